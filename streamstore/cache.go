package streamstore

import (
	"container/list"
	"maps"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/picomq/caddy-picomq/segment"
)

// blockCache keeps decoded record runs (one WAL entry or one data object
// each) under a byte budget, least recently used out first. Fresh appends
// go in at commit, so tail readers are served from memory; with a tiny
// budget every read goes to the bucket.
//
// The budget is of memory: an item counts what it holds (its records as
// segment.RecordsMemSize counts them, and its own bookkeeping), not its
// records' encoded size, which for records of a few bytes is a fraction of
// what they hold (a Record alone is 64 bytes): counted encoded, a cache of
// one-byte records held several times its budget.
//
// Data objects fetched by cold readers take at most coldCacheBytes of it,
// their own oldest out first: a reader catching up through a long stream
// reads each object once, and letting it fill the whole cache bought no
// hits but a heap that grew to the cache's size during the read (every
// fresh page a fault, about 10 us each on a VM; row 7 of the benchmarks
// read at 120 MiB/s with a 64 MiB cache and 210 with 16 MiB). That limit
// counts the objects' encoded sizes, the measure of the read-ahead window
// it is there to hold: counted in memory, a window of objects of tiny
// records would not fit it, and objects read ahead would go before their
// reader came to them. The budget still bounds their memory.
type blockCache struct {
	mu       sync.RWMutex // lookups share it; see get
	budget   int64
	used     int64
	ll       *list.List
	items    map[string]*list.Element
	coldUsed int64
	coldLL   *list.List // the cold items, most recently put first

	hits, misses atomic.Uint64 // lookups by get, for Engine.Stats
}

// coldCacheBytes bounds the cold items of a cache: the read-ahead window
// and the objects being read.
const coldCacheBytes = readAheadBytes + 2*maxDataObject

type cacheItem struct {
	key   string
	recs  []segment.Record
	size  int64         // bytes of memory held, counted against the budget
	wire  int64         // bytes encoded, counted against coldCacheBytes
	cold  *list.Element // in coldLL, for a cold item
	buf   *objBuf       // a cold item's recycled buffer (held while cached), or nil
	used  atomic.Int64  // last get or put (Unix ns), for dropIdle
	moved int64         // when it last went to the front (Unix ns); under mu
}

// cacheReorder is how stale an item's place in the LRU order may get. A
// hot item (the tail every live reader of a stream wants) is then looked
// up under the shared lock, not moved to the front by thousands of readers
// in turn.
const cacheReorder = int64(time.Second)

func newBlockCache(budget int64) *blockCache {
	return &blockCache{budget: budget, ll: list.New(), items: map[string]*list.Element{}, coldLL: list.New()}
}

func (c *blockCache) get(key string) ([]segment.Record, bool) {
	recs, buf, ok := c.lookup(key, false, true)
	buf.escape()
	return recs, ok
}

// getHeld is get for a cold reader that releases what it reads: the
// object's buffer, if recycled, comes held (release it once done).
func (c *blockCache) getHeld(key string) ([]segment.Record, *objBuf, bool) {
	return c.lookup(key, true, true)
}

// recheckHeld is getHeld without counting a lookup: for a caller looking
// again for what its own lookup just missed (a fetch that may have ended
// meanwhile), so that one read counts one lookup.
func (c *blockCache) recheckHeld(key string) ([]segment.Record, *objBuf, bool) {
	return c.lookup(key, true, false)
}

// lookup counts a lookup (if count) and refreshes the item's place in the
// order.
func (c *blockCache) lookup(key string, hold, count bool) ([]segment.Record, *objBuf, bool) {
	now := time.Now().UnixNano()
	c.mu.RLock()
	el, ok := c.items[key]
	if !ok {
		c.mu.RUnlock()
		if count {
			c.misses.Add(1)
		}
		return nil, nil, false
	}
	it := el.Value.(*cacheItem)
	it.used.Store(now)
	recs, stale := it.recs, now-it.moved > cacheReorder
	if hold {
		it.buf.hold()
	}
	buf := it.buf
	c.mu.RUnlock()
	if count {
		c.hits.Add(1)
	}
	if stale {
		c.mu.Lock()
		if cur, ok := c.items[key]; ok && cur == el {
			c.ll.MoveToFront(el)
			it.moved = now
		}
		c.mu.Unlock()
	}
	return recs, buf, true
}

// peek returns key's records without counting a lookup or refreshing the
// entry: for readers about to drop it (compaction).
func (c *blockCache) peek(key string) ([]segment.Record, bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	el, ok := c.items[key]
	if !ok {
		return nil, false
	}
	it := el.Value.(*cacheItem)
	it.buf.escape()
	return it.recs, true
}

// has reports whether key is cached, without counting a lookup.
func (c *blockCache) has(key string) bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	_, ok := c.items[key]
	return ok
}

// put caches recs under key. held is the size of the one buffer their
// bodies alias (a decoded read), or 0 when each append's bodies are their
// own (see segment.RecordsMemSize). It returns what it weighed them at,
// in memory and encoded, kept or not, so that a caller that weighs them
// too does not walk them again.
func (c *blockCache) put(key string, recs []segment.Record, held int) (mem, wire int64) {
	return c.add(key, recs, held, false, nil)
}

// putCold caches a data object fetched by a cold read (see blockCache),
// decoded out of a buffer of held bytes. The caller holds buf (nil if the
// object's buffer is not recycled); the cache takes a hold of its own if
// it keeps the object.
func (c *blockCache) putCold(key string, recs []segment.Record, held int, buf *objBuf) {
	c.add(key, recs, held, true, buf)
}

// cacheItemBytes is what an item costs beside its records and key: the
// item, its elements in the lists and its slot in the index.
const cacheItemBytes = int64(unsafe.Sizeof(cacheItem{}) + 2*unsafe.Sizeof(list.Element{}) + 32)

// recordMem is what a Record takes in a slice of them, besides its body.
const recordMem = int(unsafe.Sizeof(segment.Record{}))

// runMemSize is what caching recs under key holds in memory.
func runMemSize(key string, recs []segment.Record, held int) int64 {
	return cacheItemBytes + int64(len(key)) + int64(segment.RecordsMemSize(recs, held))
}

func (c *blockCache) add(key string, recs []segment.Record, held int, cold bool, buf *objBuf) (size, wire int64) {
	size = runMemSize(key, recs, held)
	for i := range recs {
		wire += int64(segment.RecordSize(&recs[i]))
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if size > c.budget || (cold && wire > coldCacheBytes) {
		return size, wire
	}
	if el, ok := c.items[key]; ok {
		c.unlink(el)
	}
	it := &cacheItem{key: key, recs: recs, size: size, wire: wire, moved: time.Now().UnixNano(), buf: buf}
	buf.hold()
	it.used.Store(it.moved)
	c.items[key] = c.ll.PushFront(it)
	c.used += size
	if cold {
		it.cold = c.coldLL.PushFront(it)
		c.coldUsed += wire
		for c.coldUsed > coldCacheBytes {
			c.unlink(c.items[c.coldLL.Back().Value.(*cacheItem).key])
		}
	}
	for c.used > c.budget {
		c.unlink(c.ll.Back())
	}
	return size, wire
}

// unlink drops the item at el. Called with mu held.
func (c *blockCache) unlink(el *list.Element) {
	it := el.Value.(*cacheItem)
	c.ll.Remove(el)
	delete(c.items, it.key)
	c.used -= it.size
	if it.cold != nil {
		c.coldLL.Remove(it.cold)
		c.coldUsed -= it.wire
	}
	it.buf.release()
}

// couldHoldCold reports whether a cold item of size bytes in memory and
// wire bytes encoded could be cached at all (see add).
func (c *blockCache) couldHoldCold(size, wire int64) bool {
	return size <= c.budgetBytes() && wire <= coldCacheBytes
}

func (c *blockCache) budgetBytes() int64 {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.budget
}

func (c *blockCache) setBudget(b int64) {
	c.mu.Lock()
	c.budget = b
	c.mu.Unlock()
}

// dropIdle removes the items nobody has read or written since cutoff,
// except WAL entries, and returns the bytes released. A WAL entry stays
// until compaction has folded it (and removes it): compaction reads it
// from here, however long the stream has been idle. The list is in use
// order, so the walk stops at the first item used after cutoff.
func (c *blockCache) dropIdle(cutoff time.Time) int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	var freed int64
	for el := c.ll.Back(); el != nil; {
		it := el.Value.(*cacheItem)
		if it.used.Load() > cutoff.UnixNano() {
			break
		}
		prev := el.Prev()
		if !strings.HasPrefix(it.key, walCachePrefix) {
			c.unlink(el)
			freed += it.size
		}
		el = prev
	}
	return freed
}

// shrink rebuilds the index at its present size: Go maps keep the buckets
// of their largest size, and a burst over many streams fills this one with
// an entry per stream.
func (c *blockCache) shrink() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.items = maps.Collect(maps.All(c.items))
}

// dropCold drops key if it is a cold item (see putCold).
func (c *blockCache) dropCold(key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.items[key]; ok && el.Value.(*cacheItem).cold != nil {
		c.unlink(el)
	}
}

// remove drops keys from the cache, if there.
func (c *blockCache) remove(keys []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, k := range keys {
		if el, ok := c.items[k]; ok {
			c.unlink(el)
		}
	}
}
