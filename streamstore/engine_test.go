package streamstore

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// testConfig fills in what the tests' engines share: one node id, a short
// flush interval, and compaction only when a test asks for it.
func testConfig(cfg Config) Config {
	if cfg.NodeID == "" {
		cfg.NodeID = "node-a"
	}
	if cfg.FlushInterval == 0 {
		cfg.FlushInterval = time.Millisecond
	}
	if cfg.CompactInterval == 0 {
		cfg.CompactInterval = time.Hour
	}
	return cfg
}

func startEngine(t *testing.T, st segment.Store, cfg Config) *Engine {
	t.Helper()
	e := New(st, testConfig(cfg), nil)
	if err := e.Start(context.Background()); err != nil {
		t.Fatalf("start: %v", err)
	}
	t.Cleanup(func() { _ = e.Close(context.Background()) })
	return e
}

// storedMeta reads and decodes name's metadata object straight from the
// bucket: a lookup through an engine would load or touch the stream.
func storedMeta(t *testing.T, st segment.Store, name string) *metaObject {
	t.Helper()
	data, _, err := st.Get(context.Background(), metaKey(name), 0, -1)
	if err != nil {
		t.Fatalf("read the metadata of %s: %v", name, err)
	}
	m, err := decodeMeta(data)
	if err != nil {
		t.Fatalf("decode the metadata of %s: %v", name, err)
	}
	return m
}

func recs(bodies ...string) []NewRecord {
	out := make([]NewRecord, len(bodies))
	for i, b := range bodies {
		out[i] = NewRecord{Body: []byte(b)}
	}
	return out
}

func readAll(t *testing.T, e *Engine, name string) []string {
	t.Helper()
	res, err := e.Read(context.Background(), name, ReadRequest{})
	if err != nil {
		t.Fatalf("read %s: %v", name, err)
	}
	var out []string
	for i, r := range res.Records {
		if r.Seq != uint64(i) {
			t.Fatalf("record %d has seq %d", i, r.Seq)
		}
		out = append(out, string(r.Body))
	}
	return out
}

func TestCreateAppendRead(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{})
	info, created, err := e.Create(ctx, "/a/b", CreateRequest{ContentType: "text/plain", Records: recs("x")})
	if err != nil || !created || info.NextSeq != 1 {
		t.Fatalf("create: %+v %v %v", info, created, err)
	}
	if _, created, err := e.Create(ctx, "/a/b", CreateRequest{ContentType: "text/plain"}); err != nil || created {
		t.Fatalf("idempotent create: %v %v", created, err)
	}
	if _, _, err := e.Create(ctx, "/a/b", CreateRequest{ContentType: "application/json"}); !errors.Is(err, ErrConflict) {
		t.Fatalf("conflicting create: %v", err)
	}
	res, err := e.Append(ctx, "/a/b", AppendRequest{ContentType: "text/plain", Records: recs("y", "z")})
	if err != nil || res.FirstSeq != 1 || res.NextSeq != 3 {
		t.Fatalf("append: %+v %v", res, err)
	}
	_, err = e.Append(ctx, "/a/b", AppendRequest{ContentType: "text/html", Records: recs("w")})
	var cte *ContentTypeError
	if !errors.Is(err, ErrContentType) || !errors.As(err, &cte) || cte.Sent != "text/html" || cte.Stream != "text/plain" {
		t.Fatalf("content type mismatch: %v, want a ContentTypeError naming text/html and text/plain", err)
	}
	if got := fmt.Sprint(readAll(t, e, "/a/b")); got != "[x y z]" {
		t.Fatalf("read %s", got)
	}
	if _, err := e.Append(ctx, "/missing", AppendRequest{Records: recs("w")}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("append to missing: %v", err)
	}
}

func TestReplayAfterCrashAndCompaction(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	for i := 0; i < 5; i++ {
		name := fmt.Sprintf("/s%d", i)
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
		for j := 0; j < 10; j++ {
			if _, err := e.Append(ctx, name, AppendRequest{Records: recs(fmt.Sprintf("%d-%d", i, j))}); err != nil {
				t.Fatal(err)
			}
		}
	}
	// Crash: a second engine with the same node id takes over without Close.
	e2 := startEngine(t, st, Config{})
	if got := len(readAll(t, e2, "/s3")); got != 10 {
		t.Fatalf("after replay: %d records", got)
	}
	if err := e2.Compact(ctx); err != nil {
		t.Fatalf("compact: %v", err)
	}
	if wal := st.Keys("wal/"); len(wal) != 0 {
		t.Fatalf("WAL objects left after compaction: %v", wal)
	}
	// Five small, busy streams, brought back by a replay: each is
	// checkpointed once (markReplayed), which shuts out a late checkpoint of
	// the process replaced; no packs yet.
	if data, packs := st.Keys("data/"), st.Keys("pack/"); len(data) != 5 || len(packs) != 0 {
		t.Fatalf("after the first compaction of a replay: data objects %v, packs %v; want 5 and none", data, packs)
	}
	// From then on they share packs again.
	for i := 0; i < 5; i++ {
		if _, err := e2.Append(ctx, fmt.Sprintf("/s%d", i), AppendRequest{Records: recs("more")}); err != nil {
			t.Fatal(err)
		}
	}
	if err := e2.Compact(ctx); err != nil {
		t.Fatalf("compact: %v", err)
	}
	if data, packs := st.Keys("data/"), st.Keys("pack/"); len(data) != 5 || len(packs) != 1 {
		t.Fatalf("after the next compaction: data objects %v, packs %v; want the same 5 and one pack", data, packs)
	}
	if _, err := e2.Append(ctx, "/s3", AppendRequest{Records: recs("last")}); err != nil {
		t.Fatal(err)
	}
	e3 := startEngine(t, st, Config{CacheBytes: 1})
	got := readAll(t, e3, "/s3")
	if len(got) != 12 || got[0] != "3-0" || got[10] != "more" || got[11] != "last" {
		t.Fatalf("after compaction and restart: %v", got)
	}
}

func TestProducerDedupAndFencing(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{})
	if _, _, err := e.Create(ctx, "/p", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	app := func(epoch, seq uint64, body string) (AppendResult, error) {
		return e.Append(ctx, "/p", AppendRequest{Records: recs(body), Producer: &Producer{ID: "w", Epoch: epoch, Seq: seq}})
	}
	if r, err := app(0, 0, "a"); err != nil || r.Duplicate {
		t.Fatalf("first: %+v %v", r, err)
	}
	if r, err := app(0, 0, "a"); err != nil || !r.Duplicate {
		t.Fatalf("retry: %+v %v", r, err)
	}
	var gap *SequenceGapError
	if _, err := app(0, 5, "x"); !errors.As(err, &gap) || gap.Expected != 1 {
		t.Fatalf("gap: %v", err)
	}
	// A new epoch starts at seq 0: another seq is a bad request (Durable
	// Streams' 400) that says which seq came, for Pico's sequence_gap.
	var start *EpochStartError
	if _, err := app(1, 3, "x"); !errors.As(err, &start) || start.Received != 3 || !errors.Is(err, ErrBadRequest) {
		t.Fatalf("new epoch at seq 3: %v", err)
	}
	if _, err := app(1, 0, "b"); err != nil {
		t.Fatal(err)
	}
	var fenced *FencedError
	if _, err := app(0, 1, "c"); !errors.As(err, &fenced) || fenced.CurrentEpoch != 1 {
		t.Fatalf("fenced: %v", err)
	}
	if got := fmt.Sprint(readAll(t, e, "/p")); got != "[a b]" {
		t.Fatalf("records: %s", got)
	}
}

// TestClosedStreamComesBeforeProducerChecks: on a closed stream every
// append but a retry of the closing one, or a close-only request whose
// MatchSeq (if any) is the closed tail, is a ClosedError, a stale epoch's
// too (section 5.2.1), and nothing is written.
func TestClosedStreamComesBeforeProducerChecks(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{})
	if _, _, err := e.Create(ctx, "/p", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	prod := func(epoch, seq uint64) *Producer { return &Producer{ID: "w", Epoch: epoch, Seq: seq} }
	if _, err := e.Append(ctx, "/p", AppendRequest{Records: recs("a"), Producer: prod(0, 0)}); err != nil {
		t.Fatal(err)
	}
	// A new epoch closes the stream.
	if _, err := e.Append(ctx, "/p", AppendRequest{Records: recs("b"), Producer: prod(1, 0), Close: true}); err != nil {
		t.Fatal(err)
	}
	closedTail, staleTail := uint64(2), uint64(1)
	tests := []struct {
		name      string
		req       AppendRequest
		duplicate bool // else a ClosedError
	}{
		{"stale epoch", AppendRequest{Records: recs("x"), Producer: prod(0, 1)}, false},
		{"stale epoch closing", AppendRequest{Records: recs("x"), Producer: prod(0, 1), Close: true}, false},
		{"stale epoch, content type too", AppendRequest{ContentType: "image/png", Records: recs("x"), Producer: prod(0, 1)}, false},
		{"next seq of the closing epoch", AppendRequest{Records: recs("x"), Producer: prod(1, 1)}, false},
		{"another producer", AppendRequest{Records: recs("x"), Producer: &Producer{ID: "v"}}, false},
		{"no producer", AppendRequest{Records: recs("x")}, false},
		{"retry of the closing append", AppendRequest{Records: recs("b"), Producer: prod(1, 0), Close: true}, true},
		{"close-only without a producer", AppendRequest{Close: true}, true},
		{"close-only matching the closed tail", AppendRequest{Close: true, MatchSeq: &closedTail}, true},
		{"close-only matching another tail", AppendRequest{Close: true, MatchSeq: &staleTail}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			res, err := e.Append(ctx, "/p", tc.req)
			if tc.duplicate {
				if err != nil || !res.Duplicate || !res.Closed || res.NextSeq != 2 {
					t.Fatalf("%+v %v, want a duplicate of the closed tail", res, err)
				}
				return
			}
			var closed *ClosedError
			if !errors.As(err, &closed) || closed.NextSeq != 2 {
				t.Fatalf("%+v %v, want a ClosedError at 2", res, err)
			}
		})
	}
	if got := fmt.Sprint(readAll(t, e, "/p")); got != "[a b]" {
		t.Fatalf("records: %s", got)
	}
}

func TestFailedUploadRollsBackAndRecovers(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var mu sync.Mutex
	failing := false
	st.SetFail(func(op, key string) error {
		mu.Lock()
		defer mu.Unlock()
		if failing && op == "PUT" && len(key) > 4 && key[:4] == "wal/" {
			return errors.New("injected")
		}
		return nil
	})
	e := startEngine(t, st, Config{AppendTimeout: 5 * time.Second})
	if _, _, err := e.Create(ctx, "/f", CreateRequest{ContentType: "text/plain", Records: recs("ok")}); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	failing = true
	mu.Unlock()
	// The WAL put fails, and so does the seal: the append must not be
	// acknowledged; it waits until the store answers or times out.
	done := make(chan error, 1)
	go func() {
		_, err := e.Append(ctx, "/f", AppendRequest{Records: recs("lost")})
		done <- err
	}()
	time.Sleep(100 * time.Millisecond)
	mu.Lock()
	failing = false // the seal can now land; the batch is aborted
	mu.Unlock()
	if err := <-done; !errors.Is(err, ErrUnavailable) {
		t.Fatalf("append during fault: %v", err)
	}
	var err error
	for i := 0; i < 100; i++ {
		if _, err = e.Append(ctx, "/f", AppendRequest{Records: recs("after")}); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("no recovery: %v", err)
	}
	if got := fmt.Sprint(readAll(t, e, "/f")); got != "[ok after]" {
		t.Fatalf("records: %s", got)
	}
	e2 := startEngine(t, st, Config{})
	t.Logf("keys: %v", st.Keys(""))
	if got := fmt.Sprint(readAll(t, e2, "/f")); got != "[ok after]" {
		t.Fatalf("after restart: %s", got)
	}
}

func TestDeleteAndRecreate(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/d", CreateRequest{ContentType: "text/plain", Records: recs("old")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.Delete(ctx, "/d"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Head(ctx, "/d"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("head after delete: %v", err)
	}
	if _, _, err := e.Create(ctx, "/d", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, e, "/d"); len(got) != 0 {
		t.Fatalf("old data shows through: %v", got)
	}
	deadline := time.Now().Add(2 * time.Second)
	for len(st.Keys("data/")) > 0 || len(st.Keys("gc/")) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("deleted data still in the bucket: %v %v", st.Keys("data/"), st.Keys("gc/"))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestWaitWakesOnDurableAppend(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{})
	info, _, err := e.Create(ctx, "/w", CreateRequest{ContentType: "text/plain"})
	if err != nil {
		t.Fatal(err)
	}
	s, err := e.live(ctx, "/w")
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan Info, 1)
	go func() {
		i, _ := e.Wait(ctx, "/w", info.ID, 0)
		got <- i
	}()
	// The waiter parks before the append (it counts itself in s.waiters
	// once it holds the change channel), or Wait would find the record
	// durable and return without waiting.
	if err := waitUntil(5*time.Second, func() bool { return s.waiters.Load() >= 1 }); err != nil {
		t.Fatal("Wait never parked: nothing tested")
	}
	if _, err := e.Append(ctx, "/w", AppendRequest{Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	select {
	case i := <-got:
		if i.NextSeq != 1 {
			t.Fatalf("woke with %+v", i)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("waiter not woken")
	}
}

func TestMetaKeyOrderAndRoundTrip(t *testing.T) {
	names := []string{"/a", "/a.c", "/a/b", "/a0", "/" + string(make([]byte, 100)) + "x", "/" + string(make([]byte, 100)) + "xy"}
	for i, n := range names {
		back, err := nameFromMetaKey(metaKey(n))
		if err != nil || back != n {
			t.Fatalf("round trip %q: %q %v", n, back, err)
		}
		for _, m := range names[i+1:] {
			if (n < m) != (metaKey(n) < metaKey(m)) {
				t.Fatalf("order of %q and %q not kept", n, m)
			}
		}
	}
}

func TestTrimRemovesBytesAfterCompaction(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/t", CreateRequest{ContentType: "text/plain", Records: recs("a", "b", "c")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Append(ctx, "/t", AppendRequest{Records: recs("d", "e")}); err != nil {
		t.Fatal(err)
	}
	info, err := e.Trim(ctx, "/t", 4)
	if err != nil || info.StartSeq != 4 {
		t.Fatalf("trim: %+v %v", info, err)
	}
	if _, err := e.Read(ctx, "/t", ReadRequest{Seq: 1}); !errors.Is(err, ErrGone) {
		t.Fatalf("read below start: %v", err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	for _, k := range st.Keys("data/") {
		first, _, _, _ := parseDataKey(k)
		if first < 4 {
			t.Fatalf("trimmed data still in the bucket: %s", k)
		}
	}
	e2 := startEngine(t, st, Config{CacheBytes: 1})
	res, err := e2.Read(ctx, "/t", ReadRequest{Seq: 4})
	if err != nil || len(res.Records) != 1 || string(res.Records[0].Body) != "e" || res.Info.StartSeq != 4 {
		t.Fatalf("after restart: %+v %v", res, err)
	}
}

func TestListStreams(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{})
	for _, n := range []string{"/logs/b", "/logs/a", "/other", "/logs/a/x"} {
		if _, _, err := e.Create(ctx, n, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
	}
	page, more, err := e.List(ctx, "/logs/", "", 2)
	if err != nil || !more || len(page) != 2 || page[0].Name != "/logs/a" || page[1].Name != "/logs/a/x" {
		t.Fatalf("page 1: %+v %v %v", page, more, err)
	}
	page, more, err = e.List(ctx, "/logs/", page[1].Name, 2)
	if err != nil || more || len(page) != 1 || page[0].Name != "/logs/b" {
		t.Fatalf("page 2: %+v %v %v", page, more, err)
	}
}

// TestListMatchingLooksUpOnlyMatches: a listing filtered by name looks up
// (a metadata GET each, for streams not in memory) only the names that
// match, not every stream under the prefix.
func TestListMatchingLooksUpOnlyMatches(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	first := startEngine(t, st, Config{})
	for i := range 30 {
		if _, _, err := first.Create(ctx, fmt.Sprintf("/a/s%02d", i), CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := first.Close(ctx); err != nil {
		t.Fatal(err)
	}
	e := startEngine(t, st, Config{})
	var gets atomic.Int64
	st.SetFail(func(op, key string) error {
		if op == "GET" && strings.HasPrefix(key, metaPrefix) {
			gets.Add(1)
		}
		return nil
	})
	defer st.SetFail(nil)
	page, more, err := e.ListMatching(ctx, "/a/", "", 1000, func(name string) bool { return strings.HasSuffix(name, "7") })
	if err != nil || more || len(page) != 3 || page[0].Name != "/a/s07" || page[2].Name != "/a/s27" {
		t.Fatalf("page %+v %v %v, want /a/s07, /a/s17, /a/s27", page, more, err)
	}
	if n := gets.Load(); n != 3 {
		t.Errorf("%d metadata GETs for 3 matches among 30 streams, want 3", n)
	}
}

// TestListPassesOverGravesInFewListings: a page behind many deleted
// streams, whose graves hold their keys for Config.GraveTime, lists them
// in listings that double, not one key a listing: a page of one after
// 500 graves took 500 LISTs.
func TestListPassesOverGravesInFewListings(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	for _, n := range []string{"/g/a", "/g/z"} {
		if _, _, err := e.Create(ctx, n, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
	}
	const graves = 500
	for i := range graves {
		name := fmt.Sprintf("/g/m%03d", i)
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
		if err := e.Delete(ctx, name); err != nil {
			t.Fatal(err)
		}
	}
	var lists, gets atomic.Int64
	st.SetFail(func(op, key string) error {
		switch {
		case op == "LIST" && strings.HasPrefix(key, metaPrefix):
			lists.Add(1)
		case op == "GET" && strings.HasPrefix(key, metaPrefix):
			gets.Add(1)
		}
		return nil
	})
	defer st.SetFail(nil)
	for _, limit := range []int{1, 3} {
		lists.Store(0)
		gets.Store(0)
		page, more, err := e.List(ctx, "/g/", "/g/a", limit)
		if err != nil || more || len(page) != 1 || page[0].Name != "/g/z" {
			t.Fatalf("page of %d after /g/a: %+v %v %v, want /g/z alone", limit, page, more, err)
		}
		t.Logf("page of %d: %d LISTs, %d metadata GETs", limit, lists.Load(), gets.Load())
		if n := lists.Load(); n > 10 {
			t.Errorf("page of %d behind %d graves: %d LISTs, want at most 10", limit, graves, n)
		}
		if n := gets.Load(); n > 2*graves {
			t.Errorf("page of %d behind %d graves: %d metadata GETs, want at most %d", limit, graves, n, 2*graves)
		}
	}
}

// TestListPrefixLongerThanAnyName: a prefix longer than MaxNameLength
// matches no stream and is answered an empty page, on the local-directory
// store too, which refused its key (over 1,024 bytes) as an error.
func TestListPrefixLongerThanAnyName(t *testing.T) {
	ctx := context.Background()
	st, err := segment.NewFileStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	e := startEngine(t, st, Config{})
	longest := "/" + strings.Repeat("n", MaxNameLength-1)
	if _, _, err := e.Create(ctx, longest, CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		prefix string
		want   int
	}{
		{longest, 1},
		{longest + "n", 0},
		{"/" + strings.Repeat("p", 3000), 0},
	} {
		page, more, err := e.List(ctx, c.prefix, "", 10)
		if err != nil || more || len(page) != c.want {
			t.Errorf("List(prefix of %d bytes): %d streams, more %v, %v; want %d", len(c.prefix), len(page), more, err, c.want)
		}
	}
}

// TestListSkipsHiddenStreams: expired and soft-deleted streams are left
// out of a listing, and the listing goes on past them, so a page is not
// empty (nor short) while more streams follow.
func TestListSkipsHiddenStreams(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{})
	// hide makes name a soft-deleted source of a fork.
	hide := func(name string) {
		t.Helper()
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
		if _, _, err := e.Create(ctx, "/forks"+name, CreateRequest{Fork: &ForkFrom{Source: name}}); err != nil {
			t.Fatal(err)
		}
		if err := e.Delete(ctx, name); err != nil {
			t.Fatal(err)
		}
	}
	soon := Expiry{ExpiresAt: time.Now().Add(50 * time.Millisecond)}
	for _, n := range []string{"/x/a", "/x/b"} {
		if _, _, err := e.Create(ctx, n, CreateRequest{ContentType: "text/plain", Expiry: soon}); err != nil {
			t.Fatal(err)
		}
	}
	// More hidden streams in a row than listRounds listings of one key.
	for i := range 2 * listRounds {
		hide(fmt.Sprintf("/x/c%d", i))
	}
	for _, n := range []string{"/x/d", "/x/f"} {
		if _, _, err := e.Create(ctx, n, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
	}
	hide("/x/e")
	time.Sleep(100 * time.Millisecond) // /x/a and /x/b expire
	list := func(after string, limit int) ([]string, bool) {
		t.Helper()
		page, more, err := e.List(ctx, "/x/", after, limit)
		if err != nil {
			t.Fatal(err)
		}
		names := []string{}
		for _, in := range page {
			names = append(names, in.Name)
		}
		return names, more
	}
	// Paging as a client does, after the last name of each page.
	for _, limit := range []int{1, 2, 10} {
		var all []string
		after := ""
		for pages := 1; ; pages++ {
			names, more := list(after, limit)
			if len(names) > limit || (more && len(names) == 0) || pages > 10 {
				t.Fatalf("limit %d, page %d after %q: %q more=%t", limit, pages, after, names, more)
			}
			all = append(all, names...)
			if !more {
				break
			}
			after = names[len(names)-1]
		}
		if got := fmt.Sprint(all); got != "[/x/d /x/f]" {
			t.Errorf("limit %d: listed %s", limit, got)
		}
	}
	if names, more := list("", 10); fmt.Sprint(names) != "[/x/d /x/f]" || more {
		t.Errorf("one page of 10: %q more=%t", names, more)
	}
	if names, more := list("/x/f", 1); len(names) != 0 || more {
		t.Errorf("after the last name: %q more=%t", names, more)
	}
}

func TestForkReadsSourceAndCascadesDeletes(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Records: recs("ab", "cd", "ef")}); err != nil {
		t.Fatal(err)
	}
	// Fork one byte into record 1: inherits "ab", "c".
	info, created, err := e.Create(ctx, "/fork", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 0, Bytes: 3}})
	if err != nil || !created || info.ForkBase != 2 || info.NextSeq != 2 || info.ContentType != "text/plain" {
		t.Fatalf("fork: %+v %v %v", info, created, err)
	}
	if _, created, err := e.Create(ctx, "/fork", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1, Bytes: 1}}); err != nil || created {
		t.Fatalf("idempotent fork: %v %v", created, err)
	}
	if _, err := e.Append(ctx, "/fork", AppendRequest{Records: recs("X")}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Append(ctx, "/src", AppendRequest{Records: recs("gh")}); err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(readAll(t, e, "/fork")); got != "[ab c X]" {
		t.Fatalf("fork reads %s", got)
	}
	if err := e.Delete(ctx, "/src"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Head(ctx, "/src"); !errors.Is(err, ErrGone) {
		t.Fatalf("soft-deleted source: %v", err)
	}
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain"}); !errors.Is(err, ErrConflict) {
		t.Fatalf("recreate soft-deleted: %v", err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	e2 := startEngine(t, st, Config{CacheBytes: 1})
	if got := fmt.Sprint(readAll(t, e2, "/fork")); got != "[ab c X]" {
		t.Fatalf("fork after restart reads %s", got)
	}
	if err := e2.Delete(ctx, "/fork"); err != nil {
		t.Fatal(err)
	}
	if _, err := e2.Head(ctx, "/src"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("source after last fork went: %v", err)
	}
	deadline := time.Now().Add(2 * time.Second)
	for len(st.Keys("data/")) > 0 || len(streamKeys(t, st, metaPrefix)) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("left in the bucket: %v %v", st.Keys("data/"), streamKeys(t, st, metaPrefix))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestEvictionKeepsSeqsConsistent(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{MaxStreams: 4})
	setPackBelow(e, -1) // packed streams stay in memory (pack_test.go)
	const streams, per = 20, 15
	for i := 0; i < streams; i++ {
		if _, _, err := e.Create(ctx, fmt.Sprintf("/e%d", i), CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := 0; j < per; j++ {
				for i := w; i < streams; i += 4 {
					if _, err := e.Append(ctx, fmt.Sprintf("/e%d", i), AppendRequest{Records: recs(fmt.Sprint(j))}); err != nil {
						t.Error(err)
						return
					}
				}
				if err := e.Compact(ctx); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	for i := 0; i < streams; i++ {
		got := readAll(t, e, fmt.Sprintf("/e%d", i))
		if len(got) != per {
			t.Fatalf("stream %d has %d records: %v", i, len(got), got)
		}
	}
	// Past the grace period, one more stream in memory evicts idle ones.
	time.Sleep(evictGrace + 100*time.Millisecond)
	if _, _, err := e.Create(ctx, "/e-new", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	e.mu.Lock()
	n := len(e.streams)
	e.mu.Unlock()
	if n > 4 {
		t.Fatalf("%d streams in memory with MaxStreams 4", n)
	}
}

func TestLeaseLossFencesTheOldWriter(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var mu sync.Mutex
	cutOff := false
	st.SetFail(func(op, key string) error {
		mu.Lock()
		defer mu.Unlock()
		if cutOff && key == "lease" {
			return errors.New("partitioned")
		}
		return nil
	})
	a := startEngine(t, st, Config{NodeID: "node-a", LeaseTTL: 600 * time.Millisecond})
	if _, _, err := a.Create(ctx, "/x", CreateRequest{ContentType: "text/plain", Records: recs("a0")}); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	cutOff = true
	mu.Unlock()
	time.Sleep(700 * time.Millisecond) // a's lease lapses and expires
	if _, err := a.Append(ctx, "/x", AppendRequest{Records: recs("lapsed")}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("append on a lapsed lease: %v", err)
	}
	mu.Lock()
	cutOff = false
	mu.Unlock()
	b := startEngine(t, st, Config{NodeID: "node-b"})
	if _, err := b.Append(ctx, "/x", AppendRequest{Records: recs("b1")}); err != nil {
		t.Fatal(err)
	}
	// a is reconnected: its renewal finds b's lease and fences it. Until
	// then a refuses appends all the same (its lease lapsed), so a refusal
	// alone would not show the fence.
	select {
	case <-a.fencedC:
	case <-time.After(10 * time.Second):
		t.Fatalf("a was not fenced 10 s after b took the storage over (holding: %v)", a.holding())
	}
	for i := 0; i < 3; i++ {
		if _, err := a.Append(ctx, "/x", AppendRequest{Records: recs("rogue")}); !errors.Is(err, ErrTakenOver) {
			t.Fatalf("append on a fenced node: %v, want %v", err, ErrTakenOver)
		}
	}
	if got := fmt.Sprint(readAll(t, b, "/x")); got != "[a0 b1]" {
		t.Fatalf("b reads %s", got)
	}
	b2 := startEngine(t, st, Config{NodeID: "node-b"})
	if got := fmt.Sprint(readAll(t, b2, "/x")); got != "[a0 b1]" {
		t.Fatalf("after b's restart: %s", got)
	}
}

func TestCompactionRetiresSealedNamespacesWithoutNewWrites(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain", Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	// A restart seals the old namespace; with no new writes, compaction
	// must still retire the seal.
	e2 := startEngine(t, st, Config{})
	if len(st.Keys("wal/")) == 0 {
		t.Fatal("expected a seal after restart")
	}
	if err := e2.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if keys := st.Keys("wal/"); len(keys) != 0 {
		t.Fatalf("WAL keys left: %v", keys)
	}
	if got := fmt.Sprint(readAll(t, e2, "/s")); got != "[a]" {
		t.Fatalf("reads %s", got)
	}
}

// A reload that shortens compact_interval takes effect at once, not after
// the old interval.
func TestReconfigureRearmsCompaction(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	cfg := Config{CompactInterval: time.Hour}
	e := startEngine(t, st, cfg)
	if _, _, err := e.Create(ctx, "/r", CreateRequest{ContentType: "text/plain", Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	cfg.CompactInterval = 20 * time.Millisecond
	cfg.FlushInterval = time.Millisecond
	cfg.NodeID = "node-a"
	e.Reconfigure(cfg)
	deadline := time.Now().Add(5 * time.Second)
	for len(st.Keys("pack/")) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no compaction 5 s after compact_interval became 20ms; keys %v", st.Keys(""))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A reload that shortens expiry_sweep_interval takes effect at once too:
// the sweep (a LIST of the expiry markers) comes within the new interval,
// not after the old hour.
func TestReconfigureRearmsExpirySweep(t *testing.T) {
	st := memstore.New()
	var sweeps atomic.Int64
	st.SetFail(func(op, key string) error {
		if op == "LIST" && key == expiryPrefix {
			sweeps.Add(1)
		}
		return nil
	})
	cfg := Config{ExpirySweep: time.Hour}
	e := startEngine(t, st, cfg)
	// The loop must be waiting out its hour already: one that had not
	// armed its timer yet would read the new interval anyway.
	if err := waitUntil(5*time.Second, func() bool { return goroutineWaits("(*Engine).expiryLoop") }); err != nil {
		t.Fatal("the expiry loop never waited for its timer")
	}
	before := sweeps.Load()
	cfg.ExpirySweep = 20 * time.Millisecond
	cfg.NodeID = "node-a"
	e.Reconfigure(cfg)
	if err := waitUntil(5*time.Second, func() bool { return sweeps.Load() > before }); err != nil {
		t.Fatalf("no expiry sweep 5 s after expiry_sweep_interval became 20ms (%d before)", before)
	}
}

// goroutineWaits reports whether a goroutine whose stack holds fn (and
// every one of more) is blocked in a select.
func goroutineWaits(fn string, more ...string) bool {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
next:
	for _, g := range strings.Split(string(buf), "\n\n") {
		header, _, _ := strings.Cut(g, "\n")
		if !strings.Contains(g, fn) || !strings.Contains(header, "[select") {
			continue
		}
		for _, f := range more {
			if !strings.Contains(g, f) {
				continue next
			}
		}
		return true
	}
	return false
}

// goroutineSelectsIn reports whether a goroutine is blocked in a select
// of fn itself: fn is its innermost frame outside the runtime.
func goroutineSelectsIn(fn string) bool {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for _, g := range strings.Split(string(buf), "\n\n") {
		lines := strings.Split(g, "\n")
		if !strings.Contains(lines[0], "[select") {
			continue
		}
		for _, l := range lines[1:] {
			if strings.HasPrefix(l, "\t") || strings.HasPrefix(l, "runtime.") {
				continue
			}
			if strings.Contains(l, fn) {
				return true
			}
			break
		}
	}
	return false
}

// stalledStore is a store whose every call waits for release; entered is
// closed by the first call.
type stalledStore struct {
	segment.Store
	once    sync.Once
	entered chan struct{}
	release chan struct{}
}

func (s *stalledStore) wait(ctx context.Context) error {
	s.once.Do(func() { close(s.entered) })
	select {
	case <-s.release:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s *stalledStore) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	if err := s.wait(ctx); err != nil {
		return "", err
	}
	return s.Store.Put(ctx, key, data, opts)
}

func (s *stalledStore) Get(ctx context.Context, key string, offset, length int64) ([]byte, string, error) {
	if err := s.wait(ctx); err != nil {
		return nil, "", err
	}
	return s.Store.Get(ctx, key, offset, length)
}

// Stats answer while Start still waits on the store (taking the lease,
// replaying): a metrics scrape must not hang on a start.
func TestStatsDoNotWaitForStart(t *testing.T) {
	store := &stalledStore{Store: memstore.New(), entered: make(chan struct{}), release: make(chan struct{})}
	e := New(store, Config{NodeID: "node-a", CompactInterval: time.Hour}, nil)
	started := make(chan error, 1)
	go func() { started <- e.Start(context.Background()) }()
	<-store.entered

	answered := make(chan StatsSnapshot, 1)
	go func() { answered <- e.Stats() }()
	waited := false
	select {
	case s := <-answered:
		if s.PendingBytes != 0 {
			t.Errorf("pending bytes %d before the writer exists", s.PendingBytes)
		}
	case <-time.After(5 * time.Second):
		t.Error("Stats waited for Start")
		waited = true
	}

	close(store.release)
	if err := <-started; err != nil {
		t.Fatalf("start: %v", err)
	}
	t.Cleanup(func() { _ = e.Close(context.Background()) })
	if waited {
		<-answered // the Stats that waited ends once the start has
	}
}

// TestLapsedLeaseCompactsNothingAway cuts a node off from its lease and
// compacts once the lease has lapsed: another node may own the storage by
// now and replay this one's WAL, so the compaction must neither checkpoint
// (a fold) nor move the manifest and delete WAL objects (a pack). The
// records are all there for the next owner.
func TestLapsedLeaseCompactsNothingAway(t *testing.T) {
	tests := []struct {
		name      string
		packBelow int64
	}{
		{"fold", -1},
		{"pack", 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			var cutOff atomic.Bool
			var mu sync.Mutex
			var writes []string
			st.SetFail(func(op, key string) error {
				if !cutOff.Load() {
					return nil
				}
				if key == "lease" {
					return errors.New("partitioned")
				}
				if op == "PUT" || op == "DELETE" {
					mu.Lock()
					writes = append(writes, op+" "+key)
					mu.Unlock()
				}
				return nil
			})
			e := startEngine(t, st, Config{NodeID: "node-a", LeaseTTL: 600 * time.Millisecond, PackBelow: tc.packBelow})
			for i := range 3 {
				name := fmt.Sprintf("/l%d", i)
				if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
					t.Fatal(err)
				}
				for _, r := range []string{"a", "b"} {
					if _, err := e.Append(ctx, name, AppendRequest{Records: recs(r)}); err != nil {
						t.Fatal(err)
					}
				}
			}
			cutOff.Store(true)
			time.Sleep(700 * time.Millisecond) // the lease lapses
			if err := e.Compact(ctx); err == nil {
				t.Error("a compaction on a lapsed lease reported success")
			}
			mu.Lock()
			for _, w := range writes {
				op, key, _ := strings.Cut(w, " ")
				if strings.HasPrefix(key, "streams/") || key == "manifest" || (op == "DELETE" && strings.HasPrefix(key, "wal/")) {
					t.Errorf("on a lapsed lease the compaction wrote %s", w)
				}
			}
			mu.Unlock()
			cutOff.Store(false)
			b := startEngine(t, st, Config{NodeID: "node-b"})
			for i := range 3 {
				name := fmt.Sprintf("/l%d", i)
				if got := fmt.Sprint(readAll(t, b, name)); got != "[a b]" {
					t.Errorf("the next owner reads %s as %s", name, got)
				}
			}
		})
	}
}

func TestValidateNewName(t *testing.T) {
	for _, c := range []struct {
		name string
		ok   bool
	}{
		{"/orders", true},
		{"/caf\u00e9/x", true},
		{"/a b", true},
		{"/a\u202eb", true}, // a format character, not a control one
		{"/a\nb", false},
		{"/a\r\nSet-Cookie: x", false},
		{"/a\tb", false},
		{"/a\x1bb", false},
		{"/a\x7fb", false},
		{"/a\u0085b", false},
		{"/dir\n/x", false},
	} {
		err := validateNewName(c.name)
		if (err == nil) != c.ok || (err != nil && !errors.Is(err, ErrBadRequest)) {
			t.Errorf("validateNewName(%q): %v, want ok=%v", c.name, err, c.ok)
		}
	}
}

// A storage that refuses writes until the operator acts (here a read-only
// file system) answers an append at once, naming the cause, rather than
// after the append timeout; later appends are refused at once too, and
// writes resume by themselves once the storage takes them again.
func TestRefusedWritesFailFast(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var mu sync.Mutex
	var refuse error
	st.SetFail(func(op, key string) error {
		mu.Lock()
		defer mu.Unlock()
		if op == "PUT" {
			return refuse
		}
		return nil
	})
	setRefuse := func(err error) {
		mu.Lock()
		refuse = err
		mu.Unlock()
	}
	// Long enough that an append answered by its timeout cannot pass.
	e := startEngine(t, st, Config{AppendTimeout: time.Hour})
	if _, _, err := e.Create(ctx, "/f", CreateRequest{ContentType: "text/plain", Records: recs("ok")}); err != nil {
		t.Fatal(err)
	}
	setRefuse(&fs.PathError{Op: "open", Path: "/data/.picomq-tmp/put-1", Err: syscall.EROFS})
	for i, what := range []string{"first append", "second append"} {
		actx, cancel := context.WithTimeout(ctx, time.Minute)
		_, err := e.Append(actx, "/f", AppendRequest{Records: recs(fmt.Sprint("refused", i))})
		cancel()
		if !errors.Is(err, ErrUnavailable) || !strings.Contains(fmt.Sprint(err), "read-only file system") {
			t.Fatalf("%s on a read-only store: %v, want ErrUnavailable naming the cause", what, err)
		}
	}
	setRefuse(nil)
	var err error
	for range 500 {
		if _, err = e.Append(ctx, "/f", AppendRequest{Records: recs("after")}); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("no recovery once writes are taken again: %v", err)
	}
	if got := fmt.Sprint(readAll(t, e, "/f")); got != "[ok after]" {
		t.Fatalf("records: %s", got)
	}
}

// Requests can reach an engine whose Start is still under way, and each
// asks holding about the lease Start sets: run with -race, this found the
// lease written and read unguarded.
func TestHoldingDuringStart(t *testing.T) {
	e := New(memstore.New(), testConfig(Config{}), nil)
	t.Cleanup(func() { _ = e.Close(context.Background()) })
	started := make(chan error, 1)
	go func() { started <- e.Start(context.Background()) }()
	for {
		_ = e.holding()
		select {
		case err := <-started:
			if err != nil {
				t.Fatal(err)
			}
			if err := e.holding(); err != nil {
				t.Fatalf("holding after the start: %v", err)
			}
			return
		default:
		}
	}
}

// formatGetFails fails the first read of the format object, which a start
// makes after taking the lease.
type formatGetFails struct {
	segment.Store
	failed atomic.Bool
}

func (s *formatGetFails) Get(ctx context.Context, key string, offset, length int64) ([]byte, string, error) {
	if key == "format" && s.failed.CompareAndSwap(false, true) {
		return nil, "", errors.New("injected: the bucket does not answer")
	}
	return s.Store.Get(ctx, key, offset, length)
}

// TestFailedStartIsNotTriedAgain: a start that failed after taking the
// lease leaves what its replay loaded in the engine, which a second start
// took for the bucket's state (a create only the WAL held was then taken
// for one with metadata, which nobody wrote). The engine now refuses a
// second start; a new engine on the same store starts and reads the
// stream.
func TestFailedStartIsNotTriedAgain(t *testing.T) {
	ctx := context.Background()
	mem := memstore.New()
	first := startEngine(t, mem, Config{})
	if _, _, err := first.Create(ctx, "/s", CreateRequest{ContentType: "text/plain", Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	if err := first.Close(ctx); err != nil {
		t.Fatal(err)
	}
	e := New(&formatGetFails{Store: mem}, testConfig(Config{}), nil)
	t.Cleanup(func() { _ = e.Close(ctx) })
	if err := e.Start(ctx); err == nil {
		t.Fatal("start with the format read failing succeeded")
	}
	if err := e.Start(ctx); err == nil || !strings.Contains(err.Error(), "new engine") {
		t.Fatalf("second start of the engine whose start failed: %v, want a refusal", err)
	}
	again := startEngine(t, mem, Config{})
	res, err := again.Read(ctx, "/s", ReadRequest{})
	if err != nil || len(res.Records) != 1 || string(res.Records[0].Body) != "a" {
		t.Fatalf("read on a new engine: %+v %v", res.Records, err)
	}
	res.Release()
}
