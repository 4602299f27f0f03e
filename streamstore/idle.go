package streamstore

import (
	"maps"
	"time"

	"go.uber.org/zap"
)

// Idle is free: a stream nobody has touched for Config.IdleAfter leaves
// memory (its handle and its cached blocks), and once a sweep has let go of
// a good amount the heap is handed back to the OS. Without this, a node that
// served a burst over many streams would keep up to MaxStreams handles and a
// full cache for as long as it runs, and the Go heap would keep the pages
// until the next forced GC (two minutes) and the scavenger got round to it.

// A stream with records not yet in data objects stays until a compaction
// folds it, which the interval could put up to CompactInterval after it
// went idle; many such streams are worth a compaction at once (row 8 of
// the benchmarks: 100,000 streams created in a burst missed their minute
// or made it depending on where the compaction timer stood).

// idleReturn is how much a sweep must release before it returns memory to
// the OS (below that, the scavenger's own pace is fine); idleReturnStreams
// idle streams waiting for a fold start a compaction.
const (
	idleReturnBytes   = 8 << 20
	idleReturnStreams = 1000
)

func (e *Engine) idleLoop() {
	for {
		every := max(e.config().IdleAfter/3, 100*time.Millisecond)
		t := time.NewTimer(every)
		select {
		case <-e.closing:
			t.Stop()
			return
		case <-t.C:
		}
		e.sweepIdle(time.Now())
	}
}

// sweepIdle drops what has been idle since before now - IdleAfter.
func (e *Engine) sweepIdle(now time.Time) (streams int, bytes int64) {
	idle := e.config().IdleAfter
	cutoff := now.Add(-idle)
	bytes = e.cache.dropIdle(cutoff)
	// Streams idle since before this were idle when the last compaction
	// began, which folded them (or failed, and the interval retries).
	seen := e.compactBegan.Load() - int64(idle)
	unfolded := 0
	e.mu.Lock()
	for name, s := range e.streams {
		used := s.used.Load()
		if used > cutoff.UnixNano() || !s.mu.TryLock() {
			continue
		}
		// Uncompacted WAL runs keep a handle too (until the fold).
		if !s.pinnedLocked(e) {
			switch {
			case len(s.runs) == 0 && e.keepForRenewalLocked(s, now.UnixMilli()):
				// Its renewal goes to the WAL first; it leaves once folded.
			case len(s.runs) == 0:
				s.evicted = true
				delete(e.streams, name)
				streams++
			case used > seen:
				unfolded++
			}
		}
		s.mu.Unlock()
	}
	if streams >= idleReturnStreams {
		// Go maps keep the buckets of their largest size: a burst over
		// many streams would pin its map for good.
		e.streams = maps.Collect(maps.All(e.streams))
	}
	e.mu.Unlock()
	if unfolded >= idleReturnStreams {
		e.kickCompaction()
	}
	// A node nobody has used for IdleAfter hands its heap back once, even
	// when the sweeps freed little each time: what the last requests and
	// the compaction after them left behind would otherwise stay until
	// the scavenger got round to it (row 8 of the benchmarks measured
	// anything from +23 to +71 MiB after the same minute of idleness).
	quiet := now.UnixNano()-e.lastUse.Load() >= int64(e.config().IdleAfter)
	if bytes >= idleReturnBytes || streams >= idleReturnStreams || (quiet && !e.quietReturned.Load()) {
		if bytes >= idleReturnBytes || streams >= idleReturnStreams {
			e.cache.shrink()
		}
		e.returnMemory()
		e.log.Debug("idle memory returned", zap.Int("streams", streams), zap.Int64("cache_bytes", bytes), zap.Bool("quiet", quiet))
	}
	e.quietReturned.Store(quiet)
	return streams, bytes
}
