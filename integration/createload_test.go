package integration

import (
	"context"
	"encoding/hex"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestCreateDuringLoadKeepsAppends: a PUT of an existing stream that is
// not in memory (here, after a restart) writes the stream's metadata
// first and finds the name taken. If an append's lookup was loading the
// stream at that moment, the append is acknowledged on the loaded stream,
// and the create must not replace it with a second copy read from the
// same metadata: that copy lacked the append, so reads lost it and the
// next append was given its offset again.
func TestCreateDuringLoadKeepsAppends(t *testing.T) {
	e := picoStart(t, []string{"flush_interval 5ms"}, nil)
	const path = "/ds/loadrace"
	text := []string{"Content-Type", "text/plain"}
	picoWant(t, "create", picoDo(e, http.MethodPut, path, nil, text...), http.StatusCreated)
	// A create without records is its metadata alone: after a restart the
	// stream is read from the bucket at its first use.
	e.caddy.Restart()

	meta := hex.EncodeToString([]byte("loadrace")) // inside the stream's metadata key
	releaseGet := e.proxy.Hold(testenv.Fault{Op: testenv.OpGet, KeyContains: meta, Times: 1})
	t.Cleanup(releaseGet)
	releasePut := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: meta, Times: 1})
	t.Cleanup(releasePut)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	appended := make(chan fhResp, 1)
	go func() { appended <- picoDo(e, http.MethodPost, path, []byte("b"), text...) }()
	if err := e.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("the append's lookup never read the stream's metadata: %v", err)
	}
	created := make(chan fhResp, 1)
	go func() { created <- picoDo(e, http.MethodPut, path, nil, text...) }()
	// Let the create reach the name while the load holds it; should it
	// come later, it finds the stream in memory and the test passes
	// without having made the race.
	time.Sleep(300 * time.Millisecond)
	releaseGet()
	if r := <-appended; r.Status != http.StatusNoContent {
		t.Fatalf("append while the create waited: %s", r)
	}
	if err := e.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("the create never wrote the stream's metadata: %v", err)
	}
	releasePut()
	picoWant(t, "create of the existing stream", <-created, http.StatusOK)

	if r := picoDo(e, http.MethodGet, path+"?offset=-1", nil); r.Status != http.StatusOK || string(r.Body) != "b" {
		t.Fatalf("read after the create: %s, want 200 \"b\", the acknowledged append", r)
	}
	picoWant(t, "the next append", picoDo(e, http.MethodPost, path, []byte("c"), text...), http.StatusNoContent)
	if r := picoDo(e, http.MethodGet, path+"?offset=-1", nil); string(r.Body) != "bc" {
		t.Fatalf("read after the next append: %s, want \"bc\"", r)
	}
}
