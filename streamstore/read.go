package streamstore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/picomq/caddy-picomq/segment"
)

// Read returns records from req.Seq, bounded by the durable tail. It renews a
// sliding TTL, unless it refuses the position or req.Judge refuses the
// read: a refused read is no access, and writes no renewal. Once another process took the storage over it
// answers ErrTakenOver (with ErrUnavailable), and while its lease could
// not be renewed in time, ErrUnavailable (holding).
func (e *Engine) Read(ctx context.Context, name string, req ReadRequest) (ReadResult, error) {
	if err := e.holding(); err != nil {
		return ReadResult{}, err
	}
	s, err := e.live(ctx, name)
	if err != nil {
		return ReadResult{}, err
	}
	s.mu.Lock()
	now := time.Now()
	if s.expiredLocked(now) {
		// Expired since live looked: this time live deletes it.
		s.mu.Unlock()
		return e.Read(ctx, name, req)
	}
	info := s.info()
	if err := readPosition(req, info); err != nil {
		s.mu.Unlock()
		return ReadResult{}, err
	}
	s.mu.Unlock()

	res := ReadResult{Info: info, NextSeq: info.NextSeq, UpToDate: true}
	if req.Tail || req.Seq == info.NextSeq {
		return e.served(ctx, s, req, res)
	}
	if by, ok := answerBy(ctx); ok && !req.Until.IsZero() && by.Before(req.Until) {
		req.Until = by
	}
	// Most reads are at the tail, from the cache: no buffer to hold, and
	// no allocation for holding none.
	var bufs []*objBuf
	res.Records, err = e.collect(ctx, s, info.ID, req, info.NextSeq, &bufs)
	if len(bufs) > 0 {
		res.held = &holds{bufs: bufs}
	}
	if err != nil {
		res.held.release()
		// A trim that a compaction applied while the records were being
		// fetched removed them: they are gone, as for a read that came
		// after it, not lost by the bucket.
		s.mu.Lock()
		start, deleted := s.startSeq(&s.durable), s.meta.Deleted
		s.mu.Unlock()
		if deleted {
			// Deleted while its records were being fetched, which may
			// have removed those no fork reads.
			return ReadResult{}, fmt.Errorf("%w (deleted during the read: %v)", ErrGone, err)
		}
		if req.Seq < start {
			return ReadResult{}, fmt.Errorf("%w (trimmed during the read: %v)", &TrimmedError{Seq: req.Seq, StartSeq: start}, err)
		}
		return ReadResult{}, err
	}
	res.NextSeq = req.Seq + uint64(len(res.Records))
	res.UpToDate = res.NextSeq == info.NextSeq
	return e.served(ctx, s, req, res)
}

// served hands res to req's Judge, if any, and counts the read as an
// access once it is accepted: the stream's last access moves on, and a
// sliding TTL's renewal is persisted when due.
func (e *Engine) served(ctx context.Context, s *stream, req ReadRequest, res ReadResult) (ReadResult, error) {
	if req.Judge != nil {
		if err := req.Judge(res.Info, res.Records); err != nil {
			res.Release()
			return ReadResult{}, err
		}
	}
	now := time.Now().UnixMilli()
	s.mu.Lock()
	s.touchLocked(now) // one that expired meanwhile stays expired
	sliding, evicted, id := s.meta.TTLSeconds != 0, s.evicted, s.meta.ID
	s.mu.Unlock()
	if sliding && evicted {
		// The stream left memory while its records were fetched: the
		// access belongs to the handle lookups use now, or it is lost
		// with this one and the stream expires early.
		if cur, err := e.stream(ctx, s.name); err == nil && cur != s {
			cur.mu.Lock()
			same := cur.meta.ID == id
			if same {
				cur.touchLocked(now)
			}
			cur.mu.Unlock()
			if same {
				s = cur
			}
		}
	}
	if sliding {
		e.renew(s)
	}
	return res, nil
}

// readPosition refuses a read of req.Seq past the tail or below the first
// retained record of a stream in state info.
func readPosition(req ReadRequest, info Info) error {
	switch {
	case req.Tail || req.Seq == info.NextSeq:
		return nil
	case req.Seq > info.NextSeq:
		return fmt.Errorf("%w: position %d is beyond the tail %d", ErrBadRequest, req.Seq, info.NextSeq)
	case req.Seq < info.StartSeq:
		return &TrimmedError{Seq: req.Seq, StartSeq: info.StartSeq}
	}
	return nil
}

// renew persists a sliding-TTL renewal lazily: at most every quarter of the
// TTL, as a record-less WAL entry, so tail readers cost no S3 requests.
func (e *Engine) renew(s *stream) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ttl := s.meta.TTLSeconds * 1000
	if ttl == 0 || s.gone || s.evicted || s.touched-s.pend.AccessedAt < ttl/4 {
		return
	}
	w, err := e.writer()
	if err != nil {
		return
	}
	e.addRenewalLocked(w, s) // failed: the next access tries again
}

// addRenewalLocked writes s's last access (touched) to the WAL as a
// record-less entry, and reports whether the writer took it. Called with
// s.mu held.
func (e *Engine) addRenewalLocked(w *segment.Writer, s *stream) bool {
	ent := &segment.Entry{StreamID: s.meta.ID, Name: s.name, FirstSeq: s.pend.NextSeq, AccessedAt: s.touched, Ref: s}
	b, err := w.Add(ent)
	if err != nil {
		return false
	}
	s.joined(ent, b, false)
	return true
}

// renewalUnsavedLocked reports whether s, not expired at now (Unix ms),
// would expire later for an access that only memory holds (touched) than
// for the last one its durable state holds: leaving memory, it would lose
// that renewal, and expire early. Called with s.mu held.
func (s *stream) renewalUnsavedLocked(now int64) bool {
	if s.meta.TTLSeconds == 0 || s.gone || s.meta.Deleted {
		return false
	}
	at := s.expiresAtLocked()
	return now < at && at > expiresAt(s.meta, s.durable.AccessedAt)
}

// keepForRenewalLocked is asked before s leaves memory: when s holds a
// renewal only in memory (renewalUnsavedLocked), the renewal goes to the
// WAL first and s stays until its entry is folded, and it reports true.
// Without it, a stream read less than a quarter of its TTL after its last
// saved renewal and then left idle expired up to that quarter early, swept
// away while a reader still counted on it. Should the writer refuse the
// entry, s goes all the same, its renewal lost as a crash would lose it.
// Called with s.mu held; besides it takes only the writer's own lock (not
// startMu, as writer() would), so eviction may call it under e.mu.
func (e *Engine) keepForRenewalLocked(s *stream, now int64) bool {
	if !s.renewalUnsavedLocked(now) {
		return false
	}
	w := e.statsW.Load() // lock-free: writer() takes startMu
	return w != nil && e.addRenewalLocked(w, s)
}

// ReadWeight is what a record with headers and a body of bodyLen bytes
// counts toward ReadRequest.MaxBytes: its body and its headers' names and
// values. Headers count because a read hands them out as well (Pico's
// reads carry them) and holds them until it is written: counting bodies
// only, a page of records with a megabyte of headers and empty bodies took
// every record up to MaxRecords, thousands of times the limit.
func ReadWeight(headers []Header, bodyLen int) int {
	n := bodyLen
	for _, h := range headers {
		n += len(h.Name) + len(h.Value)
	}
	return n
}

// collect gathers records [req.Seq, end) within the request's limits: from
// uncompacted WAL entries when the seq is still there, otherwise from data
// objects, each through the block cache. A fork's inherited records come
// from its source (by internal id, through the source's state), the last of
// them cut to the fork point. The buffers the records are in, held, go to
// keep; with keep nil they are never recycled.
func (e *Engine) collect(ctx context.Context, s *stream, id string, req ReadRequest, end uint64, keep *[]*objBuf) ([]Record, error) {
	a := &readAcc{req: req, stopTimed: func() {}}
	defer func() { a.stopTimed() }()
	if err := e.collectInto(ctx, a, s, id, req.Seq, end, keep); err != nil {
		return nil, err
	}
	return a.out, nil
}

// readAcc is the records a read has gathered so far, within its request's
// limits. Every stream of a fork chain adds to the one accumulator: each
// level gathering its own and handing them down used to copy every
// inherited record once per level, so a read of a fork 100 deep took
// seconds and gigabytes of allocation for one response.
type readAcc struct {
	req   ReadRequest
	out   []Record
	bytes int
	// timed is the read's context with a deadline at req.Until, made
	// once the read has a record (see recordsAt); stopTimed ends it.
	timed     context.Context
	stopTimed context.CancelFunc
}

// full reports whether the read has all the records its limits let it take.
func (a *readAcc) full() bool {
	return (a.req.MaxRecords > 0 && len(a.out) >= a.req.MaxRecords) ||
		(a.req.MaxBytes > 0 && len(a.out) > 0 && a.bytes >= a.req.MaxBytes)
}

// add takes r unless it would pass the byte limit, and reports whether the
// read takes more after it.
func (a *readAcc) add(r Record) bool {
	n := ReadWeight(r.Headers, len(r.Body))
	if a.req.MaxBytes > 0 && len(a.out) > 0 && a.bytes+n > a.req.MaxBytes {
		return false
	}
	a.out = append(a.out, r)
	a.bytes += n
	return !a.full()
}

// errReadOutOfTime ends a read's wait for more records at its Until.
var errReadOutOfTime = errors.New("the read's time ran out")

// recordsAt is e.recordsAt for a read that gathers into a: once it has a
// record, a wait that runs past the request's Until is given up.
func (a *readAcc) recordsAt(ctx context.Context, e *Engine, s *stream, id string, seq uint64) ([]Record, *objBuf, error) {
	if a.req.Until.IsZero() || len(a.out) == 0 {
		return e.recordsAt(ctx, s, id, seq)
	}
	if !time.Now().Before(a.req.Until) {
		return nil, nil, errReadOutOfTime
	}
	// One deadline for the rest of the read, not a timer per run: a
	// catch-up from the cache reads hundreds of runs.
	if a.timed == nil {
		a.timed, a.stopTimed = context.WithDeadline(ctx, a.req.Until)
	}
	rctx := a.timed
	recs, buf, err := e.recordsAt(rctx, s, id, seq)
	if err != nil && rctx.Err() != nil && ctx.Err() == nil {
		buf.release()
		return nil, nil, errReadOutOfTime
	}
	return recs, buf, err
}

// collectInto is collect's work from seq on, adding to a: records [seq,
// end) of stream s (internal id), its source's first where s is a fork.
func (e *Engine) collectInto(ctx context.Context, a *readAcc, s *stream, id string, seq, end uint64, keep *[]*objBuf) error {
	s.mu.Lock()
	fork := s.meta.Fork
	s.mu.Unlock()
	if fork != nil && seq < fork.base() {
		src, err := e.stream(ctx, fork.SourceName)
		if err != nil {
			return fmt.Errorf("fork source %s: %w", fork.SourceName, err)
		}
		had := len(a.out)
		if err := e.collectInto(ctx, a, src, fork.SourceID, seq, min(end, fork.base()), keep); err != nil {
			return err
		}
		if len(a.out) > had {
			last := &a.out[len(a.out)-1]
			if fork.Bytes > 0 && last.Seq == fork.Seq && uint64(len(last.Body)) > fork.Bytes {
				// The fork point is inside this record: the fork has its
				// first fork.Bytes bytes. Cut, it weighs less than the
				// source's limits took it at.
				a.bytes -= len(last.Body) - int(fork.Bytes)
				last.Body = last.Body[:fork.Bytes]
			}
			seq = last.Seq + 1
		}
		if a.full() || seq < fork.base() {
			return nil
		}
	}
	for seq < end {
		recs, buf, err := a.recordsAt(ctx, e, s, id, seq)
		if err != nil && len(a.out) > 0 && (errors.Is(err, ErrDamaged) || errors.Is(err, errReadOutOfTime)) {
			// The records before the damage, or before the wait that
			// ran past the read's time, are served; the read from there
			// fails, or comes again.
			return nil
		}
		if err != nil {
			return err
		}
		switch {
		case buf == nil:
		case keep != nil:
			*keep = append(*keep, buf)
		default:
			buf.escape()
		}
		from := seq
		for _, r := range recs {
			if r.Seq < seq {
				continue
			}
			if r.Seq >= end || !a.add(r) {
				return nil
			}
			seq = r.Seq + 1
		}
		if seq == from && len(a.out) > 0 {
			return nil // the records up to here are served
		}
		if seq == from {
			// Nothing at seq where it was looked for: reading again would
			// find the same, for ever.
			return fmt.Errorf("%w: no record %d of %s where the stream's index puts it", ErrDamaged, seq, s.name)
		}
	}
	return nil
}

// recordsAt returns a run of records that holds seq, and the buffer it
// holds for them (see objBuf), if any. When the entry is not
// cached, the stream's following entries in the same WAL object come with
// it in one ranged GET (they sit close together: one batch's worth), so a
// cold catch-up costs a GET per WAL object, not per append.
func (e *Engine) recordsAt(ctx context.Context, s *stream, id string, seq uint64) ([]Record, *objBuf, error) {
	for attempt := 0; ; attempt++ {
		s.mu.Lock()
		runs := sameObjectRuns(s.runs, seq)
		s.mu.Unlock()
		if len(runs) == 0 {
			return e.dataRecords(ctx, s, id, seq)
		}
		if recs, ok := e.cache.get(runCacheKey(runs[0].key, runs[0].span)); ok {
			return recs, nil, nil
		}
		if r := runs[0]; r.blob != "" {
			recs, held, err := e.blobRecords(ctx, id, r)
			if errors.Is(err, segment.ErrNotFound) {
				// A compaction applying a trim that cut into the blob
				// rewrote its retained records as a data object and
				// deleted it, before the stream's runs let go of it:
				// the data index finds them.
				return e.dataRecords(ctx, s, id, seq)
			}
			if isDamage(err) {
				return nil, nil, e.damagedObject(s.name, blobKey(id, r.blob), err)
			}
			if err != nil {
				return nil, nil, err
			}
			e.cacheRun(s, r, recs, held)
			return recs, nil, nil
		}
		first, last := runs[0].span, runs[len(runs)-1].span
		data, _, err := e.store.Get(ctx, runs[0].key, first.Off, last.Off+last.Len-first.Off)
		if errors.Is(err, segment.ErrNotFound) && attempt == 0 {
			continue // compacted meanwhile: look again
		}
		if err != nil {
			return nil, nil, fmt.Errorf("%w: read %s: %v", ErrUnavailable, runs[0].key, err)
		}
		// Each run holds its span of data; the first, the bytes of other
		// streams between the runs too, so data is counted once.
		gaps := len(data)
		for _, r := range runs {
			gaps -= int(r.span.Len)
		}
		var out []Record
		for i, r := range runs {
			ent, err := decodeRun(data, first.Off, r)
			if err == nil && ent.StreamID != id {
				err = fmt.Errorf("read %s: %w: entry is not the expected one", r.key, segment.ErrCorrupt)
			}
			if err != nil && len(out) > 0 {
				// The records before the damaged run are served; a
				// read from the damaged one fails.
				return out, nil, nil
			}
			if err != nil {
				return nil, nil, e.damaged(s.name, r, err)
			}
			held := int(r.span.Len)
			if i == 0 {
				held += max(gaps, 0)
			}
			e.cacheRun(s, r, ent.Records, held)
			out = append(out, ent.Records...)
		}
		return out, nil, nil
	}
}

// cacheRun caches the records of run r of s that a read fetched, while s
// still has the run: a compaction that folded it meanwhile (or a delete)
// took its key out of the cache, and nothing would take it out again.
func (e *Engine) cacheRun(s *stream, r walRun, recs []Record, held int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gone || !hasRun(s.runs, r) {
		return
	}
	e.cache.put(runCacheKey(r.key, r.span), recs, held)
}

// hasRun reports whether runs, in WAL order, hold r. (Were they ever out
// of order, a run missed is only a read not cached.)
func hasRun(runs []walRun, r walRun) bool {
	i, _ := slices.BinarySearchFunc(runs, r.pos, func(x walRun, p walPos) int {
		return cmp.Or(cmp.Compare(x.pos.NS, p.NS), cmp.Compare(x.pos.Seq, p.Seq))
	})
	for ; i < len(runs) && runs[i].pos == r.pos; i++ {
		if runs[i].key == r.key && runs[i].span == r.span {
			return true
		}
	}
	return false
}

// recordsKept is recordsAt for a caller that keeps the records for as
// long as it likes: their buffer, if any, is never recycled.
func (e *Engine) recordsKept(ctx context.Context, s *stream, id string, seq uint64) ([]Record, error) {
	recs, buf, err := e.recordsAt(ctx, s, id, seq)
	buf.escape()
	return recs, err
}

// decodeRun decodes run r's entry out of data, a ranged read of its
// object that starts at offset base, and checks it holds r's records.
func decodeRun(data []byte, base int64, r walRun) (*segment.Entry, error) {
	off := r.span.Off - base
	if !spanWithin(off, r.span.Len, int64(len(data))) {
		return nil, fmt.Errorf("read %s: %w: short range", r.key, segment.ErrCorrupt)
	}
	ent, _, err := segment.DecodeEntry(data[off : off+r.span.Len])
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", r.key, err)
	}
	if ent.FirstSeq != r.ch.First || ent.EndSeq() != r.ch.End {
		return nil, fmt.Errorf("read %s: %w: entry is not the expected one", r.key, segment.ErrCorrupt)
	}
	return ent, nil
}

// spanWithin reports whether the n bytes at off lie within size bytes,
// without overflow for any off and n (a pack index is read from the
// bucket).
func spanWithin(off, n, size int64) bool {
	return off >= 0 && n > 0 && off <= size && n <= size-off
}

// blobRecords reads the records of a committed blob entry of stream id.
func (e *Engine) blobRecords(ctx context.Context, id string, r walRun) ([]Record, int, error) {
	key := blobKey(id, r.blob)
	recs, held, err := e.readData(ctx, key)
	if err != nil {
		return nil, 0, err
	}
	if len(recs) == 0 || recs[0].Seq != r.ch.First || recs[len(recs)-1].Seq+1 != r.ch.End {
		return nil, 0, fmt.Errorf("read %s: %w: blob does not hold seqs [%d, %d)", key, segment.ErrCorrupt, r.ch.First, r.ch.End)
	}
	return recs, held, nil
}

// maxRangeRead caps the bytes one ranged WAL read may span.
const maxRangeRead = 1 << 20

// sameObjectRuns returns the committed entry with records that holds seq,
// followed by the stream's next entries with records in the same WAL
// object, within maxRangeRead.
func sameObjectRuns(runs []walRun, seq uint64) []walRun {
	i := sort.Search(len(runs), func(i int) bool { return runs[i].ch.End > seq })
	if i == len(runs) || runs[i].ch.First > seq {
		return nil
	}
	out := []walRun{runs[i]}
	if runs[i].blob != "" {
		return out
	}
	for j := i + 1; j < len(runs) && runs[j].key == runs[i].key && runs[j].blob == ""; j++ {
		if runs[j].span.Off+runs[j].span.Len-runs[i].span.Off > maxRangeRead {
			break
		}
		if runs[j].ch.End > runs[j].ch.First {
			out = append(out, runs[j])
		}
	}
	return out
}

// dataRecords reads the data object holding seq, through the stream's
// data index and the cache, and reads ahead after a cache miss. The
// object's buffer, if recycled, comes held.
func (e *Engine) dataRecords(ctx context.Context, s *stream, id string, seq uint64) ([]Record, *objBuf, error) {
	for attempt := 0; ; attempt++ {
		sp, next, err := e.dataSpanAt(ctx, s, id, seq)
		if isDamage(err) {
			return nil, nil, e.missingObject(s, seq, dataPrefix(id), err)
		}
		if err != nil {
			return nil, nil, err
		}
		// Keep the next objects coming on hits too: a reader that only
		// read ahead on a miss would wait for every third object.
		e.prefetch(s, next)
		if recs, buf, ok := e.cache.getHeld(sp.key); ok {
			return e.spanRecords(s, sp, recs, buf)
		}
		recs, buf, err := e.fetchData(ctx, sp.key)
		if errors.Is(err, segment.ErrNotFound) && attempt == 0 {
			// A trim rewrote the object since the index was read: list
			// again.
			s.mu.Lock()
			s.dataIdx = nil
			s.mu.Unlock()
			continue
		}
		if errors.Is(err, segment.ErrNotFound) {
			return nil, nil, e.missingObject(s, seq, sp.key, fmt.Errorf("%w: data object %s is gone", segment.ErrCorrupt, sp.key))
		}
		if isDamage(err) {
			// A checksum or framing failure: objects never change, so
			// no trim or delete explains it.
			return nil, nil, e.damagedObject(s.name, sp.key, err)
		}
		if err != nil {
			return nil, nil, err
		}
		return e.spanRecords(s, sp, recs, buf)
	}
}

// spanRecords checks that recs, read from sp's object, are the records
// its key names. A sound object under another key (a copy restored to the
// wrong name) would otherwise be served as if it held them: records
// skipped, or none past the reader's position, which it would read again
// for ever.
func (e *Engine) spanRecords(s *stream, sp dataSpan, recs []Record, buf *objBuf) ([]Record, *objBuf, error) {
	if uint64(len(recs)) == sp.end-sp.first && (len(recs) == 0 || recs[0].Seq == sp.first) {
		return recs, buf, nil
	}
	buf.release()
	held := "none"
	if len(recs) > 0 {
		held = fmt.Sprintf("[%d, %d)", recs[0].Seq, recs[len(recs)-1].Seq+1)
	}
	return nil, nil, e.damagedObject(s.name, sp.key,
		fmt.Errorf("%w: holds records %s, its name says [%d, %d)", segment.ErrCorrupt, held, sp.first, sp.end))
}

// missingObject is the error of a read of s at seq that found no object
// key where the stream's records should be (cause wraps segment.ErrCorrupt).
// A trim that a compaction applied, or a delete that landed, while the read
// was under way explains it: the cause alone is returned, which Read
// answers as the trim's TrimmedError (or the caller as the stream gone).
// Otherwise the object was lost: damage, reported as such.
func (e *Engine) missingObject(s *stream, seq uint64, key string, cause error) error {
	s.mu.Lock()
	overtaken := s.gone || seq < s.startSeq(&s.durable)
	if !overtaken && s.meta.Deleted {
		// Deleted while the read was under way: what no fork reads is
		// deleted since (thinDeleted).
		reads, known := s.meta.forkReads()
		overtaken = known && !readsAny(reads, seq, seq+1)
	}
	s.mu.Unlock()
	if overtaken {
		return cause
	}
	return e.damagedObject(s.name, key, cause)
}
