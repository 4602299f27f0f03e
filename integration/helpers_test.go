package integration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// Stream content type of every test stream: text, so SSE carries it as is.
const textPlain = "text/plain"

// newProxy starts the fault-injecting S3 proxy in front of v, closed when
// the test ends (after the Caddy children, which are started later and so
// cleaned up earlier).
func newProxy(t *testing.T, v *testenv.Versity) *testenv.Proxy {
	t.Helper()
	p, err := testenv.NewProxy(v.Endpoint)
	if err != nil {
		t.Fatalf("starting S3 proxy: %v", err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// caddyOptions are the options of a Caddy child serving the module on
// storage (an S3 URL on v), with extra picomq directives.
func caddyOptions(v *testenv.Versity, storage string, directives ...string) caddytest.Options {
	return caddytest.Options{
		Storage:      storage,
		Directives:   directives,
		Env:          caddytest.S3Env(v),
		ReadyTimeout: 90 * time.Second,
	}
}

// startWithStream starts Caddy on a versitygw bucket of its own, with
// extra picomq directives, and creates the stream name through a client
// of it. It returns the gateway and the storage URL, for further configs
// or nodes on that bucket, with Caddy and the client.
func startWithStream(t *testing.T, name string, directives ...string) (v *testenv.Versity, storage string, c *caddytest.Caddy, cl *dsClient) {
	t.Helper()
	v = testenv.NewVersity(t)
	storage = caddytest.S3Storage(t, v, v.Endpoint)
	c = caddytest.Start(t, caddyOptions(v, storage, directives...))
	cl = newClient(t, c.URL(), true)
	cl.create(t, name, 30*time.Second)
	return v, storage, c, cl
}

// waitServing waits until the current run of c has loaded its whole
// configuration (Caddy logs "serving initial configuration" once every app
// started) or has exited. caddytest's start returns as soon as the HTTP
// port answers, and Caddy may start its http app before the picomq app,
// whose failure (the storage lease is held elsewhere) then stops the
// process a few milliseconds later: such a start did not succeed.
func waitServing(c *caddytest.Caddy, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		logs := c.Logs()
		if i := strings.LastIndex(logs, "=== caddytest:"); i >= 0 {
			logs = logs[i:]
		}
		if strings.Contains(logs, "serving initial configuration") {
			return nil
		}
		if !c.Running() {
			return fmt.Errorf("caddy exited during start-up:\n%s", truncateTail(logs, 8<<10))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("caddy did not finish loading its configuration within %s", timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func truncateTail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}

// dsClient is a minimal Durable Streams client over one HTTP transport.
// Every request carries its own context; the client has no global timeout.
type dsClient struct {
	base string
	tr   *http.Transport
	hc   *http.Client
}

// newClient returns a client for the streams under base. keepAlive false
// opens a connection per request, so a server closing an idle keep-alive
// connection can never race a request that is being sent on it.
func newClient(t *testing.T, base string, keepAlive bool) *dsClient {
	t.Helper()
	tr := &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 3 * time.Second}).DialContext,
		MaxIdleConns:        256,
		MaxIdleConnsPerHost: 256,
		IdleConnTimeout:     30 * time.Second,
		DisableKeepAlives:   !keepAlive,
		DisableCompression:  true,
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &dsClient{base: base, tr: tr, hc: &http.Client{Transport: tr}}
}

// response is a fully read HTTP response.
type response struct {
	status int
	header http.Header
	body   []byte
}

func (r *response) next() string { return r.header.Get("Stream-Next-Offset") }

func (r *response) String() string {
	return fmt.Sprintf("%d %q", r.status, truncate(string(r.body), 300))
}

// do sends one request and reads the whole response.
func (c *dsClient) do(ctx context.Context, method, name, query string, hdr http.Header, body []byte) (*response, error) {
	u := c.base + name
	if query != "" {
		u += "?" + query
	}
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return nil, err
	}
	for k, vs := range hdr {
		req.Header[k] = vs
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("%s %s: reading body after status %d: %w", method, name, resp.StatusCode, err)
	}
	return &response{status: resp.StatusCode, header: resp.Header, body: b}, nil
}

// create makes a text stream, retrying connection errors and 5xx until
// timeout; it fails the test on any other answer than 201 or 200.
func (c *dsClient) create(t *testing.T, name string, timeout time.Duration) {
	t.Helper()
	if err := c.tryCreate(name, timeout); err != nil {
		t.Fatal(err)
	}
}

// tryCreate is create for goroutines other than the test's, which must not
// call t.Fatal: a 5xx or transport error is retried until timeout, any
// other failure is returned at once.
func (c *dsClient) tryCreate(name string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last string
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		r, err := c.do(ctx, http.MethodPut, name, "", http.Header{"Content-Type": {textPlain}}, nil)
		cancel()
		switch {
		case err != nil:
			last = err.Error()
		case r.status == http.StatusCreated || r.status == http.StatusOK:
			return nil
		case r.status >= 500:
			last = r.String()
		default:
			return fmt.Errorf("PUT %s: %s", name, r)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("PUT %s: no success within %s; last: %s", name, timeout, last)
}

// appendBody POSTs one text append.
func (c *dsClient) appendBody(ctx context.Context, name string, body []byte) (*response, error) {
	return c.do(ctx, http.MethodPost, name, "", http.Header{"Content-Type": {textPlain}}, body)
}

// readFrom is one catch-up GET from offset.
func (c *dsClient) readFrom(ctx context.Context, name, offset string) (*response, error) {
	return c.do(ctx, http.MethodGet, name, "offset="+url.QueryEscape(offset), nil, nil)
}

// readAll reads a stream from its start to its tail by catch-up reads,
// retrying connection errors and 5xx for up to timeout. It returns the
// content and the tail offset.
func (c *dsClient) readAll(name string, timeout time.Duration) ([]byte, string, error) {
	return c.readRange(name, "-1", -1, timeout)
}

// readRange reads from offset until the tail, or until at least limit bytes
// (limit >= 0) have arrived.
func (c *dsClient) readRange(name, offset string, limit int, timeout time.Duration) ([]byte, string, error) {
	deadline := time.Now().Add(timeout)
	var out []byte
	for i := 0; ; i++ {
		if time.Now().After(deadline) {
			return out, offset, fmt.Errorf("read %s from %s: not at the tail after %s (%d requests, %d bytes)",
				name, offset, timeout, i, len(out))
		}
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		r, err := c.readFrom(ctx, name, offset)
		cancel()
		if err != nil || r.status >= 500 {
			time.Sleep(100 * time.Millisecond)
			continue
		}
		if r.status != http.StatusOK {
			return out, offset, fmt.Errorf("GET %s?offset=%s: %s", name, offset, r)
		}
		next := r.next()
		if next == "" {
			return out, offset, fmt.Errorf("GET %s?offset=%s: no Stream-Next-Offset", name, offset)
		}
		if len(r.body) > 0 && next <= offset && offset != "-1" {
			return out, offset, fmt.Errorf("GET %s?offset=%s: %d bytes but Stream-Next-Offset %s does not advance",
				name, offset, len(r.body), next)
		}
		out = append(out, r.body...)
		upToDate := r.header.Get("Stream-Up-To-Date") == "true"
		if len(r.body) == 0 && !upToDate {
			return out, offset, fmt.Errorf("GET %s?offset=%s: empty body without Stream-Up-To-Date", name, offset)
		}
		offset = next
		if upToDate || (limit >= 0 && len(out) >= limit) {
			return out, offset, nil
		}
	}
}

// readAllParallel reads every stream in names with readAll, workers at a
// time, and returns their contents and tails in the order of names.
func readAllParallel(c *dsClient, names []string, workers int, timeout time.Duration) ([][]byte, []string, error) {
	contents := make([][]byte, len(names))
	tails := make([]string, len(names))
	errs := make([]error, len(names))
	work := make(chan int)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				contents[i], tails[i], errs[i] = c.readAll(names[i], timeout)
			}
		}()
	}
	for i := range names {
		work <- i
	}
	close(work)
	wg.Wait()
	return contents, tails, errors.Join(errs...)
}

// tail returns the stream's tail offset (HEAD), retrying errors and 5xx.
func (c *dsClient) tail(name string, timeout time.Duration) (string, error) {
	deadline := time.Now().Add(timeout)
	var last string
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		r, err := c.do(ctx, http.MethodHead, name, "", nil, nil)
		cancel()
		switch {
		case err != nil:
			last = err.Error()
		case r.status == http.StatusOK && r.next() != "":
			return r.next(), nil
		case r.status >= 500:
			last = r.String()
		default:
			return "", fmt.Errorf("HEAD %s: %s (Stream-Next-Offset %q)", name, r, r.next())
		}
		time.Sleep(100 * time.Millisecond)
	}
	return "", fmt.Errorf("HEAD %s: no answer within %s; last: %s", name, timeout, last)
}

// ---- writers: one sequential writer per stream, unique verifiable bodies.

// writer appends "w<idx>-<n>\n" for n = 0, 1, 2, ... to one stream, never
// sending the same body twice: after a failed request it moves on to the
// next n, so an append that failed may show up at most once and anything
// that shows up twice is a duplicate made by the server.
type writer struct {
	// abort cancels requests in flight when the test is torn down early.
	abort context.Context
	c     *dsClient
	idx   int
	name  string
	// pause between appends (a little jitter is added).
	pause time.Duration
	// reqTimeout bounds each append request.
	reqTimeout time.Duration
	// shared: other writers append to the same stream; verify skips
	// their well-formed lines.
	shared bool
	// producer: appends carry idempotent producer headers (epoch 0, seq
	// n), and an append whose request failed without an answer is sent
	// again, which the server deduplicates: what a real client does.
	producer bool

	mu       sync.Mutex
	next     int
	acked    map[int]string // n -> Stream-Next-Offset of its 2xx
	failed   map[int]string // n -> why it failed
	statuses map[int]int    // HTTP status -> failed appends answered with it
	spans    map[int]span   // n -> when its request was sent and answered
	lastAck  string         // highest Stream-Next-Offset acknowledged
	ackOrder []string       // problems with the acknowledged offsets
}

// span is the life of one append request.
type span struct {
	sent, done time.Time
	ok         bool // answered 2xx
}

// inFlightAt returns how many of the writer's appends were in flight at t,
// and how many of those were acknowledged.
func (w *writer) inFlightAt(t time.Time) (inFlight, acked int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, sp := range w.spans {
		if sp.sent.Before(t) && sp.done.After(t) {
			inFlight++
			if sp.ok {
				acked++
			}
		}
	}
	return inFlight, acked
}

func newWriter(abort context.Context, c *dsClient, idx int, name string, pause time.Duration) *writer {
	return &writer{abort: abort, c: c, idx: idx, name: name, pause: pause, reqTimeout: 45 * time.Second,
		acked: map[int]string{}, failed: map[int]string{}, statuses: map[int]int{},
		spans: map[int]span{}}
}

func (w *writer) body(n int) []byte { return []byte(fmt.Sprintf("w%02d-%d\n", w.idx, n)) }

// run appends until stop is closed. In-flight requests are not cancelled
// by stop: they end on their own (answer, error or reqTimeout).
func (w *writer) run(stop <-chan struct{}) {
	for i := 0; ; i++ {
		select {
		case <-stop:
			return
		default:
		}
		w.mu.Lock()
		n := w.next
		w.next++
		w.mu.Unlock()
		sent := time.Now()
		r, err := w.send(n)
		w.mu.Lock()
		w.spans[n] = span{sent: sent, done: time.Now(), ok: err == nil && r.status/100 == 2}
		switch {
		case err != nil:
			w.failed[n] = err.Error()
		case r.status/100 == 2:
			off := r.next()
			w.acked[n] = off
			if off == "" {
				w.ackOrder = append(w.ackOrder, fmt.Sprintf("append %d: %d without Stream-Next-Offset", n, r.status))
			} else if off <= w.lastAck {
				w.ackOrder = append(w.ackOrder, fmt.Sprintf("append %d: Stream-Next-Offset %s not after the previous ack's %s",
					n, off, w.lastAck))
			} else {
				w.lastAck = off
			}
		default:
			w.failed[n] = r.String()
			w.statuses[r.status]++
		}
		w.mu.Unlock()
		if err != nil || r.status/100 != 2 {
			// Caddy is down or restarting: do not spin.
			sleepOrStop(stop, 50*time.Millisecond)
		} else if w.pause > 0 {
			sleepOrStop(stop, w.pause+time.Duration(i%7)*w.pause/7)
		}
	}
}

// send makes one append; a producer writer resends it while the request
// fails without an answer (at most 20 times).
func (w *writer) send(n int) (*response, error) {
	for attempt := 0; ; attempt++ {
		ctx, cancel := context.WithTimeout(w.abort, w.reqTimeout)
		var r *response
		var err error
		if w.producer {
			h := http.Header{
				"Content-Type":   {textPlain},
				"Producer-Id":    {fmt.Sprintf("writer-%d", w.idx)},
				"Producer-Epoch": {"0"},
				"Producer-Seq":   {strconv.Itoa(n)},
				// Lets Go's transport resend the POST itself when a
				// keep-alive connection closes under it.
				"Idempotency-Key": {fmt.Sprintf("writer-%d-%d", w.idx, n)},
			}
			r, err = w.c.do(ctx, http.MethodPost, w.name, "", h, w.body(n))
		} else {
			r, err = w.c.appendBody(ctx, w.name, w.body(n))
		}
		cancel()
		if err == nil || !w.producer || attempt >= 20 || w.abort.Err() != nil {
			return r, err
		}
		// Resend even when stopping: an append must not be left unsettled.
		time.Sleep(20 * time.Millisecond)
	}
}

// counts returns how many appends were acknowledged and how many failed.
func (w *writer) counts() (acked, failed int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.acked), len(w.failed)
}

// statusCounts returns the failed appends answered with an HTTP status, by
// status.
func (w *writer) statusCounts() map[int]int {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make(map[int]int, len(w.statuses))
	for k, v := range w.statuses {
		out[k] = v
	}
	return out
}

// failures returns up to n reasons of failed appends.
func (w *writer) failures(n int) []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for k, why := range w.failed {
		if len(out) == n {
			break
		}
		out = append(out, fmt.Sprintf("%s append %d: %s", w.name, k, why))
	}
	return out
}

// verify checks a stream's final content against what the writer sent:
// only its own bodies, byte-exact, in the order sent, none twice, every
// acknowledged one present. It returns one message per problem (capped).
func (w *writer) verify(content []byte) []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var problems []string
	add := func(format string, args ...any) {
		if len(problems) < 20 {
			problems = append(problems, fmt.Sprintf("%s: ", w.name)+fmt.Sprintf(format, args...))
		}
	}
	problems = append(problems, w.ackOrder...)
	seen := map[int]bool{}
	last := -1
	prefix := fmt.Sprintf("w%02d-", w.idx)
	rest := content
	for pos := 0; len(rest) > 0; {
		i := bytes.IndexByte(rest, '\n')
		if i < 0 {
			add("content ends with a partial line %q at byte %d", truncate(string(rest), 80), pos)
			break
		}
		line := string(rest[:i])
		rest = rest[i+1:]
		at := pos
		pos += i + 1
		num, ok := strings.CutPrefix(line, prefix)
		if !ok && w.shared && isWriterLine(line) {
			continue // another writer's append on the same stream
		}
		n, err := strconv.Atoi(num)
		if !ok || err != nil || strconv.Itoa(n) != num {
			add("unexpected bytes %q at byte %d", truncate(line, 80), at)
			continue
		}
		_, wasAcked := w.acked[n]
		_, wasFailed := w.failed[n]
		switch {
		case seen[n]:
			add("append %d appears twice (second copy at byte %d; acknowledged=%v)", n, at, wasAcked)
		case !wasAcked && !wasFailed:
			add("append %d appears but was never sent to completion", n)
		}
		if n <= last {
			add("append %d at byte %d comes after append %d: out of order", n, at, last)
		}
		seen[n] = true
		last = max(last, n)
	}
	var lost []int
	for n := range w.acked {
		if !seen[n] {
			lost = append(lost, n)
		}
	}
	if len(lost) > 0 {
		slices.Sort(lost)
		add("%d acknowledged appends are missing, e.g. %v", len(lost), lost[:min(len(lost), 10)])
	}
	return problems
}

// isWriterLine reports whether line has the shape of a writer's body,
// "w<two digits>-<n>".
func isWriterLine(line string) bool {
	if len(line) < 5 || line[0] != 'w' || line[3] != '-' {
		return false
	}
	for _, c := range line[1:3] + line[4:] {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// ---- long-poll tailers.

// servedChunk is bytes a reader was served at an offset.
type servedChunk struct {
	offset string
	pos    int // byte position of the chunk in the stream, as the reader counted
	data   []byte
	epoch  int // restarts of the server before the chunk was served
	at     time.Time
}

// tailer follows a stream with long-poll reads from its start, keeping
// every chunk it was served with the offset it was served at.
type tailer struct {
	c     *dsClient
	name  string
	epoch func() int

	mu      sync.Mutex
	offset  string
	content []byte
	chunks  []servedChunk
	errs    []string
	polls   int
}

func newTailer(c *dsClient, name string, epoch func() int) *tailer {
	return &tailer{c: c, name: name, epoch: epoch, offset: "-1"}
}

func (tl *tailer) problem(format string, args ...any) {
	if len(tl.errs) < 20 {
		tl.errs = append(tl.errs, tl.name+": "+fmt.Sprintf(format, args...))
	}
}

// at returns the offset the tailer will read from next.
func (tl *tailer) at() string {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	return tl.offset
}

// run polls until ctx ends. Connection errors and 5xx are retried at the
// same offset (the server is down or restarting).
func (tl *tailer) run(ctx context.Context) {
	for ctx.Err() == nil {
		tl.mu.Lock()
		off := tl.offset
		tl.mu.Unlock()
		ep := tl.epoch()
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		r, err := tl.c.do(rctx, http.MethodGet, tl.name, "offset="+url.QueryEscape(off)+"&live=long-poll", nil, nil)
		cancel()
		if err != nil || r.status >= 500 {
			sleepCtx(ctx, 50*time.Millisecond)
			continue
		}
		tl.mu.Lock()
		tl.polls++
		next := r.next()
		switch {
		case r.status == http.StatusOK && len(r.body) > 0:
			if next == "" || (off != "-1" && next <= off) {
				tl.problem("200 at %s with %d bytes but Stream-Next-Offset %q", off, len(r.body), next)
				tl.mu.Unlock()
				return
			}
			tl.chunks = append(tl.chunks, servedChunk{offset: off, pos: len(tl.content), data: r.body, epoch: ep, at: time.Now()})
			tl.content = append(tl.content, r.body...)
			tl.offset = next
		case r.status == http.StatusOK || r.status == http.StatusNoContent:
			// Nothing new. At offset -1 the first answer names the real
			// start; anywhere else the tail must be where we are: a tail
			// behind us means we were served bytes that are gone, one
			// ahead of us means bytes were skipped.
			if next == "" {
				tl.problem("%d at %s without Stream-Next-Offset", r.status, off)
			} else if off == "-1" {
				tl.offset = next
			} else if next != off {
				tl.problem("empty %d at %s names tail %s", r.status, off, next)
				tl.offset = next
			}
		default:
			tl.problem("GET at %s: %s", off, r)
			tl.mu.Unlock()
			sleepCtx(ctx, 200*time.Millisecond)
			continue
		}
		tl.mu.Unlock()
	}
}

// ---- SSE subscribers.

// sseControl is the payload of a control event.
type sseControl struct {
	StreamNextOffset string `json:"streamNextOffset"`
	StreamCursor     string `json:"streamCursor"`
	UpToDate         bool   `json:"upToDate"`
	StreamClosed     bool   `json:"streamClosed"`
}

// sseEvent is one parsed server-sent event.
type sseEvent struct {
	event string
	data  string // data lines joined by "\n"
}

// openSSE starts an SSE read of path (its query included) that ends with
// ctx or the test, and returns its body to read events from.
func openSSE(ctx context.Context, t *testing.T, e *fhEnv, path string) *bufio.Reader {
	t.Helper()
	return bufio.NewReader(sseResponse(ctx, t, e, path).Body)
}

// sseResponse sends openSSE's request and returns the response, whose body
// is closed when the test ends, for a caller that checks its status or
// headers too.
func sseResponse(ctx context.Context, t *testing.T, e *fhEnv, path string) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.caddy.URL()+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := e.client.Do(req)
	if err != nil {
		t.Fatalf("SSE: %v", err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

// readSSEEvent reads the next event. It returns io.EOF when the stream ends
// cleanly between events and io.ErrUnexpectedEOF when it ends inside one.
func readSSEEvent(br *bufio.Reader) (sseEvent, error) {
	var ev sseEvent
	var data []string
	started := false
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			if errors.Is(err, io.EOF) {
				if started || line != "" {
					return ev, io.ErrUnexpectedEOF
				}
				return ev, io.EOF
			}
			return ev, err
		}
		line = strings.TrimSuffix(strings.TrimSuffix(line, "\n"), "\r")
		if line == "" {
			if !started {
				continue
			}
			ev.data = strings.Join(data, "\n")
			return ev, nil
		}
		if strings.HasPrefix(line, ":") {
			continue // comment
		}
		started = true
		field, value, _ := strings.Cut(line, ":")
		value = strings.TrimPrefix(value, " ")
		switch field {
		case "event":
			ev.event = value
		case "data":
			data = append(data, value)
		}
	}
}

// sseConn describes one SSE response a subscriber had open.
type sseConn struct {
	opened time.Time
	ended  time.Time
	err    error // nil when the response ended cleanly between events
	events int
}

// subscriber follows a stream over SSE from its start, reconnecting from
// the last control event's streamNextOffset whenever a response ends.
type subscriber struct {
	c    *dsClient
	name string

	mu       sync.Mutex
	offset   string
	received []byte
	conns    []sseConn
	open     bool // a response is open right now
	errs     []string
	refused  int // connection attempts that failed
}

func newSubscriber(c *dsClient, name string) *subscriber {
	return &subscriber{c: c, name: name, offset: "-1"}
}

func (s *subscriber) problem(format string, args ...any) {
	if len(s.errs) < 20 {
		s.errs = append(s.errs, s.name+" (sse): "+fmt.Sprintf(format, args...))
	}
}

func (s *subscriber) at() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.offset
}

// run subscribes until ctx ends or the stream is closed.
func (s *subscriber) run(ctx context.Context) {
	for ctx.Err() == nil {
		if s.once(ctx) {
			return
		}
	}
}

// once makes one SSE request and reads it to its end; it reports whether
// the stream was closed (no reconnect).
func (s *subscriber) once(ctx context.Context) (closed bool) {
	s.mu.Lock()
	off := s.offset
	s.mu.Unlock()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet,
		s.c.base+s.name+"?offset="+url.QueryEscape(off)+"&live=sse", nil)
	if err != nil {
		s.mu.Lock()
		s.problem("building request: %v", err)
		s.mu.Unlock()
		return true
	}
	resp, err := s.c.hc.Do(req)
	if err != nil {
		s.mu.Lock()
		s.refused++
		s.mu.Unlock()
		sleepCtx(ctx, 50*time.Millisecond)
		return false
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		s.mu.Lock()
		if resp.StatusCode < 500 {
			s.problem("GET at %s: %d %q", off, resp.StatusCode, truncate(string(b), 200))
		}
		s.refused++
		s.mu.Unlock()
		sleepCtx(ctx, 100*time.Millisecond)
		return false
	}
	conn := sseConn{opened: time.Now()}
	s.mu.Lock()
	s.open = true
	s.mu.Unlock()
	defer func() {
		conn.ended = time.Now()
		s.mu.Lock()
		s.open = false
		s.conns = append(s.conns, conn)
		s.mu.Unlock()
	}()
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		s.mu.Lock()
		s.problem("Content-Type %q", ct)
		s.mu.Unlock()
	}
	b64 := strings.EqualFold(resp.Header.Get("Stream-SSE-Data-Encoding"), "base64")
	br := bufio.NewReader(resp.Body)
	var pending []byte // data not yet confirmed by a control event
	for {
		ev, err := readSSEEvent(br)
		if err != nil {
			if !errors.Is(err, io.EOF) {
				conn.err = err
			}
			return false
		}
		conn.events++
		switch ev.event {
		case "data":
			payload := []byte(ev.data)
			if b64 {
				dec, derr := base64.StdEncoding.DecodeString(strings.NewReplacer("\n", "", "\r", "").Replace(ev.data))
				if derr != nil {
					s.mu.Lock()
					s.problem("bad base64 data event: %v", derr)
					s.mu.Unlock()
					return true
				}
				payload = dec
			}
			pending = append(pending, payload...)
		case "control":
			var c sseControl
			if err := json.Unmarshal([]byte(ev.data), &c); err != nil || c.StreamNextOffset == "" {
				s.mu.Lock()
				s.problem("bad control event %q: %v", ev.data, err)
				s.mu.Unlock()
				return true
			}
			s.mu.Lock()
			if len(pending) > 0 && off != "-1" && c.StreamNextOffset <= off {
				s.problem("%d bytes of data but streamNextOffset %s is not after %s", len(pending), c.StreamNextOffset, off)
			}
			if off != "-1" && c.StreamNextOffset < off {
				s.problem("streamNextOffset went back from %s to %s", off, c.StreamNextOffset)
			}
			s.received = append(s.received, pending...)
			s.offset = c.StreamNextOffset
			off = c.StreamNextOffset
			s.mu.Unlock()
			pending = nil
			if c.StreamClosed {
				return true
			}
		default:
			s.mu.Lock()
			s.problem("unknown event %q", ev.event)
			s.mu.Unlock()
		}
	}
}

// ---- small helpers.

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

func sleepOrStop(stop <-chan struct{}, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-stop:
	case <-t.C:
	}
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// waitFor polls cond every 50ms until it holds or timeout passes.
func waitFor(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// firstDiff returns the index of the first byte where a and b differ, or
// the shorter length.
func firstDiff(a, b []byte) int {
	n := min(len(a), len(b))
	for i := 0; i < n; i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// around shows b near position i.
func around(b []byte, i int) string {
	lo, hi := max(0, i-40), min(len(b), i+40)
	return strconv.Quote(string(b[lo:hi]))
}

// digitMessages is a JSON-mode append body of n one-byte messages (the
// digits 0-9 in turn): the smallest records a client can send, for tests of
// what tiny records cost in memory.
func digitMessages(n int) []byte {
	b := make([]byte, 0, 2*n+1)
	b = append(b, '[')
	for i := range n {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, '0'+byte(i%10))
	}
	return append(b, ']')
}
