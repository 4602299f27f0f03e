package streamstore

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/picomq/caddy-picomq/segment"
)

// A cold reader walks a stream's data objects in order. Two things keep it
// at object-store speed: the stream remembers where its data objects are (a
// list of up to a thousand keys at a time, instead of a one-key LIST before
// every GET), and reading an object that was not cached starts fetching the
// next ones in the background, so the next request finds them in the cache
// while the client is still receiving this one.

// dataSpan is one data object: records [first, end).
type dataSpan struct {
	first, end uint64
	key        string // the object to read: the blob, for a marker
	size       int64  // bytes
}

// memSize is about what sp's object holds in memory once decoded (see
// runMemSize): its bytes and a Record per record. Headers are left out.
func (sp dataSpan) memSize() int64 {
	return cacheItemBytes + int64(len(sp.key)) + sp.size + int64(sp.end-sp.first)*int64(recordMem)
}

// dataIndex is what a stream knows of its data objects: one listing's page,
// every object from the one it started at on, in seq order (there may be
// more after the last).
type dataIndex struct {
	id    string
	spans []dataSpan
}

// find returns the index of the span holding seq, or -1.
func (x *dataIndex) find(seq uint64) int {
	i := sort.Search(len(x.spans), func(i int) bool { return x.spans[i].end > seq })
	return holding(x.spans, i, seq)
}

// holding returns the index of the span from spans[i] on that holds seq,
// spans[i] being the first that ends after it, or -1. It takes the first
// end with a span that holds seq and, of the spans with that end, the one
// that starts last: a trim into a data object or a blob rewrites its kept
// records as an object with the same end, and the object it replaced,
// deleted, can come back when a PUT of it held up on its way lands late
// (a blob's marker then names a deleted blob). The rewritten one holds the
// same records from its first on. Spans that start past seq are passed
// over: an object written by a fold whose checkpoint failed, which the
// object of a later fold that merged the tail before it overlaps (starting
// before it and ending after it), holds nothing at seq.
func holding(spans []dataSpan, i int, seq uint64) int {
	for i < len(spans) {
		end, found := spans[i].end, -1
		for ; i < len(spans) && spans[i].end == end; i++ {
			if spans[i].first <= seq {
				found = i
			}
		}
		if found >= 0 {
			return found
		}
	}
	return -1
}

// A cold read fetches ahead of itself the next data objects up to
// readAheadBytes (at least one, at most readAheadObjects): one GET at a time
// leaves the reader waiting on each object's round trip, and small objects
// (compaction of a slow stream) would keep little in flight if counted by
// objects. The window slides with the reader, and up to readAheadFetches
// GETs of it are in flight per stream: what a read must keep in flight is
// bandwidth times latency, so two at a time kept up with a store next door
// but read 1 MiB objects from a bucket 25 ms away at about 64 MiB/s.
// Across streams, read-ahead GETs hold at most readAheadInFlight bytes.
//
// The window opens at readAheadStart objects and doubles each time the
// reader moves on to the next object and finds it not there yet, up to
// readAheadObjects: a single read at an old offset costs a couple of GETs
// ahead rather than sixteen (which, from many such readers, would also
// fill the budget the walkers need); a reader far from its bucket has its
// full window after four objects it had to wait for; and one next door,
// whose objects arrive before it wants them, keeps two or so in flight
// rather than sixteen objects' worth of heap.
const (
	readAheadBytes    = 16 << 20
	readAheadObjects  = 16
	readAheadStart    = 2
	readAheadFetches  = 16
	readAheadInFlight = 2 * readAheadBytes
)

// ahead returns the spans after spans[i] that a reader at spans[i] reads
// ahead with a window of n objects.
func ahead(spans []dataSpan, i, n int) []dataSpan {
	var bytes int64
	j := i + 1
	for j < len(spans) && j-i <= n && (j == i+1 || bytes+spans[j].size <= readAheadBytes) {
		bytes += spans[j].size
		j++
	}
	return spans[i+1 : j]
}

// dataListPage is how many data keys one index refresh lists.
const dataListPage = 1000

// dataSpanAt returns the data object holding seq of stream s (internal id
// id) and the objects after it that the index knows of.
func (e *Engine) dataSpanAt(ctx context.Context, s *stream, id string, seq uint64) (dataSpan, []dataSpan, error) {
	s.mu.Lock()
	if x := s.dataIdx; x != nil && x.id == id {
		if i := x.find(seq); i >= 0 {
			sp := x.spans[i]
			window, behind := s.readAhead().windowAt(sp, e.cache.has(sp.key))
			next := ahead(x.spans, i, window)
			s.mu.Unlock()
			if behind != "" {
				e.cache.dropCold(behind)
			}
			return sp, next, nil
		}
	}
	s.mu.Unlock()

	spans, i, err := e.listDataAt(ctx, id, seq)
	if err != nil {
		return dataSpan{}, nil, err
	}
	s.mu.Lock()
	s.dataIdx = &dataIndex{id: id, spans: spans}
	window, behind := s.readAhead().windowAt(spans[i], e.cache.has(spans[i].key))
	next := ahead(spans, i, window)
	s.mu.Unlock()
	if behind != "" {
		e.cache.dropCold(behind)
	}
	return spans[i], next, nil
}

// dataListPages bounds the listing pages a lookup of one seq reads past
// objects that start after it (see holding): they are what failed folds
// left, a few at most.
const dataListPages = 4

// listDataAt lists the data objects of id from the one holding seq on and
// returns them and the index of that one.
func (e *Engine) listDataAt(ctx context.Context, id string, seq uint64) ([]dataSpan, int, error) {
	after := dataKeyAfter(id, seq)
	for page := 0; page < dataListPages; page++ {
		objs, more, err := e.store.List(ctx, dataPrefix(id), after, dataListPage)
		if err != nil {
			return nil, 0, fmt.Errorf("%w: find data of %s at %d: %v", ErrUnavailable, id, seq, err)
		}
		spans := make([]dataSpan, 0, len(objs))
		for _, o := range objs {
			first, end, blob, ok := parseDataKey(o.Key)
			if !ok {
				return nil, 0, fmt.Errorf("%w: data key %s", segment.ErrCorrupt, o.Key)
			}
			sp := dataSpan{first: first, end: end, key: o.Key, size: o.Size}
			if blob != "" {
				sp.key, sp.size = blobKey(id, blob), blobSize(blob)
			}
			spans = append(spans, sp)
		}
		if i := holding(spans, 0, seq); i >= 0 {
			return spans, i, nil
		}
		if !more || len(objs) == 0 {
			break
		}
		after = objs[len(objs)-1].Key
	}
	return nil, 0, fmt.Errorf("%w: no data object holds seq %d of %s", segment.ErrCorrupt, seq, id)
}

// readAheadState is a stream's read-ahead, made at its first cold read
// (most streams never have one). Guarded by the stream's mutex.
type readAheadState struct {
	queue   []dataSpan // data objects to read ahead, in order
	workers int        // goroutines reading them
	// cursors are where the readers walking the stream are: each grows
	// its own window, so readers at different places do not keep
	// resetting each other's.
	cursors [readAheadCursors]aheadCursor
	reads   uint64 // calls to windowAt, to tell the least recently used cursor
}

// readAheadCursors is how many readers of one stream keep a window of
// their own; more than that share the least recently moved one.
const readAheadCursors = 4

type aheadCursor struct {
	at     dataSpan // the object read last
	window int      // objects read ahead of it; 0: unused
	used   uint64
}

// readAhead returns s's read-ahead, making it. Called with s.mu held.
func (s *stream) readAhead() *readAheadState {
	if s.ra == nil {
		s.ra = &readAheadState{}
	}
	return s.ra
}

// windowAt returns how many objects a reader now at sp reads ahead:
// readAheadStart, doubled each time a reader moved on from the object it
// read last to the next one and found it not there yet (ready false: not
// cached), at most readAheadObjects. A reader that finds its objects
// waiting keeps its window: a store next door needs two or so in flight,
// and every object more held is memory the heap must grow by (see
// bufPool); a bucket far away leaves the reader waiting until the window
// covers the round trip.
//
// When the reader moved on, behind is the key of the object it left,
// unless another reader is at it or before it: nobody is coming back for
// it, and a cold object is dropped from the cache then (its buffer goes
// back to the pool at once instead of after another 24 MiB).
func (r *readAheadState) windowAt(sp dataSpan, ready bool) (window int, behind string) {
	r.reads++
	var c *aheadCursor
	for i := range r.cursors {
		k := &r.cursors[i]
		switch {
		case k.window == 0:
		case sp.first == k.at.first:
			// Still the same object (its records come in several reads).
			c = k
		case sp.first == k.at.end:
			c = k
			if !ready {
				c.window = min(2*c.window, readAheadObjects)
			}
			behind = k.at.key
			for j := range r.cursors {
				if o := &r.cursors[j]; o != k && o.window != 0 && o.at.first <= k.at.first {
					behind = ""
				}
			}
		}
		if c != nil {
			break
		}
	}
	if c == nil {
		c = &r.cursors[0]
		for i := range r.cursors {
			if r.cursors[i].used < c.used {
				c = &r.cursors[i]
			}
		}
		c.window = readAheadStart
	}
	c.at, c.used = sp, r.reads
	return c.window, behind
}

// fetchCall is one data object GET in flight; a reader that wants the
// same object (a read-ahead and the reader it runs ahead of) waits for it
// rather than reading the object twice.
type fetchCall struct {
	done    chan struct{}
	recs    []Record
	buf     *objBuf
	err     error
	waiters int // callers joined so far; under Engine.fetchMu
}

// fetchData reads and decodes one data object into the cache, joining a
// fetch of the same object already in flight. The object's buffer, if
// recycled, comes held: release it once done with the records.
func (e *Engine) fetchData(ctx context.Context, key string) ([]Record, *objBuf, error) {
	e.fetchMu.Lock()
	if c, ok := e.fetching[key]; ok {
		c.waiters++
		e.fetchMu.Unlock()
		return e.joinFetch(ctx, key, c)
	}
	// A fetch puts the object in the cache before it leaves the table: one
	// that ended since the caller looked in the cache has left it there.
	// The caller counted its lookup already (a miss): this one is not
	// counted again.
	if recs, buf, ok := e.cache.recheckHeld(key); ok {
		e.fetchMu.Unlock()
		return recs, buf, nil
	}
	// The GET is no one reader's: it runs on the engine's context, and
	// this caller waits for it as a reader joining it would, so that one
	// leaving (its client went away) does not fail the others that joined.
	c := e.newFetchLocked(key)
	c.waiters++
	e.fetchMu.Unlock()
	if e.goBG(func() { _ = e.fetchDetached(key, c, 0) }) {
		return e.joinFetch(ctx, key, c)
	}
	// Closing: no new background work; the caller runs it as before.
	e.fetchMu.Lock()
	c.waiters--
	e.fetchMu.Unlock()
	return e.runFetch(ctx, key, c)
}

// newFetchLocked enters a fetch of key in the table, for its caller to
// run. Called with fetchMu held.
func (e *Engine) newFetchLocked(key string) *fetchCall {
	c := &fetchCall{done: make(chan struct{})}
	if e.fetching == nil {
		e.fetching = map[string]*fetchCall{}
	}
	e.fetching[key] = c
	return c
}

// runFetch runs c, the fetch of key its caller entered, and hands a hold
// on the object to every caller that joined it.
func (e *Engine) runFetch(ctx context.Context, key string, c *fetchCall) ([]Record, *objBuf, error) {
	c.recs, c.buf, c.err = e.getData(ctx, key)
	e.fetchMu.Lock()
	delete(e.fetching, key)
	joined := c.waiters
	e.fetchMu.Unlock()
	// A hold for every caller that joined: none can join any more, and
	// this caller's own hold keeps the buffer meanwhile.
	for range joined {
		c.buf.hold()
	}
	close(c.done)
	return c.recs, c.buf, c.err
}

// joinFetch waits for c, a fetch of key the caller joined, and takes the
// hold c keeps for it.
func (e *Engine) joinFetch(ctx context.Context, key string, c *fetchCall) ([]Record, *objBuf, error) {
	select {
	case <-c.done:
		return c.recs, c.buf, c.err
	case <-ctx.Done():
	}
	e.fetchMu.Lock()
	if e.fetching[key] == c {
		c.waiters--
		e.fetchMu.Unlock()
		return nil, nil, ctx.Err()
	}
	e.fetchMu.Unlock()
	// The fetch has counted this caller and is about to hand its hold
	// over.
	<-c.done
	c.buf.release()
	return nil, nil, ctx.Err()
}

// getData reads and decodes data object key, into a recycled buffer when
// the store can, and caches it.
func (e *Engine) getData(ctx context.Context, key string) ([]Record, *objBuf, error) {
	bg, ok := e.store.(segment.BufferGetter)
	if !ok {
		recs, held, err := e.readData(ctx, key)
		if err != nil {
			return nil, nil, err
		}
		e.cache.putCold(key, recs, held, nil)
		return recs, nil, nil
	}
	data, err := bg.GetBuffer(ctx, key, e.bufs.alloc)
	if err != nil {
		return nil, nil, storeReadError(key, err)
	}
	buf := newObjBuf(data, &e.bufs)
	recs, err := segment.DecodeData(data)
	if err != nil {
		buf.release()
		return nil, nil, fmt.Errorf("read %s: %w", key, err)
	}
	e.cache.putCold(key, recs, cap(data), buf)
	return recs, buf, nil
}

// readData reads and decodes the data object (or blob) key, and returns
// the size of the buffer the records' bodies alias. A missing object is
// ErrNotFound, any other store failure ErrUnavailable.
func (e *Engine) readData(ctx context.Context, key string) ([]Record, int, error) {
	data, _, err := e.store.Get(ctx, key, 0, -1)
	if err != nil {
		return nil, 0, storeReadError(key, err)
	}
	recs, err := segment.DecodeData(data)
	if err != nil {
		return nil, 0, fmt.Errorf("read %s: %w", key, err)
	}
	return recs, cap(data), nil
}

// storeReadError is the error of a failed read of key: ErrNotFound for a
// missing object, ErrUnavailable for any other store failure.
func storeReadError(key string, err error) error {
	if errors.Is(err, segment.ErrNotFound) {
		return fmt.Errorf("read %s: %w", key, err)
	}
	return fmt.Errorf("%w: read %s: %v", ErrUnavailable, key, err)
}

// prefetch makes the objects of next, a reader's window, what s reads
// ahead: those not cached replace what the queue held for an earlier
// window, and workers start up to readAheadFetches. A reader calls it at
// every read, hits included, so the GETs in flight follow it.
func (e *Engine) prefetch(s *stream, next []dataSpan) {
	var todo []dataSpan
	for _, sp := range next {
		if e.cache.has(sp.key) {
			continue
		}
		if !e.cache.couldHoldCold(sp.memSize(), sp.size) {
			// The cache would drop it as it came in (an object of tiny
			// records with a small cache_size): fetched ahead, it would be
			// a GET for nothing, and its reader fetches it anyway.
			continue
		}
		todo = append(todo, sp)
	}
	s.mu.Lock()
	ra := s.readAhead()
	ra.queue = todo
	start := min(readAheadFetches-ra.workers, len(todo))
	if start > 0 && !e.roomAhead(todo[0].size) {
		// Other streams' read-ahead holds the bytes: workers would end at
		// once; the reader's next call looks again.
		start = 0
	}
	ra.workers += start
	s.mu.Unlock()
	for i := range start {
		if !e.ioPool.Go(func() { e.readAheadWorker(s, ra) }) {
			// The engine has closed: nothing may call the store on its
			// behalf any more. The reader fetches what it reads itself.
			s.mu.Lock()
			ra.workers -= start - i
			ra.queue = nil
			s.mu.Unlock()
			return
		}
	}
}

// roomAhead reports whether a read-ahead GET of size bytes may start now.
func (e *Engine) roomAhead(size int64) bool {
	e.fetchMu.Lock()
	defer e.fetchMu.Unlock()
	return e.roomAheadLocked(size)
}

func (e *Engine) roomAheadLocked(size int64) bool {
	return e.aheadBytes == 0 || e.aheadBytes+size <= e.aheadLimit
}

// readAheadWorker fetches objects from s's read-ahead queue, in order, until the
// queue is empty or the bytes in flight across streams would pass
// readAheadInFlight (the reader's next call starts it again). After an
// error the queue is dropped: the reader will ask again and see it. Every
// GET is bounded and Close cuts it short, so the worker always ends.
func (e *Engine) readAheadWorker(s *stream, ra *readAheadState) {
	for {
		s.mu.Lock()
		if len(ra.queue) == 0 {
			ra.workers--
			s.mu.Unlock()
			return
		}
		sp := ra.queue[0]
		if !e.takeAhead(sp) {
			ra.workers--
			s.mu.Unlock()
			return
		}
		ra.queue = ra.queue[1:]
		c := e.claimAhead(ra, sp)
		s.mu.Unlock()
		var err error
		if c != nil {
			err = e.fetchDetached(sp.key, c, readAheadTimeout)
		}
		e.fetchMu.Lock()
		e.aheadBytes -= sp.size
		e.fetchMu.Unlock()
		if err != nil {
			s.mu.Lock()
			ra.queue = nil
			s.mu.Unlock()
		}
	}
}

// takeAhead reserves sp's bytes for a read-ahead GET, unless the GETs in
// flight would then hold more than the limit (one always may go).
func (e *Engine) takeAhead(sp dataSpan) bool {
	e.fetchMu.Lock()
	defer e.fetchMu.Unlock()
	if !e.roomAheadLocked(sp.size) {
		return false
	}
	e.aheadBytes += sp.size
	return true
}

// claimAhead enters the fetch of sp for a read-ahead worker, unless a GET
// of it is in flight (a reader that wants it waits for that one, and the
// worker moves on rather than wait too), it is cached, or every reader of
// the stream has moved past it: a worker that took sp from the queue before
// the reader read it (with its own GET) and dropped it from the cache would
// fetch it again for nobody. Called with the stream's mutex held, which
// orders it with the readers' moves.
func (e *Engine) claimAhead(ra *readAheadState, sp dataSpan) *fetchCall {
	if ra.passed(sp) {
		return nil
	}
	e.fetchMu.Lock()
	defer e.fetchMu.Unlock()
	if _, ok := e.fetching[sp.key]; ok || e.cache.has(sp.key) {
		return nil
	}
	return e.newFetchLocked(sp.key)
}

// passed reports whether every reader of the stream is past sp.
func (r *readAheadState) passed(sp dataSpan) bool {
	readers := false
	for _, c := range r.cursors {
		if c.window == 0 {
			continue
		}
		if c.at.first <= sp.first {
			return false
		}
		readers = true
	}
	return readers
}

// readAheadTimeout bounds a read-ahead's GET, which no reader asked for
// yet: a reader's own GET is bounded by the store's attempts alone, as a
// large object on a slow link may need longer.
const readAheadTimeout = 30 * time.Second

// fetchDetached runs c, a fetch of key into the cache that no caller owns
// (a read-ahead's, or one a reader's miss started), within limit (0: the
// store's own timeouts only). It is ended by Close, but not cut short when
// the read-ahead queue is dropped or the reader that started it leaves:
// others may be waiting on it and must get its outcome.
func (e *Engine) fetchDetached(key string, c *fetchCall, limit time.Duration) error {
	ctx, cancel := e.bgCtx, context.CancelFunc(func() {})
	if limit > 0 {
		ctx, cancel = context.WithTimeout(ctx, limit)
	}
	defer cancel()
	_, buf, err := e.runFetch(ctx, key, c)
	buf.release()
	return err
}
