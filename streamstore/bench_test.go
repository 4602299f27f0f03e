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

// BenchmarkGroupCommitEngine measures the engine alone over an in-memory
// store with a fixed PUT latency: 64 writers over 100 streams. It reports
// WAL PUTs per 1,000 appends, which group commit keeps near 1000/64.
func BenchmarkGroupCommitEngine(b *testing.B) {
	ctx := context.Background()
	st := memstore.New()
	var walPuts atomic.Int64
	st.SetFail(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, "wal/") {
			walPuts.Add(1)
			time.Sleep(5 * time.Millisecond)
		}
		return nil
	})
	e := New(st, Config{NodeID: "bench", CompactInterval: time.Hour}, nil)
	if err := e.Start(ctx); err != nil {
		b.Fatal(err)
	}
	defer e.Close(ctx)
	const streams, writers = 100, 64
	for i := 0; i < streams; i++ {
		if _, _, err := e.Create(ctx, fmt.Sprintf("/bench/%d", i), CreateRequest{ContentType: "application/octet-stream"}); err != nil {
			b.Fatal(err)
		}
	}
	body := make([]byte, 1024)
	walPuts.Store(0)
	var next atomic.Int64
	b.ResetTimer()
	var wg sync.WaitGroup
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				n := next.Add(1)
				if n > int64(b.N) {
					return
				}
				name := fmt.Sprintf("/bench/%d", n%streams)
				if _, err := e.Append(ctx, name, AppendRequest{Records: []NewRecord{{Body: body}}}); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	b.ReportMetric(float64(walPuts.Load())*1000/float64(b.N), "walPUTs/1k-appends")
}
