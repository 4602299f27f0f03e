package streamstore

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// TestDocGraves: a deleted document leaves a grave, so that its create and
// its delete arriving late (first attempts held up on their way, their
// retries answered) change nothing; a create takes the key back over the
// grave, and a read removes a grave older than the grave time.
func TestDocGraves(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{GraveTime: time.Hour})
	const key, objKey = "root/sub", docPrefix + "root/sub"
	v1, err := e.PutDoc(ctx, key, []byte(`{"n":1}`), "")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.DeleteDoc(ctx, key, v1); err != nil {
		t.Fatalf("delete: %v", err)
	}
	if _, err := st.Put(ctx, objKey, []byte(`{"n":1}`), segment.PutOptions{IfNoneMatch: true}); !errors.Is(err, segment.ErrPreconditionFailed) {
		t.Fatalf("the create landing late: %v; want it refused by the grave", err)
	}
	if err := e.DeleteDoc(ctx, key, v1); !errors.Is(err, ErrDocConflict) {
		t.Fatalf("the delete landing late: %v; want a conflict", err)
	}
	if _, _, err := e.GetDoc(ctx, key); !errors.Is(err, ErrNotFound) {
		t.Fatalf("read of the deleted document: %v; want ErrNotFound", err)
	}
	if keys, err := e.ListDocs(ctx, ""); err != nil || !slices.Contains(keys, key) {
		t.Fatalf("listing %q, %v; want the grave's key, which GetDoc answers as not found", keys, err)
	}
	v2, err := e.PutDoc(ctx, key, []byte(`{"n":2}`), "")
	if err != nil {
		t.Fatalf("create over the grave: %v", err)
	}
	if data, _, err := e.GetDoc(ctx, key); err != nil || string(data) != `{"n":2}` {
		t.Fatalf("read after the create over the grave: %s, %v", data, err)
	}
	if err := e.DeleteDoc(ctx, key, v2); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.GetDoc(ctx, key); !errors.Is(err, ErrNotFound) || len(st.Keys(objKey)) != 1 {
		t.Fatalf("a read before the grave time: %v, keys %q; want ErrNotFound and the grave kept", err, st.Keys(objKey))
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	e2 := startEngine(t, st, Config{GraveTime: time.Nanosecond})
	if _, _, err := e2.GetDoc(ctx, key); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a read past the grave time: %v; want ErrNotFound", err)
	}
	if keys := st.Keys(objKey); len(keys) != 0 {
		t.Fatalf("the grave is still there after a read past its time: %q", keys)
	}
}

// TestDocGraveIndexed: a deleted document's grave is in the grave index,
// so the collector removes it once it is due, without anyone reading it.
func TestDocGraveIndexed(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	const graveTime = 300 * time.Millisecond
	e := startEngine(t, st, Config{GraveTime: graveTime})
	const objKey = docPrefix + "root/sub"
	v, err := e.PutDoc(ctx, "root/sub", []byte(`{"n":1}`), "")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.DeleteDoc(ctx, "root/sub", v); err != nil {
		t.Fatal(err)
	}
	if got := st.Keys(gravesPrefix); len(got) != 1 {
		t.Fatalf("grave index %q; want the document grave's entry", got)
	}
	if err := e.collectGarbage(ctx); err != nil {
		t.Fatal(err)
	}
	if len(st.Keys(objKey)) != 1 {
		t.Fatal("the grave went before its time")
	}
	time.Sleep(graveTime)
	if err := e.collectGarbage(ctx); err != nil {
		t.Fatal(err)
	}
	if got := append(st.Keys(objKey), st.Keys(gravesPrefix)...); len(got) != 0 {
		t.Fatalf("left after the grave time and a collection: %q", got)
	}
}
