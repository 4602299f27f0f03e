// Package workers runs functions on goroutines that stay for a while to
// run the next one.
//
// A goroutine starts on a small stack and grows it, copying it each time it
// doubles, as its calls go deeper. The S3 client's calls go deep (dozens
// of middleware frames), so a go statement per request grew and copied a
// fresh stack on every request: a few percent of the process's CPU at
// hundreds of requests a second. A Pool's goroutines keep the stack they
// grew while they wait for the next function.
package workers

import (
	"sync"
	"time"
)

// Pool runs functions on goroutines that, once a function returns, wait up
// to the pool's linger time for another before they end. It has no bound
// of its own: callers that need one keep it (the WAL writer's uploads in
// flight, a reader's read-ahead).
type Pool struct {
	linger  time.Duration
	handoff chan func() // unbuffered: a send succeeds only to a waiting goroutine
	quit    chan struct{}

	mu     sync.Mutex // orders wg.Add before Close's wg.Wait
	closed bool
	wg     sync.WaitGroup
}

// New returns a pool whose idle goroutines end after linger.
func New(linger time.Duration) *Pool {
	return &Pool{linger: linger, handoff: make(chan func()), quit: make(chan struct{})}
}

// Go runs f on a waiting goroutine of the pool, or on a new one; it never
// waits. Once Close has begun it runs nothing and reports false: f would
// run on a goroutine Close does not wait for, after what it uses may be
// gone. The caller then does without, or does f's work itself.
func (p *Pool) Go(f func()) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	select {
	case p.handoff <- f:
		return true
	default:
	}
	p.wg.Add(1)
	go p.work(f)
	return true
}

func (p *Pool) work(f func()) {
	defer p.wg.Done()
	idle := time.NewTimer(p.linger)
	defer idle.Stop()
	for {
		f()
		idle.Reset(p.linger)
		select {
		case f = <-p.handoff:
		case <-idle.C:
			return
		case <-p.quit:
			return
		}
	}
}

// Close ends the waiting goroutines and waits for the running functions
// to return.
func (p *Pool) Close() {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		close(p.quit)
	}
	p.mu.Unlock()
	p.wg.Wait()
}
