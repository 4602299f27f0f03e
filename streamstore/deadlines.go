package streamstore

import (
	"slices"
	"sync"
	"time"
)

// deadlines hands out channels that close a given wait from now, give or
// take a grain, with one timer for all of them: every append waits for its
// batch with such a deadline, and a timer of its own each was a timer per
// append (three allocations, and the runtime's timer heap touched twice)
// for a safety net that almost never fires.
//
// A deadline is rounded up to a multiple of its grain, so waiters asking
// within the same grain share a channel; it never fires early.
type deadlines struct {
	mu    sync.Mutex
	slots []deadlineSlot // by at, earliest first
	timer *time.Timer    // armed for slots[0], nil when there are none
	armed time.Time      // what timer is armed for
}

type deadlineSlot struct {
	at time.Time
	ch chan struct{}
}

// deadlineGrain is how finely deadlines are told apart: an eighth of the
// wait, at most 100 ms (AppendTimeout is 30 s by default; tests use less).
func deadlineGrain(wait time.Duration) time.Duration {
	return max(min(wait/8, 100*time.Millisecond), time.Millisecond)
}

// after returns a channel closed once wait has passed (and at most a grain
// more).
func (d *deadlines) after(wait time.Duration) <-chan struct{} {
	g := deadlineGrain(wait)
	at := time.Now().Add(wait + g - 1).Truncate(g)
	d.mu.Lock()
	defer d.mu.Unlock()
	// The wait is the same for nearly every caller, so a new deadline
	// almost always goes at the end.
	i := len(d.slots)
	for i > 0 && d.slots[i-1].at.After(at) {
		i--
	}
	if i > 0 && d.slots[i-1].at.Equal(at) {
		return d.slots[i-1].ch
	}
	ch := make(chan struct{})
	d.slots = slices.Insert(d.slots, i, deadlineSlot{at: at, ch: ch})
	if i == 0 {
		d.armLocked()
	}
	return ch
}

// armLocked points the timer at the earliest slot.
func (d *deadlines) armLocked() {
	if len(d.slots) == 0 {
		return
	}
	at := d.slots[0].at
	if d.timer != nil && d.armed.Equal(at) {
		return
	}
	if d.timer != nil {
		d.timer.Stop()
	}
	d.armed = at
	d.timer = time.AfterFunc(time.Until(at), d.fire)
}

// fire closes the channels whose time has come and re-arms for the next.
func (d *deadlines) fire() {
	d.mu.Lock()
	defer d.mu.Unlock()
	now := time.Now()
	n := 0
	for n < len(d.slots) && !d.slots[n].at.After(now) {
		close(d.slots[n].ch)
		n++
	}
	d.slots = slices.Delete(d.slots, 0, n)
	// The timer that called us may not be d.timer (it was re-pointed as
	// this one fired): stop whichever is set, then arm afresh.
	if d.timer != nil {
		d.timer.Stop()
		d.timer = nil
	}
	d.armLocked()
}
