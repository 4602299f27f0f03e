package integration

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestSSEFanOut: many SSE subscribers of one stream, most at the same
// position (they share one encoded data event per wake-up), some joining
// late from the start (they catch up through chunks of their own), while
// appends arrive one at a time and in bursts (feeds behind read several
// records at once). Every subscriber must end with exactly the stream's
// bytes, with control events that only move forward; text and binary
// (base64) streams both.
func TestSSEFanOut(t *testing.T) {
	const (
		early   = 80
		late    = 20
		records = 100
	)
	v := testenv.NewVersity(t)
	// Uploads close together: a burst commits in many small steps, so
	// feeds wake at many different positions and share frames at each.
	c := caddytest.Start(t, caddyOptions(v, caddytest.S3Storage(t, v, v.Endpoint), "flush_interval 1ms"))
	wcl := newClient(t, c.URL(), true)
	scl := newClient(t, c.URL(), true)

	tests := []struct {
		ct     string
		record func(i int) []byte
	}{
		{"text/plain", func(i int) []byte {
			// Several lines, one with a leading space, one empty.
			return []byte(fmt.Sprintf("record %d\n  indented %d\n\nend %d;", i, i, i))
		}},
		{"application/octet-stream", func(i int) []byte {
			b := []byte{byte(i), 0, '\r', '\n', 0xff, ' '}
			return append(b, bytes.Repeat([]byte{byte(i * 7)}, i*13)...)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.ct, func(t *testing.T) {
			name := "/fanout/" + map[string]string{"text/plain": "text", "application/octet-stream": "bin"}[tt.ct]
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			r, err := wcl.do(ctx, http.MethodPut, name, "", http.Header{"Content-Type": {tt.ct}}, nil)
			if err != nil || r.status != http.StatusCreated {
				t.Fatalf("create %s: %v %v", name, r, err)
			}

			subCtx, stopSubs := context.WithCancel(ctx)
			var wg sync.WaitGroup
			t.Cleanup(func() { stopSubs(); wg.Wait() })
			var subs []*subscriber
			start := func(n int) {
				for i := 0; i < n; i++ {
					s := newSubscriber(scl, name)
					subs = append(subs, s)
					wg.Add(1)
					go func() { defer wg.Done(); s.run(subCtx) }()
				}
			}
			start(early)
			if !waitFor(20*time.Second, func() bool { return openCount(subs) == early }) {
				t.Fatalf("only %d of %d subscribers connected", openCount(subs), early)
			}

			var want []byte
			post := func(i int) {
				t.Helper()
				body := tt.record(i)
				r, err := wcl.do(ctx, http.MethodPost, name, "", http.Header{"Content-Type": {tt.ct}}, body)
				if err != nil || r.status/100 != 2 {
					t.Fatalf("append %d: %v %v", i, r, err)
				}
			}
			for i := 0; i < records; i++ {
				want = append(want, tt.record(i)...)
			}
			for i := 0; i < records; {
				if i%20 >= 10 {
					// A burst: ten appends at once, so feeds wake to
					// several records.
					var bwg sync.WaitGroup
					for j := i; j < i+10; j++ {
						bwg.Add(1)
						go func() { defer bwg.Done(); post(j) }()
						time.Sleep(time.Millisecond)
					}
					bwg.Wait()
					i += 10
					continue
				}
				post(i)
				i++
				if i > records/2 && len(subs) == early {
					start(late)
				}
			}
			if len(subs) != early+late {
				t.Fatalf("%d subscribers, want %d", len(subs), early+late)
			}
			// The burst posts may have landed out of order; what the
			// subscribers must match is the stream as stored.
			stored, _, err := wcl.readAll(name, 30*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if len(stored) != len(want) {
				t.Fatalf("stream holds %d bytes, %d were appended", len(stored), len(want))
			}
			done := waitFor(60*time.Second, func() bool {
				for _, s := range subs {
					s.mu.Lock()
					n := len(s.received)
					s.mu.Unlock()
					if n < len(stored) {
						return false
					}
				}
				return true
			})
			stopSubs()
			wg.Wait()
			for i, s := range subs {
				if len(s.errs) > 0 {
					t.Errorf("subscriber %d: %v", i, s.errs)
				}
				if !bytes.Equal(s.received, stored) {
					t.Errorf("subscriber %d received %d bytes, first difference at %d; the stream holds %d (all done: %v)",
						i, len(s.received), firstDiff(s.received, stored), len(stored), done)
				}
			}
		})
	}
}

func openCount(subs []*subscriber) int {
	n := 0
	for _, s := range subs {
		s.mu.Lock()
		if s.open {
			n++
		}
		s.mu.Unlock()
	}
	return n
}
