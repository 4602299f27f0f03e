package streamstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/internal/testenv"
	"github.com/picomq/caddy-picomq/segment"
)

// opCounter counts a store's LISTs and GETs under a key prefix.
type opCounter struct {
	segment.Store
	prefix string
	mu     sync.Mutex
	lists  int
	gets   map[string]int
}

func (c *opCounter) List(ctx context.Context, prefix, after string, max int) ([]segment.ObjectInfo, bool, error) {
	if strings.HasPrefix(prefix, c.prefix) {
		c.mu.Lock()
		c.lists++
		c.mu.Unlock()
	}
	return c.Store.List(ctx, prefix, after, max)
}

func (c *opCounter) Get(ctx context.Context, key string, off, n int64) ([]byte, string, error) {
	if strings.HasPrefix(key, c.prefix) {
		c.mu.Lock()
		c.gets[key]++
		c.mu.Unlock()
	}
	return c.Store.Get(ctx, key, off, n)
}

func (c *opCounter) counts() (lists, gets, maxPerKey int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, n := range c.gets {
		gets += n
		maxPerKey = max(maxPerKey, n)
	}
	return c.lists, gets, maxPerKey
}

// writeObjects makes stream name hold n data objects of two records each.
func writeObjects(t *testing.T, e *Engine, name string, n int) {
	t.Helper()
	ctx := context.Background()
	setPackBelow(e, -1)  // data objects of their own, not packs
	setMergeBelow(e, -1) // one per fold, not merged into one
	if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if _, err := e.Append(ctx, name, AppendRequest{Records: recs(fmt.Sprint(2*i), fmt.Sprint(2*i+1))}); err != nil {
			t.Fatal(err)
		}
		if err := e.Compact(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// countedColdStream writes stream name as n data objects of two records
// each, then starts a second engine on the same store that counts its
// data GETs and LISTs: the stream is cold there.
func countedColdStream(t *testing.T, name string, n int) (*Engine, *opCounter) {
	t.Helper()
	st := memstore.New()
	writeObjects(t, startEngine(t, st, Config{}), name, n)
	counter := &opCounter{Store: st, prefix: "data/", gets: map[string]int{}}
	return startEngine(t, counter, Config{}), counter
}

// A cold read through many data objects lists them once, not once per
// object, and reads each object once; the objects after the one being read
// arrive in the cache ahead of the reader.
func TestColdReadListsOnceAndReadsAhead(t *testing.T) {
	ctx := context.Background()
	const objects = 8
	e, counter := countedColdStream(t, "/cold", objects)
	info, err := e.Head(ctx, "/cold")
	if err != nil {
		t.Fatal(err)
	}
	// The first read misses, and starts fetching what follows.
	if _, err := e.Read(ctx, "/cold", ReadRequest{Seq: 0, MaxRecords: 2}); err != nil {
		t.Fatal(err)
	}
	ahead := dataKey(info.ID, 2, 4)
	deadline := time.Now().Add(2 * time.Second)
	for !e.cache.has(ahead) {
		if time.Now().After(deadline) {
			t.Fatalf("the next data object %s was not read ahead", ahead)
		}
		time.Sleep(5 * time.Millisecond)
	}
	var got []string
	for seq := uint64(0); seq < 2*objects; {
		res, err := e.Read(ctx, "/cold", ReadRequest{Seq: seq, MaxRecords: 2})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range res.Records {
			got = append(got, string(r.Body))
		}
		seq += uint64(len(res.Records))
	}
	for i, b := range got {
		if b != fmt.Sprint(i) {
			t.Fatalf("record %d is %q", i, b)
		}
	}
	lists, gets, maxPerKey := counter.counts()
	if lists != 1 {
		t.Errorf("%d LISTs of data keys for %d objects; want 1", lists, objects)
	}
	if gets != objects || maxPerKey != 1 {
		t.Errorf("%d data GETs (at most %d of one key) for %d objects; want each read once", gets, maxPerKey, objects)
	}
}

// A fetch of an object that another fetch has just put in the cache (it
// ended between the caller's cache lookup and its fetch) takes it from the
// cache instead of reading it again. With a read-ahead running in front of
// the reader this happened now and then, and an object was read twice.
func TestFetchAfterAFinishedFetchUsesTheCache(t *testing.T) {
	ctx := context.Background()
	e, counter := countedColdStream(t, "/again", 1)
	info, err := e.Head(ctx, "/again")
	if err != nil {
		t.Fatal(err)
	}
	key := dataKey(info.ID, 0, 2)
	first, buf, err := e.fetchData(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.release()
	second, buf2, err := e.fetchData(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	defer buf2.release()
	if _, gets, _ := counter.counts(); gets != 1 {
		t.Fatalf("%d GETs for two fetches of a cached object; want 1", gets)
	}
	if len(first) != 2 || len(second) != 2 || string(second[1].Body) != "1" {
		t.Fatalf("fetched %d then %d records", len(first), len(second))
	}
}

// A trim rewrites the data object at the trim point; a reader whose index
// still names the old object lists again instead of failing.
func TestDataIndexFollowsTrim(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{CacheBytes: 1}) // every read goes to the bucket
	writeObjects(t, e, "/trim", 3)
	if got := readAll(t, e, "/trim"); len(got) != 6 {
		t.Fatalf("read %q", got)
	}
	if _, err := e.Trim(ctx, "/trim", 3); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	res, err := e.Read(ctx, "/trim", ReadRequest{Seq: 3})
	if err != nil {
		t.Fatalf("read after trim with a stale index: %v", err)
	}
	var got []string
	for _, r := range res.Records {
		got = append(got, string(r.Body))
	}
	if strings.Join(got, ",") != "3,4,5" {
		t.Fatalf("read after trim: %q; want 3,4,5", got)
	}
}

// A reader reads ahead by bytes: at least the next object, as many as fit
// in readAheadBytes, never more than readAheadObjects.
func TestReadAheadSpans(t *testing.T) {
	spans := func(sizes ...int64) []dataSpan {
		out := make([]dataSpan, len(sizes))
		for i, sz := range sizes {
			out[i] = dataSpan{first: uint64(i), end: uint64(i + 1), size: sz}
		}
		return out
	}
	const mib = 1 << 20
	tests := []struct {
		name  string
		spans []dataSpan
		at    int
		want  int
	}{
		{"last object", spans(mib), 0, 0},
		{"small objects stop at the object cap", spans(make([]int64, 40)...), 0, readAheadObjects},
		{"4 MiB objects fill 16 MiB", spans(mib, 4*mib, 4*mib, 4*mib, 4*mib, 4*mib), 0, 4},
		{"one huge object still comes", spans(mib, 64*mib, mib), 0, 1},
		{"near the end", spans(mib, mib, mib), 1, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := ahead(tt.spans, tt.at, readAheadObjects)
			if len(got) != tt.want {
				t.Fatalf("%d spans ahead, want %d", len(got), tt.want)
			}
			if len(got) > 0 && got[0].first != tt.spans[tt.at+1].first {
				t.Fatal("read-ahead does not start at the next object")
			}
		})
	}
}

// gatedStore holds the GETs of keys under prefix until their key is opened
// (or all are), and records which began.
type gatedStore struct {
	segment.Store
	prefix  string
	mu      sync.Mutex
	changed chan struct{} // closed and replaced at every change
	open    map[string]bool
	allOpen bool
	began   map[string]int
}

func newGatedStore(t *testing.T, st segment.Store, prefix string) *gatedStore {
	g := &gatedStore{Store: st, prefix: prefix, changed: make(chan struct{}), open: map[string]bool{}, began: map[string]int{}}
	// Registered before the engine's cleanup, so it runs after it: held
	// GETs end and their goroutines with them.
	t.Cleanup(func() { g.openAll() })
	return g
}

func (g *gatedStore) signalLocked() {
	close(g.changed)
	g.changed = make(chan struct{})
}

func (g *gatedStore) Get(ctx context.Context, key string, off, n int64) ([]byte, string, error) {
	if strings.HasPrefix(key, g.prefix) {
		g.mu.Lock()
		g.began[key]++
		g.signalLocked()
		for !g.allOpen && !g.open[key] {
			ch := g.changed
			g.mu.Unlock()
			select {
			case <-ch:
			case <-ctx.Done():
				return nil, "", ctx.Err()
			}
			g.mu.Lock()
		}
		g.mu.Unlock()
	}
	return g.Store.Get(ctx, key, off, n)
}

func (g *gatedStore) openKeys(keys ...string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, k := range keys {
		g.open[k] = true
	}
	g.signalLocked()
}

func (g *gatedStore) openAll() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.allOpen = true
	g.signalLocked()
}

// begun returns how many GETs of key began.
func (g *gatedStore) begun(key string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.began[key]
}

// waitFor waits up to 5 s for cond, checked at every change.
func (g *gatedStore) waitFor(cond func() bool) bool {
	deadline := time.After(5 * time.Second)
	for {
		g.mu.Lock()
		ch := g.changed
		g.mu.Unlock()
		if cond() {
			return true
		}
		select {
		case <-ch:
		case <-time.After(10 * time.Millisecond):
		case <-deadline:
			return cond()
		}
	}
}

// gatedColdStream writes stream name as n data objects of two records
// each, then starts a second engine on the same store with every data GET
// held by a gatedStore. key(i) is the i-th object's key.
func gatedColdStream(t *testing.T, name string, n int) (e *Engine, g *gatedStore, st segment.Store, key func(int) string) {
	t.Helper()
	st = memstore.New()
	writeObjects(t, startEngine(t, st, Config{}), name, n)
	g = newGatedStore(t, st, "data/")
	e = startEngine(t, g, Config{})
	info, err := e.Head(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return e, g, st, func(i int) string { return dataKey(info.ID, uint64(2*i), uint64(2*i+2)) }
}

// The read-ahead follows the reader: an object it waits on does not hold up
// the objects that came into the window since. A read-ahead that ran window
// by window started the next window only when every GET of the previous
// one had ended, so one slow GET stalled the pipe.
func TestReadAheadSlidesWithTheReader(t *testing.T) {
	ctx := context.Background()
	const objects = 24
	e, g, _, key := gatedColdStream(t, "/slide", objects)
	const held = 10
	// Walking objects 0 to 3, each arriving only once the reader waits
	// for it, opens the window to its full size; at object 2 it reaches
	// the held one.
	const walked = 4
	for i := range walked {
		done := make(chan error, 1)
		go func() {
			_, err := e.Read(ctx, "/slide", ReadRequest{Seq: uint64(2 * i), MaxRecords: 2})
			done <- err
		}()
		// Object i is let through once the GETs begun show the reader is
		// there: its own GET of object 0, then the first object past what
		// half the window it opened at object i (doubled from 2 at each
		// object it had to wait for) would read ahead. (The window's last
		// objects may wait for a worker.)
		sign := key(0)
		if i > 0 {
			sign = key(i + readAheadStart<<i/2 + 1)
		}
		if !g.waitFor(func() bool { return g.begun(sign) > 0 }) {
			t.Fatalf("the reader did not reach object %d with a window of %d", i, readAheadStart<<i)
		}
		g.openKeys(key(i))
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	for i := walked; i < objects; i++ {
		if i != held {
			g.openKeys(key(i))
		}
	}
	last := walked - 1 + readAheadObjects
	if !g.waitFor(func() bool { return g.begun(key(held)) == 1 && g.begun(key(last)) == 1 }) {
		t.Fatalf("object %d was not read ahead while object %d was held", last, held)
	}
	g.openAll()
	for seq := uint64(2 * walked); seq < 2*objects; {
		res, err := e.Read(ctx, "/slide", ReadRequest{Seq: seq, MaxRecords: 2})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range res.Records {
			if string(r.Body) != fmt.Sprint(r.Seq) {
				t.Fatalf("record %d is %q", r.Seq, r.Body)
			}
		}
		seq = res.NextSeq
	}
	for i := range objects {
		if n := g.begun(key(i)); n != 1 {
			t.Errorf("object %d fetched %d times; want once", i, n)
		}
	}
}

// The window opens small and doubles while a reader walks on from one
// object to the next and finds it not there yet; anything else but a step
// to the next object starts it small again. Readers at different places
// of a stream grow windows of their own. A reader that moves on leaves its
// last object behind, unless another reader is at or before it.
func TestReadAheadWindowRamps(t *testing.T) {
	obj := func(i uint64) dataSpan { return dataSpan{first: 2 * i, end: 2*i + 2, key: fmt.Sprint(i)} }
	type step struct {
		at     uint64 // object read
		ready  bool   // it was cached
		want   int
		behind string
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"first read", []step{{7, false, readAheadStart, ""}}},
		{"walking, every object late", []step{{0, false, 2, ""}, {1, false, 4, "0"}, {2, false, 8, "1"}, {3, false, 16, "2"}, {4, false, 16, "3"}}},
		{"walking, objects waiting", []step{{0, false, 2, ""}, {1, true, 2, "0"}, {2, true, 2, "1"}, {3, false, 4, "2"}, {4, true, 4, "3"}}},
		{"the same object again", []step{{0, false, 2, ""}, {1, false, 4, "0"}, {1, false, 4, ""}, {2, false, 8, "1"}}},
		{"a jump ahead", []step{{0, false, 2, ""}, {1, false, 4, "0"}, {2, false, 8, "1"}, {9, false, 2, ""}}},
		{"back", []step{{0, false, 2, ""}, {1, false, 4, "0"}, {0, false, 2, ""}}},
		// The reader at 50 leaves nothing behind: the other one comes
		// that way.
		{"two readers walking apart", []step{{0, false, 2, ""}, {50, false, 2, ""}, {1, false, 4, "0"}, {51, false, 4, ""}, {2, false, 8, "1"}, {52, false, 8, ""}, {3, false, 16, "2"}}},
		// A fifth reader (at 50) takes the cursor moved least recently,
		// the first reader's, which starts over at 2 and takes the
		// second's; the third's (at 30) is still there, and the reader
		// at 2 keeps 30 in the cache.
		{"more readers than cursors", []step{{0, false, 2, ""}, {1, false, 4, "0"}, {20, false, 2, ""}, {30, false, 2, ""},
			{40, false, 2, ""}, {50, false, 2, ""}, {2, false, 2, ""}, {31, false, 4, ""}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var ra readAheadState
			for k, st := range tt.steps {
				got, behind := ra.windowAt(obj(st.at), st.ready)
				if got != st.want {
					t.Fatalf("read %d (object %d): window %d, want %d", k, st.at, got, st.want)
				}
				if behind != st.behind {
					t.Fatalf("read %d (object %d): left %q behind, want %q", k, st.at, behind, st.behind)
				}
			}
		})
	}
}

// A single read at an old offset of a cold stream fetches its object and
// the few after it, not a whole window.
func TestOneReadFetchesLittleAhead(t *testing.T) {
	ctx := context.Background()
	const objects = 20
	e, counter := countedColdStream(t, "/once", objects)
	if _, err := e.Read(ctx, "/once", ReadRequest{Seq: 10, MaxRecords: 2}); err != nil {
		t.Fatal(err)
	}
	gets := func() int { _, n, _ := counter.counts(); return n }
	want := 1 + readAheadStart
	// The read queued its read-ahead and started its workers before it
	// returned; once they have all ended, no more GET can begin. Wait for
	// that, not for a while in which a late GET may not have begun yet.
	s, err := e.stream(ctx, "/once")
	if err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	started := s.ra != nil && (s.ra.workers > 0 || len(s.ra.queue) > 0)
	s.mu.Unlock()
	if !started && gets() < want {
		t.Fatal("the read started no read-ahead: nothing tested")
	}
	if err := waitUntil(5*time.Second, func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.ra.workers == 0
	}); err != nil {
		t.Fatal("the read-ahead workers never ended")
	}
	if n := gets(); n != want {
		t.Fatalf("%d data GETs for one read; want %d (its object and %d ahead)", n, want, readAheadStart)
	}
}

// Read-ahead GETs in flight hold at most the engine's limit of bytes, so
// many cold readers at once cannot fill memory with objects on their way.
func TestReadAheadBoundsBytesInFlight(t *testing.T) {
	ctx := context.Background()
	const objects = readAheadObjects + 1
	e, g, st, key := gatedColdStream(t, "/bound", objects)
	listed, _, err := st.List(ctx, "data/", "", 1000) // the store's only stream
	if err != nil || len(listed) != objects {
		t.Fatalf("listed %d data objects (%v), want %d", len(listed), err, objects)
	}
	var window []dataSpan // every object after the first, in order
	for _, o := range listed[1:] {
		first, end, _, ok := parseDataKey(o.Key)
		if !ok {
			t.Fatalf("data key %s", o.Key)
		}
		window = append(window, dataSpan{first: first, end: end, key: o.Key, size: o.Size})
	}
	// Room for the first five objects of the window, not six.
	const fit = 5
	var limit int64
	for _, sp := range window[:fit] {
		limit += sp.size
	}
	e.fetchMu.Lock()
	e.aheadLimit = limit
	e.fetchMu.Unlock()
	s, err := e.stream(ctx, "/bound")
	if err != nil {
		t.Fatal(err)
	}
	e.prefetch(s, window)
	ahead := func() (n int) {
		for i := 1; i < objects; i++ {
			n += g.begun(key(i))
		}
		return n
	}
	if !g.waitFor(func() bool { return ahead() >= fit }) {
		t.Fatalf("%d read-ahead GETs began; want %d", ahead(), fit)
	}
	// Settled: every worker left is in a GET that began (the gate holds
	// them), the others gave up for want of room, and the rest of the
	// window is still queued. No GET can begin after that until one ends,
	// so the count is final, not a count taken while one was on its way.
	settled := func() (workers, queued int) {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.ra.workers, len(s.ra.queue)
	}
	if !g.waitFor(func() bool {
		w, q := settled()
		return w == ahead() && q+ahead() == len(window)
	}) {
		w, q := settled()
		t.Fatalf("read-ahead never settled: %d workers, %d queued, %d GETs begun, %d objects in the window", w, q, ahead(), len(window))
	}
	if n := ahead(); n != fit {
		t.Fatalf("%d read-ahead GETs in flight at once; the limit has room for %d", n, fit)
	}
	g.openAll()
	got := readAll(t, e, "/bound")
	if len(got) != 2*objects {
		t.Fatalf("read %d records, want %d", len(got), 2*objects)
	}
	// The last read-ahead GET may end just after the reader that joined it.
	inFlight := func() int64 {
		e.fetchMu.Lock()
		defer e.fetchMu.Unlock()
		return e.aheadBytes
	}
	if !g.waitFor(func() bool { return inFlight() == 0 }) {
		t.Fatalf("%d bytes of read-ahead still counted in flight after the read", inFlight())
	}
}

// A read-ahead worker skips an object every reader of the stream has
// moved past (it took it from the queue before they got there).
func TestReadAheadSkipsWhatEveryReaderPassed(t *testing.T) {
	obj := func(i uint64) dataSpan { return dataSpan{first: 2 * i, end: 2*i + 2, key: fmt.Sprint(i)} }
	tests := []struct {
		name    string
		readers []uint64 // objects the readers are at
		obj     uint64
		passed  bool
	}{
		{"no readers", nil, 3, false},
		{"behind the only reader", []uint64{5}, 3, true},
		{"at the reader", []uint64{5}, 5, false},
		{"ahead of the reader", []uint64{5}, 6, false},
		{"behind one reader, ahead of another", []uint64{5, 1}, 3, false},
		{"behind both", []uint64{5, 4}, 3, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var ra readAheadState
			for _, at := range tt.readers {
				ra.windowAt(obj(at), false)
			}
			if got := ra.passed(obj(tt.obj)); got != tt.passed {
				t.Fatalf("passed(%d) = %v with readers at %v; want %v", tt.obj, got, tt.readers, tt.passed)
			}
		})
	}
}

// Read-ahead GETs run on the engine's pool, which stay after a cold
// read for the next one (a goroutine per GET grew a fresh stack through
// the S3 client every time) and end when the engine closes.
func TestReadAheadGoroutinesEndAtClose(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	w := startEngine(t, st, Config{})
	writeObjects(t, w, "/ahead", 8)
	if err := w.Close(ctx); err != nil {
		t.Fatal(err)
	}
	before := testenv.WaitPoolGoroutines(0, 5*time.Second)
	e := startEngine(t, st, Config{})
	for seq := uint64(0); seq < 16; {
		res, err := e.Read(ctx, "/ahead", ReadRequest{Seq: seq, MaxRecords: 2})
		if err != nil {
			t.Fatal(err)
		}
		seq = res.NextSeq
	}
	if n := testenv.PoolGoroutines() - before; n < 1 {
		t.Errorf("%d pool goroutines waiting after a cold read, want some", n)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if n := testenv.WaitPoolGoroutines(before, time.Second) - before; n != 0 {
		t.Errorf("%d pool goroutines left after Close, want 0", n)
	}
}

// latentStore delays every data GET, so that a cold reader waits for its
// objects and its read-ahead window grows.
type latentStore struct {
	segment.Store
	delay time.Duration
}

func (s latentStore) Get(ctx context.Context, key string, off, n int64) ([]byte, string, error) {
	if strings.HasPrefix(key, "data/") {
		select {
		case <-time.After(s.delay):
		case <-ctx.Done():
			return nil, "", ctx.Err()
		}
	}
	return s.Store.Get(ctx, key, off, n)
}

// Objects the cache cannot hold (one-byte records: 850 KB of object, 4 MiB
// decoded, with a 2 MiB cache) are not read ahead: the cache dropped each
// as it came in, and a cold reader's window sent GETs for nothing, more
// than one per object on top of the reader's own.
func TestReadAheadSkipsObjectsTheCacheCannotHold(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	w := startEngine(t, st, Config{})
	setPackBelow(w, -1)
	if _, _, err := w.Create(ctx, "/tiny", CreateRequest{ContentType: "application/octet-stream"}); err != nil {
		t.Fatal(err)
	}
	const objects, perObject = 8, 50_000
	batch := make([]NewRecord, perObject)
	for i := range batch {
		batch[i].Body = []byte{byte(i)}
	}
	for range objects {
		if _, err := w.Append(ctx, "/tiny", AppendRequest{Records: batch}); err != nil {
			t.Fatal(err)
		}
		if err := w.Compact(ctx); err != nil {
			t.Fatal(err)
		}
	}
	counter := &opCounter{Store: latentStore{st, 20 * time.Millisecond}, prefix: "data/", gets: map[string]int{}}
	e := startEngine(t, counter, Config{CacheBytes: 2 << 20})
	reads := 0
	for seq := uint64(0); seq < objects*perObject; reads++ {
		res, err := e.Read(ctx, "/tiny", ReadRequest{Seq: seq, MaxRecords: 10_000})
		if err != nil {
			t.Fatal(err)
		}
		res.Release()
		if res.NextSeq <= seq {
			t.Fatalf("read at %d moved to %d", seq, res.NextSeq)
		}
		seq = res.NextSeq
	}
	_, gets, most := counter.counts()
	t.Logf("%d reads of %d objects the cache cannot hold: %d GETs, at most %d of one object", reads, objects, gets, most)
	if gets > reads {
		t.Errorf("%d GETs for %d reads: objects were read ahead for nothing", gets, reads)
	}
}

// gatedGets holds every GET of a key under prefix until open is closed or
// the GET's context ends, as a slow bucket would; started gets one value
// per GET held.
type gatedGets struct {
	*memstore.Store
	prefix  string
	open    chan struct{}
	started chan string
}

func (g *gatedGets) Get(ctx context.Context, key string, off, n int64) ([]byte, string, error) {
	if strings.HasPrefix(key, g.prefix) {
		g.started <- key
		select {
		case <-g.open:
		case <-ctx.Done():
			return nil, "", ctx.Err()
		}
	}
	return g.Store.Get(ctx, key, off, n)
}

// Readers that join a cold object's GET get the object when the reader
// whose miss started the GET leaves (its client went away) before it
// lands: the GET is no one reader's. It ran on the first reader's context,
// so every reader joined to it failed with that reader's cancellation.
func TestFetchOutlivesTheReaderThatStartedIt(t *testing.T) {
	st := memstore.New()
	writeObjects(t, startEngine(t, st, Config{}), "/shared", 1)
	g := &gatedGets{Store: st, prefix: "data/", open: make(chan struct{}), started: make(chan string, 4)}
	e := startEngine(t, g, Config{})
	info, err := e.Head(context.Background(), "/shared")
	if err != nil {
		t.Fatal(err)
	}
	key := dataKey(info.ID, 0, 2)

	first, leave := context.WithCancel(context.Background())
	firstDone := make(chan error, 1)
	go func() {
		_, buf, err := e.fetchData(first, key)
		buf.release()
		firstDone <- err
	}()
	<-g.started
	type result struct {
		recs []Record
		err  error
	}
	second := make(chan result, 1)
	go func() {
		recs, buf, err := e.fetchData(context.Background(), key)
		if err == nil {
			recs = slices.Clone(recs)
		}
		buf.release()
		second <- result{recs, err}
	}()
	// The second reader has joined the GET in flight.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		e.fetchMu.Lock()
		c := e.fetching[key]
		joined := c != nil && c.waiters > 0
		e.fetchMu.Unlock()
		if joined {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the second reader did not join the GET in flight")
		}
	}
	leave()
	if err := <-firstDone; !errors.Is(err, context.Canceled) {
		t.Errorf("the reader that left got %v; want its own cancellation", err)
	}
	close(g.open)
	got := <-second
	if got.err != nil || len(got.recs) != 2 {
		t.Fatalf("the reader still waiting got %d records, %v; want the object", len(got.recs), got.err)
	}
	select {
	case k := <-g.started:
		t.Errorf("a second GET of %s; want the one GET shared", k)
	default:
	}
}

// A read with Until answers with the records it has once a wait for the
// next object runs past it: the object's GET, held at the store, goes on,
// and the read after it gets those records. A catch-up over many objects
// on a slow store used to answer only once it had them all, past its
// caller's time (a server's write timeout, a client's).
func TestReadAnswersAtItsUntilWithWhatItHas(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{PackBelow: -1, MergeBelow: -1})
	if _, _, err := e.Create(ctx, "/u", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	for _, body := range []string{"r0", "r1"} {
		mustAppend(t, e, "/u", AppendRequest{Records: recs(body)})
		mustCompact(t, e)
	}
	keys := st.Keys("data/")
	if len(keys) != 2 {
		t.Fatalf("data objects %v; want one per compacted append", keys)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	e = startEngine(t, st, Config{PackBelow: -1, CacheBytes: 1})
	release := make(chan struct{})
	var releaseOnce sync.Once
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) })
	st.SetFail(func(op, key string) error {
		if op == "GET" && key == keys[1] {
			select {
			case <-release:
			case <-time.After(3 * time.Second): // a read that waits gets it then
			}
		}
		return nil
	})
	res, err := e.Read(ctx, "/u", ReadRequest{Until: time.Now().Add(300 * time.Millisecond)})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range res.Records {
		got = append(got, string(r.Body))
	}
	if !slices.Equal(got, []string{"r0"}) || res.UpToDate || res.NextSeq != 1 {
		t.Fatalf("a read whose second object is held past its Until: %q, up to date %v, next %d; want [r0], not up to date, next 1",
			got, res.UpToDate, res.NextSeq)
	}
	releaseOnce.Do(func() { close(release) })
	res, err = e.Read(ctx, "/u", ReadRequest{Seq: 1, Until: time.Now().Add(10 * time.Second)})
	if err != nil || len(res.Records) != 1 || string(res.Records[0].Body) != "r1" || !res.UpToDate {
		t.Fatalf("the read after it: %v, %v; want [r1], up to date", res.Records, err)
	}
}
