package streamstore

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// landedRefused is a memstore whose first create-only PUT of key is
// applied and then answered with a failed precondition: what a store
// reports when a write of its landed, its answer was lost or refused, and
// its retry met the write's own object.
type landedRefused struct {
	*memstore.Store
	key  string
	done atomic.Bool
}

func (s *landedRefused) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	if key == s.key && opts.IfNoneMatch && s.done.CompareAndSwap(false, true) {
		if _, err := s.Store.Put(ctx, key, data, opts); err != nil {
			return "", err
		}
		return "", segment.ErrPreconditionFailed
	}
	return s.Store.Put(ctx, key, data, opts)
}

// TestCreateFindsItsOwnLandedMetadata: a create whose metadata PUT landed
// but came back as a failed precondition finds its own bytes under the
// name. That is its create done, not another's: it must not be answered
// as a conflict, nor drop its records from the WAL while the metadata it
// wrote makes the stream exist without them.
func TestCreateFindsItsOwnLandedMetadata(t *testing.T) {
	for _, tc := range []struct {
		name string
		req  CreateRequest
		want string
	}{
		{"with records", CreateRequest{ContentType: "text/plain", Records: recs("x", "y")}, "[x y]"},
		{"empty", CreateRequest{ContentType: "text/plain"}, "[]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := &landedRefused{Store: memstore.New(), key: metaKey("/c")}
			e := startEngine(t, st, Config{})
			_, created, err := e.Create(ctx, "/c", tc.req)
			if err != nil || !created {
				t.Fatalf("create = created %v, %v; want it created", created, err)
			}
			if !st.done.Load() {
				t.Fatal("the metadata PUT was not refused: the test did not run")
			}
			if got := fmt.Sprint(readAll(t, e, "/c")); got != tc.want {
				t.Fatalf("read = %s, want %s", got, tc.want)
			}
			e2 := restart(t, e, st)
			if got := fmt.Sprint(readAll(t, e2, "/c")); got != tc.want {
				t.Fatalf("read after a restart = %s, want %s", got, tc.want)
			}
		})
	}
}

// TestPutDocFindsItsOwnLandedCreate: the same for a document's create.
func TestPutDocFindsItsOwnLandedCreate(t *testing.T) {
	ctx := context.Background()
	st := &landedRefused{Store: memstore.New(), key: docPrefix + "d"}
	e := startEngine(t, st, Config{})
	ver, err := e.PutDoc(ctx, "d", []byte("doc"), "")
	if err != nil {
		t.Fatalf("PutDoc: %v", err)
	}
	if !st.done.Load() {
		t.Fatal("the document PUT was not refused: the test did not run")
	}
	data, cur, err := e.GetDoc(ctx, "d")
	if err != nil || string(data) != "doc" || cur != ver {
		t.Fatalf("GetDoc = %q %s, %v; want %q %s", data, cur, err, "doc", ver)
	}
	if _, err := e.PutDoc(ctx, "d", []byte("again"), ""); !errors.Is(err, ErrDocConflict) {
		t.Fatalf("a second create: %v, want ErrDocConflict", err)
	}
}
