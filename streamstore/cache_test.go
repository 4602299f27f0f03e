package streamstore

import (
	"fmt"
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
	c.put("wal/a@0", block(1<<20))
	const obj = 1 << 20
	n := 2 * coldCacheBytes / obj
	for i := range n {
		c.putCold(fmt.Sprintf("data/x/%d", i), block(obj), nil)
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
		sum += el.Value.(*cacheItem).size
	}
	if sum != c.coldUsed || c.coldLL.Len() != len(c.items)-1 {
		t.Fatalf("cold bytes %d, counted %d; %d cold items of %d", sum, c.coldUsed, c.coldLL.Len(), len(c.items))
	}
	c.setBudget(2 << 20)
	c.put("wal/b@0", block(1<<20))
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
