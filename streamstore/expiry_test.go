package streamstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

func TestExpiryKeyRoundTripAndOrder(t *testing.T) {
	long := "/" + strings.Repeat("x", 250) // hex longer than one key folder
	tests := []struct {
		at   int64
		name string
	}{
		{0, "/a"},
		{59_999, "/b"},
		{60_000, "/a"},
		{1_796_000_000_000, long},
		{1_796_000_060_000, "/"},
	}
	var keys []string
	for _, tc := range tests {
		k := expiryKey(tc.at, tc.name, newID())
		second, name, err := parseExpiryKey(k)
		if err != nil || second != tc.at/expirySecond || name != tc.name {
			t.Errorf("parseExpiryKey(%q) = %d, %q, %v; want %d, %q", k, second, name, err, tc.at/expirySecond, tc.name)
		}
		keys = append(keys, k)
	}
	sorted := slices.Clone(keys)
	slices.Sort(sorted)
	for i := 1; i < len(sorted); i++ {
		a, _, _ := parseExpiryKey(sorted[i-1])
		b, _, _ := parseExpiryKey(sorted[i])
		if a > b {
			t.Errorf("markers do not sort by second: %q before %q", sorted[i-1], sorted[i])
		}
	}
	for _, bad := range []string{"expiry/", "expiry/12/", "expiry/12/2f", "expiry/x/2f.ab", "streams/2f.ab", "expiry/000000000001/zz.ab"} {
		if _, _, err := parseExpiryKey(bad); err == nil {
			t.Errorf("parseExpiryKey(%q) accepted", bad)
		}
	}
}

// TestSweepDeletesExpiredStreams runs sweeps at chosen times over streams
// with and without expiries: each sweep must delete exactly the streams that
// have expired by then, leave markers only for streams that can still
// expire, and follow a TTL that a read renewed.
func TestSweepDeletesExpiredStreams(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	begin := time.Now()
	creates := []struct {
		name   string
		expiry Expiry
	}{
		{"/ttl-1m", Expiry{TTL: time.Minute}},
		{"/deadline-2m", Expiry{ExpiresAt: begin.Add(2 * time.Minute)}},
		{"/ttl-1h", Expiry{TTL: time.Hour}},
		{"/renewed", Expiry{TTL: time.Minute}},
		{"/forever", Expiry{}},
	}
	for _, c := range creates {
		if _, _, err := e.Create(ctx, c.name, CreateRequest{ContentType: "text/plain", Expiry: c.expiry}); err != nil {
			t.Fatalf("create %s: %v", c.name, err)
		}
		if _, err := e.Append(ctx, c.name, AppendRequest{Records: recs("x")}); err != nil {
			t.Fatalf("append %s: %v", c.name, err)
		}
	}
	if got := len(st.Keys(expiryPrefix)); got != 4 {
		t.Fatalf("%d expiry markers after the creates, want 4 (one per stream that can expire): %v", got, st.Keys(expiryPrefix))
	}
	// "/renewed" was read 10 minutes in: it now expires at 11 minutes.
	s, err := e.stream(ctx, "/renewed")
	if err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	s.touched = begin.Add(10 * time.Minute).UnixMilli()
	s.mu.Unlock()

	exists := func(name string) bool { return len(streamKeys(t, st, metaKey(name))) == 1 }
	steps := []struct {
		at      time.Duration // after begin
		deleted int
		alive   []string
		markers int
	}{
		{at: 30 * time.Second, deleted: 0, alive: []string{"/ttl-1m", "/deadline-2m", "/ttl-1h", "/renewed", "/forever"}, markers: 4},
		{at: 3 * time.Minute, deleted: 2, alive: []string{"/ttl-1h", "/renewed", "/forever"}, markers: 2},
		{at: 5 * time.Minute, deleted: 0, alive: []string{"/ttl-1h", "/renewed", "/forever"}, markers: 2},
		{at: 13 * time.Minute, deleted: 1, alive: []string{"/ttl-1h", "/forever"}, markers: 1},
		{at: 62 * time.Minute, deleted: 1, alive: []string{"/forever"}, markers: 0},
	}
	for _, step := range steps {
		n, err := e.SweepExpired(ctx, begin.Add(step.at))
		if err != nil {
			t.Fatalf("sweep at +%v: %v", step.at, err)
		}
		if n != step.deleted {
			t.Errorf("sweep at +%v deleted %d streams, want %d", step.at, n, step.deleted)
		}
		for _, c := range creates {
			if want := slices.Contains(step.alive, c.name); exists(c.name) != want {
				t.Errorf("after the sweep at +%v: %s exists %v, want %v", step.at, c.name, exists(c.name), want)
			}
		}
		if got := st.Keys(expiryPrefix); len(got) != step.markers {
			t.Errorf("after the sweep at +%v: markers %v, want %d", step.at, got, step.markers)
		}
	}
	if got := e.Stats().Expired; got != 4 {
		t.Errorf("Stats().Expired = %d after the sweeps, want 4", got)
	}
	// Deleted means gone for clients and its data on the way out.
	if _, err := e.Read(ctx, "/ttl-1m", ReadRequest{}); err == nil {
		t.Error("a swept stream still reads")
	}
	if len(st.Keys("gc/")) == 0 && len(st.Keys("data/")) != 0 {
		t.Error("swept streams left data and no tombstone")
	}
}

// TestSweepDropsMarkersOfMissingStreams: a create that failed after its
// marker, or a stream deleted by a client, leaves a marker naming nothing.
func TestSweepDropsMarkersOfMissingStreams(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	if _, err := st.Put(ctx, expiryKey(time.Now().UnixMilli(), "/never-created", newID()), nil, segment.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Create(ctx, "/deleted", CreateRequest{ContentType: "text/plain", Expiry: Expiry{TTL: time.Minute}}); err != nil {
		t.Fatal(err)
	}
	if err := e.Delete(ctx, "/deleted"); err != nil {
		t.Fatal(err)
	}
	if got := len(st.Keys(expiryPrefix)); got != 2 {
		t.Fatalf("%d markers before the sweep, want 2", got)
	}
	n, err := e.SweepExpired(ctx, time.Now().Add(5*time.Minute))
	if err != nil || n != 0 {
		t.Fatalf("sweep: deleted %d, %v; want 0, nil", n, err)
	}
	if got := st.Keys(expiryPrefix); len(got) != 0 {
		t.Errorf("markers left: %v", got)
	}
}

// TestCreateOfATakenNameLeavesNoMarker: a create of a name that is not in
// memory writes its marker before it finds the name taken; the create
// answers "exists" or "conflict" and must take that marker back.
func TestCreateOfATakenNameLeavesNoMarker(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	req := CreateRequest{ContentType: "text/plain", Expiry: Expiry{TTL: time.Hour}}
	if _, _, err := e.Create(ctx, "/taken", req); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	e = startEngine(t, st, Config{}) // a fresh node: nothing in memory
	other := req
	other.Expiry.TTL = 2 * time.Hour
	for _, tc := range []struct {
		what    string
		req     CreateRequest
		wantErr error
	}{
		{"the same create again", req, nil},
		{"a create with another TTL", other, ErrConflict},
	} {
		_, created, err := e.Create(ctx, "/taken", tc.req)
		if created || !errors.Is(err, tc.wantErr) {
			t.Errorf("%s: created %v, %v; want false, %v", tc.what, created, err, tc.wantErr)
		}
		if got := st.Keys(expiryPrefix); len(got) != 1 {
			t.Errorf("%s: markers %v; want only the first create's", tc.what, got)
		}
		e.mu.Lock()
		delete(e.streams, "/taken") // make the next create find it absent from memory again
		e.mu.Unlock()
	}
}

// TestSweepKeepsExpiredSourcesWhileForksRead: an expired source with a
// live fork is only soft-deleted by the sweep, the fork still reads what
// it inherited, and the source goes for good with its last fork; a fork
// that inherited its source's TTL expires with it.
func TestSweepKeepsExpiredSourcesWhileForksRead(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	begin := time.Now()
	ttl := Expiry{TTL: time.Minute}
	for _, src := range []string{"/src-a", "/src-b"} {
		if _, _, err := e.Create(ctx, src, CreateRequest{ContentType: "text/plain", Expiry: ttl, Records: recs("ab", "cd")}); err != nil {
			t.Fatal(err)
		}
	}
	// /fork-a never expires; /fork-b inherits /src-b's TTL.
	if _, _, err := e.Create(ctx, "/fork-a", CreateRequest{Fork: &ForkFrom{Source: "/src-a", Seq: 2}, Expiry: Expiry{ExpiresAt: begin.Add(24 * time.Hour)}}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Create(ctx, "/fork-b", CreateRequest{Fork: &ForkFrom{Source: "/src-b", Seq: 2}}); err != nil {
		t.Fatal(err)
	}
	if n, err := e.SweepExpired(ctx, begin.Add(3*time.Minute)); err != nil || n != 3 {
		t.Fatalf("sweep: deleted %d, %v; want 3 (both sources, /fork-b)", n, err)
	}
	if got := readAll(t, e, "/fork-a"); len(got) != 2 || got[0] != "ab" || got[1] != "cd" {
		t.Errorf("/fork-a after its source expired: %q", got)
	}
	for _, tc := range []struct {
		name   string
		inMeta bool // its metadata is still in the bucket
	}{
		{"/src-a", true}, // soft-deleted: /fork-a reads it
		{"/src-b", false},
		{"/fork-b", false},
		{"/fork-a", true},
	} {
		if got := len(streamKeys(t, st, metaKey(tc.name))) == 1; got != tc.inMeta {
			t.Errorf("%s: metadata in the bucket %v, want %v", tc.name, got, tc.inMeta)
		}
	}
	// /src-a's is the one its soft delete writes, for the sweep to
	// settle its fork count.
	if got := st.Keys(expiryPrefix); len(got) != 2 {
		t.Errorf("markers %v; want /fork-a's and soft-deleted /src-a's", got)
	}
	if err := e.Delete(ctx, "/fork-a"); err != nil {
		t.Fatal(err)
	}
	if got := streamKeys(t, st, metaPrefix); len(got) != 0 {
		t.Errorf("after the last fork went: %v in the bucket", got)
	}
}

// TestIdleSweepCostsOneList backs the claim that an idle storage pays one
// LIST per sweep: with markers present but none due, a sweep makes exactly
// one request, and it reads no metadata.
func TestIdleSweepCostsOneList(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var (
		counting atomic.Bool
		mu       sync.Mutex
		ops      = map[string]int{}
	)
	st.SetFail(func(op, key string) error {
		// The engine's other background work (GC, lease) is not counted.
		if counting.Load() && (strings.HasPrefix(key, expiryPrefix) || strings.HasPrefix(key, metaPrefix)) {
			mu.Lock()
			defer mu.Unlock()
			ops[op]++
		}
		return nil
	})
	e := startEngine(t, st, Config{})
	for i := range 3 {
		name := fmt.Sprintf("/idle/%d", i)
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain", Expiry: Expiry{TTL: time.Hour}}); err != nil {
			t.Fatal(err)
		}
	}
	counting.Store(true)
	if n, err := e.SweepExpired(ctx, time.Now()); err != nil || n != 0 {
		t.Fatalf("sweep: %d, %v", n, err)
	}
	counting.Store(false)
	mu.Lock()
	defer mu.Unlock()
	if len(ops) != 1 || ops["LIST"] != 1 {
		t.Errorf("a sweep with nothing due made %v on markers and metadata; want one LIST", ops)
	}
}

// TestAccessAfterExpiryIsRefused holds a handle that live judged unexpired,
// lets the stream expire, and then appends through it: the sweep may
// already be deleting the stream, so the append must not be acknowledged
// or renew the TTL; it finds the stream gone instead. (Trim and Read take
// the same check, but look the stream up themselves, so no test can hand
// them a handle from before the expiry.)
func TestAccessAfterExpiryIsRefused(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name   string
		expiry func() Expiry
		access func(e *Engine, s *stream) error
	}{
		{"append, deadline", func() Expiry { return Expiry{ExpiresAt: time.Now().Add(300 * time.Millisecond)} },
			func(e *Engine, s *stream) error {
				_, _, err := e.appendTo(ctx, s, AppendRequest{Records: recs("late")})
				return err
			}},
		{"append, ttl", func() Expiry { return Expiry{TTL: time.Second} },
			func(e *Engine, s *stream) error {
				_, _, err := e.appendTo(ctx, s, AppendRequest{Records: recs("late")})
				return err
			}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := startEngine(t, memstore.New(), Config{})
			const name = "/expiring"
			if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain", Expiry: tc.expiry()}); err != nil {
				t.Fatal(err)
			}
			if _, err := e.Append(ctx, name, AppendRequest{Records: recs("a", "b")}); err != nil {
				t.Fatal(err)
			}
			s, err := e.live(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			s.mu.Lock()
			at := s.expiresAtLocked()
			s.mu.Unlock()
			time.Sleep(time.Until(time.UnixMilli(at)) + 20*time.Millisecond)

			err = tc.access(e, s)
			if err == nil {
				t.Fatal("an access after the expiry was accepted")
			}
			if !errors.Is(err, errStale) && !errors.Is(err, ErrNotFound) {
				t.Fatalf("access after the expiry: %v, want the stream gone", err)
			}
			s.mu.Lock()
			renewed := s.touched >= at
			s.mu.Unlock()
			if renewed {
				t.Error("the access after the expiry renewed the TTL")
			}
			if _, err := e.Read(ctx, name, ReadRequest{Seq: 0}); !errors.Is(err, ErrNotFound) {
				t.Errorf("read after the expiry: %v, want ErrNotFound", err)
			}
		})
	}
}

// TestWaitingReadersKeepATTLStreamAlive: a reader waiting at the tail of a
// stream whose TTL is shorter than the wait (a long-poll, an SSE feed) is
// reading it all along, and reads renew the TTL: the stream is still there
// when the wait ends. It used to expire under the waiter, whose next
// request found it gone. A deadline (ExpiresAt) is not renewed: the wait
// ends at it, the stream gone, rather than go on waiting for a stream
// that no longer exists.
func TestWaitingReadersKeepATTLStreamAlive(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{})
	for _, tc := range []struct {
		name     string
		ttl      time.Duration
		deadline time.Duration // from the create; 0: none
		wait     time.Duration
		wantErr  error // what Wait returns
		alive    bool  // the stream exists after the wait
	}{
		{"/ttl", time.Second, 0, 2500 * time.Millisecond, context.DeadlineExceeded, true},
		{"/deadline", 0, 1500 * time.Millisecond, time.Minute, ErrNotFound, false},
		{"/ttl-and-deadline", time.Second, 1500 * time.Millisecond, time.Minute, ErrNotFound, false},
	} {
		expiry := Expiry{TTL: tc.ttl}
		if tc.deadline > 0 {
			expiry.ExpiresAt = time.Now().Add(tc.deadline)
		}
		info, _, err := e.Create(ctx, tc.name, CreateRequest{ContentType: "text/plain", Expiry: expiry})
		if err != nil {
			t.Fatal(err)
		}
		began := time.Now()
		wctx, cancel := context.WithTimeout(ctx, tc.wait)
		_, err = e.Wait(wctx, tc.name, info.ID, 0)
		cancel()
		if !errors.Is(err, tc.wantErr) {
			t.Errorf("%s: Wait returned %v, want %v", tc.name, err, tc.wantErr)
		}
		if tc.deadline > 0 {
			// It ends at the deadline, not at the end of its own wait.
			if took := time.Since(began); took < tc.deadline-100*time.Millisecond || took > tc.deadline+time.Second {
				t.Errorf("%s: Wait ended %v after it began; the deadline was %v after the create", tc.name, took, tc.deadline)
			}
		}
		if _, err := e.Head(ctx, tc.name); (err == nil) != tc.alive {
			t.Errorf("%s: Head after the wait: %v, want the stream alive: %v", tc.name, err, tc.alive)
		}
	}
}

// TestExpiredSourceIsGoneFromTheFirstAccess: a source that expires while a
// fork reads it is soft-deleted by the access that finds it expired, and
// that access answers ErrGone, as every later one does (it answered
// ErrNotFound, and the next ErrGone); the fork reads on.
func TestExpiredSourceIsGoneFromTheFirstAccess(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{})
	deadline := time.Now().Add(300 * time.Millisecond)
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Expiry: Expiry{ExpiresAt: deadline}, Records: recs("ab")}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Create(ctx, "/fork", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1}, Expiry: Expiry{ExpiresAt: deadline.Add(time.Hour)}}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Until(deadline) + 20*time.Millisecond)
	for i := range 2 {
		if _, err := e.Head(ctx, "/src"); !errors.Is(err, ErrGone) {
			t.Errorf("access %d after the expiry: %v, want ErrGone", i+1, err)
		}
	}
	if got := readAll(t, e, "/fork"); fmt.Sprint(got) != "[ab]" {
		t.Errorf("the fork reads %q", got)
	}
}

// TestDeleteRemovesADeadlineMarker: deleting a stream with a deadline (and
// no TTL) removes its expiry marker, which would otherwise stay in the
// bucket until the deadline; a marker whose stream is soft-deleted stays,
// as the stream does, and goes with the stream, as does the marker its
// soft delete wrote.
func TestDeleteRemovesADeadlineMarker(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	far := Expiry{ExpiresAt: time.Now().Add(365 * 24 * time.Hour)}
	for _, name := range []string{"/a", "/b"} {
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain", Expiry: far, Records: recs("x")}); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := e.Create(ctx, "/bf", CreateRequest{Fork: &ForkFrom{Source: "/b", Seq: 1}}); err != nil {
		t.Fatal(err)
	}
	if got := st.Keys(expiryPrefix); len(got) != 3 {
		t.Fatalf("markers %v, want one per stream", got)
	}
	for _, name := range []string{"/a", "/b"} {
		if err := e.Delete(ctx, name); err != nil {
			t.Fatal(err)
		}
	}
	if got := st.Keys(expiryPrefix); len(got) != 3 {
		t.Errorf("markers after the deletes: %v, want /b's two (its deadline's, and its soft delete's to settle it) and /bf's", got)
	}
	if err := e.Delete(ctx, "/bf"); err != nil {
		t.Fatal(err)
	}
	if got := st.Keys(expiryPrefix); len(got) != 0 {
		t.Errorf("markers once every stream is gone: %v", got)
	}
}

// TestRefusedWritesTouchNothing: an append, a trim or an exclusive create
// the engine refuses changes nothing: not even a sliding TTL's last access,
// which a refused append or trim moved on before it was judged (kept in
// memory, and written to the WAL when the stream left it). An append that
// is accepted, or a producer's duplicate answered with success, is an
// access (the controls).
func TestRefusedWritesTouchNothing(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{})
	const name, closed = "/refused-writes", "/refused-writes-closed"
	for _, n := range []string{name, closed} {
		if _, _, err := e.Create(ctx, n, CreateRequest{ContentType: "text/plain", Expiry: Expiry{TTL: time.Minute}}); err != nil {
			t.Fatal(err)
		}
	}
	prod := func(epoch, seq uint64) *Producer { return &Producer{ID: "p", Epoch: epoch, Seq: seq} }
	if _, err := e.Append(ctx, name, AppendRequest{Records: recs("a"), Producer: prod(1, 0), StreamSeq: "5"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Append(ctx, closed, AppendRequest{Close: true}); err != nil {
		t.Fatal(err)
	}
	touched := func(n string) int64 {
		t.Helper()
		s, err := e.live(ctx, n)
		if err != nil {
			t.Fatal(err)
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.touched
	}
	five := uint64(5)
	for _, c := range []struct {
		name    string
		stream  string
		do      func() error
		refused bool
	}{
		{"a match seq that is not the tail", name, func() error {
			_, err := e.Append(ctx, name, AppendRequest{Records: recs("x"), MatchSeq: &five})
			return err
		}, true},
		{"a producer seq past the next", name, func() error {
			_, err := e.Append(ctx, name, AppendRequest{Records: recs("x"), Producer: prod(1, 5)})
			return err
		}, true},
		{"a fenced producer epoch", name, func() error {
			_, err := e.Append(ctx, name, AppendRequest{Records: recs("x"), Producer: prod(0, 0)})
			return err
		}, true},
		{"a Stream-Seq not after the last", name, func() error {
			_, err := e.Append(ctx, name, AppendRequest{Records: recs("x"), StreamSeq: "4"})
			return err
		}, true},
		{"another content type", name, func() error {
			_, err := e.Append(ctx, name, AppendRequest{Records: recs("x"), ContentType: "image/png"})
			return err
		}, true},
		{"an append to a closed stream", closed, func() error {
			_, err := e.Append(ctx, closed, AppendRequest{Records: recs("x")})
			return err
		}, true},
		{"a trim beyond the tail", name, func() error {
			_, err := e.Trim(ctx, name, 9)
			return err
		}, true},
		{"a create that asks for a new stream", name, func() error {
			_, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain", Expiry: Expiry{TTL: time.Minute}, Exclusive: true})
			if !errors.Is(err, ErrExists) {
				t.Errorf("an exclusive create of an existing stream: %v, want ErrExists", err)
			}
			return err
		}, true},
		{"a create confirmed (the control)", name, func() error {
			_, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain", Expiry: Expiry{TTL: time.Minute}})
			return err
		}, false},
		{"a producer's duplicate (the control)", name, func() error {
			_, err := e.Append(ctx, name, AppendRequest{Records: recs("a"), Producer: prod(1, 0)})
			return err
		}, false},
		{"an append accepted (the control)", name, func() error {
			_, err := e.Append(ctx, name, AppendRequest{Records: recs("b")})
			return err
		}, false},
	} {
		before := touched(c.stream)
		time.Sleep(5 * time.Millisecond) // a touch now would move the clock reading
		err := c.do()
		if c.refused != (err != nil) {
			t.Fatalf("%s: %v, refused want %v", c.name, err, c.refused)
		}
		if got := touched(c.stream); c.refused && got != before {
			t.Errorf("%s: refused, and renewed the TTL: last access %d, was %d", c.name, got, before)
		} else if !c.refused && got <= before {
			t.Errorf("%s: answered with success, and no access: last access %d, was %d", c.name, got, before)
		}
	}
}

// TestRefusedReadTouchesNothing: a read the engine refuses, at a seq past
// the tail or below the first retained record, is no access: it neither
// renews a sliding TTL in memory nor queues a renewal for the WAL, which a
// read that is served does (the control).
func TestRefusedReadTouchesNothing(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{})
	const name = "/refused-reads"
	if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain", Expiry: Expiry{TTL: time.Minute}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Append(ctx, name, AppendRequest{Records: recs("a", "b", "c")}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Trim(ctx, name, 2); err != nil {
		t.Fatal(err)
	}
	s, err := e.live(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	touched := func() int64 {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.touched
	}
	before := touched()
	time.Sleep(5 * time.Millisecond) // a touch now would move the clock reading
	if _, err := e.Read(ctx, name, ReadRequest{Seq: 9}); !errors.Is(err, ErrBadRequest) {
		t.Fatalf("read past the tail: %v, want ErrBadRequest", err)
	}
	if _, err := e.Read(ctx, name, ReadRequest{Seq: 1}); !errors.Is(err, ErrGone) {
		t.Fatalf("read of a trimmed record: %v, want ErrGone", err)
	}
	// A protocol refuses a byte position inside a record once it sees the
	// record: that read is no access either.
	errJudged := errors.New("position past the end of its record")
	var judged []Record
	_, err = e.Read(ctx, name, ReadRequest{Seq: 2, Judge: func(_ Info, recs []Record) error {
		judged = recs
		return errJudged
	}})
	if !errors.Is(err, errJudged) {
		t.Fatalf("read its judge refused: %v, want the judge's error", err)
	}
	if len(judged) != 1 || string(judged[0].Body) != "c" {
		t.Fatalf("the judge saw %v, want the record read", judged)
	}
	if got := touched(); got != before {
		t.Errorf("refused reads renewed the TTL: last access %d, was %d", got, before)
	}
	res, err := e.Read(ctx, name, ReadRequest{Seq: 2, MaxRecords: 1, MaxBytes: 1})
	if err != nil {
		t.Fatal(err)
	}
	res.Release()
	if got := touched(); got <= before {
		t.Errorf("a served read did not renew the TTL: last access %d, was %d", got, before)
	}
}

// TestIdleEvictionKeepsAnUnsavedRenewal: a stream with a sliding TTL read
// less than a quarter of its TTL after its last saved renewal holds that
// read in memory only. Leaving memory, idle or pushed out by the streams
// kept, must not lose it: the expiry sweep, due at the expiry the saved
// renewal gives, keeps the stream until its TTL has passed since the read.
// Eviction dropped the handle and the read with it, and the sweep deleted
// a stream read 10 minutes into a day's TTL a day after the write before.
func TestIdleEvictionKeepsAnUnsavedRenewal(t *testing.T) {
	for _, tc := range []struct {
		name  string
		evict func(e *Engine, s *stream) // asks for s to leave memory
	}{
		{"idle", func(e *Engine, _ *stream) { e.sweepIdle(time.Now().Add(2 * time.Hour)) }},
		{"past the streams kept", func(e *Engine, s *stream) {
			s.used.Store(time.Now().Add(-time.Hour).UnixNano())
			e.mu.Lock()
			e.evictLocked()
			e.mu.Unlock()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			e := startEngine(t, st, Config{IdleAfter: time.Hour, MaxStreams: 1})
			setPackBelow(e, -1) // packed streams stay in memory (pack_test.go)
			const name, ttl = "/renewed-then-idle", 24 * time.Hour
			if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain", Expiry: Expiry{TTL: ttl}}); err != nil {
				t.Fatal(err)
			}
			// A second stream in memory puts the first past MaxStreams.
			if _, _, err := e.Create(ctx, "/other", CreateRequest{ContentType: "text/plain"}); err != nil {
				t.Fatal(err)
			}
			s, saved, read := readInMemoryOnly(t, e, st, name)

			// The handle goes once its renewal is in the WAL and folded (a
			// compaction in between, as its interval would run).
			for range 3 {
				tc.evict(e, s)
				if !e.resident(name) {
					break
				}
				waitSettled(t, s)
				if err := e.Compact(ctx); err != nil {
					t.Fatal(err)
				}
			}
			if e.resident(name) {
				t.Fatal("the stream never left memory")
			}

			dueSaved := time.UnixMilli(saved).Add(ttl)
			n, err := e.SweepExpired(ctx, dueSaved.Add(time.Minute))
			if err != nil {
				t.Fatal(err)
			}
			if exists := len(streamKeys(t, st, metaKey(name))) == 1; n != 0 || !exists {
				t.Fatalf("the sweep a TTL after the saved access deleted %d streams (the stream exists: %v); "+
					"it was read %v later, and expires a TTL after that read",
					n, exists, time.Duration(read-saved)*time.Millisecond)
			}
			n, err = e.SweepExpired(ctx, time.UnixMilli(read).Add(ttl).Add(time.Minute))
			if err != nil {
				t.Fatal(err)
			}
			if n != 1 || len(streamKeys(t, st, metaKey(name))) != 0 {
				t.Errorf("the sweep a TTL after the read deleted %d streams; want %s gone", n, name)
			}
		})
	}
}

// readInMemoryOnly appends to stream name (made with a sliding TTL of an
// hour or more, on an engine that folds it: setPackBelow(e, -1)) and
// compacts, so that its checkpoint saves the append's access (saved, Unix
// ms); then it reads it, as Read would, 10 minutes later (read): within a
// quarter of the TTL of the saved access, so only memory holds that
// renewal. It returns the stream's handle.
func readInMemoryOnly(t *testing.T, e *Engine, st *memstore.Store, name string) (s *stream, saved, read int64) {
	t.Helper()
	ctx := context.Background()
	if _, err := e.Append(ctx, name, AppendRequest{Records: recs("x")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	saved = storedMeta(t, st, name).State.AccessedAt
	if saved == 0 {
		t.Fatal("the append saved no access time")
	}
	read = saved + (10 * time.Minute).Milliseconds()
	s, err := e.stream(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	s.touched = read
	s.mu.Unlock()
	return s, saved, read
}

// waitSettled waits until no entry of s is in flight.
func waitSettled(t *testing.T, s *stream) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		s.mu.Lock()
		pending := s.pending
		s.mu.Unlock()
		if pending == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d entries of %s still in flight after 5 s", pending, s.name)
		}
	}
}

// TestReadAcrossAnEvictionRenews: a read whose records come from the
// bucket can outlast its stream's handle, which may leave memory while the
// read waits. The read's access went to that dropped handle and was lost:
// the handle loaded next knew only the access before, and the stream
// expired up to a TTL early. It now reaches the current handle.
func TestReadAcrossAnEvictionRenews(t *testing.T) {
	ctx := context.Background()
	st := newHookedStore()
	e := startEngine(t, st, Config{PackBelow: -1})
	const name = "/read-evicted"
	if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain", Expiry: Expiry{TTL: time.Hour}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Append(ctx, name, AppendRequest{Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil { // the record is in a data object now
		t.Fatal(err)
	}
	e.sweepIdle(time.Now().Add(2 * time.Hour)) // out of memory, and out of the cache
	time.Sleep(20 * time.Millisecond)          // the read's access is later than any before

	fetching, fetchGo := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	st.setHook(func(op, key string) error {
		if op == "GET" && strings.HasPrefix(key, "data/") && first.CompareAndSwap(false, true) {
			close(fetching)
			<-fetchGo
		}
		return nil
	})
	readAt := time.Now().UnixMilli()
	done := make(chan error, 1)
	go func() {
		res, err := e.Read(ctx, name, ReadRequest{})
		res.Release()
		done <- err
	}()
	<-fetching
	e.sweepIdle(time.Now().Add(2 * time.Hour)) // the handle the read holds leaves memory
	close(fetchGo)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	st.setHook(nil)
	s, err := e.live(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	last := max(s.touched, s.durable.AccessedAt)
	s.mu.Unlock()
	if last < readAt {
		t.Fatalf("the stream's last access is %d, before the read at %d: the read renewed nothing", last, readAt)
	}
}

// TestCloseSavesRenewalsOnlyMemoryHeld: a read within a quarter of the TTL
// of the last saved renewal (and a create confirmed with 200, a producer's
// duplicate) renews the TTL in memory only; a graceful stop must write it,
// or the next start expires the stream up to a quarter of its TTL early,
// the whole renewal early for a confirmed create.
func TestCloseSavesRenewalsOnlyMemoryHeld(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	setPackBelow(e, -1) // folded, so that the checkpoint holds the append's access
	const name, ttl = "/renewed-then-stopped", 24 * time.Hour
	if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain", Expiry: Expiry{TTL: ttl}}); err != nil {
		t.Fatal(err)
	}
	_, saved, read := readInMemoryOnly(t, e, st, name)
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}

	e2 := startEngine(t, st, Config{})
	n, err := e2.SweepExpired(ctx, time.UnixMilli(saved).Add(ttl).Add(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("after a graceful stop, the sweep a TTL after the saved access deleted %d streams; "+
			"the stream was read %v later, and expires a TTL after that read", n, time.Duration(read-saved)*time.Millisecond)
	}
	if n, err := e2.SweepExpired(ctx, time.UnixMilli(read).Add(ttl).Add(time.Minute)); err != nil || n != 1 {
		t.Errorf("the sweep a TTL after the read deleted %d streams (%v); want the stream gone", n, err)
	}
}
