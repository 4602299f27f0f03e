package streamstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// lostAnswers is a store whose writes can land and still report failure, as
// an S3 PUT does when its answer is lost or its request is cancelled after
// the upload, and whose reads of some keys can fail for a while.
type lostAnswers struct {
	*memstore.Store
	mu    sync.Mutex
	lose  func(key string, opts segment.PutOptions) bool // one matching PUT lands, then fails
	blind func(key string) bool                          // once a PUT was lost, matching GETs fail
	// downAfterLoss, once a PUT was lost, fails the PUTs it matches.
	downAfterLoss func(key string) bool
	lost          bool
}

func (l *lostAnswers) loseNext(match func(string, segment.PutOptions) bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lose = match
}

func (l *lostAnswers) blindTo(match func(string) bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.blind = match
}

func (l *lostAnswers) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	l.mu.Lock()
	if l.lost && l.downAfterLoss != nil && l.downAfterLoss(key) {
		l.mu.Unlock()
		return "", fmt.Errorf("put %s: connection refused", key)
	}
	lost := l.lose != nil && l.lose(key, opts)
	if lost {
		l.lose, l.lost = nil, true
	}
	l.mu.Unlock()
	tag, err := l.Store.Put(ctx, key, data, opts)
	if lost && err == nil {
		return "", fmt.Errorf("put %s: %w", key, segment.ErrUnknownOutcome)
	}
	return tag, err
}

func (l *lostAnswers) Get(ctx context.Context, key string, off, n int64) ([]byte, string, error) {
	l.mu.Lock()
	blind := l.lost && l.blind != nil && l.blind(key)
	l.mu.Unlock()
	if blind {
		return nil, "", fmt.Errorf("get %s: connection refused", key)
	}
	return l.Store.Get(ctx, key, off, n)
}

func conditionalOn(name string) func(string, segment.PutOptions) bool {
	return func(k string, o segment.PutOptions) bool { return k == metaKey(name) && o.IfMatch != "" }
}

// A metadata write that landed but reported failure must not leave the
// engine comparing against a version that is no longer there: the next
// checkpoint's failed precondition once looked like a delete, compaction
// retired the WAL entries it had not checkpointed, and acknowledged appends
// were gone after a restart.
func TestUnconfirmedMetadataWrites(t *testing.T) {
	tests := []struct {
		name string
		// lose arms the store and runs the operation whose metadata
		// write lands unconfirmed.
		lose func(t *testing.T, e *Engine, st *lostAnswers)
	}{
		{"checkpoint", func(t *testing.T, e *Engine, st *lostAnswers) {
			st.loseNext(conditionalOn("/s"))
			_ = e.Compact(context.Background())
		}},
		{"checkpoint, read-back unreachable", func(t *testing.T, e *Engine, st *lostAnswers) {
			st.loseNext(conditionalOn("/s"))
			st.blindTo(func(k string) bool { return k == metaKey("/s") })
			if err := e.Compact(context.Background()); err == nil {
				t.Error("a compaction whose checkpoint it could not confirm reported success")
			}
			st.blindTo(nil)
		}},
		{"fork count of a fork create", func(t *testing.T, e *Engine, st *lostAnswers) {
			st.loseNext(conditionalOn("/s"))
			_, _, _ = e.Create(context.Background(), "/f", CreateRequest{Fork: &ForkFrom{Source: "/s", Seq: 1}})
		}},
		{"soft delete, read-back unreachable", func(t *testing.T, e *Engine, st *lostAnswers) {
			// A fork keeps the source's data, so its delete is a
			// metadata write.
			if _, _, err := e.Create(context.Background(), "/f", CreateRequest{Fork: &ForkFrom{Source: "/s", Seq: 1}}); err != nil {
				t.Fatal(err)
			}
			st.loseNext(conditionalOn("/s"))
			st.blindTo(func(k string) bool { return k == metaKey("/s") })
			if err := e.Delete(context.Background(), "/s"); err == nil {
				t.Fatal("a delete it could not confirm reported success")
			}
			st.blindTo(nil)
			// Told it failed, the stream goes on as if it had.
			if _, err := e.Append(context.Background(), "/s", AppendRequest{Records: recs("b")}); err != nil {
				t.Fatalf("append after a failed delete: %v", err)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := &lostAnswers{Store: memstore.New()}
			e := startEngine(t, st, Config{PackBelow: -1})
			var acked []string
			appendOne := func(body string) {
				t.Helper()
				if _, err := e.Append(ctx, "/s", AppendRequest{Records: recs(body)}); err != nil {
					t.Fatalf("append %s: %v", body, err)
				}
				acked = append(acked, body)
			}
			if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
				t.Fatal(err)
			}
			appendOne("a")
			tc.lose(t, e, st)
			acked = readAll(t, e, "/s")
			for _, b := range []string{"c", "d"} {
				appendOne(b)
				if err := e.Compact(ctx); err != nil {
					t.Fatalf("compaction after the unconfirmed write: %v", err)
				}
			}
			if wal := st.Keys("wal/"); len(wal) > 1 {
				t.Errorf("compaction left %d WAL objects: it no longer checkpoints the stream", len(wal))
			}
			// A crash: a new engine on the bucket as it is.
			e2 := startEngine(t, st.Store, Config{})
			if got, want := fmt.Sprint(readAll(t, e2, "/s")), fmt.Sprint(acked); got != want {
				t.Fatalf("after a restart the stream reads %s; acknowledged %s", got, want)
			}
		})
	}
}

// A metadata object another process wrote is not ours to overwrite, and
// while it is there compaction must not retire WAL entries it could not
// checkpoint. Two engines with one node id stand for a process that goes
// on after another took the storage over.
func TestForeignMetadataWrite(t *testing.T) {
	for _, newFirst := range []bool{false, true} {
		name := map[bool]string{false: "old owner checkpoints first", true: "new owner checkpoints first"}[newFirst]
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			a := startEngine(t, st, Config{PackBelow: -1})
			if _, _, err := a.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
				t.Fatal(err)
			}
			if _, err := a.Append(ctx, "/s", AppendRequest{Records: recs("a")}); err != nil {
				t.Fatal(err)
			}
			b := startEngine(t, st, Config{PackBelow: -1})
			if got := fmt.Sprint(readAll(t, b, "/s")); got != "[a]" {
				t.Fatalf("the new owner reads %s", got)
			}
			if !newFirst {
				_ = a.Compact(ctx) // the old owner's checkpoint lands under b
			}
			if _, err := b.Append(ctx, "/s", AppendRequest{Records: recs("b")}); err != nil {
				t.Fatal(err)
			}
			if err := b.Compact(ctx); err != nil && newFirst {
				t.Fatal(err)
			}
			if newFirst {
				before, _, _ := st.Get(ctx, metaKey("/s"), 0, -1)
				if err := a.Compact(ctx); err == nil {
					t.Error("the old owner's compaction wrote over the new owner's checkpoint without a word")
				}
				if after, _, _ := st.Get(ctx, metaKey("/s"), 0, -1); string(after) != string(before) {
					t.Error("the old owner rewrote the new owner's checkpoint")
				}
			}
			c := startEngine(t, st, Config{})
			if got := fmt.Sprint(readAll(t, c, "/s")); got != "[a b]" {
				t.Fatalf("acknowledged [a b]; after a restart the stream reads %s", got)
			}
		})
	}
}

// A create with records whose metadata write lands unconfirmed: the
// records are the stream's, so the stream must not be loaded without them
// (its next append would take their seqs).
func TestCreateMetadataUnconfirmed(t *testing.T) {
	tests := []struct {
		name        string
		blind       bool // the read-back cannot reach the bucket at first
		wantCreated bool
	}{
		{name: "read back at once", wantCreated: true},
		{name: "bucket answers later", blind: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := &lostAnswers{Store: memstore.New()}
			e := startEngine(t, st, Config{PackBelow: -1})
			st.loseNext(func(k string, o segment.PutOptions) bool { return k == metaKey("/c") && o.IfNoneMatch })
			if tc.blind {
				st.blindTo(func(k string) bool { return k == metaKey("/c") })
			}
			_, created, err := e.Create(ctx, "/c", CreateRequest{ContentType: "text/plain", Records: recs("x")})
			if created != tc.wantCreated {
				t.Fatalf("create: created %v, err %v", created, err)
			}
			if !tc.wantCreated && !errors.Is(err, ErrUnconfirmed) {
				t.Fatalf("create: %v; want it unconfirmed", err)
			}
			if tc.blind {
				// Lookups wait for the answer rather than load the
				// stream without its records.
				wctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
				_, err := e.Head(wctx, "/c")
				cancel()
				if !errors.Is(err, context.DeadlineExceeded) {
					t.Fatalf("a lookup before the bucket answered: %v", err)
				}
				st.blindTo(nil)
			}
			if _, err := e.Append(ctx, "/c", AppendRequest{Records: recs("y")}); err != nil {
				t.Fatal(err)
			}
			if got := fmt.Sprint(readAll(t, e, "/c")); got != "[x y]" {
				t.Fatalf("the stream reads %s", got)
			}
			e2 := startEngine(t, st.Store, Config{})
			if got := fmt.Sprint(readAll(t, e2, "/c")); got != "[x y]" {
				t.Fatalf("after a restart the stream reads %s", got)
			}
		})
	}
}

// Creates with records while compactions run back to back: a crash at any
// moment (an image of the bucket) must keep each acknowledged create's
// records. A stream that left the creating set before it was published
// could be cut past and its WAL entry retired before its checkpoint.
func TestCreateRacingCompaction(t *testing.T) {
	ctx := context.Background()
	st := &imageStore{in: memstore.New()}
	e := startEngine(t, st, Config{FlushInterval: 50 * time.Microsecond, PackBelow: -1})
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
				_ = e.Compact(ctx)
			}
		}
	})
	defer func() { close(stop); wg.Wait() }()
	// The window this guards against was a few instructions wide: a
	// compaction hit it within a few seconds of creates about half the time.
	deadline := time.Now().Add(5 * time.Second)
	for i := 0; time.Now().Before(deadline); i++ {
		name := fmt.Sprintf("/r%d", i)
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain", Records: recs("x")}); err != nil {
			t.Fatal(err)
		}
		if !notCheckpointed(t, st.in, name) {
			continue // and never will be again: nothing to check
		}
		img := st.image()
		if !notCheckpointed(t, img, name) {
			continue
		}
		// Not checkpointed: the WAL in the image must still hold it.
		e2 := New(img, Config{NodeID: "node-a", CompactInterval: time.Hour}, nil)
		if err := e2.Start(ctx); err != nil {
			t.Fatal(err)
		}
		res, err := e2.Read(ctx, name, ReadRequest{})
		_ = e2.Close(ctx)
		if err != nil || len(res.Records) != 1 {
			t.Fatalf("%s: a crash image reads %d records (%v); the create acknowledged one", name, len(res.Records), err)
		}
	}
}

// notCheckpointed reports whether name's metadata in st says no record of
// it is in a data object yet.
func notCheckpointed(t *testing.T, st segment.Store, name string) bool {
	t.Helper()
	return storedMeta(t, st, name).State.NextSeq == 0
}

// imageStore can copy the bucket at an instant, as a crash would leave it.
type imageStore struct {
	mu sync.RWMutex
	in *memstore.Store
}

func (s *imageStore) Put(ctx context.Context, k string, d []byte, o segment.PutOptions) (string, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.in.Put(ctx, k, d, o)
}

func (s *imageStore) Get(ctx context.Context, k string, off, n int64) ([]byte, string, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.in.Get(ctx, k, off, n)
}

func (s *imageStore) List(ctx context.Context, p, after string, max int) ([]segment.ObjectInfo, bool, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.in.List(ctx, p, after, max)
}

func (s *imageStore) Delete(ctx context.Context, keys []string) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.in.Delete(ctx, keys)
}

func (s *imageStore) DeleteIfMatch(ctx context.Context, key, etag string) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.in.DeleteIfMatch(ctx, key, etag)
}

func (s *imageStore) image() *memstore.Store {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := memstore.New()
	for _, k := range s.in.Keys("") {
		d, _, _ := s.in.Get(context.Background(), k, 0, -1)
		_, _ = out.Put(context.Background(), k, d, segment.PutOptions{})
	}
	return out
}

// An append whose WAL upload may have landed, and whose fate the writer
// could not settle before it closed (the store unreachable), must be
// answered "unconfirmed", not "nothing was acknowledged".
func TestCloseDuringOutageLeavesAppendUnconfirmed(t *testing.T) {
	ctx := context.Background()
	st := &lostAnswers{Store: memstore.New()}
	e := New(st, Config{NodeID: "node-a", FlushInterval: time.Millisecond, CompactInterval: time.Hour}, nil)
	if err := e.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	// The upload lands and fails; from then on the WAL is unreachable, so
	// the seal that would settle it cannot be written.
	st.downAfterLoss = func(k string) bool { return strings.HasPrefix(k, "wal/") }
	st.blindTo(func(k string) bool { return strings.HasPrefix(k, "wal/") })
	st.loseNext(func(k string, _ segment.PutOptions) bool { return strings.HasPrefix(k, "wal/") })
	done := make(chan error, 1)
	go func() {
		_, err := e.Append(ctx, "/s", AppendRequest{Records: recs("once")})
		done <- err
	}()
	time.Sleep(300 * time.Millisecond)
	cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	_ = e.Close(cctx)
	cancel()
	err := <-done
	e2 := startEngine(t, st.Store, Config{})
	got := readAll(t, e2, "/s")
	if len(got) > 0 && !errors.Is(err, ErrUnconfirmed) {
		t.Fatalf("the append was answered %q, yet a restart reads it: %v", err, got)
	}
	if len(got) == 0 {
		t.Fatalf("the lost answer's upload did not land: the test sets up nothing (append: %v)", err)
	}
}

// A delete whose metadata DELETE fails must leave the stream whole: the
// gc tombstone it wrote first once made the collector delete the live
// stream's data. One whose DELETE landed unconfirmed must leave it gone:
// appends acknowledged after it were lost.
func TestDeleteMetadataFailure(t *testing.T) {
	tests := []struct {
		name     string
		lands    bool // the swap for a grave is applied before it reports failure
		wantGone bool
	}{
		{name: "not applied"},
		{name: "applied unconfirmed", lands: true, wantGone: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := &lostAnswers{Store: memstore.New()}
			// Graves go at the first collection, so that it leaves no
			// tombstone either way.
			e := startEngine(t, st, Config{PackBelow: -1, GraveTime: time.Nanosecond})
			if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain", Records: recs("a", "b")}); err != nil {
				t.Fatal(err)
			}
			if err := e.Compact(ctx); err != nil {
				t.Fatal(err)
			}
			if len(st.Keys("data/")) == 0 {
				t.Fatal("compaction wrote no data object: the test checks nothing")
			}
			var once sync.Once
			st.SetFail(func(op, key string) error {
				var err error
				if op == "PUT" && key == metaKey("/s") && !tc.lands {
					once.Do(func() { err = fmt.Errorf("put %s: connection reset", key) })
				}
				return err
			})
			if tc.lands {
				st.loseNext(conditionalOn("/s"))
			}
			err := e.Delete(ctx, "/s")
			st.SetFail(nil)
			if gone := err == nil; gone != tc.wantGone {
				t.Fatalf("delete: %v", err)
			}
			if err := e.collectGarbage(ctx); err != nil {
				t.Fatal(err)
			}
			if tomb := st.Keys("gc/"); len(tomb) != 0 {
				t.Errorf("tombstones left after collection: %v", tomb)
			}
			if tc.wantGone {
				if _, err := e.Append(ctx, "/s", AppendRequest{Records: recs("c")}); !errors.Is(err, ErrNotFound) {
					t.Fatalf("append to the deleted stream: %v", err)
				}
				return
			}
			if got := fmt.Sprint(readAll(t, e, "/s")); got != "[a b]" {
				t.Fatalf("after the failed delete and a collection the stream reads %s", got)
			}
			e2 := startEngine(t, st, Config{})
			if got := fmt.Sprint(readAll(t, e2, "/s")); got != "[a b]" {
				t.Fatalf("after a restart the stream reads %s", got)
			}
		})
	}
}

// A fork create that is unconfirmed may have made the fork: the source
// keeps counting it, or deleting the source would free data the fork
// reads.
func TestUnconfirmedForkKeepsSourceCount(t *testing.T) {
	ctx := context.Background()
	st := &lostAnswers{Store: memstore.New()}
	e := startEngine(t, st, Config{PackBelow: -1})
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	st.loseNext(func(k string, o segment.PutOptions) bool { return k == metaKey("/f") && o.IfNoneMatch })
	st.blindTo(func(k string) bool { return k == metaKey("/f") })
	_, _, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1}})
	if !errors.Is(err, ErrUnconfirmed) {
		t.Fatalf("fork create: %v; want it unconfirmed", err)
	}
	st.blindTo(nil)
	if err := e.Delete(ctx, "/src"); err != nil {
		t.Fatal(err)
	}
	if err := e.collectGarbage(ctx); err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(readAll(t, e, "/f")); got != "[a]" {
		t.Fatalf("the fork reads %s after its source was deleted", got)
	}
}

// A producer's retry that arrives while the original append is in flight
// waits for it; when the original's batch aborts, the retry must go on
// (and be applied) rather than wait for some other append to wake it.
func TestProducerRetryAfterAbort(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	gate := make(chan struct{})
	var once sync.Once
	var armed atomic.Bool
	// Fail is set before the engine starts, which reads it from its own
	// goroutines; armed turns it on once the stream exists.
	st.SetFail(func(op, key string) error {
		var err error
		if armed.Load() && op == "PUT" && strings.HasPrefix(key, "wal/") {
			once.Do(func() {
				<-gate // the upload hangs, then fails; its seal wins
				err = errors.New("upload failed")
			})
		}
		return err
	})
	e := startEngine(t, st, Config{AppendTimeout: 5 * time.Second})
	if _, _, err := e.Create(ctx, "/p", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	armed.Store(true)
	app := func() error {
		_, err := e.Append(ctx, "/p", AppendRequest{Records: recs("a"), Producer: &Producer{ID: "w", Epoch: 0, Seq: 0}})
		return err
	}
	first, retry := make(chan error, 1), make(chan error, 1)
	go func() { first <- app() }()
	if err := waitUntil(2*time.Second, func() bool {
		e.mu.Lock()
		s := e.streams["/p"]
		e.mu.Unlock()
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.pending > 0
	}); err != nil {
		t.Fatal("the original append never reached the writer")
	}
	go func() { retry <- app() }()
	// The retry finds the original in flight and waits for it to settle
	// (in Append's own select; the original waits in awaitBatch). Not
	// parked there before the abort, it never waited on the original.
	if err := waitUntil(5*time.Second, func() bool {
		return goroutineSelectsIn("streamstore.(*Engine).Append(")
	}); err != nil {
		close(gate)
		t.Fatal("the retry never waited on the original in flight: nothing tested")
	}
	close(gate)
	if err := <-first; !errors.Is(err, ErrUnavailable) {
		t.Fatalf("original: %v", err)
	}
	select {
	case err := <-retry:
		// It may have joined the aborted batch's namespace and failed
		// with it; either way it answered.
		if err != nil && !errors.Is(err, ErrUnavailable) {
			t.Fatalf("retry: %v", err)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("the retry still waits 3 s after the original was aborted")
	}
	// The writer moves to a new namespace after the abort; retries from
	// then on are applied.
	var err error
	if werr := waitUntil(2*time.Second, func() bool { err = app(); return err == nil }); werr != nil {
		t.Fatalf("later retries: %v", err)
	}
	if got := fmt.Sprint(readAll(t, e, "/p")); got != "[a]" {
		t.Fatalf("the stream reads %s", got)
	}
}

// waitUntil polls cond until it holds or d passes.
func waitUntil(d time.Duration, cond func() bool) error {
	for end := time.Now().Add(d); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(end) {
			return fmt.Errorf("not true after %s", d)
		}
	}
	return nil
}

// delayedPut fails the first create-only PUT of one key before it lands,
// and keeps it, as a request still on its way, for the test to land late.
type delayedPut struct {
	*memstore.Store
	key  string
	mu   sync.Mutex
	held []byte
	done bool
	// landFirst lands the held PUT just before the next create-only PUT
	// of the key, so that one finds it there.
	landFirst bool
}

func (d *delayedPut) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	d.mu.Lock()
	if key == d.key && opts.IfNoneMatch && !d.done {
		d.done, d.held = true, slices.Clone(data)
		d.mu.Unlock()
		return "", fmt.Errorf("put %s: 503 SlowDown", key)
	}
	if key == d.key && opts.IfNoneMatch && d.landFirst {
		d.landFirst = false
		if _, err := d.Store.Put(ctx, key, d.held, opts); err != nil {
			d.mu.Unlock()
			return "", fmt.Errorf("land the held PUT: %w", err)
		}
	}
	d.mu.Unlock()
	return d.Store.Put(ctx, key, data, opts)
}

// land lets the held PUT arrive, and reports whether it was written.
func (d *delayedPut) land(t *testing.T) bool {
	t.Helper()
	d.mu.Lock()
	body := d.held
	d.mu.Unlock()
	if body == nil {
		t.Fatal("no PUT was held")
	}
	_, err := d.Store.Put(context.Background(), d.key, body, segment.PutOptions{IfNoneMatch: true})
	if err != nil && !errors.Is(err, segment.ErrPreconditionFailed) {
		t.Fatal(err)
	}
	return err == nil
}

// TestCreateRollsForward fails the metadata PUT of a create with records
// before it lands, with the bucket answering reads: the records are durable
// in the WAL, so the create must not be given up (the failed PUT may still
// land, and the stream would then load without them). It is reported
// unconfirmed, completes in the background, and the late PUT, whenever it
// lands, changes nothing.
func TestCreateRollsForward(t *testing.T) {
	tests := []struct {
		name      string
		landFirst bool // the late PUT lands before the engine's own
	}{
		{name: "the engine writes the metadata"},
		{name: "the late PUT lands first", landFirst: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := &delayedPut{Store: memstore.New(), key: metaKey("/c")}
			e := startEngine(t, st, Config{PackBelow: -1})
			_, created, err := e.Create(ctx, "/c", CreateRequest{ContentType: "text/plain", Records: recs("x")})
			if created || !errors.Is(err, ErrUnconfirmed) {
				t.Fatalf("create: created %v, err %v; want it unconfirmed", created, err)
			}
			if tc.landFirst && !st.land(t) {
				t.Fatal("the late PUT found metadata already there")
			}
			wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			_, err = e.Head(wctx, "/c")
			cancel()
			if err != nil {
				t.Fatalf("the stream after its create settled: %v", err)
			}
			if !tc.landFirst && st.land(t) {
				t.Fatal("the late PUT landed over nothing: the engine never wrote the metadata")
			}
			if _, err := e.Append(ctx, "/c", AppendRequest{Records: recs("y")}); err != nil {
				t.Fatal(err)
			}
			if got := fmt.Sprint(readAll(t, e, "/c")); got != "[x y]" {
				t.Fatalf("the stream reads %s", got)
			}
			if err := e.Compact(ctx); err != nil {
				t.Fatal(err)
			}
			e2 := startEngine(t, st.Store, Config{})
			if got := fmt.Sprint(readAll(t, e2, "/c")); got != "[x y]" {
				t.Fatalf("after a restart the stream reads %s", got)
			}
		})
	}
}

// heldPut is a store that can hold one metadata PUT back, telling the
// writer it failed without saying whether it landed (as a request cut
// short by its timeout does), and let it land later, its If-Match judged
// then, as a request stuck on its way does.
type heldPut struct {
	*memstore.Store
	mu   sync.Mutex
	hold string // the key of the next PUT to hold back
	held func() error
}

func (h *heldPut) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	h.mu.Lock()
	if h.hold == key {
		h.hold = ""
		body := append([]byte(nil), data...)
		h.held = func() error {
			_, err := h.Store.Put(context.Background(), key, body, opts)
			return err
		}
		h.mu.Unlock()
		return "", fmt.Errorf("injected: PUT of %s: %w", key, context.DeadlineExceeded)
	}
	h.mu.Unlock()
	return h.Store.Put(ctx, key, data, opts)
}

// A checkpoint whose PUT is stuck on its way is conditional on the version
// it replaces. Later writes of the stream's metadata (a fork made and
// deleted) can bring back the very bytes of that version, and with them
// its ETag, which is a hash of the bytes: the stuck checkpoint then lands
// after the writer had stopped counting it as possible. The stream's tail
// in the bucket moved past records the engine then packed, and a restart
// ignored the pack entry: an acknowledged append was lost. Every write of
// a stream's metadata is now a body never written before.
func TestStuckCheckpointCannotLandOnARepeatedVersion(t *testing.T) {
	ctx := context.Background()
	st := &heldPut{Store: memstore.New()}
	e := startEngine(t, st, Config{PackBelow: -1}) // folds: checkpoints
	const src, fork = "/aba", "/aba-fork"
	if _, _, err := e.Create(ctx, src, CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	want := []string{"a", "b"}
	mustAppend(t, e, src, AppendRequest{Records: recs(want...)})
	mustCompact(t, e)

	want = append(want, "c")
	mustAppend(t, e, src, AppendRequest{Records: recs("c")})
	st.mu.Lock()
	st.hold = metaKey(src)
	st.mu.Unlock()
	if err := e.Compact(ctx); err == nil {
		t.Fatal("the compaction whose checkpoint was held back succeeded")
	}

	// A fork made and deleted: two metadata writes of the source, the
	// second with the bytes the held checkpoint was conditional on.
	if _, _, err := e.Create(ctx, fork, CreateRequest{Fork: &ForkFrom{Source: src, Seq: 1}}); err != nil {
		t.Fatal(err)
	}
	if err := e.Delete(ctx, fork); err != nil {
		t.Fatal(err)
	}
	if err := waitUntil(5*time.Second, func() bool { return storedMeta(t, st, src).Forks == 0 }); err != nil {
		t.Fatal("the source never counted the fork's delete")
	}
	st.mu.Lock()
	land := st.held
	st.mu.Unlock()
	if err := land(); err == nil {
		t.Log("the held checkpoint landed late")
	} else if !errors.Is(err, segment.ErrPreconditionFailed) {
		t.Fatalf("the held checkpoint: %v", err)
	}

	setPackBelow(e, DefaultPackBelow)
	want = append(want, "d")
	mustAppend(t, e, src, AppendRequest{Records: recs("d")})
	mustCompact(t, e)
	mustCompact(t, e)
	if got := readAll(t, e, src); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("before a restart: %v, want %v", got, want)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	e2 := startEngine(t, st, Config{})
	if got := readAll(t, e2, src); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("after a restart: %v, want %v", got, want)
	}
}
