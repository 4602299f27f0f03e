package streamstore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/segment"
)

// maxDataObject caps a data object, so a cold read fetches a bounded block.
const maxDataObject = 4 << 20

// compactWorkers is how many streams one compaction folds at once. Each
// stream costs at least two requests one after the other (its data object,
// then its checkpoint). With 1,000 busy streams on a bucket 25 ms away, 8
// or 16 at a time fell behind for good: the backlog outgrew the cache, so
// every entry had to be read back with a GET of its own, and the WAL grew
// by 40 objects a second. 64 kept up but doubled the appends' p99.
const compactWorkers = 32

func (e *Engine) compactLoop() {
	e.compactMu.Lock()
	if err := e.sweepPacks(e.bgCtx); err != nil && e.bgCtx.Err() == nil {
		e.log.Warn("deleting unlisted packs failed; they stay until the next start", zap.Error(err))
	}
	e.compactMu.Unlock()
	for {
		t := time.NewTimer(e.config().CompactInterval)
		select {
		case <-e.closing:
			t.Stop()
			return
		case <-t.C:
		case <-e.compactKick:
			t.Stop()
		case <-e.compactReset:
			t.Stop()
			continue
		}
		if e.fenced() != nil {
			continue // another node owns the storage: nothing to do
		}
		// Close cancels a compaction under way: it is safe to stop at any
		// point (what it wrote is found again or overwritten next time).
		ctx, cancel := context.WithTimeout(e.bgCtx, 5*time.Minute)
		if err := e.Compact(ctx); err != nil && e.bgCtx.Err() == nil {
			if errors.Is(err, segment.ErrFenced) {
				// The manifest names another process: it owns the
				// storage, and waiting for the next renewal to say so
				// would let this one acknowledge appends meanwhile.
				e.log.Error("storage taken over by another process; this node writes no more", zap.Error(err))
				e.fence(err)
			} else {
				e.log.Warn("compaction failed; will retry", zap.Error(err))
			}
		}
		cancel()
	}
}

// Compact folds every committed WAL entry into data objects and metadata
// checkpoints, then retires the WAL objects that no longer hold anything
// unique: the manifest moves first, the deletes follow.
func (e *Engine) Compact(ctx context.Context) error {
	if _, err := e.writer(); err != nil {
		return err
	}
	// A node that lost the storage folds nothing: its data objects and
	// checkpoints would land in the bucket the new owner holds, and only
	// the manifest, written last, would refuse it.
	if err := e.fenced(); err != nil {
		return fmt.Errorf("compact: %w", err)
	}
	e.deleteStrayBlobs(ctx)
	e.compactMu.Lock()
	defer e.compactMu.Unlock()
	began := time.Now()
	e.compactBegan.Store(began.UnixNano())
	misses := e.cache.misses.Load()
	ns, _ := e.w.Position()
	e.mu.Lock()
	// Entries before end are compacted. With nothing committed yet, that is
	// everything before this process's namespace (earlier namespaces may
	// hold nothing but their seals). A create still writing its metadata
	// holds back the cut: its stream cannot be checkpointed yet, and its
	// WAL entries must not be retired.
	end := e.commitEnd
	if end == (walPos{}) {
		end = walPos{NS: ns}
	}
	e.walBacklog, e.walBytes, e.walWire, e.walEntries, e.compactFull = 0, 0, 0, 0, false
	for s := range e.creating {
		s.mu.Lock()
		if len(s.runs) > 0 && end.after(s.runs[0].pos) {
			end = s.runs[0].pos
		}
		s.mu.Unlock()
	}
	var todo []*stream
	for _, s := range e.streams {
		s.mu.Lock()
		if len(s.runs) > 0 && end.after(s.runs[0].pos) {
			todo = append(todo, s)
		}
		s.mu.Unlock()
	}
	e.mu.Unlock()
	if len(todo) == 0 && e.hasRetired && e.retired == end {
		if _, dead := e.livePacks(); len(dead) == 0 && len(e.deadPacks) == 0 && !e.mergedPending() {
			// Idle: the manifest already says all this pass would
			// write, so it writes nothing and asks nothing (before, an
			// idle node read the lease and the manifest and wrote the
			// manifest back every compact_interval).
			e.log.Debug("nothing to compact")
			return nil
		}
	}
	e.retryDamaged(ctx, todo, began)

	// A backlog the cache lost part of is compacted a window of the WAL
	// at a time, each window's lost entries read back first with a GET
	// per WAL object (see lostWindows).
	var folded, packed int
	windows := e.lostWindows(todo, end)
	for _, upto := range windows {
		back, err := e.readWindow(ctx, todo, upto)
		if err != nil {
			return err
		}
		f, p, err := e.compactUpTo(ctx, todo, upto, back)
		if err != nil {
			return err
		}
		folded, packed = folded+f, packed+p
	}
	if folded > 0 || packed > 0 {
		// What folding and packing left behind goes back to the OS at
		// the next quiet sweep.
		e.quietReturned.Store(false)
	}
	if folded > 0 {
		// The idle streams just folded leave memory now rather than at
		// the next sweep: a fold of thousands of them can take the
		// better part of a sweep period.
		e.sweepIdle(time.Now())
	}
	e.log.Debug("compacted", zap.Int("folded", folded), zap.Int("packed", packed), zap.Int("windows", len(windows)),
		zap.Int("live_packs", len(e.packs)), zap.Uint64("cache_misses", e.cache.misses.Load()-misses),
		zap.Duration("took", time.Since(began)))
	return nil
}

// compactUpTo compacts the runs of the streams before end and retires the
// WAL before it; back holds the records of their WAL runs (readWindow). It
// returns how many streams it folded and packed.
func (e *Engine) compactUpTo(ctx context.Context, todo []*stream, end walPos, back *readBack) (folded, packed int, _ error) {
	// Busy streams with small backlogs go into shared packs; the others
	// are folded into data objects of their own.
	now := time.Now()
	idleBefore := now.Add(-e.config().IdleAfter).UnixNano()
	limit := e.config().PackBelow
	var fold []*stream
	var jobs []*packJob
	staying := 0
	damaged := map[*stream]walPos{}
	for _, s := range todo {
		s.mu.Lock()
		d := s.damagedAt
		s.mu.Unlock()
		if d != nil {
			damaged[s] = d.pos // compacted up to its damage, below
			continue
		}
		var j packJob
		switch decide(s, end, now, idleBefore, limit, &j) {
		case decideFold:
			fold = append(fold, s)
		case decidePack:
			jobs = append(jobs, &j)
		case decideLeave:
			staying++
		}
	}
	// Packed streams stay in memory: no more of them than MaxStreams, the
	// least recently used folded first.
	if over := staying + len(jobs) - e.config().MaxStreams; over > 0 {
		slices.SortFunc(jobs, func(a, b *packJob) int { return cmp.Compare(a.used, b.used) })
		over = min(over, len(jobs))
		for _, j := range jobs[:over] {
			fold = append(fold, j.s)
		}
		jobs = jobs[over:]
	}
	if err := e.pack(ctx, jobs, end, back); err != nil {
		return 0, 0, err
	}
	if err := e.fold(ctx, fold, end, back); err != nil {
		return 0, 0, err
	}
	// A stream with a damaged entry is folded up to the WAL object that
	// holds it, and the WAL is retired up to there: what lies beyond is
	// the only copy of its acknowledged changes, damaged or not.
	retire := end
	for s, at := range damaged {
		if at.after(end) {
			at = end
		}
		if err := e.fold(ctx, []*stream{s}, at, back); err != nil {
			return 0, 0, err
		}
		if retire.after(at) {
			retire = at
		}
	}
	if err := e.retireWAL(ctx, retire); err != nil {
		return 0, 0, err
	}
	return len(fold) + len(damaged), len(jobs), nil
}

// lostWindowBytes bounds the memory the lost WAL entries one window of a
// compaction reads back hold (walRun.memSize).
const lostWindowBytes = packReadBatch

// lostWindows splits the compaction of todo's runs before end into
// windows of the WAL, returned as the end of each (the last is end).
// Compaction reads its records from the cache, which holds the backlog
// unless it outgrew it; reading the entries the cache lost back stream
// by stream cost a GET per entry (a WAL object holds one entry of each
// of many streams), which a node with 10,000 busy streams could not keep
// up with once behind: the WAL grew, the cache lost more of it, and it
// fell further behind. Read back together, a window's lost entries cost
// a GET per WAL object, and a window holds at most lostWindowBytes of
// them, so a backlog far past the cache is worked through in bounded
// memory, each window compacted and its WAL retired before the next is
// read.
func (e *Engine) lostWindows(todo []*stream, end walPos) []walPos {
	lost := e.lostRuns(todo, end)
	slices.SortFunc(lost, func(a, b walRun) int {
		return cmp.Or(cmp.Compare(a.pos.NS, b.pos.NS), cmp.Compare(a.pos.Seq, b.pos.Seq))
	})
	var ends []walPos
	var size int64
	for i, r := range lost {
		if size > 0 && size+r.memSize() > lostWindowBytes && r.pos != lost[i-1].pos {
			ends = append(ends, r.pos)
			size = 0
		}
		size += r.memSize()
	}
	return append(ends, end)
}

// readWindow gathers the records of todo's WAL runs before end: those in
// the cache by reference, so that appends made while the compaction runs
// cannot push them out before it gets to them (one that took long, its
// packs read back from a bucket 25 ms away, then read thousands of entries
// back one GET each), and those it lost read back.
//
// A lost run that does not decode is damage (damaged.go), not a failure
// of the read: its stream's damagedAt is set, and the rest is read back as
// usual.
func (e *Engine) readWindow(ctx context.Context, todo []*stream, end walPos) (*readBack, error) {
	held := map[string][]Record{}
	var lost []walRun
	owner := map[string]*stream{}
	eachWALRun(todo, end, func(s *stream, r walRun) {
		key := runCacheKey(r.key, r.span)
		if recs, ok := e.cache.peek(key); ok {
			held[key] = recs
		} else {
			lost = append(lost, r)
			owner[key] = s
		}
	})
	got, err := e.readRuns(ctx, lost, func(r walRun, cause error) {
		s := owner[runCacheKey(r.key, r.span)]
		_ = e.damaged(s.name, r, cause)
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.damagedAt == nil || s.damagedAt.pos.after(r.pos) {
			s.damagedAt = &r
		}
		s.damageChecked = time.Now()
	})
	if err != nil {
		return nil, err
	}
	maps.Copy(held, got)
	return &readBack{recs: held}, nil
}

// lostRuns returns the WAL runs of todo before end whose records the cache
// does not hold.
func (e *Engine) lostRuns(todo []*stream, end walPos) []walRun {
	var lost []walRun
	eachWALRun(todo, end, func(_ *stream, r walRun) {
		if !e.cache.has(runCacheKey(r.key, r.span)) {
			lost = append(lost, r)
		}
	})
	return lost
}

// eachWALRun calls fn, under the stream's lock, with every run of todo
// before end whose records are in a WAL entry.
func eachWALRun(todo []*stream, end walPos, fn func(*stream, walRun)) {
	for _, s := range todo {
		s.mu.Lock()
		for _, r := range s.runs {
			if !end.after(r.pos) || (s.damagedAt != nil && !s.damagedAt.pos.after(r.pos)) {
				break
			}
			if r.snap == nil && r.blob == "" && r.ch.End > r.ch.First {
				fn(s, r)
			}
		}
		s.mu.Unlock()
	}
}

// fold compacts the streams into data objects of their own, reading back
// what they have in packs a batch of streams at a time.
func (e *Engine) fold(ctx context.Context, streams []*stream, end walPos, back *readBack) error {
	// In pack order (pack's), so a batch reads few, long ranges; streams
	// with nothing in packs first.
	sizes := make(map[*stream]int64, len(streams))
	keys := make(map[*stream]int64, len(streams))
	for _, s := range streams {
		s.mu.Lock()
		for i := 0; i < len(s.runs) && s.runs[i].snap != nil; i++ {
			sizes[s] += s.runs[i].memSize()
		}
		if sizes[s] > 0 {
			keys[s] = s.leavePacksLocked(time.Time{})
		}
		s.mu.Unlock()
	}
	slices.SortFunc(streams, func(a, b *stream) int {
		return cmp.Or(cmp.Compare(keys[a], keys[b]), cmp.Compare(a.name, b.name))
	})
	for len(streams) > 0 {
		n, size := 0, int64(0)
		packed := sizes[streams[0]] > 0
		for n < len(streams) && (sizes[streams[n]] > 0) == packed && (n == 0 || size+sizes[streams[n]] <= packReadBatch) {
			size += sizes[streams[n]]
			n++
		}
		workers := compactWorkers
		if packed {
			got, err := e.readPacked(ctx, streams[:n])
			if err != nil {
				return err
			}
			back.add(got)
			workers = e.packFoldWorkers(time.Now())
		}
		if err := e.foldBatch(ctx, streams[:n], end, back, workers); err != nil {
			return err
		}
		streams = streams[n:]
	}
	return nil
}

// packFoldWorkers is how many streams leaving the packs one compaction
// folds at once while requests come in. Their records wait safely in the
// packs, unlike a WAL backlog the cache must still hold, so they need not
// hurry: at 32 at a time, a thousand of them leaving in one compaction
// sent two thousand PUTs at once to the store the WAL uploads share, and
// appends waited seconds behind them. A node no request has used for
// packFoldQuiet folds them compactWorkers at a time: nothing waits behind
// its PUTs, and streams that went idle leave memory only once folded (at
// 4 at a time, 10,000 of them were still folding a minute after the last
// request, and row 8 measured +101 MiB of idle memory against +19).
const (
	packFoldBusy  = 4
	packFoldQuiet = time.Second
)

func (e *Engine) packFoldWorkers(now time.Time) int {
	if now.UnixNano()-e.lastUse.Load() >= int64(packFoldQuiet) {
		return compactWorkers
	}
	return packFoldBusy
}

func (e *Engine) foldBatch(ctx context.Context, streams []*stream, end walPos, pre *readBack, workers int) error {
	return e.inParallel(len(streams), workers, func(i int) error {
		return e.compactStream(ctx, streams[i], end, pre)
	})
}

// inParallel calls fn(0) to fn(n-1), at most workers at a time, on the
// engine's pool, and returns every error they returned, joined. Once the
// engine has closed it calls no more of them and says so.
func (e *Engine) inParallel(n, workers int, fn func(i int) error) error {
	errs := make([]error, n)
	sem := make(chan struct{}, workers)
	var wg sync.WaitGroup
	for i := range n {
		sem <- struct{}{}
		wg.Add(1)
		started := e.ioPool.Go(func() {
			defer wg.Done()
			defer func() { <-sem }()
			errs[i] = fn(i)
		})
		if !started {
			wg.Done()
			errs[i] = fmt.Errorf("%d of %d calls not made: %w", n-i, n, ErrShuttingDown)
			break
		}
	}
	wg.Wait()
	return errors.Join(errs...)
}

// compactStream writes the stream's committed entries before end as data
// objects and checkpoints its state into its metadata object. pre holds
// records already read back from the bucket.
func (e *Engine) compactStream(ctx context.Context, s *stream, end walPos, pre *readBack) (err error) {
	s.metaMu.Lock()
	defer s.metaMu.Unlock()
	// The keys this fold puts: should it fail, nothing names them.
	var written []string
	defer func() {
		if err != nil {
			s.noteLeftovers(written)
		}
	}()
	s.mu.Lock()
	n := 0
	for n < len(s.runs) && end.after(s.runs[n].pos) {
		n++
	}
	runs := append([]walRun(nil), s.runs[:n]...)
	meta := *s.meta
	etag, gone := s.etag, s.gone
	s.mu.Unlock()
	if gone || n == 0 {
		return nil
	}

	// A small last data object that these runs continue is written again
	// with them: the first object below starts with its records.
	chunk, tailKey, err := e.mergeTail(ctx, s, &meta, runs)
	if err != nil {
		return fmt.Errorf("compact %s: %w", s.name, err)
	}
	size := 0
	for i := range chunk {
		size += segment.RecordSize(&chunk[i])
	}
	merged := ""       // tailKey, once an object holding its records and more is written
	wrote := false     // a data object or marker was written
	var last *dataTail // the last plain data object written, while small
	flush := func() error {
		if len(chunk) == 0 {
			return nil
		}
		key := dataKey(meta.ID, chunk[0].Seq, chunk[len(chunk)-1].Seq+1)
		body := segment.EncodeData(chunk)
		// The tail alone again (the record after it would have passed
		// maxDataObject) is already there, and must not be deleted.
		if key != tailKey {
			written = append(written, key)
			if _, err := e.store.Put(ctx, key, body, segment.PutOptions{}); err != nil {
				return fmt.Errorf("put data %s: %w", key, err)
			}
			if tailKey != "" && chunk[0].Seq == meta.Tail.First {
				merged = tailKey
			}
		}
		// Not cached: the records are in the cache already as WAL entries
		// until this compaction ends, and caching them twice would push
		// out the entries the rest of the compaction still has to read.
		wrote, last = true, nil
		if int64(len(body)) < e.config().MergeBelow {
			last = &dataTail{First: chunk[0].Seq, End: chunk[len(chunk)-1].Seq + 1}
		}
		chunk, size = nil, 0
		return nil
	}
	for _, r := range runs {
		if r.ch.End == r.ch.First {
			r.applyTo(&meta.State)
			meta.Upto = r.pos.next()
			continue
		}
		// A blob is a data object already: list it, do not copy it. If a
		// trim cut into it, dropBelow below rewrites or drops it.
		if r.blob != "" {
			if err := flush(); err != nil {
				return err
			}
			key := markerKey(meta.ID, r.ch.First, r.ch.End, r.blob)
			written = append(written, key)
			if _, err := e.store.Put(ctx, key, nil, segment.PutOptions{}); err != nil {
				return fmt.Errorf("put marker %s: %w", key, err)
			}
			wrote, last = true, nil
			meta.State.apply(r.ch)
			meta.Upto = r.pos.next()
			continue
		}
		// The run's own cache entry first: recordsAt looks for the run
		// and its neighbours in the stream's run list under the stream
		// lock, which for a hot stream (many runs per WAL object) made
		// compaction quadratic and held up its appends.
		recs, ok := pre.take(runCacheKey(r.key, r.span))
		if !ok {
			recs, ok = e.cache.peek(runCacheKey(r.key, r.span))
		}
		if !ok {
			var err error
			if recs, err = e.recordsKept(ctx, s, meta.ID, r.ch.First); err != nil {
				return fmt.Errorf("compact %s: %w", s.name, err)
			}
		}
		for _, rec := range recs {
			if rec.Seq < r.ch.First || rec.Seq >= r.ch.End || (rec.Seq < meta.State.StartSeq && meta.Forks == 0) {
				continue
			}
			if size > 0 && size+len(rec.Body) > maxDataObject {
				if err := flush(); err != nil {
					return err
				}
			}
			chunk = append(chunk, rec)
			size += segment.RecordSize(&rec)
		}
		r.applyTo(&meta.State)
		meta.Upto = r.pos.next()
	}
	if err := flush(); err != nil {
		return err
	}
	if wrote {
		meta.Tail = last
	}
	// The tail the previous fold merged: its delete may have been lost to
	// a crash. Deleting it again is safe: an object from its first seq on
	// (the merged one, or one merged from that) holds its records, or a
	// trim took them.
	again := meta.Merged
	meta.Merged = merged
	// A trim is in the WAL until the checkpoint below is written, so the
	// data can go first: a crash in between replays the trim.
	// Trimmed bytes stay while forks may still read them: those the forks
	// say they read, or all of them when some fork does not say.
	if start := meta.thinTo(); meta.Forks > 0 && start > max(meta.Thinned, meta.Cleaned) {
		if reads, known := meta.forkReads(); known {
			err := e.thinBelow(ctx, meta.ID, max(meta.Thinned, meta.Cleaned), start, reads)
			switch {
			case err == nil:
				meta.Thinned = start
				// Deleted, or kept whole for a fork: no fold merges a
				// tail the trim reached into (mergeTail).
				if t := meta.Tail; t != nil && t.First < start {
					meta.Tail = nil
				}
			case meta.Deleted:
				// Not worth failing the compaction of every stream for:
				// a deleted stream is thinned again at the next release
				// of a fork, or its settle sweep.
				e.log.Warn("deleting what no fork reads of a deleted stream failed; tried again at its next release or settle sweep",
					zap.String("stream", s.name), zap.Error(err))
			default:
				return fmt.Errorf("trim %s around its forks: %w", s.name, err)
			}
		}
	}
	// Not leftovers, should this fold fail: a rewrite of an object the
	// checkpoint names is then all that holds its records from the trim on.
	var rewritten []string
	if meta.State.StartSeq > meta.Cleaned && meta.Forks == 0 {
		rewritten, err = e.dropBelow(ctx, meta.ID, meta.State.StartSeq)
		if err != nil {
			return fmt.Errorf("trim %s: %w", s.name, err)
		}
		meta.Cleaned, meta.Thinned = meta.State.StartSeq, 0
		if t := meta.Tail; t != nil && t.First < meta.Cleaned {
			// Deleted, or rewritten from the trim on: that object is the
			// tail then.
			meta.Tail = nil
			if rt := (dataTail{First: meta.Cleaned, End: t.End}); slices.Contains(rewritten, dataKey(meta.ID, rt.First, rt.End)) {
				meta.Tail = &rt
			}
		}
	}
	newTag, err := e.writeMeta(ctx, s, &meta, etag)
	if errors.Is(err, errMetaGone) {
		// Deleted meanwhile; its data goes with the gc tombstone. A
		// delete that finished has marked s gone; one whose grave landed
		// unconfirmed (or another writer's) has not, and s must not take
		// appends the bucket has already thrown away.
		s.mu.Lock()
		known := s.gone
		s.mu.Unlock()
		if !known {
			e.log.Warn("a checkpoint found the stream's metadata deleted or replaced; the stream is dropped from memory as deleted",
				zap.String("stream", s.name), zap.String("id", meta.ID))
		}
		e.forget(s)
		return nil
	}
	if err != nil {
		return fmt.Errorf("checkpoint %s: %w", s.name, err)
	}
	e.stats.folds.Add(1)
	if merged != "" {
		// Only now: until the checkpoint landed, the old one named it.
		e.noteMerged(merged)
		e.stats.merges.Add(1)
	}
	if again != "" {
		e.noteMerged(again)
	}
	if len(s.leftovers) > 0 {
		// A rewrite may be of an object this fold wrote, whose records
		// readers need: it is never taken for a leftover.
		e.dropLeftovers(ctx, s, slices.Concat(written, rewritten), meta.State.NextSeq)
	}
	if ce := e.log.Check(zap.DebugLevel, "checkpoint written"); ce != nil {
		ce.Write(zap.String("stream", s.name), zap.Uint64("next_seq", meta.State.NextSeq),
			zap.Stringer("upto", meta.Upto), zap.Int("runs", n))
	}
	s.mu.Lock()
	s.runs = s.runs[n:]
	s.meta = &meta
	s.etag = newTag
	s.mu.Unlock()
	// Reads find these records in the data objects now: the cached WAL
	// entries can never be looked up again.
	dead := make([]string, 0, len(runs))
	for _, r := range runs {
		dead = append(dead, runCacheKey(r.key, r.span))
	}
	e.cache.remove(dead)
	return nil
}

// dropBelow deletes the data objects of id that hold only seqs below start,
// and rewrites the one that straddles it without the trimmed records. It
// returns the keys of the plain data objects it wrote.
//
// Keys sort by end, and so by first as well, but for objects a fold wrote
// before its checkpoint failed, which the merged object of a later fold
// overlaps (see holding): past the first object that starts at start or
// later, the listing goes on for dropOverlapKeys more keys, for a merged
// object straddling start after it.
//
// A blob goes before the marker that names it: a DELETE that fails leaves
// the marker, so the next pass (Cleaned has not moved) finds the blob
// again, where a marker deleted first would leave a blob nothing lists,
// kept until its stream is deleted. A marker left naming a deleted blob
// holds only seqs below start, which no read asks for. The straddling
// marker is the exception: it sorts before its rewritten object, so reads
// from start on would still find it and its deleted blob. It is replaced
// first by a drop marker (markerKey with an empty range at its first seq,
// which no read finds) that keeps the blob listed until it is gone.
func (e *Engine) dropBelow(ctx context.Context, id string, start uint64) ([]string, error) {
	after := ""
	past := 0 // keys seen that start at start or later
	var rewritten []string
	for {
		objs, more, err := e.store.List(ctx, dataPrefix(id), after, 1000)
		if err != nil {
			return rewritten, fmt.Errorf("list data of %s: %w", id, err)
		}
		var dead, blobs, cut []string
		for _, o := range objs {
			after = o.Key
			first, end, blob, ok := parseDataKey(o.Key)
			if ok && first >= start {
				if past++; past > dropOverlapKeys {
					more = false
					break
				}
				continue
			}
			if !ok {
				more = false
				break
			}
			if blob == "" {
				if end > start {
					nk, err := e.rewriteFrom(ctx, id, o.Key, start)
					if err != nil {
						return rewritten, err
					}
					if nk != "" {
						rewritten = append(rewritten, nk)
					}
				}
				dead = append(dead, o.Key)
				continue
			}
			blobs = append(blobs, blobKey(id, blob))
			if end <= start {
				dead = append(dead, o.Key)
				continue
			}
			nk, err := e.rewriteFrom(ctx, id, blobKey(id, blob), start)
			if errors.Is(err, segment.ErrNotFound) {
				nk, err = e.blobRewritten(ctx, id, first, start, end, err)
			}
			if err != nil {
				return rewritten, err
			}
			if nk != "" {
				rewritten = append(rewritten, nk)
			}
			drop := markerKey(id, first, first, blob)
			if _, err := e.store.Put(ctx, drop, nil, segment.PutOptions{}); err != nil {
				return rewritten, fmt.Errorf("mark trimmed blob %s of %s: %w", blob, id, err)
			}
			cut = append(cut, o.Key)
			dead = append(dead, drop)
		}
		for _, keys := range [][]string{cut, blobs, dead} {
			if len(keys) == 0 {
				continue
			}
			if err := e.store.Delete(ctx, keys); err != nil {
				return rewritten, fmt.Errorf("delete trimmed data of %s: %w", id, err)
			}
		}
		if !more || len(objs) == 0 {
			return rewritten, nil
		}
	}
}

// thinBelow deletes the data objects of id that hold only seqs below start
// and none in reads (the records forks read, sorted, as forkReads returns
// them), listing from the objects that end after from. Objects that reach
// start or hold a record of reads are kept whole: a fork reading part of
// an object keeps all of it.
//
// A blob goes before its marker, as in dropBelow, so that a failed delete
// leaves the marker that names it for the next pass.
func (e *Engine) thinBelow(ctx context.Context, id string, from, start uint64, reads []seqSpan) error {
	after := dataKeyAfter(id, from)
	for {
		objs, more, err := e.store.List(ctx, dataPrefix(id), after, 1000)
		if err != nil {
			return fmt.Errorf("list data of %s: %w", id, err)
		}
		var dead, blobs []string
		for _, o := range objs {
			after = o.Key
			first, end, blob, ok := parseDataKey(o.Key)
			if !ok || end > start {
				// Keys sort by end: none after this one ends below start.
				more = false
				break
			}
			if readsAny(reads, first, end) {
				continue
			}
			if blob != "" {
				blobs = append(blobs, blobKey(id, blob))
			}
			dead = append(dead, o.Key)
		}
		for _, keys := range [][]string{blobs, dead} {
			if len(keys) == 0 {
				continue
			}
			if err := e.store.Delete(ctx, keys); err != nil {
				return fmt.Errorf("delete trimmed data of %s: %w", id, err)
			}
		}
		if !more || len(objs) == 0 {
			return nil
		}
	}
}

// dropOverlapKeys is how far dropBelow lists past the first object that
// starts at the trim: the objects failed folds left inside a merged one are
// a few at most.
const dropOverlapKeys = 32

// blobRewritten is dropBelow's answer to a marker of blob, holding seqs
// [first, end) around start, whose blob is gone (notFound): an earlier
// pass of a trim rewrote the blob from its start on and deleted it with
// its marker, and the marker came back since, written again by the fold
// after that pass's checkpoint failed, or a PUT of it landing late. That
// rewrite, a plain object ending at end and starting after first, at or
// before start, holds the records. Its key is returned when it starts at
// start, "" when it starts before: dropBelow's listing comes to it after
// the marker (keys of one end sort by first) and rewrites it in turn, as
// this trim cuts into it. Without one the
// records are lost, and notFound is returned: the trim fails, as it did
// for the marker every time, which kept every compaction failing.
func (e *Engine) blobRewritten(ctx context.Context, id string, first, start, end uint64, notFound error) (string, error) {
	after := dataKeyAfter(id, end-1)
	for {
		objs, more, err := e.store.List(ctx, dataPrefix(id), after, 100)
		if err != nil {
			return "", fmt.Errorf("look for the rewrite of a trimmed blob of %s: %w", id, err)
		}
		for _, o := range objs {
			after = o.Key
			f, en, blob, ok := parseDataKey(o.Key)
			if !ok || en != end {
				return "", notFound // past the objects that end at end
			}
			switch {
			case blob != "" || f <= first || f > start:
			case f == start:
				return o.Key, nil
			default:
				return "", nil
			}
		}
		if !more || len(objs) == 0 {
			return "", notFound
		}
	}
}

// rewriteFrom writes the records from start on of data object key (a blob
// or a plain data object of id) as a new data object, and returns its key
// ("" when there are none).
func (e *Engine) rewriteFrom(ctx context.Context, id, key string, start uint64) (string, error) {
	recs, _, err := e.readData(ctx, key)
	if err != nil {
		return "", err
	}
	var keep []Record
	for _, r := range recs {
		if r.Seq >= start {
			keep = append(keep, r)
		}
	}
	if len(keep) == 0 {
		return "", nil
	}
	nk := dataKey(id, keep[0].Seq, keep[len(keep)-1].Seq+1)
	if _, err := e.store.Put(ctx, nk, segment.EncodeData(keep), segment.PutOptions{}); err != nil {
		return "", fmt.Errorf("put data %s: %w", nk, err)
	}
	return nk, nil
}

// retireWAL moves the manifest to end, lists the live packs there, and
// deletes the WAL objects before end and the packs no stream needs.
func (e *Engine) retireWAL(ctx context.Context, end walPos) error {
	// A process that lost the storage must not delete what the new owner
	// replays, nor write the manifest over the new owner's: the update
	// below sets the pack list from this process's view, which would
	// delist a pack the other has listed. The lease's local validity is
	// not proof enough: a process of the same node id takes it over at
	// once, and the old one finds out only at its next renewal, so the
	// lease object is read first, as before registering a namespace.
	if err := e.checkLease(); err != nil {
		return err
	}
	if err := e.lease.Load().Confirm(ctx); err != nil {
		return fmt.Errorf("confirm the lease before retiring the WAL: %w", err)
	}
	var drop []uint64 // whole namespaces
	var trimNS, trimTo uint64
	live, deadPacks := e.livePacks()
	man, err := e.man.Update(ctx, func(m *segment.Manifest) error {
		m.Packs = live
		trimTo = 0
		// A namespace leaves Namespaces for RetiredWAL, and leaves that
		// only once a compaction found its objects deleted: they go
		// after this write, and a failed delete or a crash before them
		// must leave something that names them.
		m.RetiredWAL = slices.DeleteFunc(m.RetiredWAL, func(id uint64) bool { return e.walSwept[id] })
		kept := m.Namespaces[:0:0]
		for _, n := range m.Namespaces {
			if n.ID < end.NS {
				m.RetiredWAL = append(m.RetiredWAL, n.ID)
				continue
			}
			if n.ID == end.NS {
				n.ReplayFrom = max(n.ReplayFrom, end.Seq)
				if n.SealedAt != nil && n.ReplayFrom >= *n.SealedAt {
					m.RetiredWAL = append(m.RetiredWAL, n.ID)
					continue
				}
				trimNS, trimTo = n.ID, n.ReplayFrom
			}
			kept = append(kept, n)
		}
		m.Namespaces = kept
		drop = slices.Clone(m.RetiredWAL)
		return nil
	})
	if err != nil {
		return fmt.Errorf("advance manifest: %w", err)
	}
	if ce := e.log.Check(zap.DebugLevel, "manifest moved"); ce != nil {
		ce.Write(zap.Stringer("retired_to", end), zap.Int("live_packs", len(live)), zap.Strings("dead_packs", deadPacks))
	}
	// The namespaces swept before are out of the list now.
	e.walSwept = map[uint64]bool{}
	e.noteRetired(man)
	// Unlisted now: a crash before the delete leaves them to sweepPacks.
	e.packs = live
	e.stats.packsLive.Store(int64(len(live)))
	// Out of the manifest and of e.packs now: a failed delete is kept to
	// be tried again, or the pack would stay until the next start's sweep.
	// The data objects folds merged into larger ones go in the same
	// request.
	deadPacks = append(deadPacks, e.deadPacks...)
	deadPacks = append(deadPacks, e.takeMerged()...)
	e.deadPacks = nil
	if len(deadPacks) > 0 {
		if err := e.store.Delete(ctx, deadPacks); err != nil {
			e.deadPacks = deadPacks
			return fmt.Errorf("delete dead packs and merged data objects: %w", err)
		}
	}
	for _, ns := range drop {
		if err := e.deleteUnder(ctx, segment.WALPrefix(ns), "", ""); err != nil {
			return err
		}
		e.walSwept[ns] = true
	}
	if trimTo > 0 {
		// The last retirement in the namespace deleted everything before
		// its point: list from there. On a versioned bucket the deleted
		// keys stay as delete markers, which a listing from the start of
		// the namespace would step over at every compaction, more of them
		// each time.
		from := ""
		if e.hasRetired && e.retired.NS == trimNS && e.retired.Seq > 0 {
			from = segment.WALKey(trimNS, e.retired.Seq-1)
		}
		if err := e.deleteUnder(ctx, segment.WALPrefix(trimNS), from, segment.WALKey(trimNS, trimTo)); err != nil {
			return err
		}
	}
	e.retired, e.hasRetired = end, true
	return nil
}

// deleteUnder deletes every key under prefix that sorts after from and
// before stop (all of them when both are empty), a list page and one
// batched delete at a time.
func (e *Engine) deleteUnder(ctx context.Context, prefix, from, stop string) error {
	after := from
	for {
		objs, more, err := e.store.List(ctx, prefix, after, 1000)
		if err != nil {
			return fmt.Errorf("list %s: %w", prefix, err)
		}
		var keys []string
		done := !more
		for _, o := range objs {
			if stop != "" && o.Key >= stop {
				done = true
				break
			}
			keys = append(keys, o.Key)
			after = o.Key
		}
		if len(keys) > 0 {
			if err := e.store.Delete(ctx, keys); err != nil {
				return fmt.Errorf("delete under %s: %w", prefix, err)
			}
		}
		if done || len(objs) == 0 {
			return nil
		}
	}
}

func (e *Engine) kickGC() {
	select {
	case e.gcKick <- struct{}{}:
	default:
	}
}

// gcLoop removes the data of deleted streams, as their tombstones say.
func (e *Engine) gcLoop() {
	skipped := false // the last pass did not run: the lease was not ours
	for {
		select {
		case <-e.closing:
			return
		case <-e.gcKick:
		case <-time.After(gcWait(e.nextGrave.Load(), skipped, time.Now())):
		}
		if skipped = e.checkLease() != nil; skipped {
			// Replaced, or unable to renew: the owner collects.
			continue
		}
		// Close cancels a compaction under way: it is safe to stop at any
		// point (what it wrote is found again or overwritten next time).
		ctx, cancel := context.WithTimeout(e.bgCtx, 5*time.Minute)
		if err := e.collectGarbage(ctx); err != nil {
			e.log.Warn("removing deleted streams' data failed; will retry", zap.Error(err))
		}
		cancel()
		e.sweepOrphansIfDue()
	}
}

// gcWait is how long the collector waits for its next pass: a few
// minutes, less when the next grave (nextGrave, Unix ms; 0: none) is due
// sooner, but a minute after a pass skipped for want of the lease. Only a
// pass removes a due grave, so one skipped would find it due again at once
// and the loop would spin for as long as the lease stayed lost.
func gcWait(nextGrave int64, skipped bool, now time.Time) time.Duration {
	if skipped {
		return time.Minute
	}
	wait := 5 * time.Minute
	if nextGrave != 0 {
		wait = min(wait, max(time.UnixMilli(nextGrave).Sub(now), 0))
	}
	return wait
}

// errTombstoneGone says a tombstone listed a moment ago is gone: another
// collector got to it.
var errTombstoneGone = errors.New("tombstone gone since the listing")

// tombstoneStale reports whether the stream a gc tombstone names (its body,
// returned) still has metadata with the tombstone's id: its delete failed
// after the tombstone was written. The name lock keeps a delete under way
// from being judged halfway.
func (e *Engine) tombstoneStale(ctx context.Context, key, id string) (string, bool, error) {
	name, _, err := e.store.Get(ctx, key, 0, -1)
	if errors.Is(err, segment.ErrNotFound) {
		// Judged and removed by another collector, perhaps as stale:
		// collecting the id's data now could take a live stream's.
		return "", false, errTombstoneGone
	}
	if err == nil && len(name) == 0 {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("read tombstone %s: %w", key, err)
	}
	unlock := e.lockName(string(name))
	defer unlock()
	data, _, err := e.metaOf(ctx, string(name), id)
	if errors.Is(err, errMetaGone) {
		return string(name), false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("read metadata of %s for tombstone %s: %w", name, key, err)
	}
	// Undecodable metadata says nothing about the id: collect, as before
	// tombstones were checked.
	_, err = decodeMeta(data)
	return string(name), err == nil, nil
}

// removeGrave removes the grave of stream id from name's metadata key once
// it is due (removeGraveAt), under the name lock.
func (e *Engine) removeGrave(ctx context.Context, name, id string) (time.Time, error) {
	unlock := e.lockName(name)
	defer unlock()
	return e.removeGraveAt(ctx, metaKey(name), id)
}

// collectGarbage works off the tombstones of deleted streams (their data
// and blobs go, and their graves into the grave index) and then removes
// the graves that are due.
func (e *Engine) collectGarbage(ctx context.Context) error {
	// One collector at a time: two that judge one tombstone could take a
	// live stream's data (one finds it stale and removes it, the other
	// then finds it gone).
	e.gcMu.Lock()
	defer e.gcMu.Unlock()
	after := ""
	var firstErr error
	failing := 0
	for {
		objs, more, err := e.store.List(ctx, "gc/", after, 1000)
		if err != nil {
			return fmt.Errorf("list gc tombstones: %w", err)
		}
		// Tombstones are independent (each names its own stream id), so
		// a page's go gcWorkers at a time: one at a time, at some seven
		// requests each, a bucket 25 ms away collected a few deleted
		// streams a second, fewer than a service whose streams expire by
		// the million a day deletes.
		var (
			mu       sync.Mutex
			stop     bool
			fatalErr error
		)
		perr := e.inParallel(len(objs), gcWorkers, func(i int) error {
			mu.Lock()
			skip := stop
			mu.Unlock()
			if skip {
				return nil
			}
			fatal, err := e.collectTombstone(ctx, objs[i].Key)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				failing = 0
			case fatal:
				stop = true
				if fatalErr == nil {
					fatalErr = err
				}
			default:
				// One tombstone the store keeps refusing (an object under
				// a legal hold, metadata it denies) is passed over until
				// the next pass, rather than holding up every one after it
				// for good. A few failing in a row is the store failing:
				// stop.
				if firstErr == nil {
					firstErr = err
				}
				failing++
				e.log.Warn("a deleted stream's tombstone is not collected; the next pass tries again",
					zap.String("key", objs[i].Key), zap.Error(err))
				stop = stop || failing >= gcFailuresInARow
			}
			return nil
		})
		switch {
		case fatalErr != nil:
			return fatalErr
		case perr != nil:
			return perr
		case stop:
			return firstErr
		}
		if len(objs) > 0 {
			after = objs[len(objs)-1].Key
		}
		if !more || len(objs) == 0 {
			break
		}
	}
	if err := e.removeDueGraves(ctx); err != nil {
		return err
	}
	return firstErr
}

// gcFailuresInARow is how many tombstones failing one after another end a
// collector pass: the store, not one object, is failing.
const gcFailuresInARow = 3

// gcWorkers is how many tombstones a collector pass works off at once.
const gcWorkers = 8

// collectTombstone works off tombstone key: the deleted stream's data and
// blobs go and its grave into the grave index, or a stale tombstone goes
// alone. fatal reports an error that ends the pass: the storage is no
// longer this process's.
func (e *Engine) collectTombstone(ctx context.Context, key string) (fatal bool, err error) {
	id := strings.TrimPrefix(key, "gc/")
	name, live, err := e.tombstoneStale(ctx, key, id)
	if errors.Is(err, errTombstoneGone) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if live {
		// A delete that failed after its tombstone: the stream is still
		// there, and so is its data. Or a delete under way in the process
		// that replaced this one, between its tombstone and its grave:
		// only the owner may tell.
		if err := e.confirmOwner(ctx); err != nil {
			return true, fmt.Errorf("judge tombstone %s: %w", key, err)
		}
		if err := e.store.Delete(ctx, []string{key}); err != nil {
			return false, fmt.Errorf("delete stale tombstone %s: %w", key, err)
		}
		return false, nil
	}
	if err := e.sweepStreamData(ctx, id); err != nil {
		return false, err
	}
	// The grave was written before the tombstone was listed, so it is due
	// at the latest one grave time from now. Indexed by that time, it
	// costs no request until then, however many wait.
	if name != "" {
		due := time.Now().Add(e.config().GraveTime)
		if _, err := e.store.Put(ctx, graveIndexKey(due, id), []byte(name), segment.PutOptions{}); err != nil {
			return false, fmt.Errorf("index the grave of %s: %w", name, err)
		}
	}
	if err := e.store.Delete(ctx, []string{key}); err != nil {
		return false, fmt.Errorf("delete tombstone %s: %w", key, err)
	}
	return false, nil
}

// sweepStreamData deletes the data objects and blobs of the deleted
// stream id. Blobs after data: a marker is never left naming a deleted
// blob. Blobs that never made it into the WAL go here too.
func (e *Engine) sweepStreamData(ctx context.Context, id string) error {
	for _, p := range []string{dataPrefix(id), blobPrefix(id)} {
		if err := e.deleteUnder(ctx, p, "", ""); err != nil {
			return err
		}
	}
	return nil
}

// removeDueGraves removes the graves whose index entries are due, oldest
// first, and notes when the next one is.
func (e *Engine) removeDueGraves(ctx context.Context) error {
	e.nextGrave.Store(0)
	now := time.Now()
	after := ""
	for {
		objs, more, err := e.store.List(ctx, gravesPrefix, after, 1000)
		if err != nil {
			return fmt.Errorf("list the grave index: %w", err)
		}
		for _, o := range objs {
			after = o.Key
			due, id, err := parseGraveIndexKey(o.Key)
			if err != nil {
				e.log.Warn("not a grave index entry; left alone", zap.String("key", o.Key), zap.Error(err))
				continue
			}
			if due.After(now) {
				e.nextGrave.Store(due.UnixMilli())
				return nil
			}
			name, _, err := e.store.Get(ctx, o.Key, 0, -1)
			if errors.Is(err, segment.ErrNotFound) {
				continue
			}
			if err != nil {
				return fmt.Errorf("read grave index entry %s: %w", o.Key, err)
			}
			var later time.Time
			if strings.HasPrefix(id, docGraveID) {
				later, err = e.removeGraveAt(ctx, string(name), "")
			} else {
				// A write of the stream's data held up on its way (a
				// fold's or a blob's PUT whose client gave up) can land
				// after the tombstone's sweep. It was signed before the
				// delete, so it has landed or never will by now: a sweep
				// of the id's keys again leaves nothing behind.
				if err := e.sweepStreamData(ctx, id); err != nil {
					return err
				}
				later, err = e.removeGrave(ctx, string(name), id)
			}
			if err != nil {
				return err
			}
			if !later.IsZero() {
				// The grave is younger than its entry says (grave_time
				// grew since): index it again at its own time.
				if _, err := e.store.Put(ctx, graveIndexKey(later, id), name, segment.PutOptions{}); err != nil {
					return fmt.Errorf("index the grave of %s again: %w", name, err)
				}
			}
			if err := e.store.Delete(ctx, []string{o.Key}); err != nil {
				return fmt.Errorf("delete grave index entry %s: %w", o.Key, err)
			}
		}
		if !more || len(objs) == 0 {
			return nil
		}
	}
}
