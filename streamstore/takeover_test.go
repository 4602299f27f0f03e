package streamstore

import (
	"context"
	"errors"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// A process of the same node id takes the storage over at once, while the
// one it replaced may still be compacting: that one's checkpoint of a
// stream can land after the new owner loaded the stream. The new owner's
// checkpoints must get past it; refusing a version it did not write, it
// could never checkpoint the stream again, and every compaction failed.
func TestLateCheckpointOfReplacedProcess(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	old := startEngine(t, st, Config{})
	const name = "/late"
	if _, _, err := old.Create(ctx, name, CreateRequest{ContentType: "application/octet-stream"}); err != nil {
		t.Fatal(err)
	}
	// A large append is a blob, which compaction always folds (and so
	// checkpoints) rather than packs.
	want := [][]byte{body(1, blobMinBytes)}
	if _, err := old.Append(ctx, name, AppendRequest{Records: []NewRecord{{Body: want[0]}}}); err != nil {
		t.Fatal(err)
	}

	cur := startEngine(t, st, Config{}) // the same node id: at once
	sameBodies(t, "new owner before the late checkpoint", readBodies(t, cur, name, 0), want)
	_, before, err := st.Get(ctx, metaKey(name), 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	// The old process's compaction checkpoints the stream, then finds the
	// manifest is the new owner's.
	if err := old.Compact(ctx); !errors.Is(err, segment.ErrFenced) {
		t.Fatalf("the replaced process's compaction: %v, want ErrFenced", err)
	}
	if _, after, _ := st.Get(ctx, metaKey(name), 0, -1); after == before {
		t.Fatal("the replaced process's compaction wrote no checkpoint: the test provokes nothing")
	}

	want = append(want, []byte("after"))
	if _, err := cur.Append(ctx, name, AppendRequest{Records: []NewRecord{{Body: want[1]}}}); err != nil {
		t.Fatal(err)
	}
	if err := cur.Compact(ctx); err != nil {
		t.Fatalf("the new owner's compaction after the late checkpoint: %v", err)
	}
	if err := cur.Compact(ctx); err != nil {
		t.Fatalf("the new owner's next compaction: %v", err)
	}
	sameBodies(t, "new owner after its compaction", readBodies(t, cur, name, 0), want)

	// And a restart finds it all.
	if err := cur.Close(ctx); err != nil {
		t.Fatal(err)
	}
	again := startEngine(t, st, Config{})
	sameBodies(t, "after a restart", readBodies(t, again, name, 0), want)
}

// The replaced process's late checkpoint can pass records the new owner
// replayed from the WAL and then packs. Its pack entry starts below the
// checkpoint's tail, so the next start ignored it (and every later entry
// of the stream, and its WAL entries): the records acknowledged after the
// takeover were lost, and their seqs given out again. The new owner now
// checkpoints a stream it replayed before it packs it, which writes over a
// late checkpoint that landed and shuts out one still on its way.
func TestLateCheckpointThenPacks(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	old := startEngine(t, st, Config{PackBelow: -1}) // folds: a checkpoint
	const name = "/late-packed"
	if _, _, err := old.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	want := [][]byte{[]byte("a"), []byte("b")}
	for _, b := range want {
		if _, err := old.Append(ctx, name, AppendRequest{Records: []NewRecord{{Body: b}}}); err != nil {
			t.Fatal(err)
		}
	}

	cur := startEngine(t, st, Config{}) // the same node id: at once; packs small streams
	sameBodies(t, "new owner before the late checkpoint", readBodies(t, cur, name, 0), want)
	if err := old.Compact(ctx); !errors.Is(err, segment.ErrFenced) {
		t.Fatalf("the replaced process's compaction: %v, want ErrFenced", err)
	}
	if m := storedMeta(t, st, name); m.State.NextSeq != 2 {
		t.Fatalf("the replaced process's late checkpoint has tail %d, want 2: the test provokes nothing", m.State.NextSeq)
	}

	want = append(want, []byte("c"))
	if _, err := cur.Append(ctx, name, AppendRequest{Records: []NewRecord{{Body: want[2]}}}); err != nil {
		t.Fatal(err)
	}
	if err := cur.Compact(ctx); err != nil {
		t.Fatalf("the new owner's compaction: %v", err)
	}
	sameBodies(t, "new owner after its compaction", readBodies(t, cur, name, 0), want)
	if err := cur.Close(ctx); err != nil {
		t.Fatal(err)
	}
	again := startEngine(t, st, Config{})
	sameBodies(t, "after a restart", readBodies(t, again, name, 0), want)
	if info, err := again.Head(ctx, name); err != nil || info.NextSeq != 3 {
		t.Fatalf("after a restart: tail %d (%v), want 3", info.NextSeq, err)
	}
}

// A node that learned another took the storage over (its renewal found
// the lease another process's) must stop compacting: each compaction
// wrote data objects and checkpoints into the bucket the other owns
// before it reached the manifest and was refused.
func TestFencedNodeDoesNotCompact(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	old := startEngine(t, st, Config{})
	const name = "/fenced"
	if _, _, err := old.Create(ctx, name, CreateRequest{ContentType: "application/octet-stream"}); err != nil {
		t.Fatal(err)
	}
	if _, err := old.Append(ctx, name, AppendRequest{Records: []NewRecord{{Body: body(2, blobMinBytes)}}}); err != nil {
		t.Fatal(err)
	}
	startEngine(t, st, Config{})
	old.fence(segment.ErrFenced) // as its renewal does
	_, before, err := st.Get(ctx, metaKey(name), 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	data := len(st.Keys("data/"))
	if err := old.Compact(ctx); !errors.Is(err, segment.ErrFenced) {
		t.Errorf("compaction of a fenced node: %v, want ErrFenced", err)
	}
	if _, after, _ := st.Get(ctx, metaKey(name), 0, -1); after != before {
		t.Error("a fenced node's compaction wrote a checkpoint")
	}
	if n := len(st.Keys("data/")); n != data {
		t.Errorf("a fenced node's compaction wrote %d data objects", n-data)
	}
}

// A delete (and a fork's count) is no WAL entry, so the seal that fences
// a replaced process's appends does not fence it. A process of the same
// node id takes the lease at once, and the one it replaced, its lease
// valid by its own clock, swapped the stream's metadata for a grave over
// a stream the new owner had loaded: the new owner went on acknowledging
// appends to a deleted stream.
func TestReplacedProcessDeletesNothing(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	old := startEngine(t, st, Config{})
	// Created empty: a seeded create's delete writes a WAL entry, which
	// the seal does fence.
	for _, name := range []string{"/del", "/src"} {
		if _, _, err := old.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
		if _, err := old.Append(ctx, name, AppendRequest{Records: recs("before")}); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := old.Create(ctx, "/fork", CreateRequest{ContentType: "text/plain", Fork: &ForkFrom{Source: "/src", Seq: 1}}); err != nil {
		t.Fatal(err)
	}
	cur := startEngine(t, st, Config{})
	for _, name := range []string{"/del", "/src"} {
		if got := readAll(t, cur, name); len(got) != 1 {
			t.Fatalf("the new owner reads %s as %q", name, got)
		}
	}
	// /del is removed outright, /src (with a fork) soft-deleted.
	for _, name := range []string{"/del", "/src"} {
		if err := old.Delete(ctx, name); !errors.Is(err, ErrUnavailable) {
			t.Errorf("delete of %s by the replaced process: %v, want ErrUnavailable", name, err)
		}
		if _, err := cur.Append(ctx, name, AppendRequest{Records: recs("after")}); err != nil {
			t.Fatalf("append to %s by the new owner: %v", name, err)
		}
		if err := cur.Compact(ctx); err != nil {
			t.Fatalf("compaction by the new owner: %v", err)
		}
		if got := readAll(t, cur, name); len(got) != 2 {
			t.Errorf("the new owner reads %s as %q after its compaction, want both records", name, got)
		}
	}
}

// TestGivenUpStartReleasesTheLease: a start whose context is cancelled
// after it took the lease (its caller, a config being stopped, gave it
// up) gives the lease back, so another node starts at once. One that
// failed otherwise, here on its deadline, leaves it to this node's retry:
// another node is refused until it lapses.
func TestGivenUpStartReleasesTheLease(t *testing.T) {
	for _, tc := range []struct {
		name      string
		ctx       func() (context.Context, context.CancelFunc)
		end       func(cancel context.CancelFunc)
		otherErr  error // what another node's start then gets
		wantCause error
	}{
		{"cancelled", func() (context.Context, context.CancelFunc) { return context.WithCancel(context.Background()) },
			func(cancel context.CancelFunc) { cancel() }, nil, context.Canceled},
		{"deadline", func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(context.Background(), 200*time.Millisecond)
		}, func(context.CancelFunc) {}, segment.ErrLeaseHeld, context.DeadlineExceeded},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := memstore.New()
			g := newGatedStore(t, st, "format")
			e := New(g, testConfig(Config{NodeID: "node-a", LeaseTTL: time.Minute}), nil)
			t.Cleanup(func() { _ = e.Close(context.Background()) })
			ctx, cancel := tc.ctx()
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- e.Start(ctx) }()
			if !g.waitFor(func() bool { return g.begun("format") > 0 }) {
				t.Fatal("the start never read the format object")
			}
			tc.end(cancel)
			if err := <-done; !errors.Is(err, tc.wantCause) {
				t.Fatalf("start: %v, want %v", err, tc.wantCause)
			}
			other := New(st, testConfig(Config{NodeID: "node-b", LeaseTTL: time.Minute}), nil)
			t.Cleanup(func() { _ = other.Close(context.Background()) })
			err := other.Start(context.Background())
			if (tc.otherErr == nil && err != nil) || (tc.otherErr != nil && !errors.Is(err, tc.otherErr)) {
				t.Errorf("another node's start: %v, want %v", err, tc.otherErr)
			}
		})
	}
}

// A replaced process sees none of the new owner's appends, so a reader
// waiting at a stream's tail on it would wait for records that never come,
// and a read there would say it is up to date at a tail the stream has
// moved past. Once it learns of the takeover, a waiter parked at the tail
// is let go with ErrTakenOver, and later reads and waits get it at once.
func TestReplacedProcessEndsWaitsAndReads(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	old := startEngine(t, st, Config{})
	const name = "/waited"
	info, _, err := old.Create(ctx, name, CreateRequest{ContentType: "text/plain"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := old.Append(ctx, name, AppendRequest{Records: recs("before")}); err != nil {
		t.Fatal(err)
	}
	waited := make(chan error, 1)
	go func() {
		_, err := old.Wait(ctx, name, info.ID, 1)
		waited <- err
	}()
	cur := startEngine(t, st, Config{}) // the same node id: at once
	if _, err := cur.Append(ctx, name, AppendRequest{Records: recs("after")}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-waited:
		t.Fatalf("the wait on the replaced process ended before it learned of the takeover: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	old.fence(segment.ErrFenced) // as its renewal does
	select {
	case err := <-waited:
		if !errors.Is(err, ErrTakenOver) || !errors.Is(err, ErrUnavailable) {
			t.Errorf("the waiter parked on the replaced process: %v, want ErrTakenOver and ErrUnavailable", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the waiter parked on the replaced process still waits after the takeover")
	}
	for what, op := range map[string]func() error{
		"a read":        func() error { _, err := old.Read(ctx, name, ReadRequest{Seq: 0}); return err },
		"a read at now": func() error { _, err := old.Read(ctx, name, ReadRequest{Tail: true}); return err },
		"a wait":        func() error { _, err := old.Wait(ctx, name, info.ID, 1); return err },
	} {
		if err := op(); !errors.Is(err, ErrTakenOver) {
			t.Errorf("%s on the replaced process: %v, want ErrTakenOver", what, err)
		}
	}
	if got := readAll(t, cur, name); len(got) != 2 {
		t.Errorf("the new owner reads %q, want both records", got)
	}
}

// TestReplacedProcessSweepsNoPacks: a process's first compaction deletes
// the packs its manifest does not list, left by a compaction that ended
// before listing them. If its listing is held up long enough for another
// process of the node to take over and compact, that listing can hold the
// new owner's packs, which the old manifest never lists: it deleted them,
// with the acknowledged records only they held. The sweep now confirms
// the lease before it deletes.
func TestReplacedProcessSweepsNoPacks(t *testing.T) {
	ctx := context.Background()
	st := newHookedStore()
	listing, listGo := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	st.setHook(func(op, key string) error {
		// Only the first: the new owner's own sweep must go through.
		if op == "LIST" && key == segment.PackPrefix() && first.CompareAndSwap(false, true) {
			close(listing)
			<-listGo
		}
		return nil
	})
	old := New(st, testConfig(Config{}), nil)
	if err := old.Start(ctx); err != nil {
		t.Fatal(err)
	}
	<-listing                           // the old process's sweep, held
	cur := startEngine(t, st, Config{}) // the same node id: it takes over at once
	if _, _, err := cur.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	if _, err := cur.Append(ctx, "/s", AppendRequest{Records: recs("acknowledged")}); err != nil {
		t.Fatal(err)
	}
	if err := cur.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	packs := st.Keys(segment.PackPrefix())
	if len(packs) == 0 {
		t.Fatal("the new owner's compaction wrote no pack: the test shows nothing")
	}
	close(listGo)
	_ = old.Close(ctx) // waits for its sweep to end
	if got := st.Keys(segment.PackPrefix()); !slices.Equal(got, packs) {
		t.Fatalf("packs after the replaced process's sweep: %v, want the new owner's %v", got, packs)
	}
	if err := cur.Close(ctx); err != nil {
		t.Fatal(err)
	}
	again := startEngine(t, st, Config{})
	if got := readAll(t, again, "/s"); !slices.Equal(got, []string{"acknowledged"}) {
		t.Fatalf("after a restart: %q, want the acknowledged record", got)
	}
}

// TestForeignSealFencesTheEngine: a WAL upload that finds another
// process's seal where it was to go means that process replayed this
// one's log and owns the storage. The writer stopped for good, but the
// engine went on serving reads (and compacting) from memory the new owner
// had moved past, until its next lease renewal, seconds later; now the
// seal fences the whole engine at once.
func TestForeignSealFencesTheEngine(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	w, err := e.writer()
	if err != nil {
		t.Fatal(err)
	}
	ns, seq := w.Position()
	if _, err := st.Put(ctx, segment.WALKey(ns, seq), segment.EncodeSeal(ns, seq, "another process"), segment.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Append(ctx, "/s", AppendRequest{Records: recs("x")}); !errors.Is(err, ErrTakenOver) {
		t.Fatalf("append into the sealed namespace: %v, want ErrTakenOver", err)
	}
	if _, err := e.Read(ctx, "/s", ReadRequest{}); !errors.Is(err, ErrTakenOver) {
		t.Fatalf("read after the seal was found: %v, want ErrTakenOver", err)
	}
}

// TestReplacedProcessKeepsOffTombstones: a process replaced by another of
// the same node id kept its collector running. A pass of it between the
// new owner's tombstone and grave of a delete found the stream's metadata
// still live, took the tombstone for a failed delete's and removed it: the
// deleted stream's data stayed in the bucket for good. The collector now
// confirms it owns the storage before it removes a tombstone.
func TestReplacedProcessKeepsOffTombstones(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	old := startEngine(t, st, Config{})
	cur := startEngine(t, st, Config{PackBelow: -1}) // the same node id: at once; folds into data objects
	if _, _, err := cur.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	if _, err := cur.Append(ctx, "/s", AppendRequest{Records: recs("a", "b")}); err != nil {
		t.Fatal(err)
	}
	if err := cur.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	id := storedMeta(t, st, "/s").ID
	data := func() int {
		objs, _, err := st.List(ctx, "data/"+id+"/", "", 1000)
		if err != nil {
			t.Fatal(err)
		}
		return len(objs)
	}
	if data() == 0 {
		t.Fatal("no data object after the compaction: the test provokes nothing")
	}
	var oldPass atomic.Bool
	st.SetFail(func(op, key string) error {
		// The delete's grave is on its way, its tombstone written.
		if op == "PUT" && key == metaKey("/s") && oldPass.CompareAndSwap(false, true) {
			if err := old.collectGarbage(ctx); err == nil {
				t.Log("the replaced process's collector ran a pass")
			}
		}
		return nil
	})
	if err := cur.Delete(ctx, "/s"); err != nil {
		t.Fatal(err)
	}
	st.SetFail(nil)
	if !oldPass.Load() {
		t.Fatal("the replaced process's collector never ran: the test provokes nothing")
	}
	if err := cur.collectGarbage(ctx); err != nil {
		t.Fatal(err)
	}
	if n := data(); n != 0 {
		t.Errorf("%d data objects of the deleted stream left after the owner's collection", n)
	}
}
