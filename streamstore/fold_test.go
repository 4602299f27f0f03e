package streamstore

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// Appends to one stream that meet in one batch become one WAL entry; every
// append keeps its own seqs, order, producer state and count, and all of it
// survives a restart (replay of the folded entries).
func TestFoldAppendsOfOneStream(t *testing.T) {
	const (
		writers   = 24
		each      = 25
		producers = 4 // writers 0..3 append as producers p0..p3
	)
	ctx := context.Background()
	st := memstore.New()
	st.SetFail(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, "wal/") {
			time.Sleep(10 * time.Millisecond) // slow uploads: batches fill up
		}
		return nil
	})
	e := startEngine(t, st, Config{FlushInterval: 10 * time.Millisecond})
	if _, _, err := e.Create(ctx, "/hot", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	before := e.Stats()

	type ack struct{ first, next uint64 }
	acks := make([][]ack, writers)
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for w := range writers {
		wg.Go(func() {
			for i := range each {
				req := AppendRequest{Records: recs(fmt.Sprintf("w%d-%d", w, i))}
				if w < producers {
					req.Producer = &Producer{ID: fmt.Sprintf("p%d", w), Epoch: 1, Seq: uint64(i)}
				}
				res, err := e.Append(ctx, "/hot", req)
				if err != nil {
					errs <- err
					return
				}
				acks[w] = append(acks[w], ack{res.FirstSeq, res.NextSeq})
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}

	// Every append got one seq of its own, in its writer's order.
	seen := map[uint64]bool{}
	for w, as := range acks {
		for i, a := range as {
			if a.next != a.first+1 || seen[a.first] {
				t.Fatalf("writer %d append %d: seqs [%d, %d) (taken before: %v)", w, i, a.first, a.next, seen[a.first])
			}
			seen[a.first] = true
			if i > 0 && a.first <= as[i-1].first {
				t.Fatalf("writer %d: append %d at %d is not after %d", w, i, a.first, as[i-1].first)
			}
		}
	}
	check := func(e *Engine) {
		t.Helper()
		got := readAll(t, e, "/hot")
		if len(got) != writers*each {
			t.Fatalf("%d records, want %d", len(got), writers*each)
		}
		for w, as := range acks {
			for i, a := range as {
				if want := fmt.Sprintf("w%d-%d", w, i); got[a.first] != want {
					t.Fatalf("record %d is %q, want %q", a.first, got[a.first], want)
				}
			}
		}
	}
	check(e)

	// Fewer WAL entries than appends: folding happened.
	entries := 0
	for _, ent := range walEntriesOf(t, st, "/hot") {
		if len(ent.Records) > 0 {
			entries++
		}
	}
	if entries == 0 || entries > writers*each/2 {
		t.Fatalf("%d WAL entries for %d appends; want folding to at most half", entries, writers*each)
	}
	if got := e.Stats().Appends - before.Appends; got != writers*each {
		t.Fatalf("stats count %d appends, want %d", got, writers*each)
	}
	t.Logf("%d appends in %d WAL entries", writers*each, entries)

	// After a restart (replay of the folded entries): same records, and
	// every producer's last append is known as a duplicate.
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	e2 := startEngine(t, st, Config{})
	check(e2)
	for p := range producers {
		res, err := e2.Append(ctx, "/hot", AppendRequest{Records: recs("again"),
			Producer: &Producer{ID: fmt.Sprintf("p%d", p), Epoch: 1, Seq: each - 1}})
		if err != nil || !res.Duplicate {
			t.Fatalf("producer p%d retry of its last append after restart: %+v, %v; want a duplicate", p, res, err)
		}
	}
}

// A close never folds into an earlier entry: the closing producer is the
// one recorded, not the one of the appends before it.
func TestFoldLeavesCloseAlone(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	release, held := make(chan struct{}), make(chan struct{})
	var once, heldOnce sync.Once
	st.SetFail(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, "wal/") {
			heldOnce.Do(func() { close(held) })
			<-release
		}
		return nil
	})
	// Uploads start at most every 200 ms; the first (of /other) is held,
	// so a and the close meet in the open batch behind it.
	e := startEngine(t, st, Config{FlushInterval: 200 * time.Millisecond})
	defer once.Do(func() { close(release) })
	for _, name := range []string{"/c", "/other"} {
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
	}
	c, err := e.live(ctx, "/c")
	if err != nil {
		t.Fatal(err)
	}
	// joinedC waits until /c's pending tail is at next: the append before
	// it has joined the writer's open batch (folded or not).
	joinedC := func(next uint64) {
		t.Helper()
		if err := waitUntil(5*time.Second, func() bool {
			c.mu.Lock()
			defer c.mu.Unlock()
			return c.pend.NextSeq == next
		}); err != nil {
			once.Do(func() { close(release) })
			t.Fatalf("/c's append %d never joined the WAL writer", next)
		}
	}
	var wg sync.WaitGroup
	wg.Go(func() { e.Append(ctx, "/other", AppendRequest{Records: recs("x")}) })
	select {
	case <-held:
	case <-time.After(5 * time.Second):
		once.Do(func() { close(release) })
		t.Fatal("the first WAL upload never started")
	}
	wg.Go(func() {
		e.Append(ctx, "/c", AppendRequest{Records: recs("a"), Producer: &Producer{ID: "pa", Epoch: 1, Seq: 0}})
	})
	joinedC(1)
	var closeRes AppendResult
	var closeErr error
	wg.Go(func() {
		closeRes, closeErr = e.Append(ctx, "/c", AppendRequest{Records: recs("b"), Close: true})
	})
	joinedC(2)
	once.Do(func() { close(release) })
	wg.Wait()
	if closeErr != nil || !closeRes.Closed {
		t.Fatalf("close: %+v, %v", closeRes, closeErr)
	}
	// a and the close were in one batch (one WAL object), or the close
	// could not have folded into a's entry whatever the engine does.
	coBatched := false
	for _, k := range st.Keys("wal/") {
		var a, closing bool
		for _, ent := range walObjectEntries(t, st, k, "/c") {
			for _, r := range ent.Records {
				a = a || string(r.Body) == "a"
			}
			closing = closing || ent.Closed
		}
		coBatched = coBatched || (a && closing)
	}
	if !coBatched {
		t.Fatal("a and the close were not co-batched: nothing tested")
	}
	// The close is an entry of its own, without pa's producer state
	// (folded, it would carry pa's and record pa as the closer).
	var closing []*segment.Entry
	for _, ent := range walEntriesOf(t, st, "/c") {
		if ent.Closed {
			closing = append(closing, ent)
		}
	}
	if len(closing) != 1 || closing[0].Producer != nil || len(closing[0].Records) != 1 || string(closing[0].Records[0].Body) != "b" {
		t.Fatalf("closing entries %+v; want one, with record b and no producer", closing)
	}
	if got := fmt.Sprint(readAll(t, e, "/c")); got != "[a b]" {
		t.Fatalf("records %s", got)
	}
}

// walEntriesOf decodes every WAL object in st and returns the entries of
// stream name, in key order.
func walEntriesOf(t *testing.T, st *memstore.Store, name string) []*segment.Entry {
	t.Helper()
	var out []*segment.Entry
	for _, k := range st.Keys("wal/") {
		out = append(out, walObjectEntries(t, st, k, name)...)
	}
	return out
}

// walObjectEntries decodes the WAL object at key k and returns the entries
// of stream name.
func walObjectEntries(t *testing.T, st *memstore.Store, k, name string) []*segment.Entry {
	t.Helper()
	data, _, err := st.Get(context.Background(), k, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	obj, err := segment.DecodeWAL(data)
	if err != nil {
		t.Fatalf("decode %s: %v", k, err)
	}
	var out []*segment.Entry
	for _, ent := range obj.Entries {
		if ent.Name == name {
			out = append(out, ent)
		}
	}
	return out
}
