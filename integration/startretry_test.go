package integration

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// retryCaddyfile serves the module under /ds on storage, with extra
// picomq directives, beside a route of its own.
func retryCaddyfile(storage string, directives ...string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "{\n\tpersist_config off\n}\n\nhttp://:{$%s} {\n\tbind 127.0.0.1\n", caddytest.PortEnv)
	fmt.Fprintf(&b, "\thandle_path /ds/* {\n\t\tpicomq {\n\t\t\tstorage %q\n", storage)
	for _, d := range directives {
		fmt.Fprintf(&b, "\t\t\t%s\n", d)
	}
	b.WriteString("\t\t}\n\t}\n\trespond /other 200\n}\n")
	return b.String()
}

// retryGoroutines counts the goroutines of Caddy (through its admin
// endpoint) that retry a storage's start.
func retryGoroutines(t *testing.T, admin string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+admin+"/debug/pprof/goroutine?debug=2", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("goroutine dump: %v", err)
	}
	defer resp.Body.Close()
	dump, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("goroutine dump: %d %v", resp.StatusCode, err)
	}
	return bytes.Count(dump, []byte("(*engineRef).retryStart("))
}

// waitOpen sends req until it is answered with something else than 503,
// for up to a minute, and returns that answer and how long it took.
func waitOpen(t *testing.T, e *fhEnv, req fhReq) (fhResp, time.Duration) {
	t.Helper()
	began := time.Now()
	for {
		r := e.must(req)
		if r.Status != http.StatusServiceUnavailable || time.Since(began) > time.Minute {
			return r, time.Since(began)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// errorLines returns the lines of Caddy's log at level error.
func errorLines(logs string) []string {
	var out []string
	for _, l := range strings.Split(logs, "\n") {
		if strings.Contains(l, `"level":"error"`) {
			out = append(out, fhClip(l, 400))
		}
	}
	return out
}

// TestReloadWhileStartRetries: Caddy starts while its bucket cannot be
// reached and is reloaded while the start is retried in the background.
//   - The same storage with new engine settings: the reload succeeds,
//     requests are still answered 503 at once, and the engine that opens
//     when the bucket comes back runs with the reloaded settings (a
//     max_pending of 1 byte refuses an append while another one's upload
//     is held, which the default 64 MiB would let wait).
//   - Another, reachable storage: it serves at once, and the retry of the
//     first one ends with the reload: when that bucket comes back it gets
//     no request at all (no lease taken there by a retry meant to stop).
//
// Either way Caddy then stops cleanly, with no error in its log.
func TestReloadWhileStartRetries(t *testing.T) {
	ct := map[string]string{"Content-Type": textPlain}
	for _, tc := range []struct {
		name string
		run  func(t *testing.T, e *fhEnv, storage string)
	}{
		{"same storage, new settings", func(t *testing.T, e *fhEnv, storage string) {
			if err := e.reload(retryCaddyfile(storage, "max_pending 1B")); err != nil {
				t.Fatalf("reload while the start is retried: %v", err)
			}
			if !strings.Contains(e.caddy.Logs(), "max_pending from 67108864 to 1") {
				t.Errorf("the reload did not log its settings change")
			}
			if r := e.must(fhReq{Method: http.MethodPut, Path: "/ds/r/a", Header: ct}); r.Status != http.StatusServiceUnavailable ||
				!strings.Contains(string(r.Body), "storage is not open yet (retrying)") {
				t.Fatalf("create after the reload, bucket still unreachable: %s, want 503 retrying", r)
			}
			if n := retryGoroutines(t, e.caddy.AdminAddr()); n != 1 {
				t.Errorf("%d goroutines retry the start after the reload, want 1", n)
			}
			if err := e.proxy.Up(); err != nil {
				t.Fatal(err)
			}
			r, took := waitOpen(t, e, fhReq{Method: http.MethodPut, Path: "/ds/r/a", Header: ct})
			if r.Status != http.StatusCreated {
				t.Fatalf("create %v after the bucket came back: %s", took.Round(time.Millisecond), r)
			}
			t.Logf("the storage opened %v after the bucket came back", took.Round(time.Millisecond))

			// Hold the first append's WAL upload: its bytes wait for
			// storage, so a second append finds max_pending reached.
			release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Times: 1})
			defer release()
			first := make(chan fhResp, 1)
			go func() {
				r, _ := e.send(fhReq{Method: http.MethodPost, Path: "/ds/r/a", Header: ct, Body: []byte("first")})
				first <- r
			}()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := e.proxy.WaitHeld(ctx, 1); err != nil {
				t.Fatalf("the first append's upload never reached the store: %v", err)
			}
			// Under the default max_pending the second append would wait
			// for the held upload: let it go after a while.
			timer := time.AfterFunc(5*time.Second, release)
			defer timer.Stop()
			second := e.must(fhReq{Method: http.MethodPost, Path: "/ds/r/a", Header: ct, Body: []byte("second")})
			release()
			if second.Status != http.StatusServiceUnavailable || !strings.Contains(string(second.Body), busyMessageText) {
				t.Errorf("append while max_pending (1 byte, set by the reload) is reached: %s, want 503 busy", second)
			}
			if r := <-first; r.Status/100 != 2 {
				t.Errorf("the held append: %s, want 2xx", r)
			}
			if got, _, err := e.readBytes("/ds/r/a"); err != nil || string(got) != "first" {
				t.Errorf("read back %q, %v; want %q", got, err, "first")
			}
		}},
		{"another storage", func(t *testing.T, e *fhEnv, _ string) {
			p2 := newProxy(t, e.v)
			other := testenv.StoreURL(p2.URL(), e.v.NewBucket(t), caddytest.S3Prefix)
			if n := retryGoroutines(t, e.caddy.AdminAddr()); n != 1 {
				t.Errorf("%d goroutines retry the start before the reload, want 1", n)
			}
			if err := e.reload(retryCaddyfile(other)); err != nil {
				t.Fatalf("reload to a reachable storage: %v", err)
			}
			if r := e.must(fhReq{Method: http.MethodPut, Path: "/ds/r/a", Header: ct}); r.Status != http.StatusCreated {
				t.Fatalf("create on the reachable storage: %s", r)
			}
			e.append("/ds/r/a", textPlain, []byte("on the other storage"))
			// The reload returns once the old config is cleaned up; the
			// goroutine may still be on its way out.
			if err := fhWaitFor(5*time.Second, 50*time.Millisecond, func() error {
				if n := retryGoroutines(t, e.caddy.AdminAddr()); n != 0 {
					return fmt.Errorf("%d goroutines still retry the old storage's start after the reload", n)
				}
				return nil
			}); err != nil {
				t.Error(err)
			}
			if err := e.proxy.Up(); err != nil {
				t.Fatal(err)
			}
			// Retries are at most a few seconds apart this early: one
			// that survived the reload would have reached the bucket.
			time.Sleep(5 * time.Second)
			if c := e.proxy.Counts(); c.Total() != 0 {
				t.Errorf("the old storage got %d requests after the reload (%d GET, %d PUT), want none", c.Total(), c.Get, c.Put)
			}
			if _, err := e.get("lease"); err == nil {
				t.Errorf("the old storage has a lease object: a retry took it after the reload")
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := testenv.NewVersity(t)
			p := newProxy(t, v)
			bucket := v.NewBucket(t)
			p.Down()
			storage := testenv.StoreURL(p.URL(), bucket, caddytest.S3Prefix)
			c, err := caddytest.Launch(t, caddytest.Options{
				Caddyfile:    retryCaddyfile(storage),
				Env:          caddytest.S3Env(v),
				ReadyTimeout: 90 * time.Second,
			})
			if err != nil {
				t.Fatalf("Caddy did not start with its bucket unreachable: %v", err)
			}
			e := &fhEnv{t: t, v: v, proxy: p, bucket: bucket, caddy: c, client: &http.Client{Timeout: time.Minute}}
			tc.run(t, e, storage)
			if err := c.Stop(); err != nil {
				t.Errorf("stop: %v", err)
			}
			if lines := errorLines(c.Logs()); len(lines) > 0 {
				t.Errorf("errors in the log:\n%s", strings.Join(lines, "\n"))
			}
		})
	}
}

// busyMessageText is the reason of an append refused because max_pending
// bytes already wait for storage.
const busyMessageText = "too many appends are waiting for storage"

// TestRestartWhileStoreDown: writers append to three streams, the bucket
// becomes unreachable under them, and the node is killed and started again
// while it still is. Caddy comes up and answers 503 at once; when the
// bucket comes back the storage opens by itself and every append that was
// acknowledged before the kill reads back, once and in order.
func TestRestartWhileStoreDown(t *testing.T) {
	v := testenv.NewVersity(t)
	p := newProxy(t, v)
	bucket := v.NewBucket(t)
	c, err := caddytest.Launch(t, caddytest.Options{
		Caddyfile:    retryCaddyfile(testenv.StoreURL(p.URL(), bucket, caddytest.S3Prefix)),
		Env:          caddytest.S3Env(v),
		ReadyTimeout: 90 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	cl := newClient(t, c.URL()+"/ds/", false)
	names := []string{"restart/a", "restart/b", "restart/c"}
	abort, cancel := context.WithCancel(context.Background())
	defer cancel()
	var writers []*writer
	for i, name := range names {
		cl.create(t, name, 30*time.Second)
		w := newWriter(abort, cl, i, name, 5*time.Millisecond)
		w.reqTimeout = 20 * time.Second
		writers = append(writers, w)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.run(stop)
		}()
	}
	time.Sleep(2 * time.Second)
	p.Down()
	time.Sleep(time.Second)
	c.Kill()
	close(stop)
	wg.Wait()
	acked, failed := 0, 0
	for _, w := range writers {
		a, f := w.counts()
		acked += a
		failed += f
	}
	t.Logf("before the kill: %d appends acknowledged, %d failed", acked, failed)
	if acked == 0 {
		t.Fatal("no append was acknowledged before the bucket went away")
	}

	if err := c.TryRestart(); err != nil {
		t.Fatalf("Caddy did not start again with its bucket unreachable: %v", err)
	}
	e := &fhEnv{t: t, v: v, proxy: p, bucket: bucket, caddy: c, client: &http.Client{Timeout: time.Minute}}
	if r := e.must(fhReq{Method: http.MethodGet, Path: "/ds/" + names[0] + "?offset=-1"}); r.Status != http.StatusServiceUnavailable ||
		r.Header.Get("Retry-After") == "" || !strings.Contains(string(r.Body), "storage is not open yet (retrying)") {
		t.Errorf("read after the restart, bucket unreachable: %s, want 503 retrying with Retry-After", r)
	}
	if err := p.Up(); err != nil {
		t.Fatal(err)
	}
	r, took := waitOpen(t, e, fhReq{Method: http.MethodGet, Path: "/ds/" + names[0] + "?offset=-1"})
	if r.Status != http.StatusOK {
		t.Fatalf("read %v after the bucket came back: %s", took.Round(time.Millisecond), r)
	}
	t.Logf("the storage opened %v after the bucket came back", took.Round(time.Millisecond))
	for _, w := range writers {
		content, _, err := cl.readAll(w.name, time.Minute)
		if err != nil {
			t.Fatalf("read %s: %v", w.name, err)
		}
		for _, problem := range w.verify(content) {
			t.Error(problem)
		}
	}
	for _, bad := range []string{"in use by another", "already open in this process"} {
		if strings.Contains(c.Logs(), bad) {
			t.Errorf("the log says %q", bad)
		}
	}
}

// TestReloadToUnreachableStorageIsRefused: a reload whose new storage
// cannot be reached fails, as it did before starts went to the background,
// and the running config keeps serving its storage: unlike at boot,
// failing hurts no site, and the operator reloading learns of the mistake
// at once. Taking the reload would have closed a working storage for one
// that answers 503 until its bucket can be reached.
func TestReloadToUnreachableStorageIsRefused(t *testing.T) {
	v := testenv.NewVersity(t)
	p := newProxy(t, v)
	bucket := v.NewBucket(t)
	working := retryCaddyfile(testenv.StoreURL(p.URL(), bucket, caddytest.S3Prefix))
	c, err := caddytest.Launch(t, caddytest.Options{Caddyfile: working, Env: caddytest.S3Env(v), ReadyTimeout: 90 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	e := &fhEnv{t: t, v: v, proxy: p, bucket: bucket, caddy: c, client: &http.Client{Timeout: time.Minute}}
	e.create("/ds/keep/a", textPlain)
	e.append("/ds/keep/a", textPlain, []byte("before;"))

	down := newProxy(t, v)
	down.Down()
	err = c.Reload(retryCaddyfile(testenv.StoreURL(down.URL(), v.NewBucket(t), caddytest.S3Prefix)))
	if err == nil {
		t.Errorf("a reload to a storage that cannot be reached succeeded")
	} else if !strings.Contains(err.Error(), "starting storage") || !strings.Contains(err.Error(), "connection refused") {
		t.Errorf("the failed reload does not give the reason:\n%v", err)
	}
	e.append("/ds/keep/a", textPlain, []byte("after;"))
	if got, _, err := e.readBytes("/ds/keep/a"); err != nil || string(got) != "before;after;" {
		t.Errorf("the running storage after the reload: %q, %v; want %q", got, err, "before;after;")
	}
	if err := c.Stop(); err != nil {
		t.Errorf("stop: %v", err)
	}
}

// TestStopDuringRetriedStartFreesTheLease: Caddy is stopped while a
// retried start, having taken the storage lease, waits on the store (a
// GET held by the proxy). The stop gives the start up, and the lease with
// it: another node then starts on the bucket at once, as after any other
// graceful stop. Before, the given-up start left the lease to lapse, and
// the other node's start failed with "in use by another PicoMQ node"
// for up to the lease's 30 s (now it waits as a standby, answering 503,
// which the create below would get).
func TestStopDuringRetriedStartFreesTheLease(t *testing.T) {
	v := testenv.NewVersity(t)
	p := newProxy(t, v)
	bucket := v.NewBucket(t)
	storage := testenv.StoreURL(p.URL(), bucket, caddytest.S3Prefix)
	p.Down()
	c, err := caddytest.Launch(t, caddytest.Options{Caddyfile: retryCaddyfile(storage), Env: caddytest.S3Env(v), ReadyTimeout: 90 * time.Second})
	if err != nil {
		t.Fatalf("Caddy did not start with its bucket unreachable: %v", err)
	}
	e := &fhEnv{t: t, v: v, proxy: p, bucket: bucket, caddy: c, client: &http.Client{Timeout: time.Minute}}
	// The start reads the format object right after taking the lease.
	release := p.Hold(testenv.Fault{Op: testenv.OpGet, KeyContains: "format"})
	defer release()
	if err := p.Up(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := p.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("no retried start reached the store: %v", err)
	}
	if _, err := e.get("lease"); err != nil {
		t.Fatalf("the retried start holds no lease while it waits: %v", err)
	}
	began := time.Now()
	if err := c.Stop(); err != nil {
		t.Errorf("stop during the retried start: %v", err)
	}
	t.Logf("stopped in %v", time.Since(began).Round(time.Millisecond))
	release()

	other, err := caddytest.Launch(t, caddytest.Options{Caddyfile: retryCaddyfile(storage), Env: caddytest.S3Env(v), ReadyTimeout: 90 * time.Second})
	if err == nil {
		err = waitServing(other, 30*time.Second)
	}
	if err != nil {
		t.Fatalf("another node on the bucket after the stop: %v", err)
	}
	o := &fhEnv{t: t, v: v, proxy: p, bucket: bucket, caddy: other, client: &http.Client{Timeout: time.Minute}}
	o.create("/ds/freed/a", textPlain)
}

// TestFirstPicomqConfigThroughTheAdminAPIStartsInTheBackground: Caddy
// started with a config without PicoMQ (as with no config at all, whose
// first real one a controller pushes through the admin API) is then given
// one whose storage cannot be reached. That is PicoMQ's boot, not a reload
// of it: the load succeeds, the storage answers 503 while its start is
// retried, and serves once the bucket can be reached. The load failed, as
// a reload of a running storage does, so a node could not be brought up
// that way while its store was down (nor as a standby).
func TestFirstPicomqConfigThroughTheAdminAPIStartsInTheBackground(t *testing.T) {
	v := testenv.NewVersity(t)
	p := newProxy(t, v)
	bucket := v.NewBucket(t)
	bare := fmt.Sprintf("{\n\tpersist_config off\n}\n\nhttp://:{$%s} {\n\tbind 127.0.0.1\n\trespond /other 200\n}\n", caddytest.PortEnv)
	c, err := caddytest.Launch(t, caddytest.Options{Caddyfile: bare, Env: caddytest.S3Env(v), ReadyTimeout: 90 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	e := &fhEnv{t: t, v: v, proxy: p, bucket: bucket, caddy: c, client: &http.Client{Timeout: time.Minute}}
	p.Down()
	if err := c.Reload(retryCaddyfile(testenv.StoreURL(p.URL(), bucket, caddytest.S3Prefix))); err != nil {
		t.Fatalf("the first config with PicoMQ, its storage unreachable: %v", err)
	}
	create := fhReq{Method: http.MethodPut, Path: "/ds/first/a", Header: map[string]string{"Content-Type": textPlain}}
	if r := e.must(create); r.Status != http.StatusServiceUnavailable {
		t.Errorf("a create while the storage cannot be reached: %s; want 503", r)
	}
	if err := p.Up(); err != nil {
		t.Fatal(err)
	}
	r, took := waitOpen(t, e, create)
	if r.Status != http.StatusCreated {
		t.Fatalf("a create once the bucket can be reached: %s after %v; want 201", r, took.Round(time.Millisecond))
	}
	if err := c.Stop(); err != nil {
		t.Errorf("stop: %v", err)
	}
}
