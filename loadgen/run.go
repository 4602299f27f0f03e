package loadgen

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Run performs one run. On a fatal error (a failed mark POST, a stream that
// cannot be created, an unreadable process) it returns the error, and the
// result as far as it got when there is one.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	if err := cfg.normalize(); err != nil {
		return nil, err
	}
	r := newRunner(cfg)
	defer r.tr.CloseIdleConnections()
	switch cfg.Mode {
	case ModeAppend:
		return r.runAppend(ctx)
	case ModeSSE:
		return r.runSSE(ctx)
	case ModeRead:
		return r.runRead(ctx)
	case ModePopulate:
		return r.runPopulate(ctx)
	default:
		return r.runVerify(ctx)
	}
}

// runner holds what every mode shares.
type runner struct {
	cfg    Config
	tr     *http.Transport
	client *http.Client // with the per-request timeout
	live   *http.Client // no timeout, for SSE

	// Progress counters, over the whole run (warm-up included).
	ops    atomic.Int64
	errs   atomic.Int64
	hist   histogram
	errMsg errorSamples // errors inside the measured window

	// streamAnswers is set by the first 2xx answer that carries a stream's
	// next offset (or Pico's next seq), as every stream server's do.
	streamAnswers atomic.Bool
}

// noteAnswer records whether a 2xx answer came from a stream server.
func (r *runner) noteAnswer(resp *http.Response) {
	if !r.streamAnswers.Load() && (resp.Header.Get(hdrNextOffset) != "" || resp.Header.Get(hdrPicoNextSeq) != "") {
		r.streamAnswers.Store(true)
	}
}

// warnNotStreams adds a warning to a run that counted successes when no
// answer looked like a stream server's: any 2xx counts as success, and a
// Caddy site whose host does not match the URL's (127.0.0.1 against a
// site for localhost) answers every request with an empty 200.
func (r *runner) warnNotStreams(res *Result) {
	if res.Ops > 0 && !r.streamAnswers.Load() {
		res.Warnings = append(res.Warnings, "no answer carried "+hdrNextOffset+" or "+hdrPicoNextSeq+
			": the URL does not look like a stream server's, and its 2xx were counted all the same"+
			" (a Caddy site whose host does not match the URL's answers every request with an empty 200;"+
			" so does a bare respond route)")
	}
}

func newRunner(cfg Config) *runner {
	conns := max(cfg.Writers, cfg.Subscribers, cfg.Readers) + 16
	tr := &http.Transport{
		Proxy: nil, // measure the server, not a proxy from the environment
		DialContext: (&net.Dialer{
			Timeout:   10 * time.Second,
			KeepAlive: 30 * time.Second,
		}).DialContext,
		MaxIdleConns:          0, // no limit
		MaxIdleConnsPerHost:   conns,
		MaxConnsPerHost:       0,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ExpectContinueTimeout: time.Second,
		// Live reads have no overall timeout, but their headers must come.
		ResponseHeaderTimeout: cfg.Timeout,
		DisableCompression:    true,
		// One HTTP/1.1 connection per writer, also over TLS: the load shape
		// is then the same whatever the scheme.
		TLSNextProto: map[string]func(string, *tls.Conn) http.RoundTripper{},
	}
	if cfg.RootCAs != nil {
		tr.TLSClientConfig = &tls.Config{RootCAs: cfg.RootCAs}
	}
	var rt http.RoundTripper = tr
	if len(cfg.Header) > 0 {
		u, _ := url.Parse(cfg.URL) // checked by normalize
		rt = &withHeader{base: tr, host: u.Host, header: cfg.Header}
	}
	return &runner{
		cfg:    cfg,
		tr:     tr,
		client: &http.Client{Transport: rt, Timeout: cfg.Timeout},
		live:   &http.Client{Transport: rt},
	}
}

// withHeader adds the configured headers to every request for the server's
// host. Requests elsewhere (the mark URL) go without them: an Authorization
// meant for the server is not for anyone else.
type withHeader struct {
	base   http.RoundTripper
	host   string
	header http.Header
}

func (t *withHeader) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Host != t.host {
		return t.base.RoundTrip(req)
	}
	// A RoundTripper must not change the request it is given.
	out := req.Clone(req.Context())
	for name, values := range t.header {
		if name == "Host" {
			out.Host = values[0]
			continue
		}
		out.Header[name] = values
	}
	return t.base.RoundTrip(out)
}

// streamName is the name of stream i: Prefix + i.
func (r *runner) streamName(i int) string { return r.cfg.Prefix + strconv.Itoa(i) }

// streamURL is the URL of stream i.
func (r *runner) streamURL(i int) string { return r.cfg.URL + r.streamName(i) }

// httpError describes a non-2xx answer: status and the first 200 bytes of
// the body.
func httpError(resp *http.Response) string {
	var b [200]byte
	n, _ := io.ReadFull(resp.Body, b[:])
	return strconv.Itoa(resp.StatusCode) + ": " + strings.TrimSpace(string(b[:n]))
}

// readBuffers lend Discard its buffers.
var readBuffers = sync.Pool{New: func() any { b := make([]byte, 256<<10); return &b }}

// Discard reads r to its end and returns the bytes read. io.Copy to
// io.Discard reads 8 KiB at a time, so a catch-up read of hundreds of MiB
// cost the load generator a read syscall per 8 KiB, on the cores the
// server it measures runs on; the reads here take what the socket holds.
func Discard(r io.Reader) (int64, error) {
	bp := readBuffers.Get().(*[]byte)
	defer readBuffers.Put(bp)
	var n int64
	for {
		k, err := r.Read(*bp)
		n += int64(k)
		if err == io.EOF {
			return n, nil
		}
		if err != nil {
			return n, err
		}
	}
}

// drain reads what is left of a body (so the connection is reused) and
// closes it, returning the bytes read. The bodies it sees are a few bytes
// long, so it reads them with io.Discard's small buffers, not Discard's
// large ones: a thousand writers draining at once would otherwise each
// take 256 KiB.
func drain(body io.ReadCloser) int64 {
	n, _ := io.Copy(io.Discard, body)
	body.Close()
	return n
}

// createStreams PUTs streams [0, n) with workers concurrent requests; any
// answer but 2xx fails the run. body, when not nil, gives stream i's
// initial content.
func (r *runner) createStreams(ctx context.Context, n int, body func(i int) []byte) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	var once sync.Once
	var firstErr error
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// sse mode creates its one stream whatever --writers says.
	for range max(1, min(r.cfg.Writers, n)) {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= n || ctx.Err() != nil {
					return
				}
				var b []byte
				if body != nil {
					b = body(i)
				}
				if err := r.put(ctx, i, b); err != nil {
					once.Do(func() { firstErr = err; cancel() })
					return
				}
			}
		})
	}
	wg.Wait()
	if firstErr == nil {
		firstErr = ctx.Err()
	}
	return firstErr
}

// put creates stream i with an optional initial body.
func (r *runner) put(ctx context.Context, i int, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, r.streamURL(i), bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", r.cfg.ContentType)
	resp, err := r.client.Do(req)
	if err != nil {
		return fmt.Errorf("creating %s: %w", r.streamName(i), err)
	}
	defer drain(resp.Body)
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("creating %s: %s", r.streamName(i), httpError(resp))
	}
	r.noteAnswer(resp)
	return nil
}

// mark POSTs the mark URL with ?phase=PHASE (or &phase= when the URL has a
// query already). Any failure is fatal to the run.
func (r *runner) mark(ctx context.Context, phase string) error {
	if r.cfg.Mark == "" {
		return nil
	}
	u := r.cfg.Mark
	if strings.Contains(u, "?") {
		u += "&phase=" + url.QueryEscape(phase)
	} else {
		u += "?phase=" + url.QueryEscape(phase)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, nil)
	if err != nil {
		return fmt.Errorf("mark %s: %w", phase, err)
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return fmt.Errorf("mark %s: %w", phase, err)
	}
	defer drain(resp.Body)
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("mark %s: %s", phase, httpError(resp))
	}
	return nil
}

// processes are the processes to account for: --pid ones, then this one.
func (r *runner) processes() []NamedPID {
	procs := append([]NamedPID(nil), r.cfg.PIDs...)
	if procAvailable() {
		procs = append(procs, NamedPID{Name: "bench", PID: os.Getpid()})
	}
	return procs
}

// window runs the measured window's bookkeeping: it waits until start,
// posts the start mark and starts watching the processes, waits until end,
// then posts the end mark and collects the processes' figures. It returns
// early with an error when ctx ends or a mark or process read fails.
func (r *runner) window(ctx context.Context, start, end time.Time) ([]Process, error) {
	if err := sleepUntil(ctx, start); err != nil {
		return nil, err
	}
	if err := r.mark(ctx, "start"); err != nil {
		return nil, err
	}
	w, err := startProcWatch(r.processes())
	if err != nil {
		return nil, err
	}
	if err := sleepUntil(ctx, end); err != nil {
		w.finish()
		return nil, err
	}
	procs, perr := w.finish()
	if err := r.mark(ctx, "end"); err != nil {
		return procs, err
	}
	return procs, perr
}

func sleepUntil(ctx context.Context, t time.Time) error {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err()
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-tm.C:
		return nil
	}
}

// progress prints a line a second until stop is closed: elapsed time, ops
// so far, ops in the last second, errors and the p99 of the last second.
// extra, when not nil, adds mode-specific text.
func (r *runner) progress(stop <-chan struct{}, start time.Time, extra func() string) (done <-chan struct{}) {
	ch := make(chan struct{})
	if r.cfg.Progress == nil {
		close(ch)
		return ch
	}
	go func() {
		defer close(ch)
		t := time.NewTicker(time.Second)
		defer t.Stop()
		var p progressState
		for {
			select {
			case <-stop:
				// A run shorter than a tick still shows one line, or
				// whoever watches it sees nothing until the summary.
				if p.lines == 0 {
					r.printProgress(&p, start, extra)
				}
				if r.cfg.ProgressTTY {
					io.WriteString(r.cfg.Progress, "\n")
				}
				return
			case <-t.C:
			}
			r.printProgress(&p, start, extra)
		}
	}()
	return ch
}

func (r *runner) printProgress(p *progressState, start time.Time, extra func() string) {
	line := r.progressLine(p, time.Since(start))
	if extra != nil {
		line += "  " + extra()
	}
	if r.cfg.ProgressTTY {
		io.WriteString(r.cfg.Progress, "\r\033[K"+line)
	} else {
		io.WriteString(r.cfg.Progress, line+"\n")
	}
}

// progressState is what the progress line keeps from one line to the
// next: its figures are of the interval since.
type progressState struct {
	ops   int64
	hist  histCounts
	at    time.Duration // elapsed time at the last line
	lines int
}

// progressLine is one progress line, without the mode's extra. Its p99 is
// of the appends (or reads) answered since the last line, as its ops/s
// are: one watching a run wants to see latency as it is now, a stall or
// a recovery, and a p99 over the whole run so far, warm-up included,
// moves less each second and hides both. The summary has the window's.
func (r *runner) progressLine(p *progressState, elapsed time.Duration) string {
	ops := r.ops.Load()
	p99 := "-" // nothing answered in the interval
	if d, ok := r.hist.quantileSince(&p.hist, 0.99); ok {
		p99 = fmt.Sprintf("%.2fms", float64(d)/1e6)
	}
	// Lines come about a second apart: one cut short by the run's end, or
	// put off on a busy machine, is a rate over its own interval.
	rate := ops - p.ops
	if iv := elapsed - p.at; iv > 0 {
		rate = int64(math.Round(float64(rate) / iv.Seconds()))
	}
	line := fmt.Sprintf("%6.1fs  ops %d  %d/s  errors %d  p99 (last 1s) %s",
		elapsed.Seconds(), ops, rate, r.errs.Load(), p99)
	p.ops, p.at = ops, elapsed
	p.lines++
	return line
}

// whole measures a run that has no fixed window (read, populate, verify):
// the window is fn's run, with the marks and the process figures around it.
func (r *runner) whole(ctx context.Context, fn func()) (procs []Process, elapsed time.Duration, err error) {
	if err := r.mark(ctx, "start"); err != nil {
		return nil, 0, err
	}
	w, err := startProcWatch(r.processes())
	if err != nil {
		return nil, 0, err
	}
	start := time.Now()
	stop := make(chan struct{})
	pdone := r.progress(stop, start, nil)
	fn()
	elapsed = time.Since(start)
	close(stop)
	<-pdone
	procs, err = w.finish()
	if merr := r.mark(ctx, "end"); merr != nil {
		return procs, elapsed, merr
	}
	return procs, elapsed, err
}
