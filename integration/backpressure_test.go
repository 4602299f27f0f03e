package integration

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// While the store stalls, appends stop joining once the bytes waiting for
// it reach max_pending: each further append is answered 503 with
// Retry-After at once, and nothing of it is ever stored. The appends that
// joined are acknowledged when the store comes back, and the stream holds
// exactly them.
func TestAppendsRefusedPastMaxPending(t *testing.T) {
	const (
		maxPending = 64 << 10
		size       = 16 << 10
		appends    = 16
		path       = "/busy/stream"
	)
	e := fhStart(t, fhOptions{
		Directives: []string{"max_pending 64KiB"},
		Optional:   []string{"compact_interval 1h"},
	})
	e.create(path, "application/octet-stream")

	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/"})
	released := false
	defer func() {
		if !released {
			release()
		}
	}()

	bodies := make([][]byte, appends)
	results := make([]fhResp, appends)
	errs := make([]error, appends)
	done := make(chan int, appends)
	var wg sync.WaitGroup
	for i := range appends {
		bodies[i] = bytes.Repeat([]byte{byte('a' + i)}, size)
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = e.send(fhReq{Method: http.MethodPost, Path: path,
				Header: map[string]string{"Content-Type": "application/octet-stream"}, Body: bodies[i]})
			done <- i
		}()
		// One at a time, so that the first ones join whatever the
		// scheduling: the refusals are the later ones.
		time.Sleep(20 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := e.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("no WAL upload reached the store: %v", err)
	}

	// 64 KiB holds fewer than five appends of 16 KiB with their framing,
	// so at most five join; every other one must be answered while the
	// store is still stalled.
	refused := map[int]bool{}
	for len(refused) < appends-5 {
		select {
		case i := <-done:
			if errs[i] != nil {
				t.Fatalf("append %d: %v", i, errs[i])
			}
			r := results[i]
			if r.Status != http.StatusServiceUnavailable || r.Header.Get("Retry-After") == "" ||
				!strings.Contains(string(r.Body), "too many appends are waiting for storage") {
				t.Fatalf("append %d answered while the store stalled: %s (Retry-After %q), want 503 busy",
					i, r, r.Header.Get("Retry-After"))
			}
			if r.Took > 5*time.Second {
				t.Errorf("append %d refused after %s, want at once", i, r.Took)
			}
			refused[i] = true
		case <-ctx.Done():
			t.Fatalf("only %d of %d appends refused while the store stalled", len(refused), appends)
		}
	}
	s, err := mGet(e.caddy.AdminAddr())
	if err != nil {
		t.Fatalf("metrics: %v", err)
	}
	if got := s.sum("picomq_appends_refused_busy_total"); got < float64(len(refused)) {
		t.Errorf("picomq_appends_refused_busy_total = %v, want at least %d", got, len(refused))
	}
	if got := s.sum("picomq_wal_pending_bytes"); got < maxPending {
		t.Errorf("picomq_wal_pending_bytes = %v while refusing, want at least %d", got, maxPending)
	}

	release()
	released = true
	wg.Wait()
	close(done)
	for i := range done {
		if errs[i] != nil {
			t.Fatalf("append %d: %v", i, errs[i])
		}
		switch r := results[i]; {
		case r.Status/100 == 2:
		case r.Status == http.StatusServiceUnavailable && strings.Contains(string(r.Body), "too many appends are waiting for storage"):
			refused[i] = true // refused too, answered after the count above
		default:
			t.Errorf("append %d after the store came back: %s, want 2xx (or the busy 503)", i, r)
		}
	}

	var want []byte
	for i := range appends {
		if !refused[i] {
			want = append(want, bodies[i]...)
		}
	}
	got, _, err := e.readBytes(path)
	if err != nil {
		t.Fatalf("read back: %v", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("stream holds %d bytes (%s), want the %d accepted appends in order (%d bytes)",
			len(got), runsOf(got), appends-len(refused), len(want))
	}
	t.Logf("store stalled: %d of %d appends of %d KiB joined, %d refused with 503 at once; all joined ones acknowledged once it came back",
		appends-len(refused), appends, size>>10, len(refused))
}

// runsOf describes b as runs of one repeated byte ("a x16384, b x16384").
func runsOf(b []byte) string {
	var parts []string
	for len(b) > 0 {
		n := 1
		for n < len(b) && b[n] == b[0] {
			n++
		}
		parts = append(parts, fmt.Sprintf("%c x%d", b[0], n))
		b = b[n:]
	}
	return strings.Join(parts, ", ")
}
