package streamstore

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/segment"
)

// A large append's blob is written before its WAL entry (appendBlob). A
// process that dies between the two leaves a blob no entry names, and so
// does a writer that is fenced, or closed while the store is down, with a
// batch whose fate it never learned. Nothing will ever read such a blob;
// it would cost storage for the life of its stream.
//
// A blob's name carries the namespace of the writer it was written for, so
// a process tells the blobs of earlier processes from those of its own
// appends in flight. Once it has retired every namespace before its own,
// each committed blob entry of an earlier process has been folded, and a
// folded blob entry is always a marker under data/<id>/ (blob runs are
// never packed). An earlier blob that no marker names is an orphan, and
// the sweep deletes it. It runs once per start, in the background after
// that compaction, and the manifest records how far it got
// (BlobsSweptTo): a start only looks at the blobs of the namespaces since
// the last sweep, and pays one listing of blob/ for it.

// orphanSweep is where a start's sweep of orphaned blobs is.
type orphanSweep struct {
	mu      sync.Mutex
	startNS uint64 // this process's first namespace: its blobs are never orphans yet
	state   sweepState
	from    uint64 // the manifest's BlobsSweptTo when the sweep became due
}

type sweepState int

const (
	sweepWaiting sweepState = iota // earlier namespaces are not all retired
	sweepDue                       // they are: the gc loop runs the sweep
	sweepDone                      // swept, or nothing to sweep
)

// noteRetired is told of the manifest after a compaction moved it on: when
// no namespace before this process's is left, the sweep becomes due.
func (e *Engine) noteRetired(m segment.Manifest) {
	o := &e.orphans
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.state != sweepWaiting {
		return
	}
	for _, n := range m.Namespaces {
		if n.ID < o.startNS {
			return
		}
	}
	if m.BlobsSweptTo >= o.startNS {
		o.state = sweepDone
		return
	}
	o.state, o.from = sweepDue, m.BlobsSweptTo
	e.kickGC()
}

// sweepOrphansIfDue runs the start's sweep when it is due. A failed sweep
// is tried again at the gc loop's next turn.
func (e *Engine) sweepOrphansIfDue() {
	o := &e.orphans
	o.mu.Lock()
	due, from, to := o.state == sweepDue, o.from, o.startNS
	o.mu.Unlock()
	if !due || e.checkLease() != nil {
		return
	}
	// Long: a bucket with millions of blobs takes a listing page per
	// thousand of them.
	ctx, cancel := context.WithTimeout(e.bgCtx, time.Hour)
	defer cancel()
	began := time.Now()
	n, bytes, err := e.sweepOrphanBlobs(ctx, from, to)
	if err == nil {
		_, err = e.man.Update(ctx, func(m *segment.Manifest) error {
			m.BlobsSweptTo = max(m.BlobsSweptTo, to)
			return nil
		})
	}
	e.stats.orphanBlobs.Add(int64(n))
	if err != nil {
		if e.bgCtx.Err() == nil {
			e.log.Warn("sweeping orphaned blobs failed; will retry", zap.Int("deleted", n), zap.Error(err))
		}
		return
	}
	o.mu.Lock()
	o.state = sweepDone
	o.mu.Unlock()
	lvl := zap.DebugLevel
	if n > 0 {
		lvl = zap.InfoLevel
	}
	e.log.Log(lvl, "swept orphaned blobs", zap.Int("deleted", n), zap.Int64("bytes", bytes),
		zap.Uint64("from_namespace", from), zap.Uint64("to_namespace", to), zap.Duration("took", time.Since(began)))
}

// sweepOrphanBlobs deletes the blobs of namespaces [from, to) that no
// marker names (with from zero, blobs without a namespace too). Every
// namespace before to must be retired. It returns how many it deleted and
// their bytes.
func (e *Engine) sweepOrphanBlobs(ctx context.Context, from, to uint64) (int, int64, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		mu      sync.Mutex
		deleted int
		bytes   int64
		failed  error
		wg      sync.WaitGroup
	)
	// The first sweep of a bucket written before blobs carried their
	// namespace checks every stream with blobs, a listing each: a few
	// at a time.
	sem := make(chan struct{}, sweepWorkers)
	check := func(id string, names []string) {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			n, b, err := e.dropOrphans(ctx, id, names)
			mu.Lock()
			defer mu.Unlock()
			deleted, bytes = deleted+n, bytes+b
			if err != nil && failed == nil {
				failed = err
				cancel()
			}
		}()
	}
	// Listed in key order, a stream's blobs come together.
	var id string
	var names []string
	after := ""
	var err error
	for err == nil {
		var objs []segment.ObjectInfo
		var more bool
		if objs, more, err = e.store.List(ctx, "blob/", after, 1000); err != nil {
			err = fmt.Errorf("list blobs: %w", err)
			break
		}
		for _, o := range objs {
			after = o.Key
			oid, name, ok := parseBlobKey(o.Key)
			if !ok {
				continue // not a blob this build wrote: leave it
			}
			if oid != id {
				if len(names) > 0 {
					check(id, names)
				}
				id, names = oid, nil
			}
			ns, named := blobNamespace(name)
			if (named && ns >= from && ns < to) || (!named && from == 0) {
				names = append(names, name)
			}
		}
		if !more || len(objs) == 0 {
			break
		}
	}
	if err == nil && len(names) > 0 {
		check(id, names)
	}
	wg.Wait()
	if failed != nil {
		err = failed
	}
	return deleted, bytes, err
}

// dropOrphans deletes the blobs of stream id among names that none of its
// markers names.
func (e *Engine) dropOrphans(ctx context.Context, id string, names []string) (deleted int, bytes int64, _ error) {
	marked, err := e.markedBlobs(ctx, id)
	if err != nil {
		return 0, 0, err
	}
	names = slices.DeleteFunc(names, func(name string) bool { return marked[name] })
	for len(names) > 0 {
		batch := names[:min(len(names), 1000)]
		keys := make([]string, len(batch))
		for i, name := range batch {
			keys[i] = blobKey(id, name)
		}
		if err := e.store.Delete(ctx, keys); err != nil {
			return deleted, bytes, fmt.Errorf("delete orphaned blobs of %s: %w", id, err)
		}
		for _, name := range batch {
			bytes += blobSize(name)
		}
		deleted += len(batch)
		names = names[len(batch):]
	}
	return deleted, bytes, nil
}

// markedBlobs is the set of blob names the markers of stream id name.
func (e *Engine) markedBlobs(ctx context.Context, id string) (map[string]bool, error) {
	marked := map[string]bool{}
	after := ""
	for {
		objs, more, err := e.store.List(ctx, dataPrefix(id), after, 1000)
		if err != nil {
			return nil, fmt.Errorf("list data of %s: %w", id, err)
		}
		for _, o := range objs {
			after = o.Key
			if _, _, blob, ok := parseDataKey(o.Key); ok && blob != "" {
				marked[blob] = true
			}
		}
		if !more || len(objs) == 0 {
			return marked, nil
		}
	}
}

// strayBlobs are blobs that no entry names or ever will (their append
// failed, or their batch was lost) and whose delete failed. Compaction
// deletes them at its next pass: left to the orphan sweep, they would
// stay until the next start, and a process may run for months. Their
// names are unique, so deleting one late is always safe.
type strayBlobs struct {
	mu   sync.Mutex
	keys []string
}

// maxStrayBlobs bounds the keys kept for another try; past it, blobs are
// left to the next start's orphan sweep.
const maxStrayBlobs = 10000

// add keeps keys for another try and returns how many it kept.
func (b *strayBlobs) add(keys []string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := min(len(keys), maxStrayBlobs-len(b.keys))
	b.keys = append(b.keys, keys[:n]...)
	return n
}

// take returns the keys kept and forgets them.
func (b *strayBlobs) take() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	keys := b.keys
	b.keys = nil
	return keys
}

// deleteStrayBlobs tries the kept stray blobs again; those still not
// deleted are kept for the next pass.
func (e *Engine) deleteStrayBlobs(ctx context.Context) {
	keys := e.strays.take()
	if len(keys) == 0 {
		return
	}
	if err := e.store.Delete(ctx, keys); err != nil {
		e.strays.add(keys)
		e.log.Warn("could not delete unused blobs; will retry", zap.Int("blobs", len(keys)), zap.Error(err))
		return
	}
	e.log.Info("deleted unused blobs whose first delete had failed", zap.Int("blobs", len(keys)))
}
