package integration

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestLoopbackWebhooksStopWithTheOption: a webhook subscription to this
// machine is accepted only under allow_loopback_webhooks, and keeps its
// loopback target in its document. A reload that turns the option off
// must stop its deliveries there: they used to go on for as long as the
// subscription lived, so a development subscription kept reaching local
// services after the site was opened to the public. A reload that keeps
// the option keeps them going.
func TestLoopbackWebhooksStopWithTheOption(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy")
	}
	var delivered atomic.Int64
	recv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		delivered.Add(1)
		io.WriteString(w, `{"done":true}`)
	}))
	defer recv.Close()

	e := fhStart(t, fhOptions{Directives: []string{"allow_loopback_webhooks"}, Optional: []string{"compact_interval 1h"}})
	const sub = "/r/__ds/subscriptions/local"
	e.create("/r/events/a", "application/json")
	if st, v := e.subCall(http.MethodPut, sub, `{"type":"webhook","pattern":"events/*","webhook":{"url":"`+recv.URL+`/h"}}`); st != http.StatusCreated {
		t.Fatalf("create the webhook subscription: %d %v", st, v)
	}
	waitDelivered := func(n int64) {
		t.Helper()
		if err := fhWaitFor(20*time.Second, 20*time.Millisecond, func() error {
			if got := delivered.Load(); got < n {
				return io.ErrUnexpectedEOF
			}
			return nil
		}); err != nil {
			t.Fatalf("%d deliveries, want %d", delivered.Load(), n)
		}
	}
	e.append("/r/events/a", "application/json", []byte(`{"n":1}`))
	waitDelivered(1)

	// The same option through a reload: the old config's handler lets go
	// after the new one has taken over, and deliveries go on.
	on := e.caddy.Caddyfile()
	if err := e.reload(strings.Replace(on, "allow_loopback_webhooks", "allow_loopback_webhooks\n\t\tmax_subscriptions 999", 1)); err != nil {
		t.Fatal(err)
	}
	e.append("/r/events/a", "application/json", []byte(`{"n":2}`))
	waitDelivered(2)

	off := strings.Replace(on, "allow_loopback_webhooks", "", 1)
	if off == on {
		t.Fatal("the Caddyfile has no allow_loopback_webhooks line to remove")
	}
	if err := e.reload(off); err != nil {
		t.Fatal(err)
	}
	e.append("/r/events/a", "application/json", []byte(`{"n":3}`))
	// The delivery is tried, refused at connect, and scheduled again.
	if err := fhWaitFor(20*time.Second, 50*time.Millisecond, func() error {
		if _, v := e.subCall(http.MethodGet, sub, ""); v["status"] != "failed" {
			return io.ErrUnexpectedEOF
		}
		return nil
	}); err != nil {
		t.Errorf("the subscription never showed a failed delivery after the option was turned off (%d deliveries)", delivered.Load())
	}
	if got := delivered.Load(); got != 2 {
		t.Errorf("%d deliveries to this machine, want 2: the third came after allow_loopback_webhooks was turned off", got)
	}
	if !strings.Contains(e.caddy.Logs(), "no handler allows loopback webhooks") {
		t.Errorf("no log line says why the delivery was refused")
	}
}
