package streamstore

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

// fillStreams creates n streams with one appended record each.
func fillStreams(t *testing.T, e *Engine, n int) {
	t.Helper()
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			name := fmt.Sprintf("/r%d", i)
			if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
				errs <- err
				return
			}
			if _, err := e.Append(ctx, name, AppendRequest{Records: recs(name)}); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// A replay through a slow store may take longer than the lease lives; the
// node must come up able to write all the same.
func TestReplayLongerThanTheLease(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	// While slow, every GET but the lease's takes 100 ms: the format
	// check, the manifest, the WAL and the metadata come one after the
	// other, so the replay outlasts the lease.
	var slow atomic.Bool
	st.SetFail(func(op, key string) error {
		if slow.Load() && op == "GET" && key != "lease" {
			time.Sleep(100 * time.Millisecond)
		}
		return nil
	})
	const ttl = 300 * time.Millisecond
	e := startEngine(t, st, Config{LeaseTTL: ttl})
	fillStreams(t, e, 40)

	// Crash: a second engine with the same node id takes over.
	slow.Store(true)
	began := time.Now()
	e2 := startEngine(t, st, Config{LeaseTTL: ttl})
	took := time.Since(began)
	slow.Store(false)
	if took < ttl {
		t.Fatalf("the replay took %v, not longer than the lease (%v): the test proves nothing", took, ttl)
	}
	for i := range 40 {
		name := fmt.Sprintf("/r%d", i)
		if _, err := e2.Append(ctx, name, AppendRequest{Records: recs("after")}); err != nil {
			t.Fatalf("append to %s after a %v replay (lease %v): %v", name, took, ttl, err)
		}
		if got := readAll(t, e2, name); len(got) != 2 || got[0] != name || got[1] != "after" {
			t.Fatalf("%s after replay: %v", name, got)
		}
	}
}

// Replay reads the metadata of the streams a WAL object names several at
// a time, and each missing one once.
func TestReplayLoadsMetadataConcurrently(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var counting atomic.Bool
	var loads concurrency
	var gets, deletedGets atomic.Int64
	st.SetFail(func(op, key string) error {
		if !counting.Load() || op != "GET" || !strings.HasPrefix(key, "streams/") {
			return nil
		}
		gets.Add(1)
		if key == metaKey("/r0") {
			deletedGets.Add(1)
		}
		defer loads.enter()()
		time.Sleep(10 * time.Millisecond)
		return nil
	})
	e := startEngine(t, st, Config{})
	fillStreams(t, e, 64)
	// A deleted stream's entries stay in the WAL until compaction.
	if err := e.Delete(ctx, "/r0"); err != nil {
		t.Fatal(err)
	}
	// Its tombstone collected, so that the new engine's collector does not
	// read the metadata too (it checks the stream is really gone).
	if err := e.collectGarbage(ctx); err != nil {
		t.Fatal(err)
	}

	// Crash: a second engine with the same node id takes over.
	counting.Store(true)
	e2 := startEngine(t, st, Config{})
	counting.Store(false)
	if p := loads.peak.Load(); p < 8 {
		t.Fatalf("at most %d metadata GETs were in flight during the replay; want them loaded concurrently", p)
	}
	if n := deletedGets.Load(); n > 1 {
		t.Fatalf("the deleted stream's metadata was read %d times during the replay; want once", n)
	}
	if got := readAll(t, e2, "/r63"); len(got) != 1 || got[0] != "/r63" {
		t.Fatalf("/r63 after replay: %v", got)
	}
	t.Logf("%d metadata GETs, at most %d at once", gets.Load(), loads.peak.Load())
}
