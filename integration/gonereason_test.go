package integration

import (
	"net/http"
	"strings"
	"testing"
)

// TestGoneSaysWhy: a Durable Streams 410 says which of its two causes it
// is. A request to a stream deleted while forks read it (section 4.2) is
// told the stream was deleted, not about offsets it never sent; a read
// below what a trim left is told its offset is before the retained data.
// Every 410 said "stream is gone, or the offset is before its retained
// data", so an append or a DELETE was pointed at an offset, and a reader
// could not tell a deleted stream from a trimmed one.
func TestGoneSaysWhy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, nil, nil)
	const (
		deleted = "/ds/gone/deleted"
		trimmed = "/ds/gone/trimmed"
	)
	for _, p := range []string{deleted, trimmed} {
		e.create(p, textPlain)
		for _, b := range []string{"a", "b", "c"} {
			e.append(p, textPlain, []byte(b))
		}
	}
	if r := e.must(fhReq{Method: http.MethodPut, Path: "/ds/gone/fork", Header: map[string]string{"Stream-Forked-From": deleted}}); r.Status != http.StatusCreated {
		t.Fatalf("fork: %s", r)
	}
	if r := e.must(fhReq{Method: http.MethodDelete, Path: deleted}); r.Status != http.StatusNoContent {
		t.Fatalf("DELETE %s: %s", deleted, r)
	}
	if r := e.must(fhReq{Method: http.MethodPost, Path: "/pico/gone/trimmed", Header: map[string]string{"Pico-Trim-Seq": "2"}}); r.Status != http.StatusOK {
		t.Fatalf("trim: %s", r)
	}
	for _, tc := range []struct {
		name    string
		req     fhReq
		want    string
		notWant string
	}{
		{"append to a deleted stream", fhReq{Method: http.MethodPost, Path: deleted, Body: []byte("x"), Header: map[string]string{"Content-Type": textPlain}}, "deleted", "offset"},
		{"close of a deleted stream", fhReq{Method: http.MethodPost, Path: deleted, Header: map[string]string{"Stream-Closed": "true"}}, "deleted", "offset"},
		{"delete of a deleted stream", fhReq{Method: http.MethodDelete, Path: deleted}, "deleted", "offset"},
		{"read of a deleted stream", fhReq{Method: http.MethodGet, Path: deleted + "?offset=-1"}, "deleted", "offset"},
		{"read below the trim", fhReq{Method: http.MethodGet, Path: trimmed + "?offset=0000000000000001_0000000000000000"}, "trimmed", "deleted"},
		{"long-poll below the trim", fhReq{Method: http.MethodGet, Path: trimmed + "?offset=0000000000000000_0000000000000000&live=long-poll"}, "trimmed", "deleted"},
	} {
		r := e.must(tc.req)
		body := strings.ToLower(string(r.Body))
		if r.Status != http.StatusGone || !strings.Contains(body, tc.want) || strings.Contains(body, tc.notWant) {
			t.Errorf("%s: %s, want 410 saying %q (and not %q)", tc.name, r, tc.want, tc.notWant)
		}
	}
}
