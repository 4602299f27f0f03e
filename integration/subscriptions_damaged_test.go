package integration

import (
	"encoding/hex"
	"net/http"
	"strings"
	"testing"
)

// TestDamagedSubscriptionDocumentThroughCaddy: through Caddy on
// versitygw, a subscription whose document in the bucket no longer decodes
// answers 500 SUBSCRIPTION_DAMAGED naming the object after a restart, is
// logged and counted in picomq_damaged_objects_total, and a create of the
// same id replaces it. It used to be skipped at the load with a warning:
// the subscription answered 404, silently gone.
func TestDamagedSubscriptionDocumentThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	const root = "/v1/stream/"
	sub := root + "__ds/subscriptions/p1"
	const body = `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake"}`
	e.create(root+"wake", "application/json")
	if st, v := e.subCall("PUT", sub, body); st != http.StatusCreated {
		t.Fatalf("create: %d %v", st, v)
	}
	if err := e.caddy.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	key := "subs/" + hex.EncodeToString([]byte(root)) + "/" + hex.EncodeToString([]byte("p1"))
	doc, err := e.get(key)
	if err != nil {
		t.Fatalf("the subscription's document %s: %v", key, err)
	}
	fhPutRaw(t, e, key, doc[:len(doc)/2])
	if err := e.caddy.TryRestart(); err != nil {
		t.Fatalf("restart: %v", err)
	}

	for range 2 {
		st, v := e.subCall("GET", sub, "")
		msg, _ := v["error"].(map[string]any)["message"].(string)
		if st != http.StatusInternalServerError || errCodeOf(v) != "SUBSCRIPTION_DAMAGED" || !strings.Contains(msg, key) {
			t.Fatalf("GET of the damaged subscription: %d %v; want 500 SUBSCRIPTION_DAMAGED naming %s", st, v, key)
		}
	}
	if n := strings.Count(e.caddy.Logs(), "subscription document damaged"); n != 1 {
		t.Errorf("%d log lines of the damaged document; want 1", n)
	}
	m, err := mGet(e.caddy.AdminAddr())
	if err != nil {
		t.Fatal(err)
	}
	if got := m.sum("picomq_damaged_objects_total"); got != 1 {
		t.Errorf("picomq_damaged_objects_total = %v; want 1", got)
	}
	if st, v := e.subCall("PUT", sub, body); st != http.StatusCreated {
		t.Fatalf("create again over the damaged document: %d %v", st, v)
	}
	if st, v := e.subCall("GET", sub, ""); st != http.StatusOK {
		t.Fatalf("GET after the create: %d %v", st, v)
	}

	// A DELETE of a damaged subscription deletes its document: it was 204
	// and deleted nothing, the subscription damaged at every start after.
	if err := e.caddy.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if doc, err = e.get(key); err != nil {
		t.Fatalf("the subscription's document %s: %v", key, err)
	}
	fhPutRaw(t, e, key, doc[:len(doc)/2])
	if err := e.caddy.TryRestart(); err != nil {
		t.Fatalf("restart: %v", err)
	}
	if st, v := e.subCall("DELETE", sub, ""); st != http.StatusNoContent {
		t.Fatalf("DELETE of the damaged subscription: %d %v", st, v)
	}
	for _, when := range []string{"after the delete", "after a restart"} {
		if st, v := e.subCall("GET", sub, ""); st != http.StatusNotFound {
			t.Errorf("GET %s: %d %v, want 404", when, st, v)
		}
		if err := e.caddy.Stop(); err != nil {
			t.Fatalf("stop: %v", err)
		}
		if err := e.caddy.TryRestart(); err != nil {
			t.Fatalf("restart: %v", err)
		}
	}
}
