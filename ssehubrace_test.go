package picomq

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// blockingSource holds the first frameAt of a hub until release is closed
// (a slow read), then reads with the hub's context.
type blockingSource struct {
	hubSource
	once    sync.Once
	entered chan struct{}
	release chan struct{}
}

func (b *blockingSource) frameAt(ctx context.Context, pos position, tail uint64) (*sseFrame, error) {
	first := false
	b.once.Do(func() { first = true })
	if first {
		// A slow read: the hub's context may end meanwhile.
		close(b.entered)
		<-b.release
	}
	return b.hubSource.frameAt(ctx, pos, tail)
}

// The last feed of a hub leaves while the hub's run is reading a record;
// a new feed parks at the same position (the hub's next has not moved yet)
// and starts a new run. The old run, on its way out, still moves h.next past
// the new feed, and the new run waits there: the new feed never gets the
// record that is already in the stream.
// A hub's run that the last feed's leaving cancelled can still finish a
// read on its way out. It moved the hub's position past the record it
// read, so the run a newly parked feed started waited beyond that record,
// and the feed got it only with the next append or at its reconnect
// interval. A replaced run now leaves the position alone.
func TestHubReplacedRunLeavesItsPlace(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	s, eng, key, pos := newHubStream(t)
	src := &blockingSource{hubSource: dsHubSource{d: s.proto, eng: eng, key: key},
		entered: make(chan struct{}), release: make(chan struct{})}
	a := fakeHubFeed(httptest.NewRecorder(), "c", pos)
	h := s.proto.hubs.park(src, eng, key, pos, a)
	if h == nil {
		t.Fatal("a not parked")
	}
	s.do(t, "POST", "/s", "x", ct, "text/plain").want(t, 204)
	select {
	case <-src.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("hub never read")
	}
	if err := h.leave(a); err != nil {
		t.Fatalf("a had been let go: %v", err)
	}
	recB := httptest.NewRecorder()
	b := fakeHubFeed(recB, "c", pos)
	if h2 := s.proto.hubs.park(src, eng, key, pos, b); h2 != h {
		t.Fatalf("b parked in %p, want the hub %p", h2, h)
	}
	close(src.release)
	want := position{pos.seq + 1, 0}
	deadline := time.Now().Add(2 * time.Second)
	for {
		b.mu.Lock()
		at := b.next
		b.mu.Unlock()
		if at == want {
			return
		}
		if time.Now().After(deadline) {
			h.mu.Lock()
			hn := h.next
			h.mu.Unlock()
			t.Fatalf("record %s..%s is in the stream, but feed b is still at %s after 2s (hub waits at %s); b got %q",
				pos, want, at, hn, recB.Body.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// stallWriter is a response whose first write waits for release, then
// fails with fail if that is set (the client was gone).
type stallWriter struct {
	*httptest.ResponseRecorder
	entered, release chan struct{}
	fail             error
	n                int
}

func (w *stallWriter) Write(b []byte) (int, error) {
	w.n++
	if w.n == 1 {
		close(w.entered)
		<-w.release
		if w.fail != nil {
			return 0, w.fail
		}
	}
	return w.ResponseRecorder.Write(b)
}

func (w *stallWriter) Flush() {}

// A feed that parks while the hub is writing the stream's final control
// event to the other feeds is let go with errFeedClosed (which its handler
// takes as "the final events are written") although nothing was written
// to it: its client never gets streamClosed.
// A feed that parks while the hub writes a stream's close to the others,
// after the pass took its list of feeds, was let go as "closing events
// written" with nothing written: its client saw the response end without
// the final control event section 5.8 requires. It now goes on by itself
// and writes them.
func TestHubFeedParkedDuringCloseGetsTheCloseEvents(t *testing.T) {
	s, eng, key, pos := newHubStream(t)
	// a's write is held on purpose while c parks: not a stall.
	s.proto.hubs.stallTick = time.Hour
	src := dsHubSource{d: s.proto, eng: eng, key: key}
	slow := &stallWriter{ResponseRecorder: httptest.NewRecorder(), entered: make(chan struct{}), release: make(chan struct{})}
	a := fakeHubFeed(slow, "c", pos)
	h := s.proto.hubs.park(src, eng, key, pos, a)
	if h == nil {
		t.Fatal("a not parked")
	}
	s.do(t, "POST", "/s", "", "Stream-Closed", "true").want(t, 204)
	select {
	case <-slow.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the hub never wrote the close to a")
	}
	// c read the stream just before the close (open, at the tail) and
	// parks now, while the hub is still writing to a.
	recC := httptest.NewRecorder()
	c := fakeHubFeed(recC, "c", pos)
	if h2 := s.proto.hubs.park(src, eng, key, pos, c); h2 != h {
		t.Fatalf("c parked in %p, want %p", h2, h)
	}
	close(slow.release)
	select {
	case <-c.done:
	case <-time.After(5 * time.Second):
		t.Fatal("c never let go")
	}
	if !strings.Contains(slow.Body.String(), `"streamClosed":true`) {
		t.Fatalf("a got %q", slow.Body.String())
	}
	if errors.Is(c.ended, errFeedClosed) && !strings.Contains(recC.Body.String(), `"streamClosed":true`) {
		t.Fatalf("c ended with %v (the handler returns without writing anything more) but got %q: no streamClosed control event", c.ended, recC.Body.String())
	}
}

var _ http.Flusher = (*stallWriter)(nil)
