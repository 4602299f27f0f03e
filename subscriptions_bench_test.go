package picomq

import (
	"fmt"
	"testing"
	"time"
)

// benchSubManager is a loaded manager holding n subscriptions, half of
// them a pattern and half explicit streams, spread over roots by root(i).
func benchSubManager(b *testing.B, n int, root func(i int) string) *subManager {
	b.Helper()
	m := &subManager{subs: map[string]*subState{}}
	for i := range n {
		s := &subState{ID: fmt.Sprintf("s%d", i), Root: root(i), Links: map[string]*subLink{}}
		if i%2 == 0 {
			s.Config.Pattern = fmt.Sprintf("orders/%d/*", i)
		} else {
			s.Config.Streams = []string{fmt.Sprintf("stream-%d", i)}
			s.Links[s.Config.Streams[0]] = &subLink{Explicit: true, Stream: "id"}
		}
		s.key = subDocKey(s.Root, s.ID)
		m.addSubLocked(s)
	}
	return m
}

// BenchmarkSubscriptionMatch is the subscription manager's work for one
// append notification of a stream no subscription follows, with n
// subscriptions under the stream's root, or under n other roots.
func BenchmarkSubscriptionMatch(b *testing.B) {
	for _, where := range []struct {
		name string
		root func(i int) string
	}{
		{"same-root", func(int) string { return "/app/" }},
		{"other-roots", func(i int) string { return fmt.Sprintf("/tenant-%d/", i) }},
	} {
		for _, n := range []int{10, 1000, 100000} {
			b.Run(fmt.Sprintf("%s/subs=%d", where.name, n), func(b *testing.B) {
				m := benchSubManager(b, n, where.root)
				note := appendNote{name: "/app/unrelated/stream", id: "x", first: 0, next: 1}
				for b.Loop() {
					m.applyNoteLocked(note)
				}
			})
		}
	}
}

// BenchmarkSubscriptionTick is one of the manager's 100 ms ticks with n
// idle subscriptions (nothing pending, no wake in flight), which is to say
// with nothing due: it should cost nothing, however many there are.
func BenchmarkSubscriptionTick(b *testing.B) {
	for _, n := range []int{10, 1000, 100000} {
		b.Run(fmt.Sprintf("subs=%d", n), func(b *testing.B) {
			m := benchSubManager(b, n, func(int) string { return "/app/" })
			now := time.Now()
			for b.Loop() {
				m.tickLocked(now)
			}
		})
	}
}
