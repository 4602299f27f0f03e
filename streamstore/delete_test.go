package streamstore

import (
	"context"
	"errors"
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
// object, so that a test can send it again later: a request held up on its
// way that lands after its retry was answered.
type lateDeletes struct {
	*memstore.Store
	mu     sync.Mutex
	copies []func(context.Context) error
}

func (l *lateDeletes) keep(f func(context.Context) error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.copies = append(l.copies, f)
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
// acknowledged records with it.
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
	data, _, err := st.Get(ctx, metaKey("/s"), 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	m, err := decodeMeta(data)
	if err != nil {
		t.Fatal(err)
	}
	m.CreatedAt++
	if _, err := st.Put(ctx, metaKey("/s"), encodeMeta(m), segment.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := e.Delete(ctx, "/s"); err != nil {
		t.Fatalf("delete: %v", err)
	}
	if keys := st.Keys(metaPrefix); len(keys) != 0 {
		t.Fatalf("metadata left after the delete: %q", keys)
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
	st.Fail = func(op, key string) error {
		if cutOff.Load() && key == "lease" {
			return errors.New("partitioned")
		}
		return nil
	}
	e := startEngine(t, st, Config{NodeID: "node-a", LeaseTTL: 600 * time.Millisecond})
	if _, _, err := e.Create(ctx, "/s", CreateRequest{Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	cutOff.Store(true)
	time.Sleep(700 * time.Millisecond) // the lease lapses
	if err := e.Delete(ctx, "/s"); err == nil {
		t.Error("a delete on a lapsed lease reported success")
	}
	if keys := st.Keys(metaKey("/s")); len(keys) != 1 {
		t.Errorf("metadata after the refused delete: %q", keys)
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
