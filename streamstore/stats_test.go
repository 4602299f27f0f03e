package streamstore

import (
	"context"
	"testing"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

func TestEngineStats(t *testing.T) {
	for _, tc := range []struct {
		name       string
		cacheBytes int64
		wantHits   bool // reads of fresh records come from the cache
	}{
		{name: "cached", cacheBytes: 1 << 20, wantHits: true},
		{name: "no room in the cache", cacheBytes: 1, wantHits: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			e := startEngine(t, memstore.New(), Config{CacheBytes: tc.cacheBytes})
			if got := e.Stats(); got != (StatsSnapshot{}) {
				t.Fatalf("a fresh engine has stats %+v", got)
			}
			if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain", Records: recs("ab")}); err != nil {
				t.Fatal(err)
			}
			if _, _, err := e.Create(ctx, "/empty", CreateRequest{ContentType: "text/plain"}); err != nil {
				t.Fatal(err)
			}
			if _, err := e.Append(ctx, "/s", AppendRequest{ContentType: "text/plain", Records: recs("cde", "f")}); err != nil {
				t.Fatal(err)
			}
			readAll(t, e, "/s")
			readAll(t, e, "/s")
			st := e.Stats()
			if st.Appends != 2 || st.Records != 3 || st.Bytes != 6 {
				t.Errorf("appends %d records %d bytes %d, want 2, 3 and 6", st.Appends, st.Records, st.Bytes)
			}
			if st.WALObjects < 2 || st.WALEntries < st.Appends || st.AbortedBatches != 0 {
				t.Errorf("WAL objects %d entries %d aborted %d", st.WALObjects, st.WALEntries, st.AbortedBatches)
			}
			if tc.wantHits && (st.CacheHits == 0 || st.CacheMisses != 0) {
				t.Errorf("cache hits %d misses %d, want hits only", st.CacheHits, st.CacheMisses)
			}
			if !tc.wantHits && (st.CacheHits != 0 || st.CacheMisses == 0) {
				t.Errorf("cache hits %d misses %d, want misses only", st.CacheHits, st.CacheMisses)
			}
		})
	}
}

// TestColdReadCountsOneMiss checks that a read of a data object that is
// not in the cache counts one cache miss, and a read of it once cached one
// hit: the fetch that follows a miss looks in the cache again (a fetch
// may have just put the object there), and that second look must not count
// as another lookup.
func TestColdReadCountsOneMiss(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	cfg := Config{PackBelow: -1} // the compaction writes a data object of the stream's own
	e := startEngine(t, st, cfg)
	if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	for _, body := range []string{"a", "bc", "def"} {
		if _, err := e.Append(ctx, "/s", AppendRequest{Records: recs(body)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatalf("compact: %v", err)
	}
	if data := st.Keys("data/"); len(data) != 1 {
		t.Fatalf("data objects after compaction: %v, want one", data)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatalf("close: %v", err)
	}

	// A fresh engine: its cache is empty, its WAL retired.
	e2 := startEngine(t, st, cfg)
	for _, tc := range []struct {
		name                 string
		wantHits, wantMisses uint64
	}{
		{"cold read", 0, 1},
		{"read of the cached object", 1, 0},
	} {
		before := e2.Stats()
		if got := readAll(t, e2, "/s"); len(got) != 3 {
			t.Fatalf("%s: read %q, want three records", tc.name, got)
		}
		after := e2.Stats()
		hits, misses := after.CacheHits-before.CacheHits, after.CacheMisses-before.CacheMisses
		if hits != tc.wantHits || misses != tc.wantMisses {
			t.Errorf("%s: counted %d cache hits and %d misses, want %d and %d", tc.name, hits, misses, tc.wantHits, tc.wantMisses)
		}
	}
}
