package streamstore

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/segment"
)

// A committed WAL entry that fails its checksum or framing when read back
// (bit rot or a truncated file on a local disk, a storage fault on S3) is
// damage confined to its stream: the stream is compacted up to the WAL
// object that holds it and no further, and so the WAL is retired up to
// that object and no further; every other stream compacts as usual, and
// reads of the stream's records below the damage still work. Reads of the
// damaged records fail with ErrDamaged until an operator restores the
// object. Compaction used to fail as a whole on such an entry, every time,
// so no stream was compacted and no WAL retired again.
//
// An object restored in place (from a versioned bucket or a backup) is
// found by a compaction that reads the damaged entry again, at most once a
// compaction interval per stream: one small ranged GET, never a storm.
// Once it reads back clean the stream is compacted as any other, and the
// WAL retired past the object, without a restart.

// damageLog remembers the damaged WAL entries this process found, so that
// each is logged and counted once, however many compactions and reads
// meet it.
type damageLog struct {
	mu   sync.Mutex
	seen map[string]bool // by run cache key
}

// isDamage tells a checksum or framing failure of what the store returned
// from a failure to read it: only the first is damage; the second is
// retried.
func isDamage(err error) bool { return errors.Is(err, segment.ErrCorrupt) }

// damaged reports that run r of the stream called name failed to decode
// (cause), logging it the first time, and returns the error its readers get.
func (e *Engine) damaged(name string, r walRun, cause error) error {
	if e.damage.first(runCacheKey(r.key, r.span)) {
		e.stats.damagedWAL.Add(1)
		e.log.Error("WAL entry damaged: the stream is not compacted past it and its records there cannot be read; "+
			"restore the object from a copy; do not delete it (a replay stops at a missing WAL object, dropping everything after it)",
			zap.String("stream", name), zap.String("object", r.key),
			zap.Int64("offset", r.span.Off), zap.Int64("length", r.span.Len),
			zap.Uint64("first_seq", r.ch.First), zap.Uint64("end_seq", r.ch.End), zap.Error(cause))
	}
	return fmt.Errorf("%w: records [%d, %d) of %s in WAL object %s: %w", ErrDamaged, r.ch.First, r.ch.End, name, r.key, cause)
}

// damagedObject reports that object key, which stream name's reads need,
// failed to decode or is missing (cause wraps segment.ErrCorrupt), logging
// it the first time, and returns the error its readers get. Unlike a
// damaged WAL entry, nothing else holds back for it: a data object, blob or
// metadata object is read only by the requests that need it, which get a
// 500 naming it (and no log line each) until it is restored.
func (e *Engine) damagedObject(name, key string, cause error) error {
	if e.damage.first("object " + key) {
		e.stats.damagedObjs.Add(1)
		e.log.Error("stored object damaged: reads of the stream that need it fail until it is restored from a copy",
			zap.String("stream", name), zap.String("object", key), zap.Error(cause))
	}
	return fmt.Errorf("%w: object %s of %s: %w", ErrDamaged, key, name, cause)
}

// first records damage found at key (a run cache key, or an object's), and
// says whether it is the first time.
func (l *damageLog) first(key string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.seen[key] {
		return false
	}
	if l.seen == nil {
		l.seen = map[string]bool{}
	}
	l.seen[key] = true
	return true
}

// forget drops the entry of run key from those logged, once it reads back
// clean, so that damage found there again is logged again.
func (l *damageLog) forget(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.seen, key)
}

// retryDamaged reads again the damaged run of each stream of todo that was
// last found damaged a compaction interval or more before now, and lifts
// the stream's mark when it reads back clean (the object was restored), so
// that this compaction takes the stream on as any other. A run still
// damaged, or a read that fails, leaves the mark for the next try an
// interval later: the retries of a stream never come faster than its
// compactions would anyway, and cost one ranged GET of the entry each.
func (e *Engine) retryDamaged(ctx context.Context, todo []*stream, now time.Time) {
	every := e.config().CompactInterval
	for _, s := range todo {
		s.mu.Lock()
		d := s.damagedAt
		due := d != nil && now.Sub(s.damageChecked) >= every
		if due {
			s.damageChecked = now
		}
		s.mu.Unlock()
		if !due {
			continue
		}
		clean := true
		got, err := e.readRuns(ctx, []walRun{*d}, func(walRun, error) { clean = false })
		if err != nil || !clean {
			continue
		}
		key := runCacheKey(d.key, d.span)
		// The compaction about to read it back finds it here. readRuns
		// copied the run's bytes out of its read: they are all it holds.
		e.cache.put(key, got[key], int(d.span.Len))
		s.mu.Lock()
		if s.damagedAt == d {
			s.damagedAt = nil
		}
		s.mu.Unlock()
		e.damage.forget(key)
		e.log.Info("damaged WAL entry reads back clean: the object was restored; its stream is compacted past it again",
			zap.String("stream", s.name), zap.String("object", d.key),
			zap.Uint64("first_seq", d.ch.First), zap.Uint64("end_seq", d.ch.End))
	}
}
