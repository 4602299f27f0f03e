package streamstore

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// A fold's checkpoint lands but its answer is lost, and the read-back that
// follows fails too, so the compaction fails and memory keeps the old
// checkpoint (as TestUnconfirmedMetadataWrites' "checkpoint, read-back
// unreachable"). The next compaction packs the stream instead of folding it:
// packing writes no metadata, so nothing reconciles, and the pack entry
// starts at the old checkpoint while the bucket's metadata is the landed one.
// After a restart replayPacks ignores the entry ("does not continue its
// stream") and acknowledged records are gone.
// A checkpoint whose PUT landed but whose answer, and read-back, were lost
// leaves the bucket's tail past the one this process knows. Packing the
// stream then wrote a pack entry from the old tail, which replay ignores
// as not continuing the stream: after a restart the records after the
// landed checkpoint were gone and their seqs handed out again. Such a
// stream is folded instead, whose checkpoint write finds and settles the
// unconfirmed one. Both reasons to pack: the stream idle, and small.
func TestPackAfterUnconfirmedCheckpointKeepsRecords(t *testing.T) {
	for _, why := range []string{"idle", "pack_below"} {
		t.Run(why, func(t *testing.T) {
			ctx := context.Background()
			st := &lostAnswers{Store: memstore.New()}
			cfg := testConfig(Config{})
			e := startEngine(t, st, cfg)
			if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
				t.Fatal(err)
			}
			mustAppend(t, e, "/s", AppendRequest{Records: recs("a", "b")})

			// Compaction 1 folds /s: it went idle (the production
			// trigger), or pack_below forces it. Its checkpoint lands
			// unconfirmed and the read-back cannot reach the bucket.
			if why == "idle" {
				c := cfg
				c.IdleAfter = time.Millisecond
				e.Reconfigure(c)
				time.Sleep(5 * time.Millisecond)
			} else {
				setPackBelow(e, -1)
			}
			st.loseNext(conditionalOn("/s"))
			st.blindTo(func(k string) bool { return k == metaKey("/s") })
			if err := e.Compact(ctx); err == nil {
				t.Fatal("compaction with an unconfirmed checkpoint reported success")
			}
			st.blindTo(nil)
			e.Reconfigure(cfg) // busy again, default pack_below

			// More acknowledged appends; compaction 2 packs /s.
			mustAppend(t, e, "/s", AppendRequest{Records: recs("c", "d")})
			mustCompact(t, e)
			if got := fmt.Sprint(readAll(t, e, "/s")); got != "[a b c d]" {
				t.Fatalf("before the restart the stream reads %s", got)
			}
			t.Logf("bucket after compaction 2: packs %v, data %v, wal %v", st.Keys("pack/"), st.Keys("data/"), st.Keys("wal/"))

			// A crash: a new engine on the bucket as it is.
			e2 := startEngine(t, st.Store, Config{})
			got := fmt.Sprint(readAll(t, e2, "/s"))
			if got != "[a b c d]" {
				r, err := e2.Append(ctx, "/s", AppendRequest{Records: recs("e")})
				t.Fatalf("acknowledged [a b c d]; after a restart the stream reads %s (next append got seq %d, %v)", got, r.FirstSeq, err)
			}
		})
	}
}

// A fork's metadata PUT fails before it lands and the read-back finds
// nothing, so create reports a plain failure (not ErrUnconfirmed) and
// createFork gives the source's fork count back. The PUT lands late (create
// itself says it may: "Should it land late, the stream is the empty one that
// was asked for, and a create repeated finds it"). The fork now exists, and a
// repeated create confirms it, but the source counts no fork: its delete is
// hard, the collector removes its data, and the fork's inherited records are
// gone.
// A fork's metadata PUT that failed, with a read-back that did not find
// it, can still land, and a create repeated then confirms the fork. Its
// source gave its fork count back on the failure, so deleting the source
// was a hard delete and took the fork's inherited records with it. The
// count now stays on any failure the bucket could still undo.
func TestLateForkCreateKeepsSourceData(t *testing.T) {
	ctx := context.Background()
	st := &delayedPut{Store: memstore.New(), key: metaKey("/f")}
	e := startEngine(t, st, Config{PackBelow: -1})
	if _, _, err := e.Create(ctx, "/src", CreateRequest{ContentType: "text/plain", Records: recs("a", "b")}); err != nil {
		t.Fatal(err)
	}
	mustCompact(t, e) // the source's records are in its data objects
	_, _, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 2}})
	if err == nil {
		t.Fatal("the fork's create succeeded although its metadata PUT failed")
	}
	t.Logf("fork create: %v", err)
	if !st.land(t) {
		t.Fatal("the late PUT did not land")
	}
	// The client repeats its create: the fork is there, as asked.
	if _, created, err := e.Create(ctx, "/f", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 2}}); err != nil {
		t.Fatalf("repeated fork create: %v", err)
	} else {
		t.Logf("repeated fork create: created=%v (exists, confirmed)", created)
	}
	if got := fmt.Sprint(readAll(t, e, "/f")); got != "[a b]" {
		t.Fatalf("fork reads %s", got)
	}
	if err := e.Delete(ctx, "/src"); err != nil {
		t.Fatal(err)
	}
	if err := e.collectGarbage(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("source data left: %v", st.Keys("data/"))
	res, err := e.Read(ctx, "/f", ReadRequest{})
	if err != nil || len(res.Records) != 2 {
		t.Fatalf("the confirmed fork's inherited records after the source's delete: %d records, %v", len(res.Records), err)
	}
}

// A process that goes on after another took the storage over (two engines
// with one node id, as TestForeignMetadataWrite models it) runs a
// compaction before its lease renewal notices. Its retireWAL writes the
// manifest's pack list from its own memory (m.Packs = live), dropping the
// pack the new owner listed; the new owner had retired the WAL those records
// came from, so after the next restart they are gone (and sweepPacks deletes
// the pack).
// A second process of the same node id takes the storage over at once;
// the first learns of it only at its next lease renewal. A compaction of
// the first in between wrote the manifest's pack list from its own view
// and delisted the pack the new owner had just written: after a restart
// the new owner's acknowledged record was gone. The lease object is now
// read before the manifest moves.
func TestStaleOwnerCompactionLeavesTheManifest(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	a := startEngine(t, st, Config{})
	if _, _, err := a.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	mustAppend(t, a, "/s", AppendRequest{Records: recs("a")})

	b := startEngine(t, st, Config{})
	if _, _, err := b.Create(ctx, "/t", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	mustAppend(t, b, "/t", AppendRequest{Records: recs("t1")})
	mustCompact(t, b) // /s and /t packed; the WAL retired
	m, _, _ := segment.NewManifests(st).Load(ctx)
	t.Logf("manifest after the new owner's compaction: packs %v", m.Packs)

	// The old owner's compaction, before its renewal finds the takeover.
	t.Logf("old owner's compaction: %v", a.Compact(ctx))
	m, _, _ = segment.NewManifests(st).Load(ctx)
	t.Logf("manifest after the old owner's compaction: packs %v", m.Packs)

	// The new owner crashes; a third engine starts on the bucket.
	c := startEngine(t, st, Config{})
	if got := fmt.Sprint(readAll(t, c, "/t")); got != "[t1]" {
		t.Fatalf("acknowledged [t1] to the new owner; after a restart /t reads %s", got)
	}
}

// A compaction packs a stream and then fails (a fold's PUT fails), so the
// pack is written and the stream's runs point into it, but the WAL is not
// retired. The next compaction finds a lost backlog past lostWindowBytes
// (the failed fold's runs, pushed out of the cache) and works in windows:
// the first window ends before the pack run's WAL position, and decide()
// then sees the stream's pack run at the front (from = 1) but no run before
// the cut (to = 0), and builds a job with s.runs[to-1].
// A compaction that packed a stream and then failed retires no WAL, so
// the next one may work in windows that end before that pack's position.
// Its decision for the stream indexed past the stream's runs and
// panicked, which would take the whole process down.
func TestWindowBeforeAPackLeavesTheStream(t *testing.T) {
	ctx := context.Background()
	st := newHookedStore()
	e := startEngine(t, st, Config{})
	for _, n := range []string{"/big", "/small"} {
		if _, _, err := e.Create(ctx, n, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
	}
	body := strings.Repeat("x", 200<<10) // inline, not a blob
	for range 170 {                      // 34 MiB: past lostWindowBytes
		mustAppend(t, e, "/big", AppendRequest{Records: recs(body)})
	}
	mustAppend(t, e, "/small", AppendRequest{Records: recs("a1")})
	big, _ := e.Head(ctx, "/big")
	st.setHook(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, dataPrefix(big.ID)) {
			return fmt.Errorf("injected: PUT %s failed", key)
		}
		return nil
	})
	if err := e.Compact(ctx); err == nil {
		t.Fatal("the compaction whose fold failed reported success")
	}
	st.setHook(nil)
	t.Logf("after the failed compaction: packs %v, /small has %d pack run(s)", st.Keys("pack/"), packRuns(e, "/small"))
	dropCache(e) // appends would push the failed fold's runs out
	todo, end := e.allStreams(), e.commitPos()
	t.Logf("windows of the next compaction: %d", len(e.lostWindows(todo, end)))
	func() {
		defer func() {
			if r := recover(); r != nil {
				t.Fatalf("the next compaction panicked: %v", r)
			}
		}()
		if err := e.Compact(ctx); err != nil {
			t.Fatalf("the next compaction: %v", err)
		}
	}()
	if got := fmt.Sprint(readAll(t, e, "/small")); got != "[a1]" {
		t.Fatalf("/small reads %s", got)
	}
}
