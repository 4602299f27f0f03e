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

// dropLeftovers deletes s.leftovers but those in wrote, the keys the fold
// whose checkpoint just landed put, and empties the list. A delete that
// fails is not tried again: the objects stay, which costs storage only.
// Called with s.metaMu held.
func (e *Engine) dropLeftovers(ctx context.Context, s *stream, wrote []string) {
	dead := slices.DeleteFunc(s.leftovers, func(key string) bool { return slices.Contains(wrote, key) })
	s.leftovers = nil
	if len(dead) == 0 {
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
