package streamstore

import (
	"cmp"
	"slices"
	"testing"
	"time"
)

// A deadline never closes before its wait has passed, closes within about
// a grain after, and a short wait asked for after a long one still closes
// first (the timer is moved to it).
func TestDeadlines(t *testing.T) {
	for _, tc := range []struct {
		name  string
		waits []time.Duration // asked for in this order
	}{
		{name: "one", waits: []time.Duration{40 * time.Millisecond}},
		{name: "same wait, many", waits: []time.Duration{50 * time.Millisecond, 50 * time.Millisecond, 50 * time.Millisecond}},
		{name: "shorter after longer", waits: []time.Duration{400 * time.Millisecond, 30 * time.Millisecond}},
		{name: "interleaved", waits: []time.Duration{200 * time.Millisecond, 20 * time.Millisecond, 120 * time.Millisecond, 60 * time.Millisecond}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var d deadlines
			start := time.Now()
			chans := make([]<-chan struct{}, len(tc.waits))
			for i, w := range tc.waits {
				chans[i] = d.after(w)
			}
			order := make([]int, len(tc.waits))
			for i := range order {
				order[i] = i
			}
			slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(tc.waits[a], tc.waits[b]) })
			for _, i := range order {
				w := tc.waits[i]
				select {
				case <-chans[i]:
				case <-time.After(w + deadlineGrain(w) + 5*time.Second):
					t.Fatalf("deadline %d (%v) never closed", i, w)
				}
				if took := time.Since(start); took < w {
					t.Errorf("deadline %d (%v) closed after %v: early", i, w, took)
				}
				// Waits well beyond this one are still running.
				for j, wj := range tc.waits {
					select {
					case <-chans[j]:
						if wj > w+2*deadlineGrain(wj)+100*time.Millisecond {
							t.Errorf("deadline %d (%v) closed with deadline %d (%v)", j, wj, i, w)
						}
					default:
					}
				}
			}
			d.mu.Lock()
			defer d.mu.Unlock()
			if len(d.slots) != 0 {
				t.Errorf("%d slots left after every deadline closed", len(d.slots))
			}
		})
	}
}

// Waiters asking for the same wait within one grain share a channel: one
// channel, not one per append.
func TestDeadlinesShare(t *testing.T) {
	var d deadlines
	wait := 30 * time.Second
	first := d.after(wait)
	shared := 0
	for range 100 {
		if d.after(wait) == first {
			shared++
		}
	}
	d.mu.Lock()
	slots := len(d.slots)
	d.mu.Unlock()
	// 100 calls take far less than a grain (100 ms); at worst they straddle
	// one boundary.
	if slots > 2 || shared < 50 {
		t.Fatalf("100 waits of %v made %d slots, %d shared the first channel", wait, slots, shared)
	}
	if n := testing.AllocsPerRun(100, func() { d.after(wait) }); n > 0.1 {
		t.Errorf("after allocates %v times a call in a shared grain; want none", n)
	}
}
