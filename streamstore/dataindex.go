package streamstore

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
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

// dataIndex is what a stream knows of its data objects: every object from
// from on, in seq order (there may be more after the last).
type dataIndex struct {
	id    string
	spans []dataSpan
}

// find returns the index of the span holding seq, or -1.
func (x *dataIndex) find(seq uint64) int {
	i := sort.Search(len(x.spans), func(i int) bool { return x.spans[i].end > seq })
	if i < len(x.spans) && x.spans[i].first <= seq {
		return i
	}
	return -1
}

// A cold read fetches ahead of itself the next data objects up to
// readAheadBytes (at least one, at most readAheadObjects), readAheadFetches
// GETs at a time: one GET at a time leaves the reader waiting on each
// object's round trip, and small objects (compaction of a slow stream)
// would keep little in flight if counted by objects.
const (
	readAheadBytes   = 16 << 20
	readAheadObjects = 16
	readAheadFetches = 2
)

// ahead returns the spans after spans[i] that a reader at spans[i] reads
// ahead.
func ahead(spans []dataSpan, i int) []dataSpan {
	var bytes int64
	j := i + 1
	for j < len(spans) && j-i <= readAheadObjects && (j == i+1 || bytes+spans[j].size <= readAheadBytes) {
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
			next := ahead(x.spans, i)
			sp := x.spans[i]
			s.mu.Unlock()
			return sp, next, nil
		}
	}
	s.mu.Unlock()

	objs, _, err := e.store.List(ctx, dataPrefix(id), dataKeyAfter(id, seq), dataListPage)
	if err != nil {
		return dataSpan{}, nil, fmt.Errorf("%w: find data of %s at %d: %v", ErrUnavailable, id, seq, err)
	}
	spans := make([]dataSpan, 0, len(objs))
	for _, o := range objs {
		first, end, blob, ok := parseDataKey(o.Key)
		if !ok {
			return dataSpan{}, nil, fmt.Errorf("%w: data key %s", segment.ErrCorrupt, o.Key)
		}
		sp := dataSpan{first: first, end: end, key: o.Key, size: o.Size}
		if blob != "" {
			sp.key, sp.size = blobKey(id, blob), blobSize(blob)
		}
		spans = append(spans, sp)
	}
	if len(spans) == 0 || spans[0].first > seq {
		return dataSpan{}, nil, fmt.Errorf("%w: no data object holds seq %d of %s", segment.ErrCorrupt, seq, id)
	}
	s.mu.Lock()
	s.dataIdx = &dataIndex{id: id, spans: spans}
	s.mu.Unlock()
	return spans[0], ahead(spans, 0), nil
}

// fetchCall is one data object GET in flight; a reader that wants the
// same object (a read-ahead and the reader it runs ahead of) waits for it
// rather than reading the object twice.
type fetchCall struct {
	done chan struct{}
	recs []Record
	err  error
}

// fetchData reads and decodes one data object into the cache, joining a
// fetch of the same object already in flight.
func (e *Engine) fetchData(ctx context.Context, key string) ([]Record, error) {
	e.fetchMu.Lock()
	if c, ok := e.fetching[key]; ok {
		e.fetchMu.Unlock()
		select {
		case <-c.done:
			return c.recs, c.err
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	c := &fetchCall{done: make(chan struct{})}
	if e.fetching == nil {
		e.fetching = map[string]*fetchCall{}
	}
	e.fetching[key] = c
	e.fetchMu.Unlock()
	c.recs, c.err = e.getData(ctx, key)
	e.fetchMu.Lock()
	delete(e.fetching, key)
	e.fetchMu.Unlock()
	close(c.done)
	return c.recs, c.err
}

func (e *Engine) getData(ctx context.Context, key string) ([]Record, error) {
	recs, err := e.readData(ctx, key)
	if err != nil {
		return nil, err
	}
	e.cache.putCold(key, recs)
	return recs, nil
}

// readData reads and decodes the data object (or blob) key. A missing
// object is ErrNotFound, any other store failure ErrUnavailable.
func (e *Engine) readData(ctx context.Context, key string) ([]Record, error) {
	data, _, err := e.store.Get(ctx, key, 0, -1)
	if errors.Is(err, segment.ErrNotFound) {
		return nil, fmt.Errorf("read %s: %w", key, err)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: read %s: %v", ErrUnavailable, key, err)
	}
	recs, err := segment.DecodeData(data)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", key, err)
	}
	return recs, nil
}

// prefetch fetches the data objects in next that are not cached, one after
// the other, unless s already has a read-ahead running. It gives up at the
// first error: the reader will ask again and see it.
func (e *Engine) prefetch(s *stream, next []dataSpan) {
	var todo []string
	for _, sp := range next {
		if !e.cache.has(sp.key) {
			todo = append(todo, sp.key)
		}
	}
	if len(todo) == 0 {
		return
	}
	s.mu.Lock()
	if s.prefetching {
		s.mu.Unlock()
		return
	}
	s.prefetching = true
	s.mu.Unlock()
	go func() {
		defer func() {
			s.mu.Lock()
			s.prefetching = false
			s.mu.Unlock()
		}()
		// Bounded, and cut short by Close: the goroutine always ends.
		ctx, cancel := context.WithTimeout(e.bgCtx, 30*time.Second)
		defer cancel()
		// Workers take the keys in order; after an error the rest are
		// skipped (the reader will ask again and see it).
		keys := make(chan string, len(todo))
		for _, key := range todo {
			keys <- key
		}
		close(keys)
		// Not by cancelling ctx: a reader may be waiting on a fetch in
		// flight (fetchData joins it) and must get that fetch's outcome.
		var failed atomic.Bool
		var wg sync.WaitGroup
		for range min(readAheadFetches, len(todo)) {
			wg.Go(func() {
				for key := range keys {
					if failed.Load() {
						return
					}
					if _, err := e.fetchData(ctx, key); err != nil {
						failed.Store(true)
					}
				}
			})
		}
		wg.Wait()
	}()
}
