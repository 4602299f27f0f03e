package streamstore

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestStartAfterCloseStartsNothing: an engine closed before it started
// stays closed. A Start after it took the lease and left the renewal and
// the background loops running with nothing to end them.
func TestStartAfterCloseStartsNothing(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := New(st, testConfig(Config{}), nil)
	if err := e.Close(ctx); err != nil {
		t.Fatalf("close before start: %v", err)
	}
	if err := e.Start(ctx); !errors.Is(err, ErrShuttingDown) {
		t.Errorf("start after close: %v, want %v", err, ErrShuttingDown)
	}
	if keys := st.Keys("lease"); len(keys) != 0 {
		t.Errorf("start after close took the lease: %v", keys)
	}
}

// closeWaitsOnBGOnly reports whether a stack dump shows Engine.Close
// waiting for its background goroutines while none of the engine's own
// loops is left: what it still waits for is work started on the side.
func closeWaitsOnBGOnly() bool {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	waiting := false
	for _, g := range strings.Split(string(buf), "\n\n") {
		for _, loop := range []string{".renewLease(", ".compactLoop(", ".gcLoop(", ".idleLoop(", ".expiryLoop("} {
			if strings.Contains(g, "streamstore.(*Engine)"+loop) {
				return false
			}
		}
		if strings.Contains(g, "streamstore.(*Engine).Close(") && strings.Contains(g, "sync.(*WaitGroup).Wait(") {
			waiting = true
		}
	}
	return waiting
}

// TestCloseWaitsForALostBlobsDelete: the DELETE of a lost batch's blob
// runs on a goroutine of its own (the writer's release waits for the
// hook); Close must wait for it like any other background work, not
// return while it still calls the store.
func TestCloseWaitsForALostBlobsDelete(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var failWAL atomic.Int32 // WAL uploads still to fail
	entered := make(chan struct{}, 1)
	gate := make(chan struct{})
	var deleting atomic.Bool // a blob DELETE is under way
	st.SetFail(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, "wal/") && failWAL.Add(-1) >= 0 {
			return errors.New("injected: WAL upload")
		}
		if op == "DELETE" && strings.HasPrefix(key, "blob/") {
			deleting.Store(true)
			select {
			case entered <- struct{}{}:
			default:
			}
			<-gate // a store slow to answer, whatever the context says
			deleting.Store(false)
		}
		return nil
	})
	opened := false
	open := func() {
		if !opened {
			opened = true
			close(gate)
		}
	}
	t.Cleanup(open)
	e := New(st, testConfig(Config{}), nil)
	if err := e.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Create(ctx, "/lost", CreateRequest{ContentType: "application/octet-stream"}); err != nil {
		t.Fatal(err)
	}
	failWAL.Store(1) // the upload fails; the seal that follows lands
	if _, err := e.Append(ctx, "/lost", AppendRequest{Records: []NewRecord{{Body: body(4, blobMinBytes)}}}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("append whose WAL upload failed: %v", err)
	}
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the lost batch's blob was never deleted")
	}
	closed := make(chan error, 1)
	go func() { closed <- e.Close(ctx) }()
	for !closeWaitsOnBGOnly() {
		select {
		case err := <-closed:
			if deleting.Load() {
				t.Fatalf("Close returned (%v) while the engine's DELETE of a lost blob was still under way", err)
			}
			return
		case <-time.After(time.Millisecond):
		}
	}
	open()
	if err := <-closed; err != nil {
		t.Errorf("close: %v", err)
	}
	if deleting.Load() {
		t.Error("Close returned while the engine's DELETE of a lost blob was still under way")
	}
}

// TestNoReadAheadAfterClose: a read that reaches the engine once Close has
// returned (an HTTP request still under way at a shutdown) starts no
// read-ahead. The pool ran such a worker on a goroutine nobody waited
// for, calling the store of an engine already closed.
func TestNoReadAheadAfterClose(t *testing.T) {
	ctx := context.Background()
	const objects = 6
	st := memstore.New()
	first := startEngine(t, st, Config{})
	writeObjects(t, first, "/late", objects)
	if err := first.Close(ctx); err != nil {
		t.Fatal(err)
	}
	e := startEngine(t, st, Config{})
	info, err := e.Head(ctx, "/late") // loaded: a read after Close finds it
	if err != nil {
		t.Fatal(err)
	}
	own := dataKey(info.ID, 0, 2)
	gate := make(chan struct{})
	t.Cleanup(func() { close(gate) })
	var late atomic.Int32 // GETs of objects ahead of the read
	st.SetFail(func(op, key string) error {
		if op == "GET" && strings.HasPrefix(key, "data/") && key != own {
			late.Add(1)
			<-gate // a store slow to answer, whatever the context says
		}
		return nil
	})
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if n := testenv.WaitPoolGoroutines(0, 5*time.Second); n != 0 {
		t.Fatalf("%d pool goroutines before the read", n)
	}
	if _, err := e.Read(ctx, "/late", ReadRequest{Seq: 0, MaxRecords: 2}); err != nil {
		t.Logf("read after close: %v", err)
	}
	// A worker started by the read is held at the gate: it is still there.
	if n := testenv.PoolGoroutines(); n != 0 {
		t.Errorf("a read after Close left %d goroutines on the engine's pool (%d GETs begun)", n, late.Load())
	}
}

// TestCloseKeepsTheLeaseWhileItFlushes: the lease is renewed until the
// last batch is flushed, then released. Close stopped renewing first, so
// a WAL upload that failed and was retried after the lease's validity ran
// out could not go out, nor could the writer confirm it still owned the
// storage: Close spun until its context ended, and then could not release
// the lease, which a standby had to wait out.
func TestCloseKeepsTheLeaseWhileItFlushes(t *testing.T) {
	const ttl = 600 * time.Millisecond // valid for 480 ms after each renewal
	st := newHookedStore()
	e := startEngine(t, st, Config{LeaseTTL: ttl})
	if _, _, err := e.Create(context.Background(), "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{})
	var failed atomic.Bool
	st.setHook(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, "wal/") && failed.CompareAndSwap(false, true) {
			close(started)
			time.Sleep(2 * ttl) // past the validity of the last renewal
			return errors.New("injected: WAL PUT failed")
		}
		return nil
	})
	go func() { _, _ = e.Append(context.Background(), "/s", AppendRequest{Records: recs("a")}) }()
	<-started
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	begun := time.Now()
	err := e.Close(ctx)
	took := time.Since(begun)
	if err != nil || took > 5*time.Second {
		t.Errorf("Close took %v and returned %v; want it to flush and release the lease", took.Round(time.Millisecond), err)
	}
	data, _, gerr := st.Get(context.Background(), "lease", 0, -1)
	if gerr != nil || !strings.Contains(string(data), `"expires_at_ms":0`) {
		t.Errorf("the lease after Close: %s (%v); want it released", data, gerr)
	}
}
