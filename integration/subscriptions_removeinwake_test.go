package integration

import (
	"fmt"
	"net/http"
	"strconv"
	"testing"
	"time"
)

// TestAckOfALinkRemovedDuringTheWake: through Caddy on versitygw, a
// worker whose wake offered two streams acks both with done after one
// of them was removed from the subscription: the ack is 200, the other
// stream's cursor moves and the wake ends. It was 409 INVALID_OFFSET
// (the subscription no longer linked the stream), so the worker's done
// was not applied and its work waited for the lease to run out. The
// removed stream is taken only from the wake that offered it: in the
// next wake an ack of it is 409 again.
func TestAckOfALinkRemovedDuringTheWake(t *testing.T) {
	e := fhStart(t, fhOptions{})
	const sub = "/r/__ds/subscriptions/s"
	e.create("/r/wake", "application/json")
	for _, p := range []string{"/r/events/a", "/r/events/b"} {
		e.create(p, "application/json")
	}
	if st, v := e.subCall(http.MethodPut, sub, `{"type":"pull-wake","streams":["events/a","events/b"],"wake_stream":"wake","lease_ttl_ms":600000}`); st != http.StatusCreated {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	e.append("/r/events/a", "application/json", []byte(`{"n":1}`))
	e.append("/r/events/b", "application/json", []byte(`{"n":1}`))
	claim := func() map[string]any {
		t.Helper()
		var claim map[string]any
		if err := fhWaitFor(15*time.Second, 20*time.Millisecond, func() error {
			st, v := e.subCall(http.MethodPost, sub+"/claim", `{"worker":"w"}`)
			if st != http.StatusOK {
				return fmt.Errorf("claim: %d %v", st, v)
			}
			claim = v
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return claim
	}
	ack := func(claim map[string]any, body string) (int, map[string]any) {
		t.Helper()
		return e.subCall(http.MethodPost, sub+"/ack",
			`{"wake_id":"`+claim["wake_id"].(string)+`","generation":`+strconv.Itoa(int(claim["generation"].(float64)))+`,`+body+`}`,
			"Authorization", "Bearer "+claim["token"].(string))
	}
	c := claim()
	if st, v := e.subCall(http.MethodDelete, sub+"/streams/events/b", ""); st != http.StatusNoContent {
		t.Fatalf("removing events/b: %d %v", st, v)
	}
	acks := `"acks":[{"stream":"events/a","offset":"` + subOffset(1) + `"},{"stream":"events/b","offset":"` + subOffset(1) + `"}]`
	if st, v := ack(c, acks+`,"done":true`); st != http.StatusOK {
		t.Fatalf("ack with done of both streams the wake offered, events/b removed since: %d %v, want 200", st, v)
	}
	st, v := e.subCall(http.MethodGet, sub, "")
	streams, _ := v["streams"].([]any)
	if st != http.StatusOK || len(streams) != 1 {
		t.Fatalf("GET after the ack: %d %v, want events/a alone", st, v)
	}
	if a, _ := streams[0].(map[string]any); a["path"] != "events/a" || a["acked_offset"] != subOffset(1) {
		t.Fatalf("events/a after the ack: %v, want acked at %s", a, subOffset(1))
	}
	if st, v := e.subCall(http.MethodPost, sub+"/claim", `{"worker":"w2"}`); st != http.StatusConflict || errCodeOf(v) != "NO_PENDING_WORK" {
		t.Fatalf("claim after the done: %d %v, want 409 NO_PENDING_WORK (the wake ended)", st, v)
	}
	// The next wake did not offer events/b.
	e.append("/r/events/a", "application/json", []byte(`{"n":2}`))
	c = claim()
	if st, v := ack(c, `"acks":[{"stream":"events/b","offset":"`+subOffset(1)+`"}]`); st != http.StatusConflict || errCodeOf(v) != "INVALID_OFFSET" {
		t.Fatalf("ack of events/b in the next wake: %d %v, want 409 INVALID_OFFSET", st, v)
	}
}
