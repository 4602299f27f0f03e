package integration

import (
	"net/http"
	"testing"
	"time"
)

// TestAppendWakesTheSubscriptionsThatFollowIt: through Caddy on versitygw,
// an append wakes every subscription that follows the stream, by pattern
// from its root or from a root above it, by an explicit stream given at
// creation or added later, and none that does not: one under another root,
// one whose pattern misses, one whose explicit stream was removed. The
// manager finds them through its index (subindex.go) instead of trying
// every subscription.
func TestAppendWakesTheSubscriptionsThatFollowIt(t *testing.T) {
	e := fhStart(t, fhOptions{})
	const wake = "/v1/stream/wake/pool"
	e.create(wake, "application/json")
	e.create("/v2/wake", "application/json")
	e.create("/v1/stream/events/a", "application/json")
	subs := []struct {
		id, root, body string
		wakes          bool
	}{
		{"pattern", "/v1/stream/", `"pattern":"events/*","wake_stream":"wake/pool"`, true},
		{"explicit", "/v1/stream/", `"streams":["events/a"],"wake_stream":"wake/pool"`, true},
		{"upper-root", "/v1/", `"pattern":"stream/events/**","wake_stream":"stream/wake/pool"`, true},
		{"added", "/v1/stream/", `"streams":["x"],"wake_stream":"wake/pool"`, true},
		{"removed", "/v1/stream/", `"streams":["events/a"],"wake_stream":"wake/pool"`, false},
		{"missed", "/v1/stream/", `"pattern":"events/*/*","wake_stream":"wake/pool"`, false},
		{"other-root", "/v2/", `"pattern":"**","wake_stream":"wake"`, false},
	}
	for _, s := range subs {
		if st, v := e.subCall("PUT", s.root+"__ds/subscriptions/"+s.id, `{"type":"pull-wake",`+s.body+`}`); st != http.StatusCreated {
			t.Fatalf("create subscription %s: %d %v", s.id, st, v)
		}
	}
	if st, v := e.subCall("POST", "/v1/stream/__ds/subscriptions/added/streams", `{"streams":["events/a"]}`); st != http.StatusNoContent {
		t.Fatalf("add a stream: %d %v", st, v)
	}
	if st, v := e.subCall("DELETE", "/v1/stream/__ds/subscriptions/removed/streams/events/a", ""); st != http.StatusNoContent {
		t.Fatalf("remove a stream: %d %v", st, v)
	}
	e.append("/v1/stream/events/a", "application/json", []byte(`{"n":2}`))
	// One note of the append wakes them all at once: when the followers
	// have woken, the others would have too.
	woken := func() bool {
		for _, s := range subs {
			if s.wakes && e.wakeCount(wake, s.id) == 0 {
				return false
			}
		}
		return true
	}
	if !waitFor(30*time.Second, woken) {
		t.Fatal("the subscriptions that follow events/a were not all woken")
	}
	for _, s := range subs {
		w := wake
		if s.root == "/v2/" {
			w = "/v2/wake"
		}
		if n := e.wakeCount(w, s.id); (n > 0) != s.wakes {
			t.Errorf("subscription %s: %d wake events, want woken %v", s.id, n, s.wakes)
		}
	}
}
