package integration

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/quic-go/quic-go/http3"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// feedWriteTimeout is the module's write timeout for a feed written by its
// stream's hub (defaultFeedWriteTimeout); idling past it is what an
// HTTP/2 feed must survive.
const feedWriteTimeout = 10 * time.Second

// TestHTTPS: the module behind a TLS site of Caddy's own (tls internal),
// spoken to over HTTP/2 and HTTP/3 as browsers do, on versitygw. Live reads
// work there too: an SSE feed of either protocol that got an event and
// then waits longer than the feed write timeout for the next one still
// gets it on the same response (over HTTP/2 a write deadline left armed
// resets the stream when it passes), and a long-poll wakes on an append.
func TestHTTPS(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	v := testenv.NewVersity(t)
	storage := caddytest.S3Storage(t, v, v.Endpoint)
	site := func(protocol string) string {
		return fmt.Sprintf("\t\tpicomq {\n\t\t\tstorage %q\n%s\t\t}\n", storage, protocol)
	}
	caddyfile := "{\n\tpersist_config off\n\tskip_install_trust\n\tlocal_certs\n\tauto_https disable_redirects\n}\n\n" +
		"https://127.0.0.1:{$" + caddytest.PortEnv + "} {\n\tbind 127.0.0.1\n\ttls internal\n" +
		"\thandle_path /ds/* {\n" + site("") + "\t}\n" +
		"\thandle_path /pico/* {\n" + site("\t\t\tprotocol pico\n") + "\t}\n}\n"
	c := caddytest.Start(t, caddytest.Options{Caddyfile: caddyfile, Env: caddytest.S3Env(v), ReadyTimeout: 90 * time.Second})
	base := fmt.Sprintf("https://127.0.0.1:%d", c.Port())
	roots := localCA(t, c)
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}, ForceAttemptHTTP2: true}}
	t.Cleanup(hc.CloseIdleConnections)
	h3 := &http3.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}
	t.Cleanup(func() { h3.Close() })
	hc3 := &http.Client{Transport: h3}

	// The site's certificate is issued in the background after start-up.
	var created *http.Response
	if !waitFor(30*time.Second, func() bool {
		r, err := hcDo(hc, http.MethodPut, base+"/ds/feed", "")
		if err != nil {
			return false
		}
		created = r
		return true
	}) {
		t.Fatal("no HTTPS answer within 30s")
	}
	if created.StatusCode != http.StatusCreated || created.ProtoMajor != 2 {
		t.Fatalf("create over HTTPS: %s over %s, want 201 over HTTP/2", created.Status, created.Proto)
	}
	if r, err := hcDo(hc, http.MethodPut, base+"/pico/pfeed", ""); err != nil || r.StatusCode != http.StatusCreated {
		t.Fatalf("create the Pico stream: %s", outcome(r, err))
	}

	t.Run("long-poll", func(t *testing.T) {
		if r, err := hcDo(hc, http.MethodPut, base+"/ds/poll", ""); err != nil || r.StatusCode != http.StatusCreated {
			t.Fatalf("create: %s", outcome(r, err))
		}
		got := make(chan string, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			// At the start of the empty stream, not at now: should the
			// append land before the read found the tail (the gauge
			// below counts the read from just before), it is read at
			// once rather than waited past.
			r, err := (&dsClient{base: base, hc: hc}).do(ctx, http.MethodGet, "/ds/poll", "offset=-1&live=long-poll", nil, nil)
			if err != nil {
				got <- err.Error()
				return
			}
			got <- fmt.Sprintf("%d %s", r.status, r.body)
		}()
		// Until the module has the long-poll open; a fixed pause was
		// too short on a busy machine, the HTTP/2 handshake included.
		fhWaitLongPolls(t, c.AdminAddr(), 1)
		if r, err := hcDo(hc, http.MethodPost, base+"/ds/poll", "woken"); err != nil || r.StatusCode != http.StatusNoContent {
			t.Fatalf("append: %s", outcome(r, err))
		}
		select {
		case g := <-got:
			if g != "200 woken" {
				t.Errorf("long-poll answered %q, want 200 with the append", g)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the long-poll did not wake within 10s")
		}
	})

	dsBody := func(ev sseEvent) (string, bool) { return ev.data, ev.event == "data" }
	picoBody := func(ev sseEvent) (string, bool) {
		var recs []struct {
			Body string `json:"body"`
		}
		if ev.event != "data" || json.Unmarshal([]byte(ev.data), &recs) != nil || len(recs) != 1 {
			return "", false
		}
		return recs[0].Body, true
	}
	if r, err := hcDo(hc3, http.MethodPut, base+"/ds/feed3", ""); err != nil || r.StatusCode != http.StatusCreated || r.ProtoMajor != 3 {
		t.Fatalf("create over HTTP/3: %s", outcome(r, err))
	}
	// The feeds idle side by side.
	for _, tc := range []struct {
		name, feed string
		hc         *http.Client
		proto      int // the HTTP version the feed must be served over
		appended   int // the status of an append
		body       func(ev sseEvent) (string, bool)
	}{
		{"durable-streams over HTTP/2", "/ds/feed?offset=-1&live=sse", hc, 2, http.StatusNoContent, dsBody},
		{"pico over HTTP/2", "/pico/pfeed?seq=0&live=sse", hc, 2, http.StatusOK, picoBody},
		{"durable-streams over HTTP/3", "/ds/feed3?offset=-1&live=sse", hc3, 3, http.StatusNoContent, dsBody},
	} {
		t.Run("idle SSE feed/"+tc.name, func(t *testing.T) {
			t.Parallel()
			path := strings.SplitN(tc.feed, "?", 2)[0]
			events, feedErr := openFeed(t, tc.hc, tc.proto, base+tc.feed)
			for i, body := range []string{"one", "two"} {
				if i > 0 {
					time.Sleep(feedWriteTimeout + time.Second)
				}
				if r, err := hcDo(tc.hc, http.MethodPost, base+path, body); err != nil || r.StatusCode != tc.appended {
					t.Fatalf("append %q: %s", body, outcome(r, err))
				}
				deadline := time.After(10 * time.Second)
			wait:
				for {
					select {
					case ev := <-events:
						if got, ok := tc.body(ev); ok {
							if got != body {
								t.Fatalf("data %q, want %q", got, body)
							}
							break wait
						}
					case err := <-feedErr:
						t.Fatalf("the SSE response ended before %q: %v", body, err)
					case <-deadline:
						t.Fatalf("no data event %q within 10s", body)
					}
				}
			}
		})
	}
}

// localCA is the root certificate of c's local CA (tls internal).
func localCA(t *testing.T, c *caddytest.Caddy) *x509.CertPool {
	t.Helper()
	// Caddy's data directory is XDG_DATA_HOME/caddy (see caddytest.Options).
	rootPath := filepath.Join(c.DataDir(), "data", "caddy", "pki", "authorities", "local", "root.crt")
	var pem []byte
	if !waitFor(30*time.Second, func() bool {
		var err error
		pem, err = os.ReadFile(rootPath)
		return err == nil
	}) {
		t.Fatalf("no local CA certificate at %s", rootPath)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		t.Fatalf("%s holds no certificate", rootPath)
	}
	return roots
}

// hcDo makes a request with a text/plain body and reads the response.
func hcDo(hc *http.Client, method, url, body string) (*http.Response, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, url, strings.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", textPlain)
	resp, err := hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	_, err = io.Copy(io.Discard, resp.Body)
	return resp, err
}

// outcome describes what hcDo returned.
func outcome(r *http.Response, err error) string {
	if err != nil {
		return err.Error()
	}
	return r.Status + " over " + r.Proto
}

// openFeed opens an SSE response, which must come over HTTP/proto, and
// reads its events until the test ends; errs gets why the response ended,
// if it does.
func openFeed(t *testing.T, hc *http.Client, proto int, url string) (events <-chan sseEvent, errs <-chan error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	resp, err := hc.Do(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK || resp.ProtoMajor != proto {
		resp.Body.Close()
		cancel()
		t.Fatalf("SSE %s: %s over %s, want 200 over HTTP/%d", url, resp.Status, resp.Proto, proto)
	}
	evc := make(chan sseEvent, 64)
	errc := make(chan error, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		br := bufio.NewReader(resp.Body)
		for {
			ev, err := readSSEEvent(br)
			if err != nil {
				if errors.Is(err, io.EOF) {
					err = errors.New("ended cleanly")
				}
				errc <- err
				return
			}
			select {
			case evc <- ev:
			case <-ctx.Done():
				return
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		resp.Body.Close()
		<-done
	})
	return evc, errc
}
