package streamstore

import (
	"context"
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

// walGetCounter counts the store's GETs of WAL objects, by key.
type walGetCounter struct {
	mu   sync.Mutex
	gets map[string]int
}

func countWALGets(st *memstore.Store) *walGetCounter {
	c := &walGetCounter{gets: map[string]int{}}
	st.SetFail(func(op, key string) error {
		if op == "GET" && strings.HasPrefix(key, "wal/") {
			c.mu.Lock()
			c.gets[key]++
			c.mu.Unlock()
		}
		return nil
	})
	return c
}

func (c *walGetCounter) take() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	got := c.gets
	c.gets = map[string]int{}
	return got
}

// growBacklog appends rounds of one record of size bytes to every stream
// while compaction is held, so that the backlog outgrows a small cache.
// It returns every stream's records.
func growBacklog(t *testing.T, e *Engine, names []string, rounds, size int) map[string][]string {
	t.Helper()
	ctx := context.Background()
	want := map[string][]string{}
	e.compactMu.Lock()
	defer e.compactMu.Unlock()
	for round := range rounds {
		var wg sync.WaitGroup
		errs := make([]error, len(names))
		for i, name := range names {
			body := fmt.Sprintf("%s/%03d/", name, round)
			body += strings.Repeat("x", size-len(body))
			want[name] = append(want[name], body)
			wg.Go(func() {
				_, errs[i] = e.Append(ctx, name, AppendRequest{Records: []NewRecord{{Body: []byte(body)}}})
			})
		}
		wg.Wait()
		for _, err := range errs {
			if err != nil {
				t.Fatalf("append: %v", err)
			}
		}
	}
	return want
}

// A backlog the cache lost is read back a WAL object at a time: the lost
// entries of many streams in one WAL object cost one GET between them.
// Read back stream by stream they cost a GET each, and a node behind on
// 10,000 busy streams never caught up.
func TestCompactionReadsLostEntriesByWALObject(t *testing.T) {
	tests := []struct {
		name           string
		streams        int
		rounds, size   int
		atLeastWindows int
	}{
		{name: "one window", streams: 40, rounds: 30, size: 1 << 10, atLeastWindows: 1},
		// Past lostWindowBytes of lost entries: compacted a window at a
		// time.
		{name: "windows", streams: 48, rounds: 30, size: 32 << 10, atLeastWindows: 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st := memstore.New()
			gets := countWALGets(st)
			e := startEngine(t, st, Config{CacheBytes: 64 << 10, FlushInterval: 20 * time.Millisecond})
			var names []string
			for i := range tt.streams {
				name := fmt.Sprintf("/s%02d", i)
				if _, _, err := e.Create(context.Background(), name, CreateRequest{ContentType: "text/plain"}); err != nil {
					t.Fatal(err)
				}
				names = append(names, name)
			}
			want := growBacklog(t, e, names, tt.rounds, tt.size)

			todo, end := e.allStreams(), e.commitPos()
			lost := e.lostRuns(todo, end)
			if len(lost) < tt.streams*tt.rounds/2 {
				t.Fatalf("%d of %d entries lost by the cache; the test needs most", len(lost), tt.streams*tt.rounds)
			}
			if n := len(e.lostWindows(todo, end)); n < tt.atLeastWindows {
				t.Fatalf("%d windows; the test needs at least %d", n, tt.atLeastWindows)
			}
			walObjects := len(st.Keys("wal/"))
			gets.take()
			mustCompact(t, e)

			got := gets.take()
			total := 0
			for key, n := range got {
				total += n
				if n > 1 {
					t.Errorf("%s read %d times", key, n)
				}
			}
			if total == 0 || total > walObjects {
				t.Errorf("%d GETs of WAL objects for %d lost entries in %d objects; want one per object at most", total, len(lost), walObjects)
			}
			if left := st.Keys("wal/"); len(left) > 1 {
				t.Errorf("%d WAL objects left after the compaction", len(left))
			}
			for _, name := range names {
				if got := readAll(t, e, name); !slices.Equal(got, want[name]) {
					t.Fatalf("%s after the compaction: %d records, want %d", name, len(got), len(want[name]))
				}
			}
		})
	}
}

// lostWindows cuts the WAL between objects, each window holding at most
// lostWindowBytes of lost entries unless one object holds more.
func TestLostWindows(t *testing.T) {
	const mib = 1 << 20
	pos := func(seq uint64) walPos { return walPos{NS: 1, Seq: seq} }
	runOf := func(seq uint64, size int64, records uint64) walRun {
		return walRun{pos: pos(seq), key: segment.WALKey(1, seq), span: segment.Span{Len: size}, ch: change{First: seq, End: seq + records}}
	}
	run := func(seq uint64, size int64) walRun { return runOf(seq, size, 1) }
	tests := []struct {
		name string
		runs [][]walRun // by stream
		want []walPos
	}{
		{name: "nothing lost", runs: nil, want: []walPos{pos(9)}},
		{name: "under the budget", runs: [][]walRun{{run(1, 10*mib), run(2, 10*mib)}, {run(2, 10*mib)}}, want: []walPos{pos(9)}},
		{name: "cut before the object that passes it", runs: [][]walRun{{run(1, 20*mib), run(3, 20*mib)}, {run(2, 10*mib)}},
			want: []walPos{pos(3), pos(9)}},
		{name: "one object's runs stay together", runs: [][]walRun{{run(1, 30*mib)}, {run(1, 30*mib)}, {run(2, 1)}},
			want: []walPos{pos(2), pos(9)}},
		{name: "runs at or after the end are not read", runs: [][]walRun{{run(1, 30*mib), run(9, 30*mib)}}, want: []walPos{pos(9)}},
		// 8 MiB of one-byte records (17 bytes each) is 18 MiB of Records
		// besides: read back, each run holds 26 MiB.
		{name: "records count what they hold read back", runs: [][]walRun{
			{runOf(1, 8*mib, 8*mib/17)}, {runOf(2, 8*mib, 8*mib/17)}, {runOf(3, 8*mib, 8*mib/17)}},
			want: []walPos{pos(2), pos(3), pos(9)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := &Engine{cache: newBlockCache(1 << 20)}
			var todo []*stream
			for _, runs := range tt.runs {
				todo = append(todo, &stream{runs: runs})
			}
			got := e.lostWindows(todo, pos(9))
			if fmt.Sprint(got) != fmt.Sprint(tt.want) {
				t.Fatalf("windows end at %v; want %v", got, tt.want)
			}
		})
	}
}

// The entries a compaction found in the cache are its own until it is
// done: appends that push them out of the cache meanwhile (here the whole
// cache is dropped at the compaction's first data PUT) cost it no GETs.
// A compaction that took long (its packs read back from a bucket 25 ms
// away) otherwise read thousands of entries back one GET each.
func TestCompactionKeepsWhatItFoundCached(t *testing.T) {
	st := memstore.New()
	var e *Engine
	var armed atomic.Bool // while the compaction runs
	var once sync.Once
	var walGets atomic.Int64
	st.SetFail(func(op, key string) error {
		switch {
		case !armed.Load():
		case op == "PUT" && strings.HasPrefix(key, "data/"):
			once.Do(func() { dropCache(e) })
		case op == "GET" && strings.HasPrefix(key, "wal/"):
			walGets.Add(1)
		}
		return nil
	})
	e = startEngine(t, st, Config{FlushInterval: 20 * time.Millisecond})
	setPackBelow(e, 0) // every stream folds: a data PUT each, 32 at a time
	var names []string
	for i := range 48 {
		name := fmt.Sprintf("/k%02d", i)
		if _, _, err := e.Create(context.Background(), name, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
		names = append(names, name)
	}
	want := growBacklog(t, e, names, 5, 1<<10)
	if lost := len(e.lostRuns(e.allStreams(), e.commitPos())); lost != 0 {
		t.Fatalf("%d entries lost before the compaction; the test needs them cached", lost)
	}
	armed.Store(true)
	mustCompact(t, e)
	armed.Store(false)
	if n := walGets.Load(); n != 0 {
		t.Errorf("the compaction read %d WAL entries back after the cache dropped them; want none", n)
	}
	for _, name := range names {
		if got := readAll(t, e, name); !slices.Equal(got, want[name]) {
			t.Fatalf("%s after the compaction: %d records, want %d", name, len(got), len(want[name]))
		}
	}
}

// dropCache empties the engine's cache, as appends would push it out.
func dropCache(e *Engine) {
	e.cache.mu.RLock()
	keys := make([]string, 0, len(e.cache.items))
	for k := range e.cache.items {
		keys = append(keys, k)
	}
	e.cache.mu.RUnlock()
	e.cache.remove(keys)
}

func (e *Engine) allStreams() []*stream {
	e.mu.RLock()
	defer e.mu.RUnlock()
	out := make([]*stream, 0, len(e.streams))
	for _, s := range e.streams {
		out = append(out, s)
	}
	return out
}

func (e *Engine) commitPos() walPos {
	e.mu.RLock()
	defer e.mu.RUnlock()
	return e.commitEnd
}
