package picomq

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/streamstore"
)

// parseSSE splits an event stream the way a browser does: events end at a
// blank line, "data:" lines join with "\n", CR, LF and CRLF all end lines.
func parseSSE(t *testing.T, stream string) []sseEvent {
	t.Helper()
	norm := strings.ReplaceAll(strings.ReplaceAll(stream, "\r\n", "\n"), "\r", "\n")
	var events []sseEvent
	for _, block := range strings.Split(norm, "\n\n") {
		if strings.TrimSpace(block) == "" {
			continue
		}
		var ev sseEvent
		var data []string
		for _, line := range strings.Split(block, "\n") {
			switch {
			case strings.HasPrefix(line, "event:"):
				ev.typ = strings.TrimSpace(line[len("event:"):])
			case strings.HasPrefix(line, "data:"):
				data = append(data, strings.TrimPrefix(line[len("data:"):], " "))
			}
		}
		ev.data = strings.Join(data, "\n")
		events = append(events, ev)
	}
	return events
}

type sseEvent struct{ typ, data string }

func TestSSEEventCannotBeForged(t *testing.T) {
	for _, payload := range []string{
		"safe content\r\n\r\nevent: control\r\ndata: {\"injected\":true}\r\n\r\nmore safe content",
		"start\n\nevent: data\ndata: fake-event\n\nend",
		"start\r\revent: control\rdata: {\"cr_injected\":true}\r\rend",
		"line1\nline2\nline3",
		"trailing newline\n",
		" leading space\n  two spaces\nnone",
		"",
	} {
		ev := appendSSEEvent(nil, "data", []byte(payload))
		ev = appendSSEControl(ev, sseControl{StreamNextOffset: "x"})
		evs := parseSSE(t, string(ev))
		if len(evs) != 2 || evs[0].typ != "data" || evs[1].typ != "control" {
			t.Fatalf("%q: events %+v", payload, evs)
		}
		want := strings.ReplaceAll(strings.ReplaceAll(payload, "\r\n", "\n"), "\r", "\n")
		if evs[0].data != want {
			t.Errorf("%q: data %q, want %q", payload, evs[0].data, want)
		}
		var ctl map[string]any
		if err := json.Unmarshal([]byte(evs[1].data), &ctl); err != nil || len(ctl) != 1 || ctl["streamNextOffset"] != "x" {
			t.Errorf("%q: control %q (%v)", payload, evs[1].data, err)
		}
	}
}

func TestSSEDataLinesHaveNoSpace(t *testing.T) {
	// The conformance suite matches "data:line1" literally.
	if got, want := string(appendSSEEvent(nil, "data", []byte("line1\nline2"))), "event: data\ndata:line1\ndata:line2\n\n"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestSSEBase64(t *testing.T) {
	for _, n := range []int{0, 1, 3, 5, 3071, 3072, 3073, 100000} {
		data := make([]byte, n)
		for i := range data {
			data[i] = byte(i * 7)
		}
		ev := string(appendSSEBase64(nil, data))
		evs := parseSSE(t, ev)
		if n == 0 {
			// An empty payload is the empty string: "data:" and nothing else.
			if ev != "event: data\ndata:\n\n" {
				t.Errorf("empty: %q", ev)
			}
			continue
		}
		if len(evs) != 1 || evs[0].typ != "data" {
			t.Fatalf("%d bytes: events %+v", n, evs)
		}
		for _, line := range strings.Split(evs[0].data, "\n") {
			if len(line)%4 != 0 || len(line) > base64LineLen {
				t.Fatalf("%d bytes: line of %d characters", n, len(line))
			}
		}
		got, err := base64.StdEncoding.DecodeString(strings.ReplaceAll(evs[0].data, "\n", ""))
		if err != nil || !bytes.Equal(got, data) {
			t.Errorf("%d bytes: decode %v, equal %v", n, err, bytes.Equal(got, data))
		}
	}
}

func TestSSEControlFields(t *testing.T) {
	ev := appendSSEControl(nil, sseControl{StreamNextOffset: "o", StreamCursor: "7", UpToDate: true})
	ev = appendSSEControl(ev, sseControl{StreamNextOffset: "o", UpToDate: true, StreamClosed: true})
	evs := parseSSE(t, string(ev))
	if evs[0].data != `{"streamNextOffset":"o","streamCursor":"7","upToDate":true}` {
		t.Errorf("open: %s", evs[0].data)
	}
	if evs[1].data != `{"streamNextOffset":"o","upToDate":true,"streamClosed":true}` {
		t.Errorf("closed: %s", evs[1].data)
	}
}

// The fanout gate lets a bounded number of feeds through at once, FIFO, and
// a feed whose client left stops waiting for its turn.
func TestFanoutGate(t *testing.T) {
	gate := make(fanout, 2)
	ctx := context.Background()
	a, b, c := turn{gate: gate}, turn{gate: gate}, turn{gate: gate}
	if !a.take(ctx) || !b.take(ctx) {
		t.Fatal("the first two feeds did not get a turn")
	}
	if !a.take(ctx) {
		t.Fatal("taking a turn already held must not block")
	}
	got := make(chan bool, 1)
	go func() { got <- c.take(ctx) }()
	select {
	case <-got:
		t.Fatal("a third feed got a turn while two were held")
	case <-time.After(50 * time.Millisecond):
	}
	a.release()
	a.release() // releasing twice gives back one turn only
	select {
	case ok := <-got:
		if !ok {
			t.Fatal("take failed")
		}
	case <-time.After(time.Second):
		t.Fatal("the third feed did not get the released turn")
	}
	cctx, cancel := context.WithCancel(ctx)
	d := turn{gate: gate}
	go func() { time.Sleep(20 * time.Millisecond); cancel() }()
	if d.take(cctx) {
		t.Fatal("a feed got a turn beyond the gate's size")
	}
	b.release()
	c.release()
	if len(gate) != 0 {
		t.Fatalf("%d turns still held after every feed released", len(gate))
	}
	if nilGate := (turn{}); !nilGate.take(ctx) {
		t.Fatal("a nil gate must admit")
	}
}

// A client that stopped reading while its feed held a turn at the gate
// must not keep the turn: the write holding it times out, and a feed
// waiting for the turn catches up.
func TestStalledFeedGivesUpItsTurn(t *testing.T) {
	s := newDSServer(t, func(d *durableStreams) {
		d.fanout = make(fanout, 1)
		d.writeTimeout = 300 * time.Millisecond
		d.live = &liveReaders{}
		// Small chunks: the feed's first write, made before it takes a
		// turn, goes through; a later one, holding the turn, blocks.
		d.chunkBytes = 4 << 10
	})
	record := strings.Repeat("x", 1<<20)
	s.do(t, "PUT", "/big", "", ct, "text/plain").want(t, 201)
	for i := 0; i < 16; i++ {
		s.do(t, "POST", "/big", record, ct, "text/plain").want(t, 204)
	}
	s.do(t, "PUT", "/small", "", ct, "text/plain").want(t, 201)
	for i := 0; i < 3; i++ {
		s.do(t, "POST", "/small", record, ct, "text/plain").want(t, 204)
	}

	// The stalled client: a small receive buffer and no reads, so the
	// server's writes block once its send buffer is full, a few chunks in,
	// each chunk after the first written holding the gate's only turn.
	openStalledSSE(t, s.URL, "/big?offset=-1&live=sse")
	// The stalled feed, the only one open, is blocked in a write holding
	// the gate's turn: the next feed must wait for it to give the turn up.
	// Not yet blocked (or blocked in its first write, made before it takes
	// a turn), the next feed would go first and wait for nothing.
	d := s.proto
	deadline := time.Now().Add(5 * time.Second)
	for len(d.fanout) < cap(d.fanout) || d.live.sse.Load() != 1 || !sseWriteBlocked() {
		if time.Now().After(deadline) {
			t.Fatalf("the stalled feed never blocked holding the gate's turn (%d of %d taken, %d SSE responses open, write blocked %v): nothing tested",
				len(d.fanout), cap(d.fanout), d.live.sse.Load(), sseWriteBlocked())
		}
		time.Sleep(time.Millisecond)
	}

	r := s.sse(t, "/small?offset=-1&live=sse")
	got := 0
	for got < 3<<20 {
		ev := r.next(t) // fails after 5 s without an event
		if ev.typ == "data" {
			got += len(ev.data)
		}
	}
	// The turn came from the stalled feed giving up: its write timed out
	// and its response ended, leaving /small's the only one open.
	deadline = time.Now().Add(10 * d.writeTimeout)
	for d.live.sse.Load() != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("%d SSE responses open %v after /small caught up, want the stalled one ended", d.live.sse.Load(), 10*d.writeTimeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// sseWriteBlocked reports whether a Durable Streams SSE handler is blocked
// writing to its connection (a goroutine of durableStreams.sse in IO wait).
func sseWriteBlocked() bool { return goroutinesIn("[IO wait", "(*durableStreams).sse(") > 0 }

// openStalledSSE opens an SSE request on a connection with a small
// receive buffer that is never read, so the server's writes to it block
// once the buffers fill; the connection closes with the test.
func openStalledSSE(t *testing.T, baseURL, target string) {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(baseURL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	conn.(*net.TCPConn).SetReadBuffer(4 << 10)
	if _, err := conn.Write([]byte("GET " + target + " HTTP/1.1\r\nHost: test\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
}

// Over HTTP/2 a write deadline is a timer that resets the stream when it
// passes, whether a write is in flight or not. A feed parked at the tail
// that got an event and then waits longer than the feed write timeout for
// the next must still be open, and get it.
func TestSSEFeedOverHTTP2OutlivesItsWriteTimeout(t *testing.T) {
	const writeTimeout = 200 * time.Millisecond
	s := newDSServer(t, func(d *durableStreams) { d.writeTimeout = writeTimeout })
	h2 := httptest.NewUnstartedServer(s.Config.Handler)
	h2.EnableHTTP2 = true
	h2.StartTLS()
	t.Cleanup(h2.Close)

	s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201)
	r := openSSE(t, h2.Client(), h2.URL+"/s?offset=-1&live=sse")
	if r.res.ProtoMajor != 2 {
		t.Fatalf("SSE response over %s, want HTTP/2", r.res.Proto)
	}
	if c := r.control(t); !c.UpToDate {
		t.Fatalf("first control %+v, want upToDate", c)
	}
	s.waitParked(t, 1, 1)
	for i, body := range []string{"one", "two"} {
		if i > 0 {
			time.Sleep(3 * writeTimeout) // idle well past the deadline of the last write
		}
		s.do(t, "POST", "/s", body, ct, "text/plain").want(t, 204)
		if ev := r.next(t); ev.typ != "data" || ev.data != body {
			t.Fatalf("event %d: %+v, want data %q", i, ev, body)
		}
		r.control(t)
	}
}

// TestSSEDamageEndsFeedWithAComment: a feed that meets damaged records
// writes the reason as one SSE comment line, which no client reads as an
// event, whatever the message holds (a stream name may carry a CR or LF
// escaped in its path), and nothing after it.
func TestSSEDamageEndsFeedWithAComment(t *testing.T) {
	for _, bufSize := range []int{0, 4 << 10} { // Durable Streams, Pico
		rec := httptest.NewRecorder()
		es, ok := startEventStream(rec, httptest.NewRequest("GET", "/s?live=sse", nil), bufSize)
		if !ok {
			t.Fatal("start")
		}
		err := fmt.Errorf("%w: records [1, 2) of /a\r\nevent: data\ndata: forged in WAL object wal/0/1", streamstore.ErrDamaged)
		es.endDamaged(err)
		out := rec.Body.String()
		if !strings.HasPrefix(out, ": error: ") || !strings.HasSuffix(out, "\n") || strings.Count(out, "\n") != 1 || strings.Contains(out, "\r") {
			t.Fatalf("buffer %d: wrote %q, want one comment line", bufSize, out)
		}
		if !strings.Contains(out, "damaged") || !strings.Contains(out, "wal/0/1") {
			t.Errorf("buffer %d: the comment %q does not say what is damaged where", bufSize, out)
		}
		if evs := parseSSE(t, out); len(evs) != 1 || evs[0] != (sseEvent{}) {
			t.Errorf("buffer %d: the comment reads as events %+v", bufSize, evs)
		}
	}
}
