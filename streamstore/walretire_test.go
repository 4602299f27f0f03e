package streamstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// A compaction that retires an earlier namespace takes it out of the
// manifest and then deletes its WAL objects. When those deletes fail (the
// store refuses them, or the process dies between the manifest write and
// the deletes), nothing named the namespace any more: no later compaction
// and no restart looked at it again, and its WAL objects stayed in the
// bucket for good.
func TestRetiredNamespaceIsDeletedAfterAFailedDelete(t *testing.T) {
	for _, tc := range []struct {
		name    string
		restart bool // the process dies before it can try again
	}{
		{name: "next compaction"},
		{name: "after a restart", restart: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			e1 := startEngine(t, st, Config{})
			if _, _, err := e1.Create(ctx, "/s", CreateRequest{ContentType: "text/plain", Records: recs("a")}); err != nil {
				t.Fatal(err)
			}
			mustAppend(t, e1, "/s", AppendRequest{Records: recs("b")})
			old, _ := e1.w.Position()
			prefix := segment.WALPrefix(old)
			if len(st.Keys(prefix)) == 0 {
				t.Fatalf("no WAL object under %s before the restart", prefix)
			}

			// The node starts again: its first compaction retires the
			// namespace of the process before it, whose deletes fail.
			e2 := startEngine(t, st, Config{})
			st.SetFail(func(op, key string) error {
				if op == "DELETE" && strings.HasPrefix(key, prefix) {
					return errors.New("injected: delete of a retired WAL object")
				}
				return nil
			})
			if err := e2.Compact(ctx); err == nil {
				t.Fatal("the compaction whose WAL deletes failed reported success")
			}
			st.SetFail(nil)
			man, _, err := segment.NewManifests(st).Load(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, n := range man.Namespaces {
				if n.ID == old {
					t.Fatalf("namespace %d still to replay after its compaction: %+v", old, man.Namespaces)
				}
			}

			e := e2
			if tc.restart {
				e = startEngine(t, st, Config{})
			}
			mustAppend(t, e, "/s", AppendRequest{Records: recs("c")})
			mustCompact(t, e)
			if keys := st.Keys(prefix); len(keys) > 0 {
				t.Errorf("WAL objects of the retired namespace %d still in the bucket: %v", old, keys)
			}
			if got := fmt.Sprint(readAll(t, e, "/s")); got != "[a b c]" {
				t.Fatalf("the stream reads %s", got)
			}
		})
	}
}

// A pack no stream reads any more leaves the manifest and is then
// deleted. When that delete failed, the pack was out of the engine's list
// as well as the manifest's: no later compaction tried it again, and it
// stayed in the bucket until the next start swept unlisted packs, which
// for a node that runs for months is months.
func TestDeadPackIsDeletedAfterAFailedDelete(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/p", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	mustAppend(t, e, "/p", AppendRequest{Records: recs("a")})
	mustCompact(t, e) // packed
	packs := st.Keys("pack/")
	if len(packs) != 1 {
		t.Fatalf("packs after the first compaction: %v; want one", packs)
	}

	// The stream leaves the packs, folded: the pack is no stream's now,
	// and its delete fails.
	setPackBelow(e, -1)
	mustAppend(t, e, "/p", AppendRequest{Records: recs("b")})
	st.SetFail(func(op, key string) error {
		if op == "DELETE" && strings.HasPrefix(key, "pack/") {
			return errors.New("injected: delete of a dead pack")
		}
		return nil
	})
	if err := e.Compact(ctx); err == nil {
		t.Fatal("the compaction whose pack delete failed reported success")
	}
	st.SetFail(nil)
	if len(st.Keys("pack/")) == 0 {
		t.Fatal("the dead pack went although its delete was refused")
	}

	// Nothing more to fold: the next passes must still delete it.
	for range 2 {
		if err := e.Compact(ctx); err != nil {
			t.Logf("compaction: %v", err)
		}
	}
	if left := st.Keys("pack/"); len(left) > 0 {
		t.Errorf("dead pack still in the bucket after later compactions: %v", left)
	}
	if got := fmt.Sprint(readAll(t, e, "/p")); got != "[a b]" {
		t.Fatalf("the stream reads %s", got)
	}
}
