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
	"github.com/picomq/caddy-picomq/segment"
)

// lateDeletes is a store that keeps a copy of every delete of a metadata
// object (the swap for a grave, or a plain delete) and, when creates is
// set, of every create-only write of one, so that a test can send them
// again later: requests held up on their way that land after their
// retries were answered.
type lateDeletes struct {
	*memstore.Store
	creates bool
	mu      sync.Mutex
	copies  []func(context.Context) error
}

func (l *lateDeletes) keep(f func(context.Context) error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.copies = append(l.copies, f)
}

func (l *lateDeletes) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	if isMetaKey(key) && (opts.IfMatch != "" && isGrave(data) || opts.IfNoneMatch && l.creates) {
		data := slices.Clone(data)
		l.keep(func(ctx context.Context) error {
			_, err := l.Store.Put(ctx, key, data, opts)
			return err
		})
	}
	return l.Store.Put(ctx, key, data, opts)
}

func (l *lateDeletes) Delete(ctx context.Context, keys []string) error {
	if slices.ContainsFunc(keys, isMetaKey) {
		keys := slices.Clone(keys)
		l.keep(func(ctx context.Context) error { return l.Store.Delete(ctx, keys) })
	}
	return l.Store.Delete(ctx, keys)
}

func (l *lateDeletes) DeleteIfMatch(ctx context.Context, key, etag string) error {
	if isMetaKey(key) {
		l.keep(func(ctx context.Context) error { return l.Store.DeleteIfMatch(ctx, key, etag) })
	}
	return l.Store.DeleteIfMatch(ctx, key, etag)
}

// landLate sends every delete kept so far again and reports how many
// the store refused.
func (l *lateDeletes) landLate(ctx context.Context) (refused int) {
	l.mu.Lock()
	copies := l.copies
	l.copies = nil
	l.mu.Unlock()
	for _, f := range copies {
		if errors.Is(f(ctx), segment.ErrPreconditionFailed) {
			refused++
		}
	}
	return refused
}

func isMetaKey(k string) bool {
	return strings.HasPrefix(k, metaPrefix) && strings.HasSuffix(k, metaSuffix)
}

// A stream's delete that lands a second time, after the name was created
// again, must not delete the new stream: with an unconditional DELETE its
// metadata was gone, and after a restart the new stream and its
// acknowledged records with it. (The delete is now a swap for a grave,
// conditional on the version it replaces.)
func TestLateDeleteSparesTheNextStream(t *testing.T) {
	tests := []struct {
		name string
		// before runs between the first stream's create and its delete.
		before func(t *testing.T, e *Engine)
	}{
		{"as created", func(t *testing.T, e *Engine) {}},
		{"after a checkpoint", func(t *testing.T, e *Engine) {
			mustAppend(t, e, "/s", AppendRequest{Records: recs("old2")})
			before := metaVersion(t, e, "/s")
			if err := e.Compact(context.Background()); err != nil {
				t.Fatalf("compact: %v", err)
			}
			if metaVersion(t, e, "/s") == before {
				t.Fatal("the compaction wrote no checkpoint")
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := &lateDeletes{Store: memstore.New()}
			// No packs: a compaction checkpoints into the metadata.
			e := startEngine(t, st, Config{PackBelow: -1})
			if _, _, err := e.Create(ctx, "/s", CreateRequest{Records: recs("old")}); err != nil {
				t.Fatal(err)
			}
			tc.before(t, e)
			if err := e.Delete(ctx, "/s"); err != nil {
				t.Fatalf("delete: %v", err)
			}
			if _, _, err := e.Create(ctx, "/s", CreateRequest{Records: recs("new")}); err != nil {
				t.Fatalf("create again: %v", err)
			}
			mustAppend(t, e, "/s", AppendRequest{Records: recs("more")})
			if refused := st.landLate(ctx); refused != 1 {
				t.Errorf("the store refused %d late deletes, want 1", refused)
			}
			if err := e.Close(ctx); err != nil {
				t.Fatal(err)
			}
			e2 := startEngine(t, st, Config{})
			if got := readAll(t, e2, "/s"); !slices.Equal(got, []string{"new", "more"}) {
				t.Fatalf("after a restart /s reads %q, want [new more]", got)
			}
		})
	}
}

// A metadata version this process wrote without hearing back, found by the
// delete's condition, is still the stream's own: the delete removes it.
func TestDeleteRemovesOwnUnconfirmedVersion(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/s", CreateRequest{Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	// The version the engine knows is replaced behind its back by one
	// of the same stream, as a write reported failed that landed late.
	m := storedMeta(t, st, "/s")
	m.CreatedAt++
	if _, err := st.Put(ctx, metaKey("/s"), encodeMeta(m), segment.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := e.Delete(ctx, "/s"); err != nil {
		t.Fatalf("delete: %v", err)
	}
	if data, _, err := st.Get(ctx, metaKey("/s"), 0, -1); err != nil || !isGrave(data) {
		t.Fatalf("the key after the delete holds %q, %v; want a grave", data, err)
	}
	if _, err := e.Read(ctx, "/s", ReadRequest{}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("read after the delete: %v, want ErrNotFound", err)
	}
}

// A node whose lease lapsed may have lost the storage to another, which
// may have written the stream since: its delete must not reach the
// metadata.
func TestLapsedLeaseDeletesNothing(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var cutOff atomic.Bool
	st.SetFail(func(op, key string) error {
		if cutOff.Load() && key == "lease" {
			return errors.New("partitioned")
		}
		return nil
	})
	e := startEngine(t, st, Config{NodeID: "node-a", LeaseTTL: 600 * time.Millisecond})
	if _, _, err := e.Create(ctx, "/s", CreateRequest{Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	cutOff.Store(true)
	time.Sleep(700 * time.Millisecond) // the lease lapses
	if err := e.Delete(ctx, "/s"); err == nil {
		t.Error("a delete on a lapsed lease reported success")
	}
	if data, _, err := st.Get(ctx, metaKey("/s"), 0, -1); err != nil || isGrave(data) {
		t.Errorf("metadata after the refused delete: %q, %v", data, err)
	}
	cutOff.Store(false)
	b := startEngine(t, st, Config{NodeID: "node-b"})
	if got := readAll(t, b, "/s"); !slices.Equal(got, []string{"a"}) {
		t.Fatalf("the next owner reads /s as %q, want [a]", got)
	}
}

func metaVersion(t *testing.T, e *Engine, name string) string {
	t.Helper()
	_, etag, err := e.store.Get(context.Background(), metaKey(name), 0, -1)
	if err != nil {
		t.Fatalf("metadata of %s: %v", name, err)
	}
	return etag
}

// A create's write that lands a second time, after the stream was deleted
// (its first attempt held up on the way, its retry answered first), must
// find the grave there and change nothing: a create-only write used to
// find the key free and bring the deleted stream back. The collector
// indexes the grave by when it is due and removes it then, after a
// restart too.
func TestLateCreateSparesTheDeletedName(t *testing.T) {
	const graveTime = time.Second
	for _, records := range []bool{false, true} {
		t.Run(fmt.Sprintf("records %v", records), func(t *testing.T) {
			ctx := context.Background()
			st := &lateDeletes{Store: memstore.New(), creates: true}
			e := startEngine(t, st, Config{GraveTime: graveTime})
			req := CreateRequest{ContentType: "text/plain"}
			if records {
				req.Records = recs("old")
			}
			if _, _, err := e.Create(ctx, "/s", req); err != nil {
				t.Fatal(err)
			}
			if err := e.Delete(ctx, "/s"); err != nil {
				t.Fatalf("delete: %v", err)
			}
			if refused := st.landLate(ctx); refused != 2 {
				t.Errorf("the store refused %d late writes, want 2 (the create's and the delete's)", refused)
			}
			if _, err := e.Head(ctx, "/s"); !errors.Is(err, ErrNotFound) {
				t.Fatalf("head after the late create landed: %v, want ErrNotFound", err)
			}
			if err := e.collectGarbage(ctx); err != nil {
				t.Fatal(err)
			}
			if data, _, err := st.Get(ctx, metaKey("/s"), 0, -1); err != nil || !isGrave(data) {
				t.Fatalf("before its time the key holds %q, %v; want the grave", data, err)
			}
			if got := st.Keys("gc/"); len(got) != 0 {
				t.Fatalf("tombstones %q after a collection; want them worked off", got)
			}
			if got := st.Keys(gravesPrefix); len(got) != 1 {
				t.Fatalf("grave index %q; want the grave's entry", got)
			}
			if err := e.Close(ctx); err != nil {
				t.Fatal(err)
			}
			e2 := startEngine(t, st.Store, Config{GraveTime: graveTime})
			if _, err := e2.Head(ctx, "/s"); !errors.Is(err, ErrNotFound) {
				t.Fatalf("after a restart: %v, want ErrNotFound", err)
			}
			time.Sleep(graveTime)
			if err := e2.collectGarbage(ctx); err != nil {
				t.Fatal(err)
			}
			if keys := st.Keys(""); slices.ContainsFunc(keys, func(k string) bool {
				return isMetaKey(k) || strings.HasPrefix(k, "gc/") || strings.HasPrefix(k, "data/") || strings.HasPrefix(k, gravesPrefix)
			}) {
				t.Fatalf("left after the grave's time and a collection: %q", keys)
			}
		})
	}
}

// streamKeys returns the metadata keys under prefix that hold a stream's
// metadata, leaving graves out.
func streamKeys(t *testing.T, st *memstore.Store, prefix string) []string {
	t.Helper()
	var out []string
	for _, k := range st.Keys(prefix) {
		data, _, err := st.Get(context.Background(), k, 0, -1)
		if errors.Is(err, segment.ErrNotFound) {
			continue // removed since the listing
		}
		if err != nil {
			t.Fatalf("read %s: %v", k, err)
		}
		if !isGrave(data) {
			out = append(out, k)
		}
	}
	return out
}

// TestCollectorSkipsTombstoneGoneSinceListing: a tombstone listed by the
// collector and gone when it reads it was judged by another collector
// (found stale, say: its stream's delete failed). The data must stay:
// taking the missing tombstone for "collect" deleted a live stream's data
// objects when the test's collection met the engine's own.
func TestCollectorSkipsTombstoneGoneSinceListing(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	// Installed before the engine starts, armed later: its goroutines
	// read the hook.
	var armed atomic.Pointer[string]
	st.SetFail(func(op, key string) error {
		if k := armed.Load(); op == "GET" && k != nil && key == *k && armed.CompareAndSwap(k, nil) {
			_ = st.Delete(ctx, []string{key})
		}
		return nil
	})
	e := startEngine(t, st, Config{PackBelow: -1})
	if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain", Records: recs("a", "b")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	info, err := e.Head(ctx, "/s")
	if err != nil {
		t.Fatal(err)
	}
	data := st.Keys("data/" + info.ID + "/")
	if len(data) == 0 {
		t.Fatal("compaction wrote no data object: the test checks nothing")
	}
	// A delete that failed after its tombstone, which another collector
	// removes between this one's listing and its read.
	if _, err := st.Put(ctx, gcKey(info.ID), []byte("/s"), segment.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	tomb := gcKey(info.ID)
	armed.Store(&tomb)
	if err := e.collectGarbage(ctx); err != nil {
		t.Fatal(err)
	}
	if armed.Load() != nil {
		t.Fatal("the collector never read the tombstone")
	}
	if got := st.Keys("data/" + info.ID + "/"); !slices.Equal(got, data) {
		t.Fatalf("data objects of the live stream after the collection: %q, want %q", got, data)
	}
	if got := fmt.Sprint(readAll(t, startEngine(t, st, Config{CacheBytes: 1}), "/s")); got != "[a b]" {
		t.Fatalf("after a restart the stream reads %s", got)
	}
}

// A compaction's PUT of a data object that its client gave up on (held up
// on its way, so the fold failed) can land after the stream was deleted
// and the collector removed its data: a S3 request is accepted up to 15
// minutes after it was signed. Nothing listed data/<id>/ again, so the
// object stayed for good. The collector now removes the id's data and
// blobs again when it removes the grave, grave_time later, past any
// request of the stream still on its way. Writes of the data of a stream
// being deleted are otherwise ordered before the delete's swap (the fold
// holds the stream's metadata lock), so only late ones matter.
func TestLateDataPUTOfADeletedStreamIsCollected(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var mu sync.Mutex
	var lateKey string
	failData := true
	st.SetFail(func(op, key string) error {
		mu.Lock()
		defer mu.Unlock()
		if failData && op == "PUT" && strings.HasPrefix(key, "data/") {
			lateKey = key
			return errors.New("timed out; the request is still on its way")
		}
		return nil
	})
	e := startEngine(t, st, Config{GraveTime: 200 * time.Millisecond})
	if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain", Records: recs("a", "b")}); err != nil {
		t.Fatal(err)
	}
	setPackBelow(e, -1) // folded into a data object of its own
	if err := e.Compact(ctx); err == nil {
		t.Fatal("the compaction succeeded though its data PUT failed")
	}
	mu.Lock()
	failData = false
	key := lateKey
	mu.Unlock()
	if key == "" {
		t.Fatal("the compaction wrote no data object")
	}
	lateBody := segment.EncodeData([]Record{{Seq: 0, Body: []byte("a")}, {Seq: 1, Body: []byte("b")}})
	if err := e.Delete(ctx, "/s"); err != nil {
		t.Fatal(err)
	}
	if err := e.collectGarbage(ctx); err != nil {
		t.Fatal(err)
	}
	// The held-up PUT lands now, after the collector removed the data.
	if _, err := st.Put(ctx, key, lateBody, segment.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(st.Keys("data/")) > 0 || len(st.Keys("graves/")) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("data %v and grave index %v left after the grave was due", st.Keys("data/"), st.Keys("graves/"))
		}
		if err := e.collectGarbage(ctx); err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// A delete that arrives while a fold of the stream is writing its data
// waits for the fold (which holds the stream's metadata lock across its
// PUTs and its checkpoint) before it swaps the metadata for a grave, so
// the collector's sweep, which follows the swap, finds every object the
// fold wrote: nothing of the deleted stream is left in the bucket.
func TestDeleteRacingAFoldLeavesNothing(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	st.SetFail(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, "data/") {
			once.Do(func() {
				close(held)
				<-release
			})
		}
		return nil
	})
	e := startEngine(t, st, Config{})
	// Before the engine closes, on any way out: a held PUT holds it up.
	unblock := sync.OnceFunc(func() { close(release) })
	t.Cleanup(unblock)
	if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain", Records: recs("a", "b")}); err != nil {
		t.Fatal(err)
	}
	setPackBelow(e, -1)
	compacted := make(chan error, 1)
	go func() { compacted <- e.Compact(ctx) }()
	<-held
	// What orders the delete after the fold: the fold holds the stream's
	// metadata lock while its PUT is on its way, and the delete's swap
	// takes it.
	s, err := e.stream(ctx, "/s")
	if err != nil {
		t.Fatal(err)
	}
	if s.metaMu.TryLock() {
		s.metaMu.Unlock()
		t.Fatal("the fold's data PUT is on its way without the stream's metadata lock held")
	}
	deleted := make(chan error, 1)
	go func() { deleted <- e.Delete(ctx, "/s") }()
	unblock()
	if err := <-compacted; err != nil {
		t.Fatalf("compact: %v", err)
	}
	if err := <-deleted; err != nil {
		t.Fatalf("delete: %v", err)
	}
	if err := e.collectGarbage(ctx); err != nil {
		t.Fatal(err)
	}
	if left := append(st.Keys("data/"), st.Keys("blob/")...); len(left) > 0 {
		t.Fatalf("the deleted stream's objects are left: %v", left)
	}
}

// graveAnswerLost is a store whose grave PUTs of one metadata key land but
// answer with an error whose outcome is unknown (the answer lost), while
// its reads of that key fail, as in a short outage of the bucket.
type graveAnswerLost struct {
	segment.Store
	key  string
	lose atomic.Bool
}

func (s *graveAnswerLost) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	etag, err := s.Store.Put(ctx, key, data, opts)
	if err == nil && key == s.key && opts.IfMatch != "" && isGrave(data) && s.lose.Load() {
		return "", fmt.Errorf("injected: the answer was lost: %w", segment.ErrUnknownOutcome)
	}
	return etag, err
}

func (s *graveAnswerLost) Get(ctx context.Context, key string, offset, length int64) ([]byte, string, error) {
	if key == s.key && s.lose.Load() {
		return nil, "", errors.New("injected: the bucket does not answer")
	}
	return s.Store.Get(ctx, key, offset, length)
}

// TestDeleteOfUnknownOutcome: a delete whose grave landed while its answer
// was lost, and whose read-back failed, was answered as a plain failure
// with the stream left live in memory: appends were then acknowledged on
// it, compaction found the grave and kept quiet, the collector took the
// data, and after a restart the stream, with the appends, was gone. The
// delete now says that it may have happened, and the next lookup reads the
// bucket to tell: here, that the stream is deleted.
func TestDeleteOfUnknownOutcome(t *testing.T) {
	ctx := context.Background()
	st := &graveAnswerLost{Store: memstore.New(), key: metaKey("/s")}
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Append(ctx, "/s", AppendRequest{Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	st.lose.Store(true)
	err := e.Delete(ctx, "/s")
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, ErrUnconfirmed) {
		t.Fatalf("delete whose grave landed unconfirmed: %v, want ErrUnavailable with ErrUnconfirmed", err)
	}
	// While the bucket cannot say, nothing is acknowledged on the stream.
	if _, err := e.Append(ctx, "/s", AppendRequest{Records: recs("b")}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("append while the delete's fate is unknown: %v, want ErrUnavailable", err)
	}
	st.lose.Store(false)
	if _, err := e.Append(ctx, "/s", AppendRequest{Records: recs("c")}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("append once the bucket shows the grave: %v, want ErrNotFound", err)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	again := startEngine(t, st, Config{})
	if _, err := again.Head(ctx, "/s"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("after a restart: %v, want ErrNotFound", err)
	}
}

// TestCreateAfterADeleteOfUnknownOutcome: after a delete whose grave
// landed unconfirmed, a create of the name was judged against the stream
// still in memory: told it exists (200, with the deleted stream's id) or
// that it conflicts (409) while the bucket held the grave, and every
// repeat the same, as a create never asked the bucket. A create now
// settles the delete first: 503 while the bucket cannot say, then a new
// stream.
func TestCreateAfterADeleteOfUnknownOutcome(t *testing.T) {
	for _, ct := range []string{"text/plain", "application/json"} {
		t.Run(ct, func(t *testing.T) {
			ctx := context.Background()
			st := &graveAnswerLost{Store: memstore.New(), key: metaKey("/s")}
			e := startEngine(t, st, Config{})
			old, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := e.Append(ctx, "/s", AppendRequest{Records: recs("a")}); err != nil {
				t.Fatal(err)
			}
			st.lose.Store(true)
			if err := e.Delete(ctx, "/s"); !errors.Is(err, ErrUnconfirmed) {
				t.Fatalf("delete whose grave landed unconfirmed: %v, want ErrUnconfirmed", err)
			}
			if info, created, err := e.Create(ctx, "/s", CreateRequest{ContentType: ct}); !errors.Is(err, ErrUnavailable) {
				t.Fatalf("create while the delete's fate is unknown: %+v created=%v %v, want ErrUnavailable", info, created, err)
			}
			st.lose.Store(false)
			info, created, err := e.Create(ctx, "/s", CreateRequest{ContentType: ct})
			if err != nil || !created || info.ID == old.ID {
				t.Fatalf("create once the bucket shows the grave: %+v created=%v %v, want a new stream", info, created, err)
			}
			res, err := e.Read(ctx, "/s", ReadRequest{})
			if err != nil || len(res.Records) != 0 || res.Info.ContentType != ct {
				t.Fatalf("read of the new stream: %d records, %+v, %v; want none, %s", len(res.Records), res.Info, err, ct)
			}
			res.Release()
		})
	}
}

// TestCompactionFindingAGraveDropsTheStream: a checkpoint that finds the
// stream's metadata replaced by a grave (a delete whose answer this
// process never had, or another writer's) left the handle live: appends
// were acknowledged on a stream the bucket had deleted, and compaction,
// having found nothing to keep, let the WAL that held them go. The stream
// is now dropped from memory as deleted.
func TestCompactionFindingAGraveDropsTheStream(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{PackBelow: -1}) // a fold's checkpoint, not a pack
	if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Append(ctx, "/s", AppendRequest{Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	id := storedMeta(t, st, "/s").ID
	if _, err := st.Put(ctx, metaKey("/s"), encodeGrave(id, time.Now()), segment.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Append(ctx, "/s", AppendRequest{Records: recs("b")}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("append after compaction found the grave: %v, want ErrNotFound", err)
	}
}

// A tombstone the store keeps refusing to collect (a data object under a
// legal hold, say) is passed over until the next pass: the tombstones
// after it are collected, the pass still reports the failure, and the
// next pass collects it once the store lets it. It used to end every pass,
// so every stream deleted after it kept its data for good.
func TestCollectorPassesOverATombstoneItCannotCollect(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{PackBelow: -1})
	ids := map[string]string{}
	for _, name := range []string{"/one", "/two"} {
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain", Records: recs("a", "b")}); err != nil {
			t.Fatal(err)
		}
		info, err := e.Head(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		ids[name] = info.ID
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	// The tombstone listed first is the one the store refuses, from
	// before the deletes: they kick the background collector too.
	held, free := ids["/one"], ids["/two"]
	if gcKey(free) < gcKey(held) {
		held, free = free, held
	}
	st.SetFail(func(op, key string) error {
		if op == "DELETE" && strings.HasPrefix(key, "data/"+held+"/") {
			return errors.New("object under a legal hold")
		}
		return nil
	})
	for _, name := range []string{"/one", "/two"} {
		if len(st.Keys("data/"+ids[name]+"/")) == 0 {
			t.Fatalf("no data object of %s: the test checks nothing", name)
		}
		if err := e.Delete(ctx, name); err != nil {
			t.Fatal(err)
		}
	}
	err := e.collectGarbage(ctx)
	if err == nil || !strings.Contains(err.Error(), "legal hold") {
		t.Fatalf("a pass over a tombstone it could not collect: %v; want its error", err)
	}
	if got := st.Keys("data/" + free + "/"); len(got) != 0 {
		t.Fatalf("data objects %v of the stream deleted after the refused one are left", got)
	}
	if got := st.Keys(gcKey(free)); len(got) != 0 {
		t.Fatalf("its tombstone %v is left", got)
	}
	st.SetFail(nil)
	if err := e.collectGarbage(ctx); err != nil {
		t.Fatalf("the next pass, the store letting it: %v", err)
	}
	if got := st.Keys("data/" + held + "/"); len(got) != 0 {
		t.Fatalf("data objects %v of the refused stream left after the next pass", got)
	}
}

// A collector pass works off several tombstones at once: one at a time,
// at some seven requests each, a bucket 25 ms away collected a few deleted
// streams a second.
func TestCollectorWorksOffTombstonesInParallel(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{PackBelow: -1})
	const streams = 6
	for i := range streams {
		name := fmt.Sprintf("/par/%d", i)
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain", Records: recs("a")}); err != nil {
			t.Fatal(err)
		}
	}
	mustCompact(t, e)
	var inFlight, most atomic.Int64
	st.SetFail(func(op, key string) error {
		if op == "DELETE" && strings.HasPrefix(key, "data/") {
			n := inFlight.Add(1)
			for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
			}
			time.Sleep(50 * time.Millisecond)
			inFlight.Add(-1)
		}
		return nil
	})
	for i := range streams {
		if err := e.Delete(ctx, fmt.Sprintf("/par/%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.collectGarbage(ctx); err != nil {
		t.Fatal(err)
	}
	if got := st.Keys("data/"); len(got) != 0 {
		t.Fatalf("data objects left after the pass: %v", got)
	}
	if m := most.Load(); m < 2 {
		t.Fatalf("at most %d data deletes at once over %d deleted streams; want several", m, streams)
	}
}
