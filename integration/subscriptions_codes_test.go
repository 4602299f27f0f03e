package integration

import (
	"encoding/base64"
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

// TestClaimWithoutPendingWorkThroughCaddy: through Caddy on versitygw, a
// claim of a pull-wake subscription with nothing pending is 409
// NO_PENDING_WORK (as the reference server answers) and opens no
// generation; it used to open one, with a lease on no work. Once a stream
// it follows gets a record, the claim is granted.
func TestClaimWithoutPendingWorkThroughCaddy(t *testing.T) {
	e := fhStart(t, fhOptions{})
	const sub = "/v1/stream/__ds/subscriptions/p1"
	e.create("/v1/stream/wake/pool", "application/json")
	if st, v := e.subCall("PUT", sub, `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake/pool"}`); st != http.StatusCreated {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	if st, v := e.subCall("POST", sub+"/claim", `{"worker":"w1"}`); st != http.StatusConflict || errCodeOf(v) != "NO_PENDING_WORK" {
		t.Fatalf("claim with nothing pending: %d %v, want 409 NO_PENDING_WORK", st, v)
	}
	if _, v := e.subCall("GET", sub, ""); v["generation"] != 0.0 {
		t.Fatalf("after the refused claim: generation %v, want 0", v["generation"])
	}
	e.create("/v1/stream/events/a", "application/json")
	e.append("/v1/stream/events/a", "application/json", []byte(`{"n":1}`))
	if st, v := e.subCall("POST", sub+"/claim", `{"worker":"w1"}`); st != http.StatusOK || v["generation"] != 1.0 {
		t.Fatalf("claim with events/a pending: %d %v, want 200 generation 1", st, v)
	}
}

// TestControlTokenBeforeSubscriptionThroughCaddy: through Caddy on
// versitygw, with the control API behind basic_auth except the endpoints
// that carry the module's own bearer token (callback, ack, release: a
// webhook receiver has only its callback token, and the token takes the
// Authorization header), a request there without a valid token is 401
// whether the subscription exists (pull-wake or webhook) or not. It was
// 404 for an id that does not exist and 400 for a webhook subscription's
// ack and release, which told anyone past the guard which ids exist.
func TestControlTokenBeforeSubscriptionThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	guard := "\t\t@control {\n\t\t\tpath */__ds/*\n\t\t\tnot path */callback */ack */release\n\t\t}\n" +
		"\t\tbasic_auth @control {\n\t\t\treader " + readerHash + "\n\t\t}\n"
	e := picoStartGuarded(t, []string{"allow_loopback_webhooks"}, nil, guard)
	auth := []string{"Authorization", "Basic " + base64.StdEncoding.EncodeToString([]byte("reader:"+readerPassword))}
	const subs = "/ds/v1/stream/__ds/subscriptions/"
	e.create("/ds/v1/stream/wake/pool", "application/json")
	for id, cfg := range map[string]string{
		"pull": `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake/pool"}`,
		"hook": `{"type":"webhook","pattern":"orders/*","webhook":{"url":"http://127.0.0.1:9/h"}}`,
	} {
		if st, v := e.subCall("PUT", subs+id, cfg, auth...); st != http.StatusCreated {
			t.Fatalf("create subscription %s: %d %v", id, st, v)
		}
	}
	// The guard is real: the subscription itself is not for anyone.
	if st, _ := e.subCall("GET", subs+"pull", ""); st != http.StatusUnauthorized {
		t.Fatalf("GET of a subscription without credentials: %d, want 401", st)
	}
	const body = `{"wake_id":"w_x","generation":1}`
	for _, id := range []string{"pull", "hook", "none"} {
		for _, action := range []string{"callback", "ack", "release"} {
			for _, hdr := range [][]string{nil, {"Authorization", "Bearer forged.token"}} {
				if st, v := e.subCall("POST", subs+id+"/"+action, body, hdr...); st != http.StatusUnauthorized || errCodeOf(v) != "TOKEN_INVALID" {
					t.Errorf("POST %s/%s with %v: %d %v, want 401 TOKEN_INVALID", id, action, hdr, st, v)
				}
			}
		}
	}
}
