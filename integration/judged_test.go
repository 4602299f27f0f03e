package integration

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// Conditions an append carries are judged against the durable stream, the
// one reads show, not against appends still on their way to the WAL: one
// of those may yet fail, and a refusal judged on it would be wrong, or
// name a state no read showed. The tests below hold one append's WAL
// upload at the proxy and send others behind it.

// TestStreamSeqJudgedOnDurableValue: while an append carrying Stream-Seq
// 002 is on its way, a second append with 002 must not be refused at once.
// It waits for the first; once that lands it is refused, having written
// nothing. A value the durable stream has already passed is refused at
// once.
func TestStreamSeqJudgedOnDurableValue(t *testing.T) {
	e := picoStart(t, []string{"flush_interval 5ms"}, nil)
	const path = "/ds/seq/judged"
	text := []string{"Content-Type", "text/plain"}
	post := func(body, seq string) fhResp {
		return picoDo(e, http.MethodPost, path, []byte(body), append(text, "Stream-Seq", seq)...)
	}
	picoWant(t, "create", picoDo(e, http.MethodPut, path, nil, text...), http.StatusCreated)
	if r := post("a", "001"); r.Status/100 != 2 {
		t.Fatalf("first append: %s", r)
	}

	land := holdWALBehind(t, e, func() fhResp { return post("b", "002") })
	picoWant(t, "Stream-Seq 001, passed by the durable stream", post("x", "001"), http.StatusConflict)
	second := sentBehind(t, "Stream-Seq 002", func() fhResp { return post("c", "002") })
	land()
	picoWant(t, "Stream-Seq 002 after the append holding it landed", answered(t, second), http.StatusConflict)
	if got := picoDo(e, http.MethodGet, path+"?offset=-1", nil); got.Status != http.StatusOK || string(got.Body) != "ab" {
		t.Errorf("read: %s %q, want 200 \"ab\"", got, got.Body)
	}
}

// TestProducerRefusalsJudgedOnDurableState: while a producer's epoch bump
// is on its way, an append of the old epoch is not fenced yet and one of
// the new epoch that skips seqs is not yet a gap: both wait, and are
// refused, naming the durable state, once the bump lands. An epoch the
// durable stream has already fenced is refused at once, naming the
// durable epoch. So is a trim beyond every pending append, naming the
// durable tail.
func TestProducerRefusalsJudgedOnDurableState(t *testing.T) {
	e := picoStart(t, []string{"flush_interval 5ms"}, nil)
	const path = "/producer/judged"
	text := []string{"Content-Type", "text/plain"}
	produce := func(body, epoch, seq string) fhResp {
		return picoDo(e, http.MethodPost, "/ds"+path, []byte(body),
			append(text, "Producer-Id", "p", "Producer-Epoch", epoch, "Producer-Seq", seq)...)
	}
	picoWant(t, "create", picoDo(e, http.MethodPut, "/ds"+path, nil, text...), http.StatusCreated)
	if r := produce("a", "1", "0"); r.Status/100 != 2 {
		t.Fatalf("first append: %s", r)
	}

	land := holdWALBehind(t, e, func() fhResp { return produce("b", "2", "0") })
	picoWant(t, "epoch 0, fenced by the durable epoch 1", produce("x", "0", "0"), http.StatusForbidden,
		"Producer-Epoch", "1")
	trim := picoDo(e, http.MethodPost, "/pico"+path, nil, "Pico-Trim-Seq", "5")
	picoWant(t, "trim beyond every pending append", trim, http.StatusBadRequest)
	if !strings.Contains(string(trim.Body), "beyond the tail 1") {
		t.Errorf("trim beyond every pending append: %q, want it to name the durable tail 1", trim.Body)
	}
	gap := sentBehind(t, "epoch 2 seq 5", func() fhResp { return produce("y", "2", "5") })
	stale := sentBehind(t, "epoch 1 seq 1", func() fhResp { return produce("z", "1", "1") })
	land()
	picoWant(t, "epoch 2 seq 5 once epoch 2 seq 0 landed", answered(t, gap), http.StatusConflict,
		"Producer-Expected-Seq", "1", "Producer-Received-Seq", "5")
	picoWant(t, "epoch 1 seq 1 once epoch 2 landed", answered(t, stale), http.StatusForbidden,
		"Producer-Epoch", "2")
	if got := picoDo(e, http.MethodGet, "/ds"+path+"?offset=-1", nil); got.Status != http.StatusOK || string(got.Body) != "ab" {
		t.Errorf("read: %s %q, want 200 \"ab\"", got, got.Body)
	}
}

// TestPicoMatchSeqJudgedOnDurableTail: while an append ahead is on its
// way, one whose Pico-Match-Seq names the tail a HEAD shows must not be
// refused with a tail no read shows: the append ahead may yet fail (a
// crash, a store that does not take it), and then the stream is where the
// client said and that 412 named a tail that never was. It waits for the
// append ahead instead, and once that lands it is refused with the tail
// that now is, having written nothing. The crash torture found the 412
// naming a tail that a kill then took back.
func TestPicoMatchSeqJudgedOnDurableTail(t *testing.T) {
	e := picoStart(t, []string{"flush_interval 5ms"}, nil)
	const path = "/pico/match"
	text := []string{"Content-Type", "text/plain"}
	picoWant(t, "create", picoDo(e, http.MethodPut, path, nil, text...), http.StatusCreated)
	picoWant(t, "first append", picoDo(e, http.MethodPost, path, []byte("a"), text...), http.StatusOK, "Pico-Next-Seq", "1")

	land := holdWALBehind(t, e, func() fhResp { return picoDo(e, http.MethodPost, path, []byte("b"), text...) })
	picoWant(t, "HEAD with the append ahead in flight", picoDo(e, http.MethodHead, path, nil), http.StatusOK, "Pico-Next-Seq", "1")
	matched := sentBehind(t, "Pico-Match-Seq 1", func() fhResp {
		return picoDo(e, http.MethodPost, path, []byte("c"), append(text, "Pico-Match-Seq", "1")...)
	})
	land()
	r := answered(t, matched)
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

// holdWALBehind holds the next WAL upload at the proxy, sends the append
// whose upload it is, and returns once the upload is held. land lets it
// through and fails the test unless the append then succeeds.
func holdWALBehind(t *testing.T, e *fhEnv, send func() fhResp) (land func()) {
	t.Helper()
	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Times: 1})
	t.Cleanup(release)
	ahead := make(chan fhResp, 1)
	go func() { ahead <- send() }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := e.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("the append's WAL upload never came: %v", err)
	}
	return func() {
		t.Helper()
		release()
		if r := <-ahead; r.Status/100 != 2 {
			t.Fatalf("the append ahead: %s", r)
		}
	}
}

// sentBehind sends a request in the background and fails the test if it
// is answered within a second, while the append ahead is not durable.
func sentBehind(t *testing.T, what string, send func() fhResp) <-chan fhResp {
	t.Helper()
	ch := make(chan fhResp, 1)
	go func() { ch <- send() }()
	select {
	case r := <-ch:
		t.Fatalf("%s answered %s while the append ahead is not durable", what, r)
	case <-time.After(time.Second):
	}
	return ch
}

// answered waits for the answer of a request sentBehind sent.
func answered(t *testing.T, ch <-chan fhResp) fhResp {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(20 * time.Second):
		t.Fatal("still unanswered 20s after the append ahead landed")
		return fhResp{}
	}
}
