package streamstore

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

// Streams nobody touches leave memory, cache included, and read back from
// the bucket afterwards; a stream with a reader waiting on its tail stays.
func TestIdleStreamsLeaveMemory(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{IdleAfter: time.Hour})
	setPackBelow(e, -1) // packed streams stay in memory (pack_test.go)
	const n = 20
	for i := range n {
		name := fmt.Sprintf("/idle/%d", i)
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
		if _, err := e.Append(ctx, name, AppendRequest{Records: recs("a", "b")}); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if e.cache.used != 0 {
		t.Fatalf("the cache holds %d bytes after compaction; the folded WAL entries should be gone", e.cache.used)
	}
	for i := range n {
		readAll(t, e, fmt.Sprintf("/idle/%d", i)) // fill the cache with data objects
	}
	waited, _ := e.Head(ctx, "/idle/0")
	waitDone := make(chan struct{})
	waitCtx, stopWait := context.WithCancel(ctx)
	go func() {
		defer close(waitDone)
		_, _ = e.Wait(waitCtx, "/idle/0", waited.ID, waited.NextSeq)
	}()
	t.Cleanup(func() { stopWait(); <-waitDone })
	deadline := time.Now().Add(2 * time.Second)
	for {
		e.mu.Lock()
		s := e.streams["/idle/0"]
		e.mu.Unlock()
		if s.waiters.Load() > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("waiter never registered")
		}
		time.Sleep(5 * time.Millisecond)
	}

	// Nothing is idle yet at the configured hour.
	if s, b := e.sweepIdle(time.Now()); s != 0 || b != 0 {
		t.Fatalf("sweep dropped %d streams and %d bytes that were just used", s, b)
	}
	streams, bytes := e.sweepIdle(time.Now().Add(2 * time.Hour))
	if streams != n-1 {
		t.Errorf("dropped %d stream handles; want %d (all but the one with a waiter)", streams, n-1)
	}
	if bytes == 0 || e.cache.used != 0 {
		t.Errorf("cache released %d bytes and holds %d; want everything released", bytes, e.cache.used)
	}
	e.mu.Lock()
	left := len(e.streams)
	e.mu.Unlock()
	if left != 1 {
		t.Errorf("%d handles left; want 1", left)
	}
	for i := range n {
		if got := readAll(t, e, fmt.Sprintf("/idle/%d", i)); len(got) != 2 || got[0] != "a" || got[1] != "b" {
			t.Fatalf("stream %d read back %q after the sweep", i, got)
		}
	}
}

// A backlog of many WAL entries that outgrows most of the cache starts a
// compaction at once, before the interval: compaction reads the entries
// from the cache, and once they fall out of it each would be a GET. A few
// middling entries do not: reading them back costs a few GETs, less than
// compacting over and over.
func TestCompactionStartsWhenBacklogOutgrowsCache(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{CacheBytes: 256 << 10}) // interval: an hour
	if _, _, err := e.Create(ctx, "/big", CreateRequest{ContentType: "application/octet-stream"}); err != nil {
		t.Fatal(err)
	}
	mid := make([]byte, 8<<10)
	for range 40 { // 320 KiB in 40 entries: past the bytes, far from the entries
		if _, err := e.Append(ctx, "/big", AppendRequest{Records: []NewRecord{{Body: mid}}}); err != nil {
			t.Fatal(err)
		}
	}
	// The decision is taken as each batch commits, before its appends
	// are answered: look at it, not for a compaction's absence a while
	// later (which a late one would pass). A compaction that began resets
	// the backlog's counts.
	e.mu.Lock()
	full, backlog, entries := e.compactFull, e.walBacklog, e.walEntries
	e.mu.Unlock()
	if full || backlog >= compactBacklog || entries < 40 {
		t.Fatalf("a few middling entries started a compaction (backlog full %v, %d batches, %d of 40 entries)", full, backlog, entries)
	}
	if keys := append(st.Keys("data/"), st.Keys("pack/")...); len(keys) != 0 {
		t.Fatalf("a few middling entries started a compaction: %v", keys)
	}
	// Thousands of small entries, from many writers at once, each on a
	// stream of its own (one stream's appends in one batch fold into one
	// entry).
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for w := range 64 {
		name := fmt.Sprintf("/small%d", w)
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range compactMinEntries/64 + 1 {
				if _, err := e.Append(ctx, name, AppendRequest{Records: recs(fmt.Sprint(w))}); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(st.Keys("data/")) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no compaction after %d entries over three quarters of the cache", compactMinEntries)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Large entries that outgrow most of the cache start a compaction too,
// however few: each one read back would cost its bytes again.
func TestCompactionStartsForLargeEntries(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{CacheBytes: 256 << 10}) // interval: an hour
	if _, _, err := e.Create(ctx, "/big", CreateRequest{ContentType: "application/octet-stream"}); err != nil {
		t.Fatal(err)
	}
	big := make([]byte, 64<<10)
	for range 5 { // 320 KiB in 5 entries
		if _, err := e.Append(ctx, "/big", AppendRequest{Records: []NewRecord{{Body: big}}}); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(st.Keys("data/"))+len(st.Keys("pack/")) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no compaction after 320 KiB of 64 KiB entries in a 256 KiB cache")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// The backlog that starts a compaction is weighed in the cache's measure:
// entries of one-byte records take five times their encoded size in the
// cache, and weighed encoded, the backlog reached three quarters of the
// cache only once most of it had been pushed out, which compaction then
// fetched back from the bucket.
func TestCompactionStartsBeforeTinyRecordsOutgrowTheCache(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	counter := &opCounter{Store: st, prefix: "wal/", gets: map[string]int{}}
	e := startEngine(t, counter, Config{CacheBytes: 2 << 20}) // interval: an hour
	if _, _, err := e.Create(ctx, "/tiny", CreateRequest{ContentType: "application/octet-stream"}); err != nil {
		t.Fatal(err)
	}
	// 1,000 one-byte records: 17 KB encoded, a large entry; 80 KB cached.
	batch := make([]NewRecord, 1000)
	for i := range batch {
		batch[i].Body = []byte{byte(i)}
	}
	appends := 0
	for ; len(st.Keys("data/")) == 0; appends++ {
		if appends == 200 {
			t.Fatalf("no compaction after %d entries of %d one-byte records in a 2 MiB cache", appends, len(batch))
		}
		if _, err := e.Append(ctx, "/tiny", AppendRequest{Records: batch}); err != nil {
			t.Fatal(err)
		}
	}
	_, gets, _ := counter.counts()
	t.Logf("a compaction started within %d entries of %d one-byte records in a 2 MiB cache; %d WAL GETs", appends, len(batch), gets)
	if gets != 0 {
		t.Errorf("the compaction started after %d entries fetched %d WAL objects back: they had left the cache", appends, gets)
	}
}

// WAL entries that compaction has not folded yet stay in the cache however
// idle their stream is: compaction reads them from there.
func TestIdleSweepKeepsUncompactedEntries(t *testing.T) {
	ctx := context.Background()
	counter := &opCounter{Store: memstore.New(), prefix: "wal/", gets: map[string]int{}}
	e := startEngine(t, counter, Config{IdleAfter: time.Hour})
	if _, _, err := e.Create(ctx, "/quiet", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Append(ctx, "/quiet", AppendRequest{Records: recs("a", "b")}); err != nil {
		t.Fatal(err)
	}
	held := e.cache.used
	if held == 0 {
		t.Fatal("the committed entry is not in the cache")
	}
	if streams, bytes := e.sweepIdle(time.Now().Add(2 * time.Hour)); streams != 0 || bytes != 0 {
		t.Fatalf("sweep dropped %d handles and %d bytes of an uncompacted stream", streams, bytes)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if _, gets, _ := counter.counts(); gets != 0 {
		t.Fatalf("compaction fetched %d WAL objects back from the bucket; the entries were dropped from the cache", gets)
	}
	if got := readAll(t, e, "/quiet"); len(got) != 2 {
		t.Fatalf("read %q", got)
	}
}

// A node nobody uses hands its heap back once per quiet spell (and once
// more after a compaction that folded something), however little each
// sweep frees.
func TestQuietNodeReturnsMemoryOnce(t *testing.T) {
	ctx := context.Background()
	const idle = time.Hour
	e := startEngine(t, memstore.New(), Config{IdleAfter: idle})
	var returned int
	e.returnMemory = func() { returned++ }
	if _, _, err := e.Create(ctx, "/q", CreateRequest{ContentType: "text/plain", Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	later := func() time.Time { return time.Now().Add(2 * idle) }

	e.sweepIdle(time.Now())
	if returned != 0 {
		t.Fatalf("memory returned %d times while the node is in use", returned)
	}
	e.sweepIdle(later())
	e.sweepIdle(later())
	if returned != 1 {
		t.Fatalf("memory returned %d times over two quiet sweeps; want once", returned)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	e.sweepIdle(later())
	if returned != 2 {
		t.Fatalf("memory returned %d times after a compaction that folded a stream; want a second time", returned)
	}
	readAll(t, e, "/q") // in use again
	e.sweepIdle(time.Now())
	e.sweepIdle(later())
	if returned != 3 {
		t.Fatalf("memory returned %d times after a new quiet spell; want a third time", returned)
	}
}

// Many streams that went idle with records not yet in data objects start a
// compaction at the next sweep instead of waiting out the interval, and
// leave memory as soon as it has folded them; a few such streams, or
// streams the last compaction already saw idle, wait for the interval.
func TestIdleStreamsWaitingForAFoldStartACompaction(t *testing.T) {
	cases := []struct {
		name    string
		streams int
		// seenIdle: a compaction began after the streams went idle.
		seenIdle bool
		want     bool
	}{
		{"many", idleReturnStreams, false, true},
		{"few", 10, false, false},
		{"many, seen by the last compaction", idleReturnStreams, true, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			st := memstore.New()
			const idle = time.Hour // the sweeps in this test are its own
			e := startEngine(t, st, Config{IdleAfter: idle})
			createMany(t, e, "/waiting/", tc.streams)
			past := time.Now().Add(-2 * idle).UnixNano()
			for _, s := range e.allStreams() {
				s.used.Store(past)
			}
			if tc.seenIdle {
				e.compactBegan.Store(time.Now().UnixNano())
			}
			if !tc.want {
				// The sweep's decision, not a compaction's absence a while
				// later: with the compaction lock held here, a kick either
				// stays in compactKick or wakes the loop, which then
				// blocks on the lock; either way the loop is not back in
				// its select. Idle in it before, and after, it was not
				// kicked.
				idle := func() bool { return goroutineSelectsIn("streamstore.(*Engine).compactLoop(") }
				if err := waitUntil(5*time.Second, idle); err != nil {
					t.Fatal("the compaction loop never waited for its next turn")
				}
				e.compactMu.Lock()
				defer e.compactMu.Unlock()
				if n, _ := e.sweepIdle(time.Now()); n != 0 {
					t.Fatalf("the sweep dropped %d streams whose records are only in the WAL", n)
				}
				if len(e.compactKick) != 0 || !idle() {
					t.Fatal("the sweep asked for a compaction")
				}
				return
			}
			if n, _ := e.sweepIdle(time.Now()); n != 0 {
				t.Fatalf("the sweep dropped %d streams whose records are only in the WAL", n)
			}
			deadline := time.Now().Add(10 * time.Second)
			for len(e.allStreams()) > 0 {
				if time.Now().After(deadline) {
					t.Fatalf("%d of %d idle streams still in memory; data objects: %d",
						len(e.allStreams()), tc.streams, len(st.Keys("data/")))
				}
				time.Sleep(10 * time.Millisecond)
			}
			if got := len(st.Keys("data/")); got < tc.streams {
				t.Fatalf("%d data objects for %d folded streams", got, tc.streams)
			}
			if got := readAll(t, e, "/waiting/7"); len(got) != 1 || got[0] != "7" {
				t.Fatalf("read back %q", got)
			}
		})
	}
}

// createMany creates n streams called prefix+i, each with the record i,
// from several goroutines so that they share WAL objects.
func createMany(t *testing.T, e *Engine, prefix string, n int) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	next := make(chan int)
	for range 64 {
		wg.Go(func() {
			for i := range next {
				name := fmt.Sprint(prefix, i)
				if _, _, err := e.Create(context.Background(), name, CreateRequest{ContentType: "text/plain", Records: recs(fmt.Sprint(i))}); err != nil {
					errs <- fmt.Errorf("create %s: %w", name, err)
				}
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// A handle whose name lock is held stays in memory: deletes and metadata
// writes act through the handle they looked up under the lock, and one
// evicted and replaced by a lookup meanwhile would leave the new handle
// live beside a deleted stream, or compare against a stale version.
func TestNameLockPinsHandle(t *testing.T) {
	tests := []struct {
		name  string
		evict func(e *Engine)
	}{
		{"past the stream limit", func(e *Engine) {
			e.mu.Lock()
			e.evictLocked()
			e.mu.Unlock()
		}},
		{"idle sweep", func(e *Engine) { e.sweepIdle(time.Now().Add(time.Hour)) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			e := startEngine(t, memstore.New(), Config{MaxStreams: 2, IdleAfter: time.Minute})
			for _, n := range []string{"/a", "/b", "/c"} {
				if _, _, err := e.Create(ctx, n, CreateRequest{ContentType: "text/plain"}); err != nil {
					t.Fatal(err)
				}
			}
			e.mu.Lock()
			held := e.streams["/a"]
			e.mu.Unlock()
			if held == nil {
				t.Fatal("/a is not in memory after its create")
			}
			held.used.Store(0) // long unused: the first to go
			unlock := e.lockName("/a")
			tc.evict(e)
			e.mu.Lock()
			cur := e.streams["/a"]
			e.mu.Unlock()
			if cur != held || held.evicted {
				t.Error("the handle left memory while its name lock was held")
			}
			unlock()
			tc.evict(e)
			if !held.evicted {
				t.Error("the handle stayed in memory once the lock was released: the test evicts nothing")
			}
		})
	}
}

// walCacheItems counts the WAL entries e's cache holds.
func walCacheItems(e *Engine) int {
	e.cache.mu.Lock()
	defer e.cache.mu.Unlock()
	n := 0
	for k := range e.cache.items {
		if strings.HasPrefix(k, walCachePrefix) {
			n++
		}
	}
	return n
}

// The WAL entries of a deleted stream leave the cache with it: no
// compaction folds a deleted stream's entries, which is what takes them
// out otherwise, and idle sweeps keep WAL entries for compaction, so they
// stayed until pushed out (a node gone idle after a churn of short-lived
// streams kept them for good).
func TestDeletedStreamsLeaveTheCache(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{IdleAfter: time.Hour})
	const n = 20
	for i := range n {
		name := fmt.Sprintf("/gone/%d", i)
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
		if _, err := e.Append(ctx, name, AppendRequest{Records: recs("a", "b")}); err != nil {
			t.Fatal(err)
		}
	}
	if got := walCacheItems(e); got != n {
		t.Fatalf("%d WAL entries cached after the appends, want %d", got, n)
	}
	for i := range n {
		if err := e.Delete(ctx, fmt.Sprintf("/gone/%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	e.sweepIdle(time.Now().Add(2 * time.Hour))
	if got := walCacheItems(e); got != 0 || e.cache.used != 0 {
		t.Fatalf("the cache holds %d WAL entries (%d bytes) of deleted streams", got, e.cache.used)
	}
}

// A read that fetched WAL entries while a compaction folded them does not
// cache them: the compaction took their keys out of the cache, and
// nothing would take them out again.
func TestReadRacingAFoldCachesNothing(t *testing.T) {
	ctx := context.Background()
	st := &heldGets{Store: memstore.New(), held: make(chan struct{}), release: make(chan struct{})}
	e := startEngine(t, st, Config{IdleAfter: time.Hour})
	if _, _, err := e.Create(ctx, "/r", CreateRequest{ContentType: "text/plain", Records: recs("a", "b")}); err != nil {
		t.Fatal(err)
	}
	e.mu.Lock()
	s := e.streams["/r"]
	e.mu.Unlock()
	s.mu.Lock()
	keys := runCacheKeys(s.runs)
	s.mu.Unlock()
	e.cache.remove(keys) // cold: the read GETs the WAL object
	st.arm.Store(true)
	held, release := st.held, st.release
	read := make(chan error, 1)
	go func() {
		_, err := e.Read(ctx, "/r", ReadRequest{})
		read <- err
	}()
	<-held
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	close(release)
	if err := <-read; err != nil {
		t.Fatal(err)
	}
	if got := walCacheItems(e); got != 0 {
		t.Fatalf("%d WAL entries cached by a read that raced their fold", got)
	}
}

// heldGets is a store whose first GET of a WAL object, once armed, reads
// the object and then waits for release before it answers: a GET in
// flight while the object is deleted.
type heldGets struct {
	*memstore.Store
	arm           atomic.Bool
	held, release chan struct{}
}

func (h *heldGets) Get(ctx context.Context, key string, off, n int64) ([]byte, string, error) {
	data, etag, err := h.Store.Get(ctx, key, off, n)
	if strings.HasPrefix(key, "wal/") && h.arm.CompareAndSwap(true, false) {
		close(h.held)
		<-h.release
	}
	return data, etag, err
}
