package integration

import (
	"net/http"
	"testing"
)

// TestSubscriptionErrorCodesThroughCaddy: through Caddy on versitygw, the
// control API answers with the reference server's error codes (its
// client's SubscriptionErrorCode; the protocol names only FENCED and
// ALREADY_CLAIMED): SUBSCRIPTION_ALREADY_EXISTS for another configuration
// under an existing id, TOKEN_INVALID for an ack or release without a
// valid bearer token. (An expired token, TOKEN_EXPIRED, needs a clock an
// hour on; the unit test TestSubscriptionErrorCodes signs one.)
func TestSubscriptionErrorCodesThroughCaddy(t *testing.T) {
	e := fhStart(t, fhOptions{})
	const sub = "/v1/stream/__ds/subscriptions/p1"
	e.create("/v1/stream/wake/pool", "application/json")
	if st, v := e.subCall("PUT", sub, `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake/pool"}`); st != http.StatusCreated {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	const body = `{"wake_id":"w_x","generation":1}`
	for _, tc := range []struct {
		name, path, body string
		hdr              []string
		status           int
		code             string
	}{
		{"other configuration", sub, `{"type":"pull-wake","pattern":"other/*","wake_stream":"wake/pool"}`, nil, http.StatusConflict, "SUBSCRIPTION_ALREADY_EXISTS"},
		{"no token", sub + "/ack", body, nil, http.StatusUnauthorized, "TOKEN_INVALID"},
		{"forged token", sub + "/release", body, []string{"Authorization", "Bearer forged.token"}, http.StatusUnauthorized, "TOKEN_INVALID"},
	} {
		method := "POST"
		if tc.path == sub {
			method = "PUT"
		}
		if st, v := e.subCall(method, tc.path, tc.body, tc.hdr...); st != tc.status || errCodeOf(v) != tc.code {
			t.Errorf("%s: %d %v, want %d %s", tc.name, st, v, tc.status, tc.code)
		}
	}
}
