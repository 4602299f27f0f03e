package streamstore

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// The churn test's knobs; it shares the chaos test's seed and run length
// variables (chaosSeedEnv, chaosRunEnv).
const (
	churnRunDefault = 5 * time.Second
	churnNames      = 6
	// Shares of a live stream's turns, in hundredths; appends take the
	// rest.
	churnDeletePct = 8
	churnTrimPct   = 5
	churnReadPct   = 10
	// Chances, in thousandths, that a request is also delivered a second
	// time, late. Deletes are few (one per incarnation) and are what the
	// test is for, so most of them get a late twin.
	churnLateDelete  = 600
	churnLateIfMatch = 200
	churnLateCreate  = 600
	// churnLateMin and churnLateMax bound how late a copy lands: past its
	// retry's answer, and often past the next create of the name.
	churnLateMin = 5 * time.Millisecond
	churnLateMax = 200 * time.Millisecond
	// churnLateInFlight bounds the copies on their way at once, and with
	// them the goroutines that carry them.
	churnLateInFlight = 32
	// churnGraveTime is how long a deleted name's grave stays: past every
	// late copy, yet short enough that the collector removes graves during
	// the run, and the late creates meet names whose graves are gone.
	churnGraveTime = 2 * churnLateMax
	// Below these the run proves little.
	// churnCrashes is how many times the process dies in a default-length
	// run (more in longer ones).
	churnCrashes      = 3
	churnMinAcks      = 300
	churnMinRecreates = 40
)

// TestRandomFaultsDeleteAndRecreate deletes streams and creates them again
// under the chaos test's store faults, while some deletes and metadata
// checkpoints also land a second time, late: a first attempt held up on
// its way that arrives after its retry was answered, often after the name
// was created again. One goroutine per name runs create, appends, trims
// and deletes one after the other, so that what the clients of a name
// were told is one well-defined history. Afterwards a clean restart must
// find every name as the clients were last told: the live incarnation
// with exactly its acknowledged records, or no stream after an
// acknowledged delete; never an earlier incarnation's records, and never
// a stream a late delete took away.
//
// A request that fails is ambiguous: it may have happened or not, and may
// still happen while it is on its way. The model stays simple by never
// leaving an ambiguous request behind: each goroutine retries a failed
// request until it is answered (appends carry a producer, so that their
// retries are applied once; creates, trims and deletes are idempotent),
// and only then moves on. So the state
// after every answered request is known exactly, and only the requests
// the stop caught unsettled are left open: the check accepts each of
// their outcomes.
//
// Late copies of create-only metadata PUTs are sent too: one that lands
// after the stream was deleted must find the grave in its key and change
// nothing (before graves it found the key free and brought the deleted
// stream back).
func TestRandomFaultsDeleteAndRecreate(t *testing.T) {
	seed := chaosSeed(t)
	runFor := chaosRunLength(t, churnRunDefault)
	t.Logf("random seed %d (set %s=%d to replay its faults and late copies)", seed, chaosSeedEnv, seed)

	mem := memstore.New()
	faults := &chaosFaults{rng: rand.New(rand.NewPCG(seed, 0xfa017)), injected: map[string]int{}, requests: map[string]int{}}
	late := &lateCopies{mem: mem, rng: rand.New(rand.NewPCG(seed, 0x1a7e)), outcomes: map[string]int{}}
	// Registered first, so it runs last: whatever ends the test, every
	// late copy has landed before it ends.
	t.Cleanup(late.landAll)

	cfg := testConfig(Config{
		// Compaction every few ms checkpoints the streams (If-Match
		// PUTs of their metadata) all along, and a delete kicks the
		// collector, so that both meet the deletes and the late copies.
		// A small pack limit sends some backlogs to packs and folds the
		// others.
		CompactInterval: 20 * time.Millisecond,
		CacheBytes:      64 << 10,
		PackBelow:       128,
		// Shorter than a slow PUT (chaosSlowPut): some appends and
		// creates answer "unconfirmed" while theirs is still in flight.
		AppendTimeout: 50 * time.Millisecond,
		GraveTime:     churnGraveTime,
	})
	var st *chaosStore
	var e *Engine
	var failedStarts int
	// start starts an incarnation with the faults armed, trying again as a
	// supervisor would until one starts.
	start := func() {
		t.Helper()
		for attempt := 1; ; attempt++ {
			st = &chaosStore{Store: mem, faults: faults, landed: make(chan struct{})}
			e = New(&churnStore{chaosStore: st, late: late}, cfg, nil)
			err := e.Start(context.Background())
			if err == nil {
				inc := e
				t.Cleanup(func() { closeDead(inc) })
				return
			}
			st.kill()
			closeDead(e)
			failedStarts++
			if attempt == chaosStartAttempts {
				t.Fatalf("%d starts in a row failed, the last: %v", attempt, err)
			}
		}
	}
	start()

	r := &churnRun{t: t}
	r.eng.Store(e)
	names := make([]*churnName, churnNames)
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	// Registered after the engine's cleanup, so it runs before it.
	t.Cleanup(func() { stop(); wg.Wait() })
	began := time.Now()
	for i := range names {
		n := &churnName{name: fmt.Sprintf("/churn/n%d", i), errs: map[string]int{}}
		names[i] = n
		rng := rand.New(rand.NewPCG(seed, uint64(i)+1))
		wg.Go(func() { r.churn(ctx, n, rng) })
	}
	// Crashes at random moments: the process dies with creates, deletes
	// and their metadata writes on their way, and the next one replays
	// the WAL (creates it finds without metadata are completed, undone
	// ones dropped) while late copies keep landing.
	rng := rand.New(rand.NewPCG(seed, 0xc4a5))
	crashes := make([]time.Duration, churnCrashes*max(1, int(runFor/chaosRunDefault)))
	for i := range crashes {
		crashes[i] = runFor/10 + time.Duration(rng.Int64N(int64(runFor*8/10)))
	}
	slices.Sort(crashes)
	var dead sync.WaitGroup
	crashKinds := map[string]int{}
	for _, at := range crashes {
		time.Sleep(time.Until(began.Add(at)))
		kind := "at a random moment"
		if prefix := churnLastActs[rng.IntN(len(churnLastActs))]; prefix != "" {
			st.dying.Store(&prefix)
			select {
			case <-st.landed:
				kind = "after a PUT of " + prefix + " landed"
			case <-time.After(time.Second):
				kind = "when no PUT of " + prefix + " came"
			}
		}
		crashKinds[kind]++
		st.kill()
		old := e
		dead.Go(func() { closeDead(old) })
		start()
		r.eng.Store(e)
	}
	time.Sleep(time.Until(began.Add(runFor)))
	stop()
	wg.Wait()
	ran := time.Since(began)

	// Every copy still on its way lands, with the engine up, and then the
	// engine goes. Its store is cut off after the close, so that nothing
	// it still had in flight reaches the bucket behind the check.
	late.landAll()
	dead.Wait()
	closeCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	if err := e.Close(closeCtx); err != nil {
		t.Logf("closing the engine of the run: %v", err)
	}
	cancel()
	st.kill()
	stats := e.Stats()

	// A start on the bare bucket, without faults; its small cache makes
	// the reads go to the bucket.
	fresh := startEngine(t, mem, Config{CacheBytes: 48 << 10, GraveTime: churnGraveTime})
	final := r.verify(fresh, names)
	r.listed(fresh, final)

	// The collector without faults, a compaction and one more restart
	// must not change what any name holds, and must leave no tombstone.
	bg := context.Background()
	// Once to index the last graves, once more when they are due.
	if err := fresh.collectGarbage(bg); err != nil {
		t.Errorf("collecting the deleted streams' data after the run: %v", err)
	}
	time.Sleep(churnGraveTime)
	if err := fresh.collectGarbage(bg); err != nil {
		t.Errorf("collecting the deleted streams' data after the run: %v", err)
	}
	if err := fresh.Compact(bg); err != nil {
		t.Errorf("compaction after the run: %v", err)
	}
	if keys := append(mem.Keys("gc/"), mem.Keys(gravesPrefix)...); len(keys) != 0 {
		t.Errorf("gc tombstones or grave index entries left after a collection without faults: %q", keys)
	}
	for _, k := range mem.Keys(metaPrefix) {
		if data, _, err := mem.Get(bg, k, 0, -1); err == nil && isGrave(data) {
			t.Errorf("grave left after a collection without faults: %s", k)
		}
	}
	if err := fresh.Close(bg); err != nil {
		t.Errorf("close: %v", err)
	}
	again := startEngine(t, mem, Config{CacheBytes: 48 << 10})
	for _, n := range names {
		got, err := observe(bg, again, n.name)
		if err != nil {
			t.Errorf("%s: after a collection, a compaction and a restart: %v", n.name, err)
			continue
		}
		if !got.equal(final[n.name]) {
			t.Errorf("%s: after a collection, a compaction and a restart it holds %s; before, %s",
				n.name, got, final[n.name])
		}
	}

	var acks, creates, recreates, deletes, trims, reads, pending int
	errs := map[string]int{}
	for _, n := range names {
		acks += n.acks
		creates += n.creates
		recreates += n.recreates
		deletes += n.deletes
		trims += n.trims
		reads += n.reads
		pending += len(n.open)
		for k, v := range n.errs {
			errs[k] += v
		}
	}
	t.Logf("ran %v (then %v to land the late copies, restart and check): %d appends, %d creates (%d of them after a delete), %d deletes and %d trims acknowledged; %d reads checked; %d requests left open by the stop",
		ran.Round(time.Millisecond), (time.Since(began) - ran).Round(time.Millisecond), acks, creates, recreates, deletes, trims, reads, pending)
	t.Logf("failed requests retried, by kind: %v", errs)
	t.Logf("late copies: %s", late.summary())
	t.Logf("crashes: %v, each followed by a start on the faulty bucket (%d starts failed and were tried again)", crashKinds, failedStarts)
	t.Logf("requests that could fail: %s", faults.counts(faults.requests))
	t.Logf("faults injected: %s", faults.counts(faults.injected))
	t.Logf("compaction: %d folds (each a checkpoint), %d backlogs packed into %d packs; %d WAL objects committed, %d aborted",
		stats.Folds, stats.Packed, stats.PacksWritten, stats.WALObjects, stats.AbortedBatches)
	if n := r.failures.Load(); n > chaosMaxFailures {
		t.Errorf("%d violations in all; the first %d are above", n, chaosMaxFailures)
	}
	if acks < churnMinAcks || recreates < churnMinRecreates {
		t.Fatalf("only %d appends acknowledged and %d streams created again (want %d and %d): the run proves little",
			acks, recreates, churnMinAcks, churnMinRecreates)
	}
}

// churnLastActs are the crashes the churn test picks from: at a random
// moment (""), or right after a PUT under the prefix landed, before its
// answer: a WAL upload (creates in it have their records durable and no
// metadata yet, which the next start must complete), a metadata write (a
// create, a checkpoint or a grave), a tombstone or a grave index entry.
var churnLastActs = []string{"", "wal/", "wal/", "streams/", "gc/", "graves/"}

// churnStore is the bucket as the churn test's engine sees it: the chaos
// test's faults, and a network that delivers some requests a second time,
// late.
type churnStore struct {
	*chaosStore
	late *lateCopies
}

// Put sends late copies of metadata writes: create-only ones, and
// compare-and-swap ones (checkpoints, graves, creates over graves). Other
// keys' writes are not what the test is about.
func (c *churnStore) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	if opts.IfNoneMatch && isMetaKey(key) {
		if d, ok := c.late.take(churnLateCreate); ok {
			data := slices.Clone(data)
			c.late.send("PUT if-none-match", d, func(ctx context.Context) string {
				_, err := c.late.mem.Put(ctx, key, data, segment.PutOptions{IfNoneMatch: true})
				return putOutcome(err)
			})
		}
	}
	if opts.IfMatch != "" && isMetaKey(key) {
		if d, ok := c.late.take(churnLateIfMatch); ok {
			data, etag := slices.Clone(data), opts.IfMatch
			c.late.send("PUT if-match", d, func(ctx context.Context) string {
				_, err := c.late.mem.Put(ctx, key, data, segment.PutOptions{IfMatch: etag})
				return putOutcome(err)
			})
		}
	}
	return c.chaosStore.Put(ctx, key, data, opts)
}

// Delete gets late copies too, though the engine deletes metadata only
// conditionally: an unconditional delete of it, late, would take whatever
// stream has the name by then.
func (c *churnStore) Delete(ctx context.Context, keys []string) error {
	if slices.ContainsFunc(keys, isMetaKey) {
		if d, ok := c.late.take(churnLateDelete); ok {
			keys := slices.Clone(keys)
			c.late.send("DELETE", d, func(ctx context.Context) string {
				had := slices.ContainsFunc(keys, c.late.exists)
				return deleteOutcome(had, c.late.mem.Delete(ctx, keys))
			})
		}
	}
	return c.chaosStore.Delete(ctx, keys)
}

func (c *churnStore) DeleteIfMatch(ctx context.Context, key, etag string) error {
	if isMetaKey(key) {
		if d, ok := c.late.take(churnLateDelete); ok {
			c.late.send("DELETE if-match", d, func(ctx context.Context) string {
				had := c.late.exists(key)
				return deleteOutcome(had, c.late.mem.DeleteIfMatch(ctx, key, etag))
			})
		}
	}
	return c.chaosStore.DeleteIfMatch(ctx, key, etag)
}

func putOutcome(err error) string {
	switch {
	case err == nil:
		return "written"
	case errors.Is(err, segment.ErrPreconditionFailed):
		return "refused"
	}
	return "failed"
}

// deleteOutcome names what a late delete did; had says whether the key
// existed just before, which only the summary uses (the engine may change
// it in between).
func deleteOutcome(had bool, err error) string {
	switch {
	case err == nil && had:
		return "removed an object"
	case err == nil:
		return "found nothing"
	case errors.Is(err, segment.ErrPreconditionFailed):
		return "refused"
	}
	return "failed"
}

// lateCopies carries the late copies to the bucket itself, past the faults:
// they are requests that got through, only late.
type lateCopies struct {
	mem *memstore.Store
	wg  sync.WaitGroup

	mu       sync.Mutex
	rng      *rand.Rand
	closed   bool
	inFlight int
	sent     int
	outcomes map[string]int // op and outcome: copies landed
}

// take decides, with a chance of perMille in a thousand, that a request
// gets a late copy, and how late. Once taken, the copy must be sent.
func (l *lateCopies) take(perMille int) (time.Duration, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed || l.inFlight == churnLateInFlight || l.rng.IntN(1000) >= perMille {
		return 0, false
	}
	l.inFlight++
	l.sent++
	l.wg.Add(1) // under mu, and never once closed: landAll's Wait sees every Add
	return churnLateMin + time.Duration(l.rng.Int64N(int64(churnLateMax-churnLateMin))), true
}

// send lands a copy taken with take after d.
func (l *lateCopies) send(op string, d time.Duration, land func(context.Context) string) {
	go func() {
		defer l.wg.Done()
		time.Sleep(d)
		outcome := land(context.Background())
		l.mu.Lock()
		l.inFlight--
		l.outcomes[op+" "+outcome]++
		l.mu.Unlock()
	}()
}

// exists tells the summary whether a late delete found something to take.
func (l *lateCopies) exists(key string) bool {
	_, _, err := l.mem.Get(context.Background(), key, 0, 0)
	return err == nil
}

// landAll takes no more copies and waits for every copy taken to land.
func (l *lateCopies) landAll() {
	l.mu.Lock()
	l.closed = true
	l.mu.Unlock()
	l.wg.Wait()
}

func (l *lateCopies) summary() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	keys := make([]string, 0, len(l.outcomes))
	landed := 0
	for k, n := range l.outcomes {
		keys = append(keys, k)
		landed += n
	}
	sort.Strings(keys)
	var b strings.Builder
	fmt.Fprintf(&b, "%d sent, %d landed:", l.sent, landed)
	for _, k := range keys {
		fmt.Fprintf(&b, " [%s]=%d", k, l.outcomes[k])
	}
	return b.String()
}

// churnRun is what the goroutines of one run share.
type churnRun struct {
	t        *testing.T
	eng      atomic.Pointer[Engine] // the live incarnation
	failures atomic.Int64
}

// e is the live incarnation; a request sent to one that crashed fails and
// is sent again to the next.
func (r *churnRun) e() *Engine { return r.eng.Load() }

// fail reports a violation from any goroutine, the first few in full.
func (r *churnRun) fail(format string, args ...any) {
	r.t.Helper()
	if r.failures.Add(1) <= chaosMaxFailures {
		r.t.Errorf(format, args...)
	}
}

// churnName is one name's history as its clients were told it. Only its
// goroutine touches it until the load has stopped.
type churnName struct {
	name string
	inc  int // incarnations begun; the live one's records carry its number

	// The state after the last answered request: whether the stream
	// exists, its first retained seq, and its acknowledged records from
	// seq 0 on (those below start trimmed).
	exists bool
	start  uint64
	recs   []string
	pseq   uint64 // the live incarnation's next producer seq

	// open are requests whose outcome is not known: the one the stop
	// caught unanswered. Each may or may not have happened.
	open []*churnOp
	// broken: a violation was reported; the name is not checked again.
	broken bool

	acks, creates, recreates, deletes, trims, reads int
	errs                                            map[string]int
}

type churnOp struct {
	kind string   // create, append, trim or delete
	recs []string // the records a create or an append carries
	to   uint64   // a trim's seq
}

func (o *churnOp) String() string {
	if o.kind == "trim" {
		return fmt.Sprintf("trim to %d", o.to)
	}
	if len(o.recs) > 0 {
		return fmt.Sprintf("%s of %q", o.kind, o.recs)
	}
	return o.kind
}

// churn runs name's history until ctx ends.
func (r *churnRun) churn(ctx context.Context, n *churnName, rng *rand.Rand) {
	for ctx.Err() == nil && !n.broken {
		if !n.exists {
			if rng.IntN(4) == 0 {
				r.readBack(ctx, n)
			}
			r.create(ctx, n)
			continue
		}
		switch p := rng.IntN(100); {
		case p < churnDeletePct:
			r.delete(ctx, n)
		case p < churnDeletePct+churnTrimPct && n.start < uint64(len(n.recs)):
			r.trim(ctx, n, n.start+1+rng.Uint64N(uint64(len(n.recs))-n.start))
		case p < churnDeletePct+churnTrimPct+churnReadPct:
			r.readBack(ctx, n)
		default:
			r.append(ctx, n, 1+rng.IntN(3))
		}
	}
}

// retry judges a failed attempt of op: true to send it again. One the
// stop caught stays open; one that failed with anything but
// ErrUnavailable is a violation.
func (r *churnRun) retry(ctx context.Context, n *churnName, op *churnOp, err error) bool {
	r.t.Helper()
	if ctx.Err() == nil && !errors.Is(err, ErrUnavailable) && !errors.Is(err, ErrShuttingDown) {
		r.fail("%s: %s: unexpected error: %v", n.name, op, err)
		n.broken = true
		return false
	}
	if ctx.Err() == nil {
		n.errs[op.kind+" "+errKind(err)]++
		sleepCtx(ctx, time.Millisecond)
	}
	if ctx.Err() != nil {
		n.open = append(n.open, op)
		return false
	}
	return true
}

// create begins the next incarnation, its first record its tag.
func (r *churnRun) create(ctx context.Context, n *churnName) {
	n.inc++
	tag := fmt.Sprintf("%s#%d", n.name, n.inc)
	op := &churnOp{kind: "create", recs: []string{tag}}
	for attempt := 0; ; attempt++ {
		_, created, err := r.e().Create(ctx, n.name, CreateRequest{ContentType: "text/plain", Records: recs(tag)})
		if err == nil {
			n.exists, n.start, n.recs, n.pseq = true, 0, []string{tag}, 0
			n.creates++
			if n.inc > 1 {
				n.recreates++
			}
			switch {
			case !created && attempt == 0:
				r.fail("%s: the first create of incarnation %d found a stream there already", n.name, n.inc)
				n.broken = true
			case !created:
				// An earlier attempt's, or so it must be: read it.
				r.readBack(ctx, n)
			}
			return
		}
		if !r.retry(ctx, n, op, err) {
			return
		}
	}
}

// append appends k records as the next producer seq, retried as it is
// until acknowledged: the producer makes a retry of an append that landed
// a duplicate, so the records are there once either way.
func (r *churnRun) append(ctx context.Context, n *churnName, k int) {
	bodies := make([]string, k)
	for i := range bodies {
		bodies[i] = fmt.Sprintf("%s#%d/%d/%d", n.name, n.inc, n.pseq, i)
	}
	op := &churnOp{kind: "append", recs: bodies}
	req := AppendRequest{Records: recs(bodies...), Producer: &Producer{ID: "churn", Seq: n.pseq}}
	for attempt := 0; ; attempt++ {
		res, err := r.e().Append(ctx, n.name, req)
		if err == nil {
			tail := uint64(len(n.recs))
			switch {
			case res.Duplicate && attempt == 0:
				r.fail("%s: %s: its first attempt was answered as a duplicate: %+v", n.name, op, res)
			case res.Duplicate && res.NextSeq != tail+uint64(k):
				r.fail("%s: %s: answered as a duplicate at tail %d; it would end at %d", n.name, op, res.NextSeq, tail+uint64(k))
			case !res.Duplicate && (res.FirstSeq != tail || res.NextSeq != tail+uint64(k)):
				r.fail("%s: %s: acknowledged at seqs [%d, %d); the stream was at %d", n.name, op, res.FirstSeq, res.NextSeq, tail)
			}
			n.recs = append(n.recs, bodies...)
			n.pseq++
			n.acks++
			return
		}
		var gap *SequenceGapError
		if errors.As(err, &gap) || errors.Is(err, ErrNotFound) {
			r.fail("%s: %s (attempt %d): %v: the incarnation, or its acknowledged appends, are gone", n.name, op, attempt, err)
			n.broken = true
			return
		}
		if !r.retry(ctx, n, op, err) {
			return
		}
	}
}

// trim trims the live incarnation to seq to, retried until answered: a
// repeat of a trim still on its way must not be acknowledged before that
// one is durable (it once was, and was lost with its first attempt's
// upload; TestRepeatOfUnconfirmedChangeWaitsForIt).
func (r *churnRun) trim(ctx context.Context, n *churnName, to uint64) {
	op := &churnOp{kind: "trim", to: to}
	for {
		info, err := r.e().Trim(ctx, n.name, to)
		switch {
		case err == nil && info.StartSeq != to:
			r.fail("%s: %s acknowledged; its answer says the stream starts at %d", n.name, op, info.StartSeq)
			n.broken = true
			return
		case err == nil:
			n.start = to
			n.trims++
			return
		case !r.retry(ctx, n, op, err):
			return
		}
	}
}

// delete deletes the live incarnation, retried until answered. A retry
// that finds no stream is the answer too: an earlier attempt deleted it.
func (r *churnRun) delete(ctx context.Context, n *churnName) {
	op := &churnOp{kind: "delete"}
	for attempt := 0; ; attempt++ {
		err := r.e().Delete(ctx, n.name)
		if err == nil || (attempt > 0 && errors.Is(err, ErrNotFound)) {
			n.exists, n.start, n.recs = false, 0, nil
			n.deletes++
			return
		}
		if errors.Is(err, ErrNotFound) {
			r.fail("%s: the delete of incarnation %d found no stream", n.name, n.inc)
			n.broken = true
			return
		}
		if !r.retry(ctx, n, op, err) {
			return
		}
	}
}

// readBack reads the name through the engine under load: it must hold
// what the model says now, as no request of the name is open.
func (r *churnRun) readBack(ctx context.Context, n *churnName) {
	got, err := observe(ctx, r.e(), n.name)
	switch {
	case ctx.Err() != nil:
		return
	case errors.Is(err, ErrUnavailable), errors.Is(err, ErrShuttingDown):
		n.errs["read "+errKind(err)]++
		return
	case err != nil:
		r.fail("%s: reading it back: %v; the clients were told %s", n.name, err, n.state())
		n.broken = true
		return
	}
	n.reads++
	if want := n.state(); !got.matches(want) {
		r.fail("%s: reads as %s; the clients were told %s", n.name, got, want)
		n.broken = true
	}
}

// churnState is a name's state: no stream, or one whose records from seq 0
// are recs, retained from start on.
type churnState struct {
	exists bool
	start  uint64
	recs   []string
}

func (s churnState) String() string {
	if !s.exists {
		return "no stream"
	}
	return fmt.Sprintf("seqs [%d, %d): %q", s.start, len(s.recs), s.recs[s.start:])
}

func (n *churnName) state() churnState { return churnState{n.exists, n.start, n.recs} }

// outcomes are the states the bucket may hold for n after the load: the
// model's, with each open request, in order, happened or not.
func (n *churnName) outcomes() []churnState {
	states := []churnState{n.state()}
	for _, op := range n.open {
		for _, s := range states[:len(states):len(states)] {
			states = append(states, op.applied(s))
		}
	}
	return states
}

// applied is s after o.
func (o *churnOp) applied(s churnState) churnState {
	switch o.kind {
	case "create":
		return churnState{true, 0, o.recs}
	case "append":
		return churnState{s.exists, s.start, slices.Concat(s.recs, o.recs)}
	case "trim":
		return churnState{s.exists, o.to, s.recs}
	}
	return churnState{} // delete
}

// churnSeen is what a read finds: no stream, or one retained from start,
// ending at next, with tail the bodies of [start, next).
type churnSeen struct {
	exists      bool
	start, next uint64
	tail        []string
}

func (s churnSeen) String() string {
	if !s.exists {
		return "no stream"
	}
	return fmt.Sprintf("seqs [%d, %d): %q", s.start, s.next, s.tail)
}

func (s churnSeen) matches(w churnState) bool {
	if !s.exists || !w.exists {
		return s.exists == w.exists
	}
	return s.start == w.start && s.next == uint64(len(w.recs)) && slices.Equal(s.tail, w.recs[w.start:])
}

func (s churnSeen) equal(o churnSeen) bool {
	return s.exists == o.exists && s.start == o.start && s.next == o.next && slices.Equal(s.tail, o.tail)
}

// observe reads name whole through e: ErrNotFound is an answer (no
// stream), any other error is returned.
func observe(ctx context.Context, e *Engine, name string) (churnSeen, error) {
	info, err := e.Head(ctx, name)
	if errors.Is(err, ErrNotFound) {
		return churnSeen{}, nil
	}
	if err != nil {
		return churnSeen{}, err
	}
	seen := churnSeen{exists: true, start: info.StartSeq}
	for seq := info.StartSeq; ; {
		res, err := e.Read(ctx, name, ReadRequest{Seq: seq})
		if err != nil {
			return churnSeen{}, fmt.Errorf("read at %d (head said [%d, %d)): %w", seq, info.StartSeq, info.NextSeq, err)
		}
		for i, rec := range res.Records {
			if rec.Seq != seq+uint64(i) {
				res.Release()
				return churnSeen{}, fmt.Errorf("a read from %d returned seq %d at index %d", seq, rec.Seq, i)
			}
			seen.tail = append(seen.tail, string(rec.Body))
		}
		res.Release()
		if res.UpToDate {
			seen.next = res.NextSeq
			return seen, nil
		}
		seq = res.NextSeq
	}
}

// verify holds every name, read through e, against its outcomes, and
// returns what each one holds.
func (r *churnRun) verify(e *Engine, names []*churnName) map[string]churnSeen {
	t := r.t
	t.Helper()
	final := map[string]churnSeen{}
	for _, n := range names {
		got, err := observe(context.Background(), e, n.name)
		if err != nil {
			t.Errorf("%s: after a clean restart: %v", n.name, err)
			continue
		}
		final[n.name] = got
		if n.broken {
			continue // reported already
		}
		want := n.outcomes()
		if !slices.ContainsFunc(want, got.matches) {
			open := ""
			if len(n.open) > 0 {
				open = fmt.Sprintf(" (or, as %v were left open, one of %v)", n.open, want[1:])
			}
			r.fail("%s: after a clean restart it holds %s; the clients were last told %s%s (incarnation %d)",
				n.name, got, want[0], open, n.inc)
		}
	}
	return final
}

// listed checks that e lists exactly the names that hold a stream.
func (r *churnRun) listed(e *Engine, final map[string]churnSeen) {
	t := r.t
	t.Helper()
	infos, more, err := e.List(context.Background(), "/", "", 1000)
	if err != nil || more {
		t.Errorf("list: %v (more: %v)", err, more)
		return
	}
	var got, want []string
	for _, info := range infos {
		got = append(got, info.Name)
	}
	for name, s := range final {
		if s.exists {
			want = append(want, name)
		}
	}
	sort.Strings(want)
	if !slices.Equal(got, want) {
		t.Errorf("the engine lists %q; the streams that read are %q", got, want)
	}
}
