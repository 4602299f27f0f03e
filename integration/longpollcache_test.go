package integration

import (
	"net/http"
	"testing"
	"time"
)

// TestLongPollAtNowIsNotCached: through Caddy on versitygw, a long-poll at
// offset=now that an append wakes answers 200 with Cache-Control no-store
// and no ETag: "now" is the tail, which moves, and a CDN that kept the
// answer would give every later subscriber polling the same URL records
// from before it asked. It used to answer public, max-age=60. A long-poll
// at the tail's own offset stays cacheable, as section 10.1 allows.
func TestLongPollAtNowIsNotCached(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"long_poll_timeout 30s"}})
	const path, ct = "/longpoll/now", "text/plain"
	e.create(path, ct)
	for _, tc := range []struct {
		offset, cacheControl string // offset "tail": the tail's own offset
		etag                 bool
	}{
		{"now", "no-store", false},
		{"tail", "public, max-age=60, stale-while-revalidate=300", true},
	} {
		if tc.offset == "tail" {
			tc.offset = e.must(fhReq{Method: http.MethodHead, Path: path}).Header.Get("Stream-Next-Offset")
		}
		type result struct {
			resp fhResp
			err  error
		}
		done := make(chan result, 1)
		go func() {
			resp, err := e.send(fhReq{Method: http.MethodGet, Path: path + "?live=long-poll&offset=" + tc.offset})
			done <- result{resp, err}
		}()
		// Append until the long-poll answers: an append that lands before
		// it reads the tail leaves it waiting for the next one.
		var res *result
		for i := 0; res == nil; i++ {
			if i == 100 {
				t.Fatalf("offset=%s: the long-poll did not answer 100 appends", tc.offset)
			}
			e.append(path, ct, []byte("x"))
			select {
			case r := <-done:
				res = &r
			case <-time.After(100 * time.Millisecond):
			}
		}
		if res.err != nil {
			t.Fatalf("offset=%s: %v", tc.offset, res.err)
		}
		resp := res.resp
		if resp.Status != http.StatusOK || string(resp.Body) == "" {
			t.Fatalf("offset=%s: %s, want 200 with data", tc.offset, resp)
		}
		if got := resp.Header.Get("Cache-Control"); got != tc.cacheControl {
			t.Errorf("offset=%s: Cache-Control %q, want %q", tc.offset, got, tc.cacheControl)
		}
		if got := resp.Header.Get("ETag"); (got != "") != tc.etag {
			t.Errorf("offset=%s: ETag %q, want one: %v", tc.offset, got, tc.etag)
		}
	}
}
