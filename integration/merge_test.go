package integration

import (
	"bytes"
	"fmt"
	"net/http"
	"path"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestSlowStreamMergesThroughCaddy: a stream appended to once per
// compaction keeps one growing data object in the bucket, each fold paying
// one GET of the object it continues; it reads back whole from a restarted
// Caddy. With merge_below off, each fold writes an object of its own and
// reads none.
func TestSlowStreamMergesThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const rounds = 5
	cases := []struct {
		name        string
		directives  []string
		wantObjects int
		wantGETs    int // data GETs while folding
	}{
		{"default", nil, 1, rounds - 1},
		{"off", []string{"merge_below off"}, rounds, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := fhStart(t, fhOptions{Directives: append([]string{"compact_interval 1s", "pack_below off"}, tc.directives...)})
			const ct = "text/plain"
			const name = "/merge/slow"
			e.create(name, ct)
			var written [][]byte
			before := e.proxy.Counts()
			for round := range rounds {
				body := []byte(fmt.Sprintf("round %d;", round))
				e.append(name, ct, body)
				written = append(written, body)
				if err := e.waitGone("wal/"); err != nil {
					t.Fatalf("round %d not compacted: %v", round, err)
				}
			}
			gets := e.proxy.Counts().Containing("GET", "/data/") - before.Containing("GET", "/data/")
			objs := e.mustList("data/")
			merges := mMust(t, e.caddy.AdminAddr()).sum("picomq_compaction_merges_total")
			t.Logf("%d data objects after %d folds, %d data GETs while folding, %v merges counted", len(objs), rounds, gets, merges)
			if merges != float64(tc.wantGETs) {
				t.Errorf("picomq_compaction_merges_total %v, want %d", merges, tc.wantGETs)
			}
			if len(objs) != tc.wantObjects || gets != tc.wantGETs {
				var keys []string
				for _, o := range objs {
					keys = append(keys, o.Key)
				}
				t.Fatalf("%d data objects %v and %d data GETs after %d folds, want %d and %d",
					len(objs), keys, gets, rounds, tc.wantObjects, tc.wantGETs)
			}

			e.caddy.Kill()
			e.caddy.Restart()
			got, _, err := e.readBytes(name)
			if err != nil {
				t.Fatalf("read after the restart: %v", err)
			}
			if want := bytes.Join(written, nil); !bytes.Equal(got, want) {
				t.Fatalf("read back %q, want %q", got, want)
			}
		})
	}
}

// TestLeftoverInsideAMergedObjectThroughCaddy: a fold with merge_below off
// whose checkpoint the bucket refuses leaves an object of its own; after a
// reload back to merging, and a crash (the same process's next fold that
// lands would delete it, TestFailedFoldsLeaveNothingThroughCaddy), the
// next fold writes a merged object that starts before that leftover and
// ends after it. The whole stream still reads back from a restarted Caddy:
// before, a read from the start found the leftover, which does not hold
// the first record, and answered 500. A Pico trim into the merged object
// then rewrites it, though the leftover is listed first (the trim used to
// stop there), and the next fold merges the rewrite.
func TestLeftoverInsideAMergedObjectThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	directives := []string{"compact_interval 1s", "pack_below off", "s3_timeout 1s"}
	e := fhStart(t, fhOptions{Directives: directives})
	reload := func(merge string) {
		t.Helper()
		opts := caddytest.Options{
			Storage:    testenv.StoreURL(e.proxy.URL(), e.bucket, caddytest.S3Prefix),
			Directives: append(slices.Clone(directives), "merge_below "+merge),
			Env:        caddytest.S3Env(e.v),
		}
		if err := e.reload(e.caddy.Config(opts)); err != nil {
			t.Fatalf("reload to merge_below %s: %v", merge, err)
		}
	}
	const ct = "text/plain"
	const name = "/merge/leftover"
	e.create(name, ct)
	e.append(name, ct, []byte("a;"))
	if err := e.waitGone("wal/"); err != nil {
		t.Fatalf("a; not compacted: %v", err)
	}

	reload("off")
	unfault := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/streams/", Status: http.StatusInternalServerError})
	e.append(name, ct, []byte("b;"))
	// The object of b; alone written twice: the first fold failed for
	// good (its checkpoint's retries spent), and this one will too.
	const leftover = "/00000000000000000002.00000000000000000001"
	if err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
		if n := e.proxy.Counts().Containing(testenv.OpPut, leftover); n < 2 {
			return fmt.Errorf("%d PUTs of the object of b; alone", n)
		}
		return nil
	}); err != nil {
		t.Fatalf("the unmerged fold was not tried again: %v", err)
	}
	// Back to merging, the checkpoints still refused: once a fold has
	// written the merged object of a; and b;, no fold that does not merge
	// is under way, and the refusals can stop.
	reload("64KiB")
	if err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
		if n := e.proxy.Counts().Containing(testenv.OpPut, "/00000000000000000002.00000000000000000000"); n == 0 {
			return fmt.Errorf("no PUT of the merged object")
		}
		return nil
	}); err != nil {
		t.Fatalf("no fold merged after the reload: %v", err)
	}
	e.caddy.Kill()
	unfault()
	e.caddy.Restart()
	e.append(name, ct, []byte("c;"))
	if err := e.waitGone("wal/"); err != nil {
		t.Fatalf("not compacted once the checkpoints went through: %v", err)
	}
	spans := dataSpansIn(t, e)
	t.Logf("data objects %v", spans)
	if !slices.Contains(spans, "[1,2)") || !slices.Contains(spans, "[0,3)") {
		t.Fatalf("data objects %v; the test needs the leftover [1,2) inside the merged [0,3)", spans)
	}

	e.caddy.Kill()
	e.caddy.Restart()
	got, _, err := e.readBytes(name)
	if err != nil {
		t.Fatalf("read after the restart: %v", err)
	}
	if string(got) != "a;b;c;" {
		t.Fatalf("read back %q, want %q", got, "a;b;c;")
	}

	// A Pico trim to 1: the merged object straddles it, listed after the
	// leftover that starts there, and is rewritten from it.
	opts := caddytest.Options{
		Storage:    testenv.StoreURL(e.proxy.URL(), e.bucket, caddytest.S3Prefix),
		Directives: directives,
		Env:        caddytest.S3Env(e.v),
	}
	cf := e.caddy.Config(opts)
	pico := fmt.Sprintf("\thandle_path /pico/* {\n\t\tpicomq {\n\t\t\tstorage %q\n\t\t\tprotocol pico\n\t\t\t%s\n\t\t}\n\t}\n}\n",
		opts.Storage, strings.Join(directives, "\n\t\t\t"))
	if err := e.reload(strings.TrimSuffix(cf, "}\n") + pico); err != nil {
		t.Fatalf("reload with a Pico route: %v", err)
	}
	picoWant(t, "trim", picoDo(e, http.MethodPost, "/pico"+name, nil, "Pico-Trim-Seq", "1"), 200, "Pico-Start-Seq", "1")
	if err := waitDataSpans(t, e, "[1,2)", "[1,3)"); err != nil {
		t.Fatalf("the trim did not rewrite the merged object past the leftover: %v", err)
	}
	e.append(name, ct, []byte("d;"))
	if err := waitDataSpans(t, e, "[1,2)", "[1,4)"); err != nil {
		t.Fatalf("the next fold did not merge the rewritten tail: %v", err)
	}
	if got, _, err := e.readBytes(name); err != nil || string(got) != "b;c;d;" {
		t.Fatalf("read after the trim: %q (%v), want %q", got, err, "b;c;d;")
	}
}

// TestFailedFoldsLeaveNothingThroughCaddy: while the bucket refuses a
// stream's checkpoints, each fold writes a merged data object and fails;
// the fold whose checkpoint lands deletes them. Before, each stayed in the
// bucket for as long as the stream lived.
func TestFailedFoldsLeaveNothingThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s", "pack_below off", "s3_timeout 1s"}})
	const ct = "text/plain"
	const name = "/merge/failed"
	e.create(name, ct)
	e.append(name, ct, []byte("a;"))
	if err := waitDataSpans(t, e, "[0,1)"); err != nil {
		t.Fatalf("a; not folded: %v", err)
	}
	unfault := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/streams/", Status: http.StatusInternalServerError})
	want := "a;"
	for i, body := range []string{"b;", "c;"} {
		e.append(name, ct, []byte(body))
		want += body
		// The merged object of the records so far, written by a fold
		// whose checkpoint then fails.
		key := fmt.Sprintf("/%020d.%020d", i+2, 0)
		if err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
			if n := e.proxy.Counts().Containing(testenv.OpPut, key); n == 0 {
				return fmt.Errorf("no PUT of %s", key)
			}
			return nil
		}); err != nil {
			t.Fatalf("no fold of %s: %v", body, err)
		}
	}
	if spans := dataSpansIn(t, e); !slices.Contains(spans, "[0,2)") || !slices.Contains(spans, "[0,3)") {
		t.Fatalf("data objects %v: the failed folds' [0,2) and [0,3) should be there", spans)
	}
	unfault()
	e.append(name, ct, []byte("d;"))
	want += "d;"
	if err := waitDataSpans(t, e, "[0,4)"); err != nil {
		t.Fatalf("the failed folds' objects stayed: %v", err)
	}
	e.caddy.Kill()
	e.caddy.Restart()
	if got, _, err := e.readBytes(name); err != nil || string(got) != want {
		t.Fatalf("read back %q (%v), want %q", got, err, want)
	}
}

// dataSpansIn returns the record spans [first,end) of the data objects in
// e's bucket, in key order.
func dataSpansIn(t *testing.T, e *fhEnv) []string {
	t.Helper()
	var spans []string
	for _, o := range e.mustList("data/") {
		endS, firstS, ok := strings.Cut(path.Base(o.Key), ".")
		end, err1 := strconv.ParseUint(endS, 10, 64)
		first, err2 := strconv.ParseUint(firstS, 10, 64)
		if !ok || err1 != nil || err2 != nil {
			t.Fatalf("data key %s does not parse", o.Key)
		}
		spans = append(spans, fmt.Sprintf("[%d,%d)", first, end))
	}
	return spans
}

// waitDataSpans waits for the data objects in e's bucket to be want, by
// their spans in key order.
func waitDataSpans(t *testing.T, e *fhEnv, want ...string) error {
	t.Helper()
	return fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
		if spans := dataSpansIn(t, e); !slices.Equal(spans, want) {
			return fmt.Errorf("data objects %v", spans)
		}
		return nil
	})
}

// TestMergedTailLeftByACrashThroughCaddy: the bucket refuses the delete of
// a merged tail and Caddy is killed before trying it again; the restarted
// Caddy deletes it at the stream's next fold, as the checkpoint names it.
// Before, it stayed in the bucket for as long as the stream lived.
func TestMergedTailLeftByACrashThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s", "pack_below off"}})
	const ct = "text/plain"
	const name = "/merge/crash"
	e.create(name, ct)
	e.append(name, ct, []byte("a;"))
	if err := waitDataSpans(t, e, "[0,1)"); err != nil {
		t.Fatalf("a; not folded: %v", err)
	}
	faults := e.proxy.Counts().Faults
	unfault := e.proxy.AddFault(testenv.Fault{Op: testenv.OpDelete, KeyContains: "/data/", Status: http.StatusForbidden})
	e.append(name, ct, []byte("b;"))
	// The delete comes after the checkpoint: once it was refused, the
	// checkpoint names [0,2).
	if !waitFor(fhCompactWait, func() bool { return e.proxy.Counts().Faults > faults }) {
		t.Fatal("no delete of the merged tail was tried")
	}
	if err := waitDataSpans(t, e, "[0,1)", "[0,2)"); err != nil {
		t.Fatalf("b; not merged: %v", err)
	}
	e.caddy.Kill()
	unfault()
	e.caddy.Restart()
	e.append(name, ct, []byte("c;"))
	if err := waitDataSpans(t, e, "[0,3)"); err != nil {
		t.Fatalf("the old tail was not deleted at the next fold after the restart: %v", err)
	}
	if got, _, err := e.readBytes(name); err != nil || string(got) != "a;b;c;" {
		t.Fatalf("read back %q (%v), want %q", got, err, "a;b;c;")
	}
}
