package integration

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// TestSubscriptionNamesThatCannotRoundTrip: a subscription's id and stream
// root go into its document and its answers as JSON strings, and its id
// into the callback_url a webhook receiver calls back. An id that is not
// UTF-8 came back as U+FFFD (so the callback named another subscription),
// "." and ".." are dot segments that clients and proxies remove from a
// callback_url, a control byte has no place in a URL path, and a root that
// no stream name can start with (a dot or empty segment) made a
// subscription that could never match anything. Each create is refused
// with 400 INVALID_REQUEST and writes no document.
func TestSubscriptionNamesThatCannotRoundTrip(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy")
	}
	e := fhStart(t, fhOptions{Directives: []string{"allow_loopback_webhooks"}, Optional: []string{"compact_interval 1h"}})
	bodies := map[string]string{
		"pull-wake": `{"type":"pull-wake","pattern":"*","wake_stream":"w"}`,
		"webhook":   `{"type":"webhook","pattern":"*","webhook":{"url":"http://127.0.0.1:9/h"}}`,
	}
	paths := []string{
		"/r/__ds/subscriptions/a%FF",      // not UTF-8
		"/r/__ds/subscriptions/%ED%A0%80", // a surrogate, not UTF-8
		"/r/__ds/subscriptions/.",
		"/r/__ds/subscriptions/%2E%2E",
		"/r/__ds/subscriptions/a%0Ab",
		"/r/__ds/subscriptions/a%7Fb",
		"/a/../__ds/subscriptions/s", // roots no stream name starts with
		"/a/./__ds/subscriptions/s",
		"//__ds/subscriptions/s",
		"/a//__ds/subscriptions/s",
		"/%FF/__ds/subscriptions/s",
		"/a%00b/__ds/subscriptions/s",
	}
	for _, typ := range []string{"pull-wake", "webhook"} {
		for _, p := range paths {
			st, v := e.subCall(http.MethodPut, p, bodies[typ])
			if st != http.StatusBadRequest || !strings.Contains(fmt.Sprint(v), "INVALID_REQUEST") {
				t.Errorf("PUT %s %s: %d %v, want 400 INVALID_REQUEST", typ, p, st, v)
			}
		}
	}
	for _, o := range e.mustList("subs/") {
		if o.Key != "subs/key" {
			t.Errorf("a subscription document was written: %s", o.Key)
		}
	}
	// A pull-wake subscription whose wake_stream no stream could ever be
	// (Durable Streams' own __ds segment) is refused, with the reason.
	for _, wake := range []string{"__ds", "w/__ds/x", "", "a//b"} {
		body := fmt.Sprintf(`{"type":"pull-wake","pattern":"*","wake_stream":%q}`, wake)
		st, v := e.subCall(http.MethodPut, "/r/__ds/subscriptions/wake", body)
		if st != http.StatusBadRequest || !strings.Contains(fmt.Sprint(v), "wake_stream") {
			t.Errorf("PUT with wake_stream %q: %d %v, want 400 naming wake_stream", wake, st, v)
		}
	}
	for _, o := range e.mustList("subs/") {
		if o.Key != "subs/key" {
			t.Errorf("a subscription document was written: %s", o.Key)
		}
	}
	// Ids and roots of every other kind are still taken.
	for _, p := range []string{"/r/__ds/subscriptions/caf%C3%A9", "/r/__ds/subscriptions/a.b", "/__ds/subscriptions/top", "/a/b/__ds/subscriptions/s-1"} {
		if st, v := e.subCall(http.MethodPut, p, bodies["pull-wake"]); st != http.StatusCreated {
			t.Errorf("PUT %s: %d %v, want 201", p, st, v)
		}
	}
}
