package streamstore

import (
	"context"
	"errors"
	"fmt"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/segment"
)

// A stream that is written a little at a time, with pauses longer than
// the idle time between, is folded at every pause, and each fold used to
// write its few records as a data object of their own: one append a
// minute made half a million objects a year, and a reader catching up
// from the start paid a GET for each. So a fold that continues a small
// last data object writes that object's records again with its own, as
// one object, and the old one is deleted once the checkpoint naming the
// new tail has landed. It costs a GET of at most MergeBelow bytes per such
// fold, and keys in the compaction's batched delete (the old tail's, and
// the one before it again, see metaObject.Merged); objects of a slow
// stream grow to MergeBelow before a new one starts. Busy streams fold
// larger objects and pay it only for the remainder of a fold past
// maxDataObject, when that is small.

// DefaultMergeBelow is Config.MergeBelow's default. Each fold that merges
// rewrites up to this many bytes, so it bounds the write amplification of
// a slow stream; a cold reader reads objects at least this big (its
// read-ahead keeps sixteen in flight). Exported so that the module spells
// out the same default.
const DefaultMergeBelow = 64 << 10

// MaxMergeBelow bounds Config.MergeBelow: a data object is at most this
// big anyway.
const MaxMergeBelow = maxDataObject

// dataTail names a stream's last data object, records [First, End).
type dataTail struct {
	First uint64 `json:"first"`
	End   uint64 `json:"end"`
}

// mergeTail returns the records of meta's tail object and its key when the
// fold of runs should write them again with its own: its first records
// continue the tail, and no trim of the fold reaches into it. nil when
// there is nothing to merge, or the tail is missing or damaged (the fold's
// records then get an object of their own, as before merging).
//
// A read that failed otherwise fails the fold, to be tried at the next
// compaction, tailReadTries-1 folds of s in a row: an object of the
// fold's own, should its checkpoint fail too, would be overlapped by the
// merged object of the next fold, neither starting nor ending with it
// (reads find their records all the same, and only the next fold of the
// same process deletes the object, see leftovers.go).
// After that the records get an object of their own: a tail the store
// keeps refusing (archived by a lifecycle rule, denied by a key policy)
// must not hold up the compaction of every stream for good. Called with
// s.metaMu held, which guards s.tailReadFails.
func (e *Engine) mergeTail(ctx context.Context, s *stream, meta *metaObject, runs []walRun) ([]Record, string, error) {
	t := meta.Tail
	if t == nil || t.End <= t.First || e.config().MergeBelow < 0 {
		return nil, "", nil
	}
	start := meta.State.StartSeq
	first := -1
	for i := range runs {
		r := &runs[i]
		if first < 0 && r.ch.End > r.ch.First {
			first = i
		}
		if r.snap != nil {
			start = max(start, r.snap.StartSeq)
		}
		start = max(start, r.ch.TrimTo)
	}
	if first < 0 || runs[first].blob != "" || runs[first].ch.First != t.End || start > t.First {
		return nil, "", nil
	}
	key := dataKey(meta.ID, t.First, t.End)
	recs, _, err := e.readData(ctx, key)
	if err == nil && (uint64(len(recs)) != t.End-t.First || recs[0].Seq != t.First) {
		err = fmt.Errorf("%w: %s does not hold the records its name says", segment.ErrCorrupt, key)
	}
	if err == nil {
		s.tailReadFails = 0
		return recs, key, nil
	}
	if !errors.Is(err, segment.ErrNotFound) && !isDamage(err) {
		if s.tailReadFails++; s.tailReadFails < tailReadTries {
			return nil, "", fmt.Errorf("read %s back to merge it: %w", key, err)
		}
	}
	s.tailReadFails = 0
	e.log.Warn("a stream's last data object could not be read back to merge it; the stream's new records go into an object of their own",
		zap.String("stream", s.name), zap.String("key", key), zap.Error(err))
	return nil, "", nil
}

// tailReadTries is the failed reads of a stream's tail in a row at which its
// fold gives up merging; the ones before it fail their folds (see
// mergeTail).
const tailReadTries = 3

// noteMerged queues key, a data object whose records a landed checkpoint
// names in a larger one, for the compaction's delete. Its cached copy goes
// now: a reader that still lists it finds it gone and lists again.
func (e *Engine) noteMerged(key string) {
	e.cache.remove([]string{key})
	e.mergedMu.Lock()
	e.merged = append(e.merged, key)
	e.mergedMu.Unlock()
}

// takeMerged returns the data objects queued by noteMerged, emptying the
// queue.
func (e *Engine) takeMerged() []string {
	e.mergedMu.Lock()
	defer e.mergedMu.Unlock()
	keys := e.merged
	e.merged = nil
	return keys
}

// mergedPending reports whether merged data objects wait for their delete.
func (e *Engine) mergedPending() bool {
	e.mergedMu.Lock()
	defer e.mergedMu.Unlock()
	return len(e.merged) > 0
}
