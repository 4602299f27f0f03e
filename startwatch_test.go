package picomq

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/streamstore"
)

// TestStallContext: the context a start runs under ends as a deadline
// does only once progress stops for the quiet time, not while it moves
// past it, and ends with its parent or its cancel otherwise.
func TestStallContext(t *testing.T) {
	const quiet = 100 * time.Millisecond
	t.Run("moving past the quiet time", func(t *testing.T) {
		var p atomic.Int64
		ctx, cancel := newStallContext(context.Background(), quiet, p.Load)
		defer cancel()
		for end := time.Now().Add(5 * quiet); time.Now().Before(end); {
			p.Add(1)
			time.Sleep(quiet / 10)
			if err := ctx.Err(); err != nil {
				t.Fatalf("ended while moving: %v", err)
			}
		}
	})
	t.Run("stalled", func(t *testing.T) {
		var p atomic.Int64
		ctx, cancel := newStallContext(context.Background(), quiet, p.Load)
		defer cancel()
		select {
		case <-ctx.Done():
		case <-time.After(20 * quiet):
			t.Fatal("did not end when progress stopped")
		}
		if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
			t.Fatalf("ended with %v, want context.DeadlineExceeded", ctx.Err())
		}
	})
	t.Run("parent", func(t *testing.T) {
		parent, stop := context.WithCancel(context.WithValue(context.Background(), stallKey{}, "v"))
		ctx, cancel := newStallContext(parent, time.Hour, func() int64 { return 0 })
		defer cancel()
		if ctx.Value(stallKey{}) != "v" {
			t.Error("the parent's values are not seen")
		}
		stop()
		select {
		case <-ctx.Done():
		case <-time.After(5 * time.Second):
			t.Fatal("did not end with its parent")
		}
		if !errors.Is(ctx.Err(), context.Canceled) {
			t.Fatalf("ended with %v, want context.Canceled", ctx.Err())
		}
	})
	t.Run("cancel", func(t *testing.T) {
		ctx, cancel := newStallContext(context.Background(), time.Hour, func() int64 { return 0 })
		cancel()
		cancel()
		<-ctx.Done()
		if !errors.Is(ctx.Err(), context.Canceled) {
			t.Fatalf("ended with %v, want context.Canceled", ctx.Err())
		}
	})
}

type stallKey struct{}

// TestLongReplayIsNotCutShort: a start whose replay takes longer than the
// start's bound, while making progress all along, opens the storage. A
// fixed bound failed it, and every retry after, the same way.
func TestLongReplayIsNotCutShort(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	ctx := context.Background()
	st := memstore.New()
	w := streamstore.New(st, streamstore.Config{NodeID: "writer", FlushInterval: time.Millisecond, CompactInterval: time.Hour}, zaptest.NewLogger(t))
	if err := w.Start(ctx); err != nil {
		t.Fatal(err)
	}
	for i := range 64 {
		req := streamstore.CreateRequest{ContentType: "text/plain", Records: []streamstore.NewRecord{{Body: []byte("x")}}}
		if _, _, err := w.Create(ctx, fmt.Sprintf("/s%d", i), req); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(ctx); err != nil {
		t.Fatal(err)
	}
	wal, _, err := st.List(ctx, "wal/", "", 1000)
	if err != nil || len(wal) < 48 {
		t.Fatalf("%d WAL objects to replay (%v), want 48 or more", len(wal), err)
	}

	defer func(was time.Duration) { engineStartStall = was }(engineStartStall)
	engineStartStall = 200 * time.Millisecond
	ref := newEngineRef("mem://replay", slowWAL{st}, testSettings(), newLogFollower(zaptest.NewLogger(t)))
	t.Cleanup(func() { _ = ref.Destruct() })
	began := time.Now()
	if err := ref.start(false); err != nil {
		t.Fatalf("start after %v: %v", time.Since(began), err)
	}
	if took := time.Since(began); took < engineStartStall {
		t.Fatalf("the replay took %v, within the start's bound (%v): the test proves nothing", took, engineStartStall)
	}
}

// slowWAL is a store whose WAL objects take 60 ms each to read, or until
// the read's context ends.
type slowWAL struct{ *memstore.Store }

func (s slowWAL) Get(ctx context.Context, key string, off, n int64) ([]byte, string, error) {
	if strings.HasPrefix(key, "wal/") {
		select {
		case <-time.After(60 * time.Millisecond):
		case <-ctx.Done():
			return nil, "", ctx.Err()
		}
	}
	return s.Store.Get(ctx, key, off, n)
}
