package segment

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/picomq/caddy-picomq/internal/workers"
)

// ErrWriterUnavailable is returned by Writer.Add while the writer cannot
// accept entries: an upload failed and its outcome is being settled, or the
// writer is closed.
var ErrWriterUnavailable = errors.New("WAL writer unavailable")

// ErrClosedUnsettled is in the error of a batch aborted because the
// writer closed while the store had not answered for its upload nor let
// a seal settle it: its fate is unknown, and the next replay may find it.
var ErrClosedUnsettled = errors.New("the WAL writer closed before the batch's fate was known")

// ErrWriterBusy is returned by Writer.Add and Writer.Reserve while the
// bytes waiting for storage already reach WriterConfig.MaxPending: a store
// that slows down must not make the writer grow without bound.
var ErrWriterBusy = errors.New("WAL writer busy: too many bytes waiting for upload")

// DefaultMaxPending is WriterConfig.MaxPending when it is not set: far above
// what a healthy store leaves waiting (the bytes of a few flush intervals
// plus a PUT), and a bound on memory when the store stalls.
const DefaultMaxPending = 64 << 20

// uploaderLinger is how long a goroutine that ran an upload waits for the
// next one before it ends.
const uploaderLinger = 2 * time.Second

// WriterConfig tunes group commit.
//
// FlushInterval spaces upload starts rather than delaying each batch: an
// entry that arrives when no upload has started for FlushInterval goes out
// at once, and under load a batch starts every FlushInterval. So the store
// sees at most one PUT per FlushInterval (bar FlushSize overflows) while an
// isolated append pays only the PUT's own latency, not a linger on top.
type WriterConfig struct {
	FlushInterval time.Duration // least time between the starts of two uploads
	FlushSize     int           // encoded bytes that start an upload at once
	MaxInFlight   int           // uploads in flight at once
	// FlushQuiet, when set, holds a batch whose upload could start until
	// no entry has arrived for FlushQuiet (or the batch has been open for
	// FlushInterval): closed-loop writers answered by one upload come back
	// as a burst, and this lets the burst share the next upload instead of
	// its first arrival taking the slot alone.
	FlushQuiet time.Duration
	// MaxPending bounds the memory held by entries added and not yet
	// released (open, uploading or waiting to be settled), as pendingSize
	// counts it, plus the bytes reserved by Reserve; past it Add, Extend
	// and Reserve refuse. It may be passed by one entry's or one
	// reservation's worth.
	MaxPending int
}

// Hooks receive batch outcomes strictly in WAL order, from one goroutine at
// a time, before the batch's waiters are released.
type Hooks interface {
	// Committed: every entry of b is durable.
	Committed(b *Batch)
	// Aborted: no entry of b will ever be durable or replayed.
	Aborted(b *Batch, err error)
}

// NamespaceFunc registers a fresh WAL namespace (in the manifest) and
// returns it. The writer calls it when it must abandon its namespace.
type NamespaceFunc func(ctx context.Context) (uint64, error)

// Batch is a group of entries uploaded as one WAL object.
type Batch struct {
	Namespace uint64
	Seq       uint64
	Key       string
	Entries   []*Entry
	Spans     []Span // filled once encoded

	size     int  // encoded bytes, for FlushSize
	mem      int  // what the entries hold in memory, counted in pending
	uploaded bool // the PUT returned success
	failed   error
	finished bool // upload attempt over (success or failure)
	doomed   bool // never uploaded: it was open when an earlier upload failed
	lost     bool // aborted, and certain never to be replayed

	done chan struct{}
	err  error

	// stall is closed, with stallErr set, when the batch's settlement
	// met an error that will not pass by itself (see Permanent): its
	// outcome is still settled in order, but its waiters need not wait.
	stall    chan struct{}
	stallErr error
}

// Done is closed when the batch's outcome is known; Err then tells it.
func (b *Batch) Done() <-chan struct{} { return b.done }

// Stalled is closed when the storage refused the batch's upload, or its
// settlement, with an error that needs the operator (a read-only file
// system, a permission denied, a full disk): its fate stays unknown until
// the storage takes writes again, which may be long. StallErr then tells
// the cause.
func (b *Batch) Stalled() <-chan struct{} { return b.stall }

// StallErr is the cause of a stall, once Stalled is closed.
func (b *Batch) StallErr() error { return b.stallErr }

// Err is nil once the batch is committed, or the reason it was aborted.
func (b *Batch) Err() error { return b.err }

// Lost reports, for an aborted batch, that no replay will ever see it: a
// seal took the place of its failed upload (or of an earlier one in its
// namespace), or it was never uploaded. What only it refers to can go. A
// batch aborted with its fate unknown (the writer closed while the store
// was unreachable, or another process took the storage over) is not lost
// as far as anyone can tell.
func (b *Batch) Lost() bool { return b.lost }

// WALKey is the object key of WAL object seq in namespace ns.
func WALKey(ns, seq uint64) string { return fmt.Sprintf("wal/%016x/%016x", ns, seq) }

// WALNamespace spells namespace ns as its WAL keys do (wal/<ns>/...), for
// logs an operator holds next to a listing of the bucket.
func WALNamespace(ns uint64) string { return fmt.Sprintf("%016x", ns) }

// WALPrefix is the key prefix of namespace ns.
func WALPrefix(ns uint64) string { return fmt.Sprintf("wal/%016x/", ns) }

// WriterDeps are what a writer needs from its owner.
type WriterDeps struct {
	Hooks        Hooks
	NewNamespace NamespaceFunc
	// Token identifies this process in the seals it writes, so a seal of
	// another process (one that took the storage over) is recognised.
	Token string
	// Check, when set, says why nothing may be written now (the storage
	// lease is not certainly ours); nil means go ahead.
	Check func() error
}

// Writer batches entries from all streams into WAL objects: group commit.
// Several uploads may be in flight; outcomes are released strictly in order.
type Writer struct {
	store Store
	deps  WriterDeps
	cfg   WriterConfig

	mu        sync.Mutex
	ns        uint64
	nextSeq   uint64
	open      *Batch
	queue     []*Batch // sealed batches in WAL order, not yet released
	inFlight  int
	pending   int // memory held by entries added and not yet released, and bytes reserved
	timer     *time.Timer
	lastStart time.Time // when the latest upload started
	lastAdd   time.Time // when the latest entry joined the open batch
	opened    time.Time // when the open batch got its first entry
	wantFlush bool
	broken    bool // an upload failed; Add refuses until it is settled
	// stallCause is the error that will not pass by itself which stalled
	// the settlement under way, if any: Add names it when it refuses.
	stallCause error
	fenced     error // another process took the storage over: for good
	closed     bool
	// settling is set while release settles batches it took off the
	// queue: Close waits for their outcome as for the queue's.
	settling bool
	idle     *sync.Cond // signalled when queue empties or a settlement ends

	// Uploads run on goroutines that stay for the next one: the S3
	// client's calls are deep, and a goroutine per upload grew a fresh
	// stack every time.
	uploaders *workers.Pool

	releaseMu sync.Mutex // serialises hook calls so they stay in order
	ctx       context.Context
	cancel    context.CancelFunc
}

// NewWriter starts a writer in namespace ns at WAL sequence seq.
func NewWriter(store Store, ns, seq uint64, cfg WriterConfig, deps WriterDeps) *Writer {
	if cfg.FlushInterval <= 0 {
		cfg.FlushInterval = 20 * time.Millisecond
	}
	if cfg.FlushSize <= 0 {
		cfg.FlushSize = 1 << 20
	}
	if cfg.MaxInFlight <= 0 {
		cfg.MaxInFlight = 4
	}
	if cfg.MaxPending <= 0 {
		cfg.MaxPending = DefaultMaxPending
	}
	ctx, cancel := context.WithCancel(context.Background())
	w := &Writer{store: store, deps: deps, cfg: cfg, ns: ns, nextSeq: seq, ctx: ctx, cancel: cancel,
		uploaders: workers.New(uploaderLinger)}
	w.idle = sync.NewCond(&w.mu)
	return w
}

func (w *Writer) check() error {
	if w.deps.Check == nil {
		return nil
	}
	return w.deps.Check()
}

// Fence stops the writer for good: another process owns the storage now.
// Entries not yet released are aborted in order as their uploads end.
func (w *Writer) Fence(cause error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.fenced == nil {
		if errors.Is(cause, ErrFenced) {
			w.fenced = cause
		} else {
			w.fenced = fmt.Errorf("%w: %v", ErrFenced, cause)
		}
	}
}

// SetConfig changes the flush settings; it takes effect from the next batch.
func (w *Writer) SetConfig(cfg WriterConfig) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if cfg.FlushInterval > 0 {
		w.cfg.FlushInterval = cfg.FlushInterval
	}
	if cfg.FlushSize > 0 {
		w.cfg.FlushSize = cfg.FlushSize
	}
	if cfg.MaxInFlight > 0 {
		w.cfg.MaxInFlight = cfg.MaxInFlight
	}
	if cfg.MaxPending > 0 {
		w.cfg.MaxPending = cfg.MaxPending
	}
	w.cfg.FlushQuiet = cfg.FlushQuiet
}

// Reserve counts n bytes that wait for storage outside the writer (a large
// append's own upload, before its entry is added) against MaxPending. It
// refuses with ErrWriterBusy when MaxPending bytes already wait; otherwise
// the returned func gives the bytes back, once.
func (w *Writer) Reserve(n int) (unreserve func(), err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.pending >= w.cfg.MaxPending {
		return nil, ErrWriterBusy
	}
	w.pending += n
	var once sync.Once
	return func() {
		once.Do(func() {
			w.mu.Lock()
			w.pending -= n
			w.mu.Unlock()
		})
	}, nil
}

// Pending returns the memory held by the entries added and not yet
// released (see pendingSize), and the bytes of reservations not yet given
// back.
func (w *Writer) Pending() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.pending
}

// Position returns the namespace and the next WAL sequence to be assigned.
func (w *Writer) Position() (ns, seq uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.ns, w.nextSeq
}

// Add puts e into the open batch and returns that batch. The caller must add
// a stream's entries in that stream's order; batches preserve it.
func (w *Writer) Add(e *Entry) (*Batch, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.fenced != nil {
		return nil, w.fenced
	}
	if w.broken && w.stallCause != nil {
		return nil, fmt.Errorf("%w: %w", ErrWriterUnavailable, &RefusedError{Cause: w.stallCause})
	}
	if w.broken || w.closed {
		return nil, ErrWriterUnavailable
	}
	if err := w.check(); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrWriterUnavailable, err)
	}
	if w.pending >= w.cfg.MaxPending {
		return nil, ErrWriterBusy
	}
	if w.open == nil {
		w.open = &Batch{done: make(chan struct{}), stall: make(chan struct{})}
		// A wish to flush belongs to the batch open when it was made. One
		// left by a batch doomed with a failed upload, or by a Flush with
		// nothing open, would keep this batch from arming its timer, and
		// with no upload in flight to seal it, it would never go out.
		w.wantFlush = false
	}
	b := w.open
	b.Entries = append(b.Entries, e)
	n, m := entrySize(e), pendingSize(e)
	b.size += n
	b.mem += m
	w.pending += m
	now := time.Now()
	if len(b.Entries) == 1 {
		w.opened = now
	}
	w.lastAdd = now
	if b.size >= w.cfg.FlushSize {
		w.wantFlush = true
		w.sealLocked()
	} else if !w.wantFlush && w.timer == nil {
		w.scheduleLocked(now)
	}
	return b, nil
}

// Extend grows an entry of b while b is still the open batch: grow runs
// under the writer's lock, changes the entry (b's encoding happens only
// once it is sealed) and returns how many encoded bytes it added, and how
// much memory (counted as pendingSize counts an entry's). It
// reports false, without calling grow, when b was sealed meanwhile or the
// writer cannot take entries; the caller then adds a new entry. A stream
// whose appends arrive faster than batches go out so puts one entry per
// batch in the WAL, not one per append.
func (w *Writer) Extend(b *Batch, grow func() (size, mem int)) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if b == nil || w.open != b || w.broken || w.closed || w.fenced != nil || w.check() != nil ||
		w.pending >= w.cfg.MaxPending {
		return false
	}
	n, m := grow()
	b.size += n
	b.mem += m
	w.pending += m
	w.lastAdd = time.Now()
	if b.size >= w.cfg.FlushSize {
		w.wantFlush = true
		w.sealLocked()
	}
	return true
}

// sealWaitLocked returns how long the open batch has to wait before its
// upload may start: until FlushInterval after the latest upload's start,
// and, with FlushQuiet, until arrivals pause (at most FlushInterval after
// the batch opened).
func (w *Writer) sealWaitLocked(now time.Time) time.Duration {
	wait := w.cfg.FlushInterval - now.Sub(w.lastStart)
	if q := w.cfg.FlushQuiet; q > 0 {
		until := w.lastAdd.Add(q)
		if limit := w.opened.Add(w.cfg.FlushInterval); limit.Before(until) {
			until = limit
		}
		wait = max(wait, until.Sub(now))
	}
	return wait
}

// scheduleLocked starts the open batch's upload now or arms the timer that
// will. A timer that fires early (entries kept arriving) re-arms itself,
// so Add never has to reset one.
func (w *Writer) scheduleLocked(now time.Time) {
	if wait := w.sealWaitLocked(now); wait > 0 {
		var t *time.Timer
		t = time.AfterFunc(wait, func() {
			w.mu.Lock()
			defer w.mu.Unlock()
			if w.timer != t {
				return
			}
			w.timer = nil
			if w.open != nil && len(w.open.Entries) > 0 && !w.wantFlush {
				w.scheduleLocked(time.Now())
			}
		})
		w.timer = t
		return
	}
	w.wantFlush = true
	w.sealLocked()
}

// sealLocked turns the open batch into an upload when a flush is wanted and
// an upload slot is free. A batch that cannot start yet keeps growing, so a
// saturated store sees fewer, larger PUTs.
func (w *Writer) sealLocked() {
	if !w.wantFlush || w.open == nil || len(w.open.Entries) == 0 || w.broken {
		return
	}
	if w.inFlight >= w.cfg.MaxInFlight {
		return
	}
	if w.ctx.Err() != nil {
		// Close gave up waiting and is stopping the uploaders: an upload
		// started now would run where Close does not wait for it, and
		// settle the batch through the hooks after the owner has closed.
		// The batch goes unsent instead, doomed as after a failed upload;
		// only an upload that just ended frees a slot here, and the
		// release it makes next settles the batch, failing its waiters.
		w.open.failed = errClosedUnsent
		w.doomOpenLocked()
		return
	}
	b := w.open
	w.open = nil
	w.wantFlush = false
	if w.timer != nil {
		w.timer.Stop()
		w.timer = nil
	}
	b.Namespace, b.Seq = w.ns, w.nextSeq
	b.Key = WALKey(b.Namespace, b.Seq)
	w.nextSeq++
	w.lastStart = time.Now()
	w.queue = append(w.queue, b)
	w.inFlight++
	if !w.uploaders.Go(func() { w.upload(b) }) {
		// Not expected: Close cancels w.ctx, checked above under w.mu,
		// before it stops the pool. Should it happen, the batch fails
		// unsent here and its seal settles it, never on a goroutine
		// Close does not wait for.
		w.failLocked(b, errClosedUnsent)
	}
}

// errClosedUnsent is the failure of a batch that Close left no upload to.
var errClosedUnsent = errors.New("the WAL writer closed before the batch could be uploaded")

// doomOpenLocked queues the open batch, if it has entries, as one never
// uploaded: it is released in order, aborted with the failed upload
// before it (or, first in line, on its own), and never replayed.
func (w *Writer) doomOpenLocked() {
	if w.open != nil && len(w.open.Entries) > 0 {
		w.open.doomed = true
		w.open.finished = true
		w.queue = append(w.queue, w.open)
	}
	w.open = nil
	w.broken = true
}

// failLocked records that b's upload attempt is over and failed with err,
// and stops the writer until the failure is settled.
func (w *Writer) failLocked(b *Batch, err error) {
	b.finished = true
	w.inFlight--
	b.failed = fmt.Errorf("put wal %s: %w", b.Key, err)
	if !w.broken {
		// Entries still open would get seqs above a batch whose fate
		// is unknown; they are doomed with it and released in order.
		w.doomOpenLocked()
	}
}

func (w *Writer) upload(b *Batch) {
	data, spans := EncodeWAL(b.Namespace, b.Seq, b.Entries)
	// Past the lease's certain validity nothing is uploaded: the batch
	// fails and is settled by a seal like any failed upload.
	err := w.check()
	if err == nil {
		w.mu.Lock()
		err = w.fenced
		w.mu.Unlock()
	}
	if err == nil {
		_, err = w.store.Put(w.ctx, b.Key, data, PutOptions{IfNoneMatch: true})
	}
	w.mu.Lock()
	b.Spans = spans
	if err == nil {
		b.finished = true
		w.inFlight--
		b.uploaded = true
	} else {
		w.failLocked(b, err)
	}
	if !w.broken {
		w.sealLocked()
	}
	w.mu.Unlock()
	w.release()
}

// release hands finished batches at the head of the queue to the hooks, in
// order. A failed head starts settlement once nothing is in flight.
func (w *Writer) release() {
	w.releaseMu.Lock()
	defer w.releaseMu.Unlock()
	for {
		w.mu.Lock()
		if len(w.queue) == 0 {
			w.idle.Broadcast()
			w.mu.Unlock()
			return
		}
		head := w.queue[0]
		if !head.finished {
			w.mu.Unlock()
			return
		}
		if !head.uploaded {
			// Settle only when every upload has returned, so the fate of
			// each batch is fixed before we seal.
			if w.inFlight > 0 {
				w.mu.Unlock()
				return
			}
			queue := w.queue
			w.queue = nil
			w.settling = true
			w.mu.Unlock()
			w.settle(queue)
			w.mu.Lock()
			w.settling = false
			w.mu.Unlock()
			continue
		}
		w.queue = w.queue[1:]
		w.pending -= head.mem
		w.mu.Unlock()
		w.deps.Hooks.Committed(head)
		close(head.done)
	}
}

// settle decides the fate of queue, whose first unuploaded batch failed.
// Batches that were uploaded before the first failure are committed. At a
// failure we seal the namespace at that sequence with if-none-match: if the
// seal wins, the upload can never land, so that batch and all after it are
// aborted and the writer moves to a new namespace. If the seal loses, the
// upload did land: the batch rolls forward and we go on to the next one.
func (w *Writer) settle(queue []*Batch) {
	for i, b := range queue {
		if b.uploaded {
			w.deps.Hooks.Committed(b)
			w.finish(b)
			continue
		}
		cause := b.failed
		if cause == nil {
			cause = errors.New("an earlier WAL upload failed")
		}
		// A doomed batch was never given a WAL sequence, so only a batch
		// whose upload failed needs a seal to fix its fate.
		if !b.doomed {
			// Two quick tries first: a seal that lands gives the
			// waiters a definite answer. One that the storage refuses
			// in a way that will not pass by itself (a read-only file
			// system, a denied permission) cannot land until the
			// operator acts: the waiters are told now rather than at
			// their timeout, and the seal is retried meanwhile.
			outcome, err := seal(w.ctx, w.store, b.Namespace, b.Seq, w.deps.Token, 2, true)
			if err != nil && w.ctx.Err() == nil {
				if Permanent(err) {
					w.stall(queue[i:], err)
				}
				outcome, err = seal(w.ctx, w.store, b.Namespace, b.Seq, w.deps.Token, 0, true)
			}
			switch {
			case err != nil:
				if w.ctx.Err() != nil { // closed while the store was unreachable
					err = fmt.Errorf("%w: %w", ErrClosedUnsettled, err)
				}
				w.abort(queue[i:], err, false)
				return
			case outcome == sealLanded:
				w.deps.Hooks.Committed(b)
				w.finish(b)
				continue
			case outcome == sealForeign:
				// Another process replayed our namespace and sealed it:
				// it owns the storage now. Never write again.
				w.Fence(fmt.Errorf("namespace %d sealed by another process at %d", b.Namespace, b.Seq))
				w.abort(queue[i:], ErrFenced, false)
				return
			}
		}
		// Replay stops at the seal: neither this batch nor any after it
		// in the namespace, uploaded or not, will ever be read. (A doomed
		// batch first in line was never given a sequence: nothing of it
		// or after it was uploaded.)
		w.abort(queue[i:], cause, true)
		if w.ctx.Err() == nil {
			// A writer that Close gave up on writes nothing more: it
			// needs no namespace, and its owner may be gone.
			w.switchNamespace()
		}
		return
	}
	// Every batch landed after all: carry on in the same namespace.
	w.mu.Lock()
	w.broken, w.stallCause = false, nil
	w.mu.Unlock()
}

// stall tells the waiters of batches that their settlement is held up by
// cause; each batch is told once.
func (w *Writer) stall(batches []*Batch, cause error) {
	w.mu.Lock()
	w.stallCause = cause
	w.mu.Unlock()
	for _, b := range batches {
		if b.stall == nil || b.stallErr != nil {
			continue
		}
		b.stallErr = cause
		close(b.stall)
	}
}

// abort releases batches, aborted with cause (kept in Err's chain, for
// its owner to tell ErrFenced and ErrClosedUnsettled apart).
func (w *Writer) abort(batches []*Batch, cause error, lost bool) {
	err := fmt.Errorf("%w: %w", ErrWriterUnavailable, cause)
	for _, b := range batches {
		b.err, b.lost = err, lost
		w.deps.Hooks.Aborted(b, err)
		w.finish(b)
	}
}

// finish releases b's waiters and takes its bytes off the pending count,
// for a batch released outside release's loop (which does both itself).
func (w *Writer) finish(b *Batch) {
	w.mu.Lock()
	w.pending -= b.mem
	w.mu.Unlock()
	close(b.done)
}

func (w *Writer) switchNamespace() {
	for attempt := 0; ; attempt++ {
		ns, err := w.deps.NewNamespace(w.ctx)
		if err == nil {
			w.mu.Lock()
			w.ns, w.nextSeq, w.broken, w.stallCause = ns, 0, false, nil
			w.mu.Unlock()
			return
		}
		if errors.Is(err, ErrFenced) {
			w.Fence(err)
			return
		}
		if sleepBackoff(w.ctx, attempt) != nil {
			return
		}
	}
}

// sleepBackoff waits an exponentially growing, jittered delay (50 ms up to
// 5 s) or until ctx ends.
func sleepBackoff(ctx context.Context, attempt int) error {
	d := 50 * time.Millisecond << min(attempt, 7)
	d = min(d, 5*time.Second)
	d = d/2 + time.Duration(rand.Int64N(int64(d/2)+1))
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// Flush uploads the open batch now, whatever its size.
func (w *Writer) Flush() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.wantFlush = true
	w.sealLocked()
}

// Close stops accepting entries, uploads what is open and waits for every
// outcome to be released, or for ctx to end; then it stops background work.
func (w *Writer) Close(ctx context.Context) error {
	w.mu.Lock()
	w.closed = true
	w.wantFlush = true
	w.sealLocked()
	done := make(chan struct{})
	go func() {
		w.mu.Lock()
		for len(w.queue) > 0 || w.settling || (w.open != nil && len(w.open.Entries) > 0 && !w.broken) {
			w.idle.Wait()
		}
		w.mu.Unlock()
		close(done)
	}()
	w.mu.Unlock()
	var err error
	select {
	case <-done:
	case <-ctx.Done():
		err = fmt.Errorf("close wal writer: %w", ctx.Err())
	}
	// Under w.mu: sealLocked, which checks w.ctx under it, then never
	// hands the pool an upload once the pool has begun to close.
	w.mu.Lock()
	w.cancel()
	w.mu.Unlock()
	w.uploaders.Close()
	if err != nil {
		w.mu.Lock()
		w.idle.Broadcast()
		w.mu.Unlock()
	}
	return err
}
