package integration

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// pollRecord is one long-poll request.
type pollRecord struct {
	sent, done time.Time
	status     int
	err        error
}

// longPoller long-polls an idle stream at its tail, over and over.
type longPoller struct {
	c    *dsClient
	name string

	mu       sync.Mutex
	records  []pollRecord
	inFlight bool
}

func (lp *longPoller) run(ctx context.Context, start string) {
	off := start
	for ctx.Err() == nil {
		sent := time.Now()
		lp.mu.Lock()
		lp.inFlight = true
		lp.mu.Unlock()
		r, err := lp.c.do(ctx, http.MethodGet, lp.name, "offset="+url.QueryEscape(off)+"&live=long-poll", nil, nil)
		rec := pollRecord{sent: sent, done: time.Now(), err: err}
		if err == nil {
			rec.status = r.status
			if n := r.next(); n != "" {
				off = n
			}
		}
		lp.mu.Lock()
		lp.inFlight = false
		lp.records = append(lp.records, rec)
		lp.mu.Unlock()
		if err != nil || r.status/100 != 2 {
			sleepCtx(ctx, 100*time.Millisecond)
		}
	}
}

// TestGracefulShutdown sends SIGTERM to Caddy while appends are in flight
// (WAL uploads are slowed down by the S3 proxy, or held there across the
// signal) and long-poll and SSE readers wait on idle streams. Caddy must
// exit on its own, the live responses must end promptly and cleanly, and
// after a restart every acknowledged append must be there; one that failed
// may be, at most once.
func TestGracefulShutdown(t *testing.T) {
	for _, tc := range []struct {
		name string
		// hold parks WAL uploads from just before SIGTERM until this long
		// after it; zero holds nothing.
		hold time.Duration
	}{
		{name: "slow uploads"},
		{name: "upload held across the signal", hold: 3 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) { testShutdown(t, tc.hold) })
	}
}

func testShutdown(t *testing.T, hold time.Duration) {
	const (
		streams = 16
		idle    = 4 // idle streams with a long-poll and an SSE reader each
		// Live responses open at SIGTERM must end within this.
		promptEnd = 3 * time.Second
		// Caddy must have exited within this after SIGTERM.
		exitLimit = 15 * time.Second // beyond any hold
	)
	v := testenv.NewVersity(t)
	p := newProxy(t, v)
	storage := caddytest.S3Storage(t, v, p.URL())
	c := caddytest.Start(t, caddyOptions(v, storage,
		"flush_interval 50ms", "long_poll_timeout 30s", "sse_reconnect_interval 60s"))
	cl := newClient(t, c.URL(), true)

	names := make([]string, streams)
	for i := range names {
		names[i] = fmt.Sprintf("/shutdown/s%d", i)
		cl.create(t, names[i], 30*time.Second)
	}
	idleNames := make([]string, idle)
	idleTails := make([]string, idle)
	for i := range idleNames {
		idleNames[i] = fmt.Sprintf("/shutdown/idle%d", i)
		cl.create(t, idleNames[i], 30*time.Second)
		var err error
		if idleTails[i], err = cl.tail(idleNames[i], 10*time.Second); err != nil {
			t.Fatal(err)
		}
	}

	abort, abortCancel := context.WithCancel(context.Background())
	readCtx, stopReaders := context.WithCancel(abort)
	stopWriters := make(chan struct{})
	var stopOnce sync.Once
	var writersWG, readersWG sync.WaitGroup
	t.Cleanup(func() {
		stopOnce.Do(func() { close(stopWriters) })
		stopReaders()
		abortCancel()
		writersWG.Wait()
		readersWG.Wait()
	})

	// Slow object storage: every upload takes 150-250ms, so appends are
	// waiting for their WAL object when the signal comes.
	p.SetLatency(150*time.Millisecond, 100*time.Millisecond)
	writers := make([]*writer, streams)
	for i, name := range names {
		writers[i] = newWriter(abort, cl, i, name, 0)
		writersWG.Add(1)
		go func() { defer writersWG.Done(); writers[i].run(stopWriters) }()
	}
	lcl := newClient(t, c.URL(), false)
	pollers := make([]*longPoller, idle)
	subs := make([]*subscriber, idle)
	for i, name := range idleNames {
		pollers[i] = &longPoller{c: lcl, name: name}
		subs[i] = newSubscriber(lcl, name)
		readersWG.Add(2)
		go func() { defer readersWG.Done(); pollers[i].run(readCtx, idleTails[i]) }()
		go func() { defer readersWG.Done(); subs[i].run(readCtx) }()
	}
	if !waitFor(20*time.Second, func() bool {
		for i := range pollers {
			pollers[i].mu.Lock()
			pl := pollers[i].inFlight
			pollers[i].mu.Unlock()
			subs[i].mu.Lock()
			so := subs[i].open
			subs[i].mu.Unlock()
			if !pl || !so {
				return false
			}
		}
		return true
	}) {
		t.Fatal("live readers did not all start within 20s")
	}
	time.Sleep(2 * time.Second)

	if hold > 0 {
		release := p.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/"})
		wctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := p.WaitHeld(wctx, 1)
		cancel()
		if err != nil {
			release()
			t.Fatal("no WAL upload reached the proxy within 10s under load")
		}
		releaseAt := time.AfterFunc(hold, release)
		defer releaseAt.Stop()
		defer release()
	}
	sigterm := time.Now()
	stopErr := c.StopTimeout(30 * time.Second)
	exitTook := time.Since(sigterm)
	stopOnce.Do(func() { close(stopWriters) })
	writersWG.Wait()
	stopReaders()
	readersWG.Wait()
	p.SetLatency(0, 0)

	if stopErr != nil {
		t.Errorf("Caddy did not shut down cleanly on SIGTERM: %v", stopErr)
	} else if exitTook > exitLimit {
		t.Errorf("Caddy took %s to exit after SIGTERM; want under %s", exitTook.Round(time.Millisecond), exitLimit)
	}

	// Live responses open at SIGTERM.
	var pollEnds, sseEnds []time.Duration
	for _, lp := range pollers {
		var open *pollRecord
		for i := range lp.records {
			if r := &lp.records[i]; r.sent.Before(sigterm) && r.done.After(sigterm) {
				open = r
			}
		}
		if open == nil {
			t.Errorf("%s: no long-poll was open at SIGTERM", lp.name)
			continue
		}
		took := open.done.Sub(sigterm)
		pollEnds = append(pollEnds, took)
		switch {
		case open.err != nil:
			t.Errorf("%s: the long-poll open at SIGTERM failed after %s instead of ending with a response: %v",
				lp.name, took.Round(time.Millisecond), open.err)
		case open.status != http.StatusNoContent && open.status != http.StatusOK:
			t.Errorf("%s: the long-poll open at SIGTERM ended with status %d; want 204 (or 200)", lp.name, open.status)
		}
		if took > promptEnd {
			t.Errorf("%s: the long-poll open at SIGTERM ended %s after it; want within %s",
				lp.name, took.Round(time.Millisecond), promptEnd)
		}
	}
	for _, s := range subs {
		for _, e := range s.errs {
			t.Error(e)
		}
		var open *sseConn
		for i := range s.conns {
			if cn := &s.conns[i]; cn.opened.Before(sigterm) && cn.ended.After(sigterm) {
				open = cn
			}
		}
		if open == nil {
			t.Errorf("%s: no SSE response was open at SIGTERM", s.name)
			continue
		}
		took := open.ended.Sub(sigterm)
		sseEnds = append(sseEnds, took)
		if open.err != nil {
			t.Errorf("%s: the SSE response open at SIGTERM was cut after %s instead of ending cleanly: %v",
				s.name, took.Round(time.Millisecond), open.err)
		}
		if took > promptEnd {
			t.Errorf("%s: the SSE response open at SIGTERM ended %s after it; want within %s",
				s.name, took.Round(time.Millisecond), promptEnd)
		}
	}

	// The same node again: what was acknowledged must be there.
	c.Restart()
	var acked, failed, inFlight, inFlightAcked int
	for i, name := range names {
		content, _, err := cl.readAll(name, 30*time.Second)
		if err != nil {
			t.Fatalf("read after restart: %v", err)
		}
		for _, pr := range writers[i].verify(content) {
			t.Error(pr)
		}
		a, f := writers[i].counts()
		acked += a
		failed += f
		fl, fa := writers[i].inFlightAt(sigterm)
		inFlight += fl
		inFlightAcked += fa
	}
	if inFlight == 0 {
		t.Errorf("no append was in flight at SIGTERM: the test did not test anything")
	}
	t.Logf("SIGTERM: Caddy exited after %s (err %v); live responses ended after: long-poll %v, SSE %v",
		exitTook.Round(time.Millisecond), stopErr, roundAll(pollEnds), roundAll(sseEnds))
	t.Logf("appends acknowledged %d, failed %d; in flight at SIGTERM %d, of which acknowledged %d",
		acked, failed, inFlight, inFlightAcked)
}
