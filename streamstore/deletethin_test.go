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
)

// TestSoftDeleteDropsWhatNoForkReads: deleting a stream that forks read
// keeps only the data objects holding records a fork reads, and each
// release of a fork lets go of what only it read. Before, a deleted
// source kept every record, past its forks' points too, for as long as
// its last fork lived, though no client could ever read them again. An
// entry that does not say what its fork reads (an older build's) keeps
// them all while that fork lives.
func TestSoftDeleteDropsWhatNoForkReads(t *testing.T) {
	tests := []struct {
		name   string
		legacy bool // /f's entry in the source's fork list says nothing of what it reads
		// the source's data objects, as [first,end), after each step
		deleted, firstGone string
	}{
		{
			name:      "forks say what they read",
			deleted:   "[[0,4) [4,8) [8,10)]",
			firstGone: "[[8,10)]",
		},
		{
			name:      "a fork from an older build",
			legacy:    true,
			deleted:   "[[0,4) [4,8) [8,10) [10,12) [12,13)]",
			firstGone: "[[8,10)]",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			e := startEngine(t, st, Config{PackBelow: -1, MergeBelow: -1})
			if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Records: recs("a", "b", "c", "d")}); err != nil {
				t.Fatal(err)
			}
			info, err := e.Head(ctx, "/src")
			if err != nil {
				t.Fatal(err)
			}
			spans := func() string { return streamSpans(st, info.ID) }
			compact := func(step string) {
				t.Helper()
				if err := e.Compact(ctx); err != nil {
					t.Fatalf("%s: compact: %v", step, err)
				}
			}
			// expect waits for the background thinning a delete or a
			// release starts, then holds the objects to want.
			expect := func(step, want string) {
				t.Helper()
				compact(step)
				if waitUntil(5*time.Second, func() bool { return spans() == want }) != nil {
					t.Errorf("%s: data objects %s, want %s", step, spans(), want)
				}
			}
			appendRecs := func(bodies ...string) {
				t.Helper()
				if _, err := e.Append(ctx, "/src", AppendRequest{Records: recs(bodies...)}); err != nil {
					t.Fatal(err)
				}
			}
			compact("create")
			appendRecs("e", "f", "g", "h")
			compact("append")
			appendRecs("i", "j")
			compact("append")
			// /f reads [0,6): the object [4,8) stays whole for it.
			if _, _, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 6}}); err != nil {
				t.Fatal(err)
			}
			if tc.legacy {
				forgetForkReads(t, e, "/src")
			}
			if _, err := e.Trim(ctx, "/src", 8); err != nil {
				t.Fatal(err)
			}
			// /g reads [8,9).
			if _, _, err := e.Create(ctx, "/g", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 9}}); err != nil {
				t.Fatal(err)
			}
			appendRecs("k", "l")
			compact("append")
			// The last record is in the WAL still at the delete: the fold
			// that writes it drops it again.
			appendRecs("m")
			if err := e.Delete(ctx, "/src"); err != nil {
				t.Fatal(err)
			}
			expect("delete /src", tc.deleted)
			if got := fmt.Sprint(readAll(t, e, "/f")); got != "[a b c d e f]" {
				t.Errorf("/f reads %s", got)
			}
			if got := fmt.Sprint(bodiesFrom(t, e, "/g", 8)); got != "[i]" {
				t.Errorf("/g reads %s from its start", got)
			}
			if err := e.Delete(ctx, "/f"); err != nil {
				t.Fatal(err)
			}
			expect("delete /f", tc.firstGone)
			if got := fmt.Sprint(bodiesFrom(t, e, "/g", 8)); got != "[i]" {
				t.Errorf("/g reads %s from its start after /f went", got)
			}
		})
	}
}

// TestSoftDeleteThinRetriedBySweep: when the bucket refuses the deletes
// at a soft delete, the compaction that folds the stream's last records
// still succeeds, and the sweep that settles the stream's forks later
// deletes what no fork reads; nothing else would, for an idle stream whose
// forks live on.
func TestSoftDeleteThinRetriedBySweep(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var refuse atomic.Bool
	st.SetFail(func(op, key string) error {
		if refuse.Load() && op == "DELETE" && strings.HasPrefix(key, "data/") {
			return errors.New("injected: delete refused")
		}
		return nil
	})
	const grave = 200 * time.Millisecond
	e := startEngine(t, st, Config{PackBelow: -1, MergeBelow: -1, GraveTime: grave})
	createFolded(t, e, "/src", []string{"a", "b"}, []string{"c", "d"})
	info, err := e.Head(ctx, "/src")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1}}); err != nil {
		t.Fatal(err)
	}
	// In the WAL at the delete: the fold that writes it cannot delete it
	// again, and must not fail the compaction for that.
	if _, err := e.Append(ctx, "/src", AppendRequest{Records: recs("e")}); err != nil {
		t.Fatal(err)
	}
	refuse.Store(true)
	if err := e.Delete(ctx, "/src"); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Errorf("the compaction failed for a deleted stream it could not thin: %v", err)
	}
	past := func() bool { return len(st.Keys(dataPrefix(info.ID))) == 1 }
	if waitUntil(200*time.Millisecond, past) == nil {
		t.Fatal("the data past the fork's point went though the bucket refused every delete")
	}
	refuse.Store(false)
	if _, err := e.SweepExpired(ctx, time.Now().Add(2*time.Second)); err != nil {
		t.Fatal(err)
	}
	if waitUntil(5*time.Second, past) != nil {
		t.Errorf("after the settle sweep the deleted source has data objects %v; want only the one /f reads", st.Keys(dataPrefix(info.ID)))
	}
	if got := fmt.Sprint(readAll(t, e, "/f")); got != "[a]" {
		t.Errorf("/f reads %s", got)
	}
}

// TestSoftDeleteFoldsOutOfThePacks: a deleted stream whose records past
// its forks' points sit in shared packs is folded at the next compaction
// rather than left there, and the fold keeps none of them.
func TestSoftDeleteFoldsOutOfThePacks(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{MergeBelow: -1})
	setPackBelow(e, -1) // [0,2) folded into a data object of its own
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Records: recs("a", "b")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	setPackBelow(e, 1<<20)
	if _, err := e.Append(ctx, "/src", AppendRequest{Records: recs("c", "d")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if packRuns(e, "/src") == 0 {
		t.Fatal("the appended records were not packed; the test needs them in a pack")
	}
	info, err := e.Head(ctx, "/src")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1}}); err != nil {
		t.Fatal(err)
	}
	s, err := e.stream(ctx, "/src")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Delete(ctx, "/src"); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if n := packRuns(e, "/src"); n != 0 {
		t.Errorf("the deleted source still has %d runs in the packs", n)
	}
	if err := waitUntil(5*time.Second, func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.meta.Thinned == 4
	}); err != nil {
		t.Errorf("the deleted source is thinned to %d, want 4", s.meta.Thinned)
	}
	want := dataKey(info.ID, 0, 2)
	if keys := st.Keys(dataPrefix(info.ID)); fmt.Sprint(keys) != fmt.Sprint([]string{want}) {
		t.Errorf("the deleted source has data objects %v, want only %s, which /f reads", keys, want)
	}
	if got := fmt.Sprint(readAll(t, e, "/f")); got != "[a]" {
		t.Errorf("/f reads %s", got)
	}
}

// TestReadOvertakenBySoftDeleteIsGone: a read of a stream that is deleted
// while it fetches an object no fork reads, which the delete then removes,
// is answered as the stream gone, not as damage in the bucket.
func TestReadOvertakenBySoftDeleteIsGone(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{PackBelow: -1, MergeBelow: -1})
	createFolded(t, e, "/src", []string{"a", "b"}, []string{"c", "d"})
	if _, _, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1}}); err != nil {
		t.Fatal(err)
	}
	info, err := e.Head(ctx, "/src")
	if err != nil {
		t.Fatal(err)
	}
	past := dataKey(info.ID, 2, 4) // no fork reads it
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	st.SetFail(func(op, key string) error {
		if op == "GET" && key == past {
			once.Do(func() {
				close(held)
				<-release
			})
		}
		return nil
	})
	unblock := sync.OnceFunc(func() { close(release) })
	defer unblock()
	type result struct {
		res ReadResult
		err error
	}
	done := make(chan result, 1)
	go func() {
		res, err := e.Read(ctx, "/src", ReadRequest{Seq: 2, MaxRecords: 10})
		done <- result{res, err}
	}()
	<-held
	if err := e.Delete(ctx, "/src"); err != nil {
		t.Fatal(err)
	}
	if err := waitUntil(5*time.Second, func() bool { return !slices.Contains(st.Keys(dataPrefix(info.ID)), past) }); err != nil {
		t.Fatalf("the object no fork reads is still there after the delete: %v", st.Keys(dataPrefix(info.ID)))
	}
	unblock()
	r := <-done
	r.res.Release()
	if !errors.Is(r.err, ErrGone) || errors.Is(r.err, ErrDamaged) {
		t.Errorf("the read overtaken by the delete: %v, want ErrGone", r.err)
	}
	if n := e.stats.damagedObjs.Load(); n != 0 {
		t.Errorf("%d objects reported damaged", n)
	}
}

// TestSoftDeleteThinsAForkChain: deleting each stream of a chain of forks
// keeps what the forks below it read, through a fork point inside a
// record and through a deleted fork that another fork reads.
func TestSoftDeleteThinsAForkChain(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{PackBelow: -1, MergeBelow: -1})
	appendFolded := func(name string, bodies ...string) {
		t.Helper()
		if _, err := e.Append(ctx, name, AppendRequest{Records: recs(bodies...)}); err != nil {
			t.Fatal(err)
		}
		if err := e.Compact(ctx); err != nil {
			t.Fatal(err)
		}
	}
	fork := func(name string, from ForkFrom) {
		t.Helper()
		if _, _, err := e.Create(ctx, name, CreateRequest{Fork: &from}); err != nil {
			t.Fatal(err)
		}
	}
	objects := func(name string) func() string {
		info, err := e.Head(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		return func() string { return streamSpans(st, info.ID) }
	}
	expect := func(step string, got func() string, want string) {
		t.Helper()
		if err := e.Compact(ctx); err != nil {
			t.Fatal(err)
		}
		if waitUntil(5*time.Second, func() bool { return got() == want }) != nil {
			t.Errorf("%s: data objects %s, want %s", step, got(), want)
		}
	}
	if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain", Records: recs("a", "b")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	appendFolded("/s", "cc", "d")
	appendFolded("/s", "e", "f")
	source := objects("/s")
	fork("/g", ForkFrom{Source: "/s", Seq: 2, Bytes: 1}) // reads [0,3), "c" of the third
	fork("/f1", ForkFrom{Source: "/s", Seq: 2})          // reads [0,2)
	appendFolded("/f1", "x", "y")                        // its own [2,4)
	appendFolded("/f1", "z")                             // and [4,5)
	fork("/f2", ForkFrom{Source: "/f1", Seq: 3})         // reads /f1's [0,3)
	middle := objects("/f1")

	if err := e.Delete(ctx, "/s"); err != nil {
		t.Fatal(err)
	}
	expect("the source deleted", source, "[[0,2) [2,4)]")
	if err := e.Delete(ctx, "/f1"); err != nil {
		t.Fatal(err)
	}
	expect("the middle fork deleted", middle, "[[2,4)]")
	expect("the middle fork deleted", source, "[[0,2) [2,4)]")
	for _, tc := range []struct{ name, want string }{{"/g", "[a b c]"}, {"/f2", "[a b x]"}} {
		if got := fmt.Sprint(readAll(t, e, tc.name)); got != tc.want {
			t.Errorf("%s reads %s, want %s", tc.name, got, tc.want)
		}
	}
	if err := e.Delete(ctx, "/g"); err != nil {
		t.Fatal(err)
	}
	// /f1, deleted, still reads [0,2) of the source for /f2.
	expect("the fork inside a record deleted", source, "[[0,2)]")
	if got := fmt.Sprint(readAll(t, e, "/f2")); got != "[a b x]" {
		t.Errorf("/f2 reads %s after /g went", got)
	}
}

// createFolded creates the stream called name with records of the bodies
// given, each group folded into a data object of its own.
func createFolded(t *testing.T, e *Engine, name string, groups ...[]string) {
	t.Helper()
	ctx := context.Background()
	if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	for _, g := range groups {
		if _, err := e.Append(ctx, name, AppendRequest{Records: recs(g...)}); err != nil {
			t.Fatal(err)
		}
		if err := e.Compact(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// TestTrimmedForkedSourceIsPackedAgain: a source that forks read goes back
// to the packs once the fold after its trim has deleted what it could. It
// used to be folded, a data PUT and a checkpoint, at every compaction for
// as long as it had forks.
func TestTrimmedForkedSourceIsPackedAgain(t *testing.T) {
	for _, legacy := range []bool{false, true} {
		t.Run(map[bool]string{false: "forks say what they read", true: "a fork from an older build"}[legacy], func(t *testing.T) {
			ctx := context.Background()
			e := startEngine(t, memstore.New(), Config{MergeBelow: -1})
			setPackBelow(e, -1)
			createFolded(t, e, "/src", []string{"a", "b"}, []string{"c", "d"})
			setPackBelow(e, 1<<20)
			if _, _, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1}}); err != nil {
				t.Fatal(err)
			}
			if legacy {
				forgetForkReads(t, e, "/src")
			}
			if _, err := e.Trim(ctx, "/src", 3); err != nil {
				t.Fatal(err)
			}
			if err := e.Compact(ctx); err != nil {
				t.Fatal(err)
			}
			for i := range 3 {
				if _, err := e.Append(ctx, "/src", AppendRequest{Records: recs("x")}); err != nil {
					t.Fatal(err)
				}
				if err := e.Compact(ctx); err != nil {
					t.Fatal(err)
				}
				if n := packRuns(e, "/src"); n != i+1 {
					t.Fatalf("after append %d the source has %d runs in the packs, want %d: folded, not packed", i+1, n, i+1)
				}
			}
			if got := fmt.Sprint(bodiesFrom(t, e, "/src", 3)); got != "[d x x x]" {
				t.Errorf("the source reads %s from its start", got)
			}
			if got := fmt.Sprint(readAll(t, e, "/f")); got != "[a]" {
				t.Errorf("/f reads %s", got)
			}
		})
	}
}
