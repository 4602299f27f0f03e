package integration

import (
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestSubscriptionPatternCannotSpin: a subscription pattern of many "**"
// segments that fails at its end is matched against a stream of many
// segments at the subscription's create (backfill) and at every append
// under its root. A backtracking match took exponential time there: the
// create never answered and its goroutine spun a core for good. Both must
// answer at once, and a pattern longer than any stream name is refused
// without a write.
func TestSubscriptionPatternCannotSpin(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	// A hang shows as this client's timeout, not as the test's.
	e := fhStart(t, fhOptions{Client: &http.Client{Timeout: 30 * time.Second}})
	deep := "/g/" + strings.TrimSuffix(strings.Repeat("a/", 60), "/")
	e.create(deep, textPlain)
	e.create("/g/wake", textPlain)

	jsonHdr := map[string]string{"Content-Type": "application/json"}
	spin := strings.Repeat("**/", 25) + "zz"
	r, err := e.send(fhReq{Method: http.MethodPut, Path: "/g/__ds/subscriptions/spin", Header: jsonHdr,
		Body: []byte(`{"type":"pull-wake","pattern":"` + spin + `","wake_stream":"wake"}`)})
	if err != nil {
		t.Fatalf("PUT a subscription with pattern %q: %v (after %s)", spin, err, r.Took.Round(time.Millisecond))
	}
	if r.Status != http.StatusCreated {
		t.Fatalf("PUT a subscription with pattern %q: %s, want 201", spin, r)
	}
	// The append is matched against the pattern too.
	if _, err := e.send(fhReq{Method: http.MethodPost, Path: deep, Header: map[string]string{"Content-Type": textPlain}, Body: []byte("x")}); err != nil {
		t.Fatalf("append to %s under the subscription: %v", fhClip(deep, 20), err)
	}

	long := strings.Repeat("p", 300)
	r, writes := fhExpectNoWrites(t, e, fhReq{Method: http.MethodPut, Path: "/g/__ds/subscriptions/long", Header: jsonHdr,
		Body: []byte(`{"type":"pull-wake","pattern":"` + long + `","wake_stream":"wake"}`)})
	if r.Status != http.StatusBadRequest || !fhContainsAny(string(r.Body), "pattern") {
		t.Errorf("PUT a subscription with a %d-byte pattern: %s, want 400 naming the pattern", len(long), r)
	}
	if len(writes) > 0 {
		t.Errorf("the refused subscription wrote to the object store:%s", fhSortedKeys(writes))
	}
}
