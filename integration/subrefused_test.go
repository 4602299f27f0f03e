package integration

import (
	"net/http"
	"testing"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestRefusedControlRequestsWriteNothingThroughCaddy: through Caddy on
// versitygw, on a bucket that has no subscription signing key yet, a
// control request refused on its own (a body that is not JSON, no such
// resource, a method it does not take, a create without its fields) is its
// 4xx and writes nothing, and stays its 4xx while storage refuses the
// subscription documents. Each used to wait for the subscriptions to load
// and write the key first: a 503 while storage failed, and an object
// written for a refused request.
func TestRefusedControlRequestsWriteNothingThroughCaddy(t *testing.T) {
	e := fhStart(t, fhOptions{})
	cases := []struct {
		method, path, body string
		status             int
	}{
		{"PUT", "/v1/stream/__ds/subscriptions/x", `{`, http.StatusBadRequest},
		{"POST", "/v1/stream/__ds/subscriptions/x/ack", `[`, http.StatusBadRequest},
		{"GET", "/v1/stream/__ds/bogus", "", http.StatusNotFound},
		{"PATCH", "/v1/stream/__ds/subscriptions/x", `{}`, http.StatusMethodNotAllowed},
	}
	remove := e.proxy.AddFault(testenv.Fault{KeyContains: "subs/", Status: http.StatusServiceUnavailable})
	for _, tc := range cases {
		if st, v := e.subCall(tc.method, tc.path, tc.body); st != tc.status {
			t.Errorf("with storage refusing: %s %s %q: %d %v, want %d", tc.method, tc.path, tc.body, st, v, tc.status)
		}
	}
	remove()
	cases = append(cases, struct {
		method, path, body string
		status             int
	}{"PUT", "/v1/stream/__ds/subscriptions/x", `{"type":"pull-wake"}`, http.StatusBadRequest})
	for _, tc := range cases {
		if st, v := e.subCall(tc.method, tc.path, tc.body); st != tc.status {
			t.Errorf("%s %s %q: %d %v, want %d", tc.method, tc.path, tc.body, st, v, tc.status)
		}
	}
	if _, err := e.get("subs/key"); err == nil {
		t.Error("refused requests only wrote the signing key")
	}
	if n := e.proxy.Counts().PutsUnder(fhPrefix + "subs/"); n != 0 {
		t.Errorf("%d PUTs under subs/ for refused requests only", n)
	}
}
