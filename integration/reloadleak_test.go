package integration

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// goroutines reads Caddy's goroutine profile from its admin endpoint: the
// total, and how many goroutines run the engine's compaction loop, one per
// open engine.
func goroutines(admin string) (total, engines int, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+admin+"/debug/pprof/goroutine?debug=1", nil)
	if err != nil {
		return 0, 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return 0, 0, fmt.Errorf("goroutine profile: %d %s", resp.StatusCode, b)
	}
	// debug=1 groups identical stacks: "N @ 0x..." then "#\t0x... func+0x.." lines.
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	group := 0
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, "goroutine profile: total "); ok {
			total, _ = strconv.Atoi(rest)
			continue
		}
		if n, _, ok := strings.Cut(line, " @ "); ok {
			group, _ = strconv.Atoi(n)
			continue
		}
		if strings.Contains(line, "streamstore.(*Engine).compactLoop") {
			engines += group
		}
	}
	return total, engines, sc.Err()
}

// TestReloadsLeakNothing reloads Caddy's configuration (the same storage,
// a handler option changed each time) again and again while appends,
// long-polls and SSE feeds run. Nothing acknowledged may go missing, the
// live reads open at each reload must end with a response (or a clean end
// of the SSE stream) and carry on, the process must keep one engine, its
// goroutines must come back to what they were once the load stops, and
// the metrics must keep counting in each config's registry.
func TestReloadsLeakNothing(t *testing.T) {
	const reloads = 6
	v := testenv.NewVersity(t)
	storage := caddytest.S3Storage(t, v, v.Endpoint)
	optsWith := func(poll string) caddytest.Options {
		return caddyOptions(v, storage, "flush_interval 10ms", "long_poll_timeout "+poll)
	}
	c := caddytest.Start(t, optsWith("20s"))
	wcl := newClient(t, c.URL(), true)
	lcl := newClient(t, c.URL(), false)
	names := []string{"/leak/a", "/leak/b", "/leak/c"}
	idle := "/leak/idle"
	for _, n := range append(names, idle) {
		wcl.create(t, n, 30*time.Second)
	}
	idleTail, err := wcl.tail(idle, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}

	settle := func(label string, limit int) int {
		t.Helper()
		var total, engines int
		var err error
		ok := waitFor(30*time.Second, func() bool {
			total, engines, err = goroutines(c.AdminAddr())
			return err == nil && engines == 1 && (limit == 0 || total <= limit)
		})
		if err != nil {
			t.Fatalf("%s: %v", label, err)
		}
		if engines != 1 {
			t.Errorf("%s: %d engines run (goroutines in the compaction loop), want 1", label, engines)
		}
		if !ok && limit > 0 {
			t.Errorf("%s: %d goroutines 30s after the load stopped, against %d after one reload: "+
				"the reloads leaked goroutines", label, total, limit)
		}
		return total
	}

	type load struct {
		stop    func()
		writers []*writer
		polls   []*longPoller
		subs    []*subscriber
	}
	// run starts writers on names, SSE feeds on names and long-polls on
	// the idle stream; stop ends them and waits for them.
	run := func(round int) *load {
		ctx, cancel := context.WithCancel(context.Background())
		stopWriters := make(chan struct{})
		var wg sync.WaitGroup
		l := &load{}
		for i, name := range names {
			// Each round's writers are other producers, on the streams
			// the round before wrote to.
			w := newWriter(ctx, wcl, 10*round+i, name, 20*time.Millisecond)
			w.producer, w.shared = true, true
			l.writers = append(l.writers, w)
			s := newSubscriber(lcl, name)
			l.subs = append(l.subs, s)
			lp := &longPoller{c: lcl, name: idle}
			l.polls = append(l.polls, lp)
			wg.Add(3)
			go func() { defer wg.Done(); w.run(stopWriters) }()
			go func() { defer wg.Done(); s.run(ctx) }()
			go func() { defer wg.Done(); lp.run(ctx, idleTail) }()
		}
		var once sync.Once
		l.stop = func() {
			once.Do(func() {
				close(stopWriters)
				time.Sleep(500 * time.Millisecond) // let the feeds see the last appends
				cancel()
				wg.Wait()
			})
		}
		t.Cleanup(l.stop)
		return l
	}
	reload := func(k int) {
		t.Helper()
		poll := []string{"20s", "25s"}[k%2]
		if err := c.Reload(c.Config(optsWith(poll))); err != nil {
			t.Fatalf("reload %d: %v", k, err)
		}
	}
	appends := func() float64 {
		t.Helper()
		return mMust(t, c.AdminAddr()).sum("picomq_appends_total")
	}

	// A first round with a reload, to have every lazily started goroutine
	// of Caddy and the module running before counting.
	first := run(0)
	time.Sleep(time.Second)
	reload(0)
	time.Sleep(time.Second)
	first.stop()
	baseline := settle("after one reload", 0)

	l := run(1)
	var counted []float64
	for k := 1; k <= reloads; k++ {
		time.Sleep(time.Second)
		reload(k)
		counted = append(counted, appends())
	}
	time.Sleep(time.Second)
	l.stop()
	counted = append(counted, appends())
	for i := 1; i < len(counted); i++ {
		if counted[i] <= counted[i-1] {
			t.Errorf("picomq_appends_total did not move between reloads %d and %d: %v", i, i+1, counted)
			break
		}
	}
	// Some slack: Caddy's own idle connections and timers come and go.
	after := settle(fmt.Sprintf("after %d more reloads", reloads), baseline+10)
	t.Logf("goroutines: %d after one reload, %d after %d more; picomq_appends_total at each reload %v",
		baseline, after, reloads, counted)

	for _, ld := range []*load{first, l} {
		for i, w := range ld.writers {
			content, _, err := wcl.readAll(names[i], 30*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			for _, why := range w.failures(5) {
				t.Errorf("append failed across the reloads: %s", why)
			}
			for _, pr := range w.verify(content) {
				t.Error(pr)
			}
		}
		for _, s := range ld.subs {
			for _, e := range s.errs {
				t.Error(e)
			}
		}
		for _, lp := range ld.polls {
			lp.mu.Lock()
			answered := 0
			for _, r := range lp.records {
				switch {
				case r.err == nil && r.status != http.StatusNoContent && r.status != http.StatusOK:
					t.Errorf("%s: a long-poll ended with status %d", lp.name, r.status)
				case r.err == nil:
					answered++
				case connectionLost(r.err), strings.Contains(r.err.Error(), "context canceled"):
					// The kernel resets a connection still queued on the
					// old SO_REUSEPORT socket at a reload, and a server
					// closing an idle keep-alive connection races the
					// request sent on it; a client polls again.
				case r.done.Before(time.Now().Add(-time.Second)):
					t.Errorf("%s: a long-poll failed instead of ending with a response: %v", lp.name, r.err)
				}
			}
			if answered == 0 {
				t.Errorf("%s: no long-poll was answered across the reloads", lp.name)
			}
			lp.mu.Unlock()
		}
	}
	if strings.Contains(c.Logs(), "duplicate metrics collector") {
		t.Error("a reload registered a metrics collector twice")
	}
}

// TestReloadToAnotherStorage reloads Caddy onto another prefix of the
// bucket and back, with an SSE feed open. Each storage is its own engine:
// the reload opens the new one and closes the old one once the old config
// is done (its pending appends flushed, its lease released), so the
// process runs one engine; streams of the storage left behind are not
// served until a reload comes back to it, and then they are all there.
func TestReloadToAnotherStorage(t *testing.T) {
	v := testenv.NewVersity(t)
	bucket := v.NewBucket(t)
	first := testenv.StoreURL(v.Endpoint, bucket, "first")
	second := testenv.StoreURL(v.Endpoint, bucket, "second")
	c := caddytest.Start(t, caddyOptions(v, first, "flush_interval 10ms"))
	cl := newClient(t, c.URL(), true)
	const name = "/moved/s"
	appendOK := func(body string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		r, err := cl.appendBody(ctx, name, []byte(body))
		if err != nil || r.status/100 != 2 {
			t.Fatalf("append %q: %v %v", body, r, err)
		}
	}
	read := func(label, want string) {
		t.Helper()
		got, _, err := cl.readAll(name, 30*time.Second)
		if err != nil || string(got) != want {
			t.Fatalf("%s: read %q (%v), want %q", label, got, err, want)
		}
	}
	engines := func(label string) {
		t.Helper()
		var n int
		var err error
		if !waitFor(30*time.Second, func() bool {
			_, n, err = goroutines(c.AdminAddr())
			return err == nil && n == 1
		}) {
			t.Errorf("%s: %d engines run (%v), want 1", label, n, err)
		}
	}
	cl.create(t, name, 30*time.Second)
	appendOK("w99-0\n") // a line of a writer of its own, which the writers' checks skip

	sse, stopSSE := context.WithCancel(context.Background())
	defer stopSSE()
	sub := newSubscriber(cl, name)
	done := make(chan struct{})
	go func() { defer close(done); sub.once(sse) }()
	if !waitFor(10*time.Second, func() bool { sub.mu.Lock(); defer sub.mu.Unlock(); return sub.open }) {
		t.Fatal("the SSE feed did not open")
	}

	// Appends run into the reload: Caddy cleans the old config up (and so
	// closes the first storage) without waiting for the old server's
	// requests, so some are still on their way to the closing engine.
	// Each must be acknowledged and kept, or refused.
	stopWriters := make(chan struct{})
	writers := make([]*writer, 4)
	var wg sync.WaitGroup
	for i := range writers {
		writers[i] = newWriter(context.Background(), newClient(t, c.URL(), true), i, name, 0)
		writers[i].shared = true
		wg.Add(1)
		go func() { defer wg.Done(); writers[i].run(stopWriters) }()
	}
	time.Sleep(500 * time.Millisecond)
	reloadBegan := time.Now()
	err := c.Reload(c.Config(caddyOptions(v, second, "flush_interval 10ms")))
	reloaded := time.Now()
	time.Sleep(500 * time.Millisecond)
	close(stopWriters)
	wg.Wait()
	if err != nil {
		t.Fatalf("reload to another prefix: %v", err)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Error("the SSE feed on the storage left behind did not end within 10s of the reload")
	}
	for _, e := range sub.errs {
		t.Error(e)
	}
	engines("on the second storage")
	if r, err := cl.readFrom(context.Background(), name, "-1"); err != nil || r.status != http.StatusNotFound {
		t.Errorf("the first storage's stream read on the second: %v %v, want 404", r, err)
	}
	cl.create(t, name, 30*time.Second)
	appendOK("two\n")
	read("on the second storage", "two\n")

	if err := c.Reload(c.Config(caddyOptions(v, first, "flush_interval 10ms"))); err != nil {
		t.Fatalf("reload back to the first prefix: %v", err)
	}
	engines("back on the first storage")
	content, _, err := cl.readAll(name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	acked, failed, inFlight, inFlightAtEnd := 0, 0, 0, 0
	statuses := map[int]int{}
	for _, w := range writers {
		a, f := w.counts()
		acked += a
		failed += f
		fl, _ := w.inFlightAt(reloadBegan)
		inFlight += fl
		fl, _ = w.inFlightAt(reloaded)
		inFlightAtEnd += fl
		for st, n := range w.statusCounts() {
			statuses[st] += n
		}
		for _, pr := range w.verify(content) {
			t.Error(pr)
		}
	}
	// Acknowledged appends alone prove nothing: those before the reload
	// count too. Some must have been on their way when it began.
	if inFlight == 0 {
		t.Error("no append was in flight when the reload began: nothing tested")
	}
	t.Logf("appends across the reload: %d acknowledged, %d refused (by status: %v); in flight when it began %d, when it ended %d",
		acked, failed, statuses, inFlight, inFlightAtEnd)
	want := string(content) + "three\n"
	appendOK("three\n")
	read("back on the first storage", want)
	if n := strings.Count(c.Logs(), `"msg":"storage closed"`); n != 2 {
		t.Errorf("%d storages closed by the two reloads, want 2", n)
	}
}

// connectionLost reports whether err is the loss of the connection under a
// request (reset, or closed with no answer), which a reload can cause
// whatever the handler does.
func connectionLost(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}
