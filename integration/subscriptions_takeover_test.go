package integration

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestReplacedProcessDeletesNoSubscription: through Caddy on versitygw, a
// second process of the same node takes the storage over while the first
// still runs (its lease renewals held up, so its lease is valid by its
// own clock), and writes a subscription the first also has: a worker
// claims it there. A DELETE of the subscription sent to the first process
// then found a version of the document it had not written, took it for a
// write of its own whose answer was lost, and put a grave over it: it
// answered 204, and the subscription the new owner serves, with its
// claim, was gone from storage. The first process must refuse the delete
// as it refuses its other writes then (503, another server took the
// storage over), and the document must stay the new owner's.
func TestReplacedProcessDeletesNoSubscription(t *testing.T) {
	a := fhStart(t, fhOptions{})
	const sub = "/r/__ds/subscriptions/p"
	a.create("/r/wake", "application/json")
	a.create("/r/events/a", "application/json")
	if st, v := a.subCall(http.MethodPut, sub, `{"type":"pull-wake","streams":["events/a"],"wake_stream":"wake","lease_ttl_ms":600000}`); st != http.StatusCreated {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	a.append("/r/events/a", "application/json", []byte(`{"n":1}`))
	if err := a.waitWakes("/r/wake", "p", 1); err != nil {
		t.Fatalf("wake on the first process: %v", err)
	}

	releaseLease := a.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "lease"})
	defer releaseLease()
	b := launchSameNode(t, a)
	if st, v := b.subCall(http.MethodPost, sub+"/claim", `{"worker":"w1"}`); st != http.StatusOK {
		t.Fatalf("claim on the new owner: %d %v", st, v)
	}

	st, v := a.subCall(http.MethodDelete, sub, "")
	t.Logf("DELETE on the replaced process: %d %v", st, v)
	errBody, _ := v["error"].(map[string]any)
	if msg, _ := errBody["message"].(string); st != http.StatusServiceUnavailable || !strings.Contains(msg, "another server took this storage over") {
		t.Errorf("DELETE on the replaced process: %d %v, want 503 saying another server took this storage over", st, v)
	}
	doc := a.mustDoc(t, subDoc("/r/", "p"))
	var stored struct {
		Holder string `json:"holder"`
	}
	if err := json.Unmarshal([]byte(doc), &stored); err != nil || stored.Holder != "w1" {
		t.Errorf("the subscription's document after the replaced process's DELETE: %q, want the new owner's, held by w1", doc)
	}
	if st, v := b.subCall(http.MethodGet, sub, ""); st != http.StatusOK {
		t.Errorf("GET on the new owner: %d %v", st, v)
	}
}
