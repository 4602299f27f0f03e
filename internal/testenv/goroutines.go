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

// OnPool reports whether the calling goroutine is one of a pool's.
func OnPool() bool {
	buf := make([]byte, 64<<10)
	buf = buf[:runtime.Stack(buf, false)]
	return strings.Contains(string(buf), PoolCreator)
}

// PoolCreator is the line a stack dump gives each goroutine of a pool.
const PoolCreator = "created by github.com/picomq/caddy-picomq/internal/workers.(*Pool).Go"
