package streamstore

import (
	"errors"
	"fmt"
	"sync"

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
	key := runCacheKey(r.key, r.span)
	e.damage.mu.Lock()
	first := !e.damage.seen[key]
	if first {
		if e.damage.seen == nil {
			e.damage.seen = map[string]bool{}
		}
		e.damage.seen[key] = true
	}
	e.damage.mu.Unlock()
	if first {
		e.stats.damagedWAL.Add(1)
		e.log.Error("WAL entry damaged: the stream is not compacted past it and its records there cannot be read; "+
			"restore the object from a copy; do not delete it (a replay stops at a missing WAL object, dropping everything after it)",
			zap.String("stream", name), zap.String("object", r.key),
			zap.Int64("offset", r.span.Off), zap.Int64("length", r.span.Len),
			zap.Uint64("first_seq", r.ch.First), zap.Uint64("end_seq", r.ch.End), zap.Error(cause))
	}
	return fmt.Errorf("%w: records [%d, %d) of %s in WAL object %s: %w", ErrDamaged, r.ch.First, r.ch.End, name, r.key, cause)
}
