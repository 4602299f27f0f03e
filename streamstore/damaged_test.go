package streamstore

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// walRunOf returns the WAL run of the stream called name that holds seq.
func walRunOf(t *testing.T, e *Engine, name string, seq uint64) walRun {
	t.Helper()
	e.mu.RLock()
	s := e.streams[name]
	e.mu.RUnlock()
	if s == nil {
		t.Fatalf("%s is not in memory", name)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, r := range s.runs {
		if r.snap == nil && r.blob == "" && r.ch.First <= seq && seq < r.ch.End {
			return r
		}
	}
	t.Fatalf("%s has no WAL run holding seq %d", name, seq)
	return walRun{}
}

// damageRun flips a byte inside run r's entry in its WAL object, as bit
// rot on a local disk would, or cuts the object short just before the end
// of the entry.
func damageRun(t *testing.T, st *memstore.Store, r walRun, truncate bool) {
	t.Helper()
	ctx := context.Background()
	data, _, err := st.Get(ctx, r.key, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	if truncate {
		data = data[:r.span.Off+r.span.Len-1]
	} else {
		data = slices.Clone(data)
		data[r.span.Off+r.span.Len-2] ^= 0x40
	}
	if _, err := st.Put(ctx, r.key, data, segment.PutOptions{}); err != nil {
		t.Fatal(err)
	}
}

// A WAL object that fails its checksum where compaction must read it back
// (the cache no longer holds the entry) confines the damage to the stream
// whose entry it is: that stream is compacted up to the object and no
// further, and reads of the damaged records fail naming the corruption;
// every other stream is compacted as usual, and the WAL before the object
// is retired. Compaction used to fail as a whole on it, every time: no
// stream was compacted and no WAL retired again, however long the node ran.
func TestDamagedWALEntryIsConfinedToItsStream(t *testing.T) {
	tests := []struct {
		name      string
		packBelow int64 // 0: every stream folds
		truncate  bool
	}{
		{name: "bit flip, folds"},
		{name: "bit flip, packs", packBelow: 1 << 20},
		{name: "truncated object", truncate: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			core, logs := observer.New(zap.ErrorLevel)
			e := New(st, testConfig(Config{}), zap.New(core))
			if err := e.Start(ctx); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = e.Close(context.Background()) })
			setPackBelow(e, tt.packBelow)
			for _, name := range []string{"/bad", "/good"} {
				if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
					t.Fatal(err)
				}
			}
			// One append at a time, so each is a WAL object of its own.
			for _, a := range []struct{ name, body string }{
				{"/good", "g0"}, {"/bad", "b0"}, {"/bad", "b1"}, {"/good", "g1"}, {"/bad", "b2"}, {"/good", "g2"},
			} {
				mustAppend(t, e, a.name, AppendRequest{Records: recs(a.body)})
			}
			bad := walRunOf(t, e, "/bad", 1)
			before := walRunOf(t, e, "/bad", 0)
			dropCache(e)
			damageRun(t, st, bad, tt.truncate)

			if err := e.Compact(ctx); err != nil {
				t.Fatalf("compaction failed over one damaged entry: %v", err)
			}
			// Later compactions know the damage: they read nothing of
			// the stream back from there on.
			gets := countWALGets(st)
			for i := range 2 {
				if err := e.Compact(ctx); err != nil {
					t.Fatalf("compaction %d after the damage: %v", i+2, err)
				}
			}
			if got := gets.take(); len(got) != 0 {
				t.Errorf("compactions after the damage read WAL objects back: %v", got)
			}
			st.SetFail(nil)
			if got := readAll(t, e, "/good"); !slices.Equal(got, []string{"g0", "g1", "g2"}) {
				t.Fatalf("/good reads %q", got)
			}
			if n := len(walRunsOf(e, "/good")); n != 0 {
				t.Errorf("/good still has %d runs in the WAL", n)
			}
			// /bad was compacted up to the damaged object, not past it.
			if runs := walRunsOf(e, "/bad"); len(runs) != 2 || runs[0].key != bad.key {
				t.Errorf("/bad's WAL runs after the compactions: %v; want the damaged one and the one after it", runs)
			}
			// A read stops short of the damage, and the next one fails.
			if got := readAll(t, e, "/bad"); !slices.Equal(got, []string{"b0"}) {
				t.Fatalf("a read of /bad from 0 returned %q; want the record before the damage", got)
			}
			_, err := e.Read(ctx, "/bad", ReadRequest{Seq: 1})
			if !errors.Is(err, ErrDamaged) || !errors.Is(err, segment.ErrCorrupt) || !strings.Contains(err.Error(), bad.key) {
				t.Fatalf("a read of /bad from the damage answered %v; want ErrDamaged naming %s", err, bad.key)
			}
			res, err := e.Read(ctx, "/bad", ReadRequest{Seq: 2})
			if err != nil || len(res.Records) != 1 || string(res.Records[0].Body) != "b2" {
				t.Fatalf("a read of /bad after the damage: %v, %v", res.Records, err)
			}
			// The WAL before the damaged object is retired; it stays.
			wal := st.Keys("wal/")
			if len(wal) == 0 || wal[0] != bad.key {
				t.Fatalf("WAL objects left: %v; want them to start at the damaged one %s", wal, bad.key)
			}
			if _, _, err := st.Get(ctx, before.key, 0, -1); !errors.Is(err, segment.ErrNotFound) {
				t.Errorf("%s, before the damage, was not retired: %v", before.key, err)
			}
			if n := logs.FilterMessageSnippet("damaged").Len(); n != 1 {
				t.Errorf("%d error logs of the damage over 3 compactions; want 1: %v", n, logs.All())
			}
			if got := e.Stats().DamagedWALEntries; got != 1 {
				t.Errorf("DamagedWALEntries = %d; want 1", got)
			}
		})
	}
}

// walRunsOf returns the runs of the stream called name that are in the WAL.
func walRunsOf(e *Engine, name string) []walRun {
	e.mu.RLock()
	s := e.streams[name]
	e.mu.RUnlock()
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []walRun
	for _, r := range s.runs {
		if r.snap == nil {
			out = append(out, r)
		}
	}
	return out
}

// A transient error reading a WAL object back is no damage: the
// compaction fails and is tried again, and nothing is held back for good.
func TestWALReadErrorIsNotDamage(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	setPackBelow(e, 0)
	if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	mustAppend(t, e, "/s", AppendRequest{Records: recs("a")})
	dropCache(e)
	var failing atomic.Bool // read by the collector's goroutine too
	failing.Store(true)
	st.SetFail(func(op, key string) error {
		if failing.Load() && op == "GET" && strings.HasPrefix(key, "wal/") {
			return errors.New("503 slow down")
		}
		return nil
	})
	if err := e.Compact(ctx); err == nil {
		t.Fatal("a compaction whose WAL read failed succeeded")
	}
	failing.Store(false)
	mustCompact(t, e)
	if n := len(walRunsOf(e, "/s")); n != 0 {
		t.Fatalf("/s still has %d WAL runs after the retry", n)
	}
	if got := e.Stats().DamagedWALEntries; got != 0 {
		t.Errorf("DamagedWALEntries = %d after a transient error; want 0", got)
	}
	if got := readAll(t, e, "/s"); !slices.Equal(got, []string{"a"}) {
		t.Fatalf("/s reads %q", got)
	}
}

// A restart that finds a damaged WAL object to replay refuses to start and
// says which object: it cannot tell whose acknowledged changes the damaged
// entries held, and going on without them would drop them silently.
func TestReplayRefusesADamagedWALObject(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	mustAppend(t, e, "/s", AppendRequest{Records: recs("a")})
	r := walRunOf(t, e, "/s", 0)
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	damageRun(t, st, r, false)
	e2 := New(st, testConfig(Config{}), nil)
	err := e2.Start(ctx)
	if err == nil {
		_ = e2.Close(ctx)
		t.Fatal("a start replayed a damaged WAL object")
	}
	if !errors.Is(err, ErrDamaged) || !strings.Contains(err.Error(), r.key) {
		t.Fatalf("start: %v; want ErrDamaged naming %s", err, r.key)
	}
	// The object is left as it is, for an operator to restore.
	if _, _, err := st.Get(ctx, r.key, 0, -1); err != nil {
		t.Fatalf("the damaged object: %v", err)
	}
}

// Runs read back in one range are checked one by one: a damaged entry
// costs its own run only, not its neighbours in the range, and only when
// the caller takes damage (compaction's read of the WAL); a pack's reader
// fails as before.
func TestReadRunsConfinesDamageToItsRun(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	var ents []*segment.Entry
	for i, name := range []string{"/a", "/b", "/c"} {
		ents = append(ents, &segment.Entry{StreamID: name, Name: name, FirstSeq: uint64(i),
			Records: []segment.Record{{Body: []byte("body of " + name)}}})
	}
	const key = "wal/00000000000000ff/0000000000000000"
	data, spans := segment.EncodeWAL(0xff, 0, ents)
	runs := make([]walRun, len(ents))
	for i, ent := range ents {
		runs[i] = walRun{key: key, span: spans[i], ch: change{First: ent.FirstSeq, End: ent.EndSeq()}}
	}
	tests := []struct {
		name   string
		damage func([]byte) []byte
	}{
		{name: "payload", damage: func(b []byte) []byte { b[spans[1].Off+spans[1].Len-1] ^= 1; return b }},
		{name: "length", damage: func(b []byte) []byte { b[spans[1].Off+3] ^= 1; return b }},
		{name: "checksum", damage: func(b []byte) []byte { b[spans[1].Off+4] ^= 1; return b }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := st.Put(ctx, key, tt.damage(slices.Clone(data)), segment.PutOptions{}); err != nil {
				t.Fatal(err)
			}
			var damaged []walRun
			got, err := e.readRuns(ctx, runs, func(r walRun, err error) {
				if !isDamage(err) {
					t.Errorf("damage reported as %v", err)
				}
				damaged = append(damaged, r)
			})
			if err != nil {
				t.Fatal(err)
			}
			if len(damaged) != 1 || damaged[0].span != spans[1] {
				t.Fatalf("damaged runs %v; want the second only", damaged)
			}
			for _, i := range []int{0, 2} {
				recs := got[runCacheKey(key, spans[i])]
				if len(recs) != 1 || string(recs[0].Body) != "body of "+ents[i].Name {
					t.Errorf("run %d read back as %v", i, recs)
				}
			}
			if _, err := e.readRuns(ctx, runs, nil); !isDamage(err) {
				t.Errorf("readRuns without a damage handler: %v; want the corruption", err)
			}
		})
	}
}

// badAndGood creates the streams /bad and /good and appends to them in
// turn, b0 b1 b2 to /bad and g0 g1 to /good, so that their entries share
// WAL objects; it returns the WAL run of /bad's b1, the one to damage.
func badAndGood(t *testing.T, e *Engine) walRun {
	t.Helper()
	ctx := context.Background()
	for _, name := range []string{"/bad", "/good"} {
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
	}
	for _, a := range []struct{ name, body string }{
		{"/good", "g0"}, {"/bad", "b0"}, {"/bad", "b1"}, {"/good", "g1"}, {"/bad", "b2"},
	} {
		mustAppend(t, e, a.name, AppendRequest{Records: recs(a.body)})
	}
	return walRunOf(t, e, "/bad", 1)
}

// Deleting the stream whose WAL entry is damaged lets the WAL be retired
// past the damaged object: the delete takes the stream, and its mark, out
// of the streams a compaction holds the WAL back for. The next compaction
// retires the object, the other streams are untouched, and a restart,
// with no damaged object left to replay, starts.
func TestDeletingTheDamagedStreamReleasesTheWAL(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	bad := badAndGood(t, e)
	dropCache(e)
	damageRun(t, st, bad, false)
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if wal := st.Keys("wal/"); len(wal) == 0 || wal[0] != bad.key {
		t.Fatalf("WAL objects after the damage: %v; want them to start at %s", wal, bad.key)
	}

	if err := e.Delete(ctx, "/bad"); err != nil {
		t.Fatalf("delete the damaged stream: %v", err)
	}
	mustAppend(t, e, "/good", AppendRequest{Records: recs("g2")})
	if err := e.Compact(ctx); err != nil {
		t.Fatalf("compaction after the delete: %v", err)
	}
	if wal := st.Keys("wal/"); slices.Contains(wal, bad.key) {
		t.Fatalf("WAL objects after the delete and a compaction: %v; the damaged %s is still kept", wal, bad.key)
	}
	if got := readAll(t, e, "/good"); !slices.Equal(got, []string{"g0", "g1", "g2"}) {
		t.Fatalf("/good reads %q", got)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}

	e2 := startEngine(t, st, Config{})
	if got := readAll(t, e2, "/good"); !slices.Equal(got, []string{"g0", "g1", "g2"}) {
		t.Fatalf("/good after the restart reads %q", got)
	}
	if _, err := e2.Read(ctx, "/bad", ReadRequest{}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("/bad after the restart: %v; want ErrNotFound", err)
	}
}

// A damaged WAL object restored in place is found by a compaction a
// compaction interval after the damage was last seen, without a restart:
// the stream is compacted past it and the WAL retired past it. Until then
// the damaged entry is read again at most once an interval (a compaction
// sooner reads nothing back), and a retry that finds it still damaged
// keeps the mark. The mark used to last until a restart.
func TestRestoredWALObjectIsPickedUpAgain(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	core, logs := observer.New(zap.InfoLevel)
	e := New(st, testConfig(Config{}), zap.New(core))
	if err := e.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close(context.Background()) })
	bad := badAndGood(t, e)
	original, _, err := st.Get(ctx, bad.key, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	original = slices.Clone(original)
	dropCache(e)
	damageRun(t, st, bad, false)
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	// intervalPassed makes the last look at the damage a compaction
	// interval old.
	intervalPassed := func() {
		t.Helper()
		e.mu.RLock()
		s := e.streams["/bad"]
		e.mu.RUnlock()
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.damagedAt == nil {
			t.Fatal("/bad is not marked damaged")
		}
		s.damageChecked = s.damageChecked.Add(-e.config().CompactInterval)
	}
	compactGets := func(what string) map[string]int {
		t.Helper()
		gets := countWALGets(st)
		if err := e.Compact(ctx); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		got := gets.take()
		st.SetFail(nil)
		return got
	}

	if got := compactGets("a compaction within the interval"); len(got) != 0 {
		t.Errorf("a compaction within the interval read WAL objects back: %v", got)
	}
	intervalPassed()
	if got := compactGets("a retry, still damaged"); len(got) != 1 || got[bad.key] != 1 {
		t.Errorf("a compaction an interval later read back %v; want one GET of %s", got, bad.key)
	}
	if got := compactGets("a compaction right after the retry"); len(got) != 0 {
		t.Errorf("a compaction right after a retry read WAL objects back: %v", got)
	}
	if wal := st.Keys("wal/"); len(wal) == 0 || wal[0] != bad.key {
		t.Fatalf("WAL objects with the object still damaged: %v; want them to start at %s", wal, bad.key)
	}

	if _, err := st.Put(ctx, bad.key, original, segment.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	intervalPassed()
	if err := e.Compact(ctx); err != nil {
		t.Fatalf("the compaction after the restore: %v", err)
	}
	if runs := walRunsOf(e, "/bad"); len(runs) != 0 {
		t.Errorf("/bad still has %d runs in the WAL after the restore: %v", len(runs), runs)
	}
	if wal := st.Keys("wal/"); slices.Contains(wal, bad.key) {
		t.Errorf("WAL objects after the restore: %v; the restored %s is still kept", wal, bad.key)
	}
	if got := readAll(t, e, "/bad"); !slices.Equal(got, []string{"b0", "b1", "b2"}) {
		t.Fatalf("/bad after the restore reads %q", got)
	}
	if n := logs.FilterMessageSnippet("reads back clean").Len(); n != 1 {
		t.Errorf("%d logs of the restore; want 1", n)
	}
}

// A damaged data object, a data object gone from where the stream's
// records must be, or damaged metadata is ErrDamaged naming the object,
// logged and counted once however many reads meet it, and a read from
// before the damage still gets the records there. Before, each was a plain
// segment.ErrCorrupt, which the handlers answered with a bare 500 and an
// error log line per request.
func TestDamagedObjectsAreErrDamaged(t *testing.T) {
	tests := []struct {
		name   string
		damage func(t *testing.T, st *memstore.Store) string // returns the key named
	}{
		{"data object bit flip", func(t *testing.T, st *memstore.Store) string {
			key := st.Keys("data/")[1]
			data, _, err := st.Get(context.Background(), key, 0, -1)
			if err != nil {
				t.Fatal(err)
			}
			data = slices.Clone(data)
			data[len(data)-2] ^= 0x40
			if _, err := st.Put(context.Background(), key, data, segment.PutOptions{}); err != nil {
				t.Fatal(err)
			}
			return key
		}},
		{"another data object's bytes under the key", func(t *testing.T, st *memstore.Store) string {
			// A sound object restored to the wrong name: its checksum
			// holds, its records are not the ones the name says.
			keys := st.Keys("data/")
			data, _, err := st.Get(context.Background(), keys[0], 0, -1)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := st.Put(context.Background(), keys[1], data, segment.PutOptions{}); err != nil {
				t.Fatal(err)
			}
			return keys[1]
		}},
		{"data object gone", func(t *testing.T, st *memstore.Store) string {
			key := st.Keys("data/")[1]
			if err := st.Delete(context.Background(), []string{key}); err != nil {
				t.Fatal(err)
			}
			return "data/"
		}},
		{"metadata", func(t *testing.T, st *memstore.Store) string {
			if _, err := st.Put(context.Background(), metaKey("/s"), []byte(`{"version":1,`), segment.PutOptions{}); err != nil {
				t.Fatal(err)
			}
			return metaKey("/s")
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			e := New(st, testConfig(Config{}), zap.NewNop())
			if err := e.Start(ctx); err != nil {
				t.Fatal(err)
			}
			setPackBelow(e, 0)   // every compaction folds into data objects
			setMergeBelow(e, -1) // of their own
			if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
				t.Fatal(err)
			}
			for _, body := range []string{"r0", "r1"} {
				mustAppend(t, e, "/s", AppendRequest{Records: recs(body)})
				if err := e.Compact(ctx); err != nil {
					t.Fatal(err)
				}
			}
			if keys := st.Keys("data/"); len(keys) != 2 {
				t.Fatalf("data objects %v; want one per compacted append", keys)
			}
			if err := e.Close(ctx); err != nil {
				t.Fatal(err)
			}
			key := tt.damage(t, st)

			core, logs := observer.New(zap.ErrorLevel)
			e = New(st, testConfig(Config{}), zap.New(core))
			if err := e.Start(ctx); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = e.Close(context.Background()) })
			for range 3 {
				_, err := e.Read(ctx, "/s", ReadRequest{Seq: 1})
				if !errors.Is(err, ErrDamaged) || !errors.Is(err, segment.ErrCorrupt) || !strings.Contains(err.Error(), key) {
					t.Fatalf("a read of the damage answered %v; want ErrDamaged naming %s", err, key)
				}
			}
			if key != metaKey("/s") {
				if got := readAll(t, e, "/s"); !slices.Equal(got, []string{"r0"}) {
					t.Errorf("a read from the start returned %q; want the record before the damage", got)
				}
			}
			if n := logs.FilterMessageSnippet("damaged").Len(); n != 1 {
				t.Errorf("%d error logs of the damage; want 1: %v", n, logs.All())
			}
			if n := logs.Len(); n != 1 {
				t.Errorf("%d error logs; want 1: %v", n, logs.All())
			}
			if got := e.Stats().DamagedObjects; got != 1 {
				t.Errorf("DamagedObjects = %d; want 1", got)
			}
		})
	}
}

// oneHeldGet holds the first GET of a key under prefix until open is
// closed, telling started when it does.
type oneHeldGet struct {
	*memstore.Store
	prefix  string
	held    atomic.Bool
	started chan struct{}
	open    chan struct{}
}

func (o *oneHeldGet) Get(ctx context.Context, key string, off, n int64) ([]byte, string, error) {
	if strings.HasPrefix(key, o.prefix) && o.held.CompareAndSwap(false, true) {
		close(o.started)
		<-o.open
	}
	return o.Store.Get(ctx, key, off, n)
}

// A data object that a trim removed while a read of it was under way is
// no damage: the read is answered as trimmed, and nothing is logged or
// counted as damaged.
func TestObjectTrimmedDuringAReadIsNotDamage(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := New(st, testConfig(Config{}), zap.NewNop())
	if err := e.Start(ctx); err != nil {
		t.Fatal(err)
	}
	setPackBelow(e, 0)
	if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	for _, body := range []string{"r0", "r1", "r2"} {
		mustAppend(t, e, "/s", AppendRequest{Records: recs(body)})
		if err := e.Compact(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}

	held := &oneHeldGet{Store: st, prefix: "data/", started: make(chan struct{}), open: make(chan struct{})}
	core, logs := observer.New(zap.ErrorLevel)
	e = New(held, testConfig(Config{}), zap.New(core))
	if err := e.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close(context.Background()) })
	setPackBelow(e, 0)
	read := make(chan error, 1)
	go func() {
		res, err := e.Read(ctx, "/s", ReadRequest{Seq: 0})
		res.Release()
		read <- err
	}()
	<-held.started
	if _, err := e.Trim(ctx, "/s", 2); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := e.Compact(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if keys := st.Keys("data/"); len(keys) != 1 {
		t.Fatalf("data objects after the trim: %v; want the last one only", keys)
	}
	close(held.open)
	var trimmed *TrimmedError
	if err := <-read; !errors.As(err, &trimmed) {
		t.Errorf("the read the trim overtook: %v; want a TrimmedError", err)
	}
	if n := logs.FilterMessageSnippet("damaged").Len(); n != 0 {
		t.Errorf("%d damage logs for an object a trim removed: %v", n, logs.All())
	}
	if got := e.Stats().DamagedObjects; got != 0 {
		t.Errorf("DamagedObjects = %d; want 0", got)
	}
}

// A replay that meets damaged metadata of a stream with WAL entries
// fails the start naming the object, and says it is damaged once: the
// error said "stored records are damaged" twice, the replay's wrapping
// and the metadata's own.
func TestReplayOfDamagedMetadataSaysItOnce(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := New(st, testConfig(Config{}), zap.NewNop())
	if err := e.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	mustAppend(t, e, "/s", AppendRequest{Records: recs("a")})
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Put(ctx, metaKey("/s"), []byte(`{"version":1,`), segment.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	e = New(st, testConfig(Config{}), zap.NewNop())
	err := e.Start(ctx)
	t.Cleanup(func() { _ = e.Close(context.Background()) })
	if !errors.Is(err, ErrDamaged) || !strings.Contains(err.Error(), metaKey("/s")) {
		t.Fatalf("start over damaged metadata: %v; want ErrDamaged naming %s", err, metaKey("/s"))
	}
	if n := strings.Count(err.Error(), ErrDamaged.Error()); n != 1 {
		t.Errorf("the error says %q %d times: %v", ErrDamaged.Error(), n, err)
	}
}
