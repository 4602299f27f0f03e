package picomq

import (
	"context"
	"sync"
	"time"
)

// stallContext is the context an engine's start runs under. It ends as a
// deadline would (context.DeadlineExceeded, which the start's retry at
// boot takes for the store's fault) once progress has not moved for
// quiet, or with its parent. A fixed deadline cut short a replay that was
// long but going on (a WAL that compaction had let grow), again at every
// retry, so the storage never opened.
type stallContext struct {
	context.Context // the parent, for its values and deadline

	done chan struct{}
	stop chan struct{}
	once sync.Once
	mu   sync.Mutex
	err  error
}

// newStallContext watches progress every quiet/4; its cancel must be
// called, and ends the watching goroutine.
func newStallContext(parent context.Context, quiet time.Duration, progress func() int64) (context.Context, context.CancelFunc) {
	c := &stallContext{Context: parent, done: make(chan struct{}), stop: make(chan struct{})}
	go c.watch(quiet, progress)
	return c, func() { c.end(context.Canceled) }
}

func (c *stallContext) watch(quiet time.Duration, progress func() int64) {
	tick := time.NewTicker(quiet / 4)
	defer tick.Stop()
	last, moved := progress(), time.Now()
	for {
		select {
		case <-c.stop:
			return
		case <-c.Context.Done():
			c.end(c.Context.Err())
			return
		case now := <-tick.C:
			if p := progress(); p != last {
				last, moved = p, now
			} else if now.Sub(moved) >= quiet {
				c.end(context.DeadlineExceeded)
				return
			}
		}
	}
}

// end ends c with err, the first time only.
func (c *stallContext) end(err error) {
	c.once.Do(func() {
		c.mu.Lock()
		c.err = err
		c.mu.Unlock()
		close(c.done)
		close(c.stop)
	})
}

// Done implements context.Context.
func (c *stallContext) Done() <-chan struct{} { return c.done }

// Err implements context.Context.
func (c *stallContext) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}
