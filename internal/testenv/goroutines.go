package testenv

import (
	"runtime"
	"strings"
)

// PoolGoroutines counts the goroutines of internal/workers pools that
// exist now. They are told by their creator: one that has not run yet
// shows a go statement's wrapper in a stack dump, not Pool.work.
func PoolGoroutines() int {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	return strings.Count(string(buf), PoolCreator)
}

// OnPool reports whether the calling goroutine is one of a pool's.
func OnPool() bool {
	buf := make([]byte, 64<<10)
	buf = buf[:runtime.Stack(buf, false)]
	return strings.Contains(string(buf), PoolCreator)
}

// PoolCreator is the line a stack dump gives each goroutine of a pool.
const PoolCreator = "created by github.com/picomq/caddy-picomq/internal/workers.(*Pool).Go"
