package loadgen

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Memory: every subscriber keeps 4 bytes per append of the run (the
// receipt time of each sequence number), so 5,000 subscribers of 600
// appends take 12 MB.

// subscriber is one SSE reader. recv[seq] is when it first got record seq,
// in microseconds since the run's base time plus one (0: not received);
// only its own goroutine touches recv until the run ends.
type subscriber struct {
	r      *runner
	url    string
	base   time.Time
	next   string // the offset (Pico: seq) to (re)connect from
	pico   bool   // the feed speaks Pico, not Durable Streams
	recv   []uint32
	maxSeq int          // larger numbers are not this run's
	count  atomic.Int64 // distinct records received
	ready  func()       // called once, after the first connection attempt
	raw    bool         // read the feed by hand (plain http://)
	poller *poller      // reads the feed when raw; nil: its own goroutine does
	win    *sseWindow   // the measured window, for counting errors in it
	errs   atomic.Int64 // errors inside the window

	// The event being parsed.
	b64       bool // data arrives base64-encoded
	eventName string
	data      []byte
	lines     int
	line      []byte // a line split across reads
	errMsg    errorSamples
}

// sseWindow is the run's measured window, in Unix nanoseconds, set once the
// subscribers have connected (0 until then).
type sseWindow struct{ start, end atomic.Int64 }

// holds says whether t falls inside the window.
func (w *sseWindow) holds(t time.Time) bool {
	start := w.start.Load()
	return start != 0 && t.UnixNano() >= start && t.UnixNano() <= w.end.Load()
}

// runSSE: --subscribers SSE readers follow stream prefix+"0" from its tail
// while records numbered 0, 1, 2, ... are appended at --rate, open loop
// (each at its scheduled time, not waiting for the one before). Each
// record carries its number ("#seq#"), so a subscriber knows what it got
// whatever the server batches into one event. ops are the appends
// acknowledged in the window; latency is from the writer's receipt of the
// append's acknowledgement to a subscriber's receipt of the record (0 when
// the record came first), over every (subscriber, record) pair delivered;
// expected is those appends times the subscribers; lost is expected minus
// delivered after a grace period (the timeout, at most 10s) for stragglers.
func (r *runner) runSSE(ctx context.Context) (*Result, error) {
	cfg := r.cfg
	streamURL := r.streamURL(0)
	if cfg.Create {
		if err := r.createStreams(ctx, 1, nil); err != nil {
			return nil, err
		}
	}
	tail, err := r.tail(ctx, streamURL)
	if err != nil {
		return nil, err
	}

	maxSeq := int(cfg.Rate*(cfg.Warmup+cfg.Duration).Seconds()) + 1
	base := time.Now()
	subCtx, stopSubs := context.WithCancel(ctx)
	defer stopSubs()
	subs := make([]*subscriber, cfg.Subscribers)
	win := new(sseWindow)
	var ready, running sync.WaitGroup
	ready.Add(len(subs))
	connecting := make(chan struct{}, 200) // bounds the connection storm
	raw := usesRawFeeds(streamURL) && cfg.feeds != feedsNetHTTP
	var pollers []*poller
	var polling sync.WaitGroup
	defer func() {
		stopSubs() // pollers end with the subscribers' context
		polling.Wait()
	}()
	if raw && cfg.feeds != feedsGoroutine {
		for range runtime.GOMAXPROCS(0) {
			p, err := newPoller()
			if err != nil {
				break // each feed reads on its own goroutine
			}
			pollers = append(pollers, p)
			polling.Go(func() { p.run(subCtx) })
		}
	}
	for i := range subs {
		s := &subscriber{r: r, url: streamURL, base: base, next: tail, maxSeq: maxSeq, raw: raw, pico: cfg.Protocol == ProtocolPico, win: win}
		if len(pollers) > 0 {
			s.poller = pollers[i%len(pollers)]
		}
		var once sync.Once
		s.ready = func() { once.Do(func() { <-connecting; ready.Done() }) }
		subs[i] = s
		running.Go(func() {
			connecting <- struct{}{}
			s.run(subCtx)
		})
	}
	ready.Wait()
	if err := ctx.Err(); err != nil {
		return nil, err
	}

	// The writer. acks[seq] is when the append of seq was acknowledged,
	// in microseconds since base plus one; 0 when it failed.
	t0 := time.Now()
	winStart := t0.Add(cfg.Warmup)
	winEnd := winStart.Add(cfg.Duration)
	win.end.Store(winEnd.UnixNano())
	win.start.Store(winStart.UnixNano())
	var acks []uint32
	var inWindow []bool
	var acked atomic.Int64
	stop := make(chan struct{})
	pdone := r.progress(stop, t0, func() string {
		var got int64
		for _, s := range subs {
			got += s.count.Load()
		}
		return "delivered " + itoa(got) + " of " + itoa(acked.Load()*int64(len(subs)))
	})
	type windowResult struct {
		procs []Process
		err   error
	}
	wch := make(chan windowResult, 1)
	wctx, stopWindow := context.WithCancel(ctx)
	defer stopWindow()
	go func() {
		p, err := r.window(wctx, winStart, winEnd)
		if err != nil {
			stopWindow() // a fatal error: the writer stops too
		}
		wch <- windowResult{p, err}
	}()
	interval := time.Duration(float64(time.Second) / cfg.Rate)
	hdr := http.Header{"Content-Type": {cfg.ContentType}}
	u, err := url.Parse(streamURL)
	if err != nil {
		return nil, err
	}
	// Open loop: each append goes at its scheduled time whatever the
	// earlier ones are doing, as independent producers would, so a slow
	// acknowledgement shows as latency rather than as a lower rate, and the
	// window ends on the clock.
	n := 0
	for t0.Add(time.Duration(n) * interval).Before(winEnd) {
		n++
	}
	acks = make([]uint32, n)
	inWindow = make([]bool, n)
	var mu sync.Mutex
	var appendErrs int64
	var appendLat []int64
	var senders sync.WaitGroup
	for seq := 0; seq < n; seq++ {
		if err := sleepUntil(wctx, t0.Add(time.Duration(seq)*interval)); err != nil {
			break
		}
		senders.Add(1)
		go func(seq int) {
			defer senders.Done()
			tag := appendTag(nil, seq)
			body := fillBody(make([]byte, max(cfg.Size, len(tag)+2)), cfg.ContentType, seq)
			req := &http.Request{Method: http.MethodPost, URL: u, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
				Header: hdr, Body: io.NopCloser(bytes.NewReader(body)), ContentLength: int64(len(body)), Host: u.Host}
			req = req.WithContext(ctx)
			start := time.Now()
			ok, msg, _ := r.send(req)
			end := time.Now()
			mu.Lock()
			defer mu.Unlock()
			inWindow[seq] = !end.Before(winStart) && !end.After(winEnd)
			if ok {
				acks[seq] = micros(base, end)
				acked.Add(1)
				r.ops.Add(1)
				r.hist.record(end.Sub(start))
				if inWindow[seq] {
					appendLat = append(appendLat, int64(end.Sub(start)))
				}
			} else {
				r.errs.Add(1)
				// Counted as ops are, inside the window only: the
				// warm-up's failures are no more the run's than its
				// successes are.
				if inWindow[seq] {
					appendErrs++
					r.errMsg.add("append: " + msg)
				}
			}
		}(seq)
	}
	senders.Wait()
	wr := <-wch

	// Let the last records reach everyone, then stop the subscribers.
	grace := time.Now().Add(min(cfg.Timeout, 10*time.Second))
	for time.Now().Before(grace) && ctx.Err() == nil {
		all := true
		for _, s := range subs {
			if s.count.Load() < acked.Load() {
				all = false
				break
			}
		}
		if all {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	stopSubs()
	running.Wait()
	close(stop)
	<-pdone
	if wr.err != nil && wr.procs == nil {
		return nil, wr.err // the window did not complete: no figures
	}

	res := r.result(ModeSSE)
	res.Writers = 1
	res.Streams = 1
	res.Subscribers = len(subs)
	res.DurationS = cfg.Duration.Seconds()
	res.Errors = appendErrs
	var lat []int64
	for seq, ack := range acks {
		if ack == 0 || !inWindow[seq] {
			continue
		}
		res.Ops++
		res.Bytes += int64(max(cfg.Size, len(appendTag(nil, seq))+2))
		for _, s := range subs {
			res.Expected++
			if seq >= len(s.recv) || s.recv[seq] == 0 {
				continue
			}
			res.Delivered++
			d := int64(s.recv[seq]) - int64(ack)
			lat = append(lat, max(d, 0)*int64(time.Microsecond))
		}
	}
	res.Lost = res.Expected - res.Delivered
	res.Latency = latencyOf(lat)
	al := latencyOf(appendLat)
	res.AppendLatency = &al
	for _, s := range subs {
		res.Errors += s.errs.Load()
		for _, m := range s.errMsg.list() {
			r.errMsg.add(m)
		}
	}
	res.Processes = wr.procs
	res.ErrorSamples = r.errMsg.list()
	res.finish()
	r.warnNotStreams(res)
	return res, wr.err
}

// micros is t as microseconds since base, plus one so that 0 means unset.
func micros(base, t time.Time) uint32 { return uint32(t.Sub(base)/time.Microsecond) + 1 }

func itoa(n int64) string { return string(appendInt(nil, int(n))) }

// tail asks for the stream's tail with HEAD; a server that does not say
// gets offset=now.
func (r *runner) tail(ctx context.Context, rawURL string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodHead, rawURL, nil)
	if err != nil {
		return "", err
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return "", err
	}
	defer drain(resp.Body)
	if resp.StatusCode/100 != 2 {
		return "", errors.New("HEAD " + rawURL + ": " + resp.Status)
	}
	h := hdrNextOffset
	if r.cfg.Protocol == ProtocolPico {
		h = hdrPicoNextSeq
	}
	if off := resp.Header.Get(h); off != "" {
		return off, nil
	}
	return "now", nil
}

// run reads until ctx ends, reconnecting from the last offset whenever
// the server ends the response (as servers do every so often) or it fails.
func (s *subscriber) run(ctx context.Context) {
	defer s.ready()
	for ctx.Err() == nil {
		err := s.once(ctx)
		if ctx.Err() != nil || errors.Is(err, errClosed) {
			return
		}
		if err != nil {
			s.r.errs.Add(1) // the progress line's count, which runs from the start
			// Counted as the writer's failures are, inside the window
			// only: the connection storm and the warm-up are not the
			// measured run.
			if s.win == nil || s.win.holds(time.Now()) {
				s.errs.Add(1)
				s.errMsg.add("subscriber: " + err.Error())
			}
			select {
			case <-ctx.Done():
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
}

// errClosed says the stream was closed: nothing more will come.
var errClosed = errors.New("stream closed")

// once makes one SSE request and reads its events.
func (s *subscriber) once(ctx context.Context) error {
	if s.raw {
		return s.onceRaw(ctx)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.url+s.liveQuery(), nil)
	if err != nil {
		return err
	}
	req.Header.Set("Accept", "text/event-stream")
	resp, err := s.r.live.Do(req)
	s.ready()
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if err := checkSSEResponse(resp); err != nil {
		return err
	}
	s.startResponse(resp.Header)
	br := bufio.NewReaderSize(resp.Body, 4096)
	for {
		line, err := s.readLine(br)
		if err != nil {
			if err == io.EOF {
				return nil // the server ended the response; reconnect
			}
			return err
		}
		if err := s.sseLine(line); err != nil {
			return err
		}
	}
}

// checkSSEResponse fails an answer to an SSE request that is not an event
// stream: not a 200, or a 200 of another type. A 200 with no events, such
// as the empty one of a Caddy route that serves nothing, would otherwise
// end at once and be asked again at once, without a pause or an error,
// for the whole run.
func checkSSEResponse(resp *http.Response) error {
	if resp.StatusCode != http.StatusOK {
		return errors.New(httpError(resp))
	}
	ct := resp.Header.Get("Content-Type")
	if mt, _, _ := strings.Cut(ct, ";"); !strings.EqualFold(strings.TrimSpace(mt), "text/event-stream") {
		return fmt.Errorf("200 with Content-Type %q, not text/event-stream: not an SSE feed", ct)
	}
	return nil
}

// liveQuery is the query string of an SSE request from s.next.
func (s *subscriber) liveQuery() string {
	if s.pico {
		return "?seq=" + url.QueryEscape(s.next) + "&live=sse"
	}
	return "?offset=" + url.QueryEscape(s.next) + "&live=sse"
}

// startResponse resets the event parser for a new response.
func (s *subscriber) startResponse(h http.Header) {
	s.b64 = h.Get("Stream-Sse-Data-Encoding") == "base64"
	s.eventName, s.data, s.lines = "", s.data[:0], 0
}

// sseLine takes one line of the event stream, without its ending.
func (s *subscriber) sseLine(line []byte) error {
	if len(line) == 0 { // end of an event
		err := s.event(s.eventName, s.data, s.b64)
		s.eventName, s.data, s.lines = "", s.data[:0], 0
		return err
	}
	field, value, _ := bytes.Cut(line, []byte(":"))
	if len(value) > 0 && value[0] == ' ' {
		value = value[1:]
	}
	switch string(field) {
	case "event":
		s.eventName = eventName(value)
	case "data":
		// Plain data is scanned line by line (a tag never spans a line
		// break), not copied: with thousands of subscribers on two cores,
		// every copy shows.
		if s.eventName == "data" && !s.b64 {
			s.tags(value)
			return nil
		}
		if s.lines > 0 && !s.b64 {
			s.data = append(s.data, '\n')
		}
		s.data = append(s.data, value...)
		s.lines++
	}
	return nil
}

// readLine returns the next line without its ending (LF or CRLF); the
// slice is valid until the next call.
func (s *subscriber) readLine(br *bufio.Reader) ([]byte, error) {
	s.line = s.line[:0]
	for {
		part, err := br.ReadSlice('\n')
		s.line = append(s.line, part...)
		if err == bufio.ErrBufferFull {
			continue
		}
		if err != nil {
			return nil, err
		}
		l := s.line[:len(s.line)-1]
		if n := len(l); n > 0 && l[n-1] == '\r' {
			l = l[:n-1]
		}
		return l, nil
	}
}

// event handles one complete event.
func (s *subscriber) event(event string, data []byte, b64 bool) error {
	switch event {
	case "data":
		if b64 {
			n, err := base64.StdEncoding.Decode(data, data)
			if err != nil {
				return errors.New("bad base64 in a data event: " + err.Error())
			}
			data = data[:n]
		}
		s.tags(data)
	case "control":
		parse := parseControl
		if s.pico {
			parse = parsePicoControl
		}
		next, closed, err := parse(data)
		if err != nil {
			return errors.New("bad control event: " + err.Error())
		}
		if len(next) > 0 && string(next) != s.next {
			s.next = string(next)
		}
		if closed {
			return errClosed
		}
	}
	return nil
}

// tags records the receipt of every record tagged in b.
func (s *subscriber) tags(b []byte) {
	now := micros(s.base, time.Now())
	scanTags(b, func(seq int) {
		if seq > s.maxSeq {
			return
		}
		for seq >= len(s.recv) {
			s.recv = append(s.recv, 0)
		}
		if s.recv[seq] == 0 {
			s.recv[seq] = now
			s.count.Add(1)
		}
	})
}

// eventName returns the event field's value; the names the server sends
// come without allocating.
func eventName(v []byte) string {
	switch string(v) {
	case "data":
		return "data"
	case "control":
		return "control"
	}
	return string(v)
}

// parseControl reads streamNextOffset and streamClosed from a control
// event. It takes the fast path for the server's own encoding (offsets are
// plain ASCII, no escapes) and falls back to encoding/json otherwise.
func parseControl(data []byte) (next []byte, closed bool, err error) {
	const key = `"streamNextOffset":"`
	if i := bytes.Index(data, []byte(key)); i >= 0 && data[0] == '{' && data[len(data)-1] == '}' {
		rest := data[i+len(key):]
		if j := bytes.IndexByte(rest, '"'); j >= 0 && bytes.IndexByte(rest[:j], '\\') < 0 {
			closed = bytes.Contains(data, []byte(`"streamClosed":true`))
			return rest[:j], closed, nil
		}
	}
	var c struct {
		StreamNextOffset string `json:"streamNextOffset"`
		StreamClosed     bool   `json:"streamClosed"`
	}
	if err := json.Unmarshal(data, &c); err != nil {
		return nil, false, err
	}
	return []byte(c.StreamNextOffset), c.StreamClosed, nil
}

// parsePicoControl reads next_seq and closed from a Pico control event,
// with the same fast path for the server's own encoding.
func parsePicoControl(data []byte) (next []byte, closed bool, err error) {
	const key = `"next_seq":`
	if i := bytes.Index(data, []byte(key)); i >= 0 && data[0] == '{' && data[len(data)-1] == '}' {
		rest := data[i+len(key):]
		j := 0
		for j < len(rest) && rest[j] >= '0' && rest[j] <= '9' {
			j++
		}
		if j > 0 && (j == len(rest) || rest[j] == ',' || rest[j] == '}') {
			return rest[:j], bytes.Contains(data, []byte(`"closed":true`)), nil
		}
	}
	var c struct {
		NextSeq *uint64 `json:"next_seq"`
		Closed  bool    `json:"closed"`
	}
	if err := json.Unmarshal(data, &c); err != nil {
		return nil, false, err
	}
	if c.NextSeq == nil {
		return nil, false, errors.New("no next_seq")
	}
	return strconv.AppendUint(nil, *c.NextSeq, 10), c.Closed, nil
}

// scanTags calls fn with N for every "#N#" in b.
func scanTags(b []byte, fn func(int)) {
	for i := 0; i < len(b); i++ {
		k := bytes.IndexByte(b[i:], '#')
		if k < 0 {
			return
		}
		i += k
		j, n := i+1, 0
		for j < len(b) && b[j] >= '0' && b[j] <= '9' && j-i <= 10 {
			n = n*10 + int(b[j]-'0')
			j++
		}
		if j > i+1 && j < len(b) && b[j] == '#' {
			fn(n)
			i = j
		}
	}
}
