package streamstore

import (
	"fmt"
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
