package loadgen

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"
	"time"
)

// Response headers of the Durable Streams protocol.
const (
	hdrNextOffset = "Stream-Next-Offset"
	hdrUpToDate   = "Stream-Up-To-Date"
)

// hdrPicoNextSeq is the Pico protocol's tail header.
const hdrPicoNextSeq = "Pico-Next-Seq"

// readTally is one worker's figures.
type readTally struct {
	lat      []int64
	ops      int64
	errs     int64
	bytes    int64
	requests int64
	ok       int64
	mismatch int64
}

// sum merges the tallies into res and returns every latency sample.
func sumTallies(res *Result, ts []readTally) []int64 {
	var all []int64
	for i := range ts {
		t := &ts[i]
		res.Ops += t.ops
		res.Errors += t.errs
		res.Bytes += t.bytes
		res.Requests += t.requests
		res.OK += t.ok
		res.Mismatched += t.mismatch
		all = append(all, t.lat...)
	}
	return all
}

// get sends one catch-up GET of rawURL at offset and reads the body into
// buf (reset first) when buf is not nil, else discards it. It returns the
// next offset, whether the server said the reader is up to date, the
// number of body bytes, and an error for a failure or a non-2xx answer.
func (r *runner) get(ctx context.Context, rawURL, offset string, buf *bytes.Buffer) (next string, upToDate bool, n int64, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, rawURL+"?offset="+url.QueryEscape(offset), nil)
	if err != nil {
		return "", false, 0, err
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return "", false, 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return "", false, 0, errors.New(httpError(resp))
	}
	r.noteAnswer(resp)
	if buf != nil {
		n, err = buf.ReadFrom(resp.Body)
	} else {
		n, err = Discard(resp.Body)
	}
	if err != nil {
		return "", false, n, fmt.Errorf("reading the body: %w", err)
	}
	return resp.Header.Get(hdrNextOffset), resp.Header.Get(hdrUpToDate) == "true", n, nil
}

// readToTail reads rawURL from offset -1 until the server says up to
// date, calling each after every GET. A missing Stream-Next-Offset (a
// server that is not Durable Streams, such as a respond route), or an
// offset that does not move with an empty body, ends the read too.
func (r *runner) readToTail(ctx context.Context, rawURL string, buf *bytes.Buffer, each func(lat time.Duration, n int64)) error {
	off := "-1"
	var chunk *bytes.Buffer
	if buf != nil {
		chunk = new(bytes.Buffer)
	}
	for {
		start := time.Now()
		if chunk != nil {
			chunk.Reset()
		}
		next, upToDate, n, err := r.get(ctx, rawURL, off, chunk)
		if err != nil {
			return err
		}
		if each != nil {
			each(time.Since(start), n)
		}
		if buf != nil {
			buf.Write(chunk.Bytes())
		}
		if upToDate || next == "" || (next == off && n == 0) {
			return nil
		}
		off = next
	}
}

// runRead: --readers goroutines each read --stream once from the start to
// the tail. ops are GETs; latency is per GET.
func (r *runner) runRead(ctx context.Context) (*Result, error) {
	cfg := r.cfg
	rawURL := cfg.URL + cfg.Stream
	tallies := make([]readTally, cfg.Readers)
	procs, elapsed, err := r.whole(ctx, func() {
		var wg sync.WaitGroup
		for i := range cfg.Readers {
			t := &tallies[i]
			wg.Go(func() {
				err := r.readToTail(ctx, rawURL, nil, func(lat time.Duration, n int64) {
					r.ops.Add(1)
					r.hist.record(lat)
					t.ops++
					t.requests++
					t.bytes += n
					t.lat = append(t.lat, int64(lat))
				})
				if err != nil {
					r.errs.Add(1)
					t.errs++
					r.errMsg.add(err.Error())
				}
			})
		}
		wg.Wait()
	})
	res := r.wholeResult(ModeRead, elapsed, tallies, procs)
	res.Stream = cfg.Stream
	res.Readers = cfg.Readers
	return res, err
}

// PopulateBody is the record populate writes to stream i (and verify
// expects there): size bytes that depend only on i, size and the content
// type (see fillBody).
func PopulateBody(i, size int, contentType string) []byte {
	return fillBody(make([]byte, size), contentType, i)
}

// pool runs fn for i in [0, n) on --writers workers and tallies by worker.
func (r *runner) pool(ctx context.Context, n int, fn func(i int, t *readTally)) []readTally {
	workers := min(r.cfg.Writers, n)
	tallies := make([]readTally, workers)
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		t := &tallies[w]
		wg.Go(func() {
			for ctx.Err() == nil {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				fn(i, t)
			}
		})
	}
	wg.Wait()
	return tallies
}

// fail tallies a failed operation.
func (r *runner) fail(t *readTally, msg string) {
	r.errs.Add(1)
	t.errs++
	r.errMsg.add(msg)
}

// done tallies a completed operation.
func (r *runner) done(t *readTally, lat time.Duration, n int64) {
	r.ops.Add(1)
	r.hist.record(lat)
	t.ops++
	t.bytes += n
	t.lat = append(t.lat, int64(lat))
}

// runPopulate creates --streams streams, each holding PopulateBody: a PUT
// with the record as its body, or with --create=false a POST of it to a
// stream that exists. ops are streams written; latency is per request.
func (r *runner) runPopulate(ctx context.Context) (*Result, error) {
	cfg := r.cfg
	var tallies []readTally
	procs, elapsed, err := r.whole(ctx, func() {
		tallies = r.pool(ctx, cfg.Streams, func(i int, t *readTally) {
			body := PopulateBody(i, cfg.Size, cfg.ContentType)
			method := http.MethodPut
			if !cfg.Create {
				method = http.MethodPost
			}
			start := time.Now()
			req, err := http.NewRequestWithContext(ctx, method, r.streamURL(i), bytes.NewReader(body))
			if err != nil {
				r.fail(t, err.Error())
				return
			}
			req.Header.Set("Content-Type", cfg.ContentType)
			resp, err := r.client.Do(req)
			if err != nil {
				r.fail(t, err.Error())
				return
			}
			if resp.StatusCode/100 != 2 {
				r.fail(t, httpError(resp))
				drain(resp.Body)
				return
			}
			r.noteAnswer(resp)
			drain(resp.Body)
			r.done(t, time.Since(start), int64(len(body)))
		})
	})
	return r.wholeResult(ModePopulate, elapsed, tallies, procs), err
}

// runVerify reads every stream populate wrote, from offset -1 to the
// tail, and compares it with PopulateBody. ops are streams read in full
// (ok + mismatched); latency is per stream.
func (r *runner) runVerify(ctx context.Context) (*Result, error) {
	cfg := r.cfg
	var tallies []readTally
	procs, elapsed, err := r.whole(ctx, func() {
		tallies = r.pool(ctx, cfg.Streams, func(i int, t *readTally) {
			want := PopulateBody(i, cfg.Size, cfg.ContentType)
			if isJSONType(cfg.ContentType) {
				// A JSON stream reads back as an array of its messages.
				want = append(append([]byte{'['}, want...), ']')
			}
			var got bytes.Buffer
			start := time.Now()
			err := r.readToTail(ctx, r.streamURL(i), &got, func(time.Duration, int64) { t.requests++ })
			if err != nil {
				r.fail(t, r.streamName(i)+": "+err.Error())
				return
			}
			r.done(t, time.Since(start), int64(got.Len()))
			if bytes.Equal(got.Bytes(), want) {
				t.ok++
				return
			}
			t.mismatch++
			r.errMsg.add(fmt.Sprintf("%s: mismatch: %d bytes, want %d (first difference at byte %d)",
				r.streamName(i), got.Len(), len(want), firstDiff(got.Bytes(), want)))
		})
	})
	return r.wholeResult(ModeVerify, elapsed, tallies, procs), err
}

func firstDiff(a, b []byte) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// wholeResult is the result of a mode measured as one whole run (read,
// populate, verify): its tallies summed, over elapsed.
func (r *runner) wholeResult(mode string, elapsed time.Duration, tallies []readTally, procs []Process) *Result {
	res := r.result(mode)
	res.DurationS = elapsed.Seconds()
	res.Latency = latencyOf(sumTallies(res, tallies))
	res.Processes = procs
	res.ErrorSamples = r.errMsg.list()
	res.finish()
	r.warnNotStreams(res)
	return res
}
