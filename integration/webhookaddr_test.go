package integration

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// TestWebhookURLsThatReachPrivateNetworks: a webhook URL whose address is
// no public one, written in a form that embeds or translates to another
// address (NAT64, 6to4, Teredo, IPv4-compatible IPv6) or in a range that is
// special-purpose though none of RFC 1918's (benchmarking, IETF protocol
// assignments, reserved), is refused at create with WEBHOOK_URL_REJECTED
// and no subscription document, however loopback webhooks are set. NAT64's
// well-known prefix (64:ff9b::/96) reaches any IPv4 address behind a NAT64
// gateway, private ones included (64:ff9b::a00:5 is 10.0.0.5).
func TestWebhookURLsThatReachPrivateNetworks(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy")
	}
	for _, loopback := range []bool{false, true} {
		t.Run(fmt.Sprintf("allow_loopback_webhooks=%v", loopback), func(t *testing.T) {
			var dirs []string
			if loopback {
				dirs = []string{"allow_loopback_webhooks"}
			}
			e := fhStart(t, fhOptions{Directives: dirs, Optional: []string{"compact_interval 1h"}})
			e.create("/wh/s", textPlain)
			urls := []string{
				"https://[64:ff9b::a00:5]/hook",    // NAT64 of 10.0.0.5
				"https://[64:ff9b::7f00:1]/hook",   // NAT64 of 127.0.0.1
				"https://[64:ff9b:1::a00:5]/hook",  // local-use NAT64 prefix
				"https://[2002:a00:5::1]/hook",     // 6to4 of 10.0.0.5
				"https://[2001:0:a00:5::1]/hook",   // Teredo
				"https://[::a00:5]/hook",           // IPv4-compatible IPv6
				"https://[2001:db8::1]/hook",       // documentation
				"https://198.18.0.1/hook",          // benchmarking
				"https://192.0.0.8/hook",           // IETF protocol assignments
				"https://240.0.0.1/hook",           // reserved
				"https://255.255.255.255/hook",     // limited broadcast
				"https://[::ffff:198.18.0.1]/hook", // IPv4-mapped form of one above
			}
			for i, u := range urls {
				id := fmt.Sprintf("h%d", i)
				path := "/wh/__ds/subscriptions/" + id
				st, v := e.subCall(http.MethodPut, path, `{"type":"webhook","pattern":"*","webhook":{"url":"`+u+`"}}`)
				if st != http.StatusBadRequest || !strings.Contains(fmt.Sprint(v), "WEBHOOK_URL_REJECTED") {
					b, _ := json.Marshal(v)
					t.Errorf("PUT webhook %s: %d %s, want 400 WEBHOOK_URL_REJECTED", u, st, fhClip(string(b), 200))
				}
				if st, _ := e.subCall(http.MethodGet, path, ""); st != http.StatusNotFound {
					t.Errorf("GET the subscription of %s after its create: %d, want 404", u, st)
				}
			}
			for _, o := range e.mustList("subs/") {
				if o.Key != "subs/key" {
					t.Errorf("a subscription document was written: %s", o.Key)
				}
			}
			// A public address is still taken.
			if st, v := e.subCall(http.MethodPut, "/wh/__ds/subscriptions/ok", `{"type":"webhook","pattern":"*","webhook":{"url":"https://[2606:4700::1]/hook"}}`); st != http.StatusCreated {
				t.Errorf("PUT a webhook to a public IPv6 address: %d %v", st, v)
			}
		})
	}
}
