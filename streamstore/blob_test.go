package streamstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// body returns n pseudo-random bytes, different for every tag.
func body(tag uint64, n int) []byte {
	r := rand.New(rand.NewPCG(tag, 7))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// readBodies reads name from seq on, following NextSeq to the tail.
func readBodies(t *testing.T, e *Engine, name string, seq uint64) [][]byte {
	t.Helper()
	var out [][]byte
	for {
		res, err := e.Read(context.Background(), name, ReadRequest{Seq: seq})
		if err != nil {
			t.Fatalf("read %s at %d: %v", name, seq, err)
		}
		for i, r := range res.Records {
			if r.Seq != seq+uint64(i) {
				t.Fatalf("record %d of a read at %d has seq %d", i, seq, r.Seq)
			}
			out = append(out, r.Body)
		}
		seq = res.NextSeq
		if res.UpToDate || len(res.Records) == 0 {
			return out
		}
	}
}

func sameBodies(t *testing.T, what string, got, want [][]byte) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d records, want %d", what, len(got), len(want))
	}
	for i := range want {
		if !bytes.Equal(got[i], want[i]) {
			t.Fatalf("%s: record %d differs (%d bytes, want %d)", what, i, len(got[i]), len(want[i]))
		}
	}
}

func sizeUnder(st *memstore.Store, prefix string) int {
	n := 0
	for _, k := range st.Keys(prefix) {
		data, _, _ := st.Get(context.Background(), k, 0, -1)
		n += len(data)
	}
	return n
}

func TestLargeAppendGoesToTheBucketOnce(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	want := [][]byte{[]byte("small")}
	if _, _, err := e.Create(ctx, "/big", CreateRequest{ContentType: "application/octet-stream", Records: []NewRecord{{Body: want[0]}}}); err != nil {
		t.Fatal(err)
	}
	for i, n := range []int{blobMinBytes, 3, blobMinBytes + 12345, blobMinBytes - 1} {
		b := body(uint64(i), n)
		want = append(want, b)
		res, err := e.Append(ctx, "/big", AppendRequest{Records: []NewRecord{{Body: b}}})
		if err != nil || res.FirstSeq != uint64(i+1) {
			t.Fatalf("append %d: %+v %v", i, res, err)
		}
	}
	blobs := 0
	for _, ent := range walEntriesOf(t, st, "/big") {
		if ent.Blob != "" {
			blobs++
		}
	}
	if blobs != 2 || len(st.Keys("blob/")) != 2 {
		t.Fatalf("%d blob entries, blobs %v; want the two appends of 256 KiB or more", blobs, st.Keys("blob/"))
	}
	// The WAL holds the small appends, not the large ones.
	if got := sizeUnder(st, "wal/"); got > 2*blobMinBytes {
		t.Fatalf("WAL objects hold %d bytes", got)
	}
	sameBodies(t, "live", readBodies(t, e, "/big", 0), want)

	// A second node replays the WAL: the blob entries' records come from
	// their blobs (no cache to help).
	e2 := startEngine(t, st, Config{CacheBytes: 1})
	sameBodies(t, "replayed", readBodies(t, e2, "/big", 0), want)

	if err := e2.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	markers := 0
	for _, k := range st.Keys("data/") {
		if _, _, blob, ok := parseDataKey(k); ok && blob != "" {
			markers++
		}
	}
	// Compaction copied only the small records.
	if markers != 2 || sizeUnder(st, "data/") > 2*blobMinBytes || len(st.Keys("wal/")) > 2 {
		t.Fatalf("after compaction: %d markers, %d data bytes, WAL %v", markers, sizeUnder(st, "data/"), st.Keys("wal/"))
	}
	e3 := startEngine(t, st, Config{CacheBytes: 1})
	sameBodies(t, "cold", readBodies(t, e3, "/big", 0), want)
	sameBodies(t, "cold from seq 3", readBodies(t, e3, "/big", 3), want[3:])

	if err := e3.Delete(ctx, "/big"); err != nil {
		t.Fatal(err)
	}
	if err := e3.collectGarbage(ctx); err != nil {
		t.Fatal(err)
	}
	if left := append(st.Keys("blob/"), st.Keys("data/")...); len(left) != 0 {
		t.Fatalf("left after delete: %v", left)
	}
}

// blobBatch creates name with the record "a" and appends one batch of four
// records big enough together for a blob (seqs 1 to 4), whose bodies it
// returns; tag picks them.
func blobBatch(t *testing.T, e *Engine, name string, tag uint64) [][]byte {
	t.Helper()
	ctx := context.Background()
	if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "application/octet-stream", Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	var want [][]byte
	var batch []NewRecord
	for i := range uint64(4) {
		b := body(tag+i, blobMinBytes/3)
		want = append(want, b)
		batch = append(batch, NewRecord{Body: b})
	}
	if _, err := e.Append(ctx, name, AppendRequest{Records: batch}); err != nil {
		t.Fatal(err)
	}
	return want
}

func TestTrimIntoABlob(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	want := blobBatch(t, e, "/t", 10)
	if n := len(st.Keys("blob/")); n != 1 {
		t.Fatalf("%d blobs", n)
	}
	if _, err := e.Append(ctx, "/t", AppendRequest{Records: recs("z")}); err != nil {
		t.Fatal(err)
	}
	want = append(want, []byte("z"))
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	// Seqs 1-4 are the blob; keep 3 on.
	if _, err := e.Trim(ctx, "/t", 3); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if blobs := st.Keys("blob/"); len(blobs) != 0 {
		t.Fatalf("the cut blob is still there: %v", blobs)
	}
	for _, k := range st.Keys("data/") {
		first, _, blob, _ := parseDataKey(k)
		if first < 3 || blob != "" {
			t.Fatalf("data key %s after a trim to 3", k)
		}
	}
	e2 := startEngine(t, st, Config{CacheBytes: 1})
	sameBodies(t, "after trim", readBodies(t, e2, "/t", 3), want[2:])
}

// A fold that applies a trim into a blob, whose checkpoint then fails,
// has rewritten the blob from the trim on and deleted it and its marker;
// the next fold writes the marker again with the stream's runs, and its
// trim found the blob gone: every compaction failed from then on, every
// stream's WAL kept. It now finds the rewrite and goes on, also when a
// later trim cuts into that rewrite.
func TestTrimIntoABlobWhoseCheckpointFailed(t *testing.T) {
	for _, tc := range []struct {
		name  string
		again uint64 // a second trim, after the failed fold, if not zero
		want  string // data objects at the end
	}{
		{"the same trim", 0, "[[3,5)]"},
		{"a later trim", 4, "[[4,5)]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			testTrimIntoABlobWhoseCheckpointFailed(t, tc.again, tc.want)
		})
	}
}

func testTrimIntoABlobWhoseCheckpointFailed(t *testing.T, again uint64, wantSpans string) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{PackBelow: -1})
	want := blobBatch(t, e, "/t", 4) // seqs 1-4, one blob
	if _, err := e.Trim(ctx, "/t", 3); err != nil {
		t.Fatal(err)
	}
	var refuse atomic.Bool
	refuse.Store(true)
	st.SetFail(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, metaPrefix) && refuse.Load() {
			return errors.New("injected: checkpoint refused")
		}
		return nil
	})
	if err := e.Compact(ctx); err == nil {
		t.Fatal("a compaction with its checkpoint refused succeeded")
	}
	refuse.Store(false)
	from := uint64(3)
	if again > 0 {
		if _, err := e.Trim(ctx, "/t", again); err != nil {
			t.Fatal(err)
		}
		from = again
	}
	for i := range 2 {
		if err := e.Compact(ctx); err != nil {
			t.Fatalf("compaction %d after the refusal: %v", i+1, err)
		}
	}
	if blobs := st.Keys("blob/"); len(blobs) != 0 {
		t.Errorf("the cut blob is still there: %v", blobs)
	}
	if got := fmt.Sprint(dataSpans(t, st)); got != wantSpans {
		t.Errorf("data objects %s, want %s", got, wantSpans)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	e2 := startEngine(t, st, Config{CacheBytes: 1})
	sameBodies(t, "after the trim", readBodies(t, e2, "/t", from), want[from-1:])
}

// A blob's marker PUT held up on its way (its client gave up and a retry
// wrote it, or a replaced process folded the stream too) can land after a
// trim cut into the blob: the trim rewrote the blob's kept records as a
// data object and deleted the marker and the blob. The late marker sorts
// before the rewritten object (same end, lower first), and reads of every
// seq it covers went to it and found its blob gone: a 5xx until a trim
// passed the blob's end. Among the objects that hold a seq, reads now take
// the one that starts last.
func TestLateMarkerAfterATrimIntoItsBlob(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	want := blobBatch(t, e, "/t", 20)
	mustCompact(t, e)
	var marker string
	for _, k := range st.Keys("data/") {
		if _, _, blob, _ := parseDataKey(k); blob != "" {
			marker = k
		}
	}
	if marker == "" {
		t.Fatalf("no blob marker among %v", st.Keys("data/"))
	}
	// Seqs 1-4 are the blob; keep 3 on.
	if _, err := e.Trim(ctx, "/t", 3); err != nil {
		t.Fatal(err)
	}
	mustCompact(t, e)
	if _, err := st.Put(ctx, marker, nil, segment.PutOptions{}); err != nil { // lands late
		t.Fatal(err)
	}
	e2 := startEngine(t, st, Config{CacheBytes: 1})
	sameBodies(t, "after the late marker", readBodies(t, e2, "/t", 3), want[2:])
	sameBodies(t, "from seq 4", readBodies(t, e2, "/t", 4), want[3:])
}

func TestFailedBlobUploadAcknowledgesNothing(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var mu sync.Mutex
	failing := true
	st.SetFail(func(op, key string) error {
		mu.Lock()
		defer mu.Unlock()
		if failing && op == "PUT" && strings.HasPrefix(key, "blob/") {
			return errors.New("injected")
		}
		return nil
	})
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/f", CreateRequest{ContentType: "application/octet-stream", Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	_, err := e.Append(ctx, "/f", AppendRequest{Records: []NewRecord{{Body: body(1, blobMinBytes)}}})
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("append with the blob PUT failing: %v", err)
	}
	if res, err := e.Append(ctx, "/f", AppendRequest{Records: recs("b")}); err != nil || res.FirstSeq != 1 {
		t.Fatalf("next append: %+v %v", res, err)
	}
	mu.Lock()
	failing = false
	mu.Unlock()
	big := body(2, blobMinBytes)
	if res, err := e.Append(ctx, "/f", AppendRequest{Records: []NewRecord{{Body: big}}}); err != nil || res.FirstSeq != 2 {
		t.Fatalf("append after the fault: %+v %v", res, err)
	}
	e2 := startEngine(t, st, Config{CacheBytes: 1})
	sameBodies(t, "after restart", readBodies(t, e2, "/f", 0), [][]byte{[]byte("a"), []byte("b"), big})
}

// Appends behind a large one wait for its blob: entries reach the WAL in
// seq order.
func TestAppendsWaitBehindABlob(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	st.SetFail(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, "blob/") {
			started <- struct{}{}
			<-release
		}
		return nil
	})
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/w", CreateRequest{ContentType: "application/octet-stream"}); err != nil {
		t.Fatal(err)
	}
	big := body(3, blobMinBytes)
	type result struct {
		res AppendResult
		err error
	}
	bigDone, smallDone := make(chan result, 1), make(chan result, 1)
	go func() {
		res, err := e.Append(ctx, "/w", AppendRequest{Records: []NewRecord{{Body: big}}})
		bigDone <- result{res, err}
	}()
	<-started
	go func() {
		res, err := e.Append(ctx, "/w", AppendRequest{Records: recs("after")})
		smallDone <- result{res, err}
	}()
	select {
	case r := <-smallDone:
		t.Fatalf("an append went ahead of a blob upload: %+v %v", r.res, r.err)
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	b, s := <-bigDone, <-smallDone
	if b.err != nil || s.err != nil || b.res.FirstSeq != 0 || s.res.FirstSeq != 1 {
		t.Fatalf("big %+v %v, small %+v %v", b.res, b.err, s.res, s.err)
	}
	sameBodies(t, "order", readBodies(t, e, "/w", 0), [][]byte{big, []byte("after")})
	if got := fmt.Sprint(len(walEntriesOf(t, st, "/w"))); got != "2" {
		t.Fatalf("%s WAL entries", got)
	}
}

func TestParseDataKey(t *testing.T) {
	blob := newBlobName(300, 0x2a)
	tests := []struct {
		key        string
		first, end uint64
		blob       string
		ok         bool
	}{
		{dataKey("id", 3, 9), 3, 9, "", true},
		{markerKey("id", 3, 9, blob), 3, 9, blob, true},
		{dataKey("id", 3, 9) + ".", 0, 0, "", false},
		{dataKey("id", 3, 9) + ".x-y", 0, 0, "", false},
		{dataKey("id", 3, 9) + "x", 0, 0, "", false},
		{"data/id/00000000000000000009.0000000000000000000x", 0, 0, "", false},
		{dataKey("id", 9, 3), 0, 0, "", false},
	}
	for _, tt := range tests {
		first, end, b, ok := parseDataKey(tt.key)
		if first != tt.first || end != tt.end || b != tt.blob || ok != tt.ok {
			t.Errorf("parseDataKey(%q) = %d, %d, %q, %v", tt.key, first, end, b, ok)
		}
	}
	if got := blobSize(blob); got != 300 {
		t.Errorf("blobSize(%q) = %d", blob, got)
	}
}

// TestLostBatchTakesItsBlobWithIt: the blob of an append whose WAL upload
// failed, and whose place a seal then took, can never be referenced; it
// must not stay in the bucket for the life of the stream.
func TestLostBatchTakesItsBlobWithIt(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var failWAL atomic.Int32 // WAL uploads still to fail
	st.SetFail(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, "wal/") && failWAL.Add(-1) >= 0 {
			return errors.New("injected")
		}
		return nil
	})
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/lost", CreateRequest{ContentType: "application/octet-stream"}); err != nil {
		t.Fatal(err)
	}
	failWAL.Store(1) // the upload fails; the seal that follows lands
	if _, err := e.Append(ctx, "/lost", AppendRequest{Records: []NewRecord{{Body: body(4, blobMinBytes)}}}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("append whose WAL upload failed: %v", err)
	}
	for deadline := time.Now().Add(5 * time.Second); len(st.Keys("blob/")) > 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the lost batch's blob is still there: %v", st.Keys("blob/"))
		}
	}
	// The writer may still be moving to its new namespace when the blob
	// goes: a client retries what is refused as unavailable meanwhile.
	big := body(5, blobMinBytes)
	res, err := e.Append(ctx, "/lost", AppendRequest{Records: []NewRecord{{Body: big}}})
	for deadline := time.Now().Add(5 * time.Second); errors.Is(err, ErrUnavailable) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
		res, err = e.Append(ctx, "/lost", AppendRequest{Records: []NewRecord{{Body: big}}})
	}
	if err != nil || res.FirstSeq != 0 {
		t.Fatalf("append after the fault: %+v %v", res, err)
	}
	if got := st.Keys("blob/"); len(got) != 1 {
		t.Errorf("blobs after a committed large append: %v, want 1", got)
	}
	e2 := startEngine(t, st, Config{CacheBytes: 1})
	sameBodies(t, "after restart", readBodies(t, e2, "/lost", 0), [][]byte{big})
}

// TestTrimRetriesAFailedBlobDelete: a trim whose DELETE of a blob fails
// must leave the blob findable, so that the next pass deletes it, instead
// of a blob nothing lists (the start-up sweep passes only the namespaces
// of earlier processes) kept for the life of its stream. A refused DELETE
// of the markers must leave nothing behind after the next pass either.
func TestTrimRetriesAFailedBlobDelete(t *testing.T) {
	blobKeys := func(key string) bool { return strings.HasPrefix(key, "blob/") }
	markerKeys := func(key string) bool {
		_, _, blob, ok := parseDataKey(key)
		return ok && blob != ""
	}
	for _, tc := range []struct {
		name    string
		records int    // records in the blob, seqs 1 on
		trimTo  uint64 // the trim: wholly past the blob, or into it
		refuse  func(key string) bool
	}{
		{"whole blob, blob DELETE refused", 1, 3, blobKeys},
		{"cut blob, blob DELETE refused", 4, 3, blobKeys},
		{"whole blob, marker DELETE refused", 1, 3, markerKeys},
		{"cut blob, marker DELETE refused", 4, 3, markerKeys},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			var failing atomic.Bool
			st.SetFail(func(op, key string) error {
				if op == "DELETE" && tc.refuse(key) && failing.Load() {
					return fmt.Errorf("injected: DELETE %s refused", key)
				}
				return nil
			})
			e := startEngine(t, st, Config{})
			if _, _, err := e.Create(ctx, "/t", CreateRequest{ContentType: "application/octet-stream", Records: recs("a")}); err != nil {
				t.Fatal(err)
			}
			want := [][]byte{[]byte("a")}
			var batch []NewRecord
			for i := range tc.records {
				b := body(uint64(20+i), blobMinBytes/tc.records+1)
				want = append(want, b)
				batch = append(batch, NewRecord{Body: b})
			}
			if _, err := e.Append(ctx, "/t", AppendRequest{Records: batch}); err != nil {
				t.Fatal(err)
			}
			for _, r := range []string{"y", "z"} {
				if _, err := e.Append(ctx, "/t", AppendRequest{Records: recs(r)}); err != nil {
					t.Fatal(err)
				}
				want = append(want, []byte(r))
			}
			if err := e.Compact(ctx); err != nil {
				t.Fatal(err)
			}
			if n := len(st.Keys("blob/")); n != 1 {
				t.Fatalf("%d blobs before the trim, want 1", n)
			}
			if _, err := e.Trim(ctx, "/t", tc.trimTo); err != nil {
				t.Fatal(err)
			}
			failing.Store(true)
			err := e.Compact(ctx)
			failing.Store(false)
			if err == nil {
				t.Fatal("compaction with a DELETE refused succeeded")
			}
			t.Logf("compaction with a DELETE refused: %v", err)
			// Records from the trim on stay readable meanwhile.
			sameBodies(t, "after the failed pass", readBodies(t, e, "/t", tc.trimTo), want[tc.trimTo:])
			for range 3 {
				if err := e.Compact(ctx); err != nil {
					t.Fatalf("compaction after the fault: %v", err)
				}
			}
			if blobs := st.Keys("blob/"); len(blobs) != 0 {
				t.Errorf("the trimmed blob is still in the bucket after later passes: %v", blobs)
			}
			for _, k := range st.Keys("data/") {
				if first, _, blob, _ := parseDataKey(k); first < tc.trimTo || blob != "" {
					t.Errorf("data key %s after a trim to %d", k, tc.trimTo)
				}
			}
			e2 := startEngine(t, st, Config{CacheBytes: 1})
			sameBodies(t, "after the trim", readBodies(t, e2, "/t", tc.trimTo), want[tc.trimTo:])
		})
	}
}

// TestFailedBlobDeleteIsRetried: the blob of a lost large append is
// deleted at once; when that delete fails too, the next compaction deletes
// it. It stayed until the next start's orphan sweep, which a process that
// runs for months may never reach.
func TestFailedBlobDeleteIsRetried(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var failWAL atomic.Int32 // WAL uploads still to fail
	var refuseDelete atomic.Bool
	var refused atomic.Int32
	st.SetFail(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, "wal/") && failWAL.Add(-1) >= 0 {
			return errors.New("injected: WAL upload")
		}
		if op == "DELETE" && strings.HasPrefix(key, "blob/") && refuseDelete.Load() {
			refused.Add(1)
			return fmt.Errorf("injected: DELETE %s refused", key)
		}
		return nil
	})
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/stray", CreateRequest{ContentType: "application/octet-stream"}); err != nil {
		t.Fatal(err)
	}
	refuseDelete.Store(true)
	failWAL.Store(1)
	if _, err := e.Append(ctx, "/stray", AppendRequest{Records: []NewRecord{{Body: body(4, blobMinBytes)}}}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("append whose WAL upload failed: %v", err)
	}
	for deadline := time.Now().Add(5 * time.Second); refused.Load() == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the lost append's blob was never deleted")
		}
	}
	if got := st.Keys("blob/"); len(got) != 1 {
		t.Fatalf("blobs after the refused delete: %v, want the lost append's", got)
	}
	refuseDelete.Store(false)
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if got := st.Keys("blob/"); len(got) != 0 {
		t.Errorf("blobs after a compaction: %v, want none", got)
	}
	if got := e.strays.take(); len(got) != 0 {
		t.Errorf("stray blobs still kept after their delete: %v", got)
	}
}

func TestStrayBlobsAreBounded(t *testing.T) {
	var b strayBlobs
	keys := make([]string, maxStrayBlobs-1)
	if n := b.add(keys); n != len(keys) {
		t.Fatalf("add(%d) kept %d", len(keys), n)
	}
	if n := b.add([]string{"a", "b", "c"}); n != 1 {
		t.Errorf("add past the bound kept %d, want 1", n)
	}
	if got := b.take(); len(got) != maxStrayBlobs || got[len(got)-1] != "a" {
		t.Errorf("take returned %d keys ending %q", len(got), got[len(got)-1])
	}
	if got := b.take(); len(got) != 0 {
		t.Errorf("second take returned %d keys", len(got))
	}
}
