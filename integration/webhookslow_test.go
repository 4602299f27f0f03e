package integration

import (
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

// TestWebhookSlowerThanItsLeaseThroughCaddy: through Caddy on versitygw, a
// webhook receiver that answers only after the subscription's lease ran
// out is a failed delivery: the next wake waits out the webhook's backoff
// and the subscription shows status failed. It was woken again at once at
// every lease, one delivery a second here, status active.
func TestWebhookSlowerThanItsLeaseThroughCaddy(t *testing.T) {
	var posts atomic.Int64
	stop := make(chan struct{})
	recv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		posts.Add(1)
		select {
		case <-time.After(1500 * time.Millisecond):
		case <-stop:
		}
		http.Error(w, "too slow", http.StatusInternalServerError)
	}))
	defer recv.Close()
	defer close(stop)

	e := fhStart(t, fhOptions{Directives: []string{"allow_loopback_webhooks"}})
	const root = "/v1/stream/"
	sub := root + "__ds/subscriptions/hook"
	if st, v := e.subCall("PUT", sub, `{"type":"webhook","streams":["orders"],"lease_ttl_ms":1000,"webhook":{"url":"`+recv.URL+`/h"}}`); st != http.StatusCreated {
		t.Fatalf("create: %d %v", st, v)
	}
	e.create(root+"orders", "application/json")
	e.append(root+"orders", "application/json", []byte(`{"n":1}`))
	sawFailed := false
	for end := time.Now().Add(6 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		if _, v := e.subCall("GET", sub, ""); v["status"] == "failed" {
			sawFailed = true
		}
	}
	if got := posts.Load(); got > 4 {
		t.Errorf("%d deliveries in 6 s to a receiver slower than the 1 s lease, want 4 at most", got)
	}
	if !sawFailed {
		t.Error("status never showed the failed deliveries")
	}
}
