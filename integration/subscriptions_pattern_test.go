package integration

import (
	"net/http"
	"testing"
)

// TestPutNormalizesPatternThroughCaddy: through Caddy on versitygw, a PUT
// whose pattern differs from the subscription's only in leading or
// trailing slashes (which match the same streams) re-confirms it with 200,
// as section 6.2's hash of the normalized configuration requires; it was
// refused with 409 as another configuration.
func TestPutNormalizesPatternThroughCaddy(t *testing.T) {
	e := fhStart(t, fhOptions{})
	const sub = "/v1/stream/__ds/subscriptions/p1"
	e.create("/v1/stream/wake/pool", "application/json")
	put := func(pattern string) (int, map[string]any) {
		t.Helper()
		return e.subCall("PUT", sub, `{"type":"pull-wake","pattern":"`+pattern+`","wake_stream":"wake/pool"}`)
	}
	if st, v := put("events/*"); st != http.StatusCreated {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	for _, pattern := range []string{"/events/*", "/events/*/"} {
		if st, v := put(pattern); st != http.StatusOK || v["pattern"] != "events/*" {
			t.Errorf("PUT with pattern %q: %d %v, want 200 with pattern events/*", pattern, st, v)
		}
	}
}
