package streamstore

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/segment"
)

// An expired stream is deleted when it is next accessed. One that nobody
// accesses again is found by the expiry sweep, which reads the expiry
// markers (keys.go) rather than every stream's metadata: a create with a
// TTL or deadline writes a marker at the second its expiry then falls in,
// and a sweep lists the markers of seconds gone by. For each it loads the
// stream: an expired one is deleted as an access would delete it; one that
// reads renewed gets a marker at its new expiry. Then the due marker goes.
// So renewals write nothing to the index, a stream costs at most one marker
// per TTL it outlives, an idle bucket one LIST per sweep, and nothing is
// kept in memory per stream.

// sweepWorkers is how many due markers a sweep handles at once: deleting a
// stream takes a few requests, and a backlog of expired streams must not
// crowd out the appends' own.
const sweepWorkers = 8

func (e *Engine) expiryLoop() {
	for {
		t := time.NewTimer(e.config().ExpirySweep)
		select {
		case <-e.closing:
			t.Stop()
			return
		case <-e.expiryReset:
			t.Stop()
			continue // wait the new interval from now
		case <-t.C:
		}
		n, err := e.SweepExpired(e.bgCtx, time.Now())
		if err != nil && e.bgCtx.Err() == nil {
			e.log.Warn("expiry sweep failed; will retry", zap.Int("deleted", n), zap.Error(err))
		} else if n > 0 {
			e.log.Info("expired streams deleted", zap.Int("streams", n))
		}
	}
}

// SweepExpired handles the expiry markers due at now: the streams they name
// are deleted if they have expired, or marked again at their new expiry if
// reads renewed them. It returns how many streams it deleted.
func (e *Engine) SweepExpired(ctx context.Context, now time.Time) (int, error) {
	if _, err := e.writer(); err != nil {
		return 0, err
	}
	// Markers of the seconds before this one are due.
	due := now.UnixMilli() / expirySecond
	var (
		deleted  atomic.Int64
		wg       sync.WaitGroup
		errMu    sync.Mutex
		failed   int
		firstErr error
	)
	work := make(chan string)
	for range sweepWorkers {
		wg.Go(func() {
			for key := range work {
				gone, err := e.sweepMarker(ctx, key, now)
				if gone {
					deleted.Add(1)
				}
				if err != nil {
					errMu.Lock()
					if failed++; firstErr == nil {
						firstErr = err
					}
					errMu.Unlock()
				}
			}
		})
	}
	listErr := e.listDueMarkers(ctx, due, work)
	close(work)
	wg.Wait()
	// One error stands for them all: a store that is down fails every
	// marker the same way, and the next sweep tries them again.
	if firstErr != nil {
		firstErr = fmt.Errorf("%d due markers failed, the first: %w", failed, firstErr)
	}
	return int(deleted.Load()), errors.Join(listErr, firstErr)
}

// listDueMarkers sends the keys of the markers of seconds before due to
// work, in order.
func (e *Engine) listDueMarkers(ctx context.Context, due int64, work chan<- string) error {
	after := ""
	for {
		objs, more, err := e.store.List(ctx, expiryPrefix, after, 1000)
		if err != nil {
			return fmt.Errorf("list expiry markers: %w", err)
		}
		for _, o := range objs {
			after = o.Key
			second, _, err := parseExpiryKey(o.Key)
			if err != nil {
				e.log.Debug("not an expiry marker; left alone", zap.String("key", o.Key))
				continue
			}
			if second >= due {
				return nil
			}
			select {
			case work <- o.Key:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		if !more || len(objs) == 0 {
			return nil
		}
	}
}

// sweepMarker handles one due marker and reports whether it deleted the
// stream the marker names.
func (e *Engine) sweepMarker(ctx context.Context, key string, now time.Time) (bool, error) {
	second, name, err := parseExpiryKey(key)
	if err != nil {
		return false, err
	}
	// A node that may have lost the storage to another must not delete.
	if err := e.checkLease(); err != nil {
		return false, err
	}
	unlock := e.lockName(name)
	defer unlock()
	deleted := false
	s, err := e.stream(ctx, name)
	switch {
	case errors.Is(err, ErrNotFound):
		// Deleted since, or a create that failed after writing the marker.
	case err != nil:
		return false, fmt.Errorf("expiry sweep: %w", err)
	default:
		s.mu.Lock()
		live := !s.gone && !s.meta.Deleted
		at, id := s.expiresAtLocked(), s.meta.ID
		s.mu.Unlock()
		switch {
		case !live || at == 0:
			// Gone, soft-deleted (its last fork removes it), or a new
			// stream under the name that never expires. Soft-deleted, its
			// count is settled as a touch would, should no release come,
			// and while forks still read it, it is marked again for later
			// (forks.go), before this marker goes.
			// A failure to settle (logged there) is marked again for
			// later, on the schedule, as forks still reading it are.
			if removed, _ := e.settleForks(ctx, s); removed {
				break
			}
			s.mu.Lock()
			kept, deletedAt, sid := !s.gone && s.meta.Deleted, s.meta.DeletedAt, s.meta.ID
			s.mu.Unlock()
			if kept {
				e.thinDeleted(s)
				next := nextSettle(deletedAt, now.UnixMilli(), e.config().GraveTime)
				if err := e.armSettle(ctx, name, sid, time.UnixMilli(next)); err != nil {
					return false, fmt.Errorf("expiry sweep: %w", err)
				}
			}
		case now.UnixMilli() >= at:
			err := e.deleteStream(ctx, s)
			if err != nil && !errors.Is(err, ErrNotFound) && !errors.Is(err, ErrGone) {
				return false, fmt.Errorf("delete expired stream %s: %w", name, err)
			}
			deleted = err == nil
			if deleted {
				e.stats.expired.Add(1)
			}
		case at/expirySecond != second:
			if _, err := e.store.Put(ctx, expiryKey(at, name, id), nil, segment.PutOptions{}); err != nil {
				return false, fmt.Errorf("move expiry marker of %s: %w", name, err)
			}
		}
	}
	if err := e.store.Delete(ctx, []string{key}); err != nil {
		return deleted, fmt.Errorf("delete expiry marker %s: %w", key, err)
	}
	return deleted, nil
}
