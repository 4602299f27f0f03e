package integration

import (
	"encoding/hex"
	"net/http"
	"testing"
)

// TestSubscriptionLimitThroughCaddy: through Caddy on versitygw with
// max_subscriptions 2, a third subscription under one stream root is
// refused with 403 SUBSCRIPTION_LIMIT_EXCEEDED, while re-confirming
// one, another root, and a create after a delete go through; after a
// restart the subscriptions loaded from the bucket count, and a refused
// one leaves no document.
func TestSubscriptionLimitThroughCaddy(t *testing.T) {
	e := fhStart(t, fhOptions{Directives: []string{"max_subscriptions 2"}})
	put := func(id, root string) (string, string, string) {
		return http.MethodPut, root + "__ds/subscriptions/" + id, `{"type":"pull-wake","pattern":"**","wake_stream":"wake"}`
	}
	type step struct {
		method, path, body string
	}
	run := func(steps []step, want []int) {
		t.Helper()
		for i, s := range steps {
			st, v := e.subCall(s.method, s.path, s.body)
			code := errCodeOf(v)
			if st != want[i] || (st == http.StatusForbidden) != (code == "SUBSCRIPTION_LIMIT_EXCEEDED") {
				t.Errorf("%s %s: %d %v, want %d", s.method, s.path, st, v, want[i])
			}
		}
	}
	var steps []step
	add := func(method, path, body string) { steps = append(steps, step{method, path, body}) }
	add(put("a", "/v1/stream/"))
	add(put("b", "/v1/stream/"))
	add(put("c", "/v1/stream/"))
	add(put("a", "/v1/stream/"))
	add(put("c", "/v2/"))
	add(http.MethodDelete, "/v1/stream/__ds/subscriptions/b", "")
	add(put("c", "/v1/stream/"))
	run(steps, []int{201, 201, 403, 200, 201, 204, 201})

	e.caddy.Restart()
	steps = nil
	add(put("d", "/v1/stream/"))
	add(put("d", "/v2/"))
	run(steps, []int{403, 201})

	// Documents are keyed by hex root and hex id.
	refused := "subs/" + hex.EncodeToString([]byte("/v1/stream/")) + "/" + hex.EncodeToString([]byte("d"))
	for _, o := range e.mustList("subs/") {
		if o.Key == refused {
			t.Errorf("the refused subscription left a document: %v", o)
		}
	}
}
