package integration

import (
	"net/http"
	"testing"
)

// TestWrongMethodIs405WithAllow: through Caddy on versitygw, a method that
// a stream or a subscription control resource does not take is 405 with an
// Allow header listing the methods it does (RFC 9110 section 15.5.6). The
// control resources used to answer 404 NOT_FOUND (the reference server
// answers 405), and the JWKS 405 without Allow; a path that names no
// control resource stays 404.
func TestWrongMethodIs405WithAllow(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	e.create("/m/s", "text/plain")
	const sub = "/m/__ds/subscriptions/s1"
	for _, tc := range []struct {
		method, path string
		status       int
		allow        string
	}{
		{"PATCH", "/m/s", 405, "GET, HEAD, PUT, POST, DELETE, OPTIONS"},
		{"OPTIONS", "/m/s", 204, "GET, HEAD, PUT, POST, DELETE, OPTIONS"},
		{"POST", "/m/__ds/jwks.json", 405, "GET, HEAD, OPTIONS"},
		{"POST", sub, 405, "GET, HEAD, PUT, DELETE, OPTIONS"},
		{"GET", sub + "/streams", 405, "POST, OPTIONS"},
		{"GET", sub + "/claim", 405, "POST, OPTIONS"},
		{"PUT", sub + "/ack", 405, "POST, OPTIONS"},
		{"GET", sub + "/callback", 405, "POST, OPTIONS"},
		{"DELETE", sub + "/release", 405, "POST, OPTIONS"},
		{"POST", sub + "/streams/m%2Fs", 405, "DELETE, OPTIONS"},
		{"POST", sub + "/nothing", 404, ""},
	} {
		resp := e.must(fhReq{Method: tc.method, Path: tc.path})
		if resp.Status != tc.status || resp.Header.Get("Allow") != tc.allow {
			t.Errorf("%s %s: %s, Allow %q; want %d, Allow %q", tc.method, tc.path, resp, resp.Header.Get("Allow"), tc.status, tc.allow)
		}
	}
	// The resources still answer the methods they list.
	if resp := e.must(fhReq{Method: http.MethodGet, Path: "/m/__ds/jwks.json"}); resp.Status != http.StatusOK {
		t.Errorf("GET jwks.json: %s", resp)
	}
	if resp := e.must(fhReq{Method: http.MethodGet, Path: sub}); resp.Status != http.StatusNotFound {
		t.Errorf("GET of a subscription never made: %s, want 404", resp)
	}
}
