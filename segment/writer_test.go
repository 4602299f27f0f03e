package segment_test

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/internal/testenv"
	"github.com/picomq/caddy-picomq/segment"
)

// noHooks accepts batch outcomes without doing anything with them.
type noHooks struct{}

func (noHooks) Committed(*segment.Batch)      {}
func (noHooks) Aborted(*segment.Batch, error) {}

// startLog is a store that records when each PUT began.
type startLog struct {
	segment.Store
	mu     sync.Mutex
	starts []time.Time
}

func (s *startLog) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	s.mu.Lock()
	s.starts = append(s.starts, time.Now())
	s.mu.Unlock()
	return s.Store.Put(ctx, key, data, opts)
}

func (s *startLog) times() []time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]time.Time(nil), s.starts...)
}

func newTestWriter(t *testing.T, cfg segment.WriterConfig) (*segment.Writer, *startLog) {
	t.Helper()
	store := &startLog{Store: memstore.New()}
	w := segment.NewWriter(store, 1, 0, cfg, segment.WriterDeps{Hooks: noHooks{}})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := w.Close(ctx); err != nil {
			t.Errorf("close writer: %v", err)
		}
	})
	return w, store
}

func testEntry(seq uint64) *segment.Entry {
	return &segment.Entry{StreamID: "s", Name: "s", FirstSeq: seq, Records: []segment.Record{{Seq: seq, Body: []byte("x")}}}
}

// waitBatches waits for every batch's outcome and fails the test on an error.
func waitBatches(t *testing.T, batches []*segment.Batch) {
	t.Helper()
	for _, b := range batches {
		<-b.Done()
		if err := b.Err(); err != nil {
			t.Fatalf("batch: %v", err)
		}
	}
}

// An append that finds the writer idle is uploaded at once: flush_interval
// spaces uploads, it is not a linger every append pays.
func TestWriterIdleAppendGoesOutAtOnce(t *testing.T) {
	w, _ := newTestWriter(t, segment.WriterConfig{FlushInterval: time.Second})
	for i := range 3 {
		start := time.Now()
		b, err := w.Add(testEntry(uint64(i)))
		if err != nil {
			t.Fatalf("add: %v", err)
		}
		select {
		case <-b.Done():
		case <-time.After(500 * time.Millisecond):
			// The first append must not wait for the interval; later ones
			// must (an upload started less than 1s ago).
			if i == 0 {
				t.Fatalf("an append on an idle writer waited more than 500ms (flush interval 1s)")
			}
			<-b.Done()
		}
		if err := b.Err(); err != nil {
			t.Fatalf("batch %d: %v", i, err)
		}
		if i > 0 && time.Since(start) < 900*time.Millisecond {
			t.Fatalf("append %d went out %s after the previous upload started; want the 1s spacing", i, time.Since(start))
		}
	}
}

// Under steady load, uploads start no more often than once per interval.
func TestWriterSpacesUploads(t *testing.T) {
	const interval = 40 * time.Millisecond
	w, store := newTestWriter(t, segment.WriterConfig{FlushInterval: interval, MaxInFlight: 4})
	var batches []*segment.Batch
	deadline := time.Now().Add(500 * time.Millisecond)
	for seq := uint64(0); time.Now().Before(deadline); seq++ {
		b, err := w.Add(testEntry(seq))
		if err != nil {
			t.Fatalf("add: %v", err)
		}
		if len(batches) == 0 || batches[len(batches)-1] != b {
			batches = append(batches, b)
		}
		time.Sleep(time.Millisecond)
	}
	waitBatches(t, batches)
	starts := store.times()
	if len(starts) < 5 {
		t.Fatalf("%d uploads in 500ms of appends every 1ms; want about one per %s", len(starts), interval)
	}
	for i := 1; i < len(starts); i++ {
		// Timers fire a little early or late; a gap far below the interval
		// would mean an upload started off the spacing rule.
		if gap := starts[i].Sub(starts[i-1]); gap < interval*3/4 {
			t.Errorf("uploads %d and %d started %s apart; want at least about %s", i-1, i, gap, interval)
		}
	}
}

// FlushQuiet holds an upload that could start until appends pause, at most
// FlushInterval after the batch opened.
func TestWriterFlushQuiet(t *testing.T) {
	// The counts below hold if the writer's timer goroutine runs while the
	// appending loop does. With two Ps it may not: taken by the other P,
	// whose thread the kernel of a loaded machine does not run for a few
	// hundred milliseconds, it decides nothing while the loop, on its own
	// thread, adds every append to the batch it was about to seal ("1
	// uploads for 120 appends 5ms apart in 907ms" once beside CPU
	// burners). With one P the loop's every sleep hands the P to a timer
	// goroutine that is ready: a stall stops both alike, and the spacing
	// and the batches are the writer's own doing.
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	for _, tc := range []struct {
		name             string
		interval         time.Duration
		quiet            time.Duration
		gap              time.Duration // between appends
		appends          int
		minPuts, maxPuts int           // maxPuts 0: at most one per interval of the run
		within           time.Duration // every append acknowledged this soon, if set
	}{
		// Off: the first append finds the writer idle and goes alone; the
		// rest wait for the spacing.
		{name: "off", interval: 500 * time.Millisecond, gap: 10 * time.Millisecond, appends: 5, minPuts: 2, maxPuts: 2},
		// A burst shares one upload, long before the interval. The quiet
		// time is a hundred gaps: beside CPU burners a 10 ms sleep once
		// took over 200 ms, and the burst went out in two.
		{name: "burst", interval: 5 * time.Second, quiet: time.Second, gap: 10 * time.Millisecond, appends: 5, minPuts: 1, maxPuts: 1, within: 3 * time.Second},
		// Arrivals that never pause still go out every interval.
		{name: "steady", interval: 200 * time.Millisecond, quiet: 50 * time.Millisecond, gap: 5 * time.Millisecond, appends: 120, minPuts: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, store := newTestWriter(t, segment.WriterConfig{FlushInterval: tc.interval, FlushQuiet: tc.quiet})
			start := time.Now()
			var batches []*segment.Batch
			var longest time.Duration // the longest pause between two appends
			last := start
			for i := range tc.appends {
				b, err := w.Add(testEntry(uint64(i)))
				if err != nil {
					t.Fatalf("add: %v", err)
				}
				now := time.Now()
				longest = max(longest, now.Sub(last))
				last = now
				batches = append(batches, b)
				time.Sleep(tc.gap)
			}
			waitBatches(t, batches)
			took := time.Since(start)
			maxPuts := tc.maxPuts
			if maxPuts == 0 {
				// A slow machine stretches the run, not the spacing.
				maxPuts = int(took/tc.interval) + 1
			}
			if starts := store.times(); len(starts) < tc.minPuts || len(starts) > maxPuts {
				// When each upload started, and how long the loop stalled
				// at worst, tell a writer that held a batch from a process
				// the machine did not run.
				var at []string
				for _, s := range starts {
					at = append(at, s.Sub(start).Round(time.Millisecond).String())
				}
				t.Fatalf("%d uploads for %d appends %s apart in %s (interval %s, quiet %s); want %d to %d "+
					"(uploads started at %s; longest pause between appends %s)",
					len(starts), tc.appends, tc.gap, took.Round(time.Millisecond), tc.interval, tc.quiet, tc.minPuts, maxPuts,
					strings.Join(at, " "), longest.Round(time.Millisecond))
			}
			if tc.within > 0 && took >= tc.within {
				t.Fatalf("appends took %s to be acknowledged; want less than %s (interval %s)", took, tc.within, tc.interval)
			}
		})
	}
}

// A batch that reaches flush_size goes out without waiting for the spacing.
func TestWriterFlushSizeOverridesSpacing(t *testing.T) {
	w, store := newTestWriter(t, segment.WriterConfig{FlushInterval: 10 * time.Second, FlushSize: 1})
	for i := range 3 {
		b, err := w.Add(testEntry(uint64(i)))
		if err != nil {
			t.Fatalf("add: %v", err)
		}
		select {
		case <-b.Done():
		case <-time.After(2 * time.Second):
			t.Fatalf("append %d over flush_size waited for the 10s interval", i)
		}
	}
	if n := len(store.times()); n != 3 {
		t.Fatalf("%d uploads for 3 appends each over flush_size; want 3", n)
	}
}

// failingPuts fails PUTs while fail says so.
type failingPuts struct {
	segment.Store
	fail func() bool
}

func (s *failingPuts) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	if s.fail() {
		return "", errors.New("injected")
	}
	return s.Store.Put(ctx, key, data, opts)
}

// abortLog records aborted batches.
type abortLog struct {
	noHooks
	mu      sync.Mutex
	aborted []*segment.Batch
}

func (h *abortLog) Aborted(b *segment.Batch, _ error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.aborted = append(h.aborted, b)
}

// A batch is lost only when its fate is fixed: a seal took the place of
// its failed upload. One aborted because the store never answered again
// may yet have landed.
func TestWriterTellsLostBatches(t *testing.T) {
	for _, tc := range []struct {
		name     string
		failPuts int // PUTs that fail, counting from the first; -1: all
		wantLost bool
	}{
		{"the upload fails, the seal lands", 1, true},
		{"the store never answers again", -1, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			left := tc.failPuts
			store := &failingPuts{Store: memstore.New(), fail: func() bool {
				mu.Lock()
				defer mu.Unlock()
				if left == 0 {
					return false
				}
				left--
				return true
			}}
			hooks := &abortLog{}
			w := segment.NewWriter(store, 1, 0, segment.WriterConfig{FlushInterval: time.Millisecond}, segment.WriterDeps{
				Hooks:        hooks,
				NewNamespace: func(context.Context) (uint64, error) { return 2, nil },
			})
			b, err := w.Add(testEntry(0))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			_ = w.Close(ctx)
			<-b.Done()
			if b.Err() == nil {
				t.Fatal("the batch committed despite its failed upload")
			}
			hooks.mu.Lock()
			defer hooks.mu.Unlock()
			if len(hooks.aborted) != 1 || hooks.aborted[0] != b {
				t.Fatalf("aborted batches %v, want the one", hooks.aborted)
			}
			if b.Lost() != tc.wantLost {
				t.Errorf("Lost() = %v, want %v", b.Lost(), tc.wantLost)
			}
		})
	}
}

// Close waits for a settlement under way as for an upload: a seal that
// lands a few tries later tells the batch's waiters that it is lost, safe
// to send again. Close once saw an empty queue while the batches being
// settled were off it, gave up at once and cut the seal short, and the
// waiters heard only that the outcome was unknown.
func TestWriterCloseWaitsForSettlement(t *testing.T) {
	var mu sync.Mutex
	puts, left := 0, 4 // the upload and the seal's first three tries fail
	sealing := make(chan struct{})
	store := &failingPuts{Store: memstore.New(), fail: func() bool {
		mu.Lock()
		defer mu.Unlock()
		puts++
		if puts == 2 {
			close(sealing)
		}
		if left == 0 {
			return false
		}
		left--
		return true
	}}
	w := segment.NewWriter(store, 1, 0, segment.WriterConfig{FlushInterval: time.Millisecond}, segment.WriterDeps{
		Hooks:        noHooks{},
		NewNamespace: func(context.Context) (uint64, error) { return 2, nil },
	})
	b, err := w.Add(testEntry(0))
	if err != nil {
		t.Fatal(err)
	}
	<-sealing
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := w.Close(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}
	select {
	case <-b.Done():
	default:
		t.Fatal("Close returned before the batch's outcome was released")
	}
	if b.Err() == nil {
		t.Fatal("the batch committed despite its failed upload")
	}
	if !b.Lost() || errors.Is(b.Err(), segment.ErrClosedUnsettled) {
		t.Errorf("the batch whose seal landed is not known lost: %v", b.Err())
	}
}

// heldPuts is a store whose PUTs wait until release is closed: a store
// that has stalled.
type heldPuts struct {
	segment.Store
	release chan struct{}
}

func (s *heldPuts) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	select {
	case <-s.release:
	case <-ctx.Done():
		return "", ctx.Err()
	}
	return s.Store.Put(ctx, key, data, opts)
}

// While the store stalls, the bytes waiting for it stop growing at
// MaxPending: Add and Extend refuse with ErrWriterBusy, and take entries
// again once the uploads' outcomes are released.
func TestWriterRefusesPastMaxPending(t *testing.T) {
	store := &heldPuts{Store: memstore.New(), release: make(chan struct{})}
	const maxPending = 4 << 10
	w := segment.NewWriter(store, 1, 0,
		segment.WriterConfig{FlushInterval: time.Millisecond, MaxInFlight: 2, MaxPending: maxPending},
		segment.WriterDeps{Hooks: noHooks{}})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := w.Close(ctx); err != nil {
			t.Errorf("close writer: %v", err)
		}
	})
	body := make([]byte, 512)
	entry := func(seq uint64) *segment.Entry {
		return &segment.Entry{StreamID: "s", Name: "s", FirstSeq: seq, Records: []segment.Record{{Seq: seq, Body: body}}}
	}

	var batches []*segment.Batch
	var refused error
	for seq := uint64(0); seq < 100; seq++ {
		b, err := w.Add(entry(seq))
		if err != nil {
			refused = err
			break
		}
		batches = append(batches, b)
		time.Sleep(2 * time.Millisecond) // let uploads start and stall
	}
	if !errors.Is(refused, segment.ErrWriterBusy) {
		t.Fatalf("Add with the store stalled: err %v after %d entries, want ErrWriterBusy", refused, len(batches))
	}
	pending := w.Pending()
	if pending < maxPending || pending > maxPending+1024 {
		t.Errorf("pending %d bytes when Add refused, want %d plus at most one entry", pending, maxPending)
	}
	last := batches[len(batches)-1]
	grown := false
	if w.Extend(last, func() (int, int) { grown = true; return 0, 0 }) || grown {
		t.Errorf("Extend took an append past MaxPending")
	}

	close(store.release)
	for i, b := range batches {
		select {
		case <-b.Done():
			if err := b.Err(); err != nil {
				t.Fatalf("batch %d: %v", i, err)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("batch %d not released after the store came back", i)
		}
	}
	if p := w.Pending(); p != 0 {
		t.Errorf("pending %d bytes once every batch is released, want 0", p)
	}
	if _, err := w.Add(entry(uint64(len(batches)))); err != nil {
		t.Errorf("Add after the store came back: %v", err)
	}
}

// Bytes reserved for uploads outside the writer (large appends' blobs)
// count against MaxPending like entries, until given back.
func TestWriterReserveCountsAgainstMaxPending(t *testing.T) {
	w, _ := newTestWriter(t, segment.WriterConfig{FlushInterval: time.Millisecond, MaxPending: 1000})
	first, err := w.Reserve(600)
	if err != nil {
		t.Fatalf("first reservation: %v", err)
	}
	second, err := w.Reserve(600)
	if err != nil {
		t.Fatalf("second reservation, made below the bound: %v", err)
	}
	if _, err := w.Reserve(1); !errors.Is(err, segment.ErrWriterBusy) {
		t.Errorf("reservation past the bound: err %v, want ErrWriterBusy", err)
	}
	if _, err := w.Add(testEntry(0)); !errors.Is(err, segment.ErrWriterBusy) {
		t.Errorf("Add past the bound: err %v, want ErrWriterBusy", err)
	}
	first()
	first() // giving back twice gives back once
	if p := w.Pending(); p != 600 {
		t.Errorf("pending %d after one reservation went back, want 600", p)
	}
	b, err := w.Add(testEntry(0))
	if err != nil {
		t.Fatalf("Add below the bound again: %v", err)
	}
	<-b.Done()
	second()
	if p := w.Pending(); p != 0 {
		t.Errorf("pending %d with nothing waiting, want 0", p)
	}
}

// goroutineLog is a store that records which goroutine ran each PUT.
type goroutineLog struct {
	segment.Store
	mu  sync.Mutex
	ids map[string]int
}

func (s *goroutineLog) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	buf := make([]byte, 64)
	buf = buf[:runtime.Stack(buf, false)]
	id, _, _ := strings.Cut(strings.TrimPrefix(string(buf), "goroutine "), " ")
	s.mu.Lock()
	s.ids[id]++
	s.mu.Unlock()
	return s.Store.Put(ctx, key, data, opts)
}

// Uploads one after another run on one goroutine, which stays for the
// next (a fresh goroutine per PUT grew its stack through the S3 client's
// deep calls every time), and the uploaders end when the writer closes.
func TestWriterReusesUploaders(t *testing.T) {
	before := testenv.WaitPoolGoroutines(0, 5*time.Second)
	store := &goroutineLog{Store: memstore.New(), ids: map[string]int{}}
	w := segment.NewWriter(store, 1, 0, segment.WriterConfig{FlushInterval: time.Millisecond, MaxInFlight: 4},
		segment.WriterDeps{Hooks: noHooks{}})
	const n = 20
	for seq := uint64(0); seq < n; seq++ {
		// The batch is released from its upload's goroutine, which is
		// back waiting for the next a moment later. (Should it not get
		// back, the counts below say so.)
		testenv.WaitPoolIdle(5 * time.Second)
		b, err := w.Add(testEntry(seq))
		if err != nil {
			t.Fatalf("add %d: %v", seq, err)
		}
		waitBatches(t, []*segment.Batch{b})
	}
	store.mu.Lock()
	ids := len(store.ids)
	store.mu.Unlock()
	if ids != 1 {
		t.Errorf("%d sequential uploads ran on %d goroutines, want 1", n, ids)
	}
	if got := testenv.PoolGoroutines() - before; got != 1 {
		t.Errorf("%d uploaders waiting between uploads, want 1", got)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := w.Close(ctx); err != nil {
		t.Fatalf("close writer: %v", err)
	}
	if got := testenv.WaitPoolGoroutines(before, time.Second) - before; got != 0 {
		t.Errorf("%d uploaders left after Close, want 0", got)
	}
}

// failFirstWALPut holds the first WAL PUT until release is closed and then
// fails it; every other PUT, the seal's included, goes through.
type failFirstWALPut struct {
	segment.Store
	release chan struct{}
	mu      sync.Mutex
	taken   bool
}

func (s *failFirstWALPut) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	s.mu.Lock()
	first := !s.taken && strings.HasPrefix(key, "wal/")
	s.taken = s.taken || first
	s.mu.Unlock()
	if first {
		<-s.release
		return "", errors.New("injected upload failure")
	}
	return s.Store.Put(ctx, key, data, opts)
}

// A wish to flush belongs to the batch that is open when it is made. A
// batch that wanted out while every upload slot was busy, and was then
// doomed with the failed upload ahead of it, left the wish behind; so did
// a Flush with nothing open. The next batch took it for its own upload
// already asked for, armed no timer, and never went out: every append
// after the writer recovered waited for its timeout.
func TestWriterFlushWishDoesNotOutliveItsBatch(t *testing.T) {
	for _, tc := range []struct {
		name    string
		prepare func(t *testing.T, w *segment.Writer, store *failFirstWALPut)
	}{
		{"batch doomed by a failed upload", func(t *testing.T, w *segment.Writer, store *failFirstWALPut) {
			held, err := w.Add(testEntry(0)) // goes out at once and is held
			if err != nil {
				t.Fatal(err)
			}
			// Its upload has begun (and is held) before the next entry:
			// one added while it was still open would join it.
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
				store.mu.Lock()
				taken := store.taken
				store.mu.Unlock()
				if taken {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the first batch's upload never began")
				}
			}
			// Opens a batch whose interval passes while the one slot is taken.
			waiting, err := w.Add(testEntry(1))
			if err != nil {
				t.Fatal(err)
			}
			if waiting == held {
				t.Fatal("the second entry joined the held batch: nothing tested")
			}
			time.Sleep(50 * time.Millisecond)
			close(store.release)
			for _, b := range []*segment.Batch{held, waiting} {
				<-b.Done()
				if b.Err() == nil {
					t.Fatal("a batch behind the failed upload committed")
				}
			}
		}},
		{"Flush with nothing open", func(t *testing.T, w *segment.Writer, store *failFirstWALPut) {
			store.mu.Lock()
			store.taken = true // no upload fails here
			store.mu.Unlock()
			w.Flush()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store := &failFirstWALPut{Store: memstore.New(), release: make(chan struct{})}
			w := segment.NewWriter(store, 1, 0,
				segment.WriterConfig{FlushInterval: 5 * time.Millisecond, MaxInFlight: 1},
				segment.WriterDeps{Hooks: noHooks{}, NewNamespace: func(context.Context) (uint64, error) { return 2, nil }})
			t.Cleanup(func() {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				defer cancel()
				_ = w.Close(ctx)
			})
			tc.prepare(t, w, store)
			// Once the writer takes entries again (after a failure, in a
			// new namespace), the next one goes out within the interval.
			var b *segment.Batch
			deadline := time.Now().Add(2 * time.Second)
			for {
				var err error
				if b, err = w.Add(testEntry(0)); err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the writer never took entries again: %v", err)
				}
				time.Sleep(5 * time.Millisecond)
			}
			select {
			case <-b.Done():
				if err := b.Err(); err != nil {
					t.Fatalf("the next batch: %v", err)
				}
			case <-time.After(3 * time.Second):
				ns, seq := w.Position()
				t.Fatalf("the next batch was not uploaded within 3 s at flush_interval 5ms (writer at namespace %d, seq %d)", ns, seq)
			}
		})
	}
}

// An object that fails its checksum at the key of a failed upload must not
// wedge the writer. The seal that settles the upload used to read it back,
// fail to decode it and give up, leaving the writer broken: every later
// append refused until a restart. The seal now takes its place, so replay
// stops there, and the writer goes on in a new namespace.
func TestWriterSealReplacesCorruptObject(t *testing.T) {
	store := memstore.New()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	key := segment.WALKey(1, 0)
	// The upload below finds the key taken (if-none-match) and fails; the
	// seal then reads back bytes that are no WAL object.
	if _, err := store.Put(ctx, key, []byte("PMQW\x01 torn and unreadable"), segment.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	w := segment.NewWriter(store, 1, 0, segment.WriterConfig{FlushInterval: time.Millisecond}, segment.WriterDeps{
		Hooks:        noHooks{},
		Token:        "me",
		NewNamespace: func(context.Context) (uint64, error) { return 2, nil },
	})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = w.Close(ctx)
	})
	first, err := w.Add(testEntry(0))
	if err != nil {
		t.Fatal(err)
	}
	<-first.Done()
	if first.Err() == nil {
		t.Fatal("the batch committed though its key held another object")
	}

	var next *segment.Batch
	for {
		if next, err = w.Add(testEntry(0)); err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("the writer never took entries again after the corrupt object: %v", err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	select {
	case <-next.Done():
	case <-ctx.Done():
		t.Fatal("the next batch never settled")
	}
	if err := next.Err(); err != nil {
		t.Fatalf("the next batch: %v", err)
	}
	if next.Namespace != 2 {
		t.Errorf("the next batch went to namespace %d, want 2 (a new one)", next.Namespace)
	}
	data, _, err := store.Get(ctx, key, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	obj, err := segment.DecodeWAL(data)
	if err != nil || !obj.Sealed || obj.SealToken != "me" {
		t.Fatalf("%s holds %q (decode: %v), want this writer's seal", key, data, err)
	}
}

// MaxPending bounds the memory that appends waiting for a stalled store
// hold, whatever the size of their records. Counted encoded, one-byte
// records (17 bytes each, where each holds a 64-byte Record and, as a JSON
// message, a 64-byte buffer) held several times MaxPending.
func TestWriterMaxPendingBoundsMemoryOfTinyRecords(t *testing.T) {
	store := &heldPuts{Store: memstore.New(), release: make(chan struct{})}
	const maxPending = 8 << 20
	w := segment.NewWriter(store, 1, 0,
		segment.WriterConfig{FlushInterval: time.Millisecond, FlushSize: 64 << 10, MaxInFlight: 2, MaxPending: maxPending},
		segment.WriterDeps{Hooks: noHooks{}})
	t.Cleanup(func() {
		close(store.release)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := w.Close(ctx); err != nil {
			t.Errorf("close writer: %v", err)
		}
	})
	// An append of perAppend one-byte records, each body a buffer of its
	// own as jsonMessages leaves it.
	const perAppend = 960
	entry := func(seq uint64) *segment.Entry {
		recs := make([]segment.Record, perAppend)
		for i := range recs {
			var b bytes.Buffer
			b.WriteByte('0' + byte(i%10))
			recs[i] = segment.Record{Seq: seq + uint64(i), Body: b.Bytes()}
		}
		return &segment.Entry{StreamID: "s", Name: "s", FirstSeq: seq, Records: recs}
	}

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	added := 0
	for seq := uint64(0); ; seq += perAppend {
		if _, err := w.Add(entry(seq)); errors.Is(err, segment.ErrWriterBusy) {
			break
		} else if err != nil {
			t.Fatalf("add: %v", err)
		}
		if added++; added > 100_000 {
			t.Fatalf("%d appends taken with the store stalled", added)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	held := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("%d appends of %d one-byte records taken with the store stalled: %.1f MiB held, %.1f MiB pending counted; MaxPending %d MiB",
		added, perAppend, float64(held)/(1<<20), float64(w.Pending())/(1<<20), maxPending>>20)
	if held > maxPending*3/2 {
		t.Errorf("appends waiting for the store hold %.1f MiB with MaxPending %d MiB", float64(held)/(1<<20), maxPending>>20)
	}
}
