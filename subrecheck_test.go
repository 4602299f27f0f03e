package picomq

import (
	"errors"
	"testing"

	"github.com/picomq/caddy-picomq/streamstore"
)

// recheckLinkLocked applies a lookup of a stream that failed at load to
// the link only while that is right: a tail in the same stream always
// (it only grows), anything else only to a link no note has changed
// since the load; a lookup that fails again, or a subscription whose
// writer is at work, is tried again. None of these cases writes the
// document (a wake is in flight, and a tail alone is not written then);
// those that do are TestTailsWrittenByNoneAfterALoadThatCouldNotReadTheStream's.
func TestRecheckLinkLocked(t *testing.T) {
	failed := linkHead{err: errors.New("store refused")}
	for _, tc := range []struct {
		name      string
		link      subLink // as it is now
		loaded    subLink // as the load left it
		head      linkHead
		busy      bool
		settled   bool
		wantTail  uint64
		wantAcked uint64
		wantID    string
	}{
		{name: "tail grew in the same stream", link: subLink{Explicit: true, Acked: 1, Tail: 1, Stream: "s1"}, loaded: subLink{Tail: 1, Stream: "s1"},
			head: linkHead{info: streamstore.Info{ID: "s1", NextSeq: 4}}, settled: true, wantTail: 4, wantAcked: 1, wantID: "s1"},
		{name: "same stream, a note went further", link: subLink{Explicit: true, Acked: 1, Tail: 6, Stream: "s1"}, loaded: subLink{Tail: 1, Stream: "s1"},
			head: linkHead{info: streamstore.Info{ID: "s1", NextSeq: 4}}, settled: true, wantTail: 6, wantAcked: 1, wantID: "s1"},
		{name: "another stream, a note moved the link since", link: subLink{Explicit: true, Acked: 0, Tail: 3, Stream: "s3"}, loaded: subLink{Tail: 1, Stream: "s1"},
			head: linkHead{info: streamstore.Info{ID: "s2", NextSeq: 2}}, settled: true, wantTail: 3, wantAcked: 0, wantID: "s3"},
		{name: "stream gone, a note moved the link since", link: subLink{Explicit: true, Acked: 0, Tail: 3, Stream: "s3"}, loaded: subLink{Tail: 1, Stream: "s1"},
			head: linkHead{err: streamstore.ErrNotFound}, settled: true, wantTail: 3, wantAcked: 0, wantID: "s3"},
		{name: "still unreadable", link: subLink{Explicit: true, Acked: 1, Tail: 1, Stream: "s1"}, loaded: subLink{Tail: 1, Stream: "s1"},
			head: failed, settled: false, wantTail: 1, wantAcked: 1, wantID: "s1"},
		{name: "its writer at work", link: subLink{Explicit: true, Acked: 1, Tail: 1, Stream: "s1"}, loaded: subLink{Tail: 1, Stream: "s1"},
			head: linkHead{info: streamstore.Info{ID: "s1", NextSeq: 4}}, busy: true, settled: false, wantTail: 1, wantAcked: 1, wantID: "s1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := tc.link
			s := &subState{ID: "p", Root: "/r/", key: "k", WakeID: "w", Holder: "w1", LeaseUntil: 1 << 60,
				Config: subConfig{Type: "pull-wake"}, Links: map[string]*subLink{"a": &l}}
			if tc.busy {
				s.busy = make(chan struct{})
			}
			m := &subManager{subs: map[string]*subState{"k": s}}
			r := linkRecheck{sub: s, path: "a", name: "/r/a", stream: tc.loaded.Stream, tail: tc.loaded.Tail}
			if got := m.recheckLinkLocked(r, tc.head); got != tc.settled {
				t.Errorf("settled %v, want %v", got, tc.settled)
			}
			got := s.Links["a"]
			if got.Tail != tc.wantTail || got.Acked != tc.wantAcked || got.Stream != tc.wantID {
				t.Errorf("link %+v, want tail %d acked %d stream %q", *got, tc.wantTail, tc.wantAcked, tc.wantID)
			}
		})
	}
}
