package streamstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/segment"
)

// MaxForkDepth is the deepest a fork may be in a chain of forks (a fork of
// a fork of ...): a read of a fork goes through every stream up its chain,
// loading each, and, unbounded, a chain a client built one create at a
// time would make every read of its last fork load millions of streams,
// and its recursion could exhaust the stack.
const MaxForkDepth = 1000

// createFork creates name as a fork of req.Fork.Source. The source's fork
// count goes up before the fork's metadata exists, so a crash between the
// two can only keep the source's data too long, never free it too soon.
// The caller holds the fork's name lock; the source's is taken here (child
// before parent, as deletes cascade).
func (e *Engine) createFork(ctx context.Context, name string, req CreateRequest) (Info, bool, error) {
	unlock := e.lockName(req.Fork.Source)
	defer unlock()
	src, err := e.liveLocked(ctx, req.Fork.Source, true)
	if errors.Is(err, ErrGone) {
		return Info{}, false, conflictf("the source stream was deleted")
	}
	if err != nil {
		return Info{}, false, err
	}
	src.mu.Lock()
	srcMeta := *src.meta
	src.mu.Unlock()
	depth := srcMeta.forkDepth() + 1
	if depth > MaxForkDepth {
		return Info{}, false, fmt.Errorf("%w: the source is a fork %d forks deep, and a fork may be at most %d deep: fork a stream higher up the chain",
			ErrBadRequest, depth-1, MaxForkDepth)
	}
	if req.ContentType == "" {
		req.ContentType = srcMeta.ContentType
	} else if !sameMediaType(req.ContentType, srcMeta.ContentType) {
		return Info{}, false, conflictf("a fork has its source's content type %q", srcMeta.ContentType)
	}
	srcExpiry := &expiryRef{TTLSeconds: srcMeta.TTLSeconds, ExpiresAt: srcMeta.ExpiresAt}
	if req.Expiry.IsZero() {
		req.Expiry = srcMeta.expiry()
	}
	// A point inside a record reads the source's records: within the
	// caller's answer-by time, as nothing is written yet.
	rctx, cancelResolve := withAnswerByDeadline(ctx)
	seq, bytes, err := e.resolveForkPoint(rctx, src, req.Fork.Seq, req.Fork.Bytes)
	cancelResolve()
	if err != nil {
		if due := answerDue(ctx); due != nil && ctx.Err() == nil {
			return Info{}, false, fmt.Errorf("%w: read the fork point in %s: %v", due, src.name, err)
		}
		return Info{}, false, err
	}
	// The fork is listed with the count, so that a count its release
	// never comes for (the fork's metadata write lost, the process gone
	// before the release landed) can be settled by looking it up.
	// Past maxListedForks, a fork is counted only, as before forks were
	// listed: the metadata object, rewritten at every checkpoint, stays
	// small.
	forkID, listedAt := newID(), time.Now().UnixMilli()
	listed := len(srcMeta.ForkList) < maxListedForks
	// The entry also says which of the source's records the fork reads,
	// so that a trim of the source deletes the others. Its start is read
	// before the raise, as trims only move it on, so the span holds the
	// one the fork gets below.
	src.mu.Lock()
	reads := &seqSpan{From: src.startSeq(&src.durable), To: (&forkRef{Seq: seq, Bytes: bytes}).base()}
	src.mu.Unlock()
	// Within the caller's answer-by time: nothing of the fork is written
	// yet, so a raise cut short leaves it unmade, and a raise that lands
	// all the same only keeps the source's data until its count is
	// settled (the fork is listed, and never found).
	uctx, cancelUpdate := withAnswerByDeadline(ctx)
	err = e.updateMeta(uctx, src, func(m *metaObject) {
		m.Forks++
		if listed {
			m.ForkList = append(slices.Clone(m.ForkList), forkEntry{Name: name, ID: forkID, At: listedAt, Reads: reads})
		} else {
			m.noteUnlisted(*reads)
		}
	})
	cancelUpdate()
	if err != nil {
		if listed && src.metaUnsure.Load() {
			// The raise may have landed unseen: the handle's next write
			// would write over it, but should the handle leave memory
			// first, its next load would count a fork that is never made,
			// for as long as the source lives. Settled as a lost create.
			e.settleLostFork(&forkRef{SourceName: src.name, SourceID: srcMeta.ID, Listed: true}, forkEntry{Name: name, ID: forkID})
		}
		if due := answerDue(ctx); due != nil {
			return Info{}, false, fmt.Errorf("%w: raise the fork count of %s: %v", due, src.name, err)
		}
		return Info{}, false, err
	}
	// A trim does not take the name lock and may have moved the source's
	// start since resolveForkPoint looked. Now that the count is up,
	// compaction keeps the source's records from the start read before it
	// (reads.From) to the point, so the fork's inherited records begin at
	// the start read here, which is not below that one.
	src.mu.Lock()
	start := src.startSeq(&src.durable)
	lastTS := src.durable.LastTS
	src.mu.Unlock()
	var info Info
	var created bool
	if seq < start {
		err = &TrimmedError{Seq: seq, StartSeq: start}
	} else {
		ref := &forkRef{SourceName: src.name, SourceID: srcMeta.ID, Seq: seq, Bytes: bytes, Start: start, Tail: req.Fork.Tail, Listed: listed, Depth: depth, SourceExpiry: srcExpiry, lastTS: lastTS}
		info, created, err = e.create(ctx, name, req, ref, forkID, true)
		if errors.Is(err, errNameTaken) {
			err = ErrConflict
		}
	}
	// A fork whose create failed on the bucket may exist, now or once the
	// bucket answers: a metadata PUT the read-back did not find can still
	// land, and a create repeated then confirms the fork. It keeps the
	// count, which at worst keeps the source's data longer; a create
	// refused outright, or one that failed before it wrote anything (an
	// expiry marker the bucket refused, a WAL writer too busy to take its
	// records), gives it back: kept, the count would never come down, and
	// the source, once deleted, would stay soft-deleted for good.
	var unwritten unwrittenError
	if err != nil && (!errors.Is(err, ErrUnavailable) || errors.As(err, &unwritten)) {
		// Best effort: a failed decrement only keeps the source's data
		// longer. A caller that must be answered by a time of its own
		// does not wait for it.
		if _, ok := answerBy(ctx); ok {
			// After this call has let go of the source's name: under
			// the lock again, and through the handle lookups use then.
			// src may have left memory meanwhile (nothing pins it), and
			// a write through it would change the metadata behind the
			// back of the handle loaded since, whose every later write
			// (compaction's checkpoints, a delete) it would then fail.
			ref := &forkRef{SourceName: src.name, SourceID: srcMeta.ID, Listed: listed}
			if !e.goBG(func() {
				if _, _, err := e.releaseChain(e.bgCtx, ref, forkID); err != nil {
					e.log.Warn("a failed fork's count on its source was not given back; the source's data is kept",
						zap.String("source", src.name), zap.Error(err))
				}
			}) {
				e.log.Warn("a failed fork's count on its source was not given back: the engine is closing; the source's data is kept",
					zap.String("source", src.name))
			}
		} else if rctx := context.WithoutCancel(ctx); e.updateMeta(rctx, src, func(m *metaObject) { m.releaseFork(forkID, listed) }) == nil {
			// Still under the source's name lock: src is the handle.
			e.dropKeptTrims(rctx, src)
		}
	} else if err != nil && listed && len(req.Records) == 0 {
		// With records, the create went through the WAL, and a replay
		// may still complete it from there, past any wait.
		e.settleLostFork(&forkRef{SourceName: src.name, SourceID: srcMeta.ID, Listed: true}, forkEntry{Name: name, ID: forkID})
	}
	return info, created, err
}

// settleLostFork gives back the count a fork create kept on its source
// (f names the fork) because the fork's metadata might still land, once
// Config.GraveTime has passed and the fork is not there: it never will
// be. Only for a create without records, which writes the fork's
// metadata and nothing else. Only a soft-deleted source's settle sweep
// did that before, so a live
// source counted such a fork, and kept the records it would have read
// against every trim, for as long as it lived. Only listed forks: a
// release of one already released is then a no-op, where an unlisted one
// would lower the count for another fork. Should the process end first,
// the count stays until the source is deleted and settled, as before.
func (e *Engine) settleLostFork(ref *forkRef, f forkEntry) {
	wait := e.config().GraveTime
	if e.lostForks.Add(1) > maxLostForkWaits {
		// Fork creates failing by the thousand (a store down while
		// clients retry them) must not pile up a goroutine each for
		// grave_time.
		e.lostForks.Add(-1)
		e.log.Warn("too many failed fork creates wait to give their counts back; this one's stays until its source is deleted",
			zap.String("source", ref.SourceName), zap.String("fork", f.Name))
		return
	}
	if !e.goBG(func() {
		defer e.lostForks.Add(-1)
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-e.closing:
			return
		case <-t.C:
		}
		exists, err := e.forkExists(e.bgCtx, f)
		if err == nil && !exists {
			_, _, err = e.releaseChain(e.bgCtx, ref, f.ID)
		}
		if err != nil && e.bgCtx.Err() == nil {
			e.log.Warn("a fork create failed, and giving its count on the source back failed too; the source keeps its records until it is deleted",
				zap.String("source", ref.SourceName), zap.String("fork", f.Name), zap.Error(err))
		}
	}) {
		e.lostForks.Add(-1)
	}
}

// maxLostForkWaits bounds the failed fork creates waiting in
// settleLostFork at once.
const maxLostForkWaits = 1024

// resolveForkPoint turns (seq, bytes) into a point inside one record: it
// skips whole records while bytes reach past them. seq must not be below
// the source's first retained seq (a *TrimmedError): the records there
// may be gone from the bucket, so neither the fork nor the walk over
// bytes could read them. The point must not be beyond the source's
// durable tail.
func (e *Engine) resolveForkPoint(ctx context.Context, src *stream, seq, bytes uint64) (uint64, uint64, error) {
	return e.resolveForkPointFrom(ctx, src, seq, bytes, nil)
}

// resolveForkPointFrom is resolveForkPoint with within, when set, as the
// records it may read in place of the source's retained ones: those an
// existing fork reads, which its entry in the source's fork list (or, if
// that does not say, its count) keeps in the bucket, trimmed or not. A
// walk that would read past them is errPastFork: the point it resolves to
// is past theirs too, and the records there may be gone.
func (e *Engine) resolveForkPointFrom(ctx context.Context, src *stream, seq, bytes uint64, within *seqSpan) (uint64, uint64, error) {
	asked := seq
	src.mu.Lock()
	next, id, start := src.durable.NextSeq, src.meta.ID, src.startSeq(&src.durable)
	src.mu.Unlock()
	if within != nil {
		start = within.From
	}
	if seq < start {
		return 0, 0, &TrimmedError{Seq: seq, StartSeq: start}
	}
	for {
		if seq > next || (seq == next && bytes > 0) {
			return 0, 0, fmt.Errorf("%w: fork offset is beyond the source's tail", ErrBadRequest)
		}
		if bytes == 0 {
			return seq, 0, nil
		}
		if within != nil && seq >= within.To {
			return 0, 0, errPastFork
		}
		recs, err := e.collect(ctx, src, id, ReadRequest{Seq: seq, MaxRecords: 1}, next, nil)
		if err != nil && within == nil {
			// A trim that a compaction applied meanwhile may have
			// deleted the records: the point is trimmed, as it would
			// have been for a create that came after it.
			src.mu.Lock()
			start := src.startSeq(&src.durable)
			src.mu.Unlock()
			if seq < start {
				return 0, 0, fmt.Errorf("%w (trimmed during the walk: %v)", &TrimmedError{Seq: asked, StartSeq: start}, err)
			}
		}
		if err != nil {
			return 0, 0, err
		}
		n := uint64(len(recs[0].Body))
		if bytes < n {
			return seq, bytes, nil
		}
		bytes -= n
		seq++
	}
}

// errPastFork ends a walk over a fork's records that would read past its
// point (resolveForkPointFrom).
var errPastFork = errors.New("the walk reached past the fork's point")

// sameForkPoint reports whether want, a fork point as a create asks for
// it, resolves to fork f's point. The walk over a sub-offset reads the
// source's records from f's start to its point, which f holds in the
// bucket however the source was trimmed since (or soft-deleted): a create
// repeated is judged as the first was. Refused below the source's retained start, a
// repeat whose sub-offset reached the end of its anchor's record (or past
// it) was 409 once the source was trimmed past the fork point. A read
// that failed is an error, not a different point: the repeat is then
// neither the same create nor a conflicting one.
func (e *Engine) sameForkPoint(ctx context.Context, f *forkRef, want *ForkFrom) (bool, error) {
	src, err := e.stream(ctx, f.SourceName)
	if errors.Is(err, ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	src.mu.Lock()
	same := !src.gone && src.meta.ID == f.SourceID
	src.mu.Unlock()
	if !same {
		return false, nil
	}
	seq, bytes, err := e.resolveForkPointFrom(ctx, src, want.Seq, want.Bytes, &seqSpan{From: f.Start, To: f.base()})
	var trimmed *TrimmedError
	switch {
	case errors.As(err, &trimmed), errors.Is(err, ErrBadRequest), errors.Is(err, ErrNotFound), errors.Is(err, ErrGone), errors.Is(err, errPastFork):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("resolve a fork point in %s: %w", f.SourceName, err)
	}
	return seq == f.Seq && bytes == f.Bytes, nil
}

// updateMeta rewrites the stream's metadata object with fn applied, by
// compare-and-swap. metaMu keeps it from racing compaction's checkpoints.
func (e *Engine) updateMeta(ctx context.Context, s *stream, fn func(*metaObject)) error {
	if err := e.confirmOwner(ctx); err != nil {
		return fmt.Errorf("%w: update metadata of %s: %v", ErrUnavailable, s.name, err)
	}
	if err := s.metaMu.LockContext(ctx); err != nil {
		return fmt.Errorf("%w: update metadata of %s: another write of it is under way: %v", ErrUnavailable, s.name, err)
	}
	defer s.metaMu.Unlock()
	s.mu.Lock()
	m, etag := *s.meta, s.etag
	s.mu.Unlock()
	fn(&m)
	tag, err := e.writeMeta(ctx, s, &m, etag)
	if err != nil {
		return fmt.Errorf("%w: update metadata of %s: %w", ErrUnavailable, s.name, storeCause(err))
	}
	s.mu.Lock()
	s.meta, s.etag = &m, tag
	s.notifyLocked()
	s.mu.Unlock()
	return nil
}

// deleteStream deletes s for clients: soft when forks still read it, hard
// otherwise, and then releases its own source. The caller holds its name
// lock.
//
// A write that found its stream expired deletes it first, within its
// answer-by time: cut short, the delete is left (in whatever part) to the
// next access, which finds the stream expired again or gone, and the
// write, which wrote nothing, fails with ErrTooLate.
func (e *Engine) deleteStream(ctx context.Context, s *stream) error {
	if _, ok := answerBy(ctx); !ok {
		return e.deleteStreamNow(ctx, s)
	}
	dctx, cancel := withAnswerByDeadline(ctx)
	defer cancel()
	err := e.deleteStreamNow(dctx, s)
	if err != nil && ctx.Err() == nil && !errors.Is(err, ErrGone) && !errors.Is(err, ErrNotFound) {
		if due := answerDue(ctx); due != nil {
			return fmt.Errorf("%w: delete %s, expired: %v", due, s.name, err)
		}
	}
	return err
}

// deleteStreamNow is deleteStream without the answer-by time.
func (e *Engine) deleteStreamNow(ctx context.Context, s *stream) error {
	s.mu.Lock()
	forks, deleted, fork, id := s.meta.Forks, s.meta.Deleted, s.meta.Fork, s.meta.ID
	s.mu.Unlock()
	if deleted {
		return ErrGone
	}
	if forks > 0 {
		// The settle marker goes first, so that a soft-deleted stream
		// always has one: a count no release will bring down is then
		// settled without anyone touching the stream. Should the
		// metadata write fail, the marker finds the stream live and
		// goes.
		now := time.Now()
		if err := e.armSettle(ctx, s.name, id, now.Add(e.config().GraveTime)); err != nil {
			return fmt.Errorf("%w: delete %s: %v", ErrUnavailable, s.name, err)
		}
		if err := e.updateMeta(ctx, s, func(m *metaObject) {
			m.Deleted, m.DeletedAt = true, now.UnixMilli()
		}); err != nil {
			return err
		}
		e.deleted(s.name, id)
		e.thinDeleted(s)
		return nil
	}
	if err := e.remove(ctx, s); err != nil {
		return err
	}
	e.deleted(s.name, id)
	if fork != nil {
		e.releaseSource(ctx, fork, id)
	}
	return nil
}

// releaseSource drops a fork's reference to its source; a soft-deleted
// source whose last fork went is removed, and so on up the chain. A step
// the bucket fails is tried again in the background until it succeeds or
// the engine closes: the fork is gone already, and nothing else would
// ever bring the count down, so the source, once deleted, would stay
// soft-deleted for good (410, its name taken, its data kept). Should the
// process end first, settleForks finds the fork gone. child is the
// fork's internal id.
func (e *Engine) releaseSource(ctx context.Context, f *forkRef, child string) {
	left, leftChild, err := e.releaseChain(ctx, f, child)
	if err == nil {
		return
	}
	e.log.Warn("releasing a fork's source failed; trying again in the background",
		zap.String("source", left.SourceName), zap.Error(err))
	// Should the process end before a retry lands, the sweep settles the
	// source grave_time from now, when the fork it still counts has been
	// listed long enough to be looked up. Best effort: a soft-deleted
	// source has its own marker too, only due later.
	if err := e.armSettle(context.WithoutCancel(ctx), left.SourceName, left.SourceID, time.Now().Add(e.config().GraveTime)); err != nil {
		e.log.Warn("marking a fork's source to be settled failed; its own marker settles it, later",
			zap.String("source", left.SourceName), zap.Error(err))
	}
	if !e.goBG(func() { e.retryRelease(left, leftChild) }) {
		e.log.Warn("a fork's source was not released before the engine closed; its data is kept",
			zap.String("source", left.SourceName))
	}
}

// releaseChain is releaseSource's work. On failure it returns the
// reference whose release failed, to be released again: a repeated
// release of a reference whose count went down but whose removal failed
// finds the count at zero and removes; one whose decrement may have landed
// unseen writes the same metadata again (its base is the count this
// process last knew, which the failed write did not change). child is
// the internal id of the fork f belongs to, and the one returned that of
// the fork the returned reference belongs to.
func (e *Engine) releaseChain(ctx context.Context, f *forkRef, child string) (*forkRef, string, error) {
	for f != nil {
		unlock := e.lockName(f.SourceName)
		src, err := e.stream(ctx, f.SourceName)
		if errors.Is(err, ErrNotFound) {
			unlock()
			return nil, "", nil
		}
		if err != nil {
			unlock()
			return f, child, err
		}
		src.mu.Lock()
		same := src.meta.ID == f.SourceID
		src.mu.Unlock()
		if !same {
			unlock()
			return nil, "", nil
		}
		listed := f.Listed
		err = e.updateMeta(ctx, src, func(m *metaObject) { m.releaseFork(child, listed) })
		if err != nil {
			unlock()
			return f, child, err
		}
		src.mu.Lock()
		last := src.meta.Deleted && src.meta.Forks == 0
		next, id := src.meta.Fork, src.meta.ID
		src.mu.Unlock()
		if !last {
			e.dropKeptTrims(ctx, src)
			e.thinDeleted(src)
			unlock()
			return nil, "", nil
		}
		err = e.remove(ctx, src)
		unlock()
		if err != nil && !errors.Is(err, ErrNotFound) { // not found: removed already
			return f, child, err
		}
		f, child = next, id
	}
	return nil, "", nil
}

// retryRelease releases f again, backing off, until it succeeds or the
// engine closes.
func (e *Engine) retryRelease(f *forkRef, child string) {
	wait := 250 * time.Millisecond
	for {
		select {
		case <-e.closing:
			e.log.Warn("a fork's source was not released before the engine closed; its data is kept",
				zap.String("source", f.SourceName))
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, 30*time.Second)
		left, leftChild, err := e.releaseChain(e.bgCtx, f, child)
		if err == nil {
			return
		}
		f, child = left, leftChild
	}
}

// dropKeptTrims has compaction visit a live stream a fork just let go of
// while it holds trimmed records that were kept for forks: compaction
// drops trimmed bytes only when it folds a stream, and an idle source
// would otherwise keep them in the bucket for as long as it lives. With
// forks left, the visit drops those only the released fork read, when
// every fork left says what it reads (metaObject.forkReads).
// The visit is asked for with a WAL entry that trims at the stream's own
// start, which changes nothing else (trims apply as a maximum) and leaves
// its TTL alone; it returns once the entry is durable, so the next
// compaction sees it. Best effort: should it fail, the bytes go at the
// stream's next fold, as before.
func (e *Engine) dropKeptTrims(ctx context.Context, s *stream) {
	w, err := e.writer()
	if err != nil {
		return
	}
	s.mu.Lock()
	start := s.pend.StartSeq
	_, thin := s.meta.forkReads()
	if s.gone || s.evicted || s.meta.Deleted || !thin || start <= s.meta.Cleaned {
		s.mu.Unlock()
		return
	}
	ent := &segment.Entry{StreamID: s.meta.ID, Name: s.name, FirstSeq: s.pend.NextSeq, TrimTo: start, Ref: s}
	b, err := w.Add(ent)
	if err != nil {
		s.mu.Unlock()
		err = e.addError(err)
	} else {
		s.joined(ent, b, false)
		s.mu.Unlock()
		err = e.awaitBatch(ctx, b)
	}
	if err != nil {
		e.log.Warn("asking for the trimmed records of a stream no fork reads to be dropped failed; "+
			"they go at its next compaction", zap.String("stream", s.name), zap.Error(err))
	}
}

// thinDeleted deletes the data objects and blobs of soft-deleted s that
// no fork left reads, when every fork says what it reads: a deleted
// stream's records past its forks' points, and those between them, used
// to stay for as long as its last fork lived, though no client could read
// them again. What its WAL still holds goes at the fold that writes it
// (compactStream thins to metaObject.thinTo). Nothing can widen what the
// forks read meanwhile: a deleted stream takes no new forks, and a
// release only narrows it, so a thin from an older view keeps more, never
// less. Best effort and in the background: a failure is logged and the
// next release, or the settle sweep, tries again.
func (e *Engine) thinDeleted(s *stream) {
	s.mu.Lock()
	due := !s.gone && !s.evicted && s.meta.Deleted && s.meta.Forks > 0 && s.meta.trimPending()
	s.mu.Unlock()
	if !due {
		return
	}
	e.goBG(func() {
		if err := e.thinDeletedNow(e.bgCtx, s); err != nil {
			e.log.Warn("deleting what no fork reads of a deleted stream failed; tried again at its next release or settle sweep",
				zap.String("stream", s.name), zap.Error(err))
		}
	})
}

// thinDeletedNow is thinDeleted's work. The deletes run without the
// stream's locks, as they may take long on a large stream and a fork's
// release waits on them; only the record of how far they went is written
// under them, and not when a release came meanwhile (Thinned went back
// to zero, and the release thins again for the forks left).
func (e *Engine) thinDeletedNow(ctx context.Context, s *stream) error {
	s.mu.Lock()
	m, stale := *s.meta, s.gone || s.evicted
	s.mu.Unlock()
	if stale || !m.Deleted || m.Forks == 0 || !m.trimPending() {
		return nil
	}
	from, to := max(m.Thinned, m.Cleaned), m.thinTo()
	reads, _ := m.forkReads()
	if err := e.confirmOwner(ctx); err != nil {
		return err
	}
	if err := e.thinBelow(ctx, m.ID, from, to, reads); err != nil {
		return err
	}
	// The name lock keeps s in memory while its metadata is written: a
	// handle that had left it would write behind the back of the one
	// loaded since, whose every later write would then fail.
	unlock := e.lockName(s.name)
	defer unlock()
	if err := s.metaMu.LockContext(ctx); err != nil {
		return err
	}
	defer s.metaMu.Unlock()
	s.mu.Lock()
	cur, etag := *s.meta, s.etag
	stale = s.gone || s.evicted
	s.mu.Unlock()
	if stale || cur.Forks != m.Forks || len(cur.ForkList) != len(m.ForkList) || cur.Thinned >= to {
		return nil
	}
	cur.Thinned, cur.Tail = to, nil
	tag, err := e.writeMeta(ctx, s, &cur, etag)
	if errors.Is(err, errMetaGone) {
		return nil // removed meanwhile: its last fork went
	}
	if err != nil {
		return fmt.Errorf("checkpoint %s: %w", s.name, err)
	}
	s.mu.Lock()
	s.meta, s.etag = &cur, tag
	s.mu.Unlock()
	return nil
}

// maxListedForks bounds a source's ForkList; forks made past it are
// counted only.
const maxListedForks = 1000

// forkCheckEvery is how often, at most, settleForks looks up the forks of
// one soft-deleted stream; a quarter of Config.GraveTime when that is
// shorter.
const forkCheckEvery = time.Minute

// settleForks settles the fork count of s, a soft-deleted stream, where a
// release may never come: a fork create whose metadata write failed
// unconfirmed and never landed, or a fork whose delete the process did
// not live to release. It looks up each listed fork listed longer than
// Config.GraveTime ago (a create's write can land until then); one that
// is gone, or whose name holds another stream, is counted no more. With
// no fork left, s is removed as its last release would have, and so is
// its own source in turn, and it reports true. It runs when s is
// touched or its expiry marker swept, never on a timer of its own, and
// is best effort: a fork it cannot look up keeps its count. A storage
// failure on the way is its error (ErrUnavailable), which a create of the
// name answers as such rather than as forks still reading the stream.
// Only listed forks are dropped, and only when gone, so a fork that
// exists never loses its source's records. The caller holds s's name
// lock.
func (e *Engine) settleForks(ctx context.Context, s *stream) (removed bool, err error) {
	now := time.Now()
	list, due, ok := e.forksToCheck(s, now)
	if !ok {
		return false, nil
	}
	s.forksChecked.Store(now.UnixMilli())
	defer func() {
		s.settleFailed.Store(err != nil)
		if err != nil {
			err = fmt.Errorf("%w: settle the forks of deleted stream %s: %w", ErrUnavailable, s.name, err)
		}
	}()
	var gone []string
	for _, f := range list {
		s.mu.Lock()
		_, seen := s.forksSeen[f.ID]
		s.mu.Unlock()
		if f.At > due || seen {
			continue
		}
		exists, err := e.forkExists(ctx, f)
		if err != nil {
			e.log.Warn("looking up a fork of a deleted stream failed; its count is kept",
				zap.String("stream", s.name), zap.String("fork", f.Name), zap.Error(err))
			return false, err
		}
		if !exists {
			gone = append(gone, f.ID)
			continue
		}
		s.mu.Lock()
		if s.forksSeen == nil {
			s.forksSeen = make(map[string]struct{})
		}
		s.forksSeen[f.ID] = struct{}{}
		s.mu.Unlock()
	}
	if len(gone) > 0 {
		if err := e.updateMeta(ctx, s, func(m *metaObject) {
			for _, id := range gone {
				m.releaseFork(id, true)
			}
		}); err != nil {
			e.log.Warn("dropping the gone forks of a deleted stream from its count failed",
				zap.String("stream", s.name), zap.Error(err))
			return false, err
		}
		e.log.Info("a deleted stream counts no more the forks that are gone",
			zap.String("stream", s.name), zap.Int("gone", len(gone)))
		e.thinDeleted(s)
	}
	// With no fork counted (now, or already: a last release whose
	// removal of s failed, and the process gone before a retry did it),
	// s goes as its last release would have had it.
	s.mu.Lock()
	last := s.meta.Deleted && s.meta.Forks == 0
	next, id := s.meta.Fork, s.meta.ID
	s.mu.Unlock()
	if !last {
		return false, nil
	}
	if err := e.remove(ctx, s); err != nil && !errors.Is(err, ErrNotFound) {
		e.log.Warn("removing a deleted stream no fork reads failed",
			zap.String("stream", s.name), zap.Error(err))
		return false, err
	}
	if next != nil {
		e.releaseSource(ctx, next, id)
	}
	return true, nil
}

// forksToCheck returns the forks soft-deleted s lists, and the listing
// time at or before which they are looked up, when settleForks has any
// to look up, or counts none: ok is false when s is live or gone, counts
// forks but lists none listed long enough and not found to exist
// already, or had its forks looked up less than forkCheckEvery ago. It is cheap, so that a read of the 410
// takes the name lock only when there is something to look up.
func (e *Engine) forksToCheck(s *stream, now time.Time) (list []forkEntry, due int64, ok bool) {
	grave := e.config().GraveTime
	every := min(forkCheckEvery, grave/4)
	if last := s.forksChecked.Load(); last != 0 && now.Sub(time.UnixMilli(last)) < every {
		return nil, 0, false
	}
	s.mu.Lock()
	if s.gone || s.evicted || !s.meta.Deleted {
		s.mu.Unlock()
		return nil, 0, false
	}
	due = now.Add(-grave).UnixMilli()
	list = s.meta.ForkList // never changed in place
	// A count at zero leaves nothing to look up, only s to remove.
	ok = s.meta.Forks == 0 || slices.ContainsFunc(list, func(f forkEntry) bool {
		_, seen := s.forksSeen[f.ID]
		return f.At <= due && !seen
	})
	s.mu.Unlock()
	return list, due, ok
}

// forkExists reports whether the fork f names exists: a stream under its
// name with its internal id, soft-deleted or not (a soft-deleted fork's
// own forks still read through it). The lookup waits on a create or
// delete of the name in progress.
func (e *Engine) forkExists(ctx context.Context, f forkEntry) (bool, error) {
	lctx, cancel := checkContext(ctx)
	defer cancel()
	c, err := e.stream(lctx, f.Name)
	if errors.Is(err, ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("look up fork %s: %w", f.Name, err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return !c.gone && c.meta.ID == f.ID, nil
}

// A soft-deleted stream has an expiry marker (keys.go) that the expiry
// sweep settles its fork count at (settleForks), so that a count no
// release will bring down is settled without anyone touching the stream.
// The soft delete writes it first, due grave_time later, when every fork
// the stream lists can be looked up; a release that fails writes one as
// well. The sweep that finds the stream still soft-deleted after settling
// it marks it again, at the next point of nextSettle's schedule, and the
// marker then goes; one that finds the stream gone, live, or another
// stream under its name only drops the marker. A marker only ever leads
// to settleForks, which drops only forks found gone, so a stale one
// (a soft delete that failed after writing it, a release that succeeded
// on a retry) costs a visit and nothing else.

// maxSettleEvery bounds the interval between two sweeps of a soft-deleted
// stream that forks still read.
const maxSettleEvery = 24 * time.Hour

// armSettle writes the marker that has the expiry sweep settle the fork
// count of stream name (internal id) at, should it be soft-deleted then.
// Only the lease's owner writes markers.
func (e *Engine) armSettle(ctx context.Context, name, id string, at time.Time) error {
	if err := e.checkLease(); err != nil {
		return fmt.Errorf("mark %s to be settled: %w", name, err)
	}
	if _, err := e.store.Put(ctx, expiryKey(at.UnixMilli(), name, id), nil, segment.PutOptions{}); err != nil {
		return fmt.Errorf("mark %s to be settled: %w", name, err)
	}
	return nil
}

// nextSettle is when a stream soft-deleted at deletedAt (ms; 0 when
// unknown) and still soft-deleted at now is settled next: the first point
// after now of deletedAt + k*step, where step starts at graveTime and
// doubles while the deletion is at least twice as old, up to
// maxSettleEvery. A stream that forks read for long is visited rarely,
// O(log) times in all up to the cap, and a day apart after it. The points
// depend on the stream alone, and those of a longer step are points of
// the shorter ones, so two markers of one stream (its soft delete's and a
// failed release's) come to the same key and become one.
func nextSettle(deletedAt, now int64, graveTime time.Duration) int64 {
	step := max(graveTime, time.Second).Milliseconds()
	age := now - deletedAt
	if age < 0 {
		age = 0
	}
	for step*2 <= age && step*2 <= maxSettleEvery.Milliseconds() {
		step *= 2
	}
	return deletedAt + (age/step+1)*step
}
