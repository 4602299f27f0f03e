package picomq

import (
	"container/heap"
	"time"
)

// The manager's tick acts on a subscription in one of four cases
// (subTick), each from a time the subscription's state says (nextTick).
// The tick used to find them by looking at every subscription of the
// engine, ten times a second under the lock every append's note and every
// ack takes: 33 ms a tick with 100,000 idle subscriptions
// (BenchmarkSubscriptionTick), which broke "idle is free". The manager now
// keeps the subscriptions that have a case in a min-heap by the time it
// comes (subDueHeap), and every change to what nextTick reads is followed
// by scheduleLocked, which puts the subscription at its place (or takes it
// out); a tick pops only what is due.

// subTick is what the manager's tick does for a subscription.
type subTick int

const (
	tickNone subTick = iota
	// tickWebhookRetry sends the webhook wake in flight again (NextTry).
	tickWebhookRetry
	// tickWakeEventRetry writes the wake event of an unclaimed pull-wake
	// whose event could not be written (NextTry).
	tickWakeEventRetry
	// tickLeaseExpiry ends a wake whose lease ran out (LeaseUntil) and
	// wakes again if there is work.
	tickLeaseExpiry
	// tickWake wakes a subscription with pending work and nothing in
	// flight, at the next tick: after a restart, or a wake that could not
	// be saved.
	tickWake
)

// nextTick says what the manager's tick will do for s as it is now, and
// from when (unix ms; 0 for tickWake, at the next tick). The cases are
// disjoint, so that a case not due yet hides no other.
func (s *subState) nextTick() (subTick, int64) {
	switch {
	case s.Config.Type == "webhook" && s.WakeID != "" && s.NextTry > 0:
		return tickWebhookRetry, s.NextTry
	case s.Config.Type != "webhook" && s.WakeID != "" && s.Holder == "" && s.NextTry > 0:
		return tickWakeEventRetry, s.NextTry
	case s.WakeID != "" && s.NextTry == 0 && s.LeaseUntil > 0 && (s.Config.Type == "webhook" || s.Holder != ""):
		return tickLeaseExpiry, s.LeaseUntil
	case s.WakeID == "" && s.Holder == "" && s.pending():
		if s.Config.Type == "webhook" {
			return tickWake, s.NextTry // 0 unless a delivery's backoff runs
		}
		return tickWake, 0
	}
	return tickNone, 0
}

// backingOff reports whether s, a webhook subscription with no wake in
// flight, waits out the backoff of a delivery that had no answer within
// its lease before its next wake.
func (s *subState) backingOff(now time.Time) bool {
	return s.Config.Type == "webhook" && s.WakeID == "" && s.NextTry > now.UnixMilli()
}

// subDueHeap holds the subscriptions that have a case for the tick, the
// earliest first. Each knows its place in it (subState.dueIdx), so that a
// change of its time moves it (heap.Fix) rather than leaving a stale entry
// behind: the heap never holds more than the subscriptions.
type subDueHeap []*subState

func (h subDueHeap) Len() int           { return len(h) }
func (h subDueHeap) Less(i, j int) bool { return h[i].dueAt < h[j].dueAt }

func (h subDueHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].dueIdx, h[j].dueIdx = i+1, j+1
}

func (h *subDueHeap) Push(x any) {
	s := x.(*subState)
	*h = append(*h, s)
	s.dueIdx = len(*h)
}

func (h *subDueHeap) Pop() any {
	old := *h
	s := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	s.dueIdx = 0
	return s
}

// scheduleLocked puts s in the due heap at the time of its next tick case,
// or takes it out when it has none. Whatever changes a field nextTick reads
// (WakeID, Holder, LeaseUntil, NextTry, a link's tail or cursor) calls it,
// or the tick would not see the change.
func (m *subManager) scheduleLocked(s *subState) {
	kind, at := s.nextTick()
	switch {
	case kind == tickNone && s.dueIdx > 0:
		heap.Remove(&m.due, s.dueIdx-1)
	case kind == tickNone:
	case s.dueIdx > 0:
		s.dueAt = at
		heap.Fix(&m.due, s.dueIdx-1)
	default:
		s.dueAt = at
		heap.Push(&m.due, s)
	}
}

// unscheduleLocked takes s, which is going, out of the due heap.
func (m *subManager) unscheduleLocked(s *subState) {
	if s.dueIdx > 0 {
		heap.Remove(&m.due, s.dueIdx-1)
	}
}

// popDueLocked takes out of the due heap the subscriptions whose time is
// at or before ms, the earliest first.
func (m *subManager) popDueLocked(ms int64) []*subState {
	var due []*subState
	for len(m.due) > 0 && m.due[0].dueAt <= ms {
		due = append(due, heap.Pop(&m.due).(*subState))
	}
	return due
}
