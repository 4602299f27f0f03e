package integration

import (
	"bytes"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestAppendToABucketThatRefusesWritesFailsFast: a bucket that answers
// every WAL PUT 403 (a policy or a key that lost its write permission)
// will not take the upload, nor the seal that settles it, until someone
// acts. The append is answered 503 at once rather than when the append
// timeout (here over two minutes) runs out; once the bucket takes writes
// again, appends are acknowledged, and the refused one was never stored.
func TestAppendToABucketThatRefusesWritesFailsFast(t *testing.T) {
	const (
		path = "/refused/s"
		text = "text/plain"
	)
	e := fhStart(t, fhOptions{Directives: []string{"s3_timeout 30s"}, Optional: []string{"compact_interval 1h"}})
	e.create(path, text)
	e.append(path, text, []byte("kept;"))

	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Status: http.StatusForbidden})
	defer remove()
	for _, name := range []string{"the first append", "an append while the writer is stalled"} {
		began := time.Now()
		r := e.must(fhReq{Method: http.MethodPost, Path: path, Header: map[string]string{"Content-Type": text}, Body: []byte("refused;")})
		took := time.Since(began)
		if r.Status != http.StatusServiceUnavailable {
			t.Fatalf("%s to a bucket refusing WAL PUTs: %s, want 503", name, r)
		}
		// The append timeout is 2 x (3 x 30 s + backoff): an answer that
		// waited for it would take minutes.
		if took > 30*time.Second {
			t.Errorf("%s was answered 503 after %v; want it long before the append timeout", name, took.Round(time.Millisecond))
		}
		t.Logf("%s: 503 after %v", name, took.Round(time.Millisecond))
	}

	remove()
	req := fhReq{Method: http.MethodPost, Path: path, Header: map[string]string{"Content-Type": text}, Body: []byte("after;")}
	r := e.must(req)
	// The seal retried in the background lands now; until it has, the
	// writer still refuses, and a client retries the 503 as this test does.
	for deadline := time.Now().Add(30 * time.Second); r.Status == http.StatusServiceUnavailable && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
		r = e.must(req)
	}
	if r.Status/100 != 2 {
		t.Fatalf("append once the bucket takes writes again: %s, want 2xx", r)
	}
	if got, _, err := e.readBytes(path); err != nil || !bytes.Equal(got, []byte("kept;after;")) {
		t.Errorf("the stream reads %q (%v), want only the acknowledged \"kept;after;\"", got, err)
	}
}
