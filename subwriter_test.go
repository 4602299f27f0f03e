package picomq

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/streamstore"
)

// holdPut parks the next write of s's document until the returned release
// is called (the write then fails with fail), and returns a channel closed
// when the write is parked. Cleanup releases it if the test did not.
func (g *dueRig) holdPut(t *testing.T, s *subState, fail bool) (arrived <-chan struct{}, release func()) {
	t.Helper()
	h := &putHold{key: s.key, fail: fail, arrived: make(chan struct{}), release: make(chan struct{})}
	g.held.Store(h)
	released := false
	release = func() {
		if !released {
			released = true
			close(h.release)
		}
	}
	t.Cleanup(release)
	return h.arrived, release
}

// served is the answer to a request served in a goroutine.
type served struct {
	code int
	body string
}

// serveAsync serves op on s (as serve does) in a goroutine and returns
// where its answer arrives; everything that takes the manager's lock is
// in the goroutine, so that the test sees a request held up (answer).
func (g *dueRig) serveAsync(t *testing.T, s *subState, op, body string) <-chan served {
	t.Helper()
	method := http.MethodPost
	switch op {
	case "":
		method = http.MethodDelete
	case "get":
		method, op = http.MethodGet, ""
	}
	out := make(chan served, 1)
	go func() {
		// s's fields are read under the lock: its writer replaces them.
		g.m.mu.Lock()
		tok, id := g.m.tokenLocked(s), s.ID
		if strings.Contains(body, "%[") {
			body = fmt.Sprintf(body, s.WakeID, s.Generation)
		}
		g.m.mu.Unlock()
		req := httptest.NewRequest(method, dueRoot+"__ds/subscriptions/"+id+"/"+op, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+tok)
		rec := httptest.NewRecorder()
		switch {
		case method == http.MethodDelete:
			g.m.handleDelete(rec, req, dueRoot, id)
		case method == http.MethodGet:
			g.m.handleGet(rec, req, dueRoot, id)
		case op == "claim":
			g.m.handleClaim(rec, req, dueRoot, id)
		case op == "ack":
			g.m.handleAck(rec, req, dueRoot, id, false)
		default:
			panic("no such operation " + op)
		}
		out <- served{rec.Code, rec.Body.String()}
	}()
	return out
}

// answer waits for a request served by serveAsync. The bound is there to
// report a request stuck behind a parked write as a failure rather than
// hang the test binary: no request here waits for anything but the
// in-memory store.
func answer(t *testing.T, what string, ch <-chan served) served {
	t.Helper()
	select {
	case a := <-ch:
		return a
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: no answer in 10s (held up by another write?)", what)
		return served{}
	}
}

// withLock runs f with the manager's lock held, in a goroutine, and fails
// t if it cannot get the lock (see answer).
func (g *dueRig) withLock(t *testing.T, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		g.m.mu.Lock()
		defer g.m.mu.Unlock()
		f()
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: the manager's lock was not free in 10s (held across a write?)", what)
	}
}

// stored is subscription id's document as the bucket has it.
func (g *dueRig) stored(t *testing.T, id string) string {
	t.Helper()
	b, _, err := g.eng.GetDoc(context.Background(), subDocKey(dueRoot, id))
	if err != nil {
		t.Fatalf("reading %s's document: %v", id, err)
	}
	return string(b)
}

func heartbeat(offset uint64) string {
	return `{"wake_id":%[1]q,"generation":%[2]d,"acks":[{"stream":"events/a","offset":"` + position{seq: offset}.String() + `"}]}`
}

// TestSubscriptionWriterTurns: a subscription's document is written with
// the manager's lock released, one writer per subscription at a time. The
// manager used to write every document while holding its one lock, so a
// write in progress (25 ms or more to a cloud bucket) held up every other
// subscription's requests, every append's note and the tick: each case's
// first step hung until the parked write was let go.
func TestSubscriptionWriterTurns(t *testing.T) {
	claimed := func(id string) *subState {
		return &subState{ID: id, Config: subConfig{Type: "pull-wake"},
			Links:      map[string]*subLink{"events/a": {Glob: true, Acked: 1, Tail: 5, Stream: "x"}},
			Generation: 2, WakeID: "w_2", Holder: "w1", LeaseUntil: time.Now().Add(time.Hour).UnixMilli()}
	}
	for _, tc := range []struct {
		name string
		run  func(t *testing.T, g *dueRig)
	}{
		{"another subscription's ack, claim, read and tick go on", func(t *testing.T, g *dueRig) {
			a, b := g.add(t, claimed("a")), g.add(t, claimed("b"))
			c := g.add(t, &subState{ID: "c", Config: subConfig{Type: "pull-wake"},
				Links: map[string]*subLink{"events/a": {Glob: true, Acked: 1, Tail: 5, Stream: "x"}}})
			arrived, release := g.holdPut(t, a, false)
			ackA := g.serveAsync(t, a, "ack", heartbeat(2))
			<-arrived
			if got := answer(t, "ack of b", g.serveAsync(t, b, "ack", heartbeat(3))); got.code != 200 {
				t.Fatalf("ack of b: %d %s", got.code, got.body)
			}
			if got := answer(t, "claim of c", g.serveAsync(t, c, "claim", `{"worker":"w2"}`)); got.code != 200 {
				t.Fatalf("claim of c: %d %s", got.code, got.body)
			}
			// A read of a sees its saved state: not the cursor being written.
			if got := answer(t, "read of a", g.serveAsync(t, a, "get", "")); got.code != 200 || !strings.Contains(got.body, `"acked_offset":"`+position{seq: 1}.String()) {
				t.Fatalf("read of a during its write: %d %s, want acked at 1", got.code, got.body)
			}
			g.withLock(t, "tick", func() { g.m.tickLocked(time.Now().Add(2 * time.Hour)) })
			release()
			if got := answer(t, "ack of a", ackA); got.code != 200 {
				t.Fatalf("ack of a: %d %s", got.code, got.body)
			}
		}},
		{"a second ack waits for the first, and both apply in order", func(t *testing.T, g *dueRig) {
			a := g.add(t, claimed("a"))
			arrived, release := g.holdPut(t, a, false)
			first := g.serveAsync(t, a, "ack", heartbeat(2))
			<-arrived
			second := g.serveAsync(t, a, "ack", heartbeat(3))
			release()
			for i, ch := range []<-chan served{first, second} {
				if got := answer(t, "ack", ch); got.code != 200 {
					t.Fatalf("ack %d: %d %s", i+1, got.code, got.body)
				}
			}
			if doc := g.stored(t, "a"); !strings.Contains(doc, `"acked":3`) {
				t.Fatalf("document after both acks: %s, want acked 3", doc)
			}
		}},
		{"an append's note during the write is applied", func(t *testing.T, g *dueRig) {
			a := g.add(t, claimed("a"))
			arrived, release := g.holdPut(t, a, false)
			ack := g.serveAsync(t, a, "ack", heartbeat(3))
			<-arrived
			g.withLock(t, "append note", func() {
				g.m.applyNoteLocked(appendNote{name: dueRoot + "events/a", id: "x", first: 5, next: 8})
			})
			release()
			if got := answer(t, "ack", ack); got.code != 200 {
				t.Fatalf("ack: %d %s", got.code, got.body)
			}
			g.settle(t)
			if got := answer(t, "ack at the new tail", g.serveAsync(t, a, "ack", heartbeat(8))); got.code != 200 {
				t.Fatalf("ack at the tail the note moved: %d %s", got.code, got.body)
			}
			if doc := g.stored(t, "a"); !strings.Contains(doc, `"acked":8,"tail":8`) {
				t.Fatalf("document: %s, want acked and tail 8", doc)
			}
		}},
		{"appends to one stream during the write are kept as one note", func(t *testing.T, g *dueRig) {
			a := g.add(t, claimed("a"))
			arrived, release := g.holdPut(t, a, false)
			ack := g.serveAsync(t, a, "ack", heartbeat(3))
			<-arrived
			var kept int
			g.withLock(t, "append notes", func() {
				for next := uint64(6); next <= 1000; next++ {
					g.m.applyNoteLocked(appendNote{name: dueRoot + "events/a", id: "x", first: next - 1, next: next})
				}
				kept = len(a.kept)
			})
			release()
			if got := answer(t, "ack", ack); got.code != 200 {
				t.Fatalf("ack: %d %s", got.code, got.body)
			}
			if kept != 1 {
				t.Errorf("995 appends to one stream during the write kept %d notes, want 1", kept)
			}
			g.settle(t)
			// A tail that only grows during a lease is not written
			// (quietTail): the note is applied in memory.
			if got := g.snap(a).Links["events/a"].Tail; got != 1000 {
				t.Fatalf("tail %d after the notes, want 1000", got)
			}
		}},
		{"a failed write changes nothing, and the note behind it survives", func(t *testing.T, g *dueRig) {
			a := g.add(t, claimed("a"))
			lease := g.snap(a).LeaseUntil
			arrived, release := g.holdPut(t, a, true)
			ack := g.serveAsync(t, a, "ack", heartbeat(3))
			<-arrived
			g.withLock(t, "append note", func() {
				g.m.applyNoteLocked(appendNote{name: dueRoot + "events/a", id: "x", first: 5, next: 8})
			})
			release()
			if got := answer(t, "ack", ack); got.code != 503 {
				t.Fatalf("ack whose write failed: %d %s, want 503", got.code, got.body)
			}
			g.settle(t)
			got := g.snap(a)
			if l := got.Links["events/a"]; l.Acked != 1 || l.Tail != 8 || got.LeaseUntil != lease {
				t.Fatalf("after the failed ack: acked %d tail %d lease %d, want 1, 8 and %d", l.Acked, l.Tail, got.LeaseUntil, lease)
			}
			// The tail the note moved is not written during the lease
			// (quietTail); the refused ack is not either.
			if doc := g.stored(t, "a"); !strings.Contains(doc, `"acked":1,"tail":5`) {
				t.Fatalf("document: %s, want acked 1 and tail 5", doc)
			}
		}},
		{"a stream's delete during the write that links it is applied", func(t *testing.T, g *dueRig) {
			g.createStream(t, "wake", 0)
			p := g.add(t, &subState{ID: "p", Config: subConfig{Type: "pull-wake"}, Links: map[string]*subLink{}})
			arrived, release := g.holdPut(t, p, false)
			g.withLock(t, "append note", func() {
				g.m.applyNoteLocked(appendNote{name: dueRoot + "events/b", id: "y", first: 0, next: 2})
			})
			<-arrived // the append's link of events/b is being written
			g.withLock(t, "delete note", func() {
				g.m.applyNoteLocked(appendNote{name: dueRoot + "events/b", id: "y", deleted: true})
			})
			release()
			g.settle(t)
			if l := g.snap(p).Links["events/b"]; l != nil && (!l.Gone || l.Tail != 0) {
				t.Fatalf("link of the deleted stream: %+v, want none, or gone at 0", *l)
			}
		}},
		{"a delete during the write waits for it, and wins", func(t *testing.T, g *dueRig) {
			a := g.add(t, claimed("a"))
			arrived, release := g.holdPut(t, a, false)
			ack := g.serveAsync(t, a, "ack", heartbeat(3))
			<-arrived
			del := g.serveAsync(t, a, "", "")
			release()
			if got := answer(t, "ack", ack); got.code != 200 {
				t.Fatalf("ack: %d %s", got.code, got.body)
			}
			if got := answer(t, "delete", del); got.code != 204 {
				t.Fatalf("delete: %d %s", got.code, got.body)
			}
			if _, _, err := g.eng.GetDoc(context.Background(), subDocKey(dueRoot, "a")); !errors.Is(err, streamstore.ErrNotFound) {
				t.Fatalf("document after the delete: %v, want not found", err)
			}
			if got := answer(t, "ack after the delete", g.serveAsync(t, a, "ack", heartbeat(3))); got.code != 404 {
				t.Fatalf("ack after the delete: %d %s, want 404", got.code, got.body)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := newDueRig(t)
			tc.run(t, g)
			g.settle(t)
		})
	}
}

// TestSubscriptionBackgroundWritesBounded: an append to a stream that many
// subscriptions follow starts a write of each of their documents, at most
// subBackgroundWrites of them under way at once, and every one is made.
// Without the bound all of them went to the bucket together.
func TestSubscriptionBackgroundWritesBounded(t *testing.T) {
	const subs = 3 * subBackgroundWrites
	g := newDueRig(t)
	g.createStream(t, "wake", 0)
	all := make([]*subState, subs)
	for i := range all {
		all[i] = g.add(t, &subState{ID: fmt.Sprintf("s%d", i), Config: subConfig{Type: "pull-wake"}, Links: map[string]*subLink{}})
	}
	g.putLatency.Store(int64(20 * time.Millisecond))
	g.withLock(t, "append note", func() {
		g.m.applyNoteLocked(appendNote{name: dueRoot + "events/a", id: "x", first: 0, next: 1})
	})
	g.settle(t)
	if most := g.putsMost.Load(); most > subBackgroundWrites {
		t.Errorf("%d document writes under way at once, want at most %d", most, subBackgroundWrites)
	}
	for _, s := range all {
		if got := g.snap(s); got.Links["events/a"] == nil || got.Links["events/a"].Tail != 1 || got.Generation != 1 {
			t.Errorf("subscription %s after the append: links %v generation %d, want events/a at tail 1 and a wake", got.ID, got.Links, got.Generation)
		}
	}
}
