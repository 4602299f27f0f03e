package integration

import (
	"fmt"
	"net/http"
	"testing"
)

// TestSubscriptionBackfillReadsOnlyMatches: through Caddy on versitygw,
// after a restart (no stream in memory), creating a subscription whose
// pattern's literal prefix is the whole root (**/...) lists every stream
// but reads the metadata of only those its pattern matches. It read every
// stream's: one small request cost a GET per stream in the bucket.
func TestSubscriptionBackfillReadsOnlyMatches(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	const root, n = "/v1/stream/", 30
	e.create(root+"wake/pool", "application/json")
	for i := range n {
		e.create(fmt.Sprintf("%sa/s%02d", root, i), textPlain)
	}
	e.caddy.Restart()
	metaPrefix := fhPrefix + "streams/"
	for _, tc := range []struct {
		id, pattern string
		matches     int
	}{
		{"none", "**/nomatch", 0},
		{"one", "**/s05", 1},
	} {
		before := e.proxy.Counts()
		body := `{"type":"pull-wake","pattern":"` + tc.pattern + `","wake_stream":"wake/pool"}`
		st, v := e.subCall("PUT", root+"__ds/subscriptions/"+tc.id, body)
		after := e.proxy.Counts()
		if st != http.StatusCreated {
			t.Fatalf("%s: create: %d %v", tc.id, st, v)
		}
		if links := len(v["streams"].([]any)); links != tc.matches {
			t.Errorf("%s: %d streams linked, want %d", tc.id, links, tc.matches)
		}
		// The matches, and the wake stream the create checks.
		gets := after.GetsUnder(metaPrefix) - before.GetsUnder(metaPrefix)
		if gets > tc.matches+1 {
			t.Errorf("%s: the create read %d metadata objects for %d matches among %d streams", tc.id, gets, tc.matches, n+1)
		}
	}
}
