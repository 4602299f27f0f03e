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
	a, cfg := startLeaseHolder(t)
	first := a.caddy
	const name = "/ds/standby/s"
	a.create(name, textPlain)
	var want []byte
	for i := range 20 {
		b := []byte{byte('a' + i)}
		a.append(name, textPlain, b)
		want = append(want, b...)
	}

	b := launchStandby(t, a, cfg)
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
	after := time.Since(stopped)
	t.Logf("the standby took the storage over %v after the first node stopped", after.Round(time.Millisecond))
	// The stop gave the lease back; a standby looks at it at least every
	// 2 s (standbyPoll), where its backoff had grown towards 30 s.
	if after > standbyTakeoverLimit {
		t.Errorf("the standby took the storage over %v after the first node stopped and gave the lease back, want within %v",
			after.Round(time.Millisecond), standbyTakeoverLimit)
	}
	b.append(name, textPlain, []byte("?"))
	if body, _, err := b.readBytes(name); err != nil || string(body) != string(want)+"?" {
		t.Errorf("after an append on the standby the stream reads %q (%v)", body, err)
	}
	if !strings.Contains(b.caddy.Logs(), "storage opened after another node let go of it") {
		t.Errorf("the standby's log does not say it took the storage over")
	}
}

// How long after the lease became free a standby takes the storage over:
// it looks again just after the lease's expiry (lapseTakeoverLimit), and
// at least every 2 s for a lease given back early (standbyTakeoverLimit),
// plus a start and the test's 100 ms polls.
const (
	standbyTakeoverLimit = 5 * time.Second
	lapseTakeoverLimit   = 3 * time.Second
)

// TestStandbyTakesOverWhenTheLeaseLapses: a standby of a node that dies
// (SIGKILL: its lease is not given back) takes the storage over as soon
// as the lease lapses, not at whatever point its backoff had reached.
// Before, it retried at intervals doubling up to 30 s and took over up to
// half a minute after the lease had lapsed (49 s after the cut-off of a
// 30 s lease in TestLeaseExpiryFencesPartitionedNode).
func TestStandbyTakesOverWhenTheLeaseLapses(t *testing.T) {
	t.Parallel() // waits on timers most of its run: beside the other such tests, not after them
	a, cfg := startLeaseHolder(t)
	const name = "/ds/lapse/s"
	a.create(name, textPlain)
	a.append(name, textPlain, []byte("kept"))

	b := launchStandby(t, a, cfg)
	// Let the standby's retries space out, as they would in a standby
	// that has waited a while, before the first node dies.
	time.Sleep(20 * time.Second)
	killAndTakeOver(t, a, b, name, "the standby")
}

// killAndTakeOver kills a's Caddy, the lease holder, and checks that the
// standby b takes the storage over within lapseTakeoverLimit of the
// lease's lapse, reading name ("kept") through it. who names b in the
// failure.
func killAndTakeOver(t *testing.T, a, b *fhEnv, name, who string) {
	t.Helper()
	a.caddy.Kill()
	killed := time.Now()
	// A renewal the process sent just before it died lands by then.
	time.Sleep(time.Second)
	lapses := leaseExpiry(t, a)
	got, _ := waitOpen(t, b, fhReq{Method: http.MethodGet, Path: name + "?offset=-1"})
	opened := time.Now()
	if got.Status != http.StatusOK || string(got.Body) != "kept" {
		t.Fatalf("read on the standby after the first node died: %s, want 200 %q", got, "kept")
	}
	late := opened.Sub(lapses)
	t.Logf("the lease lapsed %v after the kill; the standby took the storage over %v after that",
		lapses.Sub(killed).Round(time.Millisecond), late.Round(time.Millisecond))
	if late > lapseTakeoverLimit {
		t.Errorf("%s took the storage over %v after the lease lapsed, want within %v", who, late.Round(time.Millisecond), lapseTakeoverLimit)
	}
}

// TestStandbyTakesOverPromptlyAfterAStoreBlip: a standby that has waited
// a while, then met a store that failed its read of the lease for a
// moment, still takes the storage over as soon as the lease lapses.
// Before, its backoff doubled at every look that found the lease held
// (where standbyPoll bounds the wait anyway), so after a few seconds as a
// standby it stood at 30 s, and the one start that failed to reach the
// store waited 15 to 30 s before the next: a holder that died meanwhile
// left the storage without a writer that long after its lease lapsed.
// Found while adding faults on both nodes to the two-node crash torture.
func TestStandbyTakesOverPromptlyAfterAStoreBlip(t *testing.T) {
	t.Parallel() // waits on timers most of its run
	a, cfg := startLeaseHolder(t, "lease_ttl 3s")
	const name = "/ds/blip/s"
	a.create(name, textPlain)
	a.append(name, textPlain, []byte("kept"))

	b := launchStandby(t, a, cfg)
	// Looks that find the lease held, every 2 s, for a while.
	time.Sleep(15 * time.Second)
	// The standby's next look meets a failing store. Only its reads of
	// the lease fail: the holder writes the lease and reads it only when
	// a write of it is refused.
	before := a.proxy.Counts().Faults
	remove := a.proxy.AddFault(testenv.Fault{Op: testenv.OpGet, KeyContains: "/lease", Status: http.StatusInternalServerError})
	if !waitFor(10*time.Second, func() bool { return a.proxy.Counts().Faults > before }) {
		remove()
		t.Fatal("the standby did not read the lease within 10 s")
	}
	// Its store's retries (a second at most) run out: the start fails
	// as unreachable, and the store answers again.
	time.Sleep(3 * time.Second)
	remove()
	killAndTakeOver(t, a, b, name, "the standby, whose read of the lease had failed once,")
}

// TestLeaseTTLBoundsTheTakeover: with lease_ttl 3s the holder's lease
// object expires 3 s after its renewal, not 30, and a standby of a node
// that dies serves the storage within seconds. Before lease_ttl there was
// no way to shorten the lease from the Caddyfile: every takeover after a
// crash waited out 30 s.
func TestLeaseTTLBoundsTheTakeover(t *testing.T) {
	const ttl = 3 * time.Second
	a, cfg := startLeaseHolder(t, "lease_ttl 3s")
	first := a.caddy
	const name = "/ds/shortlease/s"
	a.create(name, textPlain)
	a.append(name, textPlain, []byte("kept"))
	b := launchStandby(t, a, cfg)

	// Renewed every second: it runs out at most 3 s from now.
	if left := time.Until(leaseExpiry(t, a)); left > ttl+500*time.Millisecond {
		t.Errorf("the lease object runs %v past now, want at most lease_ttl %v", left.Round(time.Millisecond), ttl)
	}
	first.Kill()
	killed := time.Now()
	got, _ := waitOpen(t, b, fhReq{Method: http.MethodGet, Path: name + "?offset=-1"})
	took := time.Since(killed)
	if got.Status != http.StatusOK || string(got.Body) != "kept" {
		t.Fatalf("read on the standby after the holder died: %s, want 200 %q", got, "kept")
	}
	t.Logf("the standby took the storage over %v after the holder died", took.Round(time.Millisecond))
	if took > ttl+lapseTakeoverLimit {
		t.Errorf("the standby took the storage over %v after the holder died, want within lease_ttl %v and %v",
			took.Round(time.Millisecond), ttl, lapseTakeoverLimit)
	}
}

// leaseExpiry reads the lease object of a's bucket and returns when it runs
// out, as its holder last wrote it.
func leaseExpiry(t *testing.T, a *fhEnv) time.Time {
	t.Helper()
	raw, err := a.get("lease")
	if err != nil {
		t.Fatal(err)
	}
	lease, err := parseLease(raw)
	if err != nil || lease.expires.Equal(time.UnixMilli(0)) {
		t.Fatalf("lease object %q: no expiry (%v)", raw, err)
	}
	return lease.expires
}

// startLeaseHolder starts a node on a new bucket behind the S3 proxy, with
// extra picomq directives, and returns it with its Caddyfile, which a
// standby started with it shares.
func startLeaseHolder(t *testing.T, directives ...string) (*fhEnv, string) {
	t.Helper()
	v := testenv.NewVersity(t)
	p := newProxy(t, v)
	bucket := v.NewBucket(t)
	cfg := retryCaddyfile(testenv.StoreURL(p.URL(), bucket, caddytest.S3Prefix), directives...)
	c := caddytest.Start(t, caddytest.Options{Caddyfile: cfg, Env: caddytest.S3Env(v)})
	return &fhEnv{t: t, v: v, proxy: p, bucket: bucket, caddy: c, client: &http.Client{Timeout: time.Minute}}, cfg
}

// launchStandby starts a second node (another node id) on the storage
// that holder holds; its start must not fail.
func launchStandby(t *testing.T, holder *fhEnv, cfg string) *fhEnv {
	t.Helper()
	c, err := caddytest.Launch(t, caddytest.Options{Caddyfile: cfg, Env: caddytest.S3Env(holder.v), ReadyTimeout: 90 * time.Second})
	if err != nil {
		t.Fatalf("a second node on a storage another node holds did not start: %v", err)
	}
	return &fhEnv{t: t, v: holder.v, proxy: holder.proxy, bucket: holder.bucket, caddy: c, client: &http.Client{Timeout: time.Minute}}
}
