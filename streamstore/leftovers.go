package streamstore

import (
	"context"
	"slices"

	"go.uber.org/zap"
)

// A fold writes its data objects before the checkpoint that makes them the
// stream's, so a fold that fails on the way (its checkpoint refused, a
// later PUT failing) leaves objects nothing names. Reads pass over them,
// but they used to stay in the bucket until a trim or delete reached them:
// a stream whose checkpoint failed a few times kept a few copies of its
// records for good. The next fold of the stream writes those records again
// (its runs are the failed fold's and more), or a trim took them, so once
// its checkpoint has landed (not before: the failed checkpoint may have
// landed unseen, naming them), what the failed folds wrote under keys it
// did not write or rewrite is dead, and it deletes it. Only a fold's own
// data objects and markers are leftovers, never a trim's rewrite: a
// rewrite of an object the checkpoint names is, after a failed fold, all
// that holds that object's records from the trim on. Every write under
// data/<id>/ is made by a fold, under the stream's metaMu, so no other
// write can take one of those keys between that checkpoint and the delete.
// The list lives in memory only: a process that ends before the next fold
// leaves its leftovers behind, as before.

// maxLeftovers bounds stream.leftovers: a stream whose checkpoints keep
// failing does not grow a list without end. Objects past it stay.
const maxLeftovers = 256

// noteLeftovers adds keys, put (or tried) by a fold that then failed, to
// s.leftovers. Called with s.metaMu held.
func (s *stream) noteLeftovers(keys []string) {
	for _, key := range keys {
		if len(s.leftovers) >= maxLeftovers {
			return
		}
		if !slices.Contains(s.leftovers, key) {
			s.leftovers = append(s.leftovers, key)
		}
	}
}

// dropLeftovers deletes those of s.leftovers that the fold whose
// checkpoint just landed made dead, and empties the list; wrote is the
// keys that fold put or rewrote, next its checkpoint's NextSeq. A leftover
// is dead when that fold did not write it again (it would be the fold's
// own object then), and holds no record past next (a fold can stop short
// of the failed one, when the cache lost WAL entries, say, and the
// records past it must stay where the failed checkpoint, landed unseen,
// may have put them for a process that took the storage over). A plain
// leftover is kept, too, when an object the fold wrote ends where it does
// and starts before it: a trim into that object would rewrite it under the
// leftover's key, and a DELETE of that key still on its way would then
// delete the rewrite. What is kept stays in the bucket, as before; so do
// the leftovers when the lease cannot be confirmed or the delete fails (it
// is not tried again). Called with s.metaMu held.
func (e *Engine) dropLeftovers(ctx context.Context, s *stream, wrote []string, next uint64) {
	dead := slices.DeleteFunc(s.leftovers, func(key string) bool {
		return slices.Contains(wrote, key) || !deadLeftover(key, wrote, next)
	})
	s.leftovers = nil
	if len(dead) == 0 {
		return
	}
	// Not on a node that lost the storage: what it folded is not what the
	// new owner goes on from.
	if err := e.lease.Load().Confirm(ctx); err != nil {
		e.log.Warn("the data objects of a stream's failed folds stay in the bucket: the lease could not be confirmed",
			zap.String("stream", s.name), zap.Strings("keys", dead), zap.Error(err))
		return
	}
	// A reader that listed one of them finds it gone and lists again; the
	// stream's own index forgets them now.
	e.cache.remove(dead)
	s.mu.Lock()
	s.dataIdx = nil
	s.mu.Unlock()
	if err := e.store.Delete(ctx, dead); err != nil {
		e.log.Warn("deleting the data objects of a stream's failed folds failed; they stay in the bucket",
			zap.String("stream", s.name), zap.Strings("keys", dead), zap.Error(err))
		return
	}
	e.log.Debug("deleted the data objects of a stream's failed folds", zap.String("stream", s.name), zap.Strings("keys", dead))
}

// deadLeftover reports whether leftover key, not among wrote, may go: it
// ends at or before next, and, a plain object, shares its end with no
// object of wrote that starts before it (see dropLeftovers).
func deadLeftover(key string, wrote []string, next uint64) bool {
	first, end, blob, ok := parseDataKey(key)
	if !ok || end > next {
		return false
	}
	if blob != "" {
		return true // no rewrite makes a marker
	}
	return !slices.ContainsFunc(wrote, func(w string) bool {
		f, e, _, ok := parseDataKey(w)
		return ok && e == end && f < first
	})
}
