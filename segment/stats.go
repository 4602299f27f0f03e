package segment

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"time"
)

// Op is a kind of object-store request, as counted by RequestStats.
type Op uint8

// The operations of Store, as requests: a Get of length 0 is a HEAD.
const (
	OpPut Op = iota
	OpGet
	OpHead
	OpList
	OpDelete
	numOps
)

// Ops lists every Op, in order.
var Ops = [numOps]Op{OpPut, OpGet, OpHead, OpList, OpDelete}

// String returns the operation's lowercase name, as used in error messages
// and metric labels.
func (o Op) String() string {
	switch o {
	case OpPut:
		return "put"
	case OpGet:
		return "get"
	case OpHead:
		return "head"
	case OpList:
		return "list"
	case OpDelete:
		return "delete"
	}
	return "unknown"
}

// Outcome is how one request attempt ended.
type Outcome uint8

// Outcomes of an attempt. Not found and precondition failed are answers,
// not failures: the caller asked a question and got it answered.
const (
	OutcomeOK Outcome = iota
	OutcomeNotFound
	OutcomePreconditionFailed
	OutcomeTimeout // a deadline cut the attempt off: its own timeout (then it is retried) or the caller's
	OutcomeError   // anything else: an error status, a transport error, the caller giving up
	numOutcomes
)

// Outcomes lists every Outcome, in order.
var Outcomes = [numOutcomes]Outcome{OutcomeOK, OutcomeNotFound, OutcomePreconditionFailed, OutcomeTimeout, OutcomeError}

// String returns the outcome's name as used in metric labels.
func (o Outcome) String() string {
	switch o {
	case OutcomeOK:
		return "ok"
	case OutcomeNotFound:
		return "not_found"
	case OutcomePreconditionFailed:
		return "precondition_failed"
	case OutcomeTimeout:
		return "timeout"
	case OutcomeError:
		return "error"
	}
	return "unknown"
}

// outcomeOf classifies the result of one attempt.
func outcomeOf(err error, timedOut bool) Outcome {
	switch {
	case err == nil:
		return OutcomeOK
	case errors.Is(err, ErrNotFound):
		return OutcomeNotFound
	case errors.Is(err, ErrPreconditionFailed):
		return OutcomePreconditionFailed
	case timedOut || errors.Is(err, context.DeadlineExceeded):
		return OutcomeTimeout
	default:
		return OutcomeError
	}
}

// UploadBuckets are the upper bounds, in seconds, of the upload duration
// histogram buckets of RequestStats. They start at a millisecond: a WAL
// PUT to a store in the same zone or on the same machine takes a few, and
// telling 1 from 4 ms is what tuning flush_interval against it needs.
var UploadBuckets = [...]float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}

// Histogram counts durations into UploadBuckets with atomic adds only, so
// it can sit on a request path. The zero value is ready to use.
type Histogram struct {
	counts [len(UploadBuckets) + 1]atomic.Uint64 // per bucket, not cumulative; the last is +Inf
	sumNs  atomic.Int64
}

// Observe adds one duration.
func (h *Histogram) Observe(d time.Duration) {
	s := d.Seconds()
	i := 0
	for i < len(UploadBuckets) && s > UploadBuckets[i] {
		i++
	}
	h.counts[i].Add(1)
	h.sumNs.Add(int64(d))
}

// HistogramSnapshot is a Histogram read at one moment.
type HistogramSnapshot struct {
	// Cumulative[i] counts the durations of at most UploadBuckets[i]
	// seconds.
	Cumulative [len(UploadBuckets)]uint64
	// Count of every duration, Sum of them in seconds.
	Count uint64
	Sum   float64
}

// Snapshot reads the histogram. Concurrent observations may be half seen
// (counted but not yet summed); the count always agrees with the buckets.
func (h *Histogram) Snapshot() HistogramSnapshot {
	var s HistogramSnapshot
	var n uint64
	for i := range h.counts {
		n += h.counts[i].Load()
		if i < len(s.Cumulative) {
			s.Cumulative[i] = n
		}
	}
	s.Count = n
	s.Sum = float64(h.sumNs.Load()) / float64(time.Second)
	return s
}

// UploadKind tells WAL uploads from other PUTs in RequestStats.
type UploadKind uint8

// Kinds of upload.
const (
	UploadWAL   UploadKind = iota // a WAL object (or its seal): what acknowledgements wait for
	UploadOther                   // metadata, data objects, the manifest, the lease, documents
	numUploadKinds
)

// UploadKinds lists every UploadKind, in order.
var UploadKinds = [numUploadKinds]UploadKind{UploadWAL, UploadOther}

// String returns the kind's name as used in metric labels.
func (k UploadKind) String() string {
	if k == UploadWAL {
		return "wal"
	}
	return "other"
}

func uploadKindOf(key string) UploadKind {
	if strings.HasPrefix(key, "wal/") {
		return UploadWAL
	}
	return UploadOther
}

// RequestStats counts the requests a Store makes, by operation and outcome,
// one per attempt (an S3 request retried three times counts three), and
// times every PUT attempt. Give one to Open with OpenOptions.Stats and read
// it at any time; counting costs a few atomic adds per attempt. A nil
// *RequestStats counts nothing.
type RequestStats struct {
	requests [numOps][numOutcomes]atomic.Uint64
	uploads  [numUploadKinds]Histogram
}

// Requests returns how many attempts of op ended with outcome.
func (s *RequestStats) Requests(op Op, outcome Outcome) uint64 {
	if s == nil || op >= numOps || outcome >= numOutcomes {
		return 0
	}
	return s.requests[op][outcome].Load()
}

// Uploads returns the duration histogram of PUT attempts of kind.
func (s *RequestStats) Uploads(kind UploadKind) HistogramSnapshot {
	if s == nil || kind >= numUploadKinds {
		return HistogramSnapshot{}
	}
	return s.uploads[kind].Snapshot()
}

// observe records one attempt of op on key that took d.
func (s *RequestStats) observe(op Op, key string, d time.Duration, outcome Outcome) {
	if s == nil {
		return
	}
	s.requests[op][outcome].Add(1)
	if op == OpPut {
		s.uploads[uploadKindOf(key)].Observe(d)
	}
}

// observedFileStore is a FileStore that counts its calls in a RequestStats.
// A local directory has no retries: one call is one attempt.
type observedFileStore struct {
	*FileStore
	stats *RequestStats
}

func (s observedFileStore) Put(ctx context.Context, key string, data []byte, opts PutOptions) (string, error) {
	start := time.Now()
	etag, err := s.FileStore.Put(ctx, key, data, opts)
	s.stats.observe(OpPut, key, time.Since(start), outcomeOf(err, false))
	return etag, err
}

func (s observedFileStore) Get(ctx context.Context, key string, offset, length int64) ([]byte, string, error) {
	op := OpGet
	if length == 0 {
		op = OpHead
	}
	start := time.Now()
	data, etag, err := s.FileStore.Get(ctx, key, offset, length)
	s.stats.observe(op, key, time.Since(start), outcomeOf(err, false))
	return data, etag, err
}

// GetBuffer implements BufferGetter. Without it the embedded FileStore's
// method would be promoted and the data objects cold readers read would go
// uncounted.
func (s observedFileStore) GetBuffer(ctx context.Context, key string, alloc func(n int) []byte) ([]byte, error) {
	start := time.Now()
	data, err := s.FileStore.GetBuffer(ctx, key, alloc)
	s.stats.observe(OpGet, key, time.Since(start), outcomeOf(err, false))
	return data, err
}

func (s observedFileStore) List(ctx context.Context, prefix, startAfter string, max int) ([]ObjectInfo, bool, error) {
	start := time.Now()
	objs, more, err := s.FileStore.List(ctx, prefix, startAfter, max)
	s.stats.observe(OpList, prefix, time.Since(start), outcomeOf(err, false))
	return objs, more, err
}

func (s observedFileStore) Delete(ctx context.Context, keys []string) error {
	start := time.Now()
	err := s.FileStore.Delete(ctx, keys)
	s.stats.observe(OpDelete, "", time.Since(start), outcomeOf(err, false))
	return err
}

func (s observedFileStore) DeleteIfMatch(ctx context.Context, key, etag string) error {
	start := time.Now()
	err := s.FileStore.DeleteIfMatch(ctx, key, etag)
	s.stats.observe(OpDelete, key, time.Since(start), outcomeOf(err, false))
	return err
}
