package streamstore

import (
	"context"
	"fmt"
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
	if err != nil {
		if e.bgCtx.Err() == nil {
			e.log.Warn("sweeping orphaned blobs failed; will retry", zap.Int("deleted", n), zap.Error(err))
		}
		return
	}
	e.stats.orphanBlobs.Add(int64(n))
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
func (e *Engine) sweepOrphanBlobs(ctx context.Context, from, to uint64) (deleted int, bytes int64, _ error) {
	// Listed in key order, a stream's blobs come together: each stream's
	// candidates are checked against its markers before the next's.
	var id string
	var names []string
	check := func() error {
		if len(names) == 0 {
			return nil
		}
		marked, err := e.markedBlobs(ctx, id)
		if err != nil {
			return err
		}
		var dead []string
		for _, name := range names {
			if !marked[name] {
				dead = append(dead, blobKey(id, name))
				bytes += blobSize(name)
			}
		}
		names = names[:0]
		for len(dead) > 0 {
			batch := dead[:min(len(dead), 1000)]
			if err := e.store.Delete(ctx, batch); err != nil {
				return fmt.Errorf("delete orphaned blobs of %s: %w", id, err)
			}
			deleted += len(batch)
			dead = dead[len(batch):]
		}
		return nil
	}
	after := ""
	for {
		objs, more, err := e.store.List(ctx, "blob/", after, 1000)
		if err != nil {
			return deleted, bytes, fmt.Errorf("list blobs: %w", err)
		}
		for _, o := range objs {
			after = o.Key
			oid, name, ok := parseBlobKey(o.Key)
			if !ok {
				continue // not a blob this build wrote: leave it
			}
			if oid != id {
				if err := check(); err != nil {
					return deleted, bytes, err
				}
				id = oid
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
	return deleted, bytes, check()
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
