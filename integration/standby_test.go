package integration

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestStandbyTakesOverWhenTheNodeStops: a second node (another node id)
// started on a storage that a running node holds does not fail its start:
// it answers 503 naming the holder, and once the first node stops (and
// gives the lease back) it takes the storage over by itself, with every
// acknowledged append. Before, its "caddy run" failed with "storage is in
// use by another PicoMQ node", and it had to be started again by hand
// after the first node was gone.
func TestStandbyTakesOverWhenTheNodeStops(t *testing.T) {
	v := testenv.NewVersity(t)
	p := newProxy(t, v)
	bucket := v.NewBucket(t)
	cfg := retryCaddyfile(testenv.StoreURL(p.URL(), bucket, caddytest.S3Prefix))
	first := caddytest.Start(t, caddytest.Options{Caddyfile: cfg, Env: caddytest.S3Env(v)})
	a := &fhEnv{t: t, v: v, proxy: p, bucket: bucket, caddy: first, client: &http.Client{Timeout: time.Minute}}
	const name = "/ds/standby/s"
	a.create(name, textPlain)
	var want []byte
	for i := range 20 {
		b := []byte{byte('a' + i)}
		a.append(name, textPlain, b)
		want = append(want, b...)
	}

	second, err := caddytest.Launch(t, caddytest.Options{Caddyfile: cfg, Env: caddytest.S3Env(v), ReadyTimeout: 90 * time.Second})
	if err != nil {
		t.Fatalf("a second node on a storage another node holds did not start: %v", err)
	}
	b := &fhEnv{t: t, v: v, proxy: p, bucket: bucket, caddy: second, client: &http.Client{Timeout: time.Minute}}
	r := b.must(fhReq{Method: http.MethodGet, Path: name + "?offset=-1"})
	if r.Status != http.StatusServiceUnavailable || !strings.Contains(string(r.Body), "in use by another PicoMQ node") ||
		r.Header.Get("Retry-After") == "" {
		t.Errorf("read on the standby while the first node runs: %s, want 503 naming the holder", r)
	}
	// The first node goes on serving meanwhile.
	a.append(name, textPlain, []byte("!"))
	want = append(want, '!')

	if err := first.Stop(); err != nil {
		t.Fatalf("stopping the first node: %v", err)
	}
	stopped := time.Now()
	got, took := waitOpen(t, b, fhReq{Method: http.MethodGet, Path: name + "?offset=-1"})
	if got.Status != http.StatusOK || string(got.Body) != string(want) {
		t.Fatalf("read on the standby %v after the first node stopped: %s, want 200 %q", took, got, want)
	}
	t.Logf("the standby took the storage over %v after the first node stopped", time.Since(stopped).Round(time.Millisecond))
	b.append(name, textPlain, []byte("?"))
	if body, _, err := b.readBytes(name); err != nil || string(body) != string(want)+"?" {
		t.Errorf("after an append on the standby the stream reads %q (%v)", body, err)
	}
	if !strings.Contains(second.Logs(), "storage opened after another node let go of it") {
		t.Errorf("the standby's log does not say it took the storage over")
	}
}
