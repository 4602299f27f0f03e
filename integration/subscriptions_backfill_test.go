package integration

import (
	"net/http"
	"testing"
)

// TestPatternBackfillFindsTheStreamItNames: through Caddy on versitygw, a
// subscription whose pattern can match a stream by its literal segments
// alone (no wildcard, or a trailing "**", which matches no segment too)
// links that existing stream when it is created, as section 6.2's backfill
// requires. The backfill listed under "events/a/" and missed "events/a".
func TestPatternBackfillFindsTheStreamItNames(t *testing.T) {
	e := fhStart(t, fhOptions{})
	e.create("/v1/stream/wake/pool", "application/json")
	e.create("/v1/stream/events/a", "application/json")
	for i, pattern := range []string{"events/a", "events/a/**", "events/*"} {
		sub := "/v1/stream/__ds/subscriptions/p" + string(rune('0'+i))
		st, v := e.subCall("PUT", sub, `{"type":"pull-wake","pattern":"`+pattern+`","wake_stream":"wake/pool"}`)
		if st != http.StatusCreated {
			t.Fatalf("create subscription with pattern %q: %d %v", pattern, st, v)
		}
		streams, _ := v["streams"].([]any)
		if len(streams) != 1 || streams[0].(map[string]any)["path"] != "events/a" {
			t.Errorf("pattern %q backfilled %v, want the stream events/a", pattern, v["streams"])
		}
	}
}
