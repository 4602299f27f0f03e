package integration

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// outageCaddyfile serves both protocols on one storage: Durable Streams
// under /ds, Pico under /pico.
func outageCaddyfile(storage string) string {
	block := func(extra string) string {
		return fmt.Sprintf("\t\tpicomq {\n\t\t\tstorage %q\n%s\t\t}\n", storage, extra)
	}
	return "{\n\tpersist_config off\n}\n\nhttp://:{$" + caddytest.PortEnv + "} {\n\tbind 127.0.0.1\n" +
		"\thandle_path /ds/* {\n" + block("") + "\t}\n" +
		"\thandle_path /pico/* {\n" + block("\t\t\tprotocol pico\n") + "\t}\n" +
		"\thandle /metrics {\n\t\tmetrics\n\t}\n" +
		"\trespond /other 200 {\n\t\tbody \"another site\"\n\t}\n}\n"
}

// startBucketDown starts Caddy on outageCaddyfile with the S3 proxy in
// front of its bucket down, failing the test if Caddy does not start.
func startBucketDown(t *testing.T) *fhEnv {
	t.Helper()
	v := testenv.NewVersity(t)
	p := newProxy(t, v)
	bucket := v.NewBucket(t)
	p.Down()
	c, err := caddytest.Launch(t, caddytest.Options{
		Caddyfile:    outageCaddyfile(testenv.StoreURL(p.URL(), bucket, caddytest.S3Prefix)),
		Env:          caddytest.S3Env(v),
		ReadyTimeout: 90 * time.Second,
	})
	if err != nil {
		t.Fatalf("Caddy did not start with its bucket unreachable: %v", err)
	}
	return &fhEnv{t: t, v: v, proxy: p, bucket: bucket, caddy: c, client: &http.Client{Timeout: time.Minute}}
}

// TestStartWithBucketUnreachable: Caddy starts while its bucket cannot be
// reached (the S3 proxy in front of it is down), so its other routes
// serve, and both protocols answer 503 with the reason and a Retry-After
// at once, writing nothing. When the bucket comes back the module opens it
// by itself, and streams are created, appended to and read as usual.
// Before, "caddy run" failed within a second: an S3 outage at boot kept
// every site of that Caddy down.
func TestStartWithBucketUnreachable(t *testing.T) {
	e := startBucketDown(t)
	c, p := e.caddy, e.proxy

	if r := e.must(fhReq{Method: http.MethodGet, Path: "/other"}); r.Status != http.StatusOK {
		t.Errorf("another route while the bucket is unreachable: %s", r)
	}
	for _, req := range []fhReq{
		{Method: http.MethodPut, Path: "/ds/outage/a", Header: map[string]string{"Content-Type": "text/plain"}},
		{Method: http.MethodPost, Path: "/ds/outage/a", Header: map[string]string{"Content-Type": "text/plain"}, Body: []byte("x")},
		{Method: http.MethodGet, Path: "/ds/outage/a?offset=-1"},
		{Method: http.MethodPut, Path: "/pico/outage/b", Header: map[string]string{"Content-Type": "application/json"}},
	} {
		r := e.must(req)
		if r.Status != http.StatusServiceUnavailable || r.Header.Get("Retry-After") == "" ||
			!strings.Contains(string(r.Body), "storage is not open yet (retrying)") {
			t.Errorf("%s %s with the bucket unreachable: %s, want 503 with Retry-After and the reason", req.Method, req.Path, r)
		}
		if r.Took > 2*time.Second {
			t.Errorf("%s %s waited %v for its 503", req.Method, req.Path, r.Took)
		}
	}
	if logs := c.Logs(); !strings.Contains(logs, "storage unreachable; requests are answered 503 until it opens") {
		t.Errorf("no warning that the storage is unreachable in the log")
	}
	storageOpen := func() float64 {
		t.Helper()
		_, samples, err := siteMetrics(c.URL() + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		if !samples.has("picomq_storage_open") {
			t.Fatal("no picomq_storage_open in the metrics")
		}
		return samples.sum("picomq_storage_open")
	}
	if v := storageOpen(); v != 0 {
		t.Errorf("picomq_storage_open = %v while the bucket is unreachable, want 0", v)
	}

	up := time.Now()
	if err := p.Up(); err != nil {
		t.Fatal(err)
	}
	// Retries are a second apart at first, doubling: the first after the
	// proxy came back lands within a few seconds.
	var created fhResp
	for {
		created = e.must(fhReq{Method: http.MethodPut, Path: "/ds/outage/a", Header: map[string]string{"Content-Type": "text/plain"}})
		if created.Status != http.StatusServiceUnavailable || time.Since(up) > 30*time.Second {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if created.Status != http.StatusCreated {
		t.Fatalf("create %v after the bucket came back: %s", time.Since(up).Round(time.Millisecond), created)
	}
	t.Logf("the storage opened %v after the bucket came back", time.Since(up).Round(time.Millisecond))
	e.append("/ds/outage/a", "text/plain", []byte("after the outage"))
	if got, _, err := e.readBytes("/ds/outage/a"); err != nil || string(got) != "after the outage" {
		t.Errorf("read back = %q, %v", got, err)
	}
	if r := e.must(fhReq{Method: http.MethodPut, Path: "/pico/outage/b", Header: map[string]string{"Content-Type": "application/json"}}); r.Status != http.StatusCreated {
		t.Errorf("Pico create after the bucket came back: %s", r)
	}
	if v := storageOpen(); v != 1 {
		t.Errorf("picomq_storage_open = %v once the storage opened, want 1", v)
	}
	if !strings.Contains(c.Logs(), "storage opened after being unreachable") {
		t.Errorf("no line in the log says the storage opened after the outage")
	}
}

// TestStartRefusedFailsTheLoad: a bucket that answers but refuses (access
// denied) is for the operator to fix, so "caddy run" still fails at once
// with the reason, rather than serving 503s that hide it.
func TestStartRefusedFailsTheLoad(t *testing.T) {
	v := testenv.NewVersity(t)
	p := newProxy(t, v)
	bucket := v.NewBucket(t)
	p.AddFault(testenv.Fault{Op: testenv.OpGet, Status: http.StatusForbidden, Code: "AccessDenied"})
	began := time.Now()
	_, err := caddytest.Launch(t, caddytest.Options{
		Storage:      testenv.StoreURL(p.URL(), bucket, caddytest.S3Prefix),
		Env:          caddytest.S3Env(v),
		ReadyTimeout: 30 * time.Second,
	})
	if err == nil {
		t.Fatal("Caddy started on a bucket that refuses it")
	}
	if !strings.Contains(err.Error(), "AccessDenied") || !strings.Contains(err.Error(), "starting storage") {
		t.Errorf("the failed start does not give the reason:\n%v", err)
	}
	t.Logf("refused after %v", time.Since(began).Round(time.Millisecond))
}

// TestUnreachableStoreIsNotNamedToClients: while the start is retried, a
// client is told the store cannot be reached, not the transport's error,
// which names the store's address, bucket and prefix (the log has it, as
// it has every store failure). Once the store answers but refuses, the
// refusal's reason (here AccessDenied) is the client's answer again, as
// at a failed start. Before, every module request got the raw error, such
// as `Get "http://127.0.0.1:PORT/BUCKET/picomq/lease?x-id=GetObject": dial
// tcp 127.0.0.1:PORT: connect: connection refused`, for as long as the
// outage lasted, while the same outage after the start is answered with a
// plain "storage unavailable".
func TestUnreachableStoreIsNotNamedToClients(t *testing.T) {
	e := startBucketDown(t)
	c, p, bucket := e.caddy, e.proxy, e.bucket
	requests := []fhReq{
		{Method: http.MethodPut, Path: "/ds/named/a", Header: map[string]string{"Content-Type": "text/plain"}},
		{Method: http.MethodGet, Path: "/ds/named/a?offset=-1&live=sse"},
		{Method: http.MethodGet, Path: "/ds/__ds/jwks.json"},
		{Method: http.MethodPost, Path: "/pico/named/b", Header: map[string]string{"Content-Type": "application/json"}, Body: []byte(`{"n":1}`)},
		{Method: http.MethodGet, Path: "/pico/"},
	}
	for _, req := range requests {
		r := e.must(req)
		body := string(r.Body)
		switch {
		case r.Status != http.StatusServiceUnavailable || r.Header.Get("Retry-After") == "" ||
			!strings.Contains(body, "storage is not open yet (retrying): the object store cannot be reached"):
			t.Errorf("%s %s, bucket unreachable: %s, want 503 saying the store cannot be reached", req.Method, req.Path, r)
		case strings.Contains(body, p.Addr()) || strings.Contains(body, bucket):
			t.Errorf("%s %s, bucket unreachable: the answer names the store: %s", req.Method, req.Path, r)
		}
	}
	if logs := c.Logs(); !strings.Contains(logs, "connection refused") || !strings.Contains(logs, p.Addr()) {
		t.Errorf("the log does not give the transport's error")
	}

	// The store answers now, but refuses: that reason is for the client
	// to see, as it is at a start that fails.
	p.AddFault(testenv.Fault{Op: testenv.OpGet, KeyContains: "lease", Status: http.StatusForbidden, Code: "AccessDenied"})
	if err := p.Up(); err != nil {
		t.Fatal(err)
	}
	err := fhWaitFor(30*time.Second, 100*time.Millisecond, func() error {
		for _, req := range requests {
			if r := e.must(req); r.Status != http.StatusServiceUnavailable || !strings.Contains(string(r.Body), "AccessDenied") {
				return fmt.Errorf("%s %s: %s", req.Method, req.Path, r)
			}
		}
		return nil
	})
	if err != nil {
		t.Errorf("a store that refuses the start, want 503 with its reason: %v", err)
	}
}
