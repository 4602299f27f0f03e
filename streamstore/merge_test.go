package streamstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

func setMergeBelow(e *Engine, n int64) {
	e.cfgMu.Lock()
	defer e.cfgMu.Unlock()
	e.cfg.MergeBelow = n
}

// dataSpans returns the spans [first, end) of the data objects the bucket
// holds, in key order.
func dataSpans(t *testing.T, st *memstore.Store) []string {
	t.Helper()
	var out []string
	for _, k := range st.Keys("data/") {
		first, end, _, ok := parseDataKey(k)
		if !ok {
			t.Fatalf("data key %s does not parse", k)
		}
		out = append(out, fmt.Sprintf("[%d,%d)", first, end))
	}
	return out
}

// streamSpans is the spans [first, end) of the data objects (and blob
// markers) of stream id in st, in key order, as one string.
func streamSpans(st *memstore.Store, id string) string {
	var out []string
	for _, k := range st.Keys(dataPrefix(id)) {
		if first, end, _, ok := parseDataKey(k); ok {
			out = append(out, fmt.Sprintf("[%d,%d)", first, end))
		}
	}
	return fmt.Sprint(out)
}

// foldEach appends each of bodies in turn to name and compacts after each,
// packing nothing: a stream written a little at a time with pauses.
func foldEach(t *testing.T, e *Engine, name string, bodies ...string) {
	t.Helper()
	ctx := context.Background()
	setPackBelow(e, -1)
	for _, b := range bodies {
		if _, err := e.Append(ctx, name, AppendRequest{Records: recs(b)}); err != nil {
			t.Fatal(err)
		}
		if err := e.Compact(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// startWithStream starts an engine on st with cfg and creates the stream
// /m on it.
func startWithStream(t *testing.T, st segment.Store, cfg Config) *Engine {
	t.Helper()
	e := startEngine(t, st, cfg)
	if _, _, err := e.Create(context.Background(), "/m", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	return e
}

// A stream folded a little at a time keeps one growing data object, not
// an object per fold, up to MergeBelow; every record reads back, from the
// cache-less engine of a restart too.
func TestSlowStreamFoldsGrowOneObject(t *testing.T) {
	bodies := make([]string, 8)
	for i := range bodies {
		bodies[i] = fmt.Sprintf("%02d-%s", i, strings.Repeat("x", 97)) // 100 bytes
	}
	cases := []struct {
		name       string
		mergeBelow int64
		want       []string
	}{
		{"default", 0, []string{"[0,8)"}},
		{"off", -1, []string{"[0,1)", "[1,2)", "[2,3)", "[3,4)", "[4,5)", "[5,6)", "[6,7)", "[7,8)"}},
		// An object of three records is past 300 bytes: the next fold
		// starts one of its own.
		{"small", 300, []string{"[0,3)", "[3,6)", "[6,8)"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			e := startWithStream(t, st, Config{MergeBelow: tc.mergeBelow})
			foldEach(t, e, "/m", bodies...)
			if got := dataSpans(t, st); fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("data objects %v, want %v", got, tc.want)
			}
			if err := e.Close(ctx); err != nil {
				t.Fatal(err)
			}
			e2 := startEngine(t, st, Config{CacheBytes: 1})
			if got := readAll(t, e2, "/m"); fmt.Sprint(got) != fmt.Sprint(bodies) {
				t.Fatalf("read back %q, want %q", got, bodies)
			}
		})
	}
}

// A reader that listed the stream's objects before a fold merged its tail
// finds the merged object when the one it listed is gone.
func TestReaderListedBeforeAMergeReadsOn(t *testing.T) {
	st := memstore.New()
	e := startWithStream(t, st, Config{CacheBytes: 1})
	foldEach(t, e, "/m", "a", "b")
	if got := readAll(t, e, "/m"); fmt.Sprint(got) != "[a b]" {
		t.Fatalf("read %q", got)
	}
	foldEach(t, e, "/m", "c")
	if got := dataSpans(t, st); fmt.Sprint(got) != "[[0,3)]" {
		t.Fatalf("data objects %v, want one merged object [0,3)", got)
	}
	if got := readAll(t, e, "/m"); fmt.Sprint(got) != "[a b c]" {
		t.Fatalf("read after the merge %q", got)
	}
}

// The old tail goes only once the checkpoint naming the merged object has
// landed: a checkpoint that failed leaves the bucket's checkpoint naming
// the old tail, which must still be there; the next fold merges it again.
func TestMergedTailStaysUntilTheCheckpointLands(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startWithStream(t, st, Config{})
	foldEach(t, e, "/m", "a", "b")
	var failMeta atomic.Bool
	failMeta.Store(true)
	st.SetFail(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, "streams/") && failMeta.Load() {
			return errors.New("injected: checkpoint refused")
		}
		return nil
	})
	if _, err := e.Append(ctx, "/m", AppendRequest{Records: recs("c")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err == nil {
		t.Fatal("compaction with its checkpoint refused did not fail")
	}
	if m := storedMeta(t, st, "/m"); m.Tail == nil || *m.Tail != (dataTail{0, 2}) {
		t.Fatalf("stored tail %+v, want [0,2)", m.Tail)
	}
	if got := dataSpans(t, st); fmt.Sprint(got) != "[[0,2) [0,3)]" {
		t.Fatalf("data objects %v: want the old tail kept beside the merged object", got)
	}
	failMeta.Store(false)
	foldEach(t, e, "/m", "d")
	if m := storedMeta(t, st, "/m"); m.Tail == nil || *m.Tail != (dataTail{0, 4}) {
		t.Fatalf("stored tail %+v, want [0,4)", m.Tail)
	}
	// [0,3) is what the failed fold wrote: nothing names it, and the fold
	// whose checkpoint landed deleted it (leftovers.go).
	if got := dataSpans(t, st); fmt.Sprint(got) != "[[0,4)]" {
		t.Fatalf("data objects %v, want the failed fold's [0,3) gone", got)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	e2 := startEngine(t, st, Config{CacheBytes: 1})
	if got := readAll(t, e2, "/m"); fmt.Sprint(got) != "[a b c d]" {
		t.Fatalf("read back %q", got)
	}
}

// A tail the store fails to read back fails the fold, which the next
// compaction does again: an object of the fold's own, its checkpoint then
// failing, would be overlapped by the next fold's merged object. A tail
// that is missing or damaged is not merged: the fold's records get an
// object of their own.
func TestTailReadBackFailures(t *testing.T) {
	cases := []struct {
		name      string
		breakTail func(st *memstore.Store, tail string)
		after     string // data objects once the fold of "b" is done
	}{
		{"refused", func(st *memstore.Store, tail string) {
			st.SetFail(func(op, key string) error {
				if op == "GET" && key == tail {
					return errors.New("injected: data GET refused")
				}
				return nil
			})
		}, "[[0,2)]"},
		{"refused for good", func(st *memstore.Store, tail string) {
			st.SetFail(func(op, key string) error {
				if op == "GET" && key == tail {
					return errors.New("injected: data GET refused")
				}
				return nil
			})
		}, "[[0,1) [1,2)]"},
		{"missing", func(st *memstore.Store, tail string) {
			if err := st.Delete(context.Background(), []string{tail}); err != nil {
				t.Fatal(err)
			}
		}, "[[1,2)]"},
		{"damaged", func(st *memstore.Store, tail string) {
			if _, err := st.Put(context.Background(), tail, []byte("not a data object"), segment.PutOptions{}); err != nil {
				t.Fatal(err)
			}
		}, "[[0,1) [1,2)]"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			e := startWithStream(t, st, Config{CacheBytes: 1})
			foldEach(t, e, "/m", "a")
			tc.breakTail(st, dataKey(storedMeta(t, st, "/m").ID, 0, 1))
			if _, err := e.Append(ctx, "/m", AppendRequest{Records: recs("b")}); err != nil {
				t.Fatal(err)
			}
			err := e.Compact(ctx)
			if strings.HasPrefix(tc.name, "refused") {
				// It fails the fold tailReadTries-1 times, then gives up
				// merging.
				for try := 1; try < tailReadTries; try++ {
					if err == nil {
						t.Fatalf("fold %d whose tail could not be read back succeeded", try)
					}
					if got := dataSpans(t, st); fmt.Sprint(got) != "[[0,1)]" {
						t.Fatalf("the failed fold left data objects %v", got)
					}
					if tc.name == "refused" {
						st.SetFail(nil)
					}
					err = e.Compact(ctx)
					if tc.name == "refused" {
						break
					}
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := dataSpans(t, st); fmt.Sprint(got) != tc.after {
				t.Fatalf("data objects %v, want %s", got, tc.after)
			}
		})
	}
}

// Objects a fold wrote before its checkpoint failed, without merging
// (merge_below was off, or an older build), are overlapped by the next
// fold's merged object, which starts before them and ends after them: a
// read still finds every record, the merged object where the old tail was.
// The next fold of the same process deletes them (leftovers.go), so the
// leftover here is of a process that ended before that fold.
func TestLeftoverInsideAMergedObject(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startWithStream(t, st, Config{})
	foldEach(t, e, "/m", "a")
	setMergeBelow(e, -1)
	st.SetFail(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, "streams/") {
			return errors.New("injected: checkpoint refused")
		}
		return nil
	})
	if _, err := e.Append(ctx, "/m", AppendRequest{Records: recs("b")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err == nil {
		t.Fatal("compaction with its checkpoint refused did not fail")
	}
	st.SetFail(nil)
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	e1 := startEngine(t, st, Config{})
	foldEach(t, e1, "/m", "c")
	if got := dataSpans(t, st); fmt.Sprint(got) != "[[1,2) [0,3)]" {
		t.Fatalf("data objects %v, want the leftover [1,2) and the merged [0,3)", got)
	}
	if err := e1.Close(ctx); err != nil {
		t.Fatal(err)
	}
	e2 := startEngine(t, st, Config{CacheBytes: 1})
	for seq := range uint64(3) {
		res, err := e2.Read(ctx, "/m", ReadRequest{Seq: seq})
		if err != nil {
			t.Fatalf("read from %d: %v", seq, err)
		}
		if len(res.Records) == 0 || res.Records[0].Seq != seq {
			t.Fatalf("read from %d: %+v", seq, res.Records)
		}
	}
	if got := readAll(t, e2, "/m"); fmt.Sprint(got) != "[a b c]" {
		t.Fatalf("read back %q", got)
	}

	// A trim to 1: the merged object straddles it, listed after the
	// leftover that starts there, and is rewritten from it; the rewrite
	// is the tail the next fold merges.
	if _, err := e2.Trim(ctx, "/m", 1); err != nil {
		t.Fatal(err)
	}
	setPackBelow(e2, -1)
	mustCompact(t, e2)
	if got := dataSpans(t, st); fmt.Sprint(got) != "[[1,2) [1,3)]" {
		t.Fatalf("data objects after the trim %v, want the leftover and [1,3)", got)
	}
	if m := storedMeta(t, st, "/m"); m.Tail == nil || *m.Tail != (dataTail{1, 3}) {
		t.Fatalf("stored tail %+v after the trim, want [1,3)", m.Tail)
	}
	foldEach(t, e2, "/m", "d")
	if got := dataSpans(t, st); fmt.Sprint(got) != "[[1,2) [1,4)]" {
		t.Fatalf("data objects %v, want the rewritten tail merged", got)
	}
}

// Nothing merges across a blob's marker, nor into a tail a trim reached:
// the trim's rewrite is the tail then, or nothing is.
func TestMergeStopsAtBlobsAndTrims(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startWithStream(t, st, Config{CacheBytes: 1})
	foldEach(t, e, "/m", "a", "b")
	big := strings.Repeat("B", blobMinBytes)
	foldEach(t, e, "/m", big, "c", "d")
	var spans []string
	for _, k := range st.Keys("data/") {
		first, end, blob, _ := parseDataKey(k)
		spans = append(spans, fmt.Sprintf("[%d,%d)%v", first, end, blob != ""))
	}
	if fmt.Sprint(spans) != "[[0,2)false [2,3)true [3,5)false]" {
		t.Fatalf("data objects %v", spans)
	}
	if _, err := e.Trim(ctx, "/m", 4); err != nil {
		t.Fatal(err)
	}
	foldEach(t, e, "/m", "e")
	if got := dataSpans(t, st); fmt.Sprint(got) != "[[4,5) [5,6)]" {
		t.Fatalf("data objects after the trim %v", got)
	}
	if m := storedMeta(t, st, "/m"); m.Tail == nil || *m.Tail != (dataTail{5, 6}) {
		t.Fatalf("stored tail %+v, want [5,6)", m.Tail)
	}
	res, err := e.Read(ctx, "/m", ReadRequest{Seq: 4})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range res.Records {
		got = append(got, string(r.Body))
	}
	if fmt.Sprint(got) != "[d e]" {
		t.Fatalf("read from 4: %q", got)
	}
}

// A trim into the tail rewrites it from the trim on: that object is the
// tail the next fold merges.
func TestMergeContinuesATrimmedTail(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startWithStream(t, st, Config{})
	foldEach(t, e, "/m", "a", "b")
	if _, err := e.Trim(ctx, "/m", 1); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if m := storedMeta(t, st, "/m"); m.Tail == nil || *m.Tail != (dataTail{1, 2}) {
		t.Fatalf("stored tail %+v after the trim, want [1,2)", m.Tail)
	}
	foldEach(t, e, "/m", "c")
	if got := dataSpans(t, st); fmt.Sprint(got) != "[[1,3)]" {
		t.Fatalf("data objects %v, want the trimmed tail merged", got)
	}
	res, err := e.Read(ctx, "/m", ReadRequest{Seq: 1})
	if err != nil || len(res.Records) != 2 || string(res.Records[0].Body) != "b" || string(res.Records[1].Body) != "c" {
		t.Fatalf("read from 1: %+v %v", res.Records, err)
	}
}

// A merged tail whose delete a crash kept from happening goes at the
// stream's next fold: the checkpoint names it.
func TestMergedTailLeftByACrashGoesAtTheNextFold(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startWithStream(t, st, Config{})
	foldEach(t, e, "/m", "a")
	st.SetFail(func(op, key string) error {
		if op == "DELETE" && strings.HasPrefix(key, "data/") {
			return errors.New("injected: delete refused")
		}
		return nil
	})
	if _, err := e.Append(ctx, "/m", AppendRequest{Records: recs("b")}); err != nil {
		t.Fatal(err)
	}
	_ = e.Compact(ctx) // the checkpoint lands, the delete of [0,1) fails
	if got := dataSpans(t, st); fmt.Sprint(got) != "[[0,1) [0,2)]" {
		t.Fatalf("data objects %v, want the old tail beside the merged one", got)
	}
	// The crash: the engine's list of deletes to try again is gone.
	st2 := copyStore(st)
	e2 := startEngine(t, st2, Config{})
	foldEach(t, e2, "/m", "c")
	if got := dataSpans(t, st2); fmt.Sprint(got) != "[[0,3)]" {
		t.Fatalf("data objects %v, want only the merged [0,3)", got)
	}
	if m := storedMeta(t, st2, "/m"); m.Merged != dataKey(m.ID, 0, 2) {
		t.Fatalf("stored checkpoint names %q as merged, want [0,2)'s key", m.Merged)
	}
	if got := readAll(t, e2, "/m"); fmt.Sprint(got) != "[a b c]" {
		t.Fatalf("read back %q", got)
	}
}
