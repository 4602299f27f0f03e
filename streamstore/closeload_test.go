package streamstore

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// A lookup's metadata load goes on after the request that started it has
// gone; Close waits for it before it gives up the lease, as it does for the
// engine's other background work. It used not to: the lease was released
// (and the next owner could start) while the load's GET was still on its
// way, its goroutine outliving the engine.
func TestCloseWaitsForMetadataLoad(t *testing.T) {
	store := newHookedStore()
	// No renewal PUT of the lease during the test: the only one is Close's
	// release.
	e := startEngine(t, store, Config{LeaseTTL: time.Hour})
	const name = "/absent"
	entered, released := make(chan struct{}), make(chan struct{})
	var enterOnce, releaseOnce sync.Once
	var releasedDuringLoad atomic.Bool
	store.setHook(func(op, key string) error {
		switch {
		case op == "GET" && key == metaKey(name):
			enterOnce.Do(func() { close(entered) })
			// The answer is slow to come back, even once the engine
			// closes: a release before it ends is a close that did not
			// wait.
			<-e.closing
			select {
			case <-released:
				releasedDuringLoad.Store(true)
			case <-time.After(time.Second):
			}
		case op == "PUT" && key == "lease": // segment's lease key
			releaseOnce.Do(func() { close(released) })
		}
		return nil
	})

	ctx, cancel := context.WithCancel(context.Background())
	readErr := make(chan error, 1)
	go func() {
		_, err := e.Read(ctx, name, ReadRequest{})
		readErr <- err
	}()
	<-entered
	cancel()
	if err := <-readErr; !errors.Is(err, context.Canceled) {
		t.Fatalf("read with its request gone: %v, want context.Canceled", err)
	}
	if err := e.Close(context.Background()); err != nil {
		t.Fatalf("close: %v", err)
	}
	// In this order: a load that ended after the release has said so
	// before it ended.
	e.mu.RLock()
	loading := len(e.loading)
	e.mu.RUnlock()
	if loading != 0 {
		t.Fatalf("%d metadata loads still running after Close", loading)
	}
	if releasedDuringLoad.Load() {
		t.Fatal("Close released the lease while a metadata load was still reading the bucket")
	}
	// A lookup after Close starts no load that nothing would wait for.
	if _, err := e.Read(context.Background(), name, ReadRequest{}); !errors.Is(err, ErrShuttingDown) {
		t.Fatalf("read after close: %v, want ErrShuttingDown", err)
	}
}
