package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestForwardedPublicURLs: behind a load balancer that terminates TLS and
// forwards plain HTTP, the absolute URLs the module writes (a Durable
// Streams create's Location, a webhook subscription's jwks_url) follow the
// X-Forwarded-Proto and X-Forwarded-Host of a peer that the server's
// trusted_proxies names, and a fork may name its source by such a
// Location. Without trusted_proxies the same headers from the same peer are
// a client's and change nothing. Pico's Location is a path either way.
func TestForwardedPublicURLs(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	v := testenv.NewVersity(t)
	forwarded := http.Header{
		"X-Forwarded-Proto": {"https"},
		"X-Forwarded-Host":  {"streams.example.com"},
	}
	tests := []struct {
		name    string
		servers string // the global servers block
		origin  func(c *caddytest.Caddy) string
	}{
		{
			name:    "trusted",
			servers: "\tservers {\n\t\ttrusted_proxies static 127.0.0.1/8\n\t}\n",
			origin:  func(*caddytest.Caddy) string { return "https://streams.example.com" },
		},
		{
			name:   "untrusted",
			origin: func(c *caddytest.Caddy) string { return c.URL() },
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			storage := caddytest.S3Storage(t, v, v.Endpoint)
			site := func(extra string) string {
				return fmt.Sprintf("\t\tpicomq {\n\t\t\tstorage %q\n\t\t\tallow_loopback_webhooks\n%s\t\t}\n", storage, extra)
			}
			caddyfile := "{\n\tpersist_config off\n" + tt.servers + "}\n\n" +
				"http://127.0.0.1:{$" + caddytest.PortEnv + "} {\n\tbind 127.0.0.1\n" +
				"\thandle_path /ds/* {\n" + site("") + "\t}\n" +
				"\thandle_path /pico/* {\n" + site("\t\t\tprotocol pico\n") + "\t}\n}\n"
			c := caddytest.Start(t, caddytest.Options{Caddyfile: caddyfile, Env: caddytest.S3Env(v), ReadyTimeout: 90 * time.Second})
			cl := newClient(t, c.URL(), true)
			want := tt.origin(c)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()

			r, err := cl.do(ctx, http.MethodPut, "/ds/r/orders", "", forwarded, nil)
			if err != nil || r.status != http.StatusCreated {
				t.Fatalf("create: %v %v", r, err)
			}
			loc := r.header.Get("Location")
			if loc != want+"/ds/r/orders" {
				t.Errorf("Location = %q, want %q", loc, want+"/ds/r/orders")
			}

			// The Location given back names the source of a fork.
			fork := http.Header{"Stream-Forked-From": {loc}}
			for k, vs := range forwarded {
				fork[k] = vs
			}
			if r, err := cl.do(ctx, http.MethodPut, "/ds/r/copy", "", fork, nil); err != nil || r.status != http.StatusCreated {
				t.Errorf("fork from %q: %v %v", loc, r, err)
			}

			body := []byte(`{"type":"webhook","pattern":"events/*","webhook":{"url":"http://127.0.0.1:9/h"}}`)
			hdr := http.Header{"Content-Type": {"application/json"}}
			for k, vs := range forwarded {
				hdr[k] = vs
			}
			r, err = cl.do(ctx, http.MethodPut, "/ds/r/__ds/subscriptions/hook", "", hdr, body)
			if err != nil || r.status != http.StatusCreated {
				t.Fatalf("webhook subscription: %v %v", r, err)
			}
			var view struct {
				Webhook struct {
					Signing struct {
						JWKSURL string `json:"jwks_url"`
					} `json:"signing"`
				} `json:"webhook"`
			}
			if err := json.Unmarshal(r.body, &view); err != nil {
				t.Fatalf("subscription view %s: %v", r.body, err)
			}
			if got := view.Webhook.Signing.JWKSURL; got != want+"/ds/r/__ds/jwks.json" {
				t.Errorf("jwks_url = %q, want %q", got, want+"/ds/r/__ds/jwks.json")
			}

			r, err = cl.do(ctx, http.MethodPut, "/pico/orders", "", forwarded, nil)
			if err != nil || r.status != http.StatusCreated {
				t.Fatalf("Pico create: %v %v", r, err)
			}
			if got := r.header.Get("Location"); got != "/pico/orders" {
				t.Errorf("Pico Location = %q, want /pico/orders", got)
			}
		})
	}
}
