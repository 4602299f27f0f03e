package integration

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"
)

// hookRecorder is a webhook receiver that keeps the generation of every
// delivery, by path, and answers each path as its script says: the first
// answers, in order, then the last one for good.
type hookRecorder struct {
	mu     sync.Mutex
	gens   map[string][]int
	script map[string][]string // "500", or a body to answer 200 with
}

func (h *hookRecorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Generation int `json:"generation"`
	}
	b, _ := io.ReadAll(r.Body)
	_ = json.Unmarshal(b, &body)
	h.mu.Lock()
	h.gens[r.URL.Path] = append(h.gens[r.URL.Path], body.Generation)
	answers := h.script[r.URL.Path]
	answer := answers[min(len(h.gens[r.URL.Path]), len(answers))-1]
	h.mu.Unlock()
	if answer == "500" {
		http.Error(w, "not now", http.StatusInternalServerError)
		return
	}
	io.WriteString(w, answer)
}

// generations returns the generations delivered to path so far.
func (h *hookRecorder) generations(path string) []int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]int(nil), h.gens[path]...)
}

// TestSubscriptionTimersThroughCaddy: what the subscription manager's
// tick does at its time, through Caddy on versitygw: a pull-wake lease
// that runs out (after a heartbeat, or with none) fences its worker and
// wakes the subscription again; a webhook delivery that failed is retried and its
// done acks the records; a webhook wake whose lease runs out without a
// callback is delivered again in a new generation. The tick used to find
// these by looking at every subscription; it now takes them from a heap
// by their time, which every change of that time must keep up to date.
func TestSubscriptionTimersThroughCaddy(t *testing.T) {
	hooks := &hookRecorder{gens: map[string][]int{}, script: map[string][]string{
		"/retry": {"500", `{"done":true}`},
		"/slow":  {`{}`}, // accepted, never called back
	}}
	recv := httptest.NewServer(hooks)
	defer recv.Close()
	e := fhStart(t, fhOptions{Directives: []string{"allow_loopback_webhooks"}})
	const wake, pull = "/r/wake", "/r/__ds/subscriptions/pull"
	e.create(wake, "application/json")
	for id, cfg := range map[string]string{
		"pull":  `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake","lease_ttl_ms":3000}`,
		"retry": `{"type":"webhook","pattern":"events/*","webhook":{"url":"` + recv.URL + `/retry"},"lease_ttl_ms":600000}`,
		"slow":  `{"type":"webhook","pattern":"events/*","webhook":{"url":"` + recv.URL + `/slow"},"lease_ttl_ms":1000}`,
	} {
		if st, v := e.subCall("PUT", "/r/__ds/subscriptions/"+id, cfg); st != http.StatusCreated {
			t.Fatalf("create subscription %s: %d %v", id, st, v)
		}
	}
	e.create("/r/events/a", "application/json")
	tail := e.append("/r/events/a", "application/json", []byte(`{"n":1}`))

	// The pull-wake: claimed, kept by a heartbeat, then left to run out
	// (its lease is 3 s, so that the heartbeat comes within it however
	// slow the writes of the claim are).
	if err := e.waitWakes(wake, "pull", 1); err != nil {
		t.Fatalf("first wake of the pull-wake subscription: %v", err)
	}
	st, claim := e.subCall("POST", pull+"/claim", `{"worker":"w1"}`)
	if st != http.StatusOK {
		t.Fatalf("claim: %d %v", st, claim)
	}
	gen := int(claim["generation"].(float64))
	heartbeat := `{"wake_id":"` + claim["wake_id"].(string) + `","generation":` + strconv.Itoa(gen) + `}`
	bearer := "Bearer " + claim["token"].(string)
	// A heartbeat keeps the wake it names: no other wake follows it
	// (section 7.1's callback answer), so next_wake is false.
	if st, v := e.subCall("POST", pull+"/ack", heartbeat, "Authorization", bearer); st != http.StatusOK || v["next_wake"] != false {
		t.Fatalf("heartbeat: %d %v, want 200 with next_wake false", st, v)
	}
	if err := e.waitWakes(wake, "pull", 2); err != nil {
		_, v := e.subCall("GET", pull, "")
		t.Fatalf("no wake after the lease ran out: %v; subscription %v", err, v)
	}
	if st, v := e.subCall("POST", pull+"/ack", heartbeat, "Authorization", bearer); st != http.StatusConflict {
		t.Fatalf("heartbeat after the lease ran out: %d %v, want 409 FENCED", st, v)
	}
	if st, v := e.subCall("POST", pull+"/claim", `{"worker":"w2"}`); st != http.StatusOK || int(v["generation"].(float64)) != gen+1 {
		t.Fatalf("claim after the lease ran out: %d %v, want 200 in generation %d", st, v, gen+1)
	}
	// Claimed and never heard of again: its lease runs out too.
	if err := e.waitWakes(wake, "pull", 3); err != nil {
		_, v := e.subCall("GET", pull, "")
		t.Fatalf("no wake after the second claim's lease ran out: %v; subscription %v", err, v)
	}

	// The webhook whose first delivery failed: retried, and acked by its done.
	if err := fhWaitFor(15*time.Second, 20*time.Millisecond, func() error {
		_, v := e.subCall("GET", "/r/__ds/subscriptions/retry", "")
		streams, _ := v["streams"].([]any)
		if len(streams) != 1 || streams[0].(map[string]any)["acked_offset"] != tail {
			return fmt.Errorf("links %v, deliveries %v", v["streams"], hooks.generations("/retry"))
		}
		return nil
	}); err != nil {
		t.Fatalf("the failed delivery was not retried to its done: %v", err)
	}
	if got := hooks.generations("/retry"); fmt.Sprint(got) != "[1 1]" {
		t.Errorf("deliveries of the retried webhook: generations %v, want [1 1]", got)
	}

	// The webhook never called back: delivered again when its lease ran out.
	if err := fhWaitFor(15*time.Second, 20*time.Millisecond, func() error {
		if got := hooks.generations("/slow"); len(got) < 2 {
			return fmt.Errorf("deliveries %v", got)
		}
		return nil
	}); err != nil {
		t.Fatalf("no delivery after the webhook's lease ran out: %v", err)
	}
	if got := hooks.generations("/slow")[:2]; fmt.Sprint(got) != "[1 2]" {
		t.Errorf("deliveries of the webhook left without callback: generations %v, want [1 2]", got)
	}
}
