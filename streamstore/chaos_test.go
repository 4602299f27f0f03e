package streamstore

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// The chaos test's knobs. PICOMQ_CHAOS_SEED replays a run's fault and crash
// decisions (the goroutines' interleaving still varies from run to run);
// PICOMQ_CHAOS_RUN runs it longer, e.g. "60s", to hunt for rare failures.
const (
	chaosSeedEnv    = "PICOMQ_CHAOS_SEED"
	chaosRunEnv     = "PICOMQ_CHAOS_RUN"
	chaosRunDefault = 9 * time.Second
	chaosStreams    = 4
	chaosWriters    = 8
	// chaosMinAcks: with fewer acknowledged appends the run proves little.
	chaosMinAcks = 500
	// chaosSlowPut is how late a slow PUT answers: past the append
	// timeout the run configures.
	chaosSlowPut = 80 * time.Millisecond
	// chaosMaxFailures caps the violations reported one by one.
	chaosMaxFailures = 20
)

// TestRandomFaultsLoseNoAcknowledgedAppend runs idempotent producers and
// readers against the engine while the store fails a random share of its
// requests (some writes land and still report failure) and the process
// "crashes" several times: the store stops answering the old incarnation
// at once, and a new one with the same node id replays the bucket.
// Compaction runs every few milliseconds all along, so folds, packs and
// WAL retirement meet the faults and the crashes. Afterwards, on a clean
// restart, every stream must hold every acknowledged append exactly once,
// at the seqs it was acknowledged at, each producer's appends in its seq
// order and whole, seqs without gaps, no body twice, and every record a
// reader was served at the seq and with the body it was served with:
// nothing acknowledged or shown is ever taken back, and no producer retry
// is applied twice.
func TestRandomFaultsLoseNoAcknowledgedAppend(t *testing.T) {
	seed := chaosSeed(t)
	runFor := chaosRunLength(t, chaosRunDefault)
	t.Logf("random seed %d (set %s=%d to replay its faults and crashes)", seed, chaosSeedEnv, seed)
	rng := rand.New(rand.NewPCG(seed, 0xc4a05))

	h := &chaosRun{
		t:      t,
		mem:    memstore.New(),
		faults: &chaosFaults{rng: rand.New(rand.NewPCG(seed, 0xfa017)), injected: map[string]int{}, requests: map[string]int{}},
		cfg: Config{
			// Compaction every few ms; a small cache, so that compaction
			// after a restart and the scanning reader read entries back
			// from the WAL; and a pack limit that sends some streams to
			// data objects of their own while others stay in packs or
			// are repacked.
			CompactInterval: 30 * time.Millisecond,
			CacheBytes:      128 << 10,
			PackBelow:       48 << 10,
			// Shorter than a slow PUT (chaosSlowPut): its appends answer
			// "unconfirmed" and are retried while still in flight.
			AppendTimeout: 50 * time.Millisecond,
		},
		seen: map[string]map[uint64]string{},
	}
	h.restart()

	// Creates meet the faults too; a create is idempotent, so it is
	// retried until it answers.
	streams := make([]string, chaosStreams)
	for i := range streams {
		streams[i] = fmt.Sprintf("/chaos/s%d", i)
		for attempt := 0; ; attempt++ {
			_, _, err := h.engine.Load().Create(context.Background(), streams[i], CreateRequest{ContentType: "text/plain"})
			if err == nil {
				break
			}
			if !errors.Is(err, ErrUnavailable) || attempt == 100 {
				t.Fatalf("create %s, attempt %d: %v", streams[i], attempt, err)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}

	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	// Registered after the first engine's cleanup, so it runs before it:
	// a t.Fatal half-way still stops every goroutine before any engine
	// closes.
	t.Cleanup(func() { stop(); wg.Wait() })
	writers := make([]*chaosWriter, chaosWriters)
	for i := range writers {
		w := &chaosWriter{id: i, stream: streams[i%len(streams)], producer: fmt.Sprintf("w%d", i), errs: map[string]int{}}
		writers[i] = w
		wrng := rand.New(rand.NewPCG(seed, uint64(i)+1))
		wg.Go(func() { h.write(ctx, w, wrng) })
	}
	var reads chaosReads
	wg.Go(func() { h.follow(ctx, streams, &reads) })
	wg.Go(func() { h.scan(ctx, streams, &reads) })

	// Crashes at random moments while the writers are busy: 3 to 5, and
	// as many again for every further default run length.
	crashes := make([]time.Duration, (3+rng.IntN(3))*max(1, int(runFor/chaosRunDefault)))
	for i := range crashes {
		crashes[i] = runFor/10 + time.Duration(rng.Int64N(int64(runFor*8/10)))
	}
	slices.Sort(crashes)
	began := time.Now()
	crashKinds := map[string]int{}
	for _, at := range crashes {
		time.Sleep(time.Until(began.Add(at)))
		kind := "at a random moment"
		if prefix := chaosLastActs[rng.IntN(len(chaosLastActs))]; prefix != "" {
			h.store.dying.Store(&prefix)
			select {
			case <-h.store.landed:
				kind = "after a PUT of " + prefix + " landed"
			case <-time.After(time.Second):
				kind = "when no PUT of " + prefix + " came"
			}
		}
		crashKinds[kind]++
		h.crash()
		h.restart()
	}
	time.Sleep(time.Until(began.Add(runFor)))
	stop()
	wg.Wait()
	acked := h.acked.Load()

	// The last crash, and a start on the bare bucket, without faults, to
	// check. Its small cache makes the reads go to the bucket.
	h.crash()
	h.awaitCloses()
	e := startEngine(t, h.mem, Config{CacheBytes: 48 << 10})
	final := h.check(e, streams, writers)

	// Compaction without faults, and one more restart, must not change a
	// record either.
	if err := e.Compact(context.Background()); err != nil {
		t.Errorf("compaction after the run: %v", err)
	}
	again := startEngine(t, h.mem, Config{CacheBytes: 48 << 10})
	for _, name := range streams {
		if got := readDigests(t, again, name); !slices.Equal(got, final[name]) {
			t.Errorf("%s: after a compaction and a restart it reads %d records, differing from the %d it read before",
				name, len(got), len(final[name]))
		}
	}

	dups := 0
	errs := map[string]int{}
	for _, w := range writers {
		for _, a := range w.acks {
			if a.dup {
				dups++
			}
		}
		for k, n := range w.errs {
			errs[k] += n
		}
	}
	t.Logf("ran %v with %d crashes at %v %v, %d failed starts; %d appends acknowledged (%d of them as producer duplicates)",
		runFor, len(crashes), crashes, crashKinds, h.failedStarts, acked, dups)
	t.Logf("requests that could fail: %s", h.faults.counts(h.faults.requests))
	t.Logf("faults injected: %s", h.faults.counts(h.faults.injected))
	t.Logf("compaction over all incarnations: %d folds, %d stream backlogs packed (%d repacks) into %d packs; %d WAL objects committed, %d aborted",
		h.stats.Folds, h.stats.Packed, h.stats.Repacked, h.stats.PacksWritten, h.stats.WALObjects, h.stats.AbortedBatches)
	t.Logf("append errors by kind: %v", errs)
	t.Logf("reads: %d records served, %d errors; streams hold %v records", reads.records.Load(), reads.errors.Load(), lens(final))
	if n := h.failures.Load(); n > chaosMaxFailures {
		t.Errorf("%d violations in all; the first %d are above", n, chaosMaxFailures)
	}
	if acked < chaosMinAcks {
		t.Fatalf("only %d appends were acknowledged (want at least %d): the run proves nothing", acked, chaosMinAcks)
	}
}

// chaosSeed is the run's seed: PICOMQ_CHAOS_SEED, or a fresh one.
// chaosRunLength is how long a randomized test runs: def, or what
// chaosRunEnv says.
func chaosRunLength(t *testing.T, def time.Duration) time.Duration {
	t.Helper()
	s := os.Getenv(chaosRunEnv)
	if s == "" {
		return def
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		t.Fatalf("%s: %v", chaosRunEnv, err)
	}
	return d
}

func chaosSeed(t *testing.T) uint64 {
	t.Helper()
	s := os.Getenv(chaosSeedEnv)
	if s == "" {
		return rand.Uint64()
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		t.Fatalf("%s: %v", chaosSeedEnv, err)
	}
	return n
}

// chaosLastActs are the crashes a run picks from: at a random moment ("")
// or right after a PUT under the prefix landed, before its answer: a WAL
// upload (its appends were never acknowledged, and their retries must be
// recognised) or one of compaction's writes, each a step that the next
// one must not depend on having been told of.
var chaosLastActs = []string{"", "", "wal/", "wal/", "pack/", "data/", "streams/", "manifest"}

// Injected errors say so, and a dead incarnation's errors say that, so
// that a failure's log tells them from the engine's own.
var (
	errInjected = errors.New("chaos: injected store failure")
	errCrashed  = errors.New("chaos: the process is dead")
)

type faultKind int

const (
	noFault      faultKind = iota
	faultBefore            // the request never reaches the store
	faultUnknown           // it never reaches the store, but the error leaves that open
	faultAfter             // it lands, and then the answer is lost
	faultSlow              // it lands, and the answer comes late: appends time out and are retried while in flight
)

func (k faultKind) String() string {
	return [...]string{"none", "before", "unknown", "after", "slow"}[k]
}

// chaosFaults decides, from one seeded generator, which requests fail and
// how, and counts what it injected.
type chaosFaults struct {
	mu       sync.Mutex
	rng      *rand.Rand
	injected map[string]int
	requests map[string]int // requests that could have failed, by op and class
}

// faultPerMille is the share of requests of op on keys of class (the key's
// first path element) that fail, in thousandths.
func faultPerMille(op, class string) int {
	switch class {
	case "lease":
		// The lease is renewed every 10 s, too seldom for faults to
		// matter in a run (segment/lease_test.go covers its lost
		// answers).
		return 0
	case "manifest":
		// Every namespace switch and WAL retirement rewrites it; rarely,
		// so that retirement still makes progress.
		return 15
	}
	switch op {
	case "PUT":
		return 120
	case "DELETE":
		return 50
	case "GET":
		// Rarer than writes: a compaction reads back every WAL object
		// its cache lost and gives up at the first failure, so at a few
		// percent it would hardly ever finish.
		return 5
	case "LIST":
		return 10
	}
	return 0
}

func (f *chaosFaults) decide(op, key string) faultKind {
	class, _, _ := strings.Cut(key, "/")
	rate := faultPerMille(op, class)
	if rate == 0 {
		return noFault
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.requests[op+" "+class]++
	if f.rng.IntN(1000) >= rate {
		return noFault
	}
	kind := faultBefore
	switch op {
	case "PUT":
		kind = faultKind(1 + f.rng.IntN(4))
	case "DELETE":
		if f.rng.IntN(2) == 0 {
			kind = faultAfter
		}
	}
	f.injected[op+" "+class+" "+kind.String()]++
	return kind
}

// counts summarises m, one of f's maps.
func (f *chaosFaults) counts(m map[string]int) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	keys := make([]string, 0, len(m))
	total := 0
	for k, n := range m {
		keys = append(keys, k)
		total += n
	}
	sort.Strings(keys)
	var b strings.Builder
	fmt.Fprintf(&b, "%d:", total)
	for _, k := range keys {
		fmt.Fprintf(&b, " [%s]=%d", k, m[k])
	}
	return b.String()
}

// chaosStore is the bucket as one engine incarnation sees it: faults from
// its start on, and nothing at all once dead.
type chaosStore struct {
	*memstore.Store
	faults *chaosFaults
	// Every call holds mu shared while it runs, and kill takes it
	// exclusively: once kill returns, no request of the dead process is
	// still on its way to the bucket.
	mu   sync.RWMutex
	dead bool
	// dying, when set, makes the next PUT that lands under that prefix
	// the process's last act: it dies before the answer comes back, and
	// landed is closed.
	dying   atomic.Pointer[string]
	lastAct atomic.Bool
	landed  chan struct{}
}

func (c *chaosStore) enter() bool {
	c.mu.RLock()
	if c.dead || c.lastAct.Load() {
		c.mu.RUnlock()
		return false
	}
	return true
}

func (c *chaosStore) kill() {
	c.mu.Lock()
	c.dead = true
	c.mu.Unlock()
}

func (c *chaosStore) fault(op, key string) faultKind {
	return c.faults.decide(op, key)
}

func (c *chaosStore) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	if !c.enter() {
		return "", fmt.Errorf("put %s: %w", key, errCrashed)
	}
	defer c.mu.RUnlock()
	if p := c.dying.Load(); p != nil && strings.HasPrefix(key, *p) {
		tag, err := c.Store.Put(ctx, key, data, opts)
		if err == nil && c.dying.CompareAndSwap(p, nil) {
			c.lastAct.Store(true)
			close(c.landed)
			return "", fmt.Errorf("put %s: %w", key, errCrashed)
		}
		return tag, err
	}
	switch c.fault("PUT", key) {
	case faultBefore:
		return "", fmt.Errorf("put %s: %w", key, errInjected)
	case faultUnknown:
		return "", fmt.Errorf("put %s: %w: %w", key, segment.ErrUnknownOutcome, errInjected)
	case faultAfter:
		if _, err := c.Store.Put(ctx, key, data, opts); err != nil {
			return "", err // a failed precondition answers as it is
		}
		return "", fmt.Errorf("put %s: %w: %w", key, segment.ErrUnknownOutcome, errInjected)
	case faultSlow:
		tag, err := c.Store.Put(ctx, key, data, opts)
		time.Sleep(chaosSlowPut)
		return tag, err
	}
	return c.Store.Put(ctx, key, data, opts)
}

func (c *chaosStore) Get(ctx context.Context, key string, off, n int64) ([]byte, string, error) {
	if !c.enter() {
		return nil, "", fmt.Errorf("get %s: %w", key, errCrashed)
	}
	defer c.mu.RUnlock()
	if c.fault("GET", key) != noFault {
		return nil, "", fmt.Errorf("get %s: %w", key, errInjected)
	}
	return c.Store.Get(ctx, key, off, n)
}

func (c *chaosStore) List(ctx context.Context, prefix, after string, max int) ([]segment.ObjectInfo, bool, error) {
	if !c.enter() {
		return nil, false, fmt.Errorf("list %s: %w", prefix, errCrashed)
	}
	defer c.mu.RUnlock()
	if c.fault("LIST", prefix) != noFault {
		return nil, false, fmt.Errorf("list %s: %w", prefix, errInjected)
	}
	return c.Store.List(ctx, prefix, after, max)
}

func (c *chaosStore) Delete(ctx context.Context, keys []string) error {
	if !c.enter() {
		return fmt.Errorf("delete: %w", errCrashed)
	}
	defer c.mu.RUnlock()
	if len(keys) == 0 {
		return c.Store.Delete(ctx, keys)
	}
	switch c.fault("DELETE", keys[0]) {
	case faultBefore:
		return fmt.Errorf("delete %s: %w", keys[0], errInjected)
	case faultAfter:
		if err := c.Store.Delete(ctx, keys); err != nil {
			return err
		}
		return fmt.Errorf("delete %s: %w", keys[0], errInjected)
	}
	return c.Store.Delete(ctx, keys)
}

func (c *chaosStore) DeleteIfMatch(ctx context.Context, key, etag string) error {
	if !c.enter() {
		return fmt.Errorf("delete %s: %w", key, errCrashed)
	}
	defer c.mu.RUnlock()
	switch c.fault("DELETE", key) {
	case faultBefore:
		return fmt.Errorf("delete %s: %w", key, errInjected)
	case faultAfter:
		if err := c.Store.DeleteIfMatch(ctx, key, etag); err != nil {
			return err
		}
		return fmt.Errorf("delete %s: %w", key, errInjected)
	}
	return c.Store.DeleteIfMatch(ctx, key, etag)
}

// chaosRun is the state one run shares between the test goroutine, the
// writers and the readers.
type chaosRun struct {
	t      *testing.T
	mem    *memstore.Store
	faults *chaosFaults
	cfg    Config

	engine atomic.Pointer[Engine] // the live incarnation
	store  *chaosStore            // its store (test goroutine only)
	closes []chan struct{}        // closes of crashed incarnations, done when closed

	acked        atomic.Int64
	failures     atomic.Int64
	failedStarts int           // test goroutine only
	stats        StatsSnapshot // summed over the crashed incarnations (test goroutine only)

	mu   sync.Mutex
	seen map[string]map[uint64]string // stream, seq: digest of the body a reader was served
}

// fail reports a violation from any goroutine, the first few in full.
func (h *chaosRun) fail(format string, args ...any) {
	h.t.Helper()
	if h.failures.Add(1) <= chaosMaxFailures {
		h.t.Errorf(format, args...)
	}
}

// chaosStartAttempts bounds the starts tried for one incarnation.
const chaosStartAttempts = 50

// restart starts a new incarnation on the bucket with its faults armed, so
// that the replay meets them too. A start that fails is torn down like a
// crash and tried again, as a supervisor restarting the process would: the
// next start must cope with whatever the failed one left (a lease taken, a
// namespace registered, seals written).
func (h *chaosRun) restart() {
	h.t.Helper()
	for attempt := 1; ; attempt++ {
		st := &chaosStore{Store: h.mem, faults: h.faults, landed: make(chan struct{})}
		e := New(st, testConfig(h.cfg), nil)
		err := e.Start(context.Background())
		if err == nil {
			h.t.Cleanup(func() { closeDead(e) })
			h.store = st
			h.engine.Store(e)
			return
		}
		st.kill()
		closeDead(e)
		h.failedStarts++
		if attempt == chaosStartAttempts {
			h.t.Fatalf("%d starts in a row failed, the last: %v", attempt, err)
		}
	}
}

// closeDead tears an incarnation down with a context that has already
// ended, as a dead process waits for nothing: its pending appends fail,
// and its goroutines end. (Close with no deadline waits for ever when the
// crash caught a WAL upload in flight: the dead store can never settle
// its batch.)
func closeDead(e *Engine) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_ = e.Close(ctx)
}

// crash kills the live incarnation: from now on none of its requests
// reaches the bucket. Its process is then torn down (closeDead).
func (h *chaosRun) crash() {
	h.store.kill()
	e := h.engine.Load()
	st := e.Stats()
	h.stats.Folds += st.Folds
	h.stats.Packed += st.Packed
	h.stats.Repacked += st.Repacked
	h.stats.PacksWritten += st.PacksWritten
	h.stats.WALObjects += st.WALObjects
	h.stats.AbortedBatches += st.AbortedBatches
	done := make(chan struct{})
	h.closes = append(h.closes, done)
	go func() {
		defer close(done)
		closeDead(e)
	}()
}

// awaitCloses waits for the crashed incarnations to wind down.
func (h *chaosRun) awaitCloses() {
	h.t.Helper()
	timeout := time.After(30 * time.Second)
	for i, done := range h.closes {
		select {
		case <-done:
		case <-timeout:
			h.t.Fatalf("incarnation %d, crashed, has not finished closing after 30s", i)
		}
	}
}

// chaosWriter is one idempotent producer, appending to one stream.
type chaosWriter struct {
	id               int
	stream, producer string
	sizes            []int // records of each producer seq tried
	acks             []chaosAck
	errs             map[string]int
}

// chaosAck is an acknowledged append.
type chaosAck struct {
	pseq   uint64
	bodies []string // digests
	first  uint64   // seq of its first record, unless dup
	dup    bool     // acknowledged as a producer duplicate
}

// write appends producer seq after producer seq, each retried as it is
// until acknowledged, for as long as ctx lasts.
func (h *chaosRun) write(ctx context.Context, w *chaosWriter, rng *rand.Rand) {
	blobsLeft := 2 // a few appends large enough to go to blobs
	for pseq := uint64(0); ; pseq++ {
		n := 1 + rng.IntN(3)
		large := blobsLeft > 0 && rng.IntN(250) == 0
		if large {
			blobsLeft--
		}
		req := AppendRequest{Producer: &Producer{ID: w.producer, Seq: pseq}}
		digests := make([]string, n)
		for part := range n {
			body := chaosBody(w.id, pseq, part, large && part == 0)
			req.Records = append(req.Records, NewRecord{Body: body})
			digests[part] = digest(body)
		}
		w.sizes = append(w.sizes, n)
		for attempt := 0; ; attempt++ {
			if ctx.Err() != nil {
				return
			}
			res, err := h.engine.Load().Append(ctx, w.stream, req)
			if ctx.Err() != nil {
				return // acknowledged or not, this seq is not counted
			}
			if err == nil {
				switch {
				case res.Duplicate && attempt == 0:
					h.fail("%s seq %d: its first attempt was answered as a duplicate: %+v", w.producer, pseq, res)
				case res.Duplicate && res.ProducerSeq < pseq:
					h.fail("%s seq %d: a duplicate answer says the producer is at seq %d", w.producer, pseq, res.ProducerSeq)
				case !res.Duplicate && (res.NextSeq != res.FirstSeq+uint64(n) || res.ProducerSeq != pseq):
					h.fail("%s seq %d: %d records acknowledged as %+v", w.producer, pseq, n, res)
				}
				w.acks = append(w.acks, chaosAck{pseq: pseq, bodies: digests, first: res.FirstSeq, dup: res.Duplicate})
				h.acked.Add(1)
				break
			}
			w.errs[errKind(err)]++
			var gap *SequenceGapError
			if errors.As(err, &gap) {
				h.fail("%s seq %d: %v: an acknowledged append was lost", w.producer, pseq, err)
				return // nothing this producer sends can succeed any more
			}
			if !errors.Is(err, ErrUnavailable) && !errors.Is(err, ErrShuttingDown) {
				h.fail("%s seq %d: unexpected error: %v", w.producer, pseq, err)
			}
			sleepCtx(ctx, time.Duration(1+rng.IntN(5))*time.Millisecond)
		}
	}
}

// errKind names an append error for the run's summary.
func errKind(err error) string {
	switch {
	case errors.Is(err, ErrBusy):
		return "busy"
	case errors.Is(err, ErrUnconfirmed):
		return "unconfirmed"
	case errors.Is(err, ErrUnavailable):
		return "unavailable"
	case errors.Is(err, ErrShuttingDown):
		return "shutting down"
	}
	return "other"
}

type chaosReads struct{ records, errors atomic.Int64 }

// follow reads every stream's new records as they come, as a live reader
// does.
func (h *chaosRun) follow(ctx context.Context, streams []string, reads *chaosReads) {
	next := make([]uint64, len(streams))
	for ctx.Err() == nil {
		progressed := false
		for i, name := range streams {
			res, err := h.engine.Load().Read(ctx, name, ReadRequest{Seq: next[i], MaxRecords: 64})
			if err != nil {
				h.readFailed(ctx, "follow", name, next[i], err, reads)
				continue
			}
			h.saw(name, next[i], res.Records, reads)
			res.Release()
			progressed = progressed || res.NextSeq > next[i]
			next[i] = res.NextSeq
		}
		if !progressed {
			sleepCtx(ctx, 2*time.Millisecond)
		}
	}
}

// scan reads every stream from its start again and again, which takes
// reads to packs, data objects and WAL entries the cache no longer holds.
func (h *chaosRun) scan(ctx context.Context, streams []string, reads *chaosReads) {
	for ctx.Err() == nil {
		for _, name := range streams {
			for seq := uint64(0); ctx.Err() == nil; {
				res, err := h.engine.Load().Read(ctx, name, ReadRequest{Seq: seq, MaxRecords: 256})
				if err != nil {
					h.readFailed(ctx, "scan", name, seq, err, reads)
					break
				}
				h.saw(name, seq, res.Records, reads)
				res.Release()
				if res.UpToDate {
					break
				}
				seq = res.NextSeq
			}
		}
		sleepCtx(ctx, 10*time.Millisecond)
	}
}

// saw records what a read from seq on was served, which must agree with
// every earlier read.
func (h *chaosRun) saw(name string, from uint64, recs []Record, reads *chaosReads) {
	reads.records.Add(int64(len(recs)))
	h.mu.Lock()
	defer h.mu.Unlock()
	seen := h.seen[name]
	if seen == nil {
		seen = map[uint64]string{}
		h.seen[name] = seen
	}
	for i, r := range recs {
		if r.Seq != from+uint64(i) {
			h.fail("%s: a read from %d returned seq %d at index %d", name, from, r.Seq, i)
			return
		}
		d := digest(r.Body)
		if prev, ok := seen[r.Seq]; ok && prev != d {
			h.fail("%s seq %d: served as %q, and later as %q", name, r.Seq, prev, d)
		}
		seen[r.Seq] = d
	}
}

func (h *chaosRun) readFailed(ctx context.Context, who, name string, seq uint64, err error, reads *chaosReads) {
	if ctx.Err() != nil {
		return
	}
	reads.errors.Add(1)
	switch {
	case errors.Is(err, ErrUnavailable), errors.Is(err, ErrShuttingDown):
	case errors.Is(err, ErrBadRequest):
		// The reader had been served every seq below this one.
		h.fail("%s: %s read at %d: %v: records it was served are gone", who, name, seq, err)
	default:
		h.fail("%s: %s read at %d: unexpected error: %v", who, name, seq, err)
	}
	sleepCtx(ctx, 2*time.Millisecond)
}

// check reads every stream through e and holds it against what the
// writers were told and the readers were served. It returns the streams'
// records as digests.
func (h *chaosRun) check(e *Engine, streams []string, writers []*chaosWriter) map[string][]string {
	t := h.t
	t.Helper()
	byID := map[int]*chaosWriter{}
	for _, w := range writers {
		byID[w.id] = w
	}
	final := map[string][]string{}
	for _, name := range streams {
		got := readDigests(t, e, name) // seqs 0..n-1, no gaps (readAll)
		final[name] = got
		at := map[string]uint64{} // body digest: its seq
		// Per producer, the next record expected: producer seq, and
		// part of that append.
		type pos struct {
			pseq  uint64
			part  int
			first uint64 // seq of the append's first record
		}
		next := map[int]*pos{}
		for seq, d := range got {
			if prev, ok := at[d]; ok {
				h.fail("%s: %q is at seq %d and again at %d", name, d, prev, seq)
				continue
			}
			at[d] = uint64(seq)
			wid, pseq, part, ok := parseLabel(d)
			w := byID[wid]
			if !ok || w == nil || w.stream != name {
				h.fail("%s seq %d: %q is no record a writer of this stream appended", name, seq, d)
				continue
			}
			p := next[wid]
			if p == nil {
				p = &pos{}
				next[wid] = p
			}
			if pseq != p.pseq || part != p.part {
				h.fail("%s seq %d: %s's record %d/%d follows where %d/%d was due (out of order, lost or torn)",
					name, seq, w.producer, pseq, part, p.pseq, p.part)
			}
			if part == 0 {
				p.first = uint64(seq)
			} else if uint64(seq) != p.first+uint64(part) {
				h.fail("%s seq %d: %s's append %d is not in consecutive seqs", name, seq, w.producer, pseq)
			}
			if pseq >= uint64(len(w.sizes)) || part >= w.sizes[pseq] {
				h.fail("%s seq %d: %s never appended %d/%d", name, seq, w.producer, pseq, part)
				continue
			}
			p.pseq, p.part = pseq, part+1
			if p.part == w.sizes[pseq] {
				p.pseq, p.part = pseq+1, 0
			}
		}
		for _, w := range writers {
			if w.stream != name {
				continue
			}
			if p := next[w.id]; p != nil && p.part != 0 {
				h.fail("%s: %s's append %d is torn: %d of its %d records are there", name, w.producer, p.pseq, p.part, w.sizes[p.pseq])
			}
			for _, a := range w.acks {
				for i, d := range a.bodies {
					seq, ok := at[d]
					switch {
					case !ok:
						h.fail("%s: %s's acknowledged append %d (record %d, %q) is missing", name, w.producer, a.pseq, i, d)
					case !a.dup && seq != a.first+uint64(i):
						h.fail("%s: %q was acknowledged at seq %d, and is at %d", name, d, a.first+uint64(i), seq)
					}
				}
			}
		}
		h.mu.Lock()
		for seq, d := range h.seen[name] {
			switch {
			case seq >= uint64(len(got)):
				h.fail("%s seq %d: a reader was served %q; the stream now ends at %d", name, seq, d, len(got))
			case got[seq] != d:
				h.fail("%s seq %d: a reader was served %q; the stream now holds %q", name, seq, d, got[seq])
			}
		}
		h.mu.Unlock()
	}
	return final
}

// readDigests reads a whole stream (readAll checks its seqs) as digests.
func readDigests(t *testing.T, e *Engine, name string) []string {
	t.Helper()
	bodies := readAll(t, e, name)
	out := make([]string, len(bodies))
	for i, b := range bodies {
		out[i] = digest([]byte(b))
	}
	return out
}

func lens(m map[string][]string) []int {
	names := make([]string, 0, len(m))
	for name := range m {
		names = append(names, name)
	}
	sort.Strings(names)
	out := make([]int, len(names))
	for i, name := range names {
		out[i] = len(m[name])
	}
	return out
}

// chaosBody is record part of writer's append pseq: its label, and, for a
// large one, enough filler to make the append a blob.
func chaosBody(writer int, pseq uint64, part int, large bool) []byte {
	label := fmt.Sprintf("w%d/%d/%d", writer, pseq, part)
	if !large {
		return []byte(label)
	}
	b := make([]byte, blobMinBytes+1024)
	n := copy(b, label+"|")
	for i := n; i < len(b); i++ {
		b[i] = byte('a' + (i+int(pseq))%26)
	}
	return b
}

// digest stands for a body in the test's books: the body itself when
// short, else its label, length and hash.
func digest(body []byte) string {
	if len(body) <= 64 {
		return string(body)
	}
	label, _, _ := strings.Cut(string(body[:64]), "|")
	f := fnv.New64a()
	f.Write(body)
	return fmt.Sprintf("%s|%dB|%016x", label, len(body), f.Sum64())
}

// parseLabel reads writer, producer seq and part back from a digest.
func parseLabel(d string) (writer int, pseq uint64, part int, ok bool) {
	label, _, _ := strings.Cut(d, "|")
	var extra string
	n, _ := fmt.Sscanf(label, "w%d/%d/%d%s", &writer, &pseq, &part, &extra)
	return writer, pseq, part, n == 3
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
