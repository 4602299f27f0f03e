package streamstore

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

// Compaction folds many streams at once: each costs two sequential
// requests, and on a bucket tens of milliseconds away a few at a time fell
// behind a thousand busy streams for good.
func TestCompactionFoldsStreamsConcurrently(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var counting atomic.Bool
	var inFlight, peak atomic.Int64
	st.Fail = func(op, key string) error {
		if !counting.Load() || op != "PUT" || !strings.HasPrefix(key, "data/") {
			return nil
		}
		n := inFlight.Add(1)
		for {
			p := peak.Load()
			if n <= p || peak.CompareAndSwap(p, n) {
				break
			}
		}
		time.Sleep(20 * time.Millisecond)
		inFlight.Add(-1)
		return nil
	}
	e := startEngine(t, st, Config{})
	fillStreams(t, e, 100)
	counting.Store(true)
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	counting.Store(false)
	if p := peak.Load(); p < 16 {
		t.Fatalf("at most %d data PUTs were in flight during the compaction of 100 streams; want 16 or more", p)
	}
	if data := st.Keys("data/"); len(data) != 100 {
		t.Fatalf("%d data objects after compacting 100 streams", len(data))
	}
}
