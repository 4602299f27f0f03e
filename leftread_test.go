package picomq

import (
	"context"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/picomq/caddy-picomq/segment"
	"github.com/picomq/caddy-picomq/streamstore"
)

// stallingReads is a store whose WAL reads wait for their context to end
// while stall is set, as reads from a slow bucket would; started gets one
// value per read stalled.
type stallingReads struct {
	segment.Store
	stall   atomic.Bool
	started chan struct{}
}

func (s *stallingReads) Get(ctx context.Context, key string, off, n int64) ([]byte, string, error) {
	if s.stall.Load() && strings.HasPrefix(key, "wal/") {
		s.started <- struct{}{}
		<-ctx.Done()
		return nil, "", ctx.Err()
	}
	return s.Store.Get(ctx, key, off, n)
}

// A reader that leaves while its read waits on the bucket is no storage
// failure: nothing is logged for it. Its read's cancellation came back as
// ErrUnavailable, which the handler logged as "storage unavailable" before
// it looked at whether the client was still there, hiding real outages
// among clients that simply went away.
func TestReaderLeavingIsNotAStorageFailure(t *testing.T) {
	inner, err := segment.Open("file://"+t.TempDir(), segment.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	store := &stallingReads{Store: inner, started: make(chan struct{}, 1)}
	core, logs := observer.New(zapcore.WarnLevel)
	log := zap.New(core)
	// A 1-byte cache: every read goes to the bucket.
	eng := streamstore.New(store, streamstore.Config{NodeID: "test-node", FlushInterval: time.Millisecond, CacheBytes: 1}, log)
	if err := eng.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	srv := newDSServerOn(t, eng, log)
	for _, r := range []struct{ method, body string }{{http.MethodPut, ""}, {http.MethodPost, "record"}} {
		req, _ := http.NewRequest(r.method, srv.URL+"/s", strings.NewReader(r.body))
		req.Header.Set("Content-Type", "text/plain")
		res, err := http.DefaultClient.Do(req)
		if err != nil || res.StatusCode/100 != 2 {
			t.Fatalf("%s: %v %v", r.method, res, err)
		}
		res.Body.Close()
	}
	store.stall.Store(true)
	ctx, leave := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/s?offset=-1", nil)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if res, err := http.DefaultClient.Do(req); err == nil {
			res.Body.Close()
		}
	}()
	<-store.started
	leave()
	<-done
	srv.Close() // waits for the handler to end
	if n := logs.Len(); n != 0 {
		t.Errorf("%d warnings for a reader that left: %v", n, logs.All())
	}
}
