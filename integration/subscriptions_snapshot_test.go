package integration

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"
)

// TestWebhookDoneAfterTheLinkWasReplaced: through Caddy on versitygw, a
// webhook's {"done": true} acks the tails its wake offered, but not of a
// link that was removed while that wake was out and added again since,
// in another stream under the name. The wake offered events/a at seq 3;
// meanwhile the link was removed, the stream deleted and created anew, and
// linked again at its tail, 0. The done moved the new link's cursor to 3,
// beyond the new stream's tail: its first three records woke nobody and
// were never offered.
func TestWebhookDoneAfterTheLinkWasReplaced(t *testing.T) {
	release := make(chan struct{})
	var mu sync.Mutex
	var deliveries []map[string]any
	arrived := make(chan struct{}, 16)
	recv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		b, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(b, &body)
		mu.Lock()
		deliveries = append(deliveries, body)
		n := len(deliveries)
		mu.Unlock()
		arrived <- struct{}{}
		if n > 1 {
			io.WriteString(w, `{}`)
			return
		}
		// The first wake stays out until the link has been replaced (the
		// server gives a delivery 10 s).
		select {
		case <-release:
		case <-time.After(8 * time.Second):
		}
		io.WriteString(w, `{"done":true}`)
	}))
	defer recv.Close()
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()

	e := fhStart(t, fhOptions{Directives: []string{"allow_loopback_webhooks"}})
	const sub = "/r/__ds/subscriptions/h"
	e.create("/r/events/a", "application/json")
	if st, v := e.subCall(http.MethodPut, sub, `{"type":"webhook","streams":["events/a"],"webhook":{"url":"`+recv.URL+`/h"},"lease_ttl_ms":600000}`); st != http.StatusCreated {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	e.append("/r/events/a", "application/json", []byte(`[{"n":1},{"n":2},{"n":3}]`))
	select {
	case <-arrived:
	case <-time.After(15 * time.Second):
		t.Fatal("no webhook delivery after the append")
	}
	mu.Lock()
	first := deliveries[0]
	mu.Unlock()
	if s, _ := first["streams"].([]any); len(s) != 1 || s[0].(map[string]any)["tail_offset"] != subOffset(3) {
		t.Fatalf("first delivery: %v, want events/a with tail %s", first, subOffset(3))
	}

	// While the wake is out: the link goes, the stream is replaced, and
	// the new stream is linked at its tail.
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
	close(release)

	// The webhook's done ends the wake, and the new stream's record is
	// offered from the stream's start, whether it came before the done or
	// after.
	e.append("/r/events/a", "application/json", []byte(`[{"n":1}]`))
	if err := fhWaitFor(15*time.Second, 20*time.Millisecond, func() error {
		mu.Lock()
		defer mu.Unlock()
		for _, d := range deliveries[1:] {
			s, _ := d["streams"].([]any)
			if len(s) == 1 && s[0].(map[string]any)["tail_offset"] == subOffset(1) && s[0].(map[string]any)["acked_offset"] == subOffset(0) {
				return nil
			}
		}
		return fmt.Errorf("deliveries %v", deliveries)
	}); err != nil {
		_, v := e.subCall(http.MethodGet, sub, "")
		t.Fatalf("the new stream's record was not offered: %v; subscription %v", err, v)
	}
}
