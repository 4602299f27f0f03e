package integration

import (
	"fmt"
	"net/http"
	"testing"
	"time"
)

// TestUnclaimedWakeAnnouncedAfterRestart: through Caddy on versitygw, a
// pull-wake whose wake was saved but whose wake event could not be
// appended (its wake stream did not exist yet) is announced after Caddy
// is killed and started again. The retry of the announcement lived in
// memory only, and the restart did not schedule one: the wake stayed in
// flight, unheard and unclaimed, for good.
func TestUnclaimedWakeAnnouncedAfterRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	const sub = "/r/__ds/subscriptions/p"
	if st, v := e.subCall("PUT", sub, `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake","lease_ttl_ms":600000}`); st != http.StatusCreated {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	e.create("/r/events/a", "application/json")
	e.append("/r/events/a", "application/json", []byte(`{"n":1}`))
	// The wake is saved before it is visible, and its event's append
	// fails: there is no wake stream.
	if err := fhWaitFor(15*time.Second, 20*time.Millisecond, func() error {
		if _, v := e.subCall("GET", sub, ""); v["generation"] != 1.0 {
			return fmt.Errorf("generation %v", v["generation"])
		}
		return nil
	}); err != nil {
		t.Fatalf("no wake: %v", err)
	}
	e.caddy.Kill()
	e.caddy.Restart()
	if err := waitServing(e.caddy, 60*time.Second); err != nil {
		t.Fatal(err)
	}
	e.create("/r/wake", "application/json")
	if err := e.waitWakes("/r/wake", "p", 1); err != nil {
		_, v := e.subCall("GET", sub, "")
		t.Fatalf("the wake in flight was not announced after the restart: %v; subscription %v", err, v)
	}
	if st, v := e.subCall("POST", sub+"/claim", `{"worker":"w1"}`); st != http.StatusOK || v["generation"] != 1.0 {
		t.Fatalf("claim of the announced wake: %d %v, want 200 generation 1", st, v)
	}
}
