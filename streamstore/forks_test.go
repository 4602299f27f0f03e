package streamstore

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// hookedStore is a memstore whose Fail hook can be swapped while engines
// run on it.
type hookedStore struct {
	*memstore.Store
	mu   sync.Mutex
	hook func(op, key string) error
}

func newHookedStore() *hookedStore {
	s := &hookedStore{Store: memstore.New()}
	s.SetFail(func(op, key string) error {
		s.mu.Lock()
		h := s.hook
		s.mu.Unlock()
		if h != nil {
			return h(op, key)
		}
		return nil
	})
	return s
}

func (s *hookedStore) setHook(h func(op, key string) error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.hook = h
}

// forkedSource creates /src with the one record aa and the expiry exp,
// and /fork forked from it at seq 1.
func forkedSource(t *testing.T, e *Engine, exp Expiry) {
	t.Helper()
	ctx := context.Background()
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Expiry: exp, Records: recs("aa")}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Create(ctx, "/fork", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1}}); err != nil {
		t.Fatal(err)
	}
}

// loseForkRelease deletes /fork with the bucket refusing every PUT whose
// key refuse picks, then closes e, so that what the delete left to do in
// the background is lost with the process; the bucket takes PUTs again
// when it returns.
func loseForkRelease(t *testing.T, st *hookedStore, e *Engine, refuse func(key string) bool) {
	t.Helper()
	ctx := context.Background()
	st.setHook(func(op, key string) error {
		if op == "PUT" && refuse(key) {
			return fmt.Errorf("injected: PUT of %s refused", key)
		}
		return nil
	})
	defer st.setHook(nil)
	if err := e.Delete(ctx, "/fork"); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(ctx); err != nil {
		t.Logf("close: %v", err)
	}
}

// settledInBucket reads name's metadata from the bucket, not through an
// engine (a lookup there would touch the stream and settle it), and says
// whether it is settled: a grave, or gone. Any other error fails the test.
func settledInBucket(t *testing.T, st *hookedStore, name string) (data []byte, settled bool) {
	t.Helper()
	data, _, err := st.Get(context.Background(), metaKey(name), 0, -1)
	if errors.Is(err, segment.ErrNotFound) {
		return nil, true
	}
	if err != nil {
		t.Fatalf("read the metadata of %s from the bucket: %v", name, err)
	}
	return data, isGrave(data)
}

// trimmedSource creates /src with records aa bb cc dd, trimmed to seq 2,
// and compacted when compact is set (the trimmed bytes then leave the
// bucket).
func trimmedSource(t *testing.T, e *Engine, compact bool) {
	t.Helper()
	ctx := context.Background()
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Records: recs("aa", "bb", "cc", "dd")}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Trim(ctx, "/src", 2); err != nil {
		t.Fatal(err)
	}
	if compact {
		if err := e.Compact(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// bodiesFrom reads name from seq and returns the bodies.
func bodiesFrom(t *testing.T, e *Engine, name string, seq uint64) []string {
	t.Helper()
	res, err := e.Read(context.Background(), name, ReadRequest{Seq: seq})
	if err != nil {
		t.Fatalf("read %s from %d: %v", name, seq, err)
	}
	out := []string{}
	for _, r := range res.Records {
		out = append(out, string(r.Body))
	}
	return out
}

// TestForkOfTrimmedSource: a fork point below the source's first retained
// seq is refused with a *TrimmedError and writes nothing; a fork above it
// starts where the source does, so it never reads the trimmed records,
// which compaction may have removed, also after a restart.
func TestForkOfTrimmedSource(t *testing.T) {
	tests := []struct {
		name      string
		seq       uint64
		bytes     uint64
		trimmed   bool
		wantNext  uint64
		wantReads []string // read from the fork's start
	}{
		{name: "seq 0", seq: 0, trimmed: true},
		{name: "below the start", seq: 1, trimmed: true},
		{name: "bytes reaching past the start", seq: 0, bytes: 5, trimmed: true},
		{name: "at the start", seq: 2, wantNext: 2, wantReads: []string{}},
		{name: "inside the first retained record", seq: 2, bytes: 1, wantNext: 3, wantReads: []string{"c"}},
		{name: "above the start", seq: 4, wantNext: 4, wantReads: []string{"cc", "dd"}},
	}
	for _, compact := range []bool{false, true} {
		for _, tc := range tests {
			t.Run(fmt.Sprintf("%s/compacted=%t", tc.name, compact), func(t *testing.T) {
				ctx := context.Background()
				st := newHookedStore()
				e := startEngine(t, st, Config{})
				trimmedSource(t, e, compact)

				var puts atomic.Int64
				st.setHook(func(op, key string) error {
					if op == "PUT" {
						puts.Add(1)
					}
					return nil
				})
				info, _, err := e.Create(ctx, "/fork", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: tc.seq, Bytes: tc.bytes}})
				st.setHook(nil)
				if tc.trimmed {
					var te *TrimmedError
					if !errors.As(err, &te) || te.Seq != tc.seq || te.StartSeq != 2 || !errors.Is(err, ErrGone) {
						t.Fatalf("fork at (%d, %d): %v, want a TrimmedError at start 2", tc.seq, tc.bytes, err)
					}
					if n := puts.Load(); n != 0 {
						t.Errorf("the refused fork wrote %d objects", n)
					}
					if _, err := e.Head(ctx, "/fork"); !errors.Is(err, ErrNotFound) {
						t.Errorf("HEAD of the refused fork: %v", err)
					}
					return
				}
				if err != nil {
					t.Fatalf("fork at (%d, %d): %v", tc.seq, tc.bytes, err)
				}
				if info.StartSeq != 2 || info.NextSeq != tc.wantNext {
					t.Fatalf("fork info: start %d next %d, want 2 and %d", info.StartSeq, info.NextSeq, tc.wantNext)
				}
				for i, eng := range []*Engine{e, startEngine(t, st, Config{CacheBytes: 1})} {
					if _, err := eng.Read(ctx, "/fork", ReadRequest{Seq: 0}); !errors.Is(err, ErrGone) {
						t.Errorf("engine %d: read of the fork below its start: %v, want ErrGone", i, err)
					}
					if got := bodiesFrom(t, eng, "/fork", 2); fmt.Sprint(got) != fmt.Sprint(tc.wantReads) {
						t.Errorf("engine %d: fork reads %q, want %q", i, got, tc.wantReads)
					}
				}
			})
		}
	}
}

// TestForkOfForkKeepsTheInheritedStart: a fork's own forks cannot reach
// below the start it inherited.
func TestForkOfForkKeepsTheInheritedStart(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{})
	trimmedSource(t, e, true)
	if _, _, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 3}}); err != nil {
		t.Fatal(err)
	}
	var te *TrimmedError
	if _, _, err := e.Create(ctx, "/g", CreateRequest{Fork: &ForkFrom{Source: "/f", Seq: 1}}); !errors.As(err, &te) || te.StartSeq != 2 {
		t.Fatalf("fork of the fork below its start: %v", err)
	}
	if _, _, err := e.Create(ctx, "/g", CreateRequest{Fork: &ForkFrom{Source: "/f", Seq: 3}}); err != nil {
		t.Fatal(err)
	}
	if got := bodiesFrom(t, e, "/g", 2); fmt.Sprint(got) != "[cc]" {
		t.Errorf("fork of the fork reads %q", got)
	}
}

// TestForkRacingATrim: a trim that lands between the fork's checks and its
// raising of the source's fork count is seen after the count is up, and
// the fork is refused, its count given back.
func TestForkRacingATrim(t *testing.T) {
	ctx := context.Background()
	st := newHookedStore()
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Records: recs("aa", "bb", "cc")}); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	st.setHook(func(op, key string) error {
		if op == "PUT" && key == metaKey("/src") {
			// The fork count's update: trim past the fork point first.
			once.Do(func() {
				if _, err := e.Trim(ctx, "/src", 2); err != nil {
					t.Errorf("trim: %v", err)
				}
			})
		}
		return nil
	})
	_, _, err := e.Create(ctx, "/fork", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1}})
	st.setHook(nil)
	var te *TrimmedError
	if !errors.As(err, &te) || te.StartSeq != 2 {
		t.Fatalf("fork raced by a trim: %v, want a TrimmedError", err)
	}
	src, err := e.stream(ctx, "/src")
	if err != nil {
		t.Fatal(err)
	}
	src.mu.Lock()
	forks := src.meta.Forks
	src.mu.Unlock()
	if forks != 0 {
		t.Errorf("source's fork count after the refused fork: %d", forks)
	}
	if _, err := e.Head(ctx, "/fork"); !errors.Is(err, ErrNotFound) {
		t.Errorf("HEAD of the refused fork: %v", err)
	}
}

// TestWaitEndsWhenTheStreamIsSoftDeleted: a reader waiting at the tail of
// a stream that is then soft-deleted (its forks still read it) gets
// ErrGone, as every later request does, rather than waiting on for
// records that can no longer come.
func TestWaitEndsWhenTheStreamIsSoftDeleted(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{})
	info, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Append(ctx, "/src", AppendRequest{Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Create(ctx, "/fork", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1}}); err != nil {
		t.Fatal(err)
	}
	s, err := e.live(ctx, "/src")
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	got := make(chan error, 1)
	go func() {
		_, err := e.Wait(wctx, "/src", info.ID, 1)
		got <- err
	}()
	for s.waiters.Load() == 0 {
		runtime.Gosched()
	}
	if err := e.Delete(ctx, "/src"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Head(ctx, "/src"); !errors.Is(err, ErrGone) {
		t.Fatalf("Head after the delete: %v, want ErrGone (soft-deleted)", err)
	}
	if err := <-got; !errors.Is(err, ErrGone) {
		t.Errorf("Wait on the soft-deleted stream: %v, want ErrGone", err)
	}
}

// TestLastForkReleaseDropsKeptTrims: a trim folded while forks read the
// source keeps its records in the bucket; once the last fork is deleted
// they leave at the next compaction, though the source is never written
// again. While a fork remains they stay.
func TestLastForkReleaseDropsKeptTrims(t *testing.T) {
	tests := []struct {
		name  string
		forks []string // created before the trim
		gone  []string // deleted after the trim's fold
		kept  bool     // trimmed records stay in the bucket
	}{
		{name: "last fork deleted", forks: []string{"/f"}, gone: []string{"/f"}},
		{name: "one of two forks deleted", forks: []string{"/f", "/g"}, gone: []string{"/f"}, kept: true},
		{name: "both forks deleted", forks: []string{"/f", "/g"}, gone: []string{"/g", "/f"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			e := startEngine(t, st, Config{})
			if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Records: recs("aa", "bb", "cc", "dd")}); err != nil {
				t.Fatal(err)
			}
			info, err := e.Head(ctx, "/src")
			if err != nil {
				t.Fatal(err)
			}
			for _, f := range tc.forks {
				if _, _, err := e.Create(ctx, f, CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 4}}); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := e.Trim(ctx, "/src", 3); err != nil {
				t.Fatal(err)
			}
			if err := e.Compact(ctx); err != nil {
				t.Fatal(err)
			}
			if got := st.Keys(dataPrefix(info.ID)); len(got) == 0 {
				t.Fatalf("the source's records are in no data object after the fold")
			}
			for _, f := range tc.gone {
				if err := e.Delete(ctx, f); err != nil {
					t.Fatal(err)
				}
			}
			if err := e.Compact(ctx); err != nil {
				t.Fatal(err)
			}
			// The trimmed records' bytes are in the bucket iff some data
			// object holds seqs below the trim.
			kept := false
			for _, k := range st.Keys(dataPrefix(info.ID)) {
				if first, _, _, ok := parseDataKey(k); ok && first < 3 {
					kept = true
				}
			}
			if kept != tc.kept {
				t.Errorf("trimmed records in the bucket: %t, want %t (%v)", kept, tc.kept, st.Keys(dataPrefix(info.ID)))
			}
			if got := bodiesFrom(t, e, "/src", 3); fmt.Sprint(got) != "[dd]" {
				t.Errorf("the source reads %q from its start", got)
			}
			for _, f := range tc.forks[len(tc.gone):] {
				if got := readAll(t, e, f); fmt.Sprint(got) != "[aa bb cc dd]" {
					t.Errorf("%s reads %q", f, got)
				}
			}
		})
	}
}

// TestForkCreateExistingOnlyConfirms: a create with ForkFrom.Existing
// confirms the fork under the name, even once its source is soft-deleted,
// and where there is none answers ErrNotFound and writes nothing.
func TestForkCreateExistingOnlyConfirms(t *testing.T) {
	ctx := context.Background()
	st := newHookedStore()
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Records: recs("aa", "bb")}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1, Bytes: 1}}); err != nil {
		t.Fatal(err)
	}
	if err := e.Delete(ctx, "/src"); err != nil {
		t.Fatal(err)
	}
	info, err := e.Head(ctx, "/f")
	if err != nil {
		t.Fatal(err)
	}
	if want := (ForkOrigin{Source: "/src", Seq: 1, Bytes: 1}); info.Fork != want {
		t.Errorf("Info.Fork %+v, want %+v", info.Fork, want)
	}
	_, created, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1, Bytes: 1, Existing: true}})
	if err != nil || created {
		t.Errorf("confirming /f: created %t, %v; want confirmed", created, err)
	}
	var puts atomic.Int64
	st.setHook(func(op, key string) error {
		if op == "PUT" {
			puts.Add(1)
		}
		return nil
	})
	_, _, err = e.Create(ctx, "/g", CreateRequest{Fork: &ForkFrom{Source: "/f", Seq: 1, Existing: true}})
	st.setHook(nil)
	if !errors.Is(err, ErrNotFound) {
		t.Errorf("confirming /g, which does not exist: %v, want ErrNotFound", err)
	}
	if n := puts.Load(); n != 0 {
		t.Errorf("confirming /g wrote %d objects", n)
	}
}

// TestForkCreateFailedBeforeWritingGivesTheCountBack: a fork create that
// fails before it writes anything that could make the fork exist (here
// its expiry marker, refused by the bucket) gives its source's fork count
// back: the source's delete is then a hard one. Kept, the count never came
// down, and the source stayed soft-deleted, its name taken and its data
// in the bucket, for good.
func TestForkCreateFailedBeforeWritingGivesTheCountBack(t *testing.T) {
	ctx := context.Background()
	st := newHookedStore()
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Expiry: Expiry{TTL: time.Hour}, Records: recs("aa")}); err != nil {
		t.Fatal(err)
	}
	st.setHook(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, expiryPrefix) {
			return errors.New("injected: marker PUT refused")
		}
		return nil
	})
	_, _, err := e.Create(ctx, "/fork", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1}})
	st.setHook(nil)
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("fork create with its marker refused: %v, want ErrUnavailable", err)
	}
	if _, err := e.Head(ctx, "/fork"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("HEAD of the failed fork: %v", err)
	}
	// A fresh engine reads the count from the bucket.
	e2 := startEngine(t, st, Config{})
	if err := e2.Delete(ctx, "/src"); err != nil {
		t.Fatal(err)
	}
	if _, err := e2.Head(ctx, "/src"); !errors.Is(err, ErrNotFound) {
		t.Errorf("HEAD of the source after its delete: %v, want ErrNotFound (a hard delete)", err)
	}
	if _, _, err := e2.Create(ctx, "/src", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Errorf("create of the source's name after its delete: %v", err)
	}
}

// TestFailedForkReleaseIsRetried: when the bucket fails the lowering of
// the source's fork count as a fork is deleted (the fork is gone
// already), the release is tried again in the background: the count comes
// down, and the source's delete is a hard one. It stayed raised for good,
// keeping the deleted source soft-deleted forever.
func TestFailedForkReleaseIsRetried(t *testing.T) {
	ctx := context.Background()
	st := newHookedStore()
	e := startEngine(t, st, Config{})
	forkedSource(t, e, Expiry{})
	var refused atomic.Int64
	st.setHook(func(op, key string) error {
		if op == "PUT" && key == metaKey("/src") && refused.Add(1) <= 3 {
			return errors.New("injected: source metadata PUT refused")
		}
		return nil
	})
	defer st.setHook(nil)
	if err := e.Delete(ctx, "/fork"); err != nil {
		t.Fatal(err)
	}
	src, err := e.stream(ctx, "/src")
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		src.mu.Lock()
		forks := src.meta.Forks
		src.mu.Unlock()
		if forks == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the source still counts %d forks 10s after its fork was deleted", forks)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := e.Delete(ctx, "/src"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Head(ctx, "/src"); !errors.Is(err, ErrNotFound) {
		t.Errorf("HEAD of the source after its delete: %v, want ErrNotFound (a hard delete)", err)
	}
}

// forkCount is the fork count the engine holds for name.
func forkCount(t *testing.T, e *Engine, name string) int {
	t.Helper()
	s, err := e.stream(context.Background(), name)
	if err != nil {
		t.Fatalf("look up %s: %v", name, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.meta.Forks
}

// waitRemoved touches the soft-deleted stream name with HEADs until one
// answers ErrNotFound, and fails the test if none does within 10s.
func waitRemoved(t *testing.T, e *Engine, name string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := e.Head(context.Background(), name)
		if errors.Is(err, ErrNotFound) {
			return
		}
		if !errors.Is(err, ErrGone) {
			t.Fatalf("HEAD of the soft-deleted %s: %v, want ErrGone or ErrNotFound", name, err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("HEAD of %s still %v 10s after its last fork went (it counts %d forks)",
				name, err, forkCount(t, e, name))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestLostForkCreateIsSettled: a fork create whose metadata PUT fails and
// never lands keeps its source's count up (the PUT might still land).
// Once Config.GraveTime has passed, a touch of the soft-deleted source
// finds that fork missing and counts it no more, while the fork that
// exists keeps the source and its records; once that one is deleted too,
// the source is gone and its name free. The count used to stay raised for
// good: the source answered 410 and held its name forever.
func TestLostForkCreateIsSettled(t *testing.T) {
	ctx := context.Background()
	const graveTime = 300 * time.Millisecond
	st := newHookedStore()
	e := startEngine(t, st, Config{GraveTime: graveTime})
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Records: recs("aa", "bb")}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Create(ctx, "/fork", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 2}}); err != nil {
		t.Fatal(err)
	}
	st.setHook(func(op, key string) error {
		if op == "PUT" && key == metaKey("/lost") {
			return errors.New("injected: fork metadata PUT lost")
		}
		return nil
	})
	_, _, err := e.Create(ctx, "/lost", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 2}})
	st.setHook(nil)
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("fork create with its metadata PUT lost: %v, want ErrUnavailable", err)
	}
	if err := e.Delete(ctx, "/src"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Head(ctx, "/src"); !errors.Is(err, ErrGone) {
		t.Fatalf("HEAD of the source deleted while /fork reads it: %v, want ErrGone", err)
	}
	// Touched past GraveTime, the source counts /fork only.
	deadline := time.Now().Add(10 * time.Second)
	for forkCount(t, e, "/src") != 1 {
		if _, err := e.Head(ctx, "/src"); !errors.Is(err, ErrGone) {
			t.Fatalf("HEAD of the source /fork reads: %v, want ErrGone", err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("the source counts %d forks 10s after its delete, want 1 (/fork; /lost never landed)",
				forkCount(t, e, "/src"))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got := readAll(t, e, "/fork"); strings.Join(got, ",") != "aa,bb" {
		t.Fatalf("/fork reads %q, want its source's aa,bb", got)
	}
	if err := e.Delete(ctx, "/fork"); err != nil {
		t.Fatal(err)
	}
	waitRemoved(t, e, "/src")
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Errorf("create of the source's name once no fork reads it: %v", err)
	}
}

// TestForkReleaseLostToACrashIsSettled: the process ends while it retries
// the release of a deleted fork (the bucket refusing the source's
// metadata PUT meanwhile), so the fork is gone and its source still
// counts it. The next process, on a touch of the soft-deleted source,
// finds the fork gone: the source is removed, its name free. It used to
// stay soft-deleted for good.
func TestForkReleaseLostToACrashIsSettled(t *testing.T) {
	ctx := context.Background()
	const graveTime = 300 * time.Millisecond
	st := newHookedStore()
	e := startEngine(t, st, Config{GraveTime: graveTime})
	forkedSource(t, e, Expiry{})
	if err := e.Delete(ctx, "/src"); err != nil {
		t.Fatal(err)
	}
	var refused atomic.Int64
	st.setHook(func(op, key string) error {
		if op == "PUT" && key == metaKey("/src") {
			refused.Add(1)
			return errors.New("injected: source metadata PUT refused")
		}
		return nil
	})
	if err := e.Delete(ctx, "/fork"); err != nil {
		t.Fatal(err)
	}
	if refused.Load() == 0 {
		t.Fatal("the fork's delete did not try to release its source")
	}
	// The process ends with the release still pending.
	if err := e.Close(ctx); err != nil {
		t.Logf("close: %v", err)
	}
	st.setHook(nil)
	e2 := startEngine(t, st, Config{GraveTime: graveTime})
	if n := forkCount(t, e2, "/src"); n != 1 {
		t.Fatalf("the source counts %d forks after the restart, want 1 (the release was lost)", n)
	}
	waitRemoved(t, e2, "/src")
	if _, _, err := e2.Create(ctx, "/src", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Errorf("create of the source's name once no fork reads it: %v", err)
	}
}

// TestReleaseFork: a release drops a listed fork from the list and the
// count; a listed fork no longer in the list (released already, or found
// gone) changes nothing, so a release repeated never takes the count of
// another fork; an unlisted fork (made before forks were listed) takes
// one of the count's unlisted forks, and none when there are none.
func TestReleaseFork(t *testing.T) {
	a := forkEntry{Name: "/a", ID: "ida", At: 1}
	b := forkEntry{Name: "/b", ID: "idb", At: 2}
	for _, tc := range []struct {
		name      string
		forks     int
		list      []forkEntry
		id        string
		listed    bool
		wantForks int
		wantList  []forkEntry
	}{
		{"listed", 2, []forkEntry{a, b}, "ida", true, 1, []forkEntry{b}},
		{"listed, released already", 2, []forkEntry{b}, "ida", true, 2, []forkEntry{b}},
		{"listed, beside unlisted ones", 3, []forkEntry{b}, "ida", true, 3, []forkEntry{b}},
		{"unlisted", 3, []forkEntry{b}, "old", false, 2, []forkEntry{b}},
		{"unlisted, none left", 1, []forkEntry{b}, "old", false, 1, []forkEntry{b}},
		{"unlisted, no list", 1, nil, "old", false, 0, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cur := &metaObject{Forks: tc.forks, ForkList: tc.list}
			before := slices.Clone(tc.list)
			m := *cur
			m.releaseFork(tc.id, tc.listed)
			if m.Forks != tc.wantForks || !slices.Equal(m.ForkList, tc.wantList) {
				t.Errorf("after release: forks %d, list %v; want %d, %v", m.Forks, m.ForkList, tc.wantForks, tc.wantList)
			}
			if !slices.Equal(cur.ForkList, before) {
				t.Errorf("the metadata released from changed: list %v, was %v", cur.ForkList, before)
			}
		})
	}
}

// TestForkCountSettledBySweep: a soft-deleted source whose fork's release
// was lost with the process, and which nobody touches, is settled when
// the expiry sweep comes to its marker: it finds the fork gone and
// removes the source. The sweep used to drop the marker and leave the
// source soft-deleted for good.
func TestForkCountSettledBySweep(t *testing.T) {
	ctx := context.Background()
	const graveTime = 300 * time.Millisecond
	st := newHookedStore()
	e := startEngine(t, st, Config{GraveTime: graveTime, ExpirySweep: time.Hour})
	forkedSource(t, e, Expiry{TTL: 2 * time.Second})
	// Soft-deleted either way: by this delete, or expired already.
	if err := e.Delete(ctx, "/src"); err != nil && !errors.Is(err, ErrGone) {
		t.Fatal(err)
	}
	loseForkRelease(t, st, e, func(key string) bool { return key == metaKey("/src") })
	startEngine(t, st, Config{GraveTime: graveTime, ExpirySweep: 100 * time.Millisecond})
	var data []byte
	if err := waitUntil(15*time.Second, func() bool {
		var settled bool
		data, settled = settledInBucket(t, st, "/src")
		return settled
	}); err != nil {
		t.Fatalf("the source's metadata 15s after its last fork went, with nobody touching it: %s, want a grave", data)
	}
}

// TestForksPastTheListAreCounted: a source lists at most maxListedForks
// forks, so that its metadata object stays small; a fork made past that
// is counted only, and its release lowers the count without touching the
// list, as does a listed fork's release with its entry.
func TestForksPastTheListAreCounted(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{})
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Records: recs("aa")}); err != nil {
		t.Fatal(err)
	}
	for i := range maxListedForks + 1 {
		if _, _, err := e.Create(ctx, fmt.Sprintf("/fork/%d", i), CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1}}); err != nil {
			t.Fatal(err)
		}
	}
	counts := func() (forks, listed int) {
		t.Helper()
		s, err := e.stream(ctx, "/src")
		if err != nil {
			t.Fatal(err)
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.meta.Forks, len(s.meta.ForkList)
	}
	if forks, listed := counts(); forks != maxListedForks+1 || listed != maxListedForks {
		t.Fatalf("after %d forks: count %d, listed %d; want %d, %d", maxListedForks+1, forks, listed, maxListedForks+1, maxListedForks)
	}
	past, err := e.stream(ctx, fmt.Sprintf("/fork/%d", maxListedForks))
	if err != nil {
		t.Fatal(err)
	}
	past.mu.Lock()
	pastListed := past.meta.Fork.Listed
	past.mu.Unlock()
	if pastListed {
		t.Fatal("the fork past the list says its source lists it")
	}
	for _, tc := range []struct {
		fork                  int
		wantForks, wantListed int
	}{
		{maxListedForks, maxListedForks, maxListedForks},
		{0, maxListedForks - 1, maxListedForks - 1},
	} {
		if err := e.Delete(ctx, fmt.Sprintf("/fork/%d", tc.fork)); err != nil {
			t.Fatal(err)
		}
		if forks, listed := counts(); forks != tc.wantForks || listed != tc.wantListed {
			t.Errorf("after the delete of /fork/%d: count %d, listed %d; want %d, %d", tc.fork, forks, listed, tc.wantForks, tc.wantListed)
		}
	}
}

// TestForkCountSettledUntouched: a soft-deleted source without a TTL,
// whose fork's release was lost with the process and which nobody
// touches, is settled by the expiry sweep all the same: its soft delete
// marks it, and the sweep marks it again while the fork still exists.
// The source leaves the bucket, and so does its marker. It used to keep
// its data for good: without an expiry marker, nothing came to it.
func TestForkCountSettledUntouched(t *testing.T) {
	ctx := context.Background()
	const graveTime = 500 * time.Millisecond
	markers := func(t *testing.T, st *hookedStore) []string {
		t.Helper()
		objs, _, err := st.List(ctx, expiryPrefix, "", 1000)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, o := range objs {
			if _, name, err := parseExpiryKey(o.Key); err == nil && name == "/src" {
				out = append(out, o.Key)
			}
		}
		return out
	}
	for _, tc := range []struct {
		name string
		// afterSweep has the sweep visit the source, and find the fork
		// there, before the fork's release is lost.
		afterSweep bool
		// loseMarker refuses the marker the failed release writes too.
		loseMarker bool
	}{
		{name: "release lost"},
		{name: "release and its marker lost after a sweep found the fork", afterSweep: true, loseMarker: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := newHookedStore()
			e := startEngine(t, st, Config{GraveTime: graveTime, ExpirySweep: 100 * time.Millisecond})
			forkedSource(t, e, Expiry{})
			if err := e.Delete(ctx, "/src"); err != nil {
				t.Fatal(err)
			}
			if tc.afterSweep {
				first := markers(t, st)
				if len(first) != 1 {
					t.Fatalf("markers of the soft-deleted source: %q, want one", first)
				}
				var m []string
				if err := waitUntil(15*time.Second, func() bool {
					m = markers(t, st)
					return len(m) == 1 && m[0] != first[0]
				}); err != nil {
					t.Fatalf("the source marked again by the sweep: %v; markers %q, the first %q", err, m, first)
				}
			}
			loseForkRelease(t, st, e, func(key string) bool {
				return key == metaKey("/src") || tc.loseMarker && strings.HasPrefix(key, expiryPrefix)
			})
			startEngine(t, st, Config{GraveTime: graveTime, ExpirySweep: 100 * time.Millisecond})
			var (
				data []byte
				m    []string
			)
			if err := waitUntil(15*time.Second, func() bool {
				var settled bool
				data, settled = settledInBucket(t, st, "/src")
				m = markers(t, st)
				return settled && len(m) == 0
			}); err != nil {
				t.Fatalf("the source nobody touches after its last fork went: %v; metadata %s, markers %q; want a grave and no marker", err, data, m)
			}
		})
	}
}

// TestNextSettle: the sweep of a soft-deleted stream comes back at
// doubling intervals, on points fixed by the deletion time alone, up to
// a day apart; an unknown deletion time gives the longest step.
func TestNextSettle(t *testing.T) {
	const s, g = int64(1000), 10 * time.Second
	day := maxSettleEvery.Milliseconds()
	for _, tc := range []struct {
		name           string
		deletedAt, now int64
		graveTime      time.Duration
		want           int64
	}{
		{"before the first point", 100 * s, 105 * s, g, 110 * s},
		{"at the first point", 100 * s, 111 * s, g, 120 * s},
		{"second interval", 100 * s, 121 * s, g, 140 * s},
		{"third interval", 100 * s, 145 * s, g, 180 * s},
		{"on a point", 100 * s, 140 * s, g, 180 * s},
		{"capped", 0 + 1, 1 + 10*day, g, 1 + 10*day + (g.Milliseconds()<<13 - (10*day)%(g.Milliseconds()<<13))},
		{"unknown deletion time", 0, 10 * day, g, (10*day/(g.Milliseconds()<<13) + 1) * (g.Milliseconds() << 13)},
		{"clock behind the deletion", 100 * s, 90 * s, g, 110 * s},
		{"grave time longer than the cap", 0, 3 * day, 2 * maxSettleEvery, 2 * day * 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := nextSettle(tc.deletedAt, tc.now, tc.graveTime); got != tc.want {
				t.Errorf("nextSettle(%d, %d, %v) = %d, want %d", tc.deletedAt, tc.now, tc.graveTime, got, tc.want)
			}
		})
	}
	// Two markers of one stream swept at different times come to one.
	a := nextSettle(100*s, 111*s, g)
	b := nextSettle(100*s, 119*s, g)
	if a != b {
		t.Errorf("markers swept at 111 s and 119 s: next %d and %d, want one point", a, b)
	}
}

// TestStaleSettleMarker: a soft delete whose metadata write fails leaves
// the marker it wrote first; the sweep finds the source live and drops
// the marker, and the source and its fork read as before.
func TestStaleSettleMarker(t *testing.T) {
	ctx := context.Background()
	st := newHookedStore()
	e := startEngine(t, st, Config{GraveTime: 300 * time.Millisecond, ExpirySweep: 100 * time.Millisecond})
	forkedSource(t, e, Expiry{})
	st.setHook(func(op, key string) error {
		if op == "PUT" && key == metaKey("/src") {
			return errors.New("injected: source metadata PUT refused")
		}
		return nil
	})
	if err := e.Delete(ctx, "/src"); err == nil {
		t.Fatal("delete with the metadata PUT refused succeeded")
	}
	st.setHook(nil)
	objs, _, err := st.List(ctx, expiryPrefix, "", 1000)
	if err != nil || len(objs) != 1 {
		t.Fatalf("markers after the failed delete: %v, %v; want the settle marker", objs, err)
	}
	if err := waitUntil(15*time.Second, func() bool {
		objs, _, err = st.List(ctx, expiryPrefix, "", 1000)
		return err == nil && len(objs) == 0
	}); err != nil {
		t.Fatalf("the stale marker: %v; markers %v", err, objs)
	}
	for _, name := range []string{"/src", "/fork"} {
		got, err := e.Read(ctx, name, ReadRequest{})
		if err != nil || len(got.Records) != 1 || string(got.Records[0].Body) != "aa" {
			t.Errorf("read %s after the stale marker was swept: %+v, %v; want aa", name, got, err)
		}
	}
}

// TestLostSourceRemovalIsSettled: a fork's release that brought its
// soft-deleted source's count to zero, but whose removal of the source
// failed and was lost with the process, leaves a source no fork counts;
// the sweep removes it, with nobody touching it. It used to stay
// soft-deleted for good: settling only ever looked up listed forks.
func TestLostSourceRemovalIsSettled(t *testing.T) {
	ctx := context.Background()
	const graveTime = 300 * time.Millisecond
	st := newHookedStore()
	e := startEngine(t, st, Config{GraveTime: graveTime, ExpirySweep: 100 * time.Millisecond})
	forkedSource(t, e, Expiry{})
	if err := e.Delete(ctx, "/src"); err != nil {
		t.Fatal(err)
	}
	m := storedMeta(t, st, "/src")
	loseForkRelease(t, st, e, func(key string) bool { return key == gcKey(m.ID) })
	data, _, err := st.Get(ctx, metaKey("/src"), 0, -1)
	if err != nil || isGrave(data) {
		t.Fatalf("the source when the process ended: %s, %v; want its metadata, its removal lost", data, err)
	}
	startEngine(t, st, Config{GraveTime: graveTime, ExpirySweep: 100 * time.Millisecond})
	if werr := waitUntil(15*time.Second, func() bool {
		var settled bool
		data, settled = settledInBucket(t, st, "/src")
		return settled
	}); werr != nil {
		t.Fatalf("the source no fork counts, nobody touching it: %v; metadata %s; want a grave", werr, data)
	}
}

// TestForkRepeatWithoutExpiryAsksForTheSources: a fork create that sets
// no expiry asks for its source's (section 4.2), after a restart too, so
// a fork made with an expiry of its own other than that is a conflict
// for it; one made before forks kept their source's expiry is not.
func TestForkRepeatWithoutExpiryAsksForTheSources(t *testing.T) {
	ctx := context.Background()
	st := newHookedStore()
	e := New(st, testConfig(Config{}), nil)
	if err := e.Start(ctx); err != nil {
		t.Fatal(err)
	}
	hour := Expiry{TTL: time.Hour}
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Expiry: hour}); err != nil {
		t.Fatal(err)
	}
	for name, x := range map[string]Expiry{"/inherited": {}, "/same": hour, "/own": {TTL: time.Minute}} {
		if _, _, err := e.Create(ctx, name, CreateRequest{Expiry: x, Fork: &ForkFrom{Source: "/src"}}); err != nil {
			t.Fatalf("fork %s: %v", name, err)
		}
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	// /old is /own as an earlier version wrote it, without the source's
	// expiry.
	m := storedMeta(t, st, "/own")
	if m.Fork.SourceExpiry == nil {
		t.Fatal("the fork's metadata does not keep its source's expiry")
	}
	m.Name, m.ID, m.Fork.SourceExpiry = "/old", newID(), nil
	if _, err := st.Put(ctx, metaKey("/old"), encodeMeta(m), segment.PutOptions{}); err != nil {
		t.Fatal(err)
	}

	e = startEngine(t, st, Config{})
	for name, want := range map[string]error{"/inherited": nil, "/same": nil, "/own": ErrConflict, "/old": nil} {
		_, created, err := e.Create(ctx, name, CreateRequest{Fork: &ForkFrom{Source: "/src"}})
		if created || !errors.Is(err, want) {
			t.Errorf("%s repeated without an expiry: created %t, %v; want %v", name, created, err, want)
		}
	}
}

// TestForkRepeatWalksTheRecordsTheForkHolds: a fork made with a byte
// sub-offset that reaches the end of its anchor's record, or past it,
// keeps the point it resolves to, so a create repeated with the same
// request resolves it again. It must read the source's records from the
// fork's start, which the fork holds in the bucket, however the source
// was trimmed since or soft-deleted: the repeat is confirmed. Refused
// below the source's retained start, it was ErrConflict.
func TestForkRepeatWalksTheRecordsTheForkHolds(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{})
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Records: recs("hello", " world", "!")}); err != nil {
		t.Fatal(err)
	}
	forks := []struct {
		name      string
		asked     ForkFrom // as the create asks: record 0, and bytes past its start
		seq, byts uint64   // the point it resolves to
	}{
		{"/end", ForkFrom{Source: "/src", Seq: 0, Bytes: 5}, 1, 0},
		{"/past", ForkFrom{Source: "/src", Seq: 0, Bytes: 8}, 1, 3},
	}
	for _, f := range forks {
		asked := f.asked
		if _, created, err := e.Create(ctx, f.name, CreateRequest{Fork: &asked}); err != nil || !created {
			t.Fatalf("fork %s: created %t, %v", f.name, created, err)
		}
		info, err := e.Head(ctx, f.name)
		if err != nil {
			t.Fatal(err)
		}
		if info.Fork.Seq != f.seq || info.Fork.Bytes != f.byts {
			t.Fatalf("fork %s is at (%d, %d), want (%d, %d)", f.name, info.Fork.Seq, info.Fork.Bytes, f.seq, f.byts)
		}
	}
	for _, step := range []struct {
		name string
		do   func() error
	}{
		{"as made", func() error { return nil }},
		{"the source trimmed past the points and compacted", func() error {
			if _, err := e.Trim(ctx, "/src", 3); err != nil {
				return err
			}
			return e.Compact(ctx)
		}},
		{"the source soft-deleted", func() error { return e.Delete(ctx, "/src") }},
	} {
		if err := step.do(); err != nil {
			t.Fatalf("%s: %v", step.name, err)
		}
		for _, f := range forks {
			asked := f.asked
			if _, created, err := e.Create(ctx, f.name, CreateRequest{Fork: &asked}); err != nil || created {
				t.Errorf("%s: fork %s repeated: created %t, %v; want confirmed", step.name, f.name, created, err)
			}
		}
	}
	// Another point is still another fork's.
	other := ForkFrom{Source: "/src", Seq: 0, Bytes: 7}
	if _, _, err := e.Create(ctx, "/past", CreateRequest{Fork: &other}); !errors.Is(err, ErrConflict) {
		t.Errorf("fork /past asked at another point: %v, want ErrConflict", err)
	}
}

// TestForkRepeatWhoseSourceReadFails: a fork create repeated with its
// sub-offset spelt otherwise than the point it resolved to reads the
// source's records to judge it. When that read failed, the repeat was
// ErrConflict, telling the client its own fork conflicts with it; it is
// now ErrUnavailable, and confirmed once the read goes through; one that
// differs otherwise is ErrConflict without a read.
func TestForkRepeatWhoseSourceReadFails(t *testing.T) {
	ctx := context.Background()
	st := newHookedStore()
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Records: recs("abcd", "efgh")}); err != nil {
		t.Fatal(err)
	}
	asked := ForkFrom{Source: "/src", Seq: 0, Bytes: 6} // resolves to (1, 2)
	if _, created, err := e.Create(ctx, "/f", CreateRequest{Fork: &asked}); err != nil || !created {
		t.Fatalf("fork: created %t, %v", created, err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	// A new engine with no cache to speak of: the records come from the
	// bucket.
	again := startEngine(t, st, Config{CacheBytes: 1})
	st.setHook(func(op, key string) error {
		if op == "GET" && !strings.HasPrefix(key, metaPrefix) {
			return errors.New("injected: the bucket does not answer")
		}
		return nil
	})
	repeat := asked
	if _, _, err := again.Create(ctx, "/f", CreateRequest{Fork: &repeat}); !errors.Is(err, ErrUnavailable) {
		t.Errorf("repeat while the source's records cannot be read: %v, want ErrUnavailable", err)
	}
	// One that differs otherwise conflicts whatever its point: no read.
	if _, _, err := again.Create(ctx, "/f", CreateRequest{Fork: &repeat, ContentType: "application/json"}); !errors.Is(err, ErrConflict) {
		t.Errorf("repeat with another content type while the source's records cannot be read: %v, want ErrConflict", err)
	}
	st.setHook(nil)
	if _, created, err := again.Create(ctx, "/f", CreateRequest{Fork: &repeat}); err != nil || created {
		t.Errorf("repeat once the bucket answers: created %t, %v; want confirmed", created, err)
	}
}

// TestFailedForkReleaseUsesTheCurrentHandle: a fork create that fails
// before writing anything gives its source's count back, in the background
// when its caller must be answered by a time. That release ran after the
// create had let go of the source's name, through the handle it had looked
// up: the source could leave memory and be loaded again meanwhile, and the
// release's write then changed the metadata behind the new handle, so the
// new handle's every write failed ("changed by another writer"): the
// checkpoints that let the WAL be retired, and the source's delete.
func TestFailedForkReleaseUsesTheCurrentHandle(t *testing.T) {
	ctx := context.Background()
	st := newHookedStore()
	e := startEngine(t, st, Config{PackBelow: -1})
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Append(ctx, "/src", AppendRequest{Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil { // no runs left: the source may leave memory
		t.Fatal(err)
	}
	releasing, releaseGo := make(chan struct{}), make(chan struct{})
	var mu sync.Mutex
	srcPuts := 0
	st.setHook(func(op, key string) error {
		if op != "PUT" {
			return nil
		}
		if strings.HasPrefix(key, expiryPrefix) {
			return errors.New("injected: the fork's expiry marker is refused")
		}
		if key != metaKey("/src") {
			return nil
		}
		mu.Lock()
		srcPuts++
		n := srcPuts
		mu.Unlock()
		if n == 2 { // the first raised the count; this one gives it back
			close(releasing)
			<-releaseGo
		}
		return nil
	})
	_, _, err := e.Create(WithAnswerBy(ctx, time.Now().Add(time.Minute)), "/fork", CreateRequest{
		Fork: &ForkFrom{Source: "/src", Seq: 1, Tail: true}, Expiry: Expiry{TTL: time.Hour}})
	if err == nil {
		t.Fatal("a fork create whose expiry marker was refused succeeded")
	}
	select {
	case <-releasing:
	case <-time.After(5 * time.Second):
		t.Fatal("the failed fork's count was never given back")
	}
	// The source leaves memory if nothing pins it, and a lookup loads it.
	e.sweepIdle(time.Now().Add(2 * time.Hour))
	if _, err := e.Head(ctx, "/src"); err != nil {
		t.Fatal(err)
	}
	close(releaseGo)
	if err := waitUntil(5*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return srcPuts >= 2 && storedMeta(t, st.Store, "/src").Forks == 0
	}); err != nil {
		t.Fatal("the count never came back down")
	}
	st.setHook(nil)
	if _, err := e.Append(ctx, "/src", AppendRequest{Records: recs("b")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatalf("compaction after the release: %v", err)
	}
	if err := e.Delete(ctx, "/src"); err != nil {
		t.Fatalf("delete of the source after the release: %v", err)
	}
	if _, err := e.Head(ctx, "/src"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("head after the delete: %v, want ErrNotFound", err)
	}
}

// Appends are stamped max(now, previous + 1), so that timestamps never go
// back within a stream; a source that took more than an append a
// millisecond stamped its last ones ahead of the clock, and a fork's own
// records go on from the inherited ones rather than from the clock, those
// of its first append as well as those its create carried.
func TestForkTimestampsGoOnFromItsSource(t *testing.T) {
	for _, inCreate := range []bool{false, true} {
		t.Run(fmt.Sprintf("in create %v", inCreate), func(t *testing.T) {
			ctx := context.Background()
			e := startEngine(t, memstore.New(), Config{})
			if _, _, err := e.Create(ctx, "/ts/src", CreateRequest{ContentType: "text/plain"}); err != nil {
				t.Fatal(err)
			}
			const n = 500
			var wg sync.WaitGroup
			for i := range n {
				wg.Add(1)
				go func() {
					defer wg.Done()
					mustAppend(t, e, "/ts/src", AppendRequest{Records: recs(fmt.Sprint(i))})
				}()
			}
			wg.Wait()
			req := CreateRequest{Fork: &ForkFrom{Source: "/ts/src", Seq: n}}
			if inCreate {
				req.Records = recs("own")
			}
			if _, _, err := e.Create(ctx, "/ts/fork", req); err != nil {
				t.Fatal(err)
			}
			if !inCreate {
				mustAppend(t, e, "/ts/fork", AppendRequest{Records: recs("own")})
			}
			res, err := e.Read(ctx, "/ts/fork", ReadRequest{})
			if err != nil {
				t.Fatal(err)
			}
			if len(res.Records) != n+1 {
				t.Fatalf("the fork reads %d records, want %d", len(res.Records), n+1)
			}
			last, own := res.Records[n-1].Timestamp, res.Records[n].Timestamp
			if own <= last {
				t.Fatalf("the fork's own record is stamped %d, the inherited one before it %d (now %d): back in time",
					own, last, time.Now().UnixMilli())
			}
		})
	}
}

// unsettledSource leaves /src soft-deleted and read by no fork, its
// removal lost with the process that deleted its last fork (the bucket
// refused the source's gc record, which refuseGC picks), and returns a new
// engine on the bucket, which settles /src when it is touched.
func unsettledSource(t *testing.T) (st *hookedStore, e *Engine, refuseGC func(key string) bool) {
	t.Helper()
	st = newHookedStore()
	e = startEngine(t, st, Config{})
	forkedSource(t, e, Expiry{})
	if err := e.Delete(context.Background(), "/src"); err != nil {
		t.Fatal(err)
	}
	m := storedMeta(t, st, "/src")
	refuseGC = func(key string) bool { return key == gcKey(m.ID) }
	loseForkRelease(t, st, e, refuseGC)
	return st, startEngine(t, st, Config{ExpirySweep: time.Hour}), refuseGC
}

// A create of the name of a soft-deleted stream that no fork reads any
// more, whose removal fails on a storage fault, is ErrUnavailable (a 503),
// and the next create, once storage is back, goes ahead at once. It was a
// conflict saying forks still read the stream, and stayed one for the
// minute settleForks waits between looks.
func TestCreateOverAnUnsettledSourceOnAFault(t *testing.T) {
	ctx := context.Background()
	st, e, refuseGC := unsettledSource(t)
	st.setHook(func(op, key string) error {
		if op == "PUT" && refuseGC(key) {
			return fmt.Errorf("injected: PUT of %s refused", key)
		}
		return nil
	})
	_, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain"})
	if !errors.Is(err, ErrUnavailable) || errors.Is(err, ErrConflict) {
		t.Fatalf("create over the source whose removal failed: %v; want ErrUnavailable", err)
	}
	st.setHook(nil)
	if _, created, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain"}); err != nil || !created {
		t.Fatalf("create once storage is back: created %v, %v; want a new stream", created, err)
	}
}

// Reads of a soft-deleted stream whose settling fails (its removal, here)
// keep the minute between looks: a second read right after the first is a
// 410 (ErrGone) without trying the store again. Only a create of the name
// looks again at once.
func TestReadsOfAnUnsettledSourceKeepTheirPace(t *testing.T) {
	ctx := context.Background()
	st, e, refuseGC := unsettledSource(t)
	var tries atomic.Int64
	st.setHook(func(op, key string) error {
		if op == "PUT" && refuseGC(key) {
			tries.Add(1)
			return fmt.Errorf("injected: PUT of %s refused", key)
		}
		return nil
	})
	for i := range 3 {
		if _, err := e.Read(ctx, "/src", ReadRequest{}); !errors.Is(err, ErrGone) {
			t.Fatalf("read %d of the source whose removal fails: %v; want ErrGone", i, err)
		}
	}
	if n := tries.Load(); n != 1 {
		t.Errorf("three reads tried the removal %d times; want once a minute", n)
	}
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain"}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("create over it: %v; want ErrUnavailable", err)
	}
	st.setHook(nil)
	if _, created, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain"}); err != nil || !created {
		t.Fatalf("create once storage is back: created %v, %v", created, err)
	}
}
