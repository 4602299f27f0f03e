package integration

import (
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"
)

// TestFullPatternSubscriptionFollowsNewStreams: through Caddy on
// versitygw, a pattern subscription links the 1,000 streams it may, none
// with records pending. A new stream the pattern matches takes the place
// of one of them and its record is pending for the subscription's worker.
// It used to be refused (picomq_subscription_links_refused_total), and a
// pattern over streams never deleted stopped following new ones for good.
func TestFullPatternSubscriptionFollowsNewStreams(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	const root, links = "/v1/stream/", 1000
	sub := root + "__ds/subscriptions/rooms"
	e.create(root+"wake", "application/json")
	var wg sync.WaitGroup
	work := make(chan int)
	failed := make(chan string, links)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				path := fmt.Sprintf("%srooms/%04d", root, i)
				r, err := e.send(fhReq{Method: http.MethodPut, Path: path, Header: map[string]string{"Content-Type": "application/json"}})
				if err != nil || r.Status != http.StatusCreated {
					failed <- fmt.Sprintf("%s: %v %v", path, r, err)
				}
			}
		}()
	}
	for i := range links {
		work <- i
	}
	close(work)
	wg.Wait()
	close(failed)
	for f := range failed {
		t.Fatalf("create %s", f)
	}
	if st, v := e.subCall("PUT", sub, `{"type":"pull-wake","pattern":"rooms/*","wake_stream":"wake"}`); st != http.StatusCreated {
		t.Fatalf("create the subscription over %d streams: %d %v", links, st, v)
	}
	e.create(root+"rooms/new", "application/json")
	e.append(root+"rooms/new", "application/json", []byte(`{"hello":1}`))

	var claim map[string]any
	if err := fhWaitFor(15*time.Second, 50*time.Millisecond, func() error {
		var st int
		st, claim = e.subCall("POST", sub+"/claim", `{"worker":"w1"}`)
		if st != http.StatusOK {
			return fmt.Errorf("claim: %d %v", st, claim)
		}
		return nil
	}); err != nil {
		m, _ := mGet(e.caddy.AdminAddr())
		t.Fatalf("nothing to claim after rooms/new got a record (links refused %v): %v",
			m.sum("picomq_subscription_links_refused_total"), err)
	}
	var pending []string
	for _, x := range claim["streams"].([]any) {
		if l := x.(map[string]any); l["has_pending"] == true {
			pending = append(pending, l["path"].(string))
		}
	}
	if len(pending) != 1 || pending[0] != "rooms/new" {
		t.Fatalf("the claim has records pending on %v; want rooms/new", pending)
	}
	m, err := mGet(e.caddy.AdminAddr())
	if err != nil {
		t.Fatal(err)
	}
	if r := m.sum("picomq_subscription_links_refused_total"); r != 0 {
		t.Fatalf("picomq_subscription_links_refused_total = %v; want 0, a link having made way", r)
	}
}
