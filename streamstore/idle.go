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

// idleReturn is how much a sweep must release before it returns memory to
// the OS: below that, the scavenger's own pace is fine.
const (
	idleReturnBytes   = 8 << 20
	idleReturnStreams = 1000
)

func (e *Engine) idleLoop() {
	defer e.bg.Done()
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
	cutoff := now.Add(-e.config().IdleAfter)
	bytes = e.cache.dropIdle(cutoff)
	e.mu.Lock()
	for name, s := range e.streams {
		if s.used.Load() > cutoff.UnixNano() || !s.mu.TryLock() {
			continue
		}
		// Work in flight or uncompacted WAL runs pin a handle; waiters
		// are readers following the tail.
		if s.pending == 0 && len(s.runs) == 0 && s.waiters.Load() == 0 {
			s.evicted = true
			delete(e.streams, name)
			streams++
		}
		s.mu.Unlock()
	}
	if streams >= idleReturnStreams {
		// Go maps keep the buckets of their largest size: a burst over
		// many streams would pin its map for good.
		e.streams = maps.Collect(maps.All(e.streams))
	}
	e.mu.Unlock()
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
