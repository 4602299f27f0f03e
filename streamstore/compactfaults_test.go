package streamstore

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

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
