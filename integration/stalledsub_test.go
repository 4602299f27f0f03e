package integration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// timedFeed is one SSE response read to its end, with when each control
// event arrived.
type timedFeed struct {
	mu       sync.Mutex
	data     []byte        // data confirmed by a control event
	offsets  []string      // streamNextOffset of each control event
	arrivals []time.Time   // when each control event was read
	started  chan struct{} // closed at the first control event
	err      error         // why the response ended, unless the test ended it
}

// read follows name from offset over one SSE response until ctx ends.
func (f *timedFeed) read(ctx context.Context, c *dsClient, name, offset string) {
	fail := func(err error) {
		f.mu.Lock()
		f.err = err
		f.mu.Unlock()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+name+"?offset="+url.QueryEscape(offset)+"&live=sse", nil)
	if err != nil {
		fail(err)
		return
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		fail(err)
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		fail(fmt.Errorf("GET: %d", resp.StatusCode))
		return
	}
	br := bufio.NewReader(resp.Body)
	var pending []byte
	for first := true; ; {
		ev, err := readSSEEvent(br)
		if err != nil {
			if ctx.Err() == nil {
				fail(err)
			}
			return
		}
		switch ev.event {
		case "data":
			pending = append(pending, ev.data...)
		case "control":
			var ctl sseControl
			if err := json.Unmarshal([]byte(ev.data), &ctl); err != nil {
				fail(fmt.Errorf("control event %q: %w", ev.data, err))
				return
			}
			f.mu.Lock()
			f.data = append(f.data, pending...)
			f.offsets = append(f.offsets, ctl.StreamNextOffset)
			f.arrivals = append(f.arrivals, time.Now())
			f.mu.Unlock()
			pending = nil
			if first {
				close(f.started)
				first = false
			}
		}
	}
}

// arrival is when the feed first had everything up to offset, and whether
// it did.
func (f *timedFeed) arrival(offset string) (time.Time, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, o := range f.offsets {
		if o >= offset {
			return f.arrivals[i], true
		}
	}
	return time.Time{}, false
}

// openSSESubscribers is the picomq_open_subscribers gauge for SSE reads.
func openSSESubscribers(c *caddytest.Caddy) (float64, error) {
	s, err := mGet(c.AdminAddr())
	if err != nil {
		return 0, err
	}
	return s.sum("picomq_open_subscribers", "mode", "sse"), nil
}

// TestSSEStalledSubscriberHoldsNoOneUp: one subscriber of a stream stops
// reading (a raw connection with a small receive buffer that is never
// read, as a phone that lost its network without a FIN), beside healthy
// ones, while large records are appended. Once its socket is full, a write
// to it cannot finish until the feed write timeout (10 s); the healthy
// subscribers must not wait for it. Each gets every record exactly once,
// none arrives at any of them later than a quarter of that timeout after
// its append was sent, and the stalled client's response is ended within
// the timeout.
func TestSSEStalledSubscriberHoldsNoOneUp(t *testing.T) {
	const (
		healthy = 20
		records = 48
		size    = 128 << 10 // 6 MiB in all: more than the stalled socket's buffers hold
	)
	v := testenv.NewVersity(t)
	c := caddytest.Start(t, caddyOptions(v, caddytest.S3Storage(t, v, v.Endpoint)))
	wcl := newClient(t, c.URL(), true)
	scl := newClient(t, c.URL(), true)
	const name = "/fanout/stalled"
	wcl.create(t, name, 30*time.Second)
	tail, err := wcl.tail(name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	subCtx, stopSubs := context.WithCancel(ctx)
	var wg sync.WaitGroup
	t.Cleanup(func() { stopSubs(); wg.Wait() })
	feeds := make([]*timedFeed, healthy)
	for i := range feeds {
		feeds[i] = &timedFeed{started: make(chan struct{})}
		wg.Go(func() { feeds[i].read(subCtx, scl, name, tail) })
	}
	for i, f := range feeds {
		select {
		case <-f.started:
		case <-time.After(20 * time.Second):
			t.Fatalf("subscriber %d got no first control event: %v", i, f.err)
		}
	}

	// The stalled client: it sends its request and never reads a byte.
	conn, err := net.Dial("tcp", strings.TrimPrefix(c.URL(), "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	if err := conn.(*net.TCPConn).SetReadBuffer(4 << 10); err != nil {
		t.Fatal(err)
	}
	if _, err := fmt.Fprintf(conn, "GET %s?offset=%s&live=sse HTTP/1.1\r\nHost: %s\r\n\r\n", name, url.QueryEscape(tail), strings.TrimPrefix(c.URL(), "http://")); err != nil {
		t.Fatal(err)
	}
	if !waitFor(20*time.Second, func() bool { n, err := openSSESubscribers(c); return err == nil && n == healthy+1 }) {
		n, err := openSSESubscribers(c)
		t.Fatalf("%v SSE subscribers open (%v), want %d", n, err, healthy+1)
	}

	sent := make([]time.Time, records)
	offsets := make([]string, records)
	acked := make([]time.Time, records)
	var want []byte
	for i := range records {
		body := bytes.Repeat([]byte{'a' + byte(i%26)}, size)
		want = append(want, body...)
		sent[i] = time.Now()
		r, err := wcl.appendBody(ctx, name, body)
		if err != nil || r.status/100 != 2 || r.next() == "" {
			t.Fatalf("append %d: %v %v", i, r, err)
		}
		offsets[i] = r.next()
		acked[i] = time.Now()
		// Pacing, as a producer's: each append has a pass of its own.
		time.Sleep(50 * time.Millisecond)
	}

	// Every healthy subscriber gets every record.
	last := offsets[records-1]
	if !waitFor(60*time.Second, func() bool {
		for _, f := range feeds {
			if _, ok := f.arrival(last); !ok {
				return false
			}
		}
		return true
	}) {
		for i, f := range feeds {
			if _, ok := f.arrival(last); !ok {
				f.mu.Lock()
				t.Errorf("subscriber %d has %d of %d bytes (%v)", i, len(f.data), len(want), f.err)
				f.mu.Unlock()
			}
		}
		t.FailNow()
	}
	var lat []time.Duration
	worst, worstAt := time.Duration(0), 0
	for i, f := range feeds {
		f.mu.Lock()
		if f.err != nil || !bytes.Equal(f.data, want) {
			t.Errorf("subscriber %d (%v) received %d bytes, first difference at %d; %d were appended",
				i, f.err, len(f.data), firstDiff(f.data, want), len(want))
		}
		f.mu.Unlock()
		for j := range records {
			at, _ := f.arrival(offsets[j])
			d := at.Sub(sent[j])
			lat = append(lat, d)
			if d > worst {
				worst, worstAt = d, j
			}
		}
	}
	var acks []time.Duration
	for j := range records {
		acks = append(acks, acked[j].Sub(sent[j]))
	}
	slices.Sort(acks)
	slices.Sort(lat)
	pct := func(p float64) time.Duration { return lat[int(p*float64(len(lat)-1))].Round(time.Millisecond) }
	over := len(lat) - sort.Search(len(lat), func(i int) bool { return lat[i] > 100*time.Millisecond })
	t.Logf("append to receipt over %d deliveries: p50 %v, p99 %v, max %v (record %d), %d over 100 ms; append acks: p50 %v, max %v",
		len(lat), pct(0.5), pct(0.99), worst.Round(time.Millisecond), worstAt, over,
		acks[len(acks)/2].Round(time.Millisecond), acks[len(acks)-1].Round(time.Millisecond))
	if limit := feedWriteTimeout / 4; worst > limit {
		t.Errorf("record %d reached a healthy subscriber %v after its append: the feeds waited for the stalled one (more than %v)",
			worstAt, worst.Round(time.Millisecond), limit)
	}

	// The stalled client is let go: its response ends within the write
	// timeout of the write it stopped.
	if !waitFor(feedWriteTimeout+10*time.Second, func() bool { n, err := openSSESubscribers(c); return err == nil && n == healthy }) {
		n, err := openSSESubscribers(c)
		t.Errorf("%v SSE subscribers open (%v), want %d: the stalled client was kept", n, err, healthy)
	}
	stopSubs()
	wg.Wait()
	for i, f := range feeds {
		if f.err != nil && !errors.Is(f.err, context.Canceled) {
			t.Errorf("subscriber %d: %v", i, f.err)
		}
	}
}
