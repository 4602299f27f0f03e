package integration

import (
	"context"
	"encoding/hex"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestCreateCompletedByTheNextStart: a stream created with a body has its
// records durable in the WAL before its metadata is written. Here the
// metadata PUT's first attempt is held up on its way to the bucket and
// every retry fails, so the create is answered 5xx, and Caddy is killed.
// The next start finds the create's WAL entry without metadata and must
// write it, so the stream exists with its records; the held attempt,
// landing after that, must change nothing. Before, the start dropped the
// entry (404), and the late attempt then made the stream exist empty.
func TestCreateCompletedByTheNextStart(t *testing.T) {
	e := fhStart(t, fhOptions{Directives: []string{"s3_timeout 1s"}})
	const path = "/seeded"
	key := "streams/" + hex.EncodeToString([]byte(path)) + ".m"
	text := map[string]string{"Content-Type": "text/plain"}

	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: key, Times: 1})
	defer release()
	answered := make(chan fhResp, 1)
	go func() {
		resp, err := e.send(fhReq{Method: http.MethodPut, Path: path, Header: text, Body: []byte("seed")})
		if err != nil {
			resp = fhResp{Status: -1}
		}
		answered <- resp
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := e.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("the metadata PUT was not held: %v", err)
	}
	removeFault := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: key, Status: http.StatusServiceUnavailable})
	defer removeFault()
	select {
	case resp := <-answered:
		if resp.Status < 500 {
			t.Fatalf("PUT %s with its metadata unwritten: %s, want 5xx", path, resp)
		}
	case <-ctx.Done():
		t.Fatal("the create was not answered")
	}

	e.caddy.Kill()
	removeFault()
	e.caddy.Restart()
	if got, _, err := e.readBytes(path); err != nil || string(got) != "seed" {
		t.Fatalf("after the restart %s reads %q, %v; want %q", path, got, err, "seed")
	}

	release()
	if err := e.proxy.WaitLanded(ctx); err != nil {
		t.Fatalf("the held PUT did not land: %v", err)
	}
	if resp := e.must(fhReq{Method: http.MethodPut, Path: path, Header: text, Body: []byte("seed")}); resp.Status != http.StatusOK {
		t.Fatalf("the create repeated: %s, want 200 (the stream exists)", resp)
	}
	e.caddy.Kill()
	e.caddy.Restart()
	if got, _, err := e.readBytes(path); err != nil || string(got) != "seed" {
		t.Fatalf("after the held PUT landed and a restart %s reads %q, %v; want %q", path, got, err, "seed")
	}
}

// TestDeletedSeededStreamStaysDeleted: a stream created with a body, and
// one created again after it, are deleted before any compaction, so the
// next start meets their creates' WAL entries with no metadata in the
// bucket. Each delete wrote an entry that undoes its create: the name must
// stay deleted, and must not come back as the first stream or the second.
func TestDeletedSeededStreamStaysDeleted(t *testing.T) {
	e := fhStart(t, fhOptions{Optional: []string{"compact_interval 1h"}})
	const path = "/seeded-deleted"
	text := map[string]string{"Content-Type": "text/plain"}
	for _, body := range []string{"first", "second"} {
		if resp := e.must(fhReq{Method: http.MethodPut, Path: path, Header: text, Body: []byte(body)}); resp.Status != http.StatusCreated {
			t.Fatalf("PUT %s (%s): %s, want 201", path, body, resp)
		}
		if resp := e.must(fhReq{Method: http.MethodDelete, Path: path}); resp.Status != http.StatusNoContent {
			t.Fatalf("DELETE %s: %s, want 204", path, resp)
		}
	}
	e.caddy.Kill()
	e.caddy.Restart()
	if resp := e.must(fhReq{Method: http.MethodGet, Path: path + "?offset=-1"}); resp.Status != http.StatusNotFound {
		t.Fatalf("after the restart GET %s: %s, want 404", path, resp)
	}
	key := "streams/" + hex.EncodeToString([]byte(path)) + ".m"
	if body, err := e.get(key); err == nil && !isGrave(body) {
		t.Fatalf("the deleted stream's metadata is in the bucket again: %s", body)
	}
}
