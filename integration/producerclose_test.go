package integration

import (
	"fmt"
	"net/http"
	"testing"
)

// TestProducerCloseOnlyOnAClosedStream: through Caddy on versitygw, a
// producer closes a stream with a close-only request. Its retry (the same
// Producer-Id, epoch and seq) is answered 204 with Stream-Closed and the
// producer echo headers, also after a restart, when the stream's state
// comes from the bucket. Any other producer tuple gets 409 with
// Stream-Closed and the final offset (section 5.2.1); it used to get 204
// without the producer headers, as if its close had applied.
func TestProducerCloseOnlyOnAClosedStream(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	const path, ct = "/producer/close", "text/plain"
	e.create(path, ct)
	prod := func(id string, seq int) map[string]string {
		return map[string]string{"Producer-Id": id, "Producer-Epoch": "0", "Producer-Seq": fmt.Sprint(seq)}
	}
	for i, b := range []string{"a", "b"} {
		h := prod("p1", i)
		h["Content-Type"] = ct
		if resp := e.must(fhReq{Method: http.MethodPost, Path: path, Header: h, Body: []byte(b)}); resp.Status != http.StatusOK {
			t.Fatalf("producer append %d: %s, want 200", i, resp)
		}
	}
	closeOnly := func(id string, seq int) fhResp {
		h := prod(id, seq)
		h["Stream-Closed"] = "true"
		return e.must(fhReq{Method: http.MethodPost, Path: path, Header: h})
	}
	tail := fmt.Sprintf("%016d_%016d", 2, 0)
	check := func(what string, resp fhResp, status int, epoch, seq string) {
		t.Helper()
		got := [...]string{resp.Header.Get("Stream-Closed"), resp.Header.Get("Stream-Next-Offset"),
			resp.Header.Get("Producer-Epoch"), resp.Header.Get("Producer-Seq")}
		want := [...]string{"true", tail, epoch, seq}
		if resp.Status != status || got != want {
			t.Errorf("%s: %s with Stream-Closed, Stream-Next-Offset, Producer-Epoch, Producer-Seq %q; want %d with %q",
				what, resp, got, status, want)
		}
	}
	check("the producer's close", closeOnly("p1", 2), http.StatusNoContent, "0", "2")
	for _, restarted := range []bool{false, true} {
		if restarted {
			e.caddy.Restart()
		}
		at := fmt.Sprintf(" (restarted: %v)", restarted)
		check("its retry"+at, closeOnly("p1", 2), http.StatusNoContent, "0", "2")
		check("the producer's next seq"+at, closeOnly("p1", 3), http.StatusConflict, "", "")
		check("another producer"+at, closeOnly("p2", 0), http.StatusConflict, "", "")
	}
	if got, _, err := e.readBytes(path); err != nil || string(got) != "ab" {
		t.Errorf("the stream reads %q (%v), want %q", got, err, "ab")
	}
}
