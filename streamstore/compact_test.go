package streamstore

import (
	"context"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/internal/testenv"
	"github.com/picomq/caddy-picomq/segment"
)

// Compaction folds many streams at once: each costs two sequential
// requests, and on a bucket tens of milliseconds away a few at a time fell
// behind a thousand busy streams for good.
func TestCompactionFoldsStreamsConcurrently(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var counting atomic.Bool
	var puts concurrency
	st.SetFail(func(op, key string) error {
		if !counting.Load() || op != "PUT" || !strings.HasPrefix(key, "data/") {
			return nil
		}
		defer puts.enter()()
		time.Sleep(20 * time.Millisecond)
		return nil
	})
	e := startEngine(t, st, Config{})
	setPackBelow(e, -1) // data objects of their own, not packs
	fillStreams(t, e, 100)
	counting.Store(true)
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	counting.Store(false)
	if p := puts.peak.Load(); p < 16 {
		t.Fatalf("at most %d data PUTs were in flight during the compaction of 100 streams; want 16 or more", p)
	}
	if data := st.Keys("data/"); len(data) != 100 {
		t.Fatalf("%d data objects after compacting 100 streams", len(data))
	}
}

// Compaction's S3 calls run on the engine's pool, as read-ahead GETs do:
// a goroutine per call grew a fresh stack through the S3 client each time.
func TestCompactionCallsRunOnThePool(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var counting atomic.Bool
	var onPool, off atomic.Int64
	st.SetFail(func(op, key string) error {
		if counting.Load() && op == "PUT" && strings.HasPrefix(key, "data/") {
			if testenv.OnPool() {
				onPool.Add(1)
			} else {
				off.Add(1)
			}
		}
		return nil
	})
	before := testenv.WaitPoolGoroutines(0, 5*time.Second)
	e := startEngine(t, st, Config{})
	setPackBelow(e, -1)
	fillStreams(t, e, 20)
	counting.Store(true)
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	counting.Store(false)
	if onPool.Load() != 20 || off.Load() != 0 {
		t.Errorf("data PUTs of 20 folds: %d on the pool, %d off it; want 20 and 0", onPool.Load(), off.Load())
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if n := testenv.WaitPoolGoroutines(before, time.Second) - before; n != 0 {
		t.Errorf("%d pool goroutines left after Close, want 0", n)
	}
}

// concurrency tracks how many calls are inside at once, and the most.
type concurrency struct{ now, peak atomic.Int64 }

// enter counts a call in and returns the func that counts it out.
func (c *concurrency) enter() (leave func()) {
	c.raise(c.now.Add(1))
	return func() { c.now.Add(-1) }
}

// raise lifts the peak to n.
func (c *concurrency) raise(n int64) {
	for {
		p := c.peak.Load()
		if n <= p || c.peak.CompareAndSwap(p, n) {
			return
		}
	}
}

// Streams leaving the packs are folded a few at a time while requests come
// in, and at full speed on a node nobody is using.
func TestPackFoldWorkers(t *testing.T) {
	e := &Engine{}
	now := time.Now()
	for _, tt := range []struct {
		name    string
		lastUse time.Time
		want    int
	}{
		{"request just now", now, packFoldBusy},
		{"request under a second ago", now.Add(-packFoldQuiet / 2), packFoldBusy},
		{"quiet", now.Add(-2 * packFoldQuiet), compactWorkers},
	} {
		e.lastUse.Store(tt.lastUse.UnixNano())
		if got := e.packFoldWorkers(now); got != tt.want {
			t.Errorf("%s: %d fold workers, want %d", tt.name, got, tt.want)
		}
	}
}

// A compaction with nothing to do asks the bucket nothing: an idle node
// used to read the lease and the manifest and write the manifest back at
// every compact_interval. A new append makes the next pass work again.
func TestIdleCompactionMakesNoRequests(t *testing.T) {
	ctx := context.Background()
	st := newHookedStore()
	e := startEngine(t, st, Config{})
	setPackBelow(e, -1)
	fillStreams(t, e, 3)
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var seen []string
	st.setHook(func(op, key string) error {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, op+" "+key)
		return nil
	})
	taken := func() []string {
		mu.Lock()
		defer mu.Unlock()
		out := seen
		seen = nil
		return out
	}
	for pass := range 2 {
		if err := e.Compact(ctx); err != nil {
			t.Fatal(err)
		}
		if got := taken(); len(got) > 0 {
			t.Errorf("idle compaction %d made %d requests: %v; want none", pass, len(got), got)
		}
	}
	if _, err := e.Append(ctx, "/r1", AppendRequest{Records: recs("more")}); err != nil {
		t.Fatal(err)
	}
	taken()
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if got := taken(); !slices.Contains(got, "PUT manifest") {
		t.Errorf("the compaction after an append made %v; want a manifest PUT among them", got)
	}
}

// The collector waits a few minutes, less for a grave due sooner, but a
// minute after a pass it skipped for want of the lease: only a pass removes
// a due grave, so with the lease lost the wait for one already due was 0,
// again and again, and the loop spun a core until the process ended.
func TestGCWait(t *testing.T) {
	now := time.UnixMilli(1_000_000)
	for _, tc := range []struct {
		name      string
		nextGrave int64
		skipped   bool
		want      time.Duration
	}{
		{"no grave", 0, false, 5 * time.Minute},
		{"a grave due in 30s", now.Add(30 * time.Second).UnixMilli(), false, 30 * time.Second},
		{"a grave due in an hour", now.Add(time.Hour).UnixMilli(), false, 5 * time.Minute},
		{"a grave overdue", now.Add(-time.Hour).UnixMilli(), false, 0},
		{"a grave overdue, the last pass skipped", now.Add(-time.Hour).UnixMilli(), true, time.Minute},
		{"no grave, the last pass skipped", 0, true, time.Minute},
	} {
		if got := gcWait(tc.nextGrave, tc.skipped, now); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

// walListings records where the listings of the WAL start.
type walListings struct {
	*memstore.Store
	mu    sync.Mutex
	after []string
}

func (w *walListings) List(ctx context.Context, prefix, after string, limit int) ([]segment.ObjectInfo, bool, error) {
	if strings.HasPrefix(prefix, "wal/") {
		w.mu.Lock()
		w.after = append(w.after, after)
		w.mu.Unlock()
	}
	return w.Store.List(ctx, prefix, after, limit)
}

// A compaction deletes the WAL it retired listing from where the previous
// one in the namespace stopped, not from the namespace's start: on a
// versioned bucket every key deleted before stays as a delete marker,
// which each listing from the start stepped over again.
func TestRetiringTheWALListsFromTheLastRetirement(t *testing.T) {
	st := &walListings{Store: memstore.New()}
	e := startEngine(t, st, Config{})
	ctx := context.Background()
	if _, _, err := e.Create(ctx, "/r", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	var froms []string
	for round := range 3 {
		for range 3 {
			mustAppend(t, e, "/r", AppendRequest{Records: recs("x")})
		}
		st.mu.Lock()
		st.after = nil
		st.mu.Unlock()
		mustCompact(t, e)
		st.mu.Lock()
		if len(st.after) != 1 {
			t.Fatalf("round %d: WAL listings starting after %q; want one", round, st.after)
		}
		froms = append(froms, st.after[0])
		st.mu.Unlock()
		if wal := st.Keys("wal/"); len(wal) != 0 {
			t.Fatalf("round %d: WAL objects left after the compaction: %v", round, wal)
		}
	}
	if froms[0] != "" || froms[1] == "" || froms[2] <= froms[1] {
		t.Fatalf("the retirements' listings started after %q; want the namespace's start, then each after the one before", froms)
	}
}
