package integration

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestStreamSeqJudgedOnDurableValue: a Durable Streams append's Stream-Seq
// is judged against the last value the durable stream holds. While an
// append carrying Stream-Seq 002 is on its way to the WAL (its upload held
// at the proxy), a second append with 002 must not be refused at once: the
// first may yet fail, and then nothing holds 002 and the refusal was
// wrong. It waits for the first; once that lands it is refused, having
// written nothing. A value the durable stream has already passed is
// refused at once.
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

	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Times: 1})
	defer release()
	ahead := make(chan fhResp, 1)
	go func() { ahead <- post("b", "002") }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := e.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("the append's WAL upload never came: %v", err)
	}
	picoWant(t, "Stream-Seq 001, passed by the durable stream", post("x", "001"), http.StatusConflict)

	second := make(chan fhResp, 1)
	go func() { second <- post("c", "002") }()
	select {
	case r := <-second:
		t.Fatalf("Stream-Seq 002 answered %s while the append that holds 002 is not durable", r)
	case <-time.After(time.Second):
	}

	release()
	if r := <-ahead; r.Status/100 != 2 {
		t.Fatalf("the append ahead: %s", r)
	}
	select {
	case r := <-second:
		picoWant(t, "Stream-Seq 002 after the append holding it landed", r, http.StatusConflict)
	case <-time.After(20 * time.Second):
		t.Fatal("Stream-Seq 002 still unanswered 20s after the append ahead landed")
	}
	if got := picoDo(e, http.MethodGet, path+"?offset=-1", nil); got.Status != http.StatusOK || string(got.Body) != "ab" {
		t.Errorf("read: %s %q, want 200 \"ab\"", got, got.Body)
	}
}
