package streamstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/segment"
)

// Create creates the stream name, or confirms an identical existing one.
// Initial records are made durable under a fresh internal id first and the
// metadata object is written second, with if-none-match: a crash between
// the two leaves only records nothing references.
func (e *Engine) Create(ctx context.Context, name string, req CreateRequest) (Info, bool, error) {
	if err := ValidateName(name); err != nil {
		return Info{}, false, err
	}
	if err := validateNewName(name); err != nil {
		return Info{}, false, err
	}
	if req.Fork != nil {
		if err := ValidateName(req.Fork.Source); err != nil {
			return Info{}, false, err
		}
		if req.Fork.Source == name {
			return Info{}, false, fmt.Errorf("%w: a stream cannot fork itself", ErrBadRequest)
		}
	}
	if err := e.holding(); err != nil {
		return Info{}, false, err
	}
	unlock := e.lockName(name)
	defer unlock()
	// A name not in memory is most often a new stream: write its metadata
	// object if none exists, one request, instead of reading first to find
	// nothing. Only when the bucket has one (a create repeated, an expired
	// or soft-deleted stream) is it read and judged as below. A create
	// with records or a fork keeps the read first: it writes before its
	// metadata, and that must not happen for a name that is taken. So
	// does a create with an expiry, whose marker goes before its metadata
	// object: refused (or confirmed) over an evicted stream, it wrote a
	// marker and deleted it again.
	if req.Fork == nil && len(req.Records) == 0 && req.Expiry.IsZero() && !req.ConfirmOnly && !e.resident(name) {
		info, created, err := e.create(ctx, name, req, nil, "", false)
		if !errors.Is(err, errNameTaken) {
			return info, created, err
		}
	}
	s, err := e.settledStream(ctx, name)
	switch {
	case errors.Is(err, ErrNotFound):
	case err != nil:
		return Info{}, false, err
	default:
		s.mu.Lock()
		deleted, expired := s.meta.Deleted, s.expiredLocked(time.Now())
		if !deleted && !expired {
			// Judged on all but the point first: a conflict that any
			// point makes is one without reading the source.
			fork, otherwise := s.meta.Fork, !sameConfig(s, req, true)
			s.mu.Unlock()
			if otherwise {
				s.mu.Lock()
				defer s.mu.Unlock()
				return s.info(), false, ErrConflict
			}
			// A fork create repeated with its point spelt another way
			// resolves it in the source: reads, done without s.mu, which
			// commits of the fork's entries wait for. The name lock keeps
			// the fork as it is meanwhile.
			samePoint := false
			if f := req.Fork; f != nil && fork != nil && f.Source == fork.SourceName && (f.Seq != fork.Seq || f.Bytes != fork.Bytes) {
				if samePoint, err = e.sameForkPoint(ctx, fork, f); err != nil {
					return Info{}, false, fmt.Errorf("%w: %w", ErrUnavailable, err)
				}
			}
			s.mu.Lock()
			defer s.mu.Unlock()
			if !sameConfig(s, req, samePoint) {
				return s.info(), false, ErrConflict
			}
			if req.Exclusive {
				return s.info(), false, ErrExists // a refusal: no access
			}
			s.touched = time.Now().UnixMilli()
			return s.info(), false, nil
		}
		s.mu.Unlock()
		if req.ConfirmOnly {
			break // nothing to confirm, and nothing to settle for it
		}
		if deleted {
			// Removed when its count, settled, says no fork reads it.
			// After a look that failed on storage, a create looks again
			// at once, not a minute later: it must not be told meanwhile
			// that forks still read a stream that could not be settled.
			// (Reads keep the minute between looks: their 410 is true.)
			if s.settleFailed.Load() {
				s.forksChecked.Store(0)
			}
			removed, err := e.settleForks(ctx, s)
			if err != nil {
				return Info{}, false, err
			}
			if !removed {
				return Info{}, false, conflictf("a deleted stream that forks still read holds this name")
			}
			break
		}
		if err := e.deleteStream(ctx, s); err != nil {
			return Info{}, false, err
		}
		if s.meta.Deleted { // expired, but forks keep it
			return Info{}, false, conflictf("an expired stream that forks still read holds this name")
		}
	}
	if req.Fork != nil {
		if req.Fork.Existing {
			return Info{}, false, fmt.Errorf("%w: no fork to confirm", ErrNotFound)
		}
		return e.createFork(ctx, name, req)
	}
	if req.ConfirmOnly {
		return Info{}, false, fmt.Errorf("%w: no stream to confirm", ErrNotFound)
	}
	info, created, err := e.create(ctx, name, req, nil, "", true)
	if errors.Is(err, errNameTaken) {
		err = ErrConflict
	}
	return info, created, err
}

// settledStream looks name up for a create to judge, once no close of it
// is on its way: a create is compared with the stream's closure, and a
// close not yet durable may still roll back. Judged against it, a create
// with Stream-Closed was told the stream exists closed while it stayed
// open, and one without it was refused over a close that never happened.
// It waits as an append behind a pending close does, within the append
// timeout. The caller holds the name lock.
func (e *Engine) settledStream(ctx context.Context, name string) (*stream, error) {
	var timeout <-chan struct{} // set at the first wait
	for {
		s, err := e.stream(ctx, name)
		if err != nil {
			return nil, err
		}
		// Judged against a stream whose delete may have landed, a
		// create was told the deleted stream exists.
		if err := e.confirmDelete(ctx, s); err != nil {
			return nil, err
		}
		s.mu.Lock()
		if !s.pend.Closed || s.durable.Closed {
			s.mu.Unlock()
			return s, nil
		}
		ch := s.changedLocked()
		s.mu.Unlock()
		if timeout == nil {
			timeout = e.durabilityDeadline(ctx)
		}
		select {
		case <-ch:
		case <-timeout:
			// The create wrote nothing that could make or change a
			// stream: a retry is safe.
			if err := answerDue(ctx); err != nil {
				return nil, fmt.Errorf("%w: a close of %s is not settled yet", err, name)
			}
			return nil, fmt.Errorf("%w: a close of %s was not settled in time; the create wrote nothing", ErrUnavailable, name)
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-e.closing:
			return nil, ErrShuttingDown
		}
	}
}

// unwrittenError is a create's error from before it wrote anything that
// could make the stream exist (its metadata object, or a WAL entry a
// replay would complete it from): the stream certainly does not exist, and
// a fork's create gives its source's count back.
type unwrittenError struct{ err error }

func (u unwrittenError) Error() string { return u.err.Error() }
func (u unwrittenError) Unwrap() error { return u.err }

// errNameTaken says a create found a metadata object already there.
var errNameTaken = errors.New("a metadata object exists for the name")

// errLookAgain is what lookups that waited on a create are told when the
// create did not settle what the bucket holds for the name: they read it.
var errLookAgain = errors.New("look the name up again")

// resident reports whether name is in memory.
func (e *Engine) resident(name string) bool {
	e.mu.RLock()
	defer e.mu.RUnlock()
	_, ok := e.streams[name]
	return ok
}

// sameConfig reports whether an existing stream matches a create request:
// content type, expiry, closure, and for a fork its source and point.
// samePoint says the request's fork point, spelt otherwise than the fork's
// own, resolves to it (sameForkPoint). The caller holds s.mu.
func sameConfig(s *stream, req CreateRequest, samePoint bool) bool {
	m := s.meta
	if (req.Fork != nil) != (m.Fork != nil) || s.durable.Closed != req.Closed {
		return false
	}
	if req.Fork != nil {
		f := m.Fork
		if req.Fork.Source != f.SourceName || (req.Fork.Seq != f.Seq || req.Fork.Bytes != f.Bytes) && !samePoint {
			return false
		}
		// An omitted content type or expiry on a fork means "inherited":
		// the source's, which a fork's content type always is, and its
		// expiry only when the fork's create set none of its own.
		if req.ContentType == "" {
			req.ContentType = m.ContentType
		}
		if req.Expiry.IsZero() {
			req.Expiry = m.expiry()
			if f.SourceExpiry != nil {
				req.Expiry = f.SourceExpiry.expiry()
			}
		}
	}
	return sameMediaType(m.ContentType, req.ContentType) &&
		m.expiry().TTL == req.Expiry.TTL &&
		m.expiry().ExpiresAt.Equal(req.Expiry.ExpiresAt)
}

// create writes a new stream; fork, when set, makes it a fork whose own
// records start after the inherited range. id is its internal id, or ""
// for a new one (a fork's source lists it first). A metadata object
// already there makes it fail with errNameTaken. absent says a lookup
// found no stream under name, which is then what lookups waiting on a
// failed create see; without it they read the bucket.
func (e *Engine) create(ctx context.Context, name string, req CreateRequest, fork *forkRef, id string, absent bool) (Info, bool, error) {
	w, err := e.writer()
	if err != nil {
		return Info{}, false, unwrittenError{err}
	}
	if id == "" {
		id = newID()
	}
	now := time.Now()
	m := &metaObject{
		Version:     1,
		Name:        name,
		ID:          id,
		ContentType: req.ContentType,
		TTLSeconds:  int64(req.Expiry.TTL / time.Second),
		CreatedAt:   now.UnixMilli(),
		Fork:        fork,
	}
	if fork != nil {
		m.State.NextSeq = fork.base()
		m.State.StartSeq = 0
		m.State.LastTS = fork.lastTS
	}
	if !req.Expiry.ExpiresAt.IsZero() {
		m.ExpiresAt = req.Expiry.ExpiresAt.UnixMilli()
	}
	if len(req.Records) == 0 {
		m.State.Closed = req.Closed
	}
	m.Seeded = len(req.Records) > 0
	body := encodeMeta(m)
	publish, err := e.claimName(ctx, name)
	if err != nil {
		return Info{}, false, unwrittenError{err}
	}
	s := newStream(name, m, "")
	var created *stream
	// Lookups waiting on this create see the stream it made, or, if it
	// failed, what the bucket held before: nothing, when that is known.
	createErr := errLookAgain
	if absent {
		createErr = ErrNotFound
	}
	e.mu.Lock()
	e.creating[s] = struct{}{}
	e.mu.Unlock()
	handedOver := false // settleCreate publishes instead
	defer func() {
		if !handedOver {
			e.endCreate(s, publish, created, createErr)
		}
	}()
	// The expiry marker goes first: a crash after it leaves a marker the
	// sweep drops, but a stream without one would stay in the bucket until
	// someone read it.
	marker := ""
	if at := expiresAt(m, m.CreatedAt); at != 0 {
		marker = expiryKey(at, name, m.ID)
		// Within the answer-by time: a marker alone makes no stream,
		// so one cut short leaves the create unwritten.
		mctx, cancelMarker := withAnswerByDeadline(ctx)
		_, err := e.store.Put(mctx, marker, nil, segment.PutOptions{})
		cancelMarker()
		if err != nil {
			return Info{}, false, unwrittenError{fmt.Errorf("%w: write expiry marker of %s: %w", ErrUnavailable, name, storeCause(err))}
		}
	}
	if len(req.Records) > 0 {
		if err := answerDue(ctx); err != nil {
			return Info{}, false, unwrittenError{err}
		}
		// A fork's records go on from its source's last timestamp, as
		// every append's do (appendLocked).
		ts := max(now.UnixMilli(), m.State.LastTS+1)
		ent := &segment.Entry{
			StreamID:   m.ID,
			Name:       name,
			FirstSeq:   m.State.NextSeq,
			Records:    stamp(req.Records, m.State.NextSeq, ts),
			Closed:     req.Closed,
			AccessedAt: now.UnixMilli(),
			Create:     body,
			Ref:        s,
		}
		s.mu.Lock()
		b, err := w.Add(ent)
		if err != nil {
			s.mu.Unlock()
			return Info{}, false, unwrittenError{e.addError(err)}
		}
		s.joined(ent, b, false)
		s.mu.Unlock()
		if err := e.awaitBatch(ctx, b); err != nil {
			// The entry may commit all the same. Its caller, told it
			// failed, will create the name again, perhaps without
			// records; a replay must not complete this create then.
			e.abandonCreate(s)
			return Info{}, false, err
		}
	}
	// Within the caller's answer-by time: past it the outcome is unknown,
	// as for a PUT whose answer was lost, and handled below as one.
	putCtx, cancelPut := withAnswerByDeadline(ctx)
	defer cancelPut()
	etag, err := e.putNew(putCtx, name, body)
	if errors.Is(err, errRefusedUnread) && len(req.Records) == 0 {
		// Something holds the name, or a grave does, and which is not
		// known: this create wrote nothing (a marker alone makes no
		// stream). Told the name is taken, Create looks it up.
		createErr = errLookAgain
		e.dropMarker(ctx, name, marker)
		if !absent {
			return Info{}, false, errNameTaken
		}
		if due := answerDue(ctx); due != nil {
			return Info{}, false, unwrittenError{fmt.Errorf("%w: write metadata of %s: %v", due, name, err)}
		}
		return Info{}, false, unwrittenError{fmt.Errorf("%w: write metadata of %s: %v", ErrUnavailable, name, err)}
	}
	if err != nil && !errors.Is(err, segment.ErrPreconditionFailed) {
		// It may have landed all the same (a lost answer, a cancelled
		// request), and then the records are the stream's: ask.
		cur, tag, gerr := e.readMeta(ctx, name)
		switch {
		case gerr == nil && bytes.Equal(cur, body):
			etag, err = tag, nil
		case gerr == nil:
			err = segment.ErrPreconditionFailed // another create's
		case len(req.Records) > 0:
			// The records are durable in the WAL, and the metadata is
			// what makes them the stream's: the create rolls forward.
			// Giving up would not do, even when the bucket says the PUT
			// did not land: one still on its way could land later, and
			// the stream would then load without its records. So the
			// name stays claimed, and the cut held back, until the
			// metadata is written (by the late PUT or by settleCreate,
			// the same bytes either way) or another create's is found.
			handedOver = true
			// Lookups of the name stop waiting: storage may fail the
			// write for as long as it is down, and they answer so.
			e.markSettling(name)
			if !e.goBG(func() { e.settleCreate(s, body, publish) }) {
				// What settleCreate does when the engine closes.
				e.endCreate(s, publish, nil, errLookAgain)
			}
			return Info{}, false, fmt.Errorf("%w: %w: write metadata of %s: %w", ErrUnavailable, ErrUnconfirmed, name, storeCause(err))
		case errors.Is(gerr, segment.ErrNotFound):
			// It did not land: nothing was acknowledged. (Should it
			// land late, the stream is the empty one that was asked
			// for, and a create repeated finds it.)
		case segment.Permanent(err):
			// The storage answered the PUT, refusing it for good (as it
			// may refuse the read as well): nothing was written, though
			// what holds the name is not known.
			createErr = errLookAgain
		default:
			createErr = errLookAgain
			return Info{}, false, fmt.Errorf("%w: %w: write metadata of %s: %v", ErrUnavailable, ErrUnconfirmed, name, err)
		}
	}
	if err != nil {
		if errors.Is(err, segment.ErrPreconditionFailed) {
			createErr = errLookAgain
			var taken *nameTaken
			if errors.As(err, &taken) {
				// The stream that holds the name, read already: lookups,
				// the caller's included, need not read it again.
				if m, derr := decodeMeta(taken.data); derr == nil && m.Name == name {
					created, createErr = newStream(name, m, taken.etag), nil
				}
			}
			if len(req.Records) > 0 {
				// Should the name come free before the WAL is retired, a
				// replay would complete this create from its entry.
				if err := e.dropCreate(ctx, s); err != nil {
					return Info{}, false, fmt.Errorf("%w: %w: undo the create of %s that found the name taken: %v",
						ErrUnavailable, ErrUnconfirmed, name, err)
				}
			}
			// The name is taken: this create wrote nothing after all.
			e.dropMarker(ctx, name, marker)
			return Info{}, false, errNameTaken
		}
		return Info{}, false, fmt.Errorf("%w: write metadata of %s: %w", ErrUnavailable, name, storeCause(err))
	}
	s.mu.Lock()
	s.etag = etag
	info := s.info()
	s.mu.Unlock()
	created, createErr = s, nil
	return info, true, nil
}

// dropMarker removes the expiry marker of a create that wrote nothing
// else ("" for none). A caller that must be answered by a time of its own
// does not wait for it: it goes on in the background.
func (e *Engine) dropMarker(ctx context.Context, name, marker string) {
	if marker == "" {
		return
	}
	drop := func(ctx context.Context) {
		if err := e.store.Delete(ctx, []string{marker}); err != nil {
			e.log.Warn("removing the expiry marker of a create that wrote nothing else failed; a sweep removes it",
				zap.String("stream", name), zap.Error(err))
		}
	}
	if _, ok := answerBy(ctx); !ok {
		drop(ctx)
		return
	}
	if !e.goBG(func() {
		ctx, cancel := context.WithTimeout(e.bgCtx, metaCheckTimeout)
		defer cancel()
		drop(ctx)
	}) {
		e.log.Warn("the expiry marker of a create that wrote nothing else is kept: the engine is closing; a sweep removes it",
			zap.String("stream", name))
	}
}

// endCreate publishes a create's outcome to the lookups waiting on its
// name, and only then lets go of the stream: in neither set for a moment,
// a compaction would move its cut past the stream's WAL entries without
// checkpointing it, and retire them.
func (e *Engine) endCreate(s *stream, publish func(*stream, error), created *stream, err error) {
	publish(created, err)
	e.mu.Lock()
	delete(e.creating, s)
	e.mu.Unlock()
}

// settleCreate finishes a create with records whose metadata PUT failed:
// until the engine closes, it reads the metadata and, while it is absent,
// writes it (create-only). Ours found or written, the stream is published
// with its records; another create's found, lookups read the bucket.
func (e *Engine) settleCreate(s *stream, body []byte, publish func(*stream, error)) {
	wait := 250 * time.Millisecond
	for {
		select {
		case <-e.closing:
			e.endCreate(s, publish, nil, errLookAgain)
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, 30*time.Second)
		cur, tag, err := e.readMeta(e.bgCtx, s.name)
		if errors.Is(err, segment.ErrNotFound) {
			// Only while the storage is certainly ours: another node
			// replaying this WAL found no metadata for these records.
			if e.checkLease() != nil {
				continue
			}
			tag, err = e.putNew(e.bgCtx, s.name, body)
			if err != nil {
				continue // failed, or another PUT got there first: look again
			}
			cur = body
		}
		if err != nil {
			continue
		}
		if !bytes.Equal(cur, body) {
			if err := e.dropCreate(e.bgCtx, s); err != nil {
				e.log.Warn("undoing a create that found the name taken failed; a restart before its WAL is retired "+
					"would complete it should the name be free", zap.String("stream", s.name), zap.Error(err))
			}
			e.endCreate(s, publish, nil, errLookAgain)
			return
		}
		s.mu.Lock()
		s.etag = tag
		s.mu.Unlock()
		e.log.Info("a create reported unconfirmed is complete", zap.String("stream", s.name))
		e.endCreate(s, publish, s, nil)
		return
	}
}

// dropCreate writes a WAL entry that undoes s's create for a replay (see
// segment.Entry.Drop) and waits until it is durable.
func (e *Engine) dropCreate(ctx context.Context, s *stream) error {
	b, err := e.addDrop(s)
	if err != nil {
		return err
	}
	return e.awaitBatch(ctx, b)
}

// abandonCreate adds a drop of s's create to the WAL without waiting: it
// follows the create's entry there, so a replay drops the create if both
// commit (and if only the create does, its outcome stays what its caller
// was told: unknown).
func (e *Engine) abandonCreate(s *stream) {
	if _, err := e.addDrop(s); err != nil {
		e.log.Warn("undoing a create that failed unconfirmed failed; a restart may complete it",
			zap.String("stream", s.name), zap.Error(err))
	}
}

// addDrop adds a drop of s's create to the WAL writer.
func (e *Engine) addDrop(s *stream) (*segment.Batch, error) {
	w, err := e.writer()
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	ent := &segment.Entry{StreamID: s.meta.ID, Name: s.name, FirstSeq: s.pend.NextSeq, Drop: true, Ref: s}
	b, err := w.Add(ent)
	if err != nil {
		return nil, e.addError(err)
	}
	s.joined(ent, b, false)
	return b, nil
}

// stamp turns new records into records at seq first on, all with the
// timestamp ts.
func stamp(in []NewRecord, first uint64, ts int64) []segment.Record {
	out := make([]segment.Record, len(in))
	for i, r := range in {
		out[i] = segment.Record{Seq: first + uint64(i), Timestamp: ts, Headers: r.Headers, Body: r.Body}
	}
	return out
}

// storeCause is err, the failure of a store call, for an engine error to
// hold with %w: a refusal that needs the operator (segment.Permanent) as
// a *segment.RefusedError, for the answer to name it (StorageRefusal);
// any other error as text only, so that nothing in the store's chain
// passes for one of the engine's errors.
func storeCause(err error) error {
	var refused *segment.RefusedError
	switch {
	case errors.As(err, &refused):
		return err
	case segment.Permanent(err):
		return &segment.RefusedError{Cause: err}
	default:
		return errors.New(err.Error())
	}
}

// addError is the error of an entry the WAL writer would not take. A
// refusal of the storage's (segment.RefusedError) stays in the chain, for
// the answer to name it.
func (e *Engine) addError(err error) error {
	if errors.Is(err, segment.ErrWriterBusy) {
		e.stats.busy.Add(1)
		return fmt.Errorf("%w: %w", ErrUnavailable, ErrBusy)
	}
	if errors.Is(err, segment.ErrFenced) {
		return fmt.Errorf("%w: %w: %v", ErrUnavailable, ErrTakenOver, err)
	}
	var refused *segment.RefusedError
	if errors.As(err, &refused) {
		return fmt.Errorf("%w: %w", ErrUnavailable, refused)
	}
	return fmt.Errorf("%w: %v", ErrUnavailable, err)
}

// durabilityDeadline returns a channel closed when a wait for durability
// that starts now must end: after the append timeout, or sooner at the
// time WithAnswerBy put in ctx.
func (e *Engine) durabilityDeadline(ctx context.Context) <-chan struct{} {
	wait := e.config().AppendTimeout
	if by, ok := answerBy(ctx); ok {
		wait = min(wait, time.Until(by))
	}
	return e.deadlines.after(wait)
}

// answerBy is the time WithAnswerBy put in ctx, if any.
func answerBy(ctx context.Context) (time.Time, bool) {
	by, ok := ctx.Value(answerByKey{}).(time.Time)
	return by, ok && !by.IsZero()
}

// withAnswerByDeadline is ctx with a deadline at its answer-by time, if
// any, for a store call that must end by then.
func withAnswerByDeadline(ctx context.Context) (context.Context, context.CancelFunc) {
	if by, ok := answerBy(ctx); ok {
		return context.WithDeadline(ctx, by)
	}
	return ctx, func() {}
}

// answerDue returns ErrTooLate, with ErrUnavailable, when the time by which
// ctx's caller must be answered (WithAnswerBy) has passed. A write checks
// it just before handing an entry to the WAL: handed over then, it would
// be answered at once "not confirmed, may still be stored" and stored all
// the same, which a plain retry would store twice.
func answerDue(ctx context.Context) error { return pastAnswerBy(answerBy(ctx)) }

// pastAnswerBy is answerDue for a time answerBy already looked up: a
// caller that checks under a stream's lock looks it up before taking the
// lock, as the lookup walks the request's whole context chain.
func pastAnswerBy(by time.Time, ok bool) error {
	if ok && !time.Now().Before(by) {
		return fmt.Errorf("%w: %w", ErrUnavailable, ErrTooLate)
	}
	return nil
}

// awaitBatch waits for b's outcome, at most the append timeout (or until
// the caller's WithAnswerBy time). A timeout
// answers "unavailable" but leaves the entry in the writer: its fate is
// settled in order, and the stream's tail moves only when it is.
func (e *Engine) awaitBatch(ctx context.Context, b *segment.Batch) error {
	select {
	case <-b.Done():
		err := b.Err()
		switch {
		case err == nil:
			return nil
		case errors.Is(err, segment.ErrFenced):
			// Another process took the storage over, and sealed this
			// node's WAL where the batch was to go (or before it): no
			// replay will ever read it.
			return fmt.Errorf("%w: %w: %v", ErrUnavailable, ErrTakenOver, err)
		case !b.Lost():
			// Aborted with its upload's fate unknown (the writer closed
			// while the store was unreachable): a replay may still find
			// it, so a retry is not safe to call harmless.
			if errors.Is(err, segment.ErrClosedUnsettled) {
				return fmt.Errorf("%w: %w: %w: %v", ErrUnavailable, ErrUnconfirmed, ErrClosedUnconfirmed, err)
			}
			return fmt.Errorf("%w: %w: %v", ErrUnavailable, ErrUnconfirmed, err)
		default:
			return fmt.Errorf("%w: %v", ErrUnavailable, err)
		}
	case <-b.Stalled():
		// The storage refuses writes until the operator acts: waiting
		// for the timeout would change nothing. The entry stays in the
		// writer, settled in order, as at a timeout.
		return fmt.Errorf("%w: %w: %w", ErrUnavailable, ErrUnconfirmed, &segment.RefusedError{Cause: b.StallErr()})
	case <-e.durabilityDeadline(ctx):
		return fmt.Errorf("%w: %w", ErrUnavailable, ErrUnconfirmed)
	case <-ctx.Done():
		return ctx.Err()
	}
}

// live returns the stream if it exists for clients: ErrGone when it is
// soft-deleted. An expired stream is deleted on the spot.
func (e *Engine) live(ctx context.Context, name string) (*stream, error) {
	return e.liveLocked(ctx, name, false)
}

// liveLocked is live for a caller that may already hold name's lock.
func (e *Engine) liveLocked(ctx context.Context, name string, haveLock bool) (*stream, error) {
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	s, err := e.stream(ctx, name)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	expired := !s.gone && !s.meta.Deleted && s.expiredLocked(time.Now())
	gone, deleted, unsure := s.gone, s.meta.Deleted, s.deleteUnsure && !s.gone
	s.mu.Unlock()
	switch {
	case unsure:
		return e.settleDelete(ctx, name, haveLock)
	case expired:
		unlock := func() {}
		if !haveLock {
			unlock = e.lockName(name)
			s.mu.Lock()
			evicted := s.evicted
			s.mu.Unlock()
			if evicted {
				// Replaced while we waited for the lock: judge the
				// current handle.
				unlock()
				return e.liveLocked(ctx, name, haveLock)
			}
		}
		err := e.deleteStream(ctx, s)
		s.mu.Lock()
		kept := s.meta.Deleted && !s.gone
		s.mu.Unlock()
		unlock()
		if err != nil && !errors.Is(err, ErrNotFound) && !errors.Is(err, ErrGone) {
			return nil, err
		}
		if err == nil {
			e.stats.expired.Add(1)
		}
		if kept {
			// Forks still read it: soft-deleted, and answered as the
			// next access will find it.
			return nil, ErrGone
		}
		return nil, ErrNotFound
	case gone:
		return nil, ErrNotFound
	case deleted:
		// Forks still read it, or so its count says: a count whose
		// release never came is settled here, on touch.
		if _, _, ok := e.forksToCheck(s, time.Now()); !ok {
			return nil, ErrGone
		}
		unlock := func() {}
		if !haveLock {
			unlock = e.lockName(name)
		}
		// A failure to settle leaves it as it is: soft-deleted, 410.
		removed, _ := e.settleForks(ctx, s)
		unlock()
		if removed {
			return nil, ErrNotFound
		}
		return nil, ErrGone
	}
	return s, nil
}

// forget marks s deleted and drops it from memory, as a delete that
// landed does; waiters wake to find it gone.
func (e *Engine) forget(s *stream) {
	s.mu.Lock()
	s.gone = true
	s.notifyLocked()
	// No compaction folds a gone stream's WAL entries, which is what
	// takes them out of the cache otherwise (dropIdle keeps them for it):
	// they would hold it until pushed out.
	keys := runCacheKeys(s.runs)
	s.mu.Unlock()
	e.cache.remove(keys)
	e.mu.Lock()
	if e.streams[s.name] == s {
		delete(e.streams, s.name)
	}
	e.mu.Unlock()
}

// settleDelete reads from the bucket the fate of a delete of name whose
// grave may have landed unconfirmed, under the name lock: landed, the
// stream is deleted here too (its data goes with the gc tombstone the
// delete wrote first); not, it lives on and the lookup goes on.
func (e *Engine) settleDelete(ctx context.Context, name string, haveLock bool) (*stream, error) {
	if !haveLock {
		unlock := e.lockName(name)
		defer unlock()
	}
	s, err := e.stream(ctx, name)
	if err != nil {
		return nil, err
	}
	if err := e.confirmDelete(ctx, s); err != nil {
		return nil, err
	}
	return e.liveLocked(ctx, name, true)
}

// confirmDelete reads from the bucket whether a delete of s whose grave
// may have landed unconfirmed did land: ErrNotFound, with s dropped from
// memory, when it did; nil when it did not or none is in doubt. The
// caller holds the name lock.
func (e *Engine) confirmDelete(ctx context.Context, s *stream) error {
	s.mu.Lock()
	unsure, id := s.deleteUnsure && !s.gone, s.meta.ID
	s.mu.Unlock()
	if !unsure {
		return nil
	}
	rctx, cancel := checkContext(ctx)
	_, _, err := e.metaOf(rctx, s.name, id)
	cancel()
	switch {
	case errors.Is(err, errMetaGone):
		e.forget(s)
		return ErrNotFound
	case err != nil:
		return fmt.Errorf("%w: whether a delete of %s landed is not known yet: %v", ErrUnavailable, s.name, err)
	}
	s.mu.Lock()
	s.deleteUnsure = false
	s.mu.Unlock()
	return nil
}

// Append appends to the stream and returns once the append is durable.
func (e *Engine) Append(ctx context.Context, name string, req AppendRequest) (AppendResult, error) {
	var timeout <-chan struct{} // set at the first wait
	repeat := false             // a wait was for an entry that may hold this append
	waitMem := -1               // what the records hold in memory, once a wait needs it
	if err := e.holding(); err != nil {
		return AppendResult{}, err
	}
	for {
		s, err := e.live(ctx, name)
		if err != nil {
			return AppendResult{}, err
		}
		res, wait, err := e.appendTo(ctx, s, req)
		if errors.Is(err, errStale) {
			continue
		}
		if wait.ch == nil {
			return res, err
		}
		repeat = repeat || wait.repeat
		// While it waits, the append holds its records as one waiting in
		// the WAL does, so they count against max_pending, or any number
		// of appends queued behind a stalled large append held memory
		// that nothing counted. Given back before it tries again, so that
		// its own count never refuses it.
		if waitMem < 0 {
			waitMem = 0
			if len(req.Records) > 0 {
				waitMem = segment.RecordsMemSize(stamp(req.Records, 0, 0), 0)
			}
		}
		unreserve := func() {}
		if waitMem > 0 {
			w, err := e.writer()
			if err != nil {
				return AppendResult{}, err
			}
			if unreserve, err = w.Reserve(waitMem); err != nil {
				if repeat && errors.Is(err, segment.ErrWriterBusy) {
					// Refused, but the entry it would wait for may hold
					// this very append: not "nothing was applied".
					e.stats.busy.Add(1)
					return AppendResult{}, fmt.Errorf("%w: %w: %w", ErrUnavailable, ErrUnconfirmed, ErrBusy)
				}
				return AppendResult{}, e.addError(err)
			}
		}
		// A producer retry of an append still in flight, or any append
		// behind a close or a large append still in flight: answer once
		// the original's fate is known (it may roll back, and then this
		// one applies). Within the time an append of its own would wait:
		// a repeat is no more certain than the attempt it repeats.
		if timeout == nil {
			timeout = e.durabilityDeadline(ctx)
		}
		select {
		case <-wait.ch:
			unreserve()
		case <-timeout:
			unreserve()
			if repeat {
				// The entry waited for may hold this very append.
				return AppendResult{}, fmt.Errorf("%w: %w", ErrUnavailable, ErrUnconfirmed)
			}
			// Nothing of this append was handed to the WAL: a retry
			// is safe, with or without producer headers.
			if err := answerDue(ctx); err != nil {
				return AppendResult{}, fmt.Errorf("%w: the write ahead of it on %s was not settled yet", err, name)
			}
			return AppendResult{}, fmt.Errorf("%w: the write ahead of it on %s was not settled in time; nothing of this one was written", ErrUnavailable, name)
		case <-ctx.Done():
			unreserve()
			return AppendResult{}, ctx.Err()
		case <-e.closing:
			unreserve()
			return AppendResult{}, ErrShuttingDown
		}
	}
}

// appendWait is what an append that cannot be judged yet waits for before
// it tries again: ch fires once the entry ahead of it settles. repeat says
// that entry may hold this very append (a producer's retry of one still
// in flight); otherwise nothing of the append was written yet.
type appendWait struct {
	ch     <-chan struct{}
	repeat bool
}

// repeatsLocked reports whether an entry still in flight, which an append
// of req waits for, may hold req itself: a close while a close is on its
// way, or a producer's retry of an append not yet settled (the large
// append uploading, the close, or one the producer state counts). Called
// with s.mu held.
func (s *stream) repeatsLocked(req AppendRequest) bool {
	if req.Close && s.pend.Closed {
		return true
	}
	p := req.Producer
	if p == nil {
		return false
	}
	claim := segment.ProducerState{ID: p.ID, Epoch: p.Epoch, Seq: p.Seq}
	if u := s.uploadingBy; u != nil && *u == claim {
		return true
	}
	if cb := s.pend.ClosedBy; cb != nil && *cb == claim {
		return true
	}
	cur, known := s.pend.Producers.get(p.ID)
	return known && p.Epoch == cur.Epoch && p.Seq <= cur.Seq
}

// appendTo validates req against the pending state, in the protocol's
// precedence (closed, content type, producer, Stream-Seq, match), assigns
// seqs and joins the open WAL batch, all under the stream lock; then it
// waits for durability without the lock. A non-nil wait asks the caller to
// retry once it fires.
func (e *Engine) appendTo(ctx context.Context, s *stream, req AppendRequest) (AppendResult, appendWait, error) {
	w, err := e.writer()
	if err != nil {
		return AppendResult{}, appendWait{}, err
	}
	now := time.Now().UnixMilli()
	by, hasBy := answerBy(ctx)
	s.mu.Lock()
	if s.gone {
		s.mu.Unlock()
		return AppendResult{}, appendWait{}, ErrNotFound
	}
	if s.evicted {
		s.mu.Unlock()
		return AppendResult{}, appendWait{}, errStale
	}
	if ch := s.uploading; ch != nil {
		// A large append ahead of this one holds the next seq.
		repeat := s.repeatsLocked(req)
		s.mu.Unlock()
		return AppendResult{}, appendWait{ch: ch, repeat: repeat}, nil
	}
	if s.expiredLocked(time.UnixMilli(now)) {
		// Expired since live looked; live deletes it under the name lock.
		s.mu.Unlock()
		return AppendResult{}, appendWait{}, errStale
	}
	// The access is recorded (touchLocked) only where the append is
	// answered with success: a refused one is bad input, and changes
	// nothing, a sliding TTL's expiry included.
	st := &s.pend

	// Closure comes first, before producer fencing too (section 5.2.1):
	// on a closed stream only a retry of the closing append succeeds.
	if st.Closed && !s.durable.Closed {
		// The close is still on its way and may yet roll back: answer,
		// whether success for a repeated close or refusal for an append,
		// once its fate is known.
		ch := s.changedLocked()
		repeat := s.repeatsLocked(req)
		s.mu.Unlock()
		return AppendResult{}, appendWait{ch: ch, repeat: repeat}, nil
	}
	if st.Closed {
		next := st.NextSeq
		if p := req.Producer; p != nil {
			if cb := st.ClosedBy; cb != nil && cb.ID == p.ID && cb.Epoch == p.Epoch && cb.Seq == p.Seq {
				return e.duplicateLocked(s, p)
			}
			s.mu.Unlock()
			return AppendResult{}, appendWait{}, &ClosedError{NextSeq: next}
		}
		// A repeated close succeeds, but not one whose MatchSeq names
		// another tail: its condition does not hold, and the stream was
		// sealed somewhere it did not expect.
		closeOnly := len(req.Records) == 0 && req.Close && (req.MatchSeq == nil || *req.MatchSeq == next)
		if closeOnly {
			s.touchLocked(now)
		}
		s.mu.Unlock()
		if closeOnly {
			return AppendResult{FirstSeq: next, NextSeq: next, Closed: true, Duplicate: true}, appendWait{}, nil
		}
		return AppendResult{}, appendWait{}, &ClosedError{NextSeq: next}
	}
	// A content-type mismatch comes before the producer's checks (section
	// 5.2's order: closed, content type, sequence): a retry in another type
	// is no retry of what was stored, and a stale epoch sending the wrong
	// type is told the type first, as at the reference server.
	if req.ContentType != "" && len(req.Records) > 0 && !sameMediaType(req.ContentType, s.meta.ContentType) {
		err := &ContentTypeError{Sent: req.ContentType, Stream: s.meta.ContentType}
		s.mu.Unlock()
		return AppendResult{}, appendWait{}, err
	}
	if p := req.Producer; p != nil {
		cur, known := st.Producers.get(p.ID)
		if known && p.Epoch < cur.Epoch {
			// Fenced for certain only by an epoch the durable stream
			// holds, and that is the one the refusal names; an epoch
			// bump still on its way may roll back, so wait for it.
			if d, ok := s.durable.Producers.get(p.ID); ok && p.Epoch < d.Epoch {
				s.mu.Unlock()
				return AppendResult{}, appendWait{}, &FencedError{CurrentEpoch: d.Epoch}
			}
			ch := s.changedLocked()
			s.mu.Unlock()
			return AppendResult{}, appendWait{ch: ch}, nil
		}
		if known && p.Epoch == cur.Epoch && p.Seq <= cur.Seq {
			return e.duplicateLocked(s, p)
		}
	}
	if p := req.Producer; p != nil {
		cur, known := st.Producers.get(p.ID)
		var refusal error
		switch {
		case known && p.Epoch > cur.Epoch && p.Seq != 0:
			refusal = &EpochStartError{Received: p.Seq}
		case known && p.Epoch == cur.Epoch && p.Seq > cur.Seq+1:
			refusal = &SequenceGapError{Expected: cur.Seq + 1, Received: p.Seq}
		case !known && p.Seq != 0:
			refusal = &SequenceGapError{Expected: 0, Received: p.Seq}
		}
		if refusal != nil {
			// Judged against pending state, which the producer's
			// appends still on their way may yet roll back: then the
			// seq expected, even the kind of refusal, would be one no
			// read showed. Answer once they have settled.
			if s.producerUnsettledLocked(p.ID) {
				ch := s.changedLocked()
				s.mu.Unlock()
				return AppendResult{}, appendWait{ch: ch}, nil
			}
			s.mu.Unlock()
			return AppendResult{}, appendWait{}, refusal
		}
	}
	if req.StreamSeq != "" && st.StreamSeq != "" && req.StreamSeq <= st.StreamSeq {
		// As with MatchSeq below: a value that only appends still on
		// their way have passed waits for them, since they may roll
		// back; a refusal names the durable value, never a pending one.
		durable := s.durable.StreamSeq
		if durable == "" || req.StreamSeq > durable {
			ch := s.changedLocked()
			s.mu.Unlock()
			return AppendResult{}, appendWait{ch: ch}, nil
		}
		s.mu.Unlock()
		return AppendResult{}, appendWait{}, fmt.Errorf("%w: %q is not after %q", ErrStreamSeq, req.StreamSeq, durable)
	}
	if req.MatchSeq != nil && *req.MatchSeq != st.NextSeq {
		// Judged against the tail reads show, the durable one: appends
		// still on their way may roll back, and a refusal naming their
		// tail would name one that never was (and one a HEAD does not
		// show). A match the durable tail has passed, or beyond every
		// pending append, fails whatever becomes of them; one between
		// the two waits for them.
		durable := s.durable.NextSeq
		if m := *req.MatchSeq; m >= durable && m < st.NextSeq {
			ch := s.changedLocked()
			s.mu.Unlock()
			return AppendResult{}, appendWait{ch: ch}, nil
		}
		s.mu.Unlock()
		return AppendResult{}, appendWait{}, &MatchError{NextSeq: durable}
	}
	if err := pastAnswerBy(by, hasBy); err != nil {
		s.mu.Unlock()
		return AppendResult{}, appendWait{}, err
	}
	s.touchLocked(now) // not expired: checked above, under the same lock

	ts := max(now, st.LastTS+1)
	if recordBytes(req.Records) >= blobMinBytes {
		return e.appendBlob(ctx, w, s, req, now, ts)
	}
	if s.tailEnt != nil && len(req.Records) > 0 && !req.Close {
		if res, ok := e.foldLocked(w, s, req, now, ts); ok {
			b := s.tailBatch
			s.mu.Unlock()
			return res, appendWait{}, e.awaitBatch(ctx, b)
		}
	}
	ent := s.appendEntry(req, now, ts)
	b, err := w.Add(ent)
	if err != nil {
		s.mu.Unlock()
		return AppendResult{}, appendWait{}, e.addError(err)
	}
	s.joined(ent, b, !req.Close)
	res := appendResult(ent, req, ts, st.Closed)
	s.mu.Unlock()
	return res, appendWait{}, e.awaitBatch(ctx, b)
}

// appendEntry is the WAL entry of req at the stream's pending tail. Called
// with s.mu held.
func (s *stream) appendEntry(req AppendRequest, now, ts int64) *segment.Entry {
	st := &s.pend
	ent := &segment.Entry{
		StreamID:   s.meta.ID,
		Name:       s.name,
		FirstSeq:   st.NextSeq,
		Records:    stamp(req.Records, st.NextSeq, ts),
		Closed:     req.Close,
		StreamSeq:  req.StreamSeq,
		AccessedAt: now,
		Ref:        s,
	}
	if p := req.Producer; p != nil {
		ent.Producer = &segment.ProducerState{ID: p.ID, Epoch: p.Epoch, Seq: p.Seq}
	}
	return ent
}

// appendResult answers an append whose entry is ent.
func appendResult(ent *segment.Entry, req AppendRequest, ts int64, closed bool) AppendResult {
	res := AppendResult{FirstSeq: ent.FirstSeq, NextSeq: ent.EndSeq(), Timestamp: ts, Closed: closed}
	if p := req.Producer; p != nil {
		res.ProducerEpoch, res.ProducerSeq = p.Epoch, p.Seq
	}
	return res
}

// blobMinBytes is the size from which an append's records are written as
// a blob of their own rather than into a WAL object (see blobKey): such
// an append costs a PUT of its own either way, and its bytes then go to
// the bucket once instead of twice (WAL object, then data object).
const blobMinBytes = 256 << 10

func recordBytes(recs []NewRecord) int {
	n := 0
	for i := range recs {
		n += len(recs[i].Body)
	}
	return n
}

// appendBlob is appendTo's ending for a large append: its records are put
// as a blob first, then its entry, which only names the blob, joins the
// WAL. The seqs are held meanwhile: later appends of the stream wait for
// the blob (appendTo hands them s.uploading), so entries stay in seq
// order. A blob whose entry is not added is deleted, and so is one whose
// batch is lost (hooks.Aborted); one whose batch's fate stays unknown, or
// whose node crashes before the entry commits, stays until the stream is
// deleted. Called with s.mu held; it unlocks.
func (e *Engine) appendBlob(ctx context.Context, w *segment.Writer, s *stream, req AppendRequest, now, ts int64) (AppendResult, appendWait, error) {
	st := &s.pend
	ent := s.appendEntry(req, now, ts)
	// The blob's records wait for storage as an entry's would: they count
	// against max_pending until the blob is stored, by what they hold in
	// memory as the writer counts an entry's (segment.RecordsMemSize).
	// Counted by their bodies' bytes, an append of 30,000 nine-byte JSON
	// messages held 14 times what it was counted at.
	unreserve, err := w.Reserve(segment.RecordsMemSize(ent.Records, 0))
	if err != nil {
		s.mu.Unlock()
		return AppendResult{}, appendWait{}, e.addError(err)
	}
	done := make(chan struct{})
	s.uploading, s.uploadingBy = done, ent.Producer
	// Counted as in flight, so the stream is not evicted meanwhile.
	s.pending++
	s.mu.Unlock()

	ns, _ := w.Position()
	name := newBlobName(recordBytes(req.Records), ns)
	key := blobKey(ent.StreamID, name)
	// Bounded by the caller's answer-by time: nothing is acknowledged
	// until the entry joins the WAL, so a blob cut short is dropped
	// below and the write refused as unavailable, safe to retry.
	putCtx, cancelPut := withAnswerByDeadline(ctx)
	defer cancelPut()
	_, err = e.store.Put(putCtx, key, segment.EncodeData(ent.Records), segment.PutOptions{})
	unreserve()

	s.mu.Lock()
	s.uploading, s.uploadingBy = nil, nil
	close(done)
	s.pending--
	switch {
	case err != nil:
		err = fmt.Errorf("%w: put blob %s: %w", ErrUnavailable, key, storeCause(err))
	case s.gone:
		err = ErrNotFound
	case st.NextSeq != ent.FirstSeq:
		// An earlier entry of the stream was aborted meanwhile, and the
		// tail rolled back: these seqs are no longer next.
		err = fmt.Errorf("%w: stream %s rolled back to %d during a blob upload for %d", ErrUnavailable, s.name, st.NextSeq, ent.FirstSeq)
	}
	if err == nil {
		// The upload may have taken the time left to answer.
		err = answerDue(ctx)
	}
	var b *segment.Batch
	if err == nil {
		ent.Blob = name
		if b, err = w.Add(ent); err != nil {
			err = e.addError(err)
		}
	}
	if err != nil {
		if s.pending == 0 {
			s.pend = s.durable
		}
		s.mu.Unlock()
		e.dropBlob(key)
		return AppendResult{}, appendWait{}, err
	}
	s.joined(ent, b, false)
	res := appendResult(ent, req, ts, st.Closed)
	s.mu.Unlock()
	return res, appendWait{}, e.awaitBatch(ctx, b)
}

// dropBlob deletes a blob no entry refers to. It may not exist (a failed
// PUT); a failure to delete leaves it to the next compaction (strayBlobs).
func (e *Engine) dropBlob(key string) { e.dropBlobs([]string{key}) }

// dropBlobs is dropBlob for several blobs, in one request.
func (e *Engine) dropBlobs(keys []string) {
	ctx, cancel := context.WithTimeout(e.bgCtx, 30*time.Second)
	defer cancel()
	if err := e.store.Delete(ctx, keys); err != nil {
		kept := e.strays.add(keys)
		e.log.Warn("could not delete unused blobs; compaction tries again", zap.Strings("keys", keys),
			zap.Int("kept_for_retry", kept), zap.Error(err))
	}
}

// foldLocked appends req's records to the stream's latest entry while its
// batch is still open, instead of adding an entry: one hot stream then
// costs one WAL entry per batch (one cache block, one run to compact), not
// one per append. An entry carries one producer's state, so appends of
// two producers are not folded together. It reports false when the fold
// is not possible; the caller adds an entry as usual.
func (e *Engine) foldLocked(w *segment.Writer, s *stream, req AppendRequest, now, ts int64) (AppendResult, bool) {
	ent, st := s.tailEnt, &s.pend
	var prod *segment.ProducerState
	if p := req.Producer; p != nil {
		prod = &segment.ProducerState{ID: p.ID, Epoch: p.Epoch, Seq: p.Seq}
	}
	if ent.EndSeq() != st.NextSeq || (prod != nil && ent.Producer != nil && ent.Producer.ID != prod.ID) {
		return AppendResult{}, false
	}
	add := &segment.Entry{FirstSeq: st.NextSeq, Records: stamp(req.Records, st.NextSeq, ts),
		Producer: prod, StreamSeq: req.StreamSeq, AccessedAt: now}
	folded := w.Extend(s.tailBatch, func() (size, mem int) {
		// The writer bounds what waits by memory (max_pending), encoded
		// bytes only bound the batch's object.
		mem = segment.RecordsMemSize(add.Records, 0)
		for i := range add.Records {
			size += segment.RecordSize(&add.Records[i])
		}
		fields := 0
		if prod != nil {
			if ent.Producer == nil {
				fields += 20 + len(prod.ID)
			}
			ent.Producer = prod
		}
		if add.StreamSeq != "" {
			fields += len(add.StreamSeq) - len(ent.StreamSeq)
			ent.StreamSeq = add.StreamSeq
		}
		ent.Records = append(ent.Records, add.Records...)
		ent.AccessedAt = now
		ent.Merged++
		return size + fields, mem + fields
	})
	if !folded {
		return AppendResult{}, false
	}
	st.apply(changeOf(add))
	return appendResult(add, req, ts, st.Closed), true
}

// duplicateLocked answers a producer retry of an accepted append. It is
// acknowledged only once durable; while the original is in flight the
// caller waits and retries. It unlocks s.
func (e *Engine) duplicateLocked(s *stream, p *Producer) (AppendResult, appendWait, error) {
	d, known := s.durable.Producers.get(p.ID)
	durable := known && (d.Epoch > p.Epoch || (d.Epoch == p.Epoch && d.Seq >= p.Seq))
	if cb := s.durable.ClosedBy; cb != nil && *cb == (segment.ProducerState{ID: p.ID, Epoch: p.Epoch, Seq: p.Seq}) {
		durable = true
	}
	if !durable {
		ch := s.changedLocked()
		s.mu.Unlock()
		return AppendResult{}, appendWait{ch: ch, repeat: true}, nil
	}
	// A duplicate is answered with success: the producer's retry is an
	// access like the append it repeats.
	s.touchLocked(time.Now().UnixMilli())
	res := AppendResult{
		FirstSeq:      s.durable.NextSeq,
		NextSeq:       s.durable.NextSeq,
		Closed:        s.durable.Closed,
		Duplicate:     true,
		ProducerEpoch: d.Epoch,
		ProducerSeq:   d.Seq,
	}
	s.mu.Unlock()
	return res, appendWait{}, nil
}

// producerUnsettledLocked reports whether appends still on their way carry
// producer id, so that its pending state is not yet its durable one.
// Called with s.mu held.
func (s *stream) producerUnsettledLocked(id string) bool {
	p, known := s.pend.Producers.get(id)
	d, durable := s.durable.Producers.get(id)
	return known != durable || p != d
}

// errStale: the handle was evicted while the request held it; look the
// stream up again.
var errStale = errors.New("stale stream handle")

// sameMediaType compares the media types of two Content-Type values,
// ignoring case, spacing and parameters.
func sameMediaType(a, b string) bool {
	return mediaType(a) == mediaType(b)
}

func mediaType(ct string) string {
	if i := strings.IndexByte(ct, ';'); i >= 0 {
		ct = ct[:i]
	}
	return strings.ToLower(strings.TrimSpace(ct))
}

// Head returns the stream's state without renewing its TTL.
func (e *Engine) Head(ctx context.Context, name string) (Info, error) {
	if err := e.holding(); err != nil {
		return Info{}, err
	}
	s, err := e.live(ctx, name)
	if err != nil {
		return Info{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.info(), nil
}

// Wait blocks until the stream identified by name and id has a durable record
// at seq (NextSeq > seq), is closed, or is deleted or recreated. It returns the
// stream's state then, ErrNotFound when it was deleted or recreated, ErrGone
// when it was soft-deleted (as every later request is answered), ctx.Err()
// when ctx ends first, ErrShuttingDown when the engine closes, or
// ErrTakenOver (with ErrUnavailable) once another process took the storage
// over, whose changes this one never sees. When ctx ends on a node whose
// lease lapsed meanwhile, the error is ErrUnavailable, not ctx.Err().
func (e *Engine) Wait(ctx context.Context, name, id string, seq uint64) (Info, error) {
	s, err := e.live(ctx, name)
	if err != nil {
		return Info{}, err
	}
	for {
		if err := e.holding(); err != nil {
			return Info{}, err
		}
		s.mu.Lock()
		if s.evicted {
			// Dropped from memory between two waits: look it up again.
			s.mu.Unlock()
			if s, err = e.live(ctx, name); err != nil {
				return Info{}, err
			}
			continue
		}
		if s.gone || s.meta.ID != id {
			s.mu.Unlock()
			return Info{}, ErrNotFound
		}
		if s.meta.Deleted {
			// Soft-deleted while waiting (forks still read it): no record
			// can come, and a waiter that went on would tell its client
			// to poll again a stream that answers 410.
			s.mu.Unlock()
			return Info{}, fmt.Errorf("%w: stream %s was deleted", ErrGone, name)
		}
		if s.durable.NextSeq > seq || s.durable.Closed {
			info := s.info()
			s.mu.Unlock()
			return info, nil
		}
		ch := s.changedLocked()
		// A waiter is a reader all the while it waits, and reads renew a
		// sliding TTL: one shorter than the wait (a long-poll, an SSE
		// feed's minute) would otherwise expire the stream under it. The
		// renewal comes halfway through the TTL, as a reader polling at
		// that pace would make it. A stream with a deadline (Expires-At)
		// is looked at again when it passes: a waiter must not go on
		// reading a stream that every other request finds gone.
		var wake int64 // unix milliseconds; 0: only a change wakes it
		if ttl := s.meta.TTLSeconds * 1000; ttl > 0 {
			wake = max(s.touched, s.durable.AccessedAt) + ttl/2
		}
		if at := s.meta.ExpiresAt; at != 0 && (wake == 0 || at < wake) {
			wake = at + 1 // expired once now >= at
		}
		var renewal *time.Timer
		var renewC <-chan time.Time
		if wake != 0 {
			renewal = time.NewTimer(max(time.Duration(wake-time.Now().UnixMilli())*time.Millisecond, 0))
			renewC = renewal.C
		}
		s.waiters.Add(1)
		s.mu.Unlock()
		renew := false
		select {
		case <-ch:
		case <-renewC:
			renew = true
		case <-ctx.Done():
			err = ctx.Err()
			// Nothing wakes a waiter when the lease lapses: one that ends
			// now on a node that cannot vouch for the storage says so,
			// rather than "nothing new" while another node may have
			// written since.
			if herr := e.holding(); herr != nil {
				err = herr
			}
		case <-e.closing:
			err = ErrShuttingDown
		case <-e.fencedC:
			err = e.takenOver()
		}
		if renewal != nil {
			renewal.Stop()
		}
		s.waiters.Add(-1)
		if renew {
			s.mu.Lock()
			alive := s.gone || s.touchLocked(time.Now().UnixMilli())
			s.mu.Unlock()
			if !alive {
				// Its deadline came (or the renewal came too late): the
				// stream expired, and is deleted as any access would
				// delete it.
				if _, err := e.live(ctx, name); err != nil {
					return Info{}, err
				}
				return Info{}, ErrNotFound
			}
			e.renew(s) // nothing when gone
			continue
		}
		if err != nil {
			return Info{}, err
		}
	}
}

// Delete removes the stream; its data leaves the bucket in the background.
// A stream that forks still read is soft-deleted instead: ErrGone to
// clients until its last fork goes.
func (e *Engine) Delete(ctx context.Context, name string) error {
	// The handle is looked up under the lock, which keeps it in memory:
	// one looked up before could be evicted and replaced while the delete
	// waited, and deleting through it would leave the new one live.
	if err := e.holding(); err != nil {
		return err
	}
	unlock := e.lockName(name)
	defer unlock()
	s, err := e.liveLocked(ctx, name, true)
	if err != nil {
		return err
	}
	return e.deleteStream(ctx, s)
}

// remove deletes a stream: a gc tombstone for its id first (so its data
// objects are collected even after a crash), then the metadata object. The
// caller holds the name lock.
func (e *Engine) remove(ctx context.Context, s *stream) error {
	s.mu.Lock()
	if s.gone {
		s.mu.Unlock()
		return ErrNotFound
	}
	id, name, seeded := s.meta.ID, s.name, s.meta.Seeded
	// A stream with a deadline and no TTL has its expiry marker where its
	// create put it, at the deadline, which may be years away: the sweep
	// would only drop it then.
	var markers []string
	if s.meta.ExpiresAt != 0 && s.meta.TTLSeconds == 0 {
		markers = append(markers, expiryKey(s.meta.ExpiresAt, name, id))
	}
	// A soft-deleted stream's settle marker is due at the next point of
	// its schedule (forks.go), a day away at most: gone with the stream,
	// it costs the sweep no visit. One it misses (a sweep behind, a
	// failed release's) the sweep drops when due.
	if s.meta.Deleted && s.meta.DeletedAt != 0 {
		next := nextSettle(s.meta.DeletedAt, time.Now().UnixMilli(), e.config().GraveTime)
		markers = append(markers, expiryKey(next, name, id))
	}
	s.mu.Unlock()
	if err := e.confirmOwner(ctx); err != nil {
		return fmt.Errorf("%w: delete %s: %v", ErrUnavailable, name, err)
	}
	publish, err := e.claimName(ctx, name)
	if err != nil {
		return err
	}
	removed := false
	defer func() {
		if removed {
			publish(nil, ErrNotFound)
		} else {
			publish(nil, fmt.Errorf("%w: deleting %s failed", ErrUnavailable, name))
		}
	}()
	if _, err := e.store.Put(ctx, gcKey(id), []byte(name), segment.PutOptions{}); err != nil {
		return fmt.Errorf("%w: record deletion of %s: %w", ErrUnavailable, name, storeCause(err))
	}
	if seeded {
		// Before the metadata goes: a replay that met the create's entry
		// without its metadata would otherwise write it back.
		if err := e.dropCreate(ctx, s); err != nil {
			return fmt.Errorf("delete %s: %w", name, err)
		}
	}
	if err := e.deleteMeta(ctx, s, id); err != nil {
		if errors.Is(err, segment.ErrUnknownOutcome) {
			// The grave may be in the bucket: the stream may be deleted,
			// whatever this answer says, and the next lookup reads which.
			s.mu.Lock()
			s.deleteUnsure = true
			s.mu.Unlock()
			return fmt.Errorf("%w: %w: delete metadata of %s: %w", ErrUnavailable, ErrUnconfirmed, name, storeCause(err))
		}
		// The tombstone stays behind, and the collector drops it without
		// the data, as the metadata still names the id (collectGarbage).
		return fmt.Errorf("%w: delete metadata of %s: %w", ErrUnavailable, name, storeCause(err))
	}
	e.forget(s)
	removed = true
	e.kickGC()
	if len(markers) > 0 {
		if err := e.store.Delete(ctx, markers); err != nil {
			e.log.Warn("removing a deleted stream's expiry marker failed; the sweep drops it when it is due",
				zap.String("stream", name), zap.Error(err))
		}
	}
	return nil
}

// Trim drops the records below seq for good: reads below it answer
// ErrGone at once, and the bytes leave the bucket at the next compaction.
// The trim is a WAL entry, durable before Trim returns.
func (e *Engine) Trim(ctx context.Context, name string, seq uint64) (Info, error) {
	if err := e.holding(); err != nil {
		return Info{}, err
	}
	s, err := e.live(ctx, name)
	if err != nil {
		return Info{}, err
	}
	w, err := e.writer()
	if err != nil {
		return Info{}, err
	}
	s.mu.Lock()
	if s.gone {
		s.mu.Unlock()
		return Info{}, ErrNotFound
	}
	now := time.Now().UnixMilli()
	if s.evicted || s.expiredLocked(time.UnixMilli(now)) {
		// Replaced, or expired since live looked: look again.
		s.mu.Unlock()
		return e.Trim(ctx, name, seq)
	}
	if seq > s.pend.NextSeq {
		// Beyond every pending append, so refused whatever becomes of
		// them; the tail named is the one reads show. Bad input: no
		// access either.
		next := s.durable.NextSeq
		s.mu.Unlock()
		return Info{}, fmt.Errorf("%w: trim seq %d is beyond the tail %d", ErrBadRequest, seq, next)
	}
	s.touchLocked(now)
	if seq <= s.startSeq(&s.durable) {
		info := s.info()
		s.mu.Unlock()
		return info, nil
	}
	// A trim still on its way may cover seq (this one's first attempt,
	// not confirmed in time), but it can yet be rolled back: trim again in
	// an entry of this call's own, which is durable only once that one is.
	// Trims apply as a maximum, so the second changes nothing else.
	if err := answerDue(ctx); err != nil {
		s.mu.Unlock()
		return Info{}, err
	}
	ent := &segment.Entry{StreamID: s.meta.ID, Name: s.name, FirstSeq: s.pend.NextSeq, TrimTo: seq, AccessedAt: now, Ref: s}
	b, err := w.Add(ent)
	if err != nil {
		s.mu.Unlock()
		return Info{}, e.addError(err)
	}
	s.joined(ent, b, false)
	s.mu.Unlock()
	if err := e.awaitBatch(ctx, b); err != nil {
		return Info{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.info(), nil
}

// List returns up to limit streams whose names start with prefix and sort
// after startAfter, in name order, and whether more follow. A stream not
// in memory costs a GET of its metadata object.
//
// Expired and soft-deleted streams are left out, so one listing of
// metadata keys may yield fewer streams than it listed: List then lists on
// from the last key, at most listRounds listings, and further only while
// it has found none, so that a page is never empty while more follow (a
// client continues after the last name it got, and an empty page gives it
// none).
func (e *Engine) List(ctx context.Context, prefix, startAfter string, limit int) ([]Info, bool, error) {
	return e.ListMatching(ctx, prefix, startAfter, limit, nil)
}

// ListMatching is List of the streams whose names match also reports
// true for (all, when match is nil). The names are judged before any
// stream is looked up, so a listing that few names match costs the
// metadata listings and the GETs of those few, not one per stream.
func (e *Engine) ListMatching(ctx context.Context, prefix, startAfter string, limit int, match func(name string) bool) ([]Info, bool, error) {
	if _, err := e.writer(); err != nil {
		return nil, false, err
	}
	if err := e.holding(); err != nil {
		return nil, false, err
	}
	if limit <= 0 || limit > 1000 {
		limit = 1000
	}
	if len(prefix) > MaxNameLength {
		// No name is that long, so none starts with it. Its key would
		// go to the store all the same, where the local directory
		// refuses paths that long: an error a retry never mends.
		return nil, false, nil
	}
	after := ""
	if startAfter != "" {
		after = metaKey(startAfter)
	}
	var out []Info
	batch := limit
	for round := 1; ; round++ {
		infos, last, more, err := e.listOnce(ctx, prefix, after, batch, match)
		if err != nil {
			return nil, false, err
		}
		if n := limit - len(out); len(infos) > n {
			// A listing grown past what was asked for found more.
			return append(out, infos[:n]...), true, nil
		}
		out = append(out, infos...)
		if last == "" {
			return out, false, nil // nothing listed: nothing to continue from
		}
		if !more || len(out) >= limit || (len(out) > 0 && round >= listRounds) {
			return out, more, nil
		}
		after = last
		if len(infos) == 0 {
			// Nothing in this listing, where deleted streams' graves
			// (kept for grave_time) or names match passes over lie:
			// the next lists twice as many, so that a page behind many
			// of them (a page of one, say, or the probe behind a full
			// page) costs a few LISTs, not one per key, and at most
			// about twice the GETs of the keys it passes over.
			batch = min(2*batch, 1000)
		} else {
			batch = limit - len(out)
		}
	}
}

// listRounds bounds the metadata listings one List makes once it has found
// a stream to return.
const listRounds = 4

// listOnce is one listing of up to limit metadata keys after the key
// after: the live streams among them that match (nil: all), the last key
// listed (to continue from), and whether the store has more.
func (e *Engine) listOnce(ctx context.Context, prefix, after string, limit int, match func(string) bool) ([]Info, string, bool, error) {
	objs, more, err := e.store.List(ctx, metaListPrefix(prefix), after, limit)
	if err != nil {
		return nil, "", false, fmt.Errorf("%w: list streams: %v", ErrUnavailable, err)
	}
	last := ""
	if len(objs) > 0 {
		last = objs[len(objs)-1].Key
	}
	infos := make([]Info, len(objs))
	keep := make([]bool, len(objs))
	sem := make(chan struct{}, 16)
	var wg sync.WaitGroup
	var errMu sync.Mutex
	var firstErr error
	for i, o := range objs {
		name, err := nameFromMetaKey(o.Key)
		if err != nil || !strings.HasPrefix(name, prefix) || match != nil && !match(name) {
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			s, err := e.stream(ctx, name)
			if errors.Is(err, ErrNotFound) {
				return // deleted since the listing
			}
			if err != nil {
				errMu.Lock()
				firstErr = err
				errMu.Unlock()
				return
			}
			s.mu.Lock()
			if !s.gone && !s.meta.Deleted && !s.expiredLocked(time.Now()) {
				infos[i], keep[i] = s.info(), true
			}
			s.mu.Unlock()
		}()
	}
	wg.Wait()
	if firstErr != nil {
		return nil, "", false, firstErr
	}
	out := infos[:0]
	for i := range infos {
		if keep[i] {
			out = append(out, infos[i])
		}
	}
	return out, last, more, nil
}
