package integration

import (
	"encoding/hex"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestReadOfAnUnconfirmedCreateAnswers503: through Caddy on versitygw, a
// create with a body whose metadata write the bucket keeps failing (and
// whose metadata it cannot read back either) is a 503; a read of the stream
// meanwhile is a 503 within a few seconds, not a request held for as long
// as the bucket fails; once the bucket is back the create settles and the
// stream reads its body.
func TestReadOfAnUnconfirmedCreateAnswers503(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	const path, ct = "/settling/c", "text/plain"
	meta := hex.EncodeToString([]byte(path)) + ".m"
	removePut := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: meta, Status: http.StatusInternalServerError})
	defer removePut()
	created := make(chan fhResp, 1)
	go func() {
		created <- e.must(fhReq{Method: http.MethodPut, Path: path, Body: []byte("first"), Header: map[string]string{"Content-Type": ct}})
	}()
	// Once the metadata PUT has failed, reads of it fail too: the create
	// cannot tell whether its PUT landed, and rolls forward.
	for deadline := time.Now().Add(30 * time.Second); e.proxy.Counts().Containing(testenv.OpPut, meta) == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the create's metadata PUT never reached the proxy")
		}
	}
	removeGet := e.proxy.AddFault(testenv.Fault{Op: testenv.OpGet, KeyContains: meta, Status: http.StatusInternalServerError})
	defer removeGet()
	r := <-created
	if r.Status != http.StatusServiceUnavailable {
		t.Fatalf("create while the bucket fails its metadata: %s; want 503", r)
	}
	begun := time.Now()
	r = e.must(fhReq{Method: http.MethodGet, Path: path + "?offset=-1"})
	took := time.Since(begun)
	t.Logf("read while the create is unconfirmed: %s after %v", r, took.Round(time.Millisecond))
	if r.Status != http.StatusServiceUnavailable || took > 10*time.Second {
		t.Errorf("read while the create is unconfirmed: %s after %v; want 503 within a few seconds", r, took.Round(time.Millisecond))
	}
	removePut()
	removeGet()
	if err := fhWaitFor(30*time.Second, 200*time.Millisecond, func() error {
		r := e.must(fhReq{Method: http.MethodGet, Path: path + "?offset=-1"})
		if r.Status != http.StatusOK || string(r.Body) != "first" {
			return fmt.Errorf("read: %s", r)
		}
		return nil
	}); err != nil {
		t.Fatalf("the stream once the bucket is back: %v", err)
	}
}
