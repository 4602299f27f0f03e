package picomq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// waitFeedAt waits until hf has everything up to want written.
func waitFeedAt(t *testing.T, i int, hf *hubFeed, want position) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		hf.mu.Lock()
		at := hf.next
		hf.mu.Unlock()
		if at == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("feed %d at %s, want %s", i, at, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A write that does not finish (the client stopped reading) must not hold
// the hub's other feeds: they get this record and the next while it is
// still stuck, and its feed leaves the hub. When the write ends, the feed
// is let go to go on by itself from where the write left it (the client was
// slow) or as broken (the client was gone), having got the stuck record
// once and nothing after it. With one writer for the pass and with several.
func TestHubTakesStalledFeedOut(t *testing.T) {
	many := 64*runtime.GOMAXPROCS(0) + 10
	for _, c := range []struct {
		name  string
		feeds int
		fail  error
		want  error
	}{
		{"slow client, one writer", 10, nil, errHubStopped},
		{"gone client, one writer", 10, errors.New("write timed out"), errFeedBroken},
		{"slow client, several writers", many, nil, errHubStopped},
		{"gone client, several writers", many, errors.New("write timed out"), errFeedBroken},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, eng, key, pos := newHubStream(t)
			src := dsHubSource{d: s.proto, eng: eng, key: key}
			stuck := &stallWriter{ResponseRecorder: httptest.NewRecorder(), entered: make(chan struct{}), release: make(chan struct{}), fail: c.fail}
			released := false
			release := func() {
				if !released {
					close(stuck.release)
					released = true
				}
			}
			t.Cleanup(release)
			stalled := fakeHubFeed(stuck, "c", pos)
			var healthy []*hubFeed
			var recs []*httptest.ResponseRecorder
			for i := range c.feeds - 1 {
				recs = append(recs, httptest.NewRecorder())
				healthy = append(healthy, fakeHubFeed(recs[i], "c", pos))
			}
			for _, hf := range append([]*hubFeed{stalled}, healthy...) {
				if s.proto.hubs.park(src, eng, key, pos, hf) == nil {
					t.Fatal("not parked")
				}
			}

			s.do(t, "POST", "/s", "one", ct, "text/plain").want(t, 204)
			select {
			case <-stuck.entered:
			case <-time.After(5 * time.Second):
				t.Fatal("the hub never wrote to the stalled feed")
			}
			for i, hf := range healthy {
				waitFeedAt(t, i, hf, position{pos.seq + 1, 0})
			}
			s.waitParked(t, c.feeds-1, 1) // the stalled feed left the hub
			s.do(t, "POST", "/s", "two", ct, "text/plain").want(t, 204)
			for i, hf := range healthy {
				waitFeedAt(t, i, hf, position{pos.seq + 2, 0})
			}
			select {
			case <-stalled.done:
				t.Fatalf("the stalled feed was let go (%v) before its write ended", stalled.ended)
			default:
			}

			release()
			select {
			case <-stalled.done:
			case <-time.After(5 * time.Second):
				t.Fatal("the stalled feed was not let go once its write ended")
			}
			stalled.mu.Lock()
			ended, next, body, writes := stalled.ended, stalled.next, stuck.Body.String(), stuck.n
			stalled.mu.Unlock()
			if !errors.Is(ended, c.want) {
				t.Errorf("let go with %v, want %v", ended, c.want)
			}
			wantNext, wantBody := pos, ""
			if c.fail == nil {
				wantNext = position{pos.seq + 1, 0}
				wantBody = "event: data\ndata:one\n\n"
			}
			if next != wantNext || !strings.HasPrefix(body, wantBody) || strings.Contains(body, "two") || writes != 1 {
				t.Errorf("the stalled feed is at %s after %d writes of %q; want it at %s with %q and nothing after",
					next, writes, body, wantNext, wantBody)
			}
			for i, rec := range recs {
				if b := rec.Body.String(); strings.Count(b, "event: data") != 2 || !strings.Contains(b, "data:one\n") || !strings.Contains(b, "data:two\n") {
					t.Fatalf("healthy feed %d got %q", i, b)
				}
			}
		})
	}
}

// pausableConn is a client connection whose reads can be held, as a client
// that stops reading for a while.
type pausableConn struct {
	net.Conn
	mu     sync.Mutex
	resume chan struct{} // nil while reading
}

func (c *pausableConn) Read(b []byte) (int, error) {
	c.mu.Lock()
	ch := c.resume
	c.mu.Unlock()
	if ch != nil {
		<-ch
	}
	n, err := c.Conn.Read(b)
	return n, err
}

func (c *pausableConn) pause() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.resume == nil {
		c.resume = make(chan struct{})
	}
}

func (c *pausableConn) unpause() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.resume != nil {
		close(c.resume)
		c.resume = nil
	}
}

// pausableClient is an HTTP client whose one connection has a small
// receive buffer, so that it fills soon once reads are held.
func pausableClient(t *testing.T) (*http.Client, func() *pausableConn) {
	t.Helper()
	var mu sync.Mutex
	var conn *pausableConn
	tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		// The buffer is set before the connection is made: shrunk after
		// the handshake, it holds less than the window already offered,
		// and the sender's segments beyond it are dropped and resent on
		// a backed-off timer, which stalls the reader once it reads again.
		d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
			var serr error
			if err := rc.Control(func(fd uintptr) {
				serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4<<10)
			}); err != nil {
				return err
			}
			return serr
		}}
		c, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		mu.Lock()
		defer mu.Unlock()
		conn = &pausableConn{Conn: c}
		return conn, nil
	}}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}, func() *pausableConn {
		mu.Lock()
		defer mu.Unlock()
		return conn
	}
}

// A client that stops reading while large records arrive fills its socket,
// and a hub write to it cannot finish. The reader beside it gets every
// record meanwhile. A client that was only slow (it reads again within
// the write timeout) keeps its response and gets every record once, in
// order, and its feed parks in the hub again; one that stays away past the
// write timeout has its response ended, and resumes where its last control
// event said.
func TestSSEStalledReaderHoldsNoOneUp(t *testing.T) {
	const records, size = 24, 256 << 10 // 6 MiB: more than the sockets between them hold
	for _, c := range []struct {
		name         string
		writeTimeout time.Duration
		gone         bool
	}{
		{"slow for a moment", time.Minute, false},
		{"gone", 500 * time.Millisecond, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := newDSServer(t, func(d *durableStreams) {
				d.writeTimeout = c.writeTimeout
				d.sseInterval = 5 * time.Minute
				d.maxAppend = 2 * size
				d.live = &liveReaders{}
			})
			s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201)
			client, conn := pausableClient(t)
			slow := openSSE(t, client, s.URL+"/s?offset=-1&live=sse")
			// Before openSSE's cleanup, which waits for its reader.
			t.Cleanup(func() { conn().unpause() })
			healthy := s.sse(t, "/s?offset=-1&live=sse")
			for _, r := range []*sseReader{slow, healthy} {
				if c := r.control(t); !c.UpToDate {
					t.Fatalf("first control %+v", c)
				}
			}
			s.waitParked(t, 2, 1)

			conn().pause()
			var want []string // the records, in order
			for i := range records {
				rec := strings.Repeat(fmt.Sprintf("%c", 'a'+i%26), size)
				want = append(want, rec)
				s.do(t, "POST", "/s", rec, ct, "text/plain").want(t, 204)
				if ev := healthy.next(t); ev.typ != "data" || ev.data != rec {
					t.Fatalf("record %d: the healthy reader got a %s event of %d bytes", i, ev.typ, len(ev.data))
				}
				if c := healthy.control(t); c.StreamNextOffset != (position{uint64(i + 1), 0}).String() {
					t.Fatalf("record %d: control %+v", i, c)
				}
			}
			s.waitParked(t, 1, 1) // the slow feed's write is stuck, out of the hub
			tail := position{records, 0}.String()

			if c.gone {
				deadline := time.Now().Add(10 * c.writeTimeout)
				for s.proto.live.sse.Load() != 1 {
					if time.Now().After(deadline) {
						t.Fatalf("%d SSE responses open %v after the stall, want the stalled one ended", s.proto.live.sse.Load(), 10*c.writeTimeout)
					}
					time.Sleep(10 * time.Millisecond)
				}
			}
			conn().unpause()
			// Data counts once a control event confirms it; an event the
			// connection's end cut short is no event.
			var got, pending strings.Builder
			last := (position{}).String()
			readUntil := func(next func() *sseEvent) {
				t.Helper()
				for last != tail {
					ev := next()
					if ev == nil {
						return
					}
					if ev.typ == "data" {
						pending.WriteString(ev.data)
						continue
					}
					var ctl sseControl
					if err := json.Unmarshal([]byte(ev.data), &ctl); err != nil {
						t.Fatal(err)
					}
					got.WriteString(pending.String())
					pending.Reset()
					if n := got.Len(); n%size != 0 || ctl.StreamNextOffset != (position{uint64(n / size), 0}).String() {
						t.Fatalf("after %d bytes, control %+v", n, ctl)
					}
					last = ctl.StreamNextOffset
				}
			}
			readUntil(func() *sseEvent { return nextOrEnd(t, slow) })
			if c.gone {
				if last == tail {
					t.Fatal("the stalled response went on to the tail, want it ended")
				}
				// Reconnect where the last control event said.
				pending.Reset()
				r := s.sse(t, "/s?offset="+last+"&live=sse")
				readUntil(func() *sseEvent { ev := r.next(t); return &ev })
			}
			if all := strings.Join(want, ""); got.String() != all {
				t.Fatalf("the stalled reader got %d bytes, first difference at %d; want %d", got.Len(), firstDiffString(got.String(), all), len(all))
			}
			if !c.gone {
				select {
				case <-slow.done:
					t.Fatal("the slow reader's response ended")
				default:
				}
				s.waitParked(t, 2, 1) // caught up and back in the hub
			}
		})
	}
}

// nextOrEnd is the reader's next event, or nil when its response ended.
func nextOrEnd(t *testing.T, r *sseReader) *sseEvent {
	t.Helper()
	select {
	case ev := <-r.events:
		return &ev
	case <-r.done:
		select {
		case ev := <-r.events:
			return &ev
		default:
			return nil
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no SSE event within 10s")
		return nil
	}
}

func firstDiffString(a, b string) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}
