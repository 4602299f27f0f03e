package streamstore

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// opLog counts the store's requests by operation and key prefix while on.
type opLog struct {
	mu  sync.Mutex
	on  bool
	ops map[string]int // "PUT data/", "GET pack/", ...
}

func watch(st *memstore.Store) *opLog {
	l := &opLog{ops: map[string]int{}}
	st.SetFail(func(op, key string) error {
		l.mu.Lock()
		defer l.mu.Unlock()
		if l.on {
			prefix, _, _ := strings.Cut(key, "/")
			l.ops[op+" "+prefix]++
		}
		return nil
	})
	return l
}

// during counts the requests fn makes.
func (l *opLog) during(fn func()) map[string]int {
	l.mu.Lock()
	l.on, l.ops = true, map[string]int{}
	l.mu.Unlock()
	fn()
	l.mu.Lock()
	defer l.mu.Unlock()
	l.on = false
	return l.ops
}

func mustCompact(t *testing.T, e *Engine) {
	t.Helper()
	if err := e.Compact(context.Background()); err != nil {
		t.Fatalf("compact: %v", err)
	}
}

func mustAppend(t *testing.T, e *Engine, name string, req AppendRequest) AppendResult {
	t.Helper()
	r, err := e.Append(context.Background(), name, req)
	if err != nil {
		t.Fatalf("append to %s: %v", name, err)
	}
	return r
}

// Busy streams with a few records each cost one shared pack per
// compaction, not a data object and a checkpoint each; their records,
// producers and closure survive a crash, read from the packs.
func TestPacksHoldSmallBacklogsOfManyStreams(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	ops := watch(st)
	e := startEngine(t, st, Config{})
	const n = 50
	name := func(i int) string { return fmt.Sprintf("/many/%02d", i) }
	for i := range n {
		if _, _, err := e.Create(ctx, name(i), CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
		mustAppend(t, e, name(i), AppendRequest{Records: recs("a"), Producer: &Producer{ID: "p", Seq: 0}})
	}
	got := ops.during(func() { mustCompact(t, e) })
	if got["PUT pack"] != 1 || got["PUT data"] != 0 || got["PUT streams"] != 0 {
		t.Fatalf("compacting %d small streams made %v; want one pack PUT, no data objects or checkpoints", n, got)
	}
	if wal := st.Keys("wal/"); len(wal) != 0 {
		t.Fatalf("WAL objects left after compaction: %v", wal)
	}
	// A second round: each stream's records span two packs and the WAL.
	for i := range n {
		mustAppend(t, e, name(i), AppendRequest{Records: recs("b"), Producer: &Producer{ID: "p", Seq: 1}})
	}
	mustCompact(t, e)
	if packs := st.Keys("pack/"); len(packs) != 2 {
		t.Fatalf("packs after two compactions: %v", packs)
	}
	mustAppend(t, e, name(0), AppendRequest{Records: recs("c"), Close: true})

	// Crash: a second engine takes over, with a cache too small to help.
	e2 := startEngine(t, st, Config{CacheBytes: 1})
	for i := range n {
		want := "[a b]"
		if i == 0 {
			want = "[a b c]"
		}
		if got := fmt.Sprint(readAll(t, e2, name(i))); got != want {
			t.Fatalf("%s after restart: %s, want %s", name(i), got, want)
		}
	}
	if info, _ := e2.Head(ctx, name(0)); !info.Closed {
		t.Fatalf("%s lost its closure in the restart", name(0))
	}
	r, err := e2.Append(ctx, name(1), AppendRequest{Records: recs("b"), Producer: &Producer{ID: "p", Seq: 1}})
	if err != nil || !r.Duplicate {
		t.Fatalf("a producer retry after the restart: %+v, %v; want a duplicate", r, err)
	}
	if r := mustAppend(t, e2, name(1), AppendRequest{Records: recs("d"), Producer: &Producer{ID: "p", Seq: 2}}); r.FirstSeq != 2 {
		t.Fatalf("the next append after the restart went to seq %d, want 2", r.FirstSeq)
	}
	// The replayed streams pack again, and the old packs die once every
	// stream has left them.
	setPackBelow(e2, -1)
	mustCompact(t, e2)
	if packs, data := st.Keys("pack/"), st.Keys("data/"); len(packs) != 0 || len(data) != n {
		t.Fatalf("after folding every stream: packs %v, %d data objects", packs, len(data))
	}
	m, _, err := segment.NewManifests(st).Load(ctx)
	if err != nil || len(m.Packs) != 0 {
		t.Fatalf("the manifest still lists %v (%v)", m.Packs, err)
	}
	e3 := startEngine(t, st, Config{CacheBytes: 1})
	if got := fmt.Sprint(readAll(t, e3, name(1))); got != "[a b d]" {
		t.Fatalf("%s after folding and a restart: %s", name(1), got)
	}
}

// A packed stream that goes idle is folded at the next compaction, and
// leaves memory with it.
func TestIdlePackedStreamIsFoldedAndLeavesMemory(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{IdleAfter: time.Hour})
	if _, _, err := e.Create(ctx, "/quiet", CreateRequest{ContentType: "text/plain", Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	mustAppend(t, e, "/quiet", AppendRequest{Records: recs("b")})
	mustCompact(t, e)
	if len(st.Keys("pack/")) != 1 {
		t.Fatalf("the busy stream was not packed: %v", st.Keys(""))
	}
	if streams, _ := e.sweepIdle(time.Now().Add(2 * time.Hour)); streams != 0 {
		t.Fatal("a packed stream left memory: its records would be unreachable")
	}
	e.Reconfigure(Config{IdleAfter: time.Millisecond, NodeID: "node-a", FlushInterval: time.Millisecond, CompactInterval: time.Hour})
	time.Sleep(5 * time.Millisecond)
	mustCompact(t, e)
	if packs, data := st.Keys("pack/"), st.Keys("data/"); len(packs) != 0 || len(data) != 1 {
		t.Fatalf("after the idle stream's compaction: packs %v, data %v", packs, data)
	}
	// The compaction that folded it let it go.
	if left := len(e.allStreams()); left != 0 {
		t.Fatalf("%d streams in memory after the fold; the idle one should have left", left)
	}
	if got := fmt.Sprint(readAll(t, e, "/quiet")); got != "[a b]" {
		t.Fatalf("read back %s", got)
	}
}

// Streams that leave the packs together are read back with one ranged GET
// per pack, not one per stream and pack.
func TestFoldReadsPacksBackInFewGETs(t *testing.T) {
	st := memstore.New()
	ops := watch(st)
	e := startEngine(t, st, Config{CacheBytes: 1}) // nothing stays cached
	const n, rounds = 100, 3
	name := func(i int) string { return fmt.Sprintf("/g/%03d", i) }
	for i := range n {
		if _, _, err := e.Create(context.Background(), name(i), CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
	}
	for r := range rounds {
		for i := range n {
			mustAppend(t, e, name(i), AppendRequest{Records: recs(fmt.Sprint(r))})
		}
		mustCompact(t, e)
	}
	if packs := st.Keys("pack/"); len(packs) != rounds {
		t.Fatalf("%d packs after %d compactions", len(packs), rounds)
	}
	setPackBelow(e, -1)
	got := ops.during(func() { mustCompact(t, e) })
	if got["PUT data"] != n || got["GET pack"] > rounds {
		t.Fatalf("folding %d streams out of %d packs made %v; want %d data PUTs and at most %d pack GETs", n, rounds, got, n, rounds)
	}
	for i := range n {
		if got := fmt.Sprint(readAll(t, e, name(i))); got != "[0 1 2]" {
			t.Fatalf("%s: %s", name(i), got)
		}
	}
}

// A crash between a pack's PUT and the manifest that lists it loses
// nothing: the WAL still holds the records, and the pack nobody lists is
// deleted when the next process starts.
func TestUnlistedPackAfterACrash(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var failManifest sync.Mutex
	failing := false
	st.SetFail(func(op, key string) error {
		failManifest.Lock()
		defer failManifest.Unlock()
		if failing && op == "PUT" && key == "manifest" {
			return errors.New("injected")
		}
		return nil
	})
	e := startEngine(t, st, Config{})
	for i := range 5 {
		name := fmt.Sprintf("/c%d", i)
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain", Records: recs("a")}); err != nil {
			t.Fatal(err)
		}
		mustAppend(t, e, name, AppendRequest{Records: recs("b")})
	}
	failManifest.Lock()
	failing = true
	failManifest.Unlock()
	if err := e.Compact(ctx); err == nil {
		t.Fatal("compaction succeeded without its manifest")
	}
	if len(st.Keys("pack/")) != 1 || len(st.Keys("wal/")) == 0 {
		t.Fatalf("after the failed compaction: %v", st.Keys(""))
	}
	failManifest.Lock()
	failing = false
	failManifest.Unlock()

	e2 := startEngine(t, st, Config{})
	for i := range 5 {
		name := fmt.Sprintf("/c%d", i)
		if got := fmt.Sprint(readAll(t, e2, name)); got != "[a b]" {
			t.Fatalf("%s after the crash: %s", name, got)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(st.Keys("pack/")) != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the unlisted pack was not swept: %v", st.Keys("pack/"))
		}
		time.Sleep(10 * time.Millisecond)
	}
	mustCompact(t, e2)
	if got := fmt.Sprint(readAll(t, e2, "/c3")); got != "[a b]" {
		t.Fatalf("/c3 after compacting again: %s", got)
	}
}

// A deleted stream's pack entries die with it: the pack goes when nothing
// else needs it, a replay skips them, and the name starts afresh.
func TestDeletedPackedStream(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	for _, name := range []string{"/keep", "/drop"} {
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain", Records: recs(name)}); err != nil {
			t.Fatal(err)
		}
	}
	mustCompact(t, e)
	if err := e.Delete(ctx, "/drop"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Create(ctx, "/drop", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	e2 := startEngine(t, st, Config{})
	if got := readAll(t, e2, "/drop"); len(got) != 0 {
		t.Fatalf("the recreated stream reads %v", got)
	}
	if got := fmt.Sprint(readAll(t, e2, "/keep")); got != "[/keep]" {
		t.Fatalf("/keep after restart: %s", got)
	}
	setPackBelow(e2, -1)
	mustCompact(t, e2)
	if packs := st.Keys("pack/"); len(packs) != 0 {
		t.Fatalf("packs left after every stream in them left: %v", packs)
	}
}

// No more streams are held in memory by packs than MaxStreams; the rest
// are folded, least recently used first.
func TestPackedStreamsAreCappedByMaxStreams(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{MaxStreams: 4})
	for i := range 10 {
		name := fmt.Sprintf("/m%d", i)
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain", Records: recs("a")}); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(time.Millisecond)
	for i := 6; i < 10; i++ { // the most recently used
		mustAppend(t, e, fmt.Sprintf("/m%d", i), AppendRequest{Records: recs("b")})
	}
	mustCompact(t, e)
	packed := 0
	e.mu.RLock()
	for name, s := range e.streams {
		s.mu.Lock()
		if len(s.runs) > 0 && s.runs[0].snap != nil {
			packed++
			if name < "/m6" {
				t.Errorf("%s was packed; the least recently used should fold", name)
			}
		}
		s.mu.Unlock()
	}
	e.mu.RUnlock()
	if packed != 4 || len(st.Keys("data/")) != 6 {
		t.Fatalf("%d streams packed and %d data objects with MaxStreams 4", packed, len(st.Keys("data/")))
	}
}

// setPackBelow changes the running engine's Config.PackBelow.
func setPackBelow(e *Engine, n int64) {
	e.cfgMu.Lock()
	defer e.cfgMu.Unlock()
	e.cfg.PackBelow = n
}

// packRuns is how many pack runs the stream called name has in memory.
func packRuns(e *Engine, name string) int {
	n, _ := packedRuns(e, name)
	return n
}

// packedRuns is how many pack runs the stream called name has in memory,
// and their size.
func packedRuns(e *Engine, name string) (runs int, bytes int64) {
	e.mu.RLock()
	s := e.streams[name]
	e.mu.RUnlock()
	if s == nil {
		return 0, 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for runs < len(s.runs) && s.runs[runs].snap != nil {
		bytes += s.runs[runs].span.Len
		runs++
	}
	return runs, bytes
}

// nameWithRunCap finds a stream name under prefix whose pack run cap is
// runs.
func nameWithRunCap(t *testing.T, prefix string, runs int) string {
	t.Helper()
	for i := range 1000 {
		name := fmt.Sprintf("%s%d", prefix, i)
		if _, n := packLimits(name); n == runs {
			return name
		}
	}
	t.Fatalf("no name under %s has a cap of %d runs", prefix, runs)
	return ""
}

// A stream at its cap of pack runs is repacked: its packed records and its
// new ones go into one run of the compaction's pack, with no data object or
// checkpoint of its own. A replay, with the older packs still listed for a
// stream that shares them, takes the repacked run instead of theirs; and
// once no stream reads the older packs, they leave the bucket.
func TestRepackKeepsStreamInOneRun(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	ops := watch(st)
	e := startEngine(t, st, Config{CacheBytes: 1}) // packed records come back from the packs
	a := nameWithRunCap(t, "/rp/a", packMaxRuns-6)
	b := nameWithRunCap(t, "/rp/b", packMaxRuns)
	for _, name := range []string{a, b} {
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
	}
	var bodies []string
	round := func(r int) map[string]int {
		t.Helper()
		body := fmt.Sprint(r)
		bodies = append(bodies, body)
		for _, name := range []string{a, b} {
			mustAppend(t, e, name, AppendRequest{Records: recs(body), Producer: &Producer{ID: "p", Seq: uint64(r)}})
		}
		return ops.during(func() { mustCompact(t, e) })
	}
	capA := packMaxRuns - 6
	for r := range capA {
		if got := round(r); got["PUT data"] != 0 || got["PUT streams"] != 0 {
			t.Fatalf("round %d: %v; want the two streams packed", r, got)
		}
	}
	if n := packRuns(e, a); n != capA {
		t.Fatalf("%s has %d pack runs after %d compactions, want %d", a, n, capA, capA)
	}
	got := round(capA)
	if got["PUT data"] != 0 || got["PUT streams"] != 0 || got["PUT pack"] != 1 || got["GET pack"] == 0 {
		t.Fatalf("the compaction that repacks %s made %v; want one pack PUT, pack GETs, no data objects or checkpoints", a, got)
	}
	if na, nb := packRuns(e, a), packRuns(e, b); na != 1 || nb != capA+1 {
		t.Fatalf("pack runs after the repack: %s %d, %s %d; want 1 and %d", a, na, b, nb, capA+1)
	}
	if s := e.Stats(); s.Repacked != 1 || s.Folds != 0 {
		t.Fatalf("stats after the repack: %d repacked, %d folds; want 1 and 0", s.Repacked, s.Folds)
	}
	want := fmt.Sprint(bodies)
	for _, name := range []string{a, b} {
		if got := fmt.Sprint(readAll(t, e, name)); got != want {
			t.Fatalf("%s: %s, want %s", name, got, want)
		}
	}

	// Crash, on a copy of the bucket (a replay's first compaction folds
	// the streams it brought back: see markReplayed). The packs before the
	// repack are still listed (b reads them) and still hold a's old runs.
	e2 := startEngine(t, copyStore(st), Config{CacheBytes: 1})
	for _, name := range []string{a, b} {
		if got := fmt.Sprint(readAll(t, e2, name)); got != want {
			t.Fatalf("%s after a restart: %s, want %s", name, got, want)
		}
	}
	if na := packRuns(e2, a); na != 1 {
		t.Fatalf("%s has %d pack runs after the replay, want the repacked one", a, na)
	}
	r, err := e2.Append(ctx, a, AppendRequest{Records: recs(fmt.Sprint(capA)), Producer: &Producer{ID: "p", Seq: uint64(capA)}})
	if err != nil || !r.Duplicate {
		t.Fatalf("a producer retry after the restart: %+v, %v; want a duplicate", r, err)
	}

	// b reaches its cap too: then nothing reads the packs before a's
	// repack, and they go.
	before := len(st.Keys("pack/"))
	for r := capA + 1; r <= packMaxRuns+1; r++ {
		if got := round(r); got["PUT data"] != 0 || got["PUT streams"] != 0 {
			t.Fatalf("round %d: %v; want the two streams packed", r, got)
		}
	}
	if packs := st.Keys("pack/"); len(packs) >= before {
		t.Fatalf("%d packs after both streams were repacked, %d before: the old ones did not go", len(packs), before)
	}
	want = fmt.Sprint(bodies)
	e3 := startEngine(t, st, Config{CacheBytes: 1})
	for _, name := range []string{a, b} {
		if got := fmt.Sprint(readAll(t, e3, name)); got != want {
			t.Fatalf("%s after both repacks and a restart: %s, want %s", name, got, want)
		}
	}
}

// A stream's entries in packs that outlive its repack (another stream
// still reads them) no longer continue its tail once an older pack of it
// died. A replay passes over them for the repack entry without a word: it
// used to log an error for each, on every start, for a bucket that was
// whole, hiding the ones that mean something.
func TestReplayPassesOverRepackedEntries(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{CacheBytes: 1})
	x := nameWithRunCap(t, "/rq/x", packMaxRuns-6)
	const y = "/rq/y"
	for _, name := range []string{x, y} {
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
	}
	var want []string
	for r := 0; e.Stats().Repacked == 0; r++ {
		if r > packMaxRuns {
			t.Fatalf("%s not repacked after %d compactions", x, r)
		}
		want = append(want, fmt.Sprint(r))
		mustAppend(t, e, x, AppendRequest{Records: recs(want[r])})
		if r == 1 {
			// y shares the second pack only, which so outlives x's repack
			// while the first pack dies.
			mustAppend(t, e, y, AppendRequest{Records: recs("y")})
		}
		mustCompact(t, e)
	}

	core, logs := observer.New(zap.WarnLevel)
	e2 := New(copyStore(st), testConfig(Config{CacheBytes: 1}), zap.New(core))
	if err := e2.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e2.Close(context.Background()) })
	if got := readAll(t, e2, x); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("%s after a restart: %v, want %v", x, got, want)
	}
	if got := readAll(t, e2, y); fmt.Sprint(got) != "[y]" {
		t.Fatalf("%s after a restart: %v, want [y]", y, got)
	}
	for _, l := range logs.All() {
		t.Errorf("the replay of a whole bucket logged %q %v", l.Message, l.ContextMap())
	}
}

// A replay's streams are folded before they are packed again (see
// markReplayed), but only once they have something new to pack: a stream
// that stays in the packs writes nothing a late checkpoint could
// contradict. Folding them all at the first compaction after every start
// read every live pack back and wrote two objects per packed stream, the
// burst packs exist to avoid.
func TestReplayedStreamsStayPackedUntilTheyChange(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	names := []string{"/rs/a", "/rs/b"}
	for _, name := range names {
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
		mustAppend(t, e, name, AppendRequest{Records: recs("1")})
	}
	mustCompact(t, e)
	if n := packRuns(e, names[0]); n != 1 {
		t.Fatalf("%s has %d pack runs, want 1", names[0], n)
	}

	st2 := copyStore(st) // a crash
	ops2 := watch(st2)
	e2 := startEngine(t, st2, Config{})
	if got := ops2.during(func() { mustCompact(t, e2) }); got["PUT data"] != 0 || got["PUT streams"] != 0 || got["GET pack"] != 0 {
		t.Fatalf("the first compaction after a restart, with nothing new: %v; want no folds", got)
	}
	mustAppend(t, e2, names[0], AppendRequest{Records: recs("2")})
	if got := ops2.during(func() { mustCompact(t, e2) }); got["PUT data"] != 1 || got["PUT streams"] != 1 {
		t.Fatalf("the compaction after %s changed: %v; want it folded (one data object and checkpoint)", names[0], got)
	}
	if a, b := packRuns(e2, names[0]), packRuns(e2, names[1]); a != 0 || b != 1 {
		t.Fatalf("pack runs: %s %d, %s %d; want 0 (folded) and 1 (still packed)", names[0], a, names[1], b)
	}
	mustAppend(t, e2, names[0], AppendRequest{Records: recs("3")})
	if got := ops2.during(func() { mustCompact(t, e2) }); got["PUT data"] != 0 || got["PUT streams"] != 0 || got["PUT pack"] != 1 {
		t.Fatalf("the next compaction: %v; want %s packed again", got, names[0])
	}
	e3 := startEngine(t, st2, Config{})
	for i, want := range []string{"[1 2 3]", "[1]"} {
		if got := fmt.Sprint(readAll(t, e3, names[i])); got != want {
			t.Fatalf("%s after a restart: %s, want %s", names[i], got, want)
		}
	}
}

// copyStore returns a copy of st's objects, for a crash whose replay must
// leave st as it was.
func copyStore(st *memstore.Store) *memstore.Store {
	out := memstore.New()
	for _, k := range st.Keys("") {
		d, _, _ := st.Get(context.Background(), k, 0, -1)
		_, _ = out.Put(context.Background(), k, d, segment.PutOptions{})
	}
	return out
}

// A stream whose oldest pack run passed its stay is repacked even without
// new records, so that the packs it was in can die.
func TestRepackAfterStay(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	ops := watch(st)
	e := startEngine(t, st, Config{})
	const name = "/stay/0"
	if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	for _, body := range []string{"a", "b"} {
		mustAppend(t, e, name, AppendRequest{Records: recs(body)})
		mustCompact(t, e)
	}
	// One more stream's append, so that the next compaction has a WAL to
	// retire, and the packed one's runs written long ago.
	if _, _, err := e.Create(ctx, "/stay/other", CreateRequest{ContentType: "text/plain", Records: recs("x")}); err != nil {
		t.Fatal(err)
	}
	e.mu.RLock()
	s := e.streams[name]
	e.mu.RUnlock()
	s.mu.Lock()
	for i := 0; i < len(s.runs) && s.runs[i].snap != nil; i++ {
		s.runs[i].packed -= packResidency.Milliseconds()
	}
	s.mu.Unlock()
	if n := packRuns(e, name); n != 2 {
		t.Fatalf("%d pack runs before, want 2", n)
	}
	got := ops.during(func() { mustCompact(t, e) })
	if got["PUT data"] != 0 || got["PUT streams"] != 0 {
		t.Fatalf("repacking after the stay made %v; want no data objects or checkpoints", got)
	}
	if n, r := packRuns(e, name), e.Stats().Repacked; n != 1 || r != 1 {
		t.Fatalf("after the stay: %d pack runs, %d repacked; want 1 and 1", n, r)
	}
	if got := fmt.Sprint(readAll(t, e, name)); got != "[a b]" {
		t.Fatalf("%s: %s", name, got)
	}
}

// A stream due to be repacked whose packed records are past half of
// pack_below is folded instead: it would pass the limit soon, at the same
// compaction as every stream that grows as fast.
func TestDueStreamPastHalfTheLimitIsFolded(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	ops := watch(st)
	e := startEngine(t, st, Config{})
	name := nameWithRunCap(t, "/half/", packMaxRuns-6)
	if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	var want []string
	for r := range packMaxRuns - 6 {
		body := strings.Repeat(fmt.Sprint(r%10), 1000)
		want = append(want, body)
		mustAppend(t, e, name, AppendRequest{Records: recs(body)})
		mustCompact(t, e)
	}
	if n := packRuns(e, name); n != packMaxRuns-6 {
		t.Fatalf("%d pack runs, want %d", n, packMaxRuns-6)
	}
	// The next compaction finds the stream at its cap with its records
	// between half of pack_below and all of it.
	_, packed := packedRuns(e, name)
	setPackBelow(e, packed*3/2)
	want = append(want, "last")
	mustAppend(t, e, name, AppendRequest{Records: recs("last")})
	got := ops.during(func() { mustCompact(t, e) })
	if got["PUT data"] == 0 || got["PUT streams"] == 0 || e.Stats().Repacked != 0 {
		t.Fatalf("at its cap past half the limit: %v, %d repacked; want a fold (data object and checkpoint)", got, e.Stats().Repacked)
	}
	if n := packRuns(e, name); n != 0 {
		t.Fatalf("%d pack runs after the fold", n)
	}
	if got := readAll(t, e, name); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("%s after the fold: %d records, want %d", name, len(got), len(want))
	}
}

// Records read back from the packs for a fold hold only their own runs'
// bytes: two streams folded together have runs in one pack with another
// stream's entry between them, one ranged GET fetches them with it, and
// records decoded in place kept the whole range alive (a Caddy folding
// 10,000 streams out of the packs peaked near 1 GB of heap).
func TestPackedRecordsDoNotHoldTheRange(t *testing.T) {
	ctx := context.Background()
	const size = 100 << 10 // under packReadGap: one GET for all three
	e, ranges, all := threeStreamsInOnePack(t, size)
	// Fold the first and the last in the pack: the middle one is the gap.
	slices.SortFunc(all, func(x, y *stream) int { return cmp.Compare(x.runs[0].span.Off, y.runs[0].span.Off) })
	ranges.got = nil // the pack's index, read at start
	got, err := e.readPacked(ctx, []*stream{all[0], all[2]})
	if err != nil {
		t.Fatal(err)
	}
	if len(ranges.got) != 1 || len(ranges.got[0]) < 3*size {
		t.Fatalf("the fold read %d ranges; the test needs one over the three entries", len(ranges.got))
	}
	var n int
	for _, recs := range got {
		for _, r := range recs {
			n++
			if len(r.Body) != size {
				t.Fatalf("a record of %d bytes; want %d", len(r.Body), size)
			}
			if overlaps(r.Body, ranges.got[0]) {
				t.Errorf("a record of %s is in the range read (%d bytes), other streams' entry included", r.Body[:1], len(ranges.got[0]))
			}
		}
	}
	if n != 2 {
		t.Fatalf("read back %d records; want 2", n)
	}
}

// threeStreamsInOnePack packs streams /a, /b and /c, one record of size
// bytes each, into one pack, and returns them as a node started since
// has them (nothing cached: a fold reads the pack) on a store that keeps
// the ranges it was asked for.
func threeStreamsInOnePack(t *testing.T, size int) (*Engine, *rangeGets, []*stream) {
	t.Helper()
	ctx := context.Background()
	st := memstore.New()
	w := startEngine(t, st, Config{})
	setPackBelow(w, 4<<20)
	names := []string{"/a", "/b", "/c"}
	for _, name := range names {
		if _, _, err := w.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
		mustAppend(t, w, name, AppendRequest{Records: []NewRecord{{Body: bytes.Repeat([]byte(name[1:]), size)}}})
	}
	mustCompact(t, w)
	if packs := st.Keys("pack/"); len(packs) != 1 {
		t.Fatalf("%d packs; the test needs the three streams in one", len(packs))
	}
	if err := w.Close(ctx); err != nil {
		t.Fatal(err)
	}
	ranges := &rangeGets{Store: st}
	e := startEngine(t, ranges, Config{})
	var all []*stream
	for _, name := range names {
		if _, err := e.Head(ctx, name); err != nil {
			t.Fatal(err)
		}
		e.mu.RLock()
		s := e.streams[name]
		e.mu.RUnlock()
		if runs, _ := packedRuns(e, name); runs != 1 {
			t.Fatalf("%s has %d pack runs; the test needs 1", name, runs)
		}
		all = append(all, s)
	}
	return e, ranges, all
}

// rangeGets keeps what its ranged GETs of packs returned.
type rangeGets struct {
	segment.Store
	mu  sync.Mutex
	got [][]byte
}

func (g *rangeGets) Get(ctx context.Context, key string, off, n int64) ([]byte, string, error) {
	b, etag, err := g.Store.Get(ctx, key, off, n)
	if err == nil && strings.HasPrefix(key, "pack/") && n > 0 {
		g.mu.Lock()
		g.got = append(g.got, b)
		g.mu.Unlock()
	}
	return b, etag, err
}

// overlaps reports whether a and b share memory.
func overlaps(a, b []byte) bool {
	if len(a) == 0 || len(b) == 0 {
		return false
	}
	a0, b0 := uintptr(unsafe.Pointer(unsafe.SliceData(a))), uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	return a0 < b0+uintptr(len(b)) && b0 < a0+uintptr(len(a))
}

// TestReplayPackEntry: the replay adds a pack entry to a stream's runs only
// when it continues the stream, a repack entry (everything since the
// checkpoint) replacing the runs before it. A repack entry whose state does
// not end where its records do is damaged: it must leave the runs as they
// were, not drop them and add nothing.
func TestReplayPackEntry(t *testing.T) {
	entry := func(first, end, stateEnd uint64, repack bool) packIndexEntry {
		return packIndexEntry{Name: "/r", ID: "id", First: first, End: end, State: writerState{NextSeq: stateEnd}, Repack: repack}
	}
	for _, tc := range []struct {
		name      string
		ents      []packIndexEntry
		applied   []bool
		wantRuns  [][2]uint64 // each run's [first, end)
		wantTail  uint64
		checkTail uint64 // the checkpoint's tail
	}{
		{"entries that follow", []packIndexEntry{entry(2, 4, 4, false), entry(4, 5, 5, false)},
			[]bool{true, true}, [][2]uint64{{2, 4}, {4, 5}}, 5, 2},
		{"a gap", []packIndexEntry{entry(2, 4, 4, false), entry(5, 6, 6, false)},
			[]bool{true, false}, [][2]uint64{{2, 4}}, 4, 2},
		{"a repack replaces the runs before it", []packIndexEntry{entry(2, 4, 4, false), entry(2, 6, 6, true)},
			[]bool{true, true}, [][2]uint64{{2, 6}}, 6, 2},
		{"a repack from below the checkpoint", []packIndexEntry{entry(2, 4, 4, false), entry(1, 6, 6, true)},
			[]bool{true, false}, [][2]uint64{{2, 4}}, 4, 2},
		{"a damaged repack keeps the runs", []packIndexEntry{entry(2, 4, 4, false), entry(2, 6, 9, true)},
			[]bool{true, false}, [][2]uint64{{2, 4}}, 4, 2},
		{"a damaged entry", []packIndexEntry{entry(2, 4, 3, false)},
			[]bool{false}, nil, 2, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newStream("/r", &metaObject{ID: "id", State: writerState{NextSeq: tc.checkTail}}, "")
			for i, ent := range tc.ents {
				if got := s.replayPackEntry("pack", ent); got != tc.applied[i] {
					t.Errorf("entry %d [%d, %d): applied %v, want %v", i, ent.First, ent.End, got, tc.applied[i])
				}
			}
			var runs [][2]uint64
			for _, r := range s.runs {
				runs = append(runs, [2]uint64{r.ch.First, r.ch.End})
			}
			if fmt.Sprint(runs) != fmt.Sprint(tc.wantRuns) || s.durable.NextSeq != tc.wantTail {
				t.Errorf("runs %v, tail %d; want %v, %d", runs, s.durable.NextSeq, tc.wantRuns, tc.wantTail)
			}
		})
	}
}

// A pack index that matches its checksum but names spans the pack cannot
// hold (only a faulty writer makes one) fails the start as a damaged
// index does, naming the pack. Its spans were sliced as they came: a
// negative length passed the bounds check and a read of the stream
// panicked, taking the process down.
func TestReplayRefusesAPackIndexOutOfRange(t *testing.T) {
	for _, tc := range []struct {
		name string
		bend func(ent *packIndexEntry, indexOff int64)
	}{
		{"negative length", func(ent *packIndexEntry, _ int64) { ent.Len = -3 }},
		{"past the entries", func(ent *packIndexEntry, indexOff int64) { ent.Off = indexOff - 2 }},
		{"huge offset", func(ent *packIndexEntry, _ int64) { ent.Off = math.MaxInt64 - 1 }},
		{"records end before they start", func(ent *packIndexEntry, _ int64) { ent.First = ent.End + 1 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			e := startEngine(t, st, Config{})
			for _, name := range []string{"/p/a", "/p/b"} {
				if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
					t.Fatal(err)
				}
				mustAppend(t, e, name, AppendRequest{Records: recs("x", "y")})
			}
			mustCompact(t, e)
			if err := e.Close(ctx); err != nil {
				t.Fatal(err)
			}
			mans := segment.NewManifests(st)
			m, _, err := mans.Load(ctx)
			if err != nil || len(m.Packs) != 1 {
				t.Fatalf("manifest packs %v (%v); want one", m.Packs, err)
			}
			ref := m.Packs[0]
			obj, _, err := st.Get(ctx, ref.Key, 0, -1)
			if err != nil {
				t.Fatal(err)
			}
			var idx []packIndexEntry
			if err := json.Unmarshal(obj[ref.IndexOff:ref.IndexOff+ref.IndexLen], &idx); err != nil {
				t.Fatal(err)
			}
			tc.bend(&idx[len(idx)-1], ref.IndexOff)
			bent, err := json.Marshal(idx)
			if err != nil {
				t.Fatal(err)
			}
			obj = append(slices.Clone(obj[:ref.IndexOff]), bent...)
			if _, err := st.Put(ctx, ref.Key, obj, segment.PutOptions{}); err != nil {
				t.Fatal(err)
			}
			if _, err := mans.Update(ctx, func(m *segment.Manifest) error {
				m.Packs[0].IndexLen = int64(len(bent))
				m.Packs[0].IndexCRC = crc32.Checksum(bent, crc32.MakeTable(crc32.Castagnoli))
				return nil
			}); err != nil {
				t.Fatal(err)
			}

			e2 := New(st, testConfig(Config{}), zap.NewNop())
			err = e2.Start(ctx)
			if err == nil {
				defer e2.Close(ctx)
				var got []string
				for _, name := range []string{"/p/a", "/p/b"} {
					_, err := e2.Read(ctx, name, ReadRequest{})
					got = append(got, fmt.Sprintf("%s: %v", name, err))
				}
				t.Fatalf("an engine started on a pack index whose spans the pack cannot hold; reads: %v", got)
			}
			if !errors.Is(err, segment.ErrCorrupt) || !strings.Contains(err.Error(), ref.Key) {
				t.Fatalf("start: %v; want the index corrupt, naming %s", err, ref.Key)
			}
		})
	}
}

func TestSpanWithin(t *testing.T) {
	for _, tc := range []struct {
		off, n, size int64
		want         bool
	}{
		{0, 10, 10, true},
		{5, 5, 10, true},
		{5, 6, 10, false},
		{-1, 2, 10, false},
		{3, 0, 10, false},
		{3, -2, 10, false},
		{11, 1, 10, false},
		{math.MaxInt64, math.MaxInt64, 10, false},
		{2, math.MaxInt64, 10, false},
	} {
		if got := spanWithin(tc.off, tc.n, tc.size); got != tc.want {
			t.Errorf("spanWithin(%d, %d, %d) = %v, want %v", tc.off, tc.n, tc.size, got, tc.want)
		}
	}
}

// A stream with more producers than packMaxProducers is folded, not packed:
// every pack index entry would hold all of them. One with fewer is packed,
// however many appends each made.
func TestStreamWithManyProducersIsFolded(t *testing.T) {
	for _, tc := range []struct {
		producers, each int
		packed          bool
	}{
		{packMaxProducers, 1, true},
		{1, 2 * packMaxProducers, true},
		{10, 10, true}, // past producerMergeMin changes: base and log both hold them
		{packMaxProducers + 1, 1, false},
	} {
		t.Run(fmt.Sprintf("%dx%d", tc.producers, tc.each), func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			e := startEngine(t, st, Config{})
			if _, _, err := e.Create(ctx, "/p", CreateRequest{ContentType: "text/plain"}); err != nil {
				t.Fatal(err)
			}
			for i := range tc.producers {
				for seq := range tc.each {
					mustAppend(t, e, "/p", AppendRequest{Records: recs(fmt.Sprint(i)),
						Producer: &Producer{ID: fmt.Sprintf("p%02d", i), Epoch: 0, Seq: uint64(seq)}})
				}
			}
			mustCompact(t, e)
			packs, data := len(st.Keys("pack/")), len(st.Keys("data/"))
			if tc.packed != (packs == 1 && data == 0) || !tc.packed != (packs == 0 && data == 1) {
				t.Fatalf("%d producers: %d packs and %d data objects; packed %v", tc.producers, packs, data, tc.packed)
			}
			if got := readAll(t, e, "/p"); len(got) != tc.producers*tc.each {
				t.Fatalf("read %d records, want %d", len(got), tc.producers*tc.each)
			}
		})
	}
}
