package workers

import (
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// goid returns the calling goroutine's id, from its stack trace's header.
func goid() string {
	buf := make([]byte, 64)
	buf = buf[:runtime.Stack(buf, false)]
	id, _, _ := strings.Cut(strings.TrimPrefix(string(buf), "goroutine "), " ")
	return id
}

// waiting counts the pool goroutines that exist now (by their creator:
// one not yet run shows a wrapper, not Pool.work), and of them those
// waiting for a function.
func waiting() (all, idle int) {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, testenv.PoolCreator) {
			all++
			if strings.Contains(g, "[select") && strings.Contains(g, "workers.(*Pool).work(") {
				idle++
			}
		}
	}
	return all, idle
}

func count() int {
	all, _ := waiting()
	return all
}

// eventually polls cond for up to 5 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestPoolReusesAWaitingGoroutine(t *testing.T) {
	p := New(time.Minute)
	defer p.Close()
	ids := map[string]bool{}
	for range 20 {
		done := make(chan string)
		p.Go(func() { done <- goid() })
		ids[<-done] = true
		// The goroutine reports before it returns; let it reach its wait.
		eventually(t, "the goroutine to wait", func() bool { _, idle := waiting(); return idle == 1 })
	}
	if len(ids) != 1 {
		t.Errorf("20 functions one after another ran on %d goroutines, want 1", len(ids))
	}
}

func TestPoolRunsConcurrentFunctionsAtOnce(t *testing.T) {
	p := New(time.Minute)
	defer p.Close()
	const n = 8
	var started sync.WaitGroup
	started.Add(n)
	release := make(chan struct{})
	for range n {
		// Each blocks until all have started: a pool that queued them
		// behind one another would never get there.
		p.Go(func() {
			started.Done()
			<-release
		})
	}
	done := make(chan struct{})
	go func() { started.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("functions given to the pool did not all run at once")
	}
	close(release)
}

func TestPoolGoroutinesEnd(t *testing.T) {
	for _, tc := range []struct {
		name   string
		linger time.Duration
		close  bool
	}{
		{name: "after the linger", linger: 20 * time.Millisecond},
		{name: "at Close", linger: time.Hour, close: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := count()
			p := New(tc.linger)
			var ran sync.WaitGroup
			for range 3 {
				ran.Add(1)
				p.Go(ran.Done)
			}
			ran.Wait()
			if tc.close {
				p.Close()
				if got := count() - before; got != 0 {
					t.Errorf("%d pool goroutines after Close, want 0", got)
				}
				return
			}
			defer p.Close()
			eventually(t, "idle goroutines to end", func() bool { return count() == before })
		})
	}
}

func TestPoolCloseWaitsForRunningFunctions(t *testing.T) {
	p := New(time.Hour)
	release := make(chan struct{})
	finished := false
	p.Go(func() {
		<-release
		finished = true
	})
	closed := make(chan struct{})
	go func() { p.Close(); close(closed) }()
	select {
	case <-closed:
		t.Fatal("Close returned while a function was running")
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	<-closed
	if !finished {
		t.Error("Close returned before the running function did")
	}

	// After Close nothing runs: Close would not wait for it.
	ran := false
	if p.Go(func() { ran = true }) {
		t.Error("Go after Close reported the function started")
	}
	if ran {
		t.Error("a function given after Close ran")
	}
}
