package integration

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// TestWebhookFailureLogKeepsTheURLsSecret: a webhook URL often carries its
// receiver's secret, in its query (?token=) or its path (a Slack-style
// /services/T…/B…/XXXX), which is why the example site guards GETs of
// subscriptions. A delivery that failed to connect used to log the Go
// client's error whole, `Post "<the whole URL>": dial tcp …`, handing that
// secret to everyone who reads Caddy's log. The warning names the
// subscription, the webhook's host and the reason, and nothing of the
// URL's path or query.
func TestWebhookFailureLogKeepsTheURLsSecret(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy")
	}
	// A loopback address that refuses connections: the receiver is gone.
	gone := httptest.NewServer(http.NotFoundHandler())
	gone.Close()
	host := strings.TrimPrefix(gone.URL, "http://")
	const pathSecret, querySecret = "T0PATHSECRET", "s3cr3t-token"
	hook := gone.URL + "/services/" + pathSecret + "?token=" + querySecret

	e := fhStart(t, fhOptions{Directives: []string{"allow_loopback_webhooks"}, Optional: []string{"compact_interval 1h"}})
	const sub = "/r/__ds/subscriptions/leak"
	e.create("/r/events/a", "application/json")
	if st, v := e.subCall(http.MethodPut, sub, `{"type":"webhook","pattern":"events/*","webhook":{"url":"`+hook+`"}}`); st != http.StatusCreated {
		t.Fatalf("create the webhook subscription: %d %v", st, v)
	}
	e.append("/r/events/a", "application/json", []byte(`{"n":1}`))

	var line string
	if err := fhWaitFor(20*time.Second, 50*time.Millisecond, func() error {
		for _, l := range strings.Split(e.caddy.Logs(), "\n") {
			if strings.Contains(l, "webhook delivery failed") {
				line = l
				return nil
			}
		}
		return errors.New("no failed delivery logged")
	}); err != nil {
		t.Fatal(err)
	}
	for _, secret := range []string{querySecret, pathSecret} {
		if strings.Contains(e.caddy.Logs(), secret) {
			t.Errorf("Caddy's log holds the webhook URL's secret %q: %s", secret, line)
		}
	}
	// What the operator needs is still there: which subscription, which
	// host, and why.
	for _, want := range []string{`"id":"leak"`, host, "connection refused"} {
		if !strings.Contains(line, want) {
			t.Errorf("the failed delivery's warning does not say %q: %s", want, line)
		}
	}
}
