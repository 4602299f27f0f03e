package integration

import (
	"encoding/hex"
	"fmt"
	"net/http"
	"strings"
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

// TestSubscriptionDescriptionBound: a description is carried in the
// subscription's document, written again at every ack, so one over 4 KiB
// is refused with 400 and a reason, and leaves no document; one at the
// bound is kept and shown as given.
func TestSubscriptionDescriptionBound(t *testing.T) {
	e := fhStart(t, fhOptions{})
	for _, tt := range []struct {
		id   string
		size int
		want int
	}{
		{"long", 4<<10 + 1, http.StatusBadRequest},
		{"fits", 4 << 10, http.StatusCreated},
	} {
		desc := strings.Repeat("d", tt.size)
		body := `{"type":"pull-wake","pattern":"**","wake_stream":"wake","description":"` + desc + `"}`
		st, v := e.subCall(http.MethodPut, "/s/__ds/subscriptions/"+tt.id, body)
		if st != tt.want {
			t.Fatalf("%s: PUT with a description of %d bytes: %d %v, want %d", tt.id, tt.size, st, v, tt.want)
		}
		if st == http.StatusBadRequest {
			if msg, _ := v["error"].(map[string]any); !strings.Contains(fmt.Sprint(msg), "description") {
				t.Errorf("%s: the refusal does not say why: %v", tt.id, v)
			}
			continue
		}
		st, v = e.subCall(http.MethodGet, "/s/__ds/subscriptions/"+tt.id, "")
		if st != http.StatusOK || v["description"] != desc {
			t.Errorf("%s: GET %d, description of %d bytes, want the %d given", tt.id, st, len(fmt.Sprint(v["description"])), tt.size)
		}
	}
	root := "subs/" + hex.EncodeToString([]byte("/s/")) + "/"
	var kept []string
	for _, o := range e.mustList(root) {
		kept = append(kept, o.Key)
	}
	if want := root + hex.EncodeToString([]byte("fits")); len(kept) != 1 || kept[0] != want {
		t.Errorf("documents under %s: %q, want only %s", root, kept, want)
	}
}
