package testenv

import (
	"runtime"
	"strings"
	"time"
)

// PoolGoroutines counts the goroutines of internal/workers pools that
// exist now. They are told by their creator: one that has not run yet
// shows a go statement's wrapper in a stack dump, not Pool.work.
func PoolGoroutines() int {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	return strings.Count(string(buf), PoolCreator)
}

// WaitPoolGoroutines waits up to within for the count of pool goroutines
// to be want and returns the count it saw last. Tests that count a pool's
// goroutines take their baseline with want 0: an earlier test's engine
// left for dead in a simulated crash keeps its idle goroutines until
// their linger runs out, and one ending mid-test skews the difference.
// After a Close, a short wait covers a goroutine that has told the pool
// it is done but not yet returned.
func WaitPoolGoroutines(want int, within time.Duration) int {
	deadline := time.Now().Add(within)
	for {
		n := PoolGoroutines()
		if n == want || time.Now().After(deadline) {
			return n
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// WaitPoolIdle waits up to within for every pool goroutine to be waiting
// for its next function, and reports whether they all were. A function's
// caller can learn it is done (a channel it closed) before the goroutine
// that ran it is back waiting: a test that hands the pool its next
// function at once may then see it start a goroutine of its own.
func WaitPoolIdle(within time.Duration) bool {
	deadline := time.Now().Add(within)
	for {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		idle := true
		for _, g := range strings.Split(string(buf), "\n\n") {
			if !strings.Contains(g, PoolCreator) {
				continue
			}
			// A waiting one is parked in the work loop's select, with
			// that loop as its innermost frame.
			lines := strings.SplitN(g, "\n", 3)
			if len(lines) < 2 || !strings.Contains(lines[0], "[select") || !strings.HasPrefix(lines[1], poolWork) {
				idle = false
			}
		}
		if idle {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
}

// poolWork is the frame of a pool goroutine's loop in a stack dump.
const poolWork = "github.com/picomq/caddy-picomq/internal/workers.(*Pool).work("

// OnPool reports whether the calling goroutine is one of a pool's.
func OnPool() bool {
	buf := make([]byte, 64<<10)
	buf = buf[:runtime.Stack(buf, false)]
	return strings.Contains(string(buf), PoolCreator)
}

// PoolCreator is the line a stack dump gives each goroutine of a pool.
const PoolCreator = "created by github.com/picomq/caddy-picomq/internal/workers.(*Pool).Go"
