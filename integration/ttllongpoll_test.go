package integration

import (
	"fmt"
	"net/http"
	"testing"
)

// TestLongPollKeepsATTLStreamAlive: through Caddy on versitygw, a client
// long-polls a stream with Stream-TTL: 1 without pause, each long-poll
// lasting the 3 s timeout. It reads the stream all the while, and reads
// renew the TTL (section 5.5), so every long-poll ends in 204 and the
// stream still reads after them. The stream used to expire during the
// first long-poll, and the next request got 404.
func TestLongPollKeepsATTLStreamAlive(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"long_poll_timeout 3s", "expiry_sweep_interval 1s"}})
	const path = "/ttl/longpoll"
	resp := e.must(fhReq{Method: http.MethodPut, Path: path, Body: []byte("a"),
		Header: map[string]string{"Content-Type": textPlain, "Stream-TTL": "1"}})
	if resp.Status != http.StatusCreated {
		t.Fatalf("PUT %s: %s, want 201", path, resp)
	}
	tail := fmt.Sprintf("%016d_%016d", 1, 0)
	for i := range 3 {
		resp := e.must(fhReq{Method: http.MethodGet, Path: path + "?live=long-poll&offset=" + tail})
		if resp.Status != http.StatusNoContent {
			t.Fatalf("long-poll %d on a stream it kept reading: %s, want 204 at the timeout", i, resp)
		}
	}
	if resp := e.must(fhReq{Method: http.MethodGet, Path: path + "?offset=-1"}); resp.Status != http.StatusOK || string(resp.Body) != "a" {
		t.Errorf("read after the long-polls: %s, want 200 %q", resp, "a")
	}
}
