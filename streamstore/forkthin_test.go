package streamstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// TestTrimDropsWhatNoForkReads: a trim of a stream that forks read deletes
// the trimmed data objects no fork reads, and keeps those one does until
// that fork is deleted. Before, one fork kept every record trimmed after
// it was made, for as long as it lived: a stream trimmed for retention
// grew without bound while any fork of it existed. An entry that does not
// say what its fork reads (written by an older build) keeps them all.
func TestTrimDropsWhatNoForkReads(t *testing.T) {
	tests := []struct {
		name   string
		legacy bool // /f's entry in the source's fork list says nothing of what it reads
		// the source's data objects, as [first,end), after each step
		trimmed, second, firstGone, bothGone string
	}{
		{
			name:      "forks say what they read",
			trimmed:   "[[0,4) [8,10)]",
			second:    "[[0,4) [8,10) [12,14)]",
			firstGone: "[[8,10) [12,14)]",
			bothGone:  "[[12,14)]",
		},
		{
			name:      "a fork from an older build",
			legacy:    true,
			trimmed:   "[[0,4) [4,8) [8,10)]",
			second:    "[[0,4) [4,8) [8,10) [10,12) [12,14)]",
			firstGone: "[[8,10) [12,14)]",
			bothGone:  "[[12,14)]",
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
			objects := func(step string) string {
				t.Helper()
				if err := e.Compact(ctx); err != nil {
					t.Fatalf("%s: compact: %v", step, err)
				}
				return streamSpans(st, info.ID)
			}
			appendRecs := func(bodies ...string) {
				t.Helper()
				if _, err := e.Append(ctx, "/src", AppendRequest{Records: recs(bodies...)}); err != nil {
					t.Fatal(err)
				}
			}
			trim := func(seq uint64) {
				t.Helper()
				if _, err := e.Trim(ctx, "/src", seq); err != nil {
					t.Fatal(err)
				}
			}
			objects("create")
			// /f reads [0,4).
			if _, _, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 4}}); err != nil {
				t.Fatal(err)
			}
			if tc.legacy {
				forgetForkReads(t, e, "/src")
			}
			appendRecs("e", "f", "g", "h")
			objects("append")
			appendRecs("i", "j")
			trim(8)
			if got := objects("trim to 8"); got != tc.trimmed {
				t.Errorf("after the trim to 8, with /f reading [0,4): data objects %s, want %s", got, tc.trimmed)
			}
			// /g reads [8,10).
			if _, _, err := e.Create(ctx, "/g", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 10}}); err != nil {
				t.Fatal(err)
			}
			appendRecs("k", "l")
			objects("append")
			appendRecs("m", "n")
			trim(12)
			if got := objects("trim to 12"); got != tc.second {
				t.Errorf("after the trim to 12, with /g reading [8,10): data objects %s, want %s", got, tc.second)
			}
			if got := fmt.Sprint(readAll(t, e, "/f")); got != "[a b c d]" {
				t.Errorf("/f reads %s", got)
			}
			if got := fmt.Sprint(bodiesFrom(t, e, "/g", 8)); got != "[i j]" {
				t.Errorf("/g reads %s from its start", got)
			}
			if err := e.Delete(ctx, "/f"); err != nil {
				t.Fatal(err)
			}
			if got := objects("delete /f"); got != tc.firstGone {
				t.Errorf("after /f went: data objects %s, want %s", got, tc.firstGone)
			}
			if got := fmt.Sprint(bodiesFrom(t, e, "/g", 8)); got != "[i j]" {
				t.Errorf("/g reads %s from its start after /f went", got)
			}
			if err := e.Delete(ctx, "/g"); err != nil {
				t.Fatal(err)
			}
			if got := objects("delete /g"); got != tc.bothGone {
				t.Errorf("after /g went: data objects %s, want %s", got, tc.bothGone)
			}
			if got := fmt.Sprint(bodiesFrom(t, e, "/src", 12)); got != "[m n]" {
				t.Errorf("the source reads %s from its start", got)
			}
		})
	}
}

// TestBlobNoForkReadsGoes: a blob no fork reads goes with its marker when
// a trim passes it, or when its stream is deleted, while a fork reads the
// records before it.
func TestBlobNoForkReadsGoes(t *testing.T) {
	for _, deleted := range []bool{false, true} {
		t.Run(map[bool]string{false: "trimmed", true: "deleted"}[deleted], func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			e := startEngine(t, st, Config{PackBelow: -1, MergeBelow: -1})
			blobBatch(t, e, "/t", 20) // "a", then a blob of seqs 1 to 4
			if err := e.Compact(ctx); err != nil {
				t.Fatal(err)
			}
			if _, _, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/t", Seq: 1}}); err != nil {
				t.Fatal(err)
			}
			if deleted {
				if err := e.Delete(ctx, "/t"); err != nil {
					t.Fatal(err)
				}
			} else {
				if _, err := e.Append(ctx, "/t", AppendRequest{Records: recs("z")}); err != nil {
					t.Fatal(err)
				}
				if _, err := e.Trim(ctx, "/t", 5); err != nil {
					t.Fatal(err)
				}
				if err := e.Compact(ctx); err != nil {
					t.Fatal(err)
				}
				if got := fmt.Sprint(bodiesFrom(t, e, "/t", 5)); got != "[z]" {
					t.Errorf("/t reads %s from its start", got)
				}
			}
			// A deleted stream's is deleted in the background.
			if waitUntil(5*time.Second, func() bool { return len(st.Keys("blob/")) == 0 }) != nil {
				t.Errorf("the blob no fork reads is still there: %v", st.Keys("blob/"))
			}
			for _, k := range st.Keys("data/") {
				if _, _, blob, _ := parseDataKey(k); blob != "" {
					t.Errorf("its marker %s is still there", k)
				}
			}
			if got := fmt.Sprint(readAll(t, e, "/f")); got != "[a]" {
				t.Errorf("/f reads %s", got)
			}
		})
	}
}

func TestForkReads(t *testing.T) {
	span := func(from, to uint64) *seqSpan { return &seqSpan{From: from, To: to} }
	tests := []struct {
		name  string
		forks int
		list  []*seqSpan
		want  string // the spans, or "unknown"
	}{
		{name: "no forks", want: "[]"},
		{name: "one", forks: 1, list: []*seqSpan{span(2, 5)}, want: "[{2 5}]"},
		{name: "sorted and joined", forks: 4, list: []*seqSpan{span(8, 9), span(0, 3), span(3, 4), span(1, 2)}, want: "[{0 4} {8 9}]"},
		{name: "overlapping", forks: 2, list: []*seqSpan{span(0, 6), span(2, 4)}, want: "[{0 6}]"},
		{name: "empty spans left out", forks: 2, list: []*seqSpan{span(5, 5), span(7, 3)}, want: "[]"},
		{name: "an entry without its span", forks: 2, list: []*seqSpan{span(0, 3), nil}, want: "unknown"},
		{name: "forks counted but not listed", forks: 2, list: []*seqSpan{span(0, 3)}, want: "unknown"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := &metaObject{Forks: tc.forks}
			for i, sp := range tc.list {
				m.ForkList = append(m.ForkList, forkEntry{ID: fmt.Sprint(i), Reads: sp})
			}
			spans, known := m.forkReads()
			got := "unknown"
			if known {
				got = fmt.Sprint(spans)
			}
			if got != tc.want {
				t.Errorf("forkReads = %s, want %s", got, tc.want)
			}
		})
	}
}

func TestReadsAny(t *testing.T) {
	spans := []seqSpan{{From: 2, To: 4}, {From: 8, To: 10}}
	tests := []struct {
		first, end uint64
		want       bool
	}{
		{0, 2, false}, {0, 3, true}, {3, 3, false}, {4, 8, false}, {3, 9, true},
		{9, 12, true}, {10, 20, false}, {5, 6, false},
	}
	for _, tc := range tests {
		if got := readsAny(spans, tc.first, tc.end); got != tc.want {
			t.Errorf("readsAny(%v, %d, %d) = %t, want %t", spans, tc.first, tc.end, got, tc.want)
		}
	}
}

// TestForkRepeatAfterATrimDroppedWhatItDoesNotRead: a fork create repeated
// with a sub-offset walks the source's records from the asked seq; the
// records past the fork's point may be gone now that a trim drops what no
// fork reads. A walk that reaches past the point is another point
// (ErrConflict) without reading on; one that lands on it is confirmed.
func TestForkRepeatAfterATrimDroppedWhatItDoesNotRead(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{PackBelow: -1, MergeBelow: -1})
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Records: recs("aa")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Append(ctx, "/src", AppendRequest{Records: recs("bb", "cc", "dd")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Append(ctx, "/src", AppendRequest{Records: recs("ee")}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Trim(ctx, "/src", 4); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	info, err := e.Head(ctx, "/src")
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range st.Keys(dataPrefix(info.ID)) {
		if first, end, _, _ := parseDataKey(k); first < 4 && end > 1 {
			t.Fatalf("records [1,4), which no fork reads, are still in %s", k)
		}
	}
	tests := []struct {
		name  string
		asked ForkFrom
		want  error
	}{
		{"the fork's point", ForkFrom{Source: "/src", Seq: 0, Bytes: 2}, nil},
		{"past it", ForkFrom{Source: "/src", Seq: 0, Bytes: 5}, ErrConflict},
		{"past it, from its own seq", ForkFrom{Source: "/src", Seq: 1, Bytes: 1}, ErrConflict},
	}
	for _, tc := range tests {
		asked := tc.asked
		_, created, err := e.Create(ctx, "/f", CreateRequest{Fork: &asked})
		if created || !errors.Is(err, tc.want) || (tc.want == nil && err != nil) {
			t.Errorf("%s: repeated create: created %t, %v; want %v", tc.name, created, err, tc.want)
		}
	}
}

// TestForkWalkOvertakenByATrimIsTrimmed: a fork create whose sub-offset
// walks the source's records, overtaken by a trim whose compaction
// deletes the record it reads (no other fork reads it), is refused as
// trimmed, as a create that came after the trim is, not as a storage
// fault.
func TestForkWalkOvertakenByATrimIsTrimmed(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{PackBelow: -1, MergeBelow: -1})
	if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	for _, body := range []string{"r0", "r1", "r2"} {
		mustAppend(t, e, "/s", AppendRequest{Records: recs(body)})
		if err := e.Compact(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/s", Seq: 1}}); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}

	held := &oneHeldGet{Store: st, prefix: "data/", started: make(chan struct{}), open: make(chan struct{})}
	e = startEngine(t, held, Config{PackBelow: -1, MergeBelow: -1})
	created := make(chan error, 1)
	go func() {
		// One byte into record 1: the walk reads it.
		_, _, err := e.Create(ctx, "/g", CreateRequest{Fork: &ForkFrom{Source: "/s", Seq: 1, Bytes: 1}})
		created <- err
	}()
	<-held.started
	if _, err := e.Trim(ctx, "/s", 2); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	info, err := e.Head(ctx, "/s")
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range st.Keys(dataPrefix(info.ID)) {
		if first, _, _, _ := parseDataKey(k); first == 1 {
			t.Fatalf("record 1, which no fork reads, is still in %s after the trim", k)
		}
	}
	close(held.open)
	var trimmed *TrimmedError
	if err := <-created; !errors.As(err, &trimmed) {
		t.Errorf("the fork create the trim overtook: %v; want a TrimmedError", err)
	}
}

// TestForkReadsOutliveARestart: what a fork reads is in its source's
// metadata, so an engine started later drops around it too, and keeps
// what the fork reads.
func TestForkReadsOutliveARestart(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	cfg := Config{PackBelow: -1, MergeBelow: -1}
	e := startEngine(t, st, cfg)
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Records: recs("a", "b")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 2}}); err != nil {
		t.Fatal(err)
	}
	mustAppend(t, e, "/src", AppendRequest{Records: recs("c", "d")})
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}

	e = startEngine(t, st, cfg)
	mustAppend(t, e, "/src", AppendRequest{Records: recs("e")})
	if _, err := e.Trim(ctx, "/src", 4); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	info, err := e.Head(ctx, "/src")
	if err != nil {
		t.Fatal(err)
	}
	if got := streamSpans(st, info.ID); got != "[[0,2) [4,5)]" {
		t.Errorf("data objects after the restart's trim: %s, want [[0,2) [4,5)]", got)
	}
	if got := fmt.Sprint(readAll(t, e, "/f")); got != "[a b]" {
		t.Errorf("/f reads %s", got)
	}
}

// forgetForkReads makes the fork list of the stream called name say
// nothing of what its forks read, as an older build wrote it.
func forgetForkReads(t *testing.T, e *Engine, name string) {
	t.Helper()
	s, err := e.stream(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.updateMeta(context.Background(), s, func(m *metaObject) {
		m.ForkList = slices.Clone(m.ForkList)
		for i := range m.ForkList {
			m.ForkList[i].Reads = nil
		}
	}); err != nil {
		t.Fatal(err)
	}
}

// TestLostForkCreateOfALiveSourceIsSettled: a fork create whose metadata
// PUT fails and never lands keeps its source's count, as the PUT might
// still land; once Config.GraveTime has passed without it, the count is
// given back, with no touch of the source and the source still live, so a
// trim then deletes the records only that fork would have read. Only a
// soft-deleted source used to be settled: a live one counted the fork,
// and kept those records, for as long as it lived.
func TestLostForkCreateOfALiveSourceIsSettled(t *testing.T) {
	ctx := context.Background()
	const graveTime = 300 * time.Millisecond
	st := newHookedStore()
	e := startEngine(t, st, Config{GraveTime: graveTime, PackBelow: -1})
	createFolded(t, e, "/src", []string{"aa", "bb"})
	info, err := e.Head(ctx, "/src")
	if err != nil {
		t.Fatal(err)
	}
	st.setHook(func(op, key string) error {
		if op == "PUT" && key == metaKey("/lost") {
			return errors.New("injected: fork metadata PUT lost")
		}
		return nil
	})
	_, _, err = e.Create(ctx, "/lost", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 2}})
	st.setHook(nil)
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("fork create with its metadata PUT lost: %v, want ErrUnavailable", err)
	}
	if n := forkCount(t, e, "/src"); n != 1 {
		t.Fatalf("the source counts %d forks after the failed create, want 1 (its PUT might still land)", n)
	}
	if err := waitUntil(10*time.Second, func() bool { return forkCount(t, e, "/src") == 0 }); err != nil {
		t.Fatalf("the source still counts %d forks 10s after the failed create, want 0", forkCount(t, e, "/src"))
	}
	if _, err := e.Trim(ctx, "/src", 2); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if keys := st.Keys(dataPrefix(info.ID)); len(keys) != 0 {
		t.Errorf("after the trim the source keeps %v", keys)
	}
}

// TestLostForkWaitsAreBounded: fork creates failing by the thousand (a
// store refusing their metadata while clients retry) each wait grave_time
// to give their counts back; at most maxLostForkWaits of them at once,
// not a goroutine each without bound. They end with the engine.
func TestLostForkWaitsAreBounded(t *testing.T) {
	ctx := context.Background()
	st := newHookedStore()
	e := New(st, testConfig(Config{GraveTime: time.Hour, PackBelow: -1}), nil)
	if err := e.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx)
	sources := []string{"/src/a", "/src/b"}
	for _, src := range sources {
		if _, _, err := e.Create(ctx, src, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
	}
	st.setHook(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, metaKey("/lost/")[:len(metaKey("/lost/"))-len(metaSuffix)]) {
			return errors.New("injected: fork metadata PUT lost")
		}
		return nil
	})
	const perSource = 600 // listed: under maxListedForks each
	for i := range perSource {
		for _, src := range sources {
			_, _, err := e.Create(ctx, fmt.Sprintf("/lost%s/%d", src, i), CreateRequest{Fork: &ForkFrom{Source: src}})
			if !errors.Is(err, ErrUnavailable) {
				t.Fatalf("fork create %d of %s with its metadata PUT lost: %v, want ErrUnavailable", i, src, err)
			}
		}
	}
	if n := e.lostForks.Load(); n != maxLostForkWaits {
		t.Fatalf("%d lost forks wait after %d failed creates, want the bound %d", n, 2*perSource, maxLostForkWaits)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if n := e.lostForks.Load(); n != 0 {
		t.Fatalf("%d lost forks still wait after Close", n)
	}
}

// TestLostForkCountRaiseIsSettled: the raise of a source's fork count
// lands, but its answer is lost and the read-back fails, so the create
// fails and no fork is made. The source's handle then leaves memory, and
// its next load finds the raise in the bucket: Config.GraveTime after the
// create, the count goes back, as the fork is not there. It used to stay
// for as long as the source lived.
func TestLostForkCountRaiseIsSettled(t *testing.T) {
	ctx := context.Background()
	const graveTime = 200 * time.Millisecond
	st := &lostAnswers{Store: memstore.New()}
	e := startEngine(t, st, Config{GraveTime: graveTime, PackBelow: -1})
	createFolded(t, e, "/src", []string{"a", "b"})
	st.loseNext(func(k string, o segment.PutOptions) bool { return k == metaKey("/src") && o.IfMatch != "" })
	st.blindTo(func(k string) bool { return k == metaKey("/src") })
	_, _, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 2}})
	st.blindTo(nil)
	if err == nil {
		t.Fatal("a fork create whose raise went unconfirmed succeeded")
	}
	if m := storedMeta(t, st, "/src"); m.Forks != 1 || len(m.ForkList) != 1 {
		t.Fatalf("the bucket's source counts %d forks, lists %d: the test needs the raise landed", m.Forks, len(m.ForkList))
	}
	e.sweepIdle(time.Now().Add(time.Hour))
	if err := waitUntil(10*time.Second, func() bool { return forkCount(t, e, "/src") == 0 }); err != nil {
		t.Fatalf("the source still counts %d forks 10s after the failed create, want 0", forkCount(t, e, "/src"))
	}
	if m := storedMeta(t, st, "/src"); m.Forks != 0 || len(m.ForkList) != 0 {
		t.Fatalf("the bucket's source counts %d forks, lists %d, want none", m.Forks, len(m.ForkList))
	}
}

// TestUnconfirmedForkThatLandedKeepsItsCount: a fork create whose metadata
// PUT landed but whose answer was lost keeps its source's count past
// Config.GraveTime: the look for the fork finds it, and its source's
// records stay for it through the source's delete.
func TestUnconfirmedForkThatLandedKeepsItsCount(t *testing.T) {
	ctx := context.Background()
	const graveTime = 200 * time.Millisecond
	st := &lostAnswers{Store: memstore.New()}
	e := startEngine(t, st, Config{GraveTime: graveTime, PackBelow: -1})
	createFolded(t, e, "/src", []string{"a", "b"})
	st.loseNext(func(k string, o segment.PutOptions) bool { return k == metaKey("/f") && o.IfNoneMatch })
	st.blindTo(func(k string) bool { return k == metaKey("/f") })
	_, _, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 2}})
	st.blindTo(nil)
	if !errors.Is(err, ErrUnconfirmed) {
		t.Fatalf("fork create: %v; want it unconfirmed", err)
	}
	time.Sleep(5 * graveTime)
	if n := forkCount(t, e, "/src"); n != 1 {
		t.Fatalf("the source counts %d forks after grave_time, want 1: the fork landed", n)
	}
	if err := e.Delete(ctx, "/src"); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(readAll(t, e, "/f")); got != "[a b]" {
		t.Errorf("the fork reads %s after its source's delete", got)
	}
}

// TestForksPastTheListAreThinnedAround: a source lists at most
// maxListedForks forks; what the forks past the list read is kept as one
// span, so a trim of the source still deletes what no fork reads. It used
// to delete nothing while any fork past the list lived. Forks past the
// list counted without that span (an earlier version's) still keep every
// trimmed record; once the last of them goes, the listed ones' reads
// decide again.
func TestForksPastTheListAreThinnedAround(t *testing.T) {
	for _, tc := range []struct {
		name   string
		legacy bool // the forks past the list were counted without their span
		want   string
	}{
		{"past the list", false, "[[0,1) [1,2) [2,3)]"},
		{"an earlier version's", true, "[[0,1) [1,2) [2,3) [3,4) [4,5) [5,6)]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			e := startEngine(t, st, Config{MergeBelow: -1})
			setPackBelow(e, -1)
			createFolded(t, e, "/src", []string{"a"}, []string{"b"}, []string{"c"}, []string{"d"}, []string{"e"}, []string{"f"})
			info, err := e.Head(ctx, "/src")
			if err != nil {
				t.Fatal(err)
			}
			for i := range maxListedForks {
				if _, _, err := e.Create(ctx, fmt.Sprintf("/fork/%d", i), CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1}}); err != nil {
					t.Fatal(err)
				}
			}
			if _, _, err := e.Create(ctx, "/past", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 3}}); err != nil {
				t.Fatal(err)
			}
			if tc.legacy {
				s, err := e.stream(ctx, "/src")
				if err != nil {
					t.Fatal(err)
				}
				if err := e.updateMeta(ctx, s, func(m *metaObject) { m.Unlisted = nil }); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := e.Trim(ctx, "/src", 6); err != nil {
				t.Fatal(err)
			}
			mustCompact(t, e)
			if got := streamSpans(st, info.ID); got != tc.want {
				t.Fatalf("after the trim the source keeps %s, want %s", got, tc.want)
			}
			if got := fmt.Sprint(readAll(t, e, "/past")); got != "[a b c]" {
				t.Fatalf("the fork past the list reads %s", got)
			}
			if err := e.Delete(ctx, "/past"); err != nil {
				t.Fatal(err)
			}
			mustCompact(t, e)
			if got := streamSpans(st, info.ID); got != "[[0,1)]" {
				t.Fatalf("with the fork past the list gone the source keeps %s, want [[0,1)]", got)
			}
			if got := fmt.Sprint(readAll(t, e, "/fork/7")); got != "[a]" {
				t.Fatalf("a listed fork reads %s", got)
			}
		})
	}
}
