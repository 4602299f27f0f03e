package integration

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestAckOfTheOldStreamAfterALinkWasAddedAgain: through Caddy on
// versitygw, a worker's wake offered events/a at seq 3; meanwhile the link
// was removed, the stream deleted and created anew, the new stream linked
// again at its tail (0), and ten records appended to it. The worker's ack
// of events/a at 3, the old stream's offset it was offered, moved the new
// link's cursor to 3: three records of the new stream that no wake had
// offered counted as processed. It must move nothing there, as an ack for
// a link that started over during the wake does, and the next claim
// offers the new stream from its start.
func TestAckOfTheOldStreamAfterALinkWasAddedAgain(t *testing.T) {
	e := fhStart(t, fhOptions{})
	const sub = "/r/__ds/subscriptions/s"
	e.create("/r/wake", "application/json")
	e.create("/r/events/a", "application/json")
	if st, v := e.subCall(http.MethodPut, sub, `{"type":"pull-wake","streams":["events/a"],"wake_stream":"wake","lease_ttl_ms":600000}`); st != http.StatusCreated {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	e.append("/r/events/a", "application/json", []byte(`[{"n":1},{"n":2},{"n":3}]`))
	claim := func(worker string) map[string]any {
		t.Helper()
		var c map[string]any
		if err := fhWaitFor(15*time.Second, 20*time.Millisecond, func() error {
			st, v := e.subCall(http.MethodPost, sub+"/claim", `{"worker":"`+worker+`"}`)
			if st != http.StatusOK {
				return fmt.Errorf("claim: %d %v", st, v)
			}
			c = v
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return c
	}
	c := claim("w1")
	if s := c["streams"].([]any)[0].(map[string]any); s["tail_offset"] != subOffset(3) {
		t.Fatalf("claim offered %v, want events/a to %s", s, subOffset(3))
	}

	if st, v := e.subCall(http.MethodDelete, sub+"/streams/events/a", ""); st != http.StatusNoContent {
		t.Fatalf("remove events/a: %d %v", st, v)
	}
	if st, v := e.subCall(http.MethodDelete, "/r/events/a", ""); st != http.StatusNoContent {
		t.Fatalf("delete events/a: %d %v", st, v)
	}
	e.create("/r/events/a", "application/json")
	if st, v := e.subCall(http.MethodPost, sub+"/streams", `{"streams":["events/a"]}`); st != http.StatusNoContent {
		t.Fatalf("add events/a again: %d %v", st, v)
	}
	recs := make([]string, 10)
	for i := range recs {
		recs[i] = `{"m":` + strconv.Itoa(i) + `}`
	}
	e.append("/r/events/a", "application/json", []byte("["+strings.Join(recs, ",")+"]"))

	ack := `{"wake_id":"` + c["wake_id"].(string) + `","generation":` + strconv.Itoa(int(c["generation"].(float64))) +
		`,"acks":[{"stream":"events/a","offset":"` + subOffset(3) + `"}],"done":true}`
	st, v := e.subCall(http.MethodPost, sub+"/ack", ack, "Authorization", "Bearer "+c["token"].(string))
	t.Logf("ack of the old stream's offset: %d %v", st, v)
	if st != http.StatusOK {
		t.Errorf("ack of what the wake offered: %d %v, want 200 (its done ends the wake)", st, v)
	}
	next := claim("w2")
	s := next["streams"].([]any)[0].(map[string]any)
	if s["acked_offset"] != subOffset(0) || s["tail_offset"] != subOffset(10) {
		t.Errorf("next claim offers events/a %v, want acked %s tail %s: every record of the new stream",
			s, subOffset(0), subOffset(10))
	}
}
