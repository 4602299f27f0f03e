package integration

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestPicoMatchSeqJudgedOnDurableTail: an append with Pico-Match-Seq is
// judged against the tail readers are shown, the durable one. While an
// append ahead of it is on its way to the WAL (its upload held at the
// proxy), one naming the tail a HEAD shows must not be refused with a
// tail no read shows: the append ahead may yet fail (a crash, a store
// that does not take it), and then the stream is where the client said
// and that 412 named a tail that never was. It waits for the append
// ahead instead, and once that lands it is refused with the tail that
// now is, having written nothing. The crash torture found the 412 naming
// a tail that a kill then took back.
func TestPicoMatchSeqJudgedOnDurableTail(t *testing.T) {
	e := picoStart(t, []string{"flush_interval 5ms"}, nil)
	const path = "/pico/match"
	picoWant(t, "create", picoDo(e, http.MethodPut, path, nil, "Content-Type", "text/plain"), http.StatusCreated)
	picoWant(t, "first append", picoDo(e, http.MethodPost, path, []byte("a"), "Content-Type", "text/plain"), http.StatusOK,
		"Pico-Next-Seq", "1")

	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Times: 1})
	defer release()
	ahead := make(chan fhResp, 1)
	go func() { ahead <- picoDo(e, http.MethodPost, path, []byte("b"), "Content-Type", "text/plain") }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := e.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("the append's WAL upload never came: %v", err)
	}
	picoWant(t, "HEAD with the append ahead in flight", picoDo(e, http.MethodHead, path, nil), http.StatusOK, "Pico-Next-Seq", "1")

	matched := make(chan fhResp, 1)
	go func() {
		matched <- picoDo(e, http.MethodPost, path, []byte("c"), "Content-Type", "text/plain", "Pico-Match-Seq", "1")
	}()
	select {
	case r := <-matched:
		t.Fatalf("Pico-Match-Seq 1 answered %s (Pico-Next-Seq %q) while HEAD shows tail 1 and the append ahead is not durable",
			r, r.Header.Get("Pico-Next-Seq"))
	case <-time.After(time.Second):
	}

	release()
	picoWant(t, "the append ahead", <-ahead, http.StatusOK, "Pico-Next-Seq", "2")
	var r fhResp
	select {
	case r = <-matched:
	case <-time.After(20 * time.Second):
		t.Fatal("Pico-Match-Seq 1 still unanswered 20s after the append ahead landed")
	}
	picoWantError(t, "Pico-Match-Seq 1 after the append ahead landed", r, http.StatusPreconditionFailed, "match_failed")
	var body struct {
		NextSeq uint64 `json:"next_seq"`
	}
	if err := json.Unmarshal(r.Body, &body); err != nil || body.NextSeq != 2 || r.Header.Get("Pico-Next-Seq") != "2" {
		t.Errorf("412 names next_seq %d, Pico-Next-Seq %q (%v), want 2", body.NextSeq, r.Header.Get("Pico-Next-Seq"), err)
	}
	recs := picoRecords(t, picoDo(e, http.MethodGet, path+"?seq=0", nil))
	if len(recs) != 2 || string(recs[0].data(t)) != "a" || string(recs[1].data(t)) != "b" {
		t.Errorf("records %+v, want a and b only", recs)
	}
}
