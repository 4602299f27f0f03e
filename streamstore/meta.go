package streamstore

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
	"time"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/segment"
)

// walPos is a position in the WAL across namespaces; it orders entries.
type walPos struct {
	NS  uint64 `json:"ns"`
	Seq uint64 `json:"seq"`
}

func (p walPos) after(q walPos) bool {
	return p.NS > q.NS || (p.NS == q.NS && p.Seq > q.Seq)
}

// next is the position just after p.
func (p walPos) next() walPos { return walPos{p.NS, p.Seq + 1} }

// String is p as logs show it: namespace/seq.
func (p walPos) String() string { return fmt.Sprintf("%d/%d", p.NS, p.Seq) }

// writerState is what appends check and change: the tail, closure, the
// producers' progress and the last Stream-Seq.
type writerState struct {
	NextSeq    uint64                 `json:"next_seq"`
	StartSeq   uint64                 `json:"start_seq,omitempty"`
	LastTS     int64                  `json:"last_ts,omitempty"`
	Closed     bool                   `json:"closed,omitempty"`
	ClosedBy   *segment.ProducerState `json:"closed_by,omitempty"`
	StreamSeq  string                 `json:"stream_seq,omitempty"`
	AccessedAt int64                  `json:"accessed_at,omitempty"`
	// Producers is encoded as the map of producer id to state that
	// earlier versions wrote, and left out when empty, as they did.
	Producers producerSet `json:"producers,omitzero"`
}

// change is what one WAL entry does to a stream's writer state; it is kept
// for committed entries until they are checkpointed, without their records.
type change struct {
	First, End uint64 // the seqs of the entry's records: [First, End)
	LastTS     int64
	Closed     bool
	Producer   *segment.ProducerState
	StreamSeq  string
	AccessedAt int64
	TrimTo     uint64
}

func changeOf(e *segment.Entry) change {
	c := change{
		First:      e.FirstSeq,
		End:        e.EndSeq(),
		Closed:     e.Closed,
		Producer:   e.Producer,
		StreamSeq:  e.StreamSeq,
		AccessedAt: e.AccessedAt,
		TrimTo:     e.TrimTo,
	}
	if n := len(e.Records); n > 0 {
		c.LastTS = e.Records[n-1].Timestamp
	}
	return c
}

// apply folds one change into the state. A state copy can be kept as the
// durable one while another is changed: Producers is a value (producerSet).
func (w *writerState) apply(c change) {
	w.NextSeq = c.End
	w.LastTS = max(w.LastTS, c.LastTS)
	if c.Closed && !w.Closed {
		w.Closed = true
		w.ClosedBy = c.Producer
	}
	if c.Producer != nil {
		w.Producers.set(*c.Producer)
	}
	if c.StreamSeq != "" {
		w.StreamSeq = c.StreamSeq
	}
	w.AccessedAt = max(w.AccessedAt, c.AccessedAt)
	w.StartSeq = max(w.StartSeq, min(c.TrimTo, w.NextSeq))
}

// metaObject is a stream's metadata object: its fixed configuration, and a
// checkpoint of its writer state: entries before WAL position Upto are
// folded in; replay applies only the others.
type metaObject struct {
	Version     int    `json:"v"`
	Name        string `json:"name"`
	ID          string `json:"id"`
	ContentType string `json:"content_type"`
	TTLSeconds  int64  `json:"ttl_s,omitempty"`
	ExpiresAt   int64  `json:"expires_at_ms,omitempty"`
	CreatedAt   int64  `json:"created_at_ms"`
	Upto        walPos `json:"upto"`
	// Cleaned: data objects holding only seqs below it are deleted.
	Cleaned uint64 `json:"cleaned,omitempty"`
	// Thinned: while forks read the stream, the data objects holding only
	// seqs below it that no fork in ForkList reads are deleted (see
	// thinBelow). A release sets it back to zero: the forks left read
	// less.
	Thinned uint64 `json:"thinned,omitempty"`
	// Tail is the stream's last data object while it is small and plain
	// (not a blob's marker): the next fold merges it (see mergeTail).
	Tail *dataTail `json:"tail,omitempty"`
	// Merged is the data object the fold that wrote this checkpoint merged
	// into its tail: deleted after the write, and again by the next fold,
	// should a crash have come between the write and the delete.
	Merged string `json:"merged,omitempty"`
	// Fork, on a fork, references the source's data: by internal id (the
	// name only locates its state), never by object keys, so the source's
	// compaction stays free.
	Fork *forkRef `json:"fork,omitempty"`
	// Forks counts the live forks that reference this stream's data.
	Forks int `json:"forks,omitempty"`
	// ForkList names the forks Forks counts, those made since forks were
	// listed (the count may be higher: forks made by an earlier version,
	// or listed entries that version dropped when it rewrote the object).
	// A listed fork can be looked up, and one that is gone no longer
	// counted, should its release never come (see settleForks).
	ForkList []forkEntry `json:"fork_list,omitempty"`
	// Unlisted, while forks past ForkList's bound are counted, spans the
	// records every one of them reads: set by the create of the first
	// fork past the list while every fork counted was listed, widened by
	// each later one, dropped when the count is back to the list's length.
	// Without it (forks counted by an earlier version, or before the
	// field), what those forks read is not known, and nothing is thinned.
	Unlisted *seqSpan `json:"unlisted_reads,omitempty"`
	// Deleted marks a soft-deleted stream: gone for clients, kept for its
	// forks until the last one goes.
	Deleted bool `json:"deleted,omitempty"`
	// DeletedAt is when the stream was soft-deleted (ms); it anchors the
	// schedule on which the expiry sweep settles its fork count
	// (nextSettle). Zero on a stream soft-deleted by an earlier version.
	DeletedAt int64 `json:"deleted_at_ms,omitempty"`
	// Seeded marks a stream created with records: its create is a WAL
	// entry that carries this object, which a replay writes if it is
	// missing, so deleting the stream first writes an entry that undoes
	// the create (segment.Entry.Drop).
	Seeded bool        `json:"seeded,omitempty"`
	State  writerState `json:"state"`
	// Rev counts the writes of the object since its create (writeMeta), so
	// that no version of it ever has the bytes, and so the ETag, of an
	// earlier one. A write held up on its way is conditional on the
	// version it replaces; had a later write brought those bytes back (a
	// fork made and deleted restores the count and the list), it would
	// land then, long after the writer stopped counting it as possible,
	// and move the stream's checkpoint past records the writer went on to
	// pack.
	Rev uint64 `json:"rev,omitempty"`
}

// forkRef is a fork's inherited range: the source's records from Start
// and below Seq, and Bytes bytes of record Seq when Bytes > 0 (the fork's
// own records then start at Seq+1).
type forkRef struct {
	SourceName string `json:"source_name"`
	SourceID   string `json:"source_id"`
	Seq        uint64 `json:"seq"`
	Bytes      uint64 `json:"bytes,omitempty"`
	// Start is the source's first retained seq when the fork was made:
	// the records below it were trimmed, and compaction may have dropped
	// them, so the fork starts there too.
	Start uint64 `json:"start,omitempty"`
	// Tail says the create named no point: the source's tail then. A
	// create repeated without a point matches only such a fork.
	Tail bool `json:"tail,omitempty"`
	// Listed says the source lists the fork in its ForkList.
	Listed bool `json:"listed,omitempty"`
	// Depth is how many forks deep the fork is: 1 for a fork of a stream
	// that is none, one more than its source's otherwise. Zero on forks
	// made before it was kept, which count as 1 (see forkDepth).
	Depth int `json:"depth,omitempty"`
	// SourceExpiry is the source's expiry when the fork was made: what a
	// create that sets none asks for (section 4.2), so a create repeated
	// without Stream-TTL or Stream-Expires-At matches the fork only when
	// its expiry is this one. Nil on forks made before it was kept, which
	// such a create matches whatever their expiry.
	SourceExpiry *expiryRef `json:"source_expiry,omitempty"`
	// lastTS is the source's last append's timestamp when the fork was
	// made, for the create to start the fork's own from: appends are
	// stamped max(now, previous + 1), and a source that took more than an
	// append a millisecond stamped its last ones ahead of the clock, so a
	// fork's first own record stamped now would go back in time.
	lastTS int64
}

// expiryRef is an expiry as the metadata object keeps it.
type expiryRef struct {
	TTLSeconds int64 `json:"ttl_s,omitempty"`
	ExpiresAt  int64 `json:"expires_at_ms,omitempty"`
}

func (x *expiryRef) expiry() Expiry {
	return (&metaObject{TTLSeconds: x.TTLSeconds, ExpiresAt: x.ExpiresAt}).expiry()
}

// forkEntry is a fork in its source's ForkList, written with the count
// before the fork's metadata is.
type forkEntry struct {
	Name string `json:"name"`
	ID   string `json:"id"`
	// At is when the count went up (ms). The fork's metadata write comes
	// later and, its outcome unknown, may land until Config.GraveTime has
	// passed: a fork not found before then may still appear.
	At int64 `json:"at_ms"`
	// Reads holds every record of this stream the fork can read: a trim
	// deletes the others while the fork lives. Nil on entries written
	// before it was kept, whose forks keep every trimmed record.
	Reads *seqSpan `json:"reads,omitempty"`
}

// seqSpan is records [From, To).
type seqSpan struct {
	From uint64 `json:"from"`
	To   uint64 `json:"to"`
}

// forkReads returns the records the forks of the stream read, as sorted
// spans that neither overlap nor touch, and whether they are known: every
// fork counted is listed with the records it reads. With no fork, none.
func (m *metaObject) forkReads() ([]seqSpan, bool) {
	unlisted := m.Forks - len(m.ForkList)
	if unlisted < 0 || (unlisted > 0 && m.Unlisted == nil) {
		return nil, false
	}
	spans := make([]seqSpan, 0, len(m.ForkList)+1)
	for _, f := range m.ForkList {
		if f.Reads == nil {
			return nil, false
		}
		if f.Reads.To > f.Reads.From {
			spans = append(spans, *f.Reads)
		}
	}
	if unlisted > 0 && m.Unlisted.To > m.Unlisted.From {
		spans = append(spans, *m.Unlisted)
	}
	slices.SortFunc(spans, func(a, b seqSpan) int { return cmp.Compare(a.From, b.From) })
	out := spans[:0]
	for _, sp := range spans {
		if n := len(out); n > 0 && sp.From <= out[n-1].To {
			out[n-1].To = max(out[n-1].To, sp.To)
			continue
		}
		out = append(out, sp)
	}
	return out, true
}

// thinTo is the seq below which the stream's records are there only for
// its forks: its start, or, soft-deleted, its end, as clients read none of
// it any more.
func (m *metaObject) thinTo() uint64 {
	if m.Deleted {
		return m.State.NextSeq
	}
	return m.State.StartSeq
}

// trimPending reports whether a fold would delete trimmed records: those
// below the start while no fork reads the stream, or, while forks do and
// every one says what it reads, those below thinTo that no fold has looked
// at yet. With forks that do not say, a fold deletes nothing.
func (m *metaObject) trimPending() bool {
	if m.Forks == 0 {
		return m.State.StartSeq > m.Cleaned
	}
	if m.thinTo() <= max(m.Thinned, m.Cleaned) {
		return false
	}
	_, known := m.forkReads()
	return known
}

// readsAny reports whether records [first, end) include one in spans
// (sorted, as forkReads returns them).
func readsAny(spans []seqSpan, first, end uint64) bool {
	i := sort.Search(len(spans), func(i int) bool { return spans[i].To > first })
	return first < end && i < len(spans) && spans[i].From < end
}

// releaseFork stops counting the fork with internal id; listed says its
// source listed it when it was made. A listed fork not in the list is
// counted no more already (released, or found gone): lowering the count
// for it again could free data a fork still reads. An unlisted one takes
// one of the count's unlisted forks.
func (m *metaObject) releaseFork(id string, listed bool) {
	if i := slices.IndexFunc(m.ForkList, func(f forkEntry) bool { return f.ID == id }); i >= 0 {
		// A copy: m shares the slice with the stream's current metadata.
		m.ForkList = slices.Delete(slices.Clone(m.ForkList), i, i+1)
		m.Forks = max(m.Forks-1, 0)
		m.Thinned = 0
		return
	}
	if !listed && m.Forks > len(m.ForkList) {
		m.Forks--
		m.Thinned = 0
		if m.Forks == len(m.ForkList) {
			m.Unlisted = nil // no fork past the list is left
		}
	}
}

// noteUnlisted counts in Unlisted the records r that a fork made past
// ForkList's bound reads; m.Forks counts that fork already.
func (m *metaObject) noteUnlisted(r seqSpan) {
	switch {
	case m.Forks-1 == len(m.ForkList):
		// The first past the list, every other fork listed: what the
		// forks past the list read is known from here on.
		m.Unlisted = &r
	case m.Unlisted != nil:
		m.Unlisted = &seqSpan{From: min(m.Unlisted.From, r.From), To: max(m.Unlisted.To, r.To)}
	}
}

// forkDepth is how many forks deep the stream is: 0 for one that is no
// fork. A fork made by an older build, which kept no depth, counts as 1
// whatever its source: its chain is as deep as its creator allowed.
func (m *metaObject) forkDepth() int {
	if m.Fork == nil {
		return 0
	}
	return max(m.Fork.Depth, 1)
}

// base is the first seq of the fork's own records.
func (f *forkRef) base() uint64 {
	if f.Bytes > 0 {
		return f.Seq + 1
	}
	return f.Seq
}

func (m *metaObject) expiry() Expiry {
	x := Expiry{TTL: time.Duration(m.TTLSeconds) * time.Second}
	if m.ExpiresAt != 0 {
		x.ExpiresAt = time.UnixMilli(m.ExpiresAt).UTC()
	}
	return x
}

func encodeMeta(m *metaObject) []byte {
	b, err := json.Marshal(m)
	if err != nil {
		panic(fmt.Sprintf("encode metadata: %v", err)) // only plain types: cannot fail
	}
	return b
}

func decodeMeta(data []byte) (*metaObject, error) {
	var m metaObject
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("%w: metadata: %v", segment.ErrCorrupt, err)
	}
	if m.Version != 1 {
		return nil, fmt.Errorf("%w: metadata version %d", segment.ErrCorrupt, m.Version)
	}
	return &m, nil
}

// errMetaGone says a stream's metadata object is gone, or belongs to a
// stream created anew under its name: the stream was deleted meanwhile.
var errMetaGone = errors.New("metadata object deleted meanwhile")

// maxUnsure bounds the unconfirmed metadata writes a stream remembers.
const maxUnsure = 4

// metaCheckTimeout bounds reading a metadata object back after a write of
// it failed.
const metaCheckTimeout = 10 * time.Second

// checkContext is the context of a read-back after a write failed: its
// own deadline, as a cancelled request must not leave the answer unknown.
func checkContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), metaCheckTimeout)
}

// readMeta reads name's metadata object back after a write of it failed:
// segment.ErrNotFound when there is none or a grave.
func (e *Engine) readMeta(ctx context.Context, name string) ([]byte, string, error) {
	rctx, cancel := checkContext(ctx)
	defer cancel()
	// A request's answer-by time bounds it too (checkContext keeps
	// ctx's values): a failed create then answers "not confirmed".
	rctx, cancelBy := withAnswerByDeadline(rctx)
	defer cancelBy()
	data, etag, err := e.store.Get(rctx, metaKey(name), 0, -1)
	if err == nil && isGrave(data) {
		return nil, "", segment.ErrNotFound
	}
	return data, etag, err
}

// A grave is what a deleted stream leaves in its metadata key: a delete
// swaps the metadata for it by compare-and-swap, and a create replaces it
// the same way. A create's write held up on its way (its retry answered
// first, the stream deleted since) is create-only and so fails against it,
// where it would have found the key free and brought the deleted stream
// back. The collector removes a grave after Config.GraveTime, when no such
// write can land any more: S3 refuses a request signed more than 15
// minutes before it arrives.
type grave struct {
	Grave int    `json:"grave"` // 1; tells a grave from metadata (version "v")
	ID    string `json:"id"`    // the deleted stream's internal id
	At    int64  `json:"at_ms"` // when it was deleted
}

// defaultGraveTime outlasts SigV4's 15 minutes of allowed clock skew, the
// longest a signed request can take to reach S3 and still be served.
const defaultGraveTime = 20 * time.Minute

// graveTag starts every grave, and never metadata (which starts {"v":).
var graveTag = []byte(`{"grave":`)

func encodeGrave(id string, at time.Time) []byte {
	b, err := json.Marshal(grave{Grave: 1, ID: id, At: at.UnixMilli()})
	if err != nil {
		panic(fmt.Sprintf("encode grave: %v", err)) // only plain types: cannot fail
	}
	return b
}

func isGrave(data []byte) bool { return bytes.HasPrefix(data, graveTag) }

// decodeGrave returns the grave data holds; ok is false for anything else.
func decodeGrave(data []byte) (g grave, ok bool) {
	if !isGrave(data) || json.Unmarshal(data, &g) != nil {
		return grave{}, false
	}
	return g, true
}

// removeGraveAt removes the grave at key, of stream id ("" for a
// document's), once it is due, and otherwise returns when it will be;
// anything else at key is left alone.
func (e *Engine) removeGraveAt(ctx context.Context, key, id string) (time.Time, error) {
	data, etag, err := e.store.Get(ctx, key, 0, -1)
	if errors.Is(err, segment.ErrNotFound) {
		return time.Time{}, nil
	}
	if err != nil {
		return time.Time{}, fmt.Errorf("read the grave at %s: %w", key, err)
	}
	g, ok := decodeGrave(data)
	if !ok || g.ID != id {
		return time.Time{}, nil
	}
	return e.dropGraveIfDue(ctx, key, etag, g)
}

// dropGraveIfDue removes grave g, version etag at key, once it is
// Config.GraveTime old, and otherwise returns when it will be.
func (e *Engine) dropGraveIfDue(ctx context.Context, key, etag string, g grave) (time.Time, error) {
	if due := time.UnixMilli(g.At).Add(e.config().GraveTime); time.Now().Before(due) {
		return due, nil
	}
	// Conditional: a create may have replaced the grave since it was read.
	if err := e.store.DeleteIfMatch(ctx, key, etag); err != nil && !errors.Is(err, segment.ErrPreconditionFailed) {
		return time.Time{}, fmt.Errorf("remove the grave at %s: %w", key, err)
	}
	return time.Time{}, nil
}

// nameTaken is putOverGrave's failed precondition when the key holds
// something other than a grave: what it read there, so that its caller
// need not read it again.
type nameTaken struct {
	data []byte
	etag string
	err  error
}

func (t *nameTaken) Error() string { return t.err.Error() }
func (t *nameTaken) Unwrap() error { return t.err }

// maxGravePasses bounds putOverGrave's rounds: each finds a grave replaced or
// removed since it read it.
const maxGravePasses = 4

// putNew writes body as name's metadata where there is none or a grave,
// and returns its version: segment.ErrPreconditionFailed when a stream
// holds the name. Other errors leave open whether the write landed, as a
// create-only PUT's do.
func (e *Engine) putNew(ctx context.Context, name string, body []byte) (string, error) {
	return e.putOverGrave(ctx, metaKey(name), body)
}

// errRefusedUnread is putOverGrave's error when its create-only write was
// refused and what holds the key could not be read: nothing was written.
var errRefusedUnread = errors.New("a create-only write was refused and the key could not be read")

// putOverGrave writes body at key where there is nothing or a grave, and
// returns its version: segment.ErrPreconditionFailed when anything else is
// there, as a *nameTaken holding what it read.
func (e *Engine) putOverGrave(ctx context.Context, key string, body []byte) (string, error) {
	opts := segment.PutOptions{IfNoneMatch: true}
	for pass := 1; ; pass++ {
		etag, err := e.store.Put(ctx, key, body, opts)
		if !errors.Is(err, segment.ErrPreconditionFailed) || pass == maxGravePasses {
			return etag, err
		}
		cur, tag, gerr := e.store.Get(ctx, key, 0, -1)
		switch {
		case errors.Is(gerr, segment.ErrNotFound):
			opts = segment.PutOptions{IfNoneMatch: true}
		case gerr != nil:
			// Not the precondition error: whether something holds the
			// key is not known.
			return "", fmt.Errorf("%w: read %s: %w", errRefusedUnread, key, gerr)
		case isGrave(cur):
			opts = segment.PutOptions{IfMatch: tag}
		case bytes.Equal(cur, body):
			// Our own write, which landed although the store said its
			// condition failed (a retry of it met it): a stream's
			// metadata names a fresh id, so no other create wrote these
			// bytes, and a document created twice alike is one create.
			return tag, nil
		default:
			return "", &nameTaken{data: cur, etag: tag, err: err}
		}
	}
}

// metaOf reads name's metadata object as the stream with internal id:
// errMetaGone when the object is gone or names another stream (deleted,
// and maybe created anew). An object that does not decode is returned as
// it is.
func (e *Engine) metaOf(ctx context.Context, name, id string) ([]byte, string, error) {
	data, etag, err := e.store.Get(ctx, metaKey(name), 0, -1)
	if errors.Is(err, segment.ErrNotFound) {
		return nil, "", errMetaGone
	}
	if err != nil {
		return nil, "", err
	}
	if isGrave(data) {
		return nil, "", errMetaGone
	}
	if m, derr := decodeMeta(data); derr == nil && m.ID != id {
		return nil, "", errMetaGone
	}
	return data, etag, nil
}

// writeMeta writes m, its Rev advanced, as s's metadata object over the
// version etag names, and returns the new version. The caller holds
// s.metaMu.
//
// A conditional write can mislead in two ways: it can fail after it landed
// (a lost answer, a cancelled request), and from then on every
// compare-and-swap against the etag we know fails with a precondition
// error that looks like a delete. So a failed write asks the bucket. Gone,
// or another stream under the name: errMetaGone. Holding what this process
// wrote, now or in a write that failed unconfirmed: ours, and the in-memory
// state wins, as the callers of those writes were told they failed (a
// compaction that wrote its checkpoint will write it again). Anything else
// was written by another process: an error, so that nothing retires the
// WAL entries this one has not checkpointed.
func (e *Engine) writeMeta(ctx context.Context, s *stream, m *metaObject, etag string) (string, error) {
	if err := e.checkLease(); err != nil {
		return "", err
	}
	m.Rev++
	body := encodeMeta(m)
	tag, err := e.store.Put(ctx, metaKey(s.name), body, segment.PutOptions{IfMatch: etag})
	if err == nil {
		s.clearUnsure()
		return tag, nil
	}
	s.rememberUnsure(body, err)
	rctx, cancel := checkContext(ctx)
	defer cancel()
	// A request's answer-by time bounds it too: the write then stays
	// unsure, as one whose read-back failed.
	rctx, cancelBy := withAnswerByDeadline(rctx)
	defer cancelBy()
	cur, curTag, gerr := e.metaOf(rctx, s.name, m.ID)
	switch {
	case errors.Is(gerr, errMetaGone):
		return "", errMetaGone
	case gerr != nil:
		return "", fmt.Errorf("%w (reading it back: %v)", err, gerr)
	case bytes.Equal(cur, body):
		s.clearUnsure()
		return curTag, nil
	}
	if curTag == etag {
		return "", err // the version we know is still there: ours failed
	}
	if !slices.ContainsFunc(s.unsure, func(b []byte) bool { return bytes.Equal(b, cur) }) {
		if !e.replacedWrote(cur) {
			return "", fmt.Errorf("metadata of %s changed by another writer: %w", s.name, err)
		}
		// A checkpoint of the process this one took the storage over
		// from, landed after this one loaded the stream: it describes
		// only what that process committed, which this one replayed, so
		// it is written over. Refusing, the stream could never be
		// checkpointed again, and no compaction would get through.
		e.log.Info("writing over a late checkpoint of the process that held the storage before",
			zap.String("stream", s.name))
	}
	if err := e.checkLease(); err != nil {
		return "", err
	}
	if cm, derr := decodeMeta(cur); derr == nil && cm.Rev >= m.Rev {
		// The version written over counted its writes from another
		// start, or is this one's own unconfirmed write: stay above it,
		// so that no version repeats one before it.
		m.Rev = cm.Rev + 1
		body = encodeMeta(m)
	}
	tag, err = e.store.Put(ctx, metaKey(s.name), body, segment.PutOptions{IfMatch: curTag})
	if err != nil {
		s.rememberUnsure(body, err)
		return "", fmt.Errorf("rewrite over an unconfirmed write: %w", err)
	}
	s.clearUnsure()
	return tag, nil
}

// replacedWrote reports whether metadata body cur, a version this process
// did not write, was written by a process that held the storage before
// this one: its checkpoint is of WAL positions in namespaces registered
// before this process's own. A process that took the storage over from
// this one replays this one's namespace, so its checkpoints are of this
// namespace or later, and are not written over.
func (e *Engine) replacedWrote(cur []byte) bool {
	own := e.ownNS.Load()
	if own == 0 {
		return false
	}
	m, err := decodeMeta(cur)
	return err == nil && m.Upto.NS < own-1
}

// maxMetaDeletes bounds deleteMeta's tries: each finds our metadata under
// a version this process wrote without hearing back, and there are at most
// maxUnsure of those.
const maxMetaDeletes = maxUnsure + 2

// errNoVersion stands for the delete deleteMeta could not send: it knows
// no version of the object to make it conditional on.
var errNoVersion = errors.New("no known version to delete")

// deleteMeta replaces the metadata object of s, the stream with internal
// id, with a grave. The swap holds only for the version this process
// knows: one held up on the way, its retry answered first and the name
// created again meanwhile, must not bury the new stream when it lands. A
// swap that fails or finds another version asks the bucket: gone, a grave
// or another stream's now is done (it may be our swap that landed), and
// ours under another version, a write of this process that failed without
// saying so and landed, is buried in its turn. metaMu keeps checkpoints
// from moving the version in between.
func (e *Engine) deleteMeta(ctx context.Context, s *stream, id string) error {
	if err := s.metaMu.LockContext(ctx); err != nil {
		return fmt.Errorf("another write of the metadata is under way: %w", err)
	}
	defer s.metaMu.Unlock()
	s.mu.Lock()
	etag := s.etag
	s.mu.Unlock()
	body := encodeGrave(id, time.Now())
	for try := 1; ; try++ {
		// A node that may have lost the storage to another must not
		// delete what that one may have written.
		if err := e.checkLease(); err != nil {
			return err
		}
		err := errNoVersion
		if etag != "" {
			if _, err = e.store.Put(ctx, metaKey(s.name), body, segment.PutOptions{IfMatch: etag}); err == nil {
				return nil
			}
		}
		rctx, cancel := checkContext(ctx)
		_, cur, gerr := e.metaOf(rctx, s.name, id)
		cancel()
		switch {
		case errors.Is(gerr, errMetaGone):
			return nil
		case gerr != nil:
			return fmt.Errorf("%w (reading it back: %v)", err, gerr)
		case err != errNoVersion && !errors.Is(err, segment.ErrPreconditionFailed):
			return err
		case try == maxMetaDeletes:
			return fmt.Errorf("metadata of %s keeps changing: %w", s.name, err)
		}
		etag = cur
	}
}

// rememberUnsure records body as possibly written when err leaves that
// open; a failed precondition says it was not. The caller holds s.metaMu.
func (s *stream) rememberUnsure(body []byte, err error) {
	if errors.Is(err, segment.ErrPreconditionFailed) || errors.Is(err, segment.ErrNotFound) {
		return
	}
	s.unsure = append(s.unsure, body)
	if len(s.unsure) > maxUnsure {
		s.unsure = slices.Delete(s.unsure, 0, 1)
	}
	s.metaUnsure.Store(true)
}

// clearUnsure forgets the unconfirmed writes once a write is confirmed.
// The caller holds s.metaMu.
func (s *stream) clearUnsure() {
	s.unsure = s.unsure[:0]
	s.metaUnsure.Store(false)
}
