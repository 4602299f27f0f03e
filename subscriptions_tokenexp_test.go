package picomq

import (
	"encoding/base64"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestHeartbeatKeepsTheClaimTokenValid: a claim token carries an expiry
// (the lease plus an hour from the claim), but a worker that heartbeats
// keeps its lease for as long as it works (section 7.2: an ack without
// done extends the lease and keeps the claim active), and no answer gives
// it a new token. So a token past its expiry is still taken for the wake
// it names while that wake's lease runs; it was 401 TOKEN_EXPIRED, and a
// worker an hour and a half into a job could neither heartbeat nor ack
// what it had done. Past the lease, or for another wake, it is refused as
// before.
func TestHeartbeatKeepsTheClaimTokenValid(t *testing.T) {
	n := startSubNode(t, t.TempDir())
	const sub = "/v1/stream/__ds/subscriptions/p1"
	if st, _ := n.call(t, "PUT", "/v1/stream/wake/pool", "[]"); st != http.StatusCreated {
		t.Fatal("wake stream")
	}
	if st, v := n.call(t, "PUT", sub, `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake/pool","lease_ttl_ms":600000}`); st != http.StatusCreated {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	if st, _ := n.call(t, "PUT", "/v1/stream/events/a", `{"n":1}`); st != http.StatusCreated {
		t.Fatal("events/a")
	}
	claim := func() (token, body string) {
		t.Helper()
		var st int
		var v map[string]any
		deadline := time.Now().Add(10 * time.Second)
		for {
			if st, v = n.call(t, "POST", sub+"/claim", `{"worker":"w1"}`); st == http.StatusOK || time.Now().After(deadline) {
				break
			}
			time.Sleep(20 * time.Millisecond) // the append's note is on its way
		}
		if st != http.StatusOK {
			t.Fatalf("claim: %d %v", st, v)
		}
		return v["token"].(string), `{"wake_id":"` + v["wake_id"].(string) + `","generation":` + strconv.Itoa(int(v["generation"].(float64))) + `}`
	}
	m := n.Config.Handler.(*durableStreams).subs.cur.Load()
	// expired is tok with its expiry in the past, signed as the server
	// signs tokens.
	expired := func(tok string) string {
		t.Helper()
		p, _, _ := strings.Cut(tok, ".")
		b, err := base64.RawURLEncoding.DecodeString(p)
		if err != nil {
			t.Fatal(err)
		}
		var c tokenClaims
		if err := json.Unmarshal(b, &c); err != nil {
			t.Fatal(err)
		}
		c.Exp = time.Now().Add(-time.Minute).Unix()
		return signClaims(m, c)
	}

	tok, body := claim()
	old := expired(tok)
	if st, v := n.call(t, "POST", sub+"/ack", body, "Authorization", "Bearer "+old); st != http.StatusOK {
		t.Errorf("heartbeat with the token past its expiry, the lease running: %d %v, want 200", st, v)
	}
	if st, _ := n.call(t, "POST", sub+"/release", body, "Authorization", "Bearer "+tok); st != http.StatusNoContent {
		t.Fatalf("release: %d", st)
	}
	// The wake it named is over: refused, as an expired token.
	tok2, body2 := claim()
	if st, v := n.call(t, "POST", sub+"/ack", body2, "Authorization", "Bearer "+old); st != http.StatusUnauthorized {
		t.Errorf("heartbeat with an expired token of an earlier wake: %d %v, want 401", st, v)
	}
	if st, v := n.call(t, "POST", sub+"/ack", body2, "Authorization", "Bearer "+tok2); st != http.StatusOK {
		t.Errorf("heartbeat of the new wake: %d %v", st, v)
	}
}
