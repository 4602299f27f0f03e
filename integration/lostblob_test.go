package integration

import (
	"bytes"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestLostAppendLeavesNoBlob: a large append is written as a blob before
// its WAL entry. When the store refuses the WAL upload, the append is
// answered 503, the writer seals the upload's place, and the blob, which
// nothing can ever refer to, must leave the bucket instead of staying for
// the life of the stream.
func TestLostAppendLeavesNoBlob(t *testing.T) {
	const octet = "application/octet-stream"
	e := fhStart(t, fhOptions{Optional: []string{"compact_interval 1h"}})
	e.create("/lost/blob", octet)
	// 403 is not retried: the upload fails at once, the seal that follows
	// goes through.
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Status: http.StatusForbidden, Times: 1})
	defer remove()
	lost := bytes.Repeat([]byte("L"), 300<<10)
	r := e.must(fhReq{Method: http.MethodPost, Path: "/lost/blob", Header: map[string]string{"Content-Type": octet}, Body: lost})
	if r.Status != http.StatusServiceUnavailable {
		t.Fatalf("append whose WAL upload was refused: %s, want 503", r)
	}
	began := time.Now()
	for len(e.mustList("blob/")) > 0 {
		if time.Since(began) > 15*time.Second {
			t.Fatalf("15 s after the refused append its blob is still in the bucket: %v", e.mustList("blob/"))
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("the lost append's blob left the bucket %v after the 503", time.Since(began).Round(time.Millisecond))

	// The writer may still be moving to its new namespace when the blob
	// goes (CI saw it 2 ms after the 503): a client retries the 503 that
	// refuses an append meanwhile, and so does this test.
	kept := bytes.Repeat([]byte("K"), 300<<10)
	req := fhReq{Method: http.MethodPost, Path: "/lost/blob", Header: map[string]string{"Content-Type": octet}, Body: kept}
	r = e.must(req)
	for deadline := time.Now().Add(5 * time.Second); r.Status == http.StatusServiceUnavailable && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
		r = e.must(req)
	}
	if r.Status/100 != 2 {
		t.Fatalf("append after the lost one: %s, want 2xx", r)
	}
	if got := e.mustList("blob/"); len(got) != 1 {
		t.Errorf("blobs after one acknowledged large append: %v, want 1", got)
	}
	if got, _, err := e.readBytes("/lost/blob"); err != nil || !bytes.Equal(got, kept) {
		t.Errorf("the stream reads %d bytes (%v), want only the acknowledged %d", len(got), err, len(kept))
	}
}

// TestLostAppendsBlobGoesAfterAFailedDelete: when the delete of a lost
// append's blob is refused too, the next compaction deletes it, through
// Caddy on versitygw. It stayed in the bucket until the next start.
func TestLostAppendsBlobGoesAfterAFailedDelete(t *testing.T) {
	const octet = "application/octet-stream"
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s"}})
	e.create("/lost/stray", octet)
	removeDel := e.proxy.AddFault(testenv.Fault{Op: testenv.OpDelete, KeyContains: "/blob/", Status: http.StatusForbidden, Times: 1})
	defer removeDel()
	removePut := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Status: http.StatusForbidden, Times: 1})
	defer removePut()
	r := e.must(fhReq{Method: http.MethodPost, Path: "/lost/stray", Header: map[string]string{"Content-Type": octet},
		Body: bytes.Repeat([]byte("L"), 300<<10)})
	if r.Status != http.StatusServiceUnavailable {
		t.Fatalf("append whose WAL upload was refused: %s, want 503", r)
	}
	began := time.Now()
	for e.proxy.Counts().Containing(testenv.OpDelete, "/blob/") == 0 {
		if time.Since(began) > 10*time.Second {
			t.Fatal("no delete of the lost append's blob in 10 s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	for len(e.mustList("blob/")) > 0 {
		if time.Since(began) > 15*time.Second {
			t.Fatalf("15 s after its refused delete the lost append's blob is still in the bucket: %v", e.mustList("blob/"))
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("the blob left the bucket %v after the 503 (deletes of it: %d)", time.Since(began).Round(time.Millisecond),
		e.proxy.Counts().Containing(testenv.OpDelete, "/blob/"))
}
