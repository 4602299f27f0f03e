package streamstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

// What folds wrote before their checkpoints failed is deleted by the next
// fold whose checkpoint lands, but for the keys that fold wrote again; the
// stream reads back whole from a restarted engine.
func TestFailedFoldsLeaveNothing(t *testing.T) {
	big := strings.Repeat("B", blobMinBytes)
	cases := []struct {
		name  string
		merge bool
		// mergeAfter turns merging off for the compactions refused,
		// and on again after them.
		mergeAfter bool
		failed     []string // appended while checkpoints are refused, a compaction after each
		after      []string // appended once they are not, a compaction after each ("" for none)
		first      []string // folded one by one before the refusals start
		pending    []string // appended while refused, with no compaction between
		failTrim   uint64   // trimmed to, then a compaction more, while refused, if not zero
		trim       uint64   // trimmed to before the compaction that lands, if not zero
		want       string   // data objects at the end
		read       string   // the records read back from the start
		delErr     bool     // the store refuses the leftovers' delete
	}{
		{name: "merged, twice", merge: true, failed: []string{"b", "c"}, after: []string{"d"},
			want: "[[0,4)]", read: "[a b c d]"},
		{name: "unmerged, twice", failed: []string{"b", "c"}, after: []string{"d"},
			want: "[[0,1) [1,4)]", read: "[a b c d]"},
		// The fold that lands writes the very object the failed one
		// did: it stays.
		{name: "the same object again", merge: true, failed: []string{"b"}, after: []string{""},
			want: "[[0,2)]", read: "[a b]"},
		{name: "the same object again, unmerged", failed: []string{"b"}, after: []string{""},
			want: "[[0,1) [1,2)]", read: "[a b]"},
		// The fold that lands merges the tail into [0,3), which ends
		// where the failed fold's [1,3) does: a trim to 1 would rewrite
		// it under that key, which a late DELETE would then take, so
		// [1,3) stays; [1,2) goes.
		{name: "unmerged, then merged", merge: true, failed: []string{"b", "c"}, mergeAfter: true, after: []string{""},
			want: "[[0,3) [1,3)]", read: "[a b c]"},
		// A blob's marker is written again under the same key: it stays,
		// or the blob would be lost.
		{name: "a blob's marker", merge: true, failed: []string{big}, after: []string{""},
			want: "[[0,1) [1,2)]", read: "[a " + big + "]"},
		// A leftover the trim cut into is rewritten from the trim on,
		// and that rewrite stays: the trim's rewrites are not told apart
		// from those of the objects the fold wrote, which readers need.
		{name: "a trim between", merge: true, failed: []string{"b", "c"}, trim: 2, after: []string{"d"},
			want: "[[2,3) [2,4)]", read: "[c d]"},
		// The failed fold wrote [1,3) and, for the trim, its rewrite
		// [2,3); the fold that lands does both again.
		{name: "a trim in the failed fold", merge: true, failed: []string{"b", "c"}, failTrim: 2, after: []string{""},
			want: "[[2,3)]", read: "[c]"},
		// The failed fold rewrote the folded [0,2) from the trim on and
		// deleted it: the rewrite [1,2) is all that holds b, and the
		// fold that lands does not write it again.
		{name: "a trim into a folded object", merge: true, first: []string{"b"}, pending: []string{"c"}, failTrim: 1, after: []string{""},
			want: "[[1,2) [2,3)]", read: "[b c]"},
		{name: "delete refused", merge: true, failed: []string{"b"}, after: []string{"c"}, delErr: true,
			want: "[[0,2) [0,3)]", read: "[a b c]"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			e := startWithStream(t, st, Config{})
			if !tc.merge {
				setMergeBelow(e, -1)
			}
			foldEach(t, e, "/m", append([]string{"a"}, tc.first...)...)
			if tc.mergeAfter {
				setMergeBelow(e, -1)
			}
			var refuse atomic.Bool
			refuse.Store(true)
			st.SetFail(func(op, key string) error {
				switch {
				case op == "PUT" && strings.HasPrefix(key, "streams/") && refuse.Load():
					return errors.New("injected: checkpoint refused")
				case op == "DELETE" && strings.HasSuffix(key, fmt.Sprintf("/%020d.%020d", 2, 0)) && tc.delErr:
					return errors.New("injected: delete refused")
				}
				return nil
			})
			for _, b := range tc.failed {
				if _, err := e.Append(ctx, "/m", AppendRequest{Records: recs(b)}); err != nil {
					t.Fatal(err)
				}
				if err := e.Compact(ctx); err == nil {
					t.Fatal("a compaction with its checkpoint refused succeeded")
				}
			}
			if len(tc.pending) > 0 {
				if _, err := e.Append(ctx, "/m", AppendRequest{Records: recs(tc.pending...)}); err != nil {
					t.Fatal(err)
				}
			}
			if tc.failTrim > 0 {
				if _, err := e.Trim(ctx, "/m", tc.failTrim); err != nil {
					t.Fatal(err)
				}
				if err := e.Compact(ctx); err == nil {
					t.Fatal("a compaction with its checkpoint refused succeeded")
				}
			}
			refuse.Store(false)
			if tc.mergeAfter {
				setMergeBelow(e, DefaultMergeBelow)
			}
			if tc.trim > 0 {
				if _, err := e.Trim(ctx, "/m", tc.trim); err != nil {
					t.Fatal(err)
				}
			}
			for _, b := range tc.after {
				if b != "" {
					if _, err := e.Append(ctx, "/m", AppendRequest{Records: recs(b)}); err != nil {
						t.Fatal(err)
					}
				}
				mustCompact(t, e)
			}
			if got := fmt.Sprint(dataSpans(t, st)); got != tc.want {
				t.Fatalf("data objects %s, want %s", got, tc.want)
			}
			if err := e.Close(ctx); err != nil {
				t.Fatal(err)
			}
			e2 := startEngine(t, st, Config{CacheBytes: 1})
			var got []string
			for seq := max(tc.trim, tc.failTrim); ; {
				res, err := e2.Read(ctx, "/m", ReadRequest{Seq: seq})
				if err != nil {
					t.Fatalf("read from %d: %v", seq, err)
				}
				if len(res.Records) == 0 {
					break
				}
				for _, r := range res.Records {
					if r.Seq != seq {
						t.Fatalf("record %d where %d was due", r.Seq, seq)
					}
					got, seq = append(got, string(r.Body)), seq+1
				}
			}
			if fmt.Sprint(got) != tc.read {
				t.Fatalf("read back %.40q, want %.40q", got, tc.read)
			}
		})
	}
}
