package picomq

import (
	"bufio"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/internal/picowire"
	"github.com/picomq/caddy-picomq/streamstore"
)

// parked counts the feeds parked in hs, and the hubs.
func parked(hs *sseHubs) (feeds, hubs int) {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	for _, h := range hs.hubs {
		h.mu.Lock()
		feeds += len(h.feeds)
		h.mu.Unlock()
	}
	return feeds, len(hs.hubs)
}

// waitParked waits until want feeds are parked in want hubs of hs.
func waitParked(t *testing.T, hs *sseHubs, feeds, hubs int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		f, h := parked(hs)
		if f == feeds && h == hubs {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d feeds parked in %d hubs, want %d in %d", f, h, feeds, hubs)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (s *dsServer) waitParked(t *testing.T, feeds, hubs int) {
	t.Helper()
	waitParked(t, s.proto.hubs, feeds, hubs)
}

// A feed parked at a quiet stream's tail gets its control event again at
// every keep-alive interval, so that a proxy that closes idle connections
// does not cut it; an append after that reaches it as before.
func TestSSEHubKeepsQuietFeedsAlive(t *testing.T) {
	s := newDSServer(t)
	s.proto.hubs.keepAlive = 200 * time.Millisecond
	s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201)
	r := s.sse(t, "/s?offset=now&live=sse")
	first := r.control(t)
	if !first.UpToDate {
		t.Fatalf("first control %+v", first)
	}
	s.waitParked(t, 1, 1)
	began := time.Now()
	for i := range 3 {
		c := r.control(t)
		if !c.UpToDate || c.StreamNextOffset != first.StreamNextOffset || c.StreamCursor == "" {
			t.Fatalf("keep-alive %d: control %+v, want the tail's, up to date", i, c)
		}
	}
	if took := time.Since(began); took < 400*time.Millisecond {
		t.Errorf("three keep-alives in %s: sooner than the interval", took)
	}
	s.do(t, "POST", "/s", "one", ct, "text/plain").want(t, 204)
	for {
		ev := r.next(t)
		if ev.typ == "control" {
			continue // a keep-alive written before the append
		}
		if ev.typ != "data" || ev.data != "one" {
			t.Fatalf("after the keep-alives: event %+v, want the record", ev)
		}
		break
	}
	if c := r.control(t); c.StreamNextOffset != (position{1, 0}).String() {
		t.Fatalf("control after the record %+v", c)
	}
}

// Feeds at the tail park in the stream's hub, which writes each append to
// all of them; one that leaves does not disturb the others; the close
// reaches every feed and ends it, and the hub with them.
func TestSSEHubServesTailFeeds(t *testing.T) {
	const n = 20
	s := newDSServer(t)
	s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201)
	readers := make([]*sseReader, n)
	for i := range readers {
		readers[i] = s.sse(t, "/s?offset=now&live=sse")
		if c := readers[i].control(t); !c.UpToDate {
			t.Fatalf("first control %+v", c)
		}
	}
	s.waitParked(t, n, 1)

	for i, rec := range []string{"one", "two", "three"} {
		s.do(t, "POST", "/s", rec, ct, "text/plain").want(t, 204)
		for j, r := range readers {
			if ev := r.next(t); ev.typ != "data" || ev.data != rec {
				t.Fatalf("reader %d, record %d: event %+v", j, i, ev)
			}
			if c := r.control(t); c.StreamNextOffset != (position{uint64(i + 1), 0}).String() || !c.UpToDate || c.StreamCursor == "" {
				t.Fatalf("reader %d, record %d: control %+v", j, i, c)
			}
		}
	}
	s.waitParked(t, n, 1) // still parked: no feed took its own turn

	readers[0].res.Body.Close()
	s.waitParked(t, n-1, 1)
	s.do(t, "POST", "/s", "four", ct, "text/plain").want(t, 204)
	for _, r := range readers[1:] {
		if ev := r.next(t); ev.data != "four" {
			t.Fatalf("after a reader left: event %+v", ev)
		}
		r.control(t)
	}

	s.do(t, "POST", "/s", "", "Stream-Closed", "true").want(t, 204)
	for j, r := range readers[1:] {
		if c := r.control(t); !c.StreamClosed || c.StreamCursor != "" || c.StreamNextOffset != (position{4, 0}).String() {
			t.Errorf("reader %d: close control %+v", j+1, c)
		}
		r.ends(t, 2*time.Second)
	}
	s.waitParked(t, 0, 0)
}

// A hub lets its feeds go when their time is up (they recycle), when the
// stream is deleted (each finds out alone and ends) and at shutdown (each
// writes its final control event).
func TestSSEHubLetsFeedsGo(t *testing.T) {
	// Long enough for both to be seen parked before they recycle, on a
	// busy machine too.
	s := newDSServer(t, func(d *durableStreams) { d.sseInterval = time.Second })
	s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201)
	a, b := s.sse(t, "/s?offset=now&live=sse"), s.sse(t, "/s?offset=now&live=sse")
	a.control(t)
	b.control(t)
	s.waitParked(t, 2, 1)
	a.ends(t, 3*time.Second)
	b.ends(t, 3*time.Second)
	s.waitParked(t, 0, 0)

	s.proto.sseInterval = time.Minute
	a = s.sse(t, "/s?offset=now&live=sse")
	a.control(t)
	s.waitParked(t, 1, 1)
	s.do(t, "DELETE", "/s", "").want(t, 204)
	a.ends(t, 2*time.Second)
	s.waitParked(t, 0, 0)

	s.do(t, "PUT", "/t", "", ct, "text/plain").want(t, 201)
	a = s.sse(t, "/t?offset=now&live=sse")
	a.control(t)
	s.waitParked(t, 1, 1)
	s.shutdown()
	if c := a.control(t); c.StreamNextOffset != (position{}).String() || !c.UpToDate {
		t.Errorf("shutdown control %+v", c)
	}
	a.ends(t, 2*time.Second)
	s.waitParked(t, 0, 0)
}

// A feed whose write fails is let go and dropped; the others get the
// event, and the hub goes on with them.
func TestSSEHubDropsBrokenFeed(t *testing.T) {
	s, eng, key, pos := newHubStream(t)

	type fakeFeed struct {
		hf  *hubFeed
		rec *httptest.ResponseRecorder
	}
	newFeed := func(w http.ResponseWriter, cursor string) *hubFeed { return fakeHubFeed(w, cursor, pos) }
	var good []fakeFeed
	for i := 0; i < 3; i++ {
		rec := httptest.NewRecorder()
		good = append(good, fakeFeed{newFeed(rec, "c1"), rec})
	}
	broken := newFeed(failingWriter{}, "c1")
	var hub *sseHub
	for _, hf := range []*hubFeed{good[0].hf, broken, good[1].hf, good[2].hf} {
		h := s.proto.hubs.park(dsHubSource{d: s.proto, eng: eng, key: key}, eng, key, pos, hf)
		if h == nil || (hub != nil && h != hub) {
			t.Fatalf("park: hub %p, first %p", h, hub)
		}
		hub = h
	}
	s.do(t, "POST", "/s", "x", ct, "text/plain").want(t, 204)
	select {
	case <-broken.done:
	case <-time.After(5 * time.Second):
		t.Fatal("the broken feed was not let go")
	}
	if !errors.Is(broken.ended, errFeedBroken) {
		t.Errorf("broken feed ended with %v", broken.ended)
	}
	s.waitParked(t, 3, 1)
	want := (position{pos.seq + 1, 0}).String()
	// The broken feed may have come first in the pass: wait for the rest.
	for i, g := range good {
		deadline := time.Now().Add(5 * time.Second)
		for {
			g.hf.mu.Lock()
			at := g.hf.next.String()
			g.hf.mu.Unlock()
			if at == want {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("feed %d still at %s, want %s", i, at, want)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	for i, g := range good {
		if got := hub.leave(g.hf); got != nil {
			t.Errorf("feed %d had been let go: %v", i, got)
		}
		if g.hf.next.String() != want || g.rec.Body.Len() == 0 {
			t.Errorf("feed %d at %s with %q, want it at %s", i, g.hf.next, g.rec.Body.String(), want)
		}
	}
	s.waitParked(t, 0, 0)
	// Parking away from the hub's position is refused while it runs, and
	// a feed at the tail again starts a hub afresh.
	if h := s.proto.hubs.park(dsHubSource{d: s.proto, eng: eng, key: key}, eng, key, pos, newFeed(httptest.NewRecorder(), "c1")); h == nil {
		t.Fatal("no hub for a feed at the old tail of an idle stream")
	} else if h2 := s.proto.hubs.park(dsHubSource{d: s.proto, eng: eng, key: key}, eng, key, position{pos.seq + 5, 0}, newFeed(httptest.NewRecorder(), "c1")); h2 != nil {
		t.Error("a feed at another position was parked")
	}
}

// newHubStream is a server with an empty text stream /s, for tests that
// park feeds of their own: its engine, its hub key and its tail.
func newHubStream(t testing.TB) (*dsServer, *streamstore.Engine, hubKey, position) {
	t.Helper()
	s := newDSServer(t)
	s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201)
	eng, _ := s.proto.engine(context.Background())
	info, err := eng.Head(context.Background(), "/s")
	if err != nil {
		t.Fatal(err)
	}
	return s, eng, hubKey{name: "/s", id: info.ID, enc: sseText}, position{info.NextSeq, 0}
}

// fakeHubFeed is a feed at pos that writes its events to w.
func fakeHubFeed(w http.ResponseWriter, cursor string, pos position) *hubFeed {
	es := &eventStream{out: w, rc: http.NewResponseController(w)}
	var mu sync.Mutex
	return &hubFeed{es: es, cursor: cursor, next: pos, done: make(chan struct{}), limit: es.rc.SetWriteDeadline,
		write: func(f *sseFrame) bool {
			mu.Lock()
			defer mu.Unlock()
			return es.write(appendSSEControl(append([]byte(nil), f.data...), frameControl(f, cursor))) && es.flush()
		}}
}

// A hub writes a frame only to feeds at the frame's start: a feed anywhere
// else (which one run at a time never leaves behind) goes on alone rather
// than get a gap or a repeat.
func TestSSEHubWritesOnlyAtTheFeedsPosition(t *testing.T) {
	s, eng, key, pos := newHubStream(t)
	rec := httptest.NewRecorder()
	hf := fakeHubFeed(rec, "c", pos)
	if s.proto.hubs.park(dsHubSource{d: s.proto, eng: eng, key: key}, eng, key, pos, hf) == nil {
		t.Fatal("not parked")
	}
	hf.mu.Lock()
	hf.next = position{pos.seq + 7, 0}
	hf.mu.Unlock()
	s.do(t, "POST", "/s", "x", ct, "text/plain").want(t, 204)
	select {
	case <-hf.done:
	case <-time.After(5 * time.Second):
		t.Fatal("the misplaced feed was not let go")
	}
	if !errors.Is(hf.ended, errHubStopped) || rec.Body.Len() != 0 {
		t.Errorf("ended with %v after writing %q", hf.ended, rec.Body.String())
	}
	s.waitParked(t, 0, 0)
}

// Feeds parked in one hub share each data event but not their cursors:
// every control event carries the feed's own, and one that a client sent
// ahead of the clock stays ahead of it (section 10.1: a cursor that went
// back would let a CDN answer the feed's next request from its cache, in a
// loop). A pass encodes the control event of each cursor once, up to
// maxPassVariants of them, and past that each feed encodes its own; both
// ways are checked.
func TestSSEHubFeedsKeepTheirOwnCursors(t *testing.T) {
	for _, tc := range []struct {
		name  string
		ahead int // feeds with a cursor of their own ahead of the clock
	}{
		{"fewer cursors than a pass encodes", 3},
		{"more cursors than a pass encodes", maxPassVariants + 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newDSServer(t)
			s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201)
			type feed struct {
				r      *sseReader
				sent   uint64 // the cursor the client sent; 0: none
				cursor string // the one the feed's first control event gave
			}
			// Sent cursors lie further apart than the jitter moves one
			// (cursorMaxJitter seconds), so every feed's own is distinct;
			// the last two feeds send none and share the clock's.
			now := cursorAt(time.Now())
			feeds := make([]feed, tc.ahead+2)
			for i := range feeds {
				query := "/s?offset=now&live=sse"
				if i < tc.ahead {
					feeds[i].sent = now + uint64(i+1)*1000
					query += "&cursor=" + strconv.FormatUint(feeds[i].sent, 10)
				}
				feeds[i].r = s.sse(t, query)
				c := feeds[i].r.control(t)
				feeds[i].cursor = c.StreamCursor
				if n, err := strconv.ParseUint(c.StreamCursor, 10, 64); err != nil || (feeds[i].sent > 0 && n <= feeds[i].sent) {
					t.Fatalf("feed %d sent cursor %d and got %q", i, feeds[i].sent, c.StreamCursor)
				}
			}
			s.waitParked(t, len(feeds), 1)
			for i, rec := range []string{"one", "two"} {
				s.do(t, "POST", "/s", rec, ct, "text/plain").want(t, 204)
				for j, f := range feeds {
					if ev := f.r.next(t); ev.typ != "data" || ev.data != rec {
						t.Fatalf("feed %d, record %d: event %+v", j, i, ev)
					}
					if c := f.r.control(t); c.StreamCursor != f.cursor {
						t.Errorf("feed %d, record %d: cursor %q, want the feed's own %q (it sent %d)", j, i, c.StreamCursor, f.cursor, f.sent)
					}
				}
			}
			s.waitParked(t, len(feeds), 1) // the hub wrote both records
		})
	}
}

type failingWriter struct{}

func (failingWriter) Header() http.Header       { return http.Header{} }
func (failingWriter) Write([]byte) (int, error) { return 0, errors.New("client gone") }
func (failingWriter) WriteHeader(int)           {}

// Pico feeds at the tail park in their stream's hub too, one hub per set of
// read limits: each append reaches every feed in the events its own reads
// would have made, a feed that leaves does not disturb the others, and the
// close ends them all, and the hubs with them.
func TestPicoSSEHubServesTailFeeds(t *testing.T) {
	const n = 10
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/h", nil, hCT, "application/octet-stream").want(t, 201)
	var whole, single []*picoSSE
	for range n {
		r := s.sse(t, "/pico/h?live=sse&seq=now")
		r.control(t, 0, true, false)
		whole = append(whole, r)
	}
	for range 2 {
		r := s.sse(t, "/pico/h?live=sse&seq=now&count=1")
		r.control(t, 0, true, false)
		single = append(single, r)
	}
	waitParked(t, s.pico.hubs, n+2, 2)

	batch := picowire.EncodeBinary([]picowire.Record{{Body: []byte("a")}, {Body: []byte("b")}, {Body: []byte("c")}})
	s.do(t, "POST", "/pico/h", batch, hCT, picowire.BinaryBatch).want(t, 200)
	for i, r := range whole {
		if recs := r.data(t, "3"); len(recs) != 3 || string(recs[0].bytes()) != "a" || string(recs[2].bytes()) != "c" {
			t.Fatalf("feed %d: records %+v", i, recs)
		}
		r.control(t, 3, true, false)
	}
	for i, r := range single {
		for seq := uint64(1); seq <= 3; seq++ {
			if recs := r.data(t, strconv.FormatUint(seq, 10)); len(recs) != 1 || recs[0].Seq != seq-1 {
				t.Fatalf("count=1 feed %d: records %+v", i, recs)
			}
			r.control(t, seq, seq == 3, false)
		}
	}
	waitParked(t, s.pico.hubs, n+2, 2) // still parked: no feed read alone

	whole[0].res.Body.Close()
	waitParked(t, s.pico.hubs, n+1, 2)
	s.do(t, "POST", "/pico/h", []byte("d"), hCT, "application/octet-stream").want(t, 200)
	for i, r := range append(whole[1:], single...) {
		if recs := r.data(t, "4"); len(recs) != 1 || string(recs[0].bytes()) != "d" {
			t.Fatalf("feed %d after one left: records %+v", i, recs)
		}
		r.control(t, 4, true, false)
	}

	s.do(t, "POST", "/pico/h", []byte("e"), hCT, "application/octet-stream", hdrPicoClosed, "true").want(t, 200)
	for _, r := range append(whole[1:], single...) {
		r.data(t, "5")
		r.control(t, 5, true, true)
		r.ends(t, 2*time.Second)
	}
	waitParked(t, s.pico.hubs, 0, 0)
}

// A hub lets Pico feeds go when their time is up (they recycle), when the
// stream is deleted (each finds out alone and ends) and at shutdown (each
// writes where to resume).
func TestPicoSSEHubLetsFeedsGo(t *testing.T) {
	s := newPicoServer(t, func(p *picoProtocol) { p.sseInterval = time.Second })
	s.do(t, "PUT", "/pico/g", []byte("a")).want(t, 201)
	a, b := s.sse(t, "/pico/g?live=sse&seq=now"), s.sse(t, "/pico/g?live=sse&seq=now")
	a.control(t, 1, true, false)
	b.control(t, 1, true, false)
	waitParked(t, s.pico.hubs, 2, 1)
	a.ends(t, 3*time.Second)
	b.ends(t, 3*time.Second)
	waitParked(t, s.pico.hubs, 0, 0)

	s.pico.sseInterval = time.Minute
	a = s.sse(t, "/pico/g?live=sse&seq=now")
	a.control(t, 1, true, false)
	waitParked(t, s.pico.hubs, 1, 1)
	s.do(t, "DELETE", "/pico/g", nil).want(t, 204)
	a.ends(t, 2*time.Second)
	waitParked(t, s.pico.hubs, 0, 0)

	s.do(t, "PUT", "/pico/k", []byte("a")).want(t, 201)
	a = s.sse(t, "/pico/k?live=sse&seq=now")
	a.control(t, 1, true, false)
	waitParked(t, s.pico.hubs, 1, 1)
	s.shutdown()
	a.control(t, 1, true, false)
	a.ends(t, 2*time.Second)
	waitParked(t, s.pico.hubs, 0, 0)
}

// gatedRecorder records a feed's writes, each held until gate closes; the
// first write says so on entered.
type gatedRecorder struct {
	*httptest.ResponseRecorder
	gate    chan struct{}
	entered *sync.Once
	signal  chan struct{}
}

func (g gatedRecorder) Write(b []byte) (int, error) {
	g.entered.Do(func() { close(g.signal) })
	<-g.gate
	return g.ResponseRecorder.Write(b)
}

// A record appended while a pass is under way reaches the feeds the pass
// has not written yet in the same write as the record before it, and the
// feeds it has written in a pass of their own: every feed gets both
// records once, in order, and more feeds than one slice means some of them
// get both in one event.
func TestSSEHubJoinsRecordsArrivingMidPass(t *testing.T) {
	const n = hubSlice + 44
	s, eng, key, pos := newHubStream(t)
	// The writes are held on purpose while "two" is appended: not a stall.
	s.proto.hubs.stallTick = time.Hour
	src := dsHubSource{d: s.proto, eng: eng, key: key}
	gate, signal, once := make(chan struct{}), make(chan struct{}), &sync.Once{}
	recs := make([]*httptest.ResponseRecorder, n)
	feeds := make([]*hubFeed, n)
	for i := range feeds {
		recs[i] = httptest.NewRecorder()
		feeds[i] = fakeHubFeed(gatedRecorder{recs[i], gate, once, signal}, "c", pos)
		if s.proto.hubs.park(src, eng, key, pos, feeds[i]) == nil {
			t.Fatalf("feed %d not parked", i)
		}
	}
	s.do(t, "POST", "/s", "one", ct, "text/plain").want(t, 204)
	select {
	case <-signal: // the pass for "one" is writing its first slice
	case <-time.After(5 * time.Second):
		t.Fatal("the hub wrote nothing")
	}
	s.do(t, "POST", "/s", "two", ct, "text/plain").want(t, 204)
	close(gate)

	want := position{pos.seq + 2, 0}
	deadline := time.Now().Add(10 * time.Second)
	joined := 0
	for i, hf := range feeds {
		for {
			hf.mu.Lock()
			next, body := hf.next, recs[i].Body.String()
			hf.mu.Unlock()
			if next == want {
				var data string
				events := 0
				for _, line := range strings.Split(body, "\n") {
					if line == "event: data" {
						events++
					}
					if d, ok := strings.CutPrefix(line, "data:"); ok && events > 0 && !strings.HasPrefix(d, "{") {
						data += strings.TrimPrefix(d, " ")
					}
				}
				if data != "onetwo" {
					t.Fatalf("feed %d got data %q in %d events, want \"onetwo\":\n%s", i, data, events, body)
				}
				if events == 1 {
					joined++
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("feed %d at %s, want %s", i, next, want)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	if joined == 0 || joined == n {
		t.Errorf("%d of %d feeds got both records in one event; want those of the pass's later slices only", joined, n)
	}
	t.Logf("%d of %d feeds got both records in one event", joined, n)
}

// discardFlusher takes a feed's writes and flushes without keeping them.
type discardFlusher struct{ h http.Header }

func (d discardFlusher) Header() http.Header         { return d.h }
func (d discardFlusher) Write(b []byte) (int, error) { return len(b), nil }
func (d discardFlusher) WriteHeader(int)             {}
func (d discardFlusher) Flush()                      {}

// BenchmarkSSEHubPass measures what a hub costs per append to 5,000 parked
// feeds whose writes go nowhere: the hub's own work, with the sockets left
// out. One op is one append written to every feed.
//
//	go test -run '^$' -bench SSEHubPass -benchmem .
func BenchmarkSSEHubPass(b *testing.B) {
	const n = 5000
	s, eng, key, pos := newHubStream(b)
	src := dsHubSource{d: s.proto, eng: eng, key: key}
	feeds := make([]*hubFeed, n)
	for i := range feeds {
		feeds[i] = fakeHubFeed(discardFlusher{http.Header{}}, "c", pos)
		if s.proto.hubs.park(src, eng, key, pos, feeds[i]) == nil {
			b.Fatalf("feed %d not parked", i)
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		s.do(b, "POST", "/s", "x", ct, "text/plain").want(b, 204)
		want := position{pos.seq + uint64(i) + 1, 0}
		for _, hf := range feeds {
			for {
				hf.mu.Lock()
				next := hf.next
				hf.mu.Unlock()
				if !next.before(want) {
					break
				}
				runtime.Gosched()
			}
		}
	}
}

// idleWriter wraps w as Caddy's server does by default: every write and
// flush moves the write deadline to a minute away.
func idleWriter(w http.ResponseWriter, d caddyhttp.IdleDeadline) *caddyhttp.IdleTimeoutWriter {
	return &caddyhttp.IdleTimeoutWriter{
		ResponseWriterWrapper: &caddyhttp.ResponseWriterWrapper{ResponseWriter: w},
		Ctrl:                  http.NewResponseController(w),
		Deadline:              d,
		Logger:                zap.NewNop(),
	}
}

// The hub skips Caddy's idle write timeout only where its own deadline is
// at least as strict, and only where nothing else must see the bytes.
func TestSkipIdleTimeout(t *testing.T) {
	const hubTimeout = 10 * time.Second
	rec := httptest.NewRecorder()
	plain := caddyhttp.IdleDeadline{Timeout: time.Minute}
	for _, c := range []struct {
		name string
		es   *eventStream
		want bool
	}{
		{"the response itself", &eventStream{out: rec}, false},
		{"Caddy's default idle timeout", &eventStream{out: idleWriter(rec, plain)}, true},
		{"idle timeout equal to the hub's", &eventStream{out: idleWriter(rec, caddyhttp.IdleDeadline{Timeout: hubTimeout})}, true},
		{"idle timeout shorter than the hub's", &eventStream{out: idleWriter(rec, caddyhttp.IdleDeadline{Timeout: time.Second})}, false},
		{"a minimum rate", &eventStream{out: idleWriter(rec, caddyhttp.IdleDeadline{Timeout: time.Minute, MinRate: 100})}, false},
		{"a hard write timeout", &eventStream{out: idleWriter(rec, caddyhttp.IdleDeadline{Timeout: time.Minute, HardDeadline: time.Now().Add(time.Hour)})}, false},
		{"an access log's recorder above it", &eventStream{out: caddyhttp.NewResponseRecorder(idleWriter(rec, plain), nil, nil)}, false},
		{"a buffer of the feed's own", &eventStream{out: idleWriter(rec, plain), bw: bufio.NewWriter(rec)}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := skipIdleTimeout(c.es, hubTimeout)
			if (got != nil) != c.want {
				t.Fatalf("skipIdleTimeout = %v, want the response beneath: %v", got, c.want)
			}
			if got != nil && got != http.ResponseWriter(rec) {
				t.Fatalf("skipIdleTimeout = %T, want the response beneath the wrapper", got)
			}
		})
	}
}

// A client that stops reading while its feed is parked must not hold the
// hub, and so every other feed of the stream, for the minute of Caddy's
// idle timeout, which the hub's writes skip: the hub's own write deadline
// lets it go, and the feed beside it gets every record.
func TestHubDropsStalledFeedUnderIdleTimeout(t *testing.T) {
	const writeTimeout = 300 * time.Millisecond
	s := newDSServer(t, func(d *durableStreams) { d.writeTimeout = writeTimeout })
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		iw := idleWriter(w, caddyhttp.IdleDeadline{Start: time.Now(), Timeout: time.Minute})
		defer iw.HandlerDone()
		s.Config.Handler.ServeHTTP(iw, r)
	}))
	t.Cleanup(srv.Close)
	s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201)

	// The stalled client: a small receive buffer and no reads.
	openStalledSSE(t, srv.URL, "/s?offset=-1&live=sse")
	r := openSSE(t, srv.Client(), srv.URL+"/s?offset=-1&live=sse")
	if c := r.control(t); !c.UpToDate {
		t.Fatalf("first control %+v, want upToDate", c)
	}
	s.waitParked(t, 2, 1)
	s.proto.hubs.mu.Lock()
	for _, h := range s.proto.hubs.hubs {
		h.mu.Lock()
		for hf := range h.feeds {
			if hf.direct == nil {
				t.Error("a feed parked under Caddy's default idle timeout is written through it")
			}
		}
		h.mu.Unlock()
	}
	s.proto.hubs.mu.Unlock()

	record := strings.Repeat("x", 1<<20)
	start := time.Now()
	got := 0
	for i := 0; i < 8; i++ {
		s.do(t, "POST", "/s", record, ct, "text/plain").want(t, 204)
		for got < (i+1)*len(record) {
			ev := r.next(t) // fails after 5 s without an event
			if ev.typ == "data" {
				got += len(ev.data)
			}
		}
	}
	s.waitParked(t, 1, 1) // the stalled feed was let go
	t.Logf("8 MiB reached the reading feed in %v beside a stalled one", time.Since(start).Round(time.Millisecond))
}

// A feed that waits alone (no hub: it could not park, or the hub's watchdog
// let it go) gets its control event again at every keep-alive interval
// too, in both protocols.
func TestSSELoneFeedsAreKeptAlive(t *testing.T) {
	const every = 200 * time.Millisecond
	t.Run("durable streams", func(t *testing.T) {
		s := newDSServer(t, func(d *durableStreams) { d.hubs, d.sseKeepAlive = nil, every })
		s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201)
		r := s.sse(t, "/s?offset=now&live=sse")
		first := r.control(t)
		began := time.Now()
		for i := range 3 {
			if c := r.control(t); !c.UpToDate || c.StreamNextOffset != first.StreamNextOffset {
				t.Fatalf("keep-alive %d: control %+v", i, c)
			}
		}
		if took := time.Since(began); took < 2*every {
			t.Errorf("three keep-alives in %s: sooner than the interval", took)
		}
		s.do(t, "POST", "/s", "one", ct, "text/plain").want(t, 204)
		for {
			if ev := r.next(t); ev.typ != "control" {
				if ev.typ != "data" || ev.data != "one" {
					t.Fatalf("after the keep-alives: event %+v", ev)
				}
				break
			}
		}
	})
	t.Run("pico", func(t *testing.T) {
		s := newPicoServer(t, func(p *picoProtocol) { p.hubs, p.sseKeepAlive = nil, every })
		s.do(t, "PUT", "/pico/s", nil, "Content-Type", "text/plain").want(t, 201)
		r := s.sse(t, "/pico/s?live=sse")
		began := time.Now()
		for i := range 4 {
			if ev := r.next(t); ev.typ != "control" || !strings.Contains(ev.data, `"next_seq":0`) {
				t.Fatalf("event %d at a quiet tail: %+v", i, ev)
			}
		}
		if took := time.Since(began); took < 2*every {
			t.Errorf("four control events in %s: sooner than the interval", took)
		}
	})
}

// TestSSEKeepAliveAfterDataRepeatsNoData: a lone feed that read records
// up to the tail and then waits out the keep-alive gets the control event
// again, not the records: the page it had sent was written once more at
// every keep-alive, the same records (a page up to 1 MiB) delivered again.
func TestSSEKeepAliveAfterDataRepeatsNoData(t *testing.T) {
	const every = 150 * time.Millisecond
	t.Run("durable streams", func(t *testing.T) {
		s := newDSServer(t, func(d *durableStreams) { d.hubs, d.sseKeepAlive = nil, every })
		s.do(t, "PUT", "/s", "x", ct, "text/plain").want(t, 201)
		r := s.sse(t, "/s?offset=-1&live=sse")
		if ev := r.next(t); ev.typ != "data" || ev.data != "x" {
			t.Fatalf("first event %+v", ev)
		}
		for i := range 4 {
			if ev := r.next(t); ev.typ != "control" {
				t.Fatalf("event %d after the data, the stream quiet: %+v", i, ev)
			}
		}
	})
	t.Run("pico", func(t *testing.T) {
		s := newPicoServer(t, func(p *picoProtocol) { p.hubs, p.sseKeepAlive = nil, every })
		s.do(t, "PUT", "/pico/s", []byte("x"), "Content-Type", "text/plain").want(t, 201)
		r := s.sse(t, "/pico/s?live=sse")
		if ev := r.next(t); ev.typ != "data" {
			t.Fatalf("first event %+v", ev)
		}
		for i := range 4 {
			if ev := r.next(t); ev.typ != "control" {
				t.Fatalf("event %d after the data, the stream quiet: %+v", i, ev)
			}
		}
	})
}
