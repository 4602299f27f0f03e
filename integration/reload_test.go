package integration

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestReloadUnderLoad reloads Caddy's configuration (admin API /load,
// changing flush_interval) several times under a steady write load with SSE
// subscribers open. No write may fail, no acknowledged append may be lost,
// subscribers must resume from their last streamNextOffset with no gap and
// no duplicate, and the SSE responses open when a reload begins must end
// promptly (the old server must not wait out its grace period for them).
func TestReloadUnderLoad(t *testing.T) {
	const (
		streams     = 6
		subsPerStrm = 2
		// An SSE response open when a reload begins must end within this,
		// counted from the start of `caddy reload` (which adapts the
		// Caddyfile in a process of its own first: ~0.2s idle, more on a
		// busy machine). Without the shutdown hook it would never end:
		// Caddy's default grace period is eternal.
		promptEnd = 5 * time.Second
		// A reload must finish within this.
		reloadLimit = 15 * time.Second
	)
	v := testenv.NewVersity(t)
	storage := caddytest.S3Storage(t, v, v.Endpoint)
	optsWith := func(flush string) caddytest.Options {
		return caddyOptions(v, storage, "flush_interval "+flush, "long_poll_timeout 5s")
	}
	c := caddytest.Start(t, optsWith("10ms"))
	// Caddy binds its listeners with SO_REUSEPORT, so at a reload the
	// kernel resets connections still queued on the old socket, whatever
	// the handler (a plain respond route loses them too), and a server
	// closing an idle keep-alive connection races a POST sent on it.
	// Writers therefore do what a Durable Streams client does: idempotent
	// producer headers, and a resend of an append that got no answer.
	// Every append must end acknowledged exactly once.
	wcl := newClient(t, c.URL(), true)
	scl := newClient(t, c.URL(), true)

	names := make([]string, streams)
	for i := range names {
		names[i] = fmt.Sprintf("/reload/s%d", i)
		wcl.create(t, names[i], 30*time.Second)
	}

	abort, abortCancel := context.WithCancel(context.Background())
	subCtx, stopSubs := context.WithCancel(abort)
	stopWriters := make(chan struct{})
	var stopOnce sync.Once
	var writersWG, subsWG sync.WaitGroup
	t.Cleanup(func() {
		stopOnce.Do(func() { close(stopWriters) })
		stopSubs()
		abortCancel()
		writersWG.Wait()
		subsWG.Wait()
	})
	writers := make([]*writer, streams)
	var subs []*subscriber
	subStream := map[*subscriber]int{}
	for i, name := range names {
		writers[i] = newWriter(abort, wcl, i, name, 20*time.Millisecond)
		writers[i].producer = true
		writersWG.Add(1)
		go func() { defer writersWG.Done(); writers[i].run(stopWriters) }()
		for j := 0; j < subsPerStrm; j++ {
			s := newSubscriber(scl, name)
			subs = append(subs, s)
			subStream[s] = i
			subsWG.Add(1)
			go func() { defer subsWG.Done(); s.run(subCtx) }()
		}
	}
	if !waitFor(20*time.Second, func() bool {
		for _, s := range subs {
			s.mu.Lock()
			ok := s.open && len(s.received) > 0
			s.mu.Unlock()
			if !ok {
				return false
			}
		}
		return true
	}) {
		t.Fatal("SSE subscribers did not all connect and receive data within 20s")
	}

	// The engine is shared across reloads, never rebuilt: the storage is
	// opened once per process.
	const opened = `"msg":"storage opened"`
	openedBefore := strings.Count(c.Logs(), opened)
	if openedBefore == 0 {
		t.Fatalf("Caddy's log does not say the storage was opened (%s)", opened)
	}

	type reloadFigures struct {
		flush     string
		took      time.Duration
		ends      []time.Duration // per subscriber open at the start: when its response ended
		unclean   int             // of those, responses that ended inside an event
		stillOpen int
	}
	var figures []reloadFigures
	for k, flush := range []string{"25ms", "5ms", "50ms", "10ms"} {
		time.Sleep(2 * time.Second)
		// Which responses are open now, and how many each subscriber
		// has had before.
		before := map[*subscriber]int{}
		for _, s := range subs {
			s.mu.Lock()
			if s.open {
				before[s] = len(s.conns)
			}
			s.mu.Unlock()
		}
		began := time.Now()
		err := c.Reload(c.Config(optsWith(flush)))
		took := time.Since(began)
		if err != nil {
			t.Fatalf("reload %d (flush_interval %s): %v", k, flush, err)
		}
		if took > reloadLimit {
			t.Errorf("reload %d took %s", k, took.Round(time.Millisecond))
		}
		fig := reloadFigures{flush: flush, took: took}
		waitFor(promptEnd+5*time.Second, func() bool {
			for s, n := range before {
				s.mu.Lock()
				done := len(s.conns) > n
				s.mu.Unlock()
				if !done {
					return false
				}
			}
			return true
		})
		for s, n := range before {
			s.mu.Lock()
			if len(s.conns) <= n {
				fig.stillOpen++
			} else {
				conn := s.conns[n]
				fig.ends = append(fig.ends, conn.ended.Sub(began))
				if conn.err != nil {
					fig.unclean++
				}
			}
			s.mu.Unlock()
		}
		slices.Sort(fig.ends)
		figures = append(figures, fig)
		if fig.stillOpen > 0 {
			t.Errorf("reload %d: %d of %d SSE responses open when it began were still open %s later",
				k, fig.stillOpen, len(before), (promptEnd + 5*time.Second).Round(time.Second))
		}
		if len(fig.ends) > 0 && fig.ends[len(fig.ends)-1] > promptEnd {
			t.Errorf("reload %d: SSE responses open when it began ended %v after it began; want all within %s",
				k, fig.ends, promptEnd)
		}
		if fig.unclean > 0 {
			t.Errorf("reload %d: %d SSE responses were cut inside an event instead of ending cleanly", k, fig.unclean)
		}
	}
	if n := strings.Count(c.Logs(), opened); n != openedBefore {
		t.Errorf("the storage was opened again by the reloads (%d log lines %s before, %d after): "+
			"the engine must be shared across a reload, not rebuilt", openedBefore, opened, n)
	}
	time.Sleep(time.Second)
	stopOnce.Do(func() { close(stopWriters) })
	writersWG.Wait()

	contents := make([][]byte, streams)
	tails := make([]string, streams)
	for i, name := range names {
		var err error
		contents[i], tails[i], err = wcl.readAll(name, 30*time.Second)
		if err != nil {
			t.Fatalf("final read: %v", err)
		}
	}
	waitFor(15*time.Second, func() bool {
		for _, s := range subs {
			if s.at() != tails[subStream[s]] {
				return false
			}
		}
		return true
	})
	stopSubs()
	subsWG.Wait()

	var acked, failed, reconnects int
	for i := range writers {
		a, f := writers[i].counts()
		acked += a
		failed += f
		for _, why := range writers[i].failures(5) {
			t.Errorf("write failed during reloads: %s", why)
		}
		for _, pr := range writers[i].verify(contents[i]) {
			t.Error(pr)
		}
	}
	for _, s := range subs {
		i := subStream[s]
		for _, e := range s.errs {
			t.Error(e)
		}
		reconnects += len(s.conns) - 1
		if at := s.at(); at != tails[i] {
			t.Errorf("%s: SSE subscriber stopped at %s, tail is %s", s.name, at, tails[i])
		}
		if !bytes.Equal(s.received, contents[i]) {
			d := firstDiff(s.received, contents[i])
			t.Errorf("%s: SSE subscriber received %d bytes, stream holds %d; first difference at byte %d: got %s, stream %s",
				s.name, len(s.received), len(contents[i]), d, around(s.received, d), around(contents[i], d))
		}
	}
	if acked == 0 {
		t.Fatal("no append was acknowledged")
	}
	t.Logf("appends acknowledged %d, failed %d; SSE subscribers %d, reconnects %d", acked, failed, len(subs), reconnects)
	for k, f := range figures {
		t.Logf("reload %d to flush_interval %s took %s; open SSE responses ended after %v",
			k, f.flush, f.took.Round(time.Millisecond), roundAll(f.ends))
	}

}

// TestReloadAppliesEngineSettings checks that engine settings changed by a
// reload reach the running engine (the design: "the running engine takes
// the new settings when the new config is provisioned"). Uploads start at
// most once per flush interval, so of three back-to-back appends the second
// and third wait for it: with flush_interval 1s the median takes about a
// second, and after a reload back to 10ms far less.
func TestReloadAppliesEngineSettings(t *testing.T) {
	v := testenv.NewVersity(t)
	storage := caddytest.S3Storage(t, v, v.Endpoint)
	optsWith := func(flush string) caddytest.Options {
		return caddyOptions(v, storage, "flush_interval "+flush)
	}
	c := caddytest.Start(t, optsWith("10ms"))
	cl := newClient(t, c.URL(), true)
	const name = "/reload/settings"
	cl.create(t, name, 30*time.Second)

	latency := func(label string) time.Duration { return appendLatency(t, cl, name, label) }
	start := latency("start")
	steps := []struct {
		flush    string
		min, max time.Duration
	}{
		{"1s", 700 * time.Millisecond, 3 * time.Second},
		{"10ms", 0, 500 * time.Millisecond},
	}
	prev := "10ms"
	for _, st := range steps {
		if err := c.Reload(c.Config(optsWith(st.flush))); err != nil {
			t.Fatalf("reload to flush_interval %s: %v", st.flush, err)
		}
		// The operator is told what the reload changed.
		if changed := `"changed":"flush_interval from ` + prev + ` to ` + st.flush + `"`; !strings.Contains(c.Logs(), changed) {
			t.Errorf("no log line of the reload to flush_interval %s says %s", st.flush, changed)
		}
		prev = st.flush
		got := latency(st.flush)
		t.Logf("median lone-append latency with flush_interval %s after a reload: %s (at start, 10ms: %s)",
			st.flush, got.Round(time.Millisecond), start.Round(time.Millisecond))
		if got < st.min || got > st.max {
			t.Errorf("flush_interval %s set by a reload did not take effect: a lone append took %s, want %s..%s",
				st.flush, got.Round(time.Millisecond), st.min, st.max)
		}
	}
}

// appendLatency returns the median of three back-to-back appends to name,
// which a flush interval of a second or more makes about that long.
func appendLatency(t *testing.T, cl *dsClient, name, label string) time.Duration {
	t.Helper()
	var ds []time.Duration
	for i := 0; i < 3; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		began := time.Now()
		r, err := cl.appendBody(ctx, name, []byte(fmt.Sprintf("%s-%d\n", label, i)))
		cancel()
		if err != nil || r.status/100 != 2 {
			t.Fatalf("lone append (%s): %v %v", label, r, err)
		}
		ds = append(ds, time.Since(began))
	}
	slices.Sort(ds)
	return ds[1]
}

// TestFailedReloadKeepsEngineSettings reloads with a config whose first
// handler sets flush_interval 1s on the running storage and whose second,
// on the same storage, disagrees: the load fails and Caddy keeps the old
// config, whose flush_interval (10ms) must still be the engine's. The
// first handler's provisioning used to apply its settings to the shared
// engine at once, so the failed reload left every append waiting a second.
func TestFailedReloadKeepsEngineSettings(t *testing.T) {
	const name = "/reload/failed-settings"
	_, storage, c, cl := startWithStream(t, name, "flush_interval 10ms")

	// route /other/* sorts before the catch-all route, so its handler is
	// provisioned first.
	bad := fmt.Sprintf(`{
	admin %s
	persist_config off
}
http://:%d {
	bind 127.0.0.1
	route /other/* {
		picomq {
			storage %q
			flush_interval 1s
		}
	}
	route {
		picomq {
			storage %q
			flush_interval 10ms
		}
	}
}
`, c.AdminAddr(), c.Port(), storage, storage)
	err := c.Reload(bad)
	if err == nil {
		t.Fatal("a reload whose handlers disagree on one storage's settings succeeded")
	}
	if !strings.Contains(err.Error(), "disagree on flush_interval") {
		t.Fatalf("the reload failed for another reason than the one provoked: %v", err)
	}
	got := appendLatency(t, cl, name, "after")
	t.Logf("median lone-append latency after the failed reload: %s", got.Round(time.Millisecond))
	if got > 500*time.Millisecond {
		t.Errorf("after a failed reload a lone append took %s: the engine runs the refused config's flush_interval 1s, "+
			"not the running config's 10ms", got.Round(time.Millisecond))
	}
}

func roundAll(ds []time.Duration) []time.Duration {
	out := make([]time.Duration, len(ds))
	for i, d := range ds {
		out[i] = d.Round(time.Millisecond)
	}
	return out
}

// TestReloadOfS3TimeoutOnly reloads with only s3_timeout changed, which
// takes a restart: Caddy's log must say so, once (the old config's
// cleanup said it a second time), and must not claim that the engine's
// settings changed.
func TestReloadOfS3TimeoutOnly(t *testing.T) {
	v, storage, c, _ := startWithStream(t, "/reload/s3timeout", "s3_timeout 10s")
	if err := c.Reload(c.Config(caddyOptions(v, storage, "s3_timeout 3s"))); err != nil {
		t.Fatal(err)
	}
	// Caddy cleans the old config up before the reload is answered.
	logs := c.Logs()
	const warning = "s3_timeout changed; it takes effect when Caddy restarts"
	if n := strings.Count(logs, warning); n != 1 {
		t.Errorf("%d warnings %q after a reload to s3_timeout 3s, want 1", n, warning)
	}
	if strings.Contains(logs, "engine settings changed") {
		t.Error("the log says the engine settings changed, though only s3_timeout (which takes a restart) did")
	}
}

// TestReloadToShortGraveTimeWarns reloads Caddy on S3 from the default
// grave_time to 5m, under the 15 minutes S3 accepts a signed request for:
// the operator is warned, as at a start with it. Only a start used to
// warn, the reload's engine being the running one.
func TestReloadToShortGraveTimeWarns(t *testing.T) {
	v := testenv.NewVersity(t)
	storage := caddytest.S3Storage(t, v, v.Endpoint)
	c := caddytest.Start(t, caddyOptions(v, storage))
	const warning = "grave_time is shorter than the time S3 accepts a signed request"
	if strings.Contains(c.Logs(), warning) {
		t.Fatalf("a start with the default grave_time warned: %s", warning)
	}
	if err := c.Reload(c.Config(caddyOptions(v, storage, "grave_time 5m"))); err != nil {
		t.Fatalf("reload to grave_time 5m: %v", err)
	}
	if !strings.Contains(c.Logs(), warning) {
		t.Errorf("a reload to grave_time 5m on S3 logged no warning %q", warning)
	}
}
