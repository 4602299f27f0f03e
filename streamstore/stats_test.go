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
