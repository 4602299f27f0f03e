package loadgen

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/url"
	"sync"
	"time"
)

// appendWorker is one writer's tally inside the measured window; only its
// own goroutine touches it until the run ends.
type appendWorker struct {
	lat  []int64 // nanoseconds, successful appends only
	ops  int64
	errs int64
}

// runAppend: writer w appends to the streams of its share round-robin.
// With at least as many streams as writers, its share is the streams s
// with s mod writers == w; with fewer, it is the single stream w mod
// streams. Either way every stream gets load, and as evenly as the counts
// allow.
func (r *runner) runAppend(ctx context.Context) (*Result, error) {
	cfg := r.cfg
	if cfg.Create {
		if err := r.createStreams(ctx, cfg.Streams, nil); err != nil {
			return nil, err
		}
	}
	body := fillBody(make([]byte, cfg.Size), cfg.ContentType, 0)
	urls := make([]*url.URL, cfg.Streams)
	for i := range urls {
		u, err := url.Parse(r.streamURL(i))
		if err != nil {
			return nil, err
		}
		urls[i] = u
	}
	hdr := http.Header{"Content-Type": {cfg.ContentType}}

	t0 := time.Now()
	winStart := t0.Add(cfg.Warmup)
	winEnd := winStart.Add(cfg.Duration)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	workers := make([]appendWorker, cfg.Writers)
	var wg sync.WaitGroup
	for w := range cfg.Writers {
		wg.Go(func() {
			r.appendLoop(ctx, w, &workers[w], urls, hdr, body, t0, winStart, winEnd)
		})
	}
	stop := make(chan struct{})
	pdone := r.progress(stop, t0, nil)
	procs, werr := r.window(ctx, winStart, winEnd)
	if werr != nil && procs == nil {
		cancel() // a fatal error before the window closed: stop now
	}
	// Appends in flight at the end finish on their own (within the
	// timeout) but do not count.
	wg.Wait()
	close(stop)
	<-pdone
	if werr != nil && procs == nil {
		return nil, werr // the window did not complete: no figures
	}

	res := r.result(ModeAppend)
	res.DurationS = cfg.Duration.Seconds()
	var all []int64
	for i := range workers {
		res.Ops += workers[i].ops
		res.Errors += workers[i].errs
		all = append(all, workers[i].lat...)
		workers[i].lat = nil
	}
	res.Bytes = res.Ops * int64(cfg.Size)
	res.Latency = latencyOf(all)
	res.Processes = procs
	res.ErrorSamples = r.errMsg.list()
	res.finish()
	r.warnNotStreams(res)
	return res, werr
}

// appendLoop is one writer. Closed loop (no rate), latency runs from
// sending to the answer; open loop, writer w sends its k-th append at
// t0 + (k*writers + w)/rate and latency runs from that scheduled time, so
// a server that falls behind the rate shows it in latency (no coordinated
// omission).
func (r *runner) appendLoop(ctx context.Context, w int, tally *appendWorker, urls []*url.URL, hdr http.Header, body []byte,
	t0, winStart, winEnd time.Time) {
	cfg := r.cfg
	nstreams := len(urls)
	first, step, count := w%nstreams, cfg.Writers, 1
	if cfg.Writers < nstreams {
		first = w
		count = (nstreams - w + cfg.Writers - 1) / cfg.Writers
	}
	tally.lat = make([]int64, 0, 1024)
	var interval, offset time.Duration
	if cfg.Rate > 0 {
		interval = time.Duration(float64(cfg.Writers) / cfg.Rate * float64(time.Second))
		offset = time.Duration(float64(w) / cfg.Rate * float64(time.Second))
	}
	for k := 0; ; k++ {
		if ctx.Err() != nil {
			return
		}
		var start time.Time
		if interval > 0 {
			start = t0.Add(offset + time.Duration(k)*interval)
			// A writer behind its schedule stops at the window's end
			// too: what it still owes would only be load nobody
			// measures, for as long again as it is behind.
			if !start.Before(winEnd) || !time.Now().Before(winEnd) {
				return
			}
			if d := time.Until(start); d > 0 {
				time.Sleep(d)
			}
		} else {
			start = time.Now()
			if !start.Before(winEnd) {
				return
			}
		}
		u := urls[first+(k%count)*step]
		req := &http.Request{
			Method:        http.MethodPost,
			URL:           u,
			Proto:         "HTTP/1.1",
			ProtoMajor:    1,
			ProtoMinor:    1,
			Header:        hdr, // shared and only read
			Body:          io.NopCloser(bytes.NewReader(body)),
			ContentLength: int64(len(body)),
			Host:          u.Host,
		}
		ok, msg, answered := r.send(req)
		end := time.Now()
		lat := end.Sub(start)
		inWindow := !end.Before(winStart) && !end.After(winEnd)
		if ok {
			r.ops.Add(1)
			r.hist.record(lat)
			if inWindow {
				tally.ops++
				tally.lat = append(tally.lat, int64(lat))
			}
		} else {
			r.errs.Add(1)
			if inWindow {
				tally.errs++
				r.errMsg.add(msg)
			}
			if !answered && interval == 0 {
				// Nothing answered (the server is down or restarting): a
				// closed loop would retry at once, tens of thousands of
				// times a second, taking the CPU the server needs to come
				// back on the machine they share.
				pause(ctx, noAnswerPause)
			}
		}
	}
}

// noAnswerPause is how long a closed-loop writer waits after a request
// that got no answer.
const noAnswerPause = 100 * time.Millisecond

// pause waits d or until ctx ends.
func pause(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// result starts a Result with the run's configuration. Settings the mode
// does not use are left zero: read mode's result carried the defaults
// "writers": 64 and "streams": 100, which read as if 64 writers had taken
// part. The keys stay, so that every result has the same shape.
func (r *runner) result(mode string) *Result {
	cfg := r.cfg
	res := &Result{
		Mode:         mode,
		URL:          cfg.URL,
		ErrorSamples: []string{},
		Warnings:     []string{},
		Processes:    []Process{},
	}
	if FlagUsed(mode, "prefix") {
		res.Prefix = cfg.Prefix
	}
	if FlagUsed(mode, "writers") {
		res.Writers = cfg.Writers
	}
	if FlagUsed(mode, "streams") {
		res.Streams = cfg.Streams
	}
	if FlagUsed(mode, "size") {
		res.Size = cfg.Size
	}
	if FlagUsed(mode, "rate") {
		res.Rate = cfg.Rate
	}
	return res
}

// finish fills the rates and the error samples.
func (res *Result) finish() {
	if res.DurationS > 0 {
		res.OpsPerS = float64(res.Ops) / res.DurationS
		res.MBPerS = float64(res.Bytes) / (1 << 20) / res.DurationS
	}
	if res.Processes == nil {
		res.Processes = []Process{}
	}
	if res.ErrorSamples == nil {
		res.ErrorSamples = []string{}
	}
	if res.Warnings == nil {
		res.Warnings = []string{}
	}
}

// fillBody fills b with printable bytes that identify tag and returns it:
// "#tag#" then a letter pattern that depends on tag, ending in a newline.
// For application/json the body is a JSON string of the same length
// instead (a JSON stream takes only JSON values). Bodies too short for the
// tag hold only the pattern.
func fillBody(b []byte, contentType string, tag int) []byte {
	for i := range b {
		b[i] = 'a' + byte((tag*7+i)%26)
	}
	head := appendTag(nil, tag)
	json := isJSONType(contentType)
	switch {
	case json && len(b) >= len(head)+2:
		b[0] = '"'
		copy(b[1:], head)
		b[len(b)-1] = '"'
	case json && len(b) >= 2:
		b[0], b[len(b)-1] = '"', '"'
	case len(b) >= len(head)+1:
		copy(b, head)
		b[len(b)-1] = '\n'
	}
	return b
}

// appendTag appends "#N#".
func appendTag(b []byte, n int) []byte {
	b = append(b, '#')
	b = appendInt(b, n)
	return append(b, '#')
}

func appendInt(b []byte, n int) []byte {
	if n == 0 {
		return append(b, '0')
	}
	var d [20]byte
	i := len(d)
	for n > 0 {
		i--
		d[i] = byte('0' + n%10)
		n /= 10
	}
	return append(b, d[i:]...)
}

func isJSONType(ct string) bool {
	mt, _, _ := bytes.Cut([]byte(ct), []byte(";"))
	return string(bytes.ToLower(bytes.TrimSpace(mt))) == "application/json"
}

// send does req and reads the answer to its end: ok for a 2xx, else what
// went wrong (the transport error, or the status and the start of the
// body); answered is false when no answer came.
func (r *runner) send(req *http.Request) (ok bool, msg string, answered bool) {
	resp, err := r.client.Do(req)
	if err != nil {
		return false, err.Error(), false
	}
	defer drain(resp.Body)
	if resp.StatusCode/100 != 2 {
		return false, httpError(resp), true
	}
	r.noteAnswer(resp)
	return true, "", true
}
