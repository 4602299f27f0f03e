package streamstore

import (
	"bytes"
	"fmt"
	"runtime"
	"strings"
	"testing"

	"github.com/picomq/caddy-picomq/segment"
)

func block(n int) []segment.Record {
	return []segment.Record{{Body: make([]byte, n)}}
}

// Cold data objects take at most coldCacheBytes, oldest out first, and
// never push out what the rest of the cache holds.
func TestCacheBoundsColdObjects(t *testing.T) {
	c := newBlockCache(4 * coldCacheBytes)
	c.put("wal/a@0", block(1<<20), 0)
	const obj = 1 << 20
	n := 2 * coldCacheBytes / obj
	for i := range n {
		c.putCold(fmt.Sprintf("data/x/%d", i), block(obj), 0, nil)
	}
	if !c.has("wal/a@0") {
		t.Fatal("cold objects pushed a WAL entry out")
	}
	if c.coldUsed > coldCacheBytes || c.coldLL.Len() == 0 {
		t.Fatalf("cold items hold %d bytes in %d items; limit %d", c.coldUsed, c.coldLL.Len(), coldCacheBytes)
	}
	if c.has("data/x/0") || !c.has(fmt.Sprintf("data/x/%d", n-1)) {
		t.Fatal("cold eviction is not oldest first")
	}
	// Accounting stays whole through removal and the global limit.
	c.remove([]string{fmt.Sprintf("data/x/%d", n-1)})
	var sum int64
	for el := c.coldLL.Front(); el != nil; el = el.Next() {
		sum += el.Value.(*cacheItem).wire
	}
	if sum != c.coldUsed || c.coldLL.Len() != len(c.items)-1 {
		t.Fatalf("cold bytes %d, counted %d; %d cold items of %d", sum, c.coldUsed, c.coldLL.Len(), len(c.items))
	}
	c.setBudget(2 << 20)
	c.put("wal/b@0", block(1<<20), 0)
	if c.used > 2<<20 || c.coldUsed > c.used {
		t.Fatalf("after shrinking: used %d, cold %d", c.used, c.coldUsed)
	}
}

// Run keys are what the cache, compaction and readers agree on: the
// object's key and the run's offset in it, and nothing else.
func TestRunCacheKey(t *testing.T) {
	for _, tc := range []struct {
		key  string
		off  int64
		want string
	}{
		{"wal/0000000000000001/0000000000000002", 0, "wal/0000000000000001/0000000000000002@0"},
		{"wal/0000000000000001/0000000000000002", 1234567, "wal/0000000000000001/0000000000000002@1234567"},
		{"pack/" + strings.Repeat("k", 200), 42, "pack/" + strings.Repeat("k", 200) + "@42"},
	} {
		if got := runCacheKey(tc.key, segment.Span{Off: tc.off}); got != tc.want {
			t.Errorf("runCacheKey(%q, %d) = %q, want %q", tc.key, tc.off, got, tc.want)
		}
	}
	if n := testing.AllocsPerRun(100, func() { _ = runCacheKey("wal/0000000000000001/0000000000000002", segment.Span{Off: 99}) }); n > 1 {
		t.Errorf("runCacheKey allocates %v times per call; want 1", n)
	}
}

// The budget bounds what the cache holds in memory, whatever the size of
// the records: filled with one-byte records, as appends and reads leave
// them, it holds about its budget. Counted by their encoded size (17
// bytes), records that hold 64 bytes of Record each and more took several
// times the budget.
func TestCacheBudgetBoundsMemoryOfTinyRecords(t *testing.T) {
	const budget = 8 << 20
	// Each case makes one item of n one-byte records, and the size of the
	// buffer their bodies alias, as the callers of put pass it.
	cases := []struct {
		name string
		n    int
		make func(t *testing.T, n int) ([]segment.Record, int)
	}{
		{"one record per append", 1, func(t *testing.T, n int) ([]segment.Record, int) {
			recs := make([]segment.Record, n)
			for i := range recs {
				recs[i].Body = []byte{byte(i)}
			}
			return recs, 0
		}},
		{"JSON messages", 100, func(t *testing.T, n int) ([]segment.Record, int) {
			// jsonMessages compacts each into a bytes.Buffer of its own.
			recs := make([]segment.Record, n)
			for i := range recs {
				var b bytes.Buffer
				b.WriteByte('0' + byte(i%10))
				recs[i].Body = b.Bytes()
			}
			return recs, 0
		}},
		{"binary batch", 1000, func(t *testing.T, n int) ([]segment.Record, int) {
			// Bodies alias the request body, as picowire.DecodeBinary
			// leaves them.
			body := make([]byte, 9*n)
			recs := make([]segment.Record, n)
			for i := range recs {
				recs[i].Body = body[9*i+8 : 9*i+9] // its capacity reaches to the end of body
			}
			return recs, 0
		}},
		{"decoded data object", 1000, func(t *testing.T, n int) ([]segment.Record, int) {
			t.Helper()
			src := make([]segment.Record, n)
			for i := range src {
				src[i] = segment.Record{Seq: uint64(i), Body: []byte{byte(i)}}
			}
			data := segment.EncodeData(src)
			recs, err := segment.DecodeData(data)
			if err != nil {
				t.Fatal(err)
			}
			return recs, cap(data)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := newBlockCache(budget)
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			// Twice as many records as fill the budget counted encoded.
			for i := 0; i*tc.n < 2*budget/17; i++ {
				recs, held := tc.make(t, tc.n)
				c.put(fmt.Sprintf("wal/%016x/%016x@%d", 1, i, 25), recs, held)
			}
			runtime.GC()
			runtime.ReadMemStats(&after)
			held := int64(after.HeapAlloc) - int64(before.HeapAlloc)
			runtime.KeepAlive(c)
			t.Logf("%d items of %d records: %.1f MiB held, counted %.1f MiB; budget %d MiB",
				len(c.items), tc.n, float64(held)/(1<<20), float64(c.used)/(1<<20), budget>>20)
			if held > budget*3/2 {
				t.Errorf("the cache holds %.1f MiB of one-byte records with a budget of %d MiB", float64(held)/(1<<20), budget>>20)
			}
			if held < budget/2 {
				t.Errorf("the cache holds %.1f MiB with a budget of %d MiB: it counts more than is held", float64(held)/(1<<20), budget>>20)
			}
		})
	}
}
