package streamstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/picomq/caddy-picomq/segment"
)

// Header is one record header: string metadata carried with a record (not an
// HTTP header). Order is preserved.
type Header = segment.Header

// Record is one stored record. Seq is consecutive from 0 within a stream;
// Timestamp is milliseconds since the Unix epoch, assigned by the engine and
// never decreasing within a stream.
type Record = segment.Record

// NewRecord is a record to append; the engine assigns Seq and Timestamp.
type NewRecord struct {
	Headers []Header
	Body    []byte
}

// Expiry is a stream's lifetime setting: a sliding TTL, an absolute deadline,
// or neither. At most one of the two is set.
type Expiry struct {
	TTL       time.Duration // sliding idle window; 0 means none
	ExpiresAt time.Time     // absolute deadline; zero means none
}

// IsZero reports whether the stream never expires.
func (x Expiry) IsZero() bool { return x.TTL == 0 && x.ExpiresAt.IsZero() }

// answerByKey is the context key of WithAnswerBy's time.
type answerByKey struct{}

// WithAnswerBy returns a copy of ctx under which a write (Create with
// records, Append, a close, Trim) waits for durability until t at most,
// when t comes before Config.AppendTimeout would end the wait: it then
// fails as at that timeout, with ErrUnconfirmed, and what it handed to the
// WAL goes on and may still become durable. A write that reaches the WAL
// only after t, or is still waiting at t for its stream's metadata to be
// read, hands it nothing and fails with ErrTooLate. Unlike a
// context deadline it cancels nothing. A server whose response must be written by a deadline
// of its own passes one a little before it.
func WithAnswerBy(ctx context.Context, t time.Time) context.Context {
	return context.WithValue(ctx, answerByKey{}, t)
}

// CreateRequest creates a stream. Create is idempotent: an existing stream with
// the same ContentType, Expiry and Closed answers Created=false; a different
// one fails with ErrConflict.
type CreateRequest struct {
	ContentType string // empty on a fork: inherit the source's
	Expiry      Expiry
	Closed      bool        // create the stream already closed
	Records     []NewRecord // initial records, possibly none
	Fork        *ForkFrom   // create a fork of another stream
	// Exclusive asks for a new stream only: an existing one with the same
	// configuration fails with ErrExists instead of being confirmed, and
	// that refusal is no access to it (a sliding TTL is not renewed).
	Exclusive bool
	// ConfirmOnly only confirms a stream already under the name (not a
	// fork): finding none, or one deleted or expired, Create answers
	// ErrNotFound and writes nothing. For a create whose initial body is
	// bad: it is judged on its settings alone when the stream exists.
	ConfirmOnly bool
}

// ForkFrom names a fork's source and divergence point. The fork inherits
// the source's records below Seq, then Bytes bytes of what follows (which
// may end inside a record, or reach over several). The fork references the
// source's data; nothing is copied.
type ForkFrom struct {
	Source string
	Seq    uint64
	Bytes  uint64
	// Existing only confirms a fork already under the name: a create that
	// finds no stream there answers ErrNotFound and writes nothing. A
	// caller that took the point from that fork (Info.Fork) uses it, so
	// that a fork it has not looked at is never made there.
	Existing bool
	// Tail says the request named no point: Seq and Bytes are the
	// source's tail, as the caller found it. The fork remembers it.
	Tail bool
}

// ForkOrigin is where a fork branched off: its source, the point its
// create resolved (its inherited records are the source's below Seq, and
// Bytes bytes of record Seq), and Start, the source's first retained seq
// then, where the fork's records begin. Source is empty for a stream that
// is not a fork.
type ForkOrigin struct {
	Source string
	Seq    uint64
	Bytes  uint64
	Start  uint64
	Tail   bool // its create named no point: the source's tail then
}

// Producer is an idempotent producer's claim on an append.
type Producer struct {
	ID    string
	Epoch uint64
	Seq   uint64
}

// AppendRequest appends zero or more records atomically, on consecutive seqs.
// Zero records with Close set is a close-only request.
type AppendRequest struct {
	// ContentType, when not empty, must equal the stream's (a
	// ContentTypeError, matching ErrContentType).
	ContentType string
	Records     []NewRecord
	// Close seals the stream after the records.
	Close bool
	// Producer, when set, makes the append idempotent per (ID, Epoch, Seq).
	Producer *Producer
	// StreamSeq, when not empty, must sort after the last one accepted on
	// this stream (ErrStreamSeq). Durable Streams' Stream-Seq.
	StreamSeq string
	// MatchSeq, when set, requires the stream's next seq to equal it
	// (ErrMatchFailed). Pico-Match-Seq.
	MatchSeq *uint64
}

// AppendResult describes an acknowledged append. It is returned only after
// the append, and every earlier append on the stream, is durable.
type AppendResult struct {
	FirstSeq  uint64 // seq of the first record appended (== NextSeq when none)
	NextSeq   uint64 // the stream's next seq after this append
	Timestamp int64  // timestamp given to the records
	Closed    bool   // the stream is closed now
	// Duplicate is true when a producer retry was recognised and nothing was
	// written; FirstSeq/NextSeq then describe the current tail.
	Duplicate bool
	// ProducerEpoch and ProducerSeq echo the producer state after the append
	// (the highest accepted seq for that epoch).
	ProducerEpoch uint64
	ProducerSeq   uint64
}

// Info is a snapshot of a stream's state, bounded by the durable tail.
type Info struct {
	Name        string
	ID          string // internal id, fresh at every create
	ContentType string
	Expiry      Expiry
	StartSeq    uint64 // first readable seq (above any trim)
	NextSeq     uint64 // durable tail: the seq the next record will get
	Closed      bool
	CreatedAt   time.Time
	// ForkBase is the first seq of the fork's own records (0 for a stream
	// that is not a fork); records below it are inherited.
	ForkBase uint64
	// Fork is where a fork branched off (zero for other streams).
	Fork ForkOrigin
}

// ReadRequest asks for records from Seq on. Reads never return records past
// the durable tail.
type ReadRequest struct {
	Seq uint64
	// Tail reads nothing and answers the tail (offset=now), whatever Seq
	// says; it renews the TTL like any read. (Not an in-band Seq value: a
	// client may send any uint64, and it must be judged as a position.)
	Tail       bool
	MaxRecords int // 0 means no limit
	MaxBytes   int // body and header bytes (ReadWeight); 0 means no limit. At least one record is returned when any exists.
	// Judge, if set, is shown the stream's state and the records read
	// before the read counts as an access: a protocol refuses there what
	// it can only judge with them (a byte position inside a record). Its
	// error is Read's, and then the read neither touches the stream nor
	// renews its TTL.
	Judge func(Info, []Record) error
	// Until, if set, is when the read answers with the records it has
	// rather than wait for more: once it has one, a wait for an object
	// past Until ends it (the object's GET goes on for the next read), and
	// the result is not UpToDate. A catch-up over many objects on a slow
	// store answers within its caller's time instead of past it. An
	// answer-by time in ctx (WithAnswerBy) before it takes its place.
	Until time.Time
}

// ReadResult holds the records read and the stream state at the time of the
// read. UpToDate is true when the result reaches the durable tail.
type ReadResult struct {
	Records  []Record
	Info     Info
	NextSeq  uint64 // seq after the last record returned (the resume point)
	UpToDate bool

	held *holds
}

// Release lets the engine reuse the memory of the records' bodies: call it
// once they are written out, and use none of them after. Copies of a
// result share one release. A result never released costs only that
// reuse.
func (r ReadResult) Release() { r.held.release() }

// conflictError is ErrConflict with its own reason as the whole message:
// wrapping would lead every reason with ErrConflict's "stream exists",
// which is wrong where the stream does not (a fork refused for its content
// type) or is deleted.
type conflictError struct{ reason string }

func (e *conflictError) Error() string        { return e.reason }
func (e *conflictError) Is(target error) bool { return target == ErrConflict }

func conflictf(format string, args ...any) error {
	return &conflictError{reason: fmt.Sprintf(format, args...)}
}

// Errors. Each is matched with errors.Is / errors.As.
var (
	ErrNotFound    = errors.New("stream not found")
	ErrGone        = errors.New("stream is gone") // soft-deleted, or data below the retained start
	ErrConflict    = errors.New("stream exists with a different configuration")
	ErrExists      = errors.New("stream exists, and the create asked for a new one")
	ErrContentType = errors.New("content type does not match the stream")
	ErrStreamSeq   = errors.New("stream-seq is not greater than the last one")
	ErrBadRequest  = errors.New("bad request")
	// ErrUnavailable wraps object-storage failures: nothing was acknowledged
	// and a retry is safe.
	ErrUnavailable = errors.New("storage unavailable")
	// ErrUnconfirmed (always with ErrUnavailable) means the store did not
	// confirm an append in time: it was not acknowledged, but it may still
	// become durable. Only producer headers make a retry safe then. When
	// the storage refused the write for good rather than being slow,
	// StorageRefusal names the cause; a write refused that way before it
	// was handed over has ErrUnavailable without ErrUnconfirmed. A
	// document write (PutDoc, DeleteDoc) has it when it may have landed.
	ErrUnconfirmed = errors.New("the write was not confirmed in time and may still be stored")
	// ErrClosedUnconfirmed (always with ErrUnavailable and
	// ErrUnconfirmed) means the engine closed (a shutdown, or a reload
	// onto other storage) before the store answered for the write: it
	// was not acknowledged, and the next start's replay may still find
	// it. Only producer headers make a retry safe.
	ErrClosedUnconfirmed = errors.New("the engine closed before the store confirmed the write")
	// ErrTakenOver (always with ErrUnavailable) means another process
	// took the storage over: this one writes nothing more, and the write
	// was not stored. A retry is safe, where the storage's owner serves.
	// Reads and waits get it too: this process no longer sees the
	// streams' changes.
	ErrTakenOver = errors.New("another node took the storage over")
	// ErrTooLate (always with ErrUnavailable) means the time WithAnswerBy
	// gave had passed before the write was handed to the WAL: nothing was
	// written, and a retry is safe.
	ErrTooLate = errors.New("the write was not handed to storage before its answer was due")
	// ErrBusy (always with ErrUnavailable) means the appends waiting for
	// storage already hold Config.MaxPending bytes: the store is slower
	// than the appends. Nothing was applied; a retry is safe.
	ErrBusy = errors.New("too many appends are waiting for storage")
	// ErrShuttingDown is returned by waits when the engine or the server is stopping.
	ErrShuttingDown = errors.New("shutting down")
	// ErrDamaged means records this node acknowledged, or a stream's
	// metadata, are in an object of the bucket that fails its checksum or
	// framing (bit rot, a truncated file), or a data object the stream's
	// records need is missing: a retry does not help, and they are not
	// served until the object is restored. It always comes with
	// segment.ErrCorrupt.
	ErrDamaged = errors.New("stored records are damaged")
)

// StorageRefusal reports whether err is a write the storage refuses in a
// way that does not pass by itself (access denied, a read-only or full
// file system), and names the cause briefly, without object keys or paths:
// what a client may be told.
func StorageRefusal(err error) (reason string, ok bool) {
	var refused *segment.RefusedError
	if !errors.As(err, &refused) {
		return "", false
	}
	return refused.Reason(), true
}

// ClosedError: the stream is closed and the append cannot be applied.
type ClosedError struct{ NextSeq uint64 }

func (e *ClosedError) Error() string { return fmt.Sprintf("stream is closed at seq %d", e.NextSeq) }

// ContentTypeError: an append's content type is not its stream's. It
// matches ErrContentType; it names both types, so that a client that
// sent another type than it meant (curl's --data sends
// application/x-www-form-urlencoded) sees which.
type ContentTypeError struct{ Sent, Stream string }

func (e *ContentTypeError) Error() string {
	return fmt.Sprintf("content type %s does not match the stream's (%s)", e.Sent, e.Stream)
}

// Is makes a ContentTypeError match ErrContentType.
func (e *ContentTypeError) Is(target error) bool { return target == ErrContentType }

// TrimmedError: a position is below the stream's first retained seq, so
// the records it needs were trimmed. It matches ErrGone.
type TrimmedError struct{ Seq, StartSeq uint64 }

func (e *TrimmedError) Error() string {
	return fmt.Sprintf("seq %d is below the first retained seq %d", e.Seq, e.StartSeq)
}

// Is makes a TrimmedError match ErrGone.
func (e *TrimmedError) Is(target error) bool { return target == ErrGone }

// MatchError: MatchSeq did not equal the stream's next seq.
type MatchError struct{ NextSeq uint64 }

func (e *MatchError) Error() string {
	return fmt.Sprintf("match seq failed: stream is at seq %d", e.NextSeq)
}

// FencedError: the producer epoch is older than the stream's current one.
type FencedError struct{ CurrentEpoch uint64 }

func (e *FencedError) Error() string {
	return fmt.Sprintf("producer epoch is stale; current epoch is %d", e.CurrentEpoch)
}

// SequenceGapError: the producer seq skipped ahead of the expected one.
type SequenceGapError struct{ Expected, Received uint64 }

func (e *SequenceGapError) Error() string {
	return fmt.Sprintf("producer seq gap: expected %d, received %d", e.Expected, e.Received)
}

// EpochStartError: a producer's first append of a new epoch has a seq
// other than 0. It matches ErrBadRequest, as Durable Streams answers it
// (400); Pico reports it as the gap it is from the 0 the epoch starts at.
type EpochStartError struct{ Received uint64 }

func (e *EpochStartError) Error() string {
	return ErrBadRequest.Error() + ": a new producer epoch must start at seq 0"
}

// Is makes the error match ErrBadRequest.
func (e *EpochStartError) Is(target error) bool { return target == ErrBadRequest }

// MaxProducerIDLength and MaxStreamSeqLength bound the producer id and the
// Stream-Seq value an append may carry, in bytes. Both are kept in the
// stream's writer state for as long as the stream lives (a producer's state
// is never dropped, as section 5.2.1 asks of persistent stores), loaded
// with it and rewritten at every checkpoint: without a bound, every append
// could add as much as the HTTP header limit lets a client send.
const (
	MaxProducerIDLength = 256
	MaxStreamSeqLength  = 256
)

// MaxNameLength is the longest stream name, in bytes, that the engine stores.
const MaxNameLength = 256

// MaxContentTypeLength bounds, in bytes, the content type a new stream is
// created with. It is kept in the stream's metadata for as long as the
// stream lives, held with the stream in memory and sent with every read,
// HEAD and listing entry: without a bound a create could give it as much
// as the HTTP header limit lets a client send (16 KiB by default in Caddy,
// more where a site raises it), 64 times this, in every stream it made.
// Media type names are at most 127 characters each (RFC 6838 section
// 4.2).
const MaxContentTypeLength = 256

// validateNewName refuses a control character (C0, DEL, C1) in the name of
// a stream to create, whatever the protocol: no client can type one, a
// listing or terminal shows the name as another (a CR moves back over what
// came before), and names go into Location headers and webhook payloads.
// ValidateName, which every request passes, does not: a stream made before
// this rule can still be read and deleted.
func validateNewName(name string) error {
	if i := strings.IndexFunc(name, unicode.IsControl); i >= 0 {
		c, _ := utf8.DecodeRuneInString(name[i:])
		return fmt.Errorf("%w: stream name has the control character %U at byte %d; new streams may not", ErrBadRequest, c, i)
	}
	return nil
}

// ValidateName checks a stream name before any I/O: it must start with '/',
// be at most MaxNameLength bytes of UTF-8, and hold no NUL byte and no
// empty, "." or ".." segment.
func ValidateName(name string) error {
	if len(name) < 2 || name[0] != '/' {
		return fmt.Errorf("%w: stream name must be a path below /", ErrBadRequest)
	}
	if len(name) > MaxNameLength {
		return fmt.Errorf("%w: stream name is %d bytes; the limit is %d", ErrBadRequest, len(name), MaxNameLength)
	}
	// Names go out as JSON strings (Pico listings, subscription
	// documents), which carry UTF-8 only: other bytes come back as
	// U+FFFD, a name the client cannot address, and two such names read
	// the same. A listing page ending at one then continues after the
	// U+FFFD form, which sorts before the real bytes, and repeats itself
	// for good.
	if !utf8.ValidString(name) {
		return fmt.Errorf("%w: stream name is not valid UTF-8", ErrBadRequest)
	}
	// Every request checks its name, live feeds at every wake-up: walk the
	// segments in place rather than split them into a new slice.
	rest := name[1:]
	for {
		seg, tail, more := strings.Cut(rest, "/")
		switch {
		case seg == "" || seg == "." || seg == "..":
			return fmt.Errorf("%w: stream name has an empty, '.' or '..' segment", ErrBadRequest)
		case strings.IndexByte(seg, 0) >= 0:
			return fmt.Errorf("%w: stream name contains a NUL byte", ErrBadRequest)
		}
		if !more {
			return nil
		}
		rest = tail
	}
}
