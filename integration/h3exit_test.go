package integration

import (
	"crypto/tls"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/quic-go/quic-go/http3"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestHTTP3FeedsEndAtExit: through Caddy on versitygw, an SSE feed open
// over HTTP/3 does not hold Caddy's exit open. Caddy stops its apps in no
// set order, and the module's shutdown hook on the HTTP server covers only
// HTTP/1 and HTTP/2; a review read that an http app stopped before
// PicoMQ's would wait for the feed's reconnect interval (60 s). It does not
// (the exits here take milliseconds either way), and this keeps it so.
// Several exits, so that both orders come up.
func TestHTTP3FeedsEndAtExit(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	v := testenv.NewVersity(t)
	storage := caddytest.S3Storage(t, v, v.Endpoint)
	caddyfile := "{\n\tpersist_config off\n\tskip_install_trust\n\tlocal_certs\n\tauto_https disable_redirects\n}\n\n" +
		"https://127.0.0.1:{$" + caddytest.PortEnv + "} {\n\tbind 127.0.0.1\n\ttls internal\n" +
		fmt.Sprintf("\tpicomq {\n\t\tstorage %q\n\t}\n}\n", storage)
	c := caddytest.Start(t, caddytest.Options{Caddyfile: caddyfile, Env: caddytest.S3Env(v), ReadyTimeout: 90 * time.Second})
	base := fmt.Sprintf("https://127.0.0.1:%d", c.Port())
	roots := localCA(t, c)
	const exits = 5
	for i := range exits {
		if i > 0 {
			if err := c.TryRestart(); err != nil {
				t.Fatalf("restart %d: %v", i, err)
			}
		}
		h3 := &http3.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}
		hc3 := &http.Client{Transport: h3}
		// The site's certificate is issued in the background after the
		// first start.
		if !waitFor(30*time.Second, func() bool {
			r, err := hcDo(hc3, http.MethodPut, base+"/feed", "")
			return err == nil && (r.StatusCode == http.StatusCreated || r.StatusCode == http.StatusOK)
		}) {
			t.Fatalf("exit %d: no HTTP/3 answer within 30s", i)
		}
		events, feedErr := openFeed(t, hc3, 3, base+"/feed?offset=-1&live=sse")
		select {
		case <-events:
		case err := <-feedErr:
			t.Fatalf("exit %d: the feed ended before its first event: %v", i, err)
		case <-time.After(10 * time.Second):
			t.Fatalf("exit %d: no first event within 10s", i)
		}
		start := time.Now()
		if err := c.StopTimeout(20 * time.Second); err != nil {
			t.Fatalf("exit %d with an HTTP/3 feed open: %v", i, err)
		}
		t.Logf("exit %d with an HTTP/3 feed open took %s", i, time.Since(start).Round(time.Millisecond))
		h3.Close()
	}
}
