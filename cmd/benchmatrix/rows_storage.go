//go:build linux

package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3types "github.com/aws/aws-sdk-go-v2/service/s3/types"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
	"github.com/picomq/caddy-picomq/loadgen"
)

// row5: 1 MiB appends against 1 MiB PUTs straight into versitygw.
func (m *matrix) row5(ctx context.Context) {
	t0 := time.Now()
	const writers, size = 8, 1 << 20
	r := newRow("5", "1 MiB appends, 8 writers over 8 streams", "≥ 50% of the bandwidth of 8 writers PUTting 1 MiB objects straight into versitygw")
	set := rowSettings["5"]
	r.use(set)
	m.rows = append(m.rows, r)
	defer func() { r.Elapsed = time.Since(t0) }()

	m.logf("  reference: %d goroutines PUT 1 MiB objects into versitygw for %s after %s", writers, m.sc.Duration, m.sc.Warmup)
	ref, refP99, refN, err := m.putBandwidth(ctx, writers, size, m.sc.Warmup, m.sc.Duration)
	r.Commands = append(r.Commands, fmt.Sprintf("# reference: in cmd/benchmatrix, %d goroutines PutObject 1 MiB (aws-sdk-go-v2, path style) of new keys to versitygw directly, %s warm-up, %s window; the objects deleted and the page cache flushed afterwards", writers, m.sc.Warmup, m.sc.Duration))
	if err != nil {
		r.Err = "reference PUTs: " + err.Error()
		return
	}
	m.logf("  reference: %.1f MiB/s (%d PUTs, p99 %s ms)", ref, refN, fmtNum(refP99))
	r.Reference = fmt.Sprintf("direct PutObject of new keys: %.1f MiB/s, p99 %s ms", ref, fmtNum(refP99))
	m.settle()

	e, err := m.newPico(ctx, "5", set)
	if err != nil {
		r.Err = "starting PicoMQ: " + err.Error()
		return
	}
	defer e.close()
	spec := appendSpec("/r5/", writers, writers, size, m.sc.Warmup, m.sc.Duration)
	pr, err := m.measurePico(ctx, e, "r5", spec)
	r.Commands = append(r.Commands, "# PicoMQ", pr.cmd)
	if err != nil {
		r.Err = err.Error()
		return
	}
	got := pr.res.mibPerS()
	r.Measured = fmt.Sprintf("%.1f MiB/s (%s appends/s), p99 %s ms, %s S3 req/1,000 appends",
		got, fmtNum(float64(pr.res.OpsPerS)), fmtNum(float64(pr.res.Latency.P99)), fmtNum(pr.per1k()))
	if ref > 0 {
		r.Ratio = got / ref
	}
	r.Checks = append(r.Checks, ratioCheck(r.Ratio, 0.5), errorCheck(pr.res))
	r.Details = append(r.Details, s3Breakdown(pr.s3, pr.marked))
	r.Details = append(r.Details, processDetail(pr.res)...)
	r.Details = append(r.Details, errorDetail(pr.res)...)
}

// putBandwidth has writers goroutines PUT size-byte objects into a fresh
// bucket on versitygw, and returns the MiB/s, the p99 in ms and the PUT
// count of the window after warmup. Every PUT is a new key, as every
// append is new data: rewriting a few keys would let the filesystem drop
// each object before it reached the disk, which the stream, keeping every
// byte, never gets. The objects are deleted afterwards.
func (m *matrix) putBandwidth(ctx context.Context, writers, size int, warmup, dur time.Duration) (float64, float64, int, error) {
	m.buckets++
	bucket := fmt.Sprintf("bench-r5-ref-%d", m.buckets)
	if err := m.versity.CreateBucket(ctx, bucket); err != nil {
		return 0, 0, 0, err
	}
	client := m.versity.Client()
	body := make([]byte, size)
	for i := range body {
		body[i] = byte(rand.N(256))
	}
	lat, elapsed, err := timedPuts(ctx, writers, warmup, dur, func(ctx context.Context, w, n int) error {
		key := fmt.Sprintf("ref/writer-%d/%08d", w, n)
		_, err := client.PutObject(ctx, &s3.PutObjectInput{
			Bucket: aws.String(bucket), Key: aws.String(key), Body: bytes.NewReader(body),
			ContentLength: aws.Int64(int64(size)),
		})
		return err
	})
	if err != nil {
		return 0, 0, 0, err
	}
	if err := deleteAll(ctx, client, bucket, "ref/"); err != nil {
		return 0, 0, 0, fmt.Errorf("deleting the reference objects: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return 0, 0, 0, err
	}
	return float64(len(lat)) * float64(size) / elapsed.Seconds() / (1 << 20), percentile(lat, 99), len(lat), nil
}

// timedPuts has writers goroutines call put, each with its number w and
// a count n of its own calls, through warmup and then a window of dur, and
// returns the latencies in ms, sorted, of the calls counted in the window,
// and the window's length. It counts as the load generator counts appends
// (closed loop): a call that completes inside the window counts, whenever
// it started, and none starts after the window's end; so the reference
// and the PicoMQ run it is set against count alike. A writer whose call
// fails stops, and the first error is returned.
func timedPuts(ctx context.Context, writers int, warmup, dur time.Duration, put func(ctx context.Context, w, n int) error) ([]float64, time.Duration, error) {
	winStart := time.Now().Add(warmup)
	winEnd := winStart.Add(dur)
	var (
		mu       sync.Mutex
		lat      []float64
		firstErr error
		wg       sync.WaitGroup
	)
	for w := range writers {
		wg.Go(func() {
			for n := 0; ctx.Err() == nil; n++ {
				start := time.Now()
				if !start.Before(winEnd) {
					return
				}
				if err := put(ctx, w, n); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
					return
				}
				end := time.Now()
				if !end.Before(winStart) && !end.After(winEnd) {
					mu.Lock()
					lat = append(lat, float64(end.Sub(start))/1e6)
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		return nil, 0, firstErr
	}
	if err := ctx.Err(); err != nil {
		return nil, 0, err
	}
	sort.Float64s(lat)
	return lat, dur, nil
}

// deleteAll deletes every object under prefix.
func deleteAll(ctx context.Context, c *s3.Client, bucket, prefix string) error {
	objs, err := listObjects(ctx, c, bucket, prefix)
	if err != nil {
		return err
	}
	for len(objs) > 0 {
		n := min(len(objs), 1000)
		ids := make([]s3types.ObjectIdentifier, n)
		for i, o := range objs[:n] {
			ids[i] = s3types.ObjectIdentifier{Key: aws.String(o.key)}
		}
		_, err := c.DeleteObjects(ctx, &s3.DeleteObjectsInput{Bucket: aws.String(bucket), Delete: &s3types.Delete{Objects: ids, Quiet: aws.Bool(true)}})
		if err != nil {
			return err
		}
		objs = objs[n:]
	}
	return nil
}

// percentile is the load generator's nearest-rank percentile of sorted, so
// that a reference's p99 is the same statistic as the PicoMQ run's.
func percentile(sorted []float64, p float64) float64 {
	return loadgen.Percentile(sorted, p)
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// row6: SSE fan-out, on PicoMQ and then, as a comparison, on the Node
// reference server.
func (m *matrix) row6(ctx context.Context) {
	m.row6Pico(ctx)
	m.row6Node(ctx)
}

func (m *matrix) sseSpec() benchSpec {
	// A warm-up as in the append rows: the 5,000 connections and their
	// first reads are the row's set-up, not its fan-out.
	return benchSpec{Mode: "sse", Prefix: "/r6/", Streams: 1, Subscribers: m.sc.SSESubscribers, Rate: m.sc.SSERate, Size: 1024,
		Warmup: m.sc.Warmup, Duration: m.sc.SSEDuration}
}

func (m *matrix) row6Pico(ctx context.Context) {
	t0 := time.Now()
	n := m.sc.SSESubscribers
	r := newRow("6", fmt.Sprintf("Fan-out: %s SSE subscribers on one stream, %g appends/s", fmtInt(float64(n)), m.sc.SSERate),
		"every event reaches every subscriber; p99 append-ack → receipt ≤ 100 ms; Caddy RSS ≤ 512 MiB")
	set := rowSettings["6"]
	r.use(set)
	m.rows = append(m.rows, r)
	defer func() { r.Elapsed = time.Since(t0) }()
	spec := m.sseSpec()

	// 100,000 events a second keep both cores near busy, so one window's
	// p99 moves with whatever else the machine does (120 and 200 ms in two
	// matrices of one path, 116 ms alone minutes after the second): like
	// rows 1, 3 and 4 the row takes the median of its rounds, each on a
	// fresh Caddy so that no round inherits another's heap.
	type round struct {
		res  *benchResult
		peak float64 // Caddy's peak RSS, the generator's or ours (MiB)
	}
	rounds := max(m.sc.Rounds, 1)
	runs := make([]round, 0, rounds)
	var last *picoEnv
	defer func() {
		if last != nil {
			last.close()
		}
	}()
	for k := range rounds {
		e, err := m.newPico(ctx, "6", set)
		if err != nil {
			r.Err = "starting PicoMQ: " + err.Error()
			return
		}
		if last != nil {
			last.close()
		}
		last = e
		// Our own sampling of Caddy's RSS, in case the generator's misses the peak.
		peak := sampleRSS(ctx, e.caddy.pid())
		pr, err := m.measurePico(ctx, e, fmt.Sprintf("r6-%d", k+1), spec)
		ownPeak := peak()
		if pr != nil && pr.cmd != "" {
			r.Commands = append(r.Commands, fmt.Sprintf("# round %d of %d, on a fresh Caddy", k+1, rounds), pr.cmd)
		}
		if err != nil {
			r.Err = err.Error()
			return
		}
		_, _, genPeak, _ := pr.res.process("caddy")
		runs = append(runs, round{res: pr.res, peak: max(genPeak, ownPeak)})
	}
	p99s := make([]float64, len(runs))
	var lost, peakRSS float64
	for k, run := range runs {
		p99s[k] = float64(run.res.Latency.P99)
		l := float64(run.res.Lost)
		if d := float64(run.res.Expected) - float64(run.res.Delivered); d > l {
			l = d
		}
		lost += l
		peakRSS = max(peakRSS, run.peak)
	}
	mid := medianIndex(p99s)
	res := runs[mid].res
	rate := 0.0
	if res.DurationS > 0 {
		rate = float64(res.Ops) / float64(res.DurationS)
	}
	r.Measured = fmt.Sprintf("%s of %s events delivered at %s appends/s, p99 %s ms (round %d of %d, the median), Caddy peak RSS %.0f MiB (the highest round's)",
		fmtInt(float64(res.Delivered)), fmtInt(float64(res.Expected)), fmtNum(rate), fmtNum(float64(res.Latency.P99)), mid+1, len(runs), peakRSS)
	parts := make([]string, len(runs))
	for k, run := range runs {
		parts[k] = fmt.Sprintf("%s of %s, %s ms, %.0f MiB",
			fmtInt(float64(run.res.Delivered)), fmtInt(float64(run.res.Expected)), fmtNum(p99s[k]), run.peak)
	}
	r.Details = append(r.Details, "rounds (events delivered; p99; Caddy's peak RSS, the higher of the load generator's samples and the matrix's every 100 ms): "+
		strings.Join(parts, "; "))
	r.Checks = append(r.Checks,
		check{What: "events expected", Got: float64(res.Expected), Limit: 1, Min: true},
		// The row is only the if the appends came at its rate.
		check{What: "appends/s acknowledged", Got: rate, Limit: 0.95 * m.sc.SSERate, Min: true},
		check{What: "events lost (all rounds)", Got: lost, Limit: 0},
		check{What: "p99 (the median round's)", Got: float64(res.Latency.P99), Limit: 100, Unit: "ms"},
		check{What: "Caddy peak RSS (the highest round's)", Got: peakRSS, Limit: 512, Unit: "MiB"},
	)
	r.Details = append(r.Details, fmt.Sprintf("the median round: subscribers connected: %s; delivery latency ms: p50 %s, p90 %s, p99 %s, max %s",
		fmtInt(float64(res.Subscribers)), fmtNum(float64(res.Latency.P50)), fmtNum(float64(res.Latency.P90)),
		fmtNum(float64(res.Latency.P99)), fmtNum(float64(res.Latency.Max))))
	r.Details = append(r.Details, processDetail(res)...)
	r.Details = append(r.Details, errorDetail(res)...)

	// The same subscribers at one append a second, on the last round's
	// Caddy: each wave of events has the machine to itself, so its p99 is
	// what one wave over every feed takes, without waves queueing behind
	// each other.
	slow := spec
	slow.Prefix, slow.Rate, slow.Duration = "/r6slow/", 1, m.sc.SSEDuration/2
	sr, err := m.measurePico(ctx, last, "r6-slow", slow)
	if err != nil {
		r.Details = append(r.Details, "at 1 append/s: "+err.Error())
		return
	}
	r.Commands = append(r.Commands, "# the same subscribers at 1 append/s, on the last round's Caddy", sr.cmd)
	s := sr.res
	r.Details = append(r.Details, fmt.Sprintf("the same subscribers at 1 append/s (one wave of events at a time): %s of %s delivered, "+
		"delivery latency ms p50 %s, p99 %s, max %s", fmtInt(float64(s.Delivered)), fmtInt(float64(s.Expected)),
		fmtNum(float64(s.Latency.P50)), fmtNum(float64(s.Latency.P99)), fmtNum(float64(s.Latency.Max))))
}

func (m *matrix) row6Node(ctx context.Context) {
	r, res := m.nodeRow(ctx, "6-node", "6", m.sseSpec())
	if res == nil {
		return
	}
	rate := 0.0
	if res.DurationS > 0 {
		rate = float64(res.Ops) / float64(res.DurationS)
	}
	r.Measured = fmt.Sprintf("%s of %s events delivered at %s appends/s, p99 %s ms",
		fmtInt(float64(res.Delivered)), fmtInt(float64(res.Expected)), fmtNum(rate), fmtNum(float64(res.Latency.P99)))
	if res.Errors > 0 {
		r.Measured += fmt.Sprintf(", %s errors", fmtInt(float64(res.Errors)))
	}
}

// sampleRSS polls pid's RSS until the returned function is called, which
// gives the peak in MiB.
func sampleRSS(ctx context.Context, pid int) func() float64 {
	ctx, cancel := context.WithCancel(ctx)
	var peak atomic.Uint64
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			if v, err := rssMiB(pid); err == nil && uint64(v*1024) > peak.Load() {
				peak.Store(uint64(v * 1024))
			}
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return func() float64 {
		cancel()
		<-done
		return float64(peak.Load()) / 1024
	}
}

// row7: a cold Caddy reads a large stream from its start.
func (m *matrix) row7(ctx context.Context) {
	t0 := time.Now()
	size := int64(m.sc.CatchupMiB) << 20
	r := newRow("7", fmt.Sprintf("Cold catch-up: a %s stream read from the start by a freshly started Caddy", fmtSize(size)),
		"≥ 70% of sequential 8 MiB ranged GETs of the same objects straight from versitygw (second pass, page cache warm)")
	set := rowSettings["7"]
	r.use(set)
	m.rows = append(m.rows, r)
	defer func() { r.Elapsed = time.Since(t0) }()
	e, err := m.newPico(ctx, "7", set)
	if err != nil {
		r.Err = "starting PicoMQ: " + err.Error()
		return
	}
	defer e.close()

	const name = "/r7/catchup"
	m.logf("  appending %s to %s as 1 MiB appends", fmtSize(size), name)
	if err := fillStream(ctx, e.caddy.url()+name, int(size>>20), 1<<20); err != nil {
		r.Err = "filling the stream: " + err.Error()
		return
	}
	client := m.versity.Client()
	prefix := caddytest.S3Prefix + "/"
	// Wait for compaction to retire every WAL object.
	waitFor := 2 * time.Minute
	if m.quick {
		waitFor = 30 * time.Second
	}
	deadline := time.Now().Add(waitFor)
	var wal []s3Object
	for {
		wal, err = listObjects(ctx, client, e.bucket, prefix+"wal/")
		if err != nil {
			r.Err = "listing WAL objects: " + err.Error()
			return
		}
		if len(wal) == 0 || time.Now().After(deadline) || !sleepCtx(ctx, 500*time.Millisecond) {
			break
		}
	}
	data, err := listObjects(ctx, client, e.bucket, prefix+"data/")
	if err != nil {
		r.Err = "listing data objects: " + err.Error()
		return
	}
	// Appends of 256 KiB and more are blobs, listed by empty markers.
	blobs, err := listObjects(ctx, client, e.bucket, prefix+"blob/")
	if err != nil {
		r.Err = "listing blobs: " + err.Error()
		return
	}
	var dataBytes, blobBytes int64
	for _, o := range data {
		dataBytes += o.size
	}
	for _, o := range blobs {
		blobBytes += o.size
	}
	r.Details = append(r.Details, fmt.Sprintf("after compaction (%s): %d data objects holding %s, %d blobs holding %s, %d WAL objects left",
		time.Since(t0).Round(time.Second), len(data), fmtBytes(dataBytes), len(blobs), fmtBytes(blobBytes), len(wal)))
	m.logf("  compaction: %d data objects (%s), %d blobs (%s), %d WAL objects left", len(data), fmtBytes(dataBytes), len(blobs), fmtBytes(blobBytes), len(wal))

	// Reference: sequential 8 MiB ranged GETs of the same objects; a first
	// pass, untimed, warms the page cache.
	var objs []s3Object
	for _, o := range slices.Concat(data, blobs, wal) {
		if o.size > 0 {
			objs = append(objs, o)
		}
	}
	reference := func(pass int) (float64, error) {
		t := time.Now()
		n, err := rangedRead(ctx, client, e.bucket, objs, 8<<20)
		if err != nil {
			return 0, fmt.Errorf("reference GETs: %w", err)
		}
		mibs := float64(n) / time.Since(t).Seconds() / (1 << 20)
		m.logf("  reference pass %d: %s in %s, %.1f MiB/s", pass, fmtBytes(n), time.Since(t).Round(time.Millisecond), mibs)
		return mibs, nil
	}
	if _, err := reference(0); err != nil {
		r.Err = err.Error()
		return
	}
	r.Commands = append(r.Commands, fmt.Sprintf("# reference: in cmd/benchmatrix, sequential 8 MiB ranged GetObject of the %d objects under %sdata/, blob/ (and wal/) straight from versitygw; one pass to warm the page cache, then one timed before each of PicoMQ's reads", len(objs), prefix))

	// Each read lasts under a second, short enough for a shared VM to put
	// it off by a fifth either way (63.8% and 92% in two matrices with no
	// change to the path; 58.7 to 77% over three rounds of one run), so
	// the reference and PicoMQ alternate over more rounds than rows 1, 3
	// and 4 take (a round here costs seconds), and the median round's
	// ratio counts.
	// The timed read goes straight to versitygw, as the reference does:
	// the S3 proxy would copy every byte once more on the same two cores.
	// The same read through the proxy follows, for its S3 request counts.
	rounds := 2*max(m.sc.Rounds, 1) + 1
	refs := make([]float64, rounds)
	reads := make([]*picoRun, rounds)
	ratios := make([]float64, rounds)
	for k := range rounds {
		if refs[k], err = reference(k + 1); err != nil {
			r.Err = err.Error()
			return
		}
		m.logf("  round %d of %d: restarting caddy, straight to versitygw, for a cold read", k+1, rounds)
		pr, err := m.coldRead(ctx, e, name, fmt.Sprintf("r7-%d", k+1), true)
		if pr != nil {
			r.Commands = append(r.Commands, fmt.Sprintf("# round %d: PicoMQ, after a restart of Caddy with its storage URL pointing at versitygw itself, not the S3 proxy", k+1), pr.cmd)
		}
		if err != nil {
			r.Err = err.Error()
			return
		}
		reads[k] = pr
		if refs[k] > 0 {
			ratios[k] = pr.res.mibPerS() / refs[k]
		}
	}
	mid := medianIndex(ratios)
	pr, refMiBs := reads[mid], refs[mid]
	r.Reference = fmt.Sprintf("8 MiB ranged GETs, page cache warm: %.1f MiB/s", refMiBs)
	r.Measured = readMeasured(pr)
	r.Ratio = ratios[mid]
	if rounds > 1 {
		var parts []string
		for k := range rounds {
			parts = append(parts, fmt.Sprintf("%.1f/%.1f = %.1f%%", reads[k].res.mibPerS(), refs[k], 100*ratios[k]))
		}
		r.Reference += fmt.Sprintf(" (round %d of %d, whose ratio is the median)", mid+1, rounds)
		r.Measured += fmt.Sprintf("; that round's figures, of %d rounds", rounds)
		r.Details = append(r.Details, "rounds (PicoMQ/reference MiB/s): "+strings.Join(parts, "; "))
	}
	r.Checks = append(r.Checks,
		ratioCheck(r.Ratio, 0.7),
		check{What: "read", Got: float64(pr.res.Bytes) / (1 << 20), Limit: float64(size) / (1 << 20), Min: true, Unit: "MiB"},
		errorCheck(pr.res))
	r.Details = append(r.Details, processDetail(pr.res)...)
	r.Details = append(r.Details, errorDetail(pr.res)...)
	// Row 7-warm reads again with the Caddy of the last round: its
	// reference and first read are that round's, not the median's.
	last := rounds - 1
	warm := m.row7Warm(ctx, e, name, fmt.Sprintf("8 MiB ranged GETs, page cache warm: %.1f MiB/s (round %d of %d, the Caddy's own)", refs[last], last+1, rounds),
		refs[last], reads[last].res.mibPerS())

	m.logf("  restarting caddy for the same cold read through the S3 proxy")
	pp, err := m.coldRead(ctx, e, name, "r7-proxy", false)
	if proxiedRead(r, pp, err, "cold read", "# the same, Caddy's storage through the S3 proxy (for the S3 requests)") {
		// Row 7-warm's second read once more, through the proxy, for
		// its S3 requests: how much of it came from the bucket again.
		pw, err := m.measurePico(ctx, e, "r7-warm-proxy", coldReadSpec(name))
		proxiedRead(warm, pw, err, "second read", "# the same second read through the S3 proxy, after row 7's read through it (for the S3 requests)")
	}

	m.row7Cloud(ctx, e, name, objs, size)
}

// proxiedRead adds to r a read made through the S3 proxy, for its S3
// requests: its command, and its figures or its error. It reports whether
// the read went through.
func proxiedRead(r *rowResult, pr *picoRun, err error, what, comment string) bool {
	if pr != nil {
		r.Commands = append(r.Commands, comment, pr.cmd)
	}
	if err != nil {
		r.Details = append(r.Details, "through the S3 proxy: "+err.Error())
		return false
	}
	r.Details = append(r.Details, "the same "+what+" through the S3 proxy: "+readMeasured(pr)+"; "+s3Breakdown(pr.s3, pr.marked))
	return true
}

// row7Warm has the Caddy that just made row 7's timed read read the stream
// again from its start, straight from versitygw as before: the cache keeps
// few cold objects, so the reads go to the bucket again, but the process is
// warm (its heap grown, its connections open). A comparison that shows what
// a freshly started process's first read pays on this machine.
func (m *matrix) row7Warm(ctx context.Context, e *picoEnv, name, reference string, refMiBs, firstMiBs float64) *rowResult {
	t0 := time.Now()
	r := newRow("7-warm", "Row 7's read again, by the same Caddy right after its first", "none: a comparison")
	r.use(rowSettings["7-warm"])
	m.rows = append(m.rows, r)
	defer func() { r.Elapsed = time.Since(t0) }()
	r.Reference = reference
	m.logf("  the same read again, same caddy")
	pr, err := m.measurePico(ctx, e, "r7-warm", coldReadSpec(name))
	if pr != nil {
		r.Commands = append(r.Commands, "# PicoMQ: the Caddy of row 7's timed read, right after it, reading the stream again", pr.cmd)
	}
	if err != nil {
		r.Err = err.Error()
		return r
	}
	r.Measured = readMeasured(pr) + fmt.Sprintf("; its first read %.1f MiB/s", firstMiBs)
	if refMiBs > 0 {
		r.Ratio = pr.res.mibPerS() / refMiBs
	}
	r.Details = append(r.Details, processDetail(pr.res)...)
	r.Details = append(r.Details, errorDetail(pr.res)...)
	return r
}

// row7Cloud reads row 7's stream once more from a freshly started Caddy,
// with the S3 proxy adding row 3's delay to every request: a cold read from
// a bucket 25 ms away, against the reference's ranged GETs through the same
// delay. A comparison: the issue sets no target for it.
func (m *matrix) row7Cloud(ctx context.Context, e *picoEnv, name string, objs []s3Object, size int64) {
	t0 := time.Now()
	set := rowSettings["7-cloud"]
	r := newRow("7-cloud", fmt.Sprintf("Row 7's cold read from a bucket %s away (the S3 proxy's delay on every request)", set.Latency), "none: a comparison")
	r.use(set)
	m.rows = append(m.rows, r)
	defer func() { r.Elapsed = time.Since(t0) }()
	e.proxy.SetLatency(set.Latency, set.Jitter)
	defer e.proxy.SetLatency(e.set.Latency, e.set.Jitter)

	client := m.versity.ClientVia(e.proxy.URL())
	t := time.Now()
	n, err := rangedRead(ctx, client, e.bucket, objs, 8<<20)
	if err != nil {
		r.Err = "reference GETs: " + err.Error()
		return
	}
	refMiBs := float64(n) / time.Since(t).Seconds() / (1 << 20)
	m.logf("  reference through the delay: %s in %s, %.1f MiB/s", fmtBytes(n), time.Since(t).Round(time.Millisecond), refMiBs)
	r.Reference = fmt.Sprintf("8 MiB ranged GETs through the same delay: %.1f MiB/s", refMiBs)
	r.Commands = append(r.Commands, fmt.Sprintf("# reference: in cmd/benchmatrix, row 7's sequential 8 MiB ranged GetObject of the %d objects, through the S3 proxy with +%s per request (page cache warm from row 7)", len(objs), set.Latency))

	m.logf("  restarting caddy for a cold read through the delay")
	pr, err := m.coldRead(ctx, e, name, "r7-cloud", false)
	if pr != nil {
		r.Commands = append(r.Commands, fmt.Sprintf("# PicoMQ, after a restart of Caddy, the proxy adding %s to every request", set.Latency), pr.cmd)
	}
	if err != nil {
		r.Err = err.Error()
		return
	}
	if got := int64(pr.res.Bytes); got < size || pr.res.Errors > 0 {
		r.Err = fmt.Sprintf("read %s of %s with %d errors", fmtBytes(got), fmtBytes(size), int64(pr.res.Errors))
		return
	}
	r.Measured = readMeasured(pr)
	if refMiBs > 0 {
		r.Ratio = pr.res.mibPerS() / refMiBs
	}
	r.Details = append(r.Details, s3Breakdown(pr.s3, pr.marked))
	r.Details = append(r.Details, processDetail(pr.res)...)
}

// coldRead stops e's Caddy and starts the same node again, its caches
// empty, then reads stream name from its start with one reader. With
// direct, the node's storage is versitygw itself instead of the S3 proxy
// (which then counts nothing); the next restart goes back to the proxy.
func (m *matrix) coldRead(ctx context.Context, e *picoEnv, name, label string, direct bool) (*picoRun, error) {
	e.caddy.p.stop(15 * time.Second)
	config := e.caddy.caddyfile
	if direct {
		e.caddy.caddyfile = caddyPicoMQ(e.caddy.port, testenv.StoreURL(m.versity.Endpoint, e.bucket, caddytest.S3Prefix), e.set.Directives)
		defer func() { e.caddy.caddyfile = config }()
	}
	if err := e.caddy.restart(ctx); err != nil {
		return nil, fmt.Errorf("restarting Caddy: %w", err)
	}
	return m.measurePico(ctx, e, label, coldReadSpec(name))
}

// coldReadSpec is one reader reading stream name from its start.
func coldReadSpec(name string) benchSpec {
	return benchSpec{Mode: "read", Stream: name, Readers: 1, NoCreate: true, Timeout: 5 * time.Minute}
}

// readMeasured is the Measured cell of a cold read; S3 requests are left
// out when the proxy saw none (Caddy read straight from versitygw).
func readMeasured(pr *picoRun) string {
	s := fmt.Sprintf("%.1f MiB/s (%s read in %.2f s)", pr.res.mibPerS(), fmtBytes(int64(pr.res.Bytes)), float64(pr.res.DurationS))
	if pr.s3.Total > 0 {
		s += fmt.Sprintf(", %d S3 requests", pr.s3.Total)
	}
	return s
}

// fillStream creates url as an octet-stream stream and appends n bodies of
// size bytes, four at a time.
func fillStream(ctx context.Context, url string, n, size int) error {
	hc := &http.Client{Timeout: 2 * time.Minute}
	do := func(method string, body []byte) error {
		req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Content-Type", "application/octet-stream")
		resp, err := hc.Do(req)
		if err != nil {
			return err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode/100 != 2 {
			return fmt.Errorf("%s %s: %s", method, url, resp.Status)
		}
		return nil
	}
	if err := do(http.MethodPut, nil); err != nil {
		return err
	}
	body := make([]byte, size)
	for i := range body {
		body[i] = byte(rand.N(256))
	}
	var next atomic.Int64
	errs := make(chan error, 4)
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(n) {
				if err := do(http.MethodPost, body); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

type s3Object struct {
	key  string
	size int64
}

func listObjects(ctx context.Context, c *s3.Client, bucket, prefix string) ([]s3Object, error) {
	var out []s3Object
	p := s3.NewListObjectsV2Paginator(c, &s3.ListObjectsV2Input{Bucket: aws.String(bucket), Prefix: aws.String(prefix)})
	for p.HasMorePages() {
		page, err := p.NextPage(ctx)
		if err != nil {
			return nil, err
		}
		for _, o := range page.Contents {
			out = append(out, s3Object{key: aws.ToString(o.Key), size: aws.ToInt64(o.Size)})
		}
	}
	return out, nil
}

// rangedRead reads every object in order with ranged GETs of chunk bytes,
// one at a time, and returns the bytes read.
func rangedRead(ctx context.Context, c *s3.Client, bucket string, objs []s3Object, chunk int64) (int64, error) {
	var total int64
	for _, o := range objs {
		for off := int64(0); off < o.size; off += chunk {
			end := min(off+chunk, o.size) - 1
			out, err := c.GetObject(ctx, &s3.GetObjectInput{
				Bucket: aws.String(bucket), Key: aws.String(o.key), Range: aws.String(fmt.Sprintf("bytes=%d-%d", off, end)),
			})
			if err != nil {
				return total, fmt.Errorf("GET %s: %w", o.key, err)
			}
			n, err := loadgen.Discard(out.Body)
			out.Body.Close()
			total += n
			if err != nil {
				return total, err
			}
		}
	}
	return total, nil
}

// row8: many idle streams cost no memory.
func (m *matrix) row8(ctx context.Context) {
	t0 := time.Now()
	n := m.sc.IdleStreams
	r := newRow("8", fmt.Sprintf("Idle is free: %s streams with one record each, then %s without requests", fmtInt(float64(n)), m.sc.IdleWait),
		"Caddy RSS ≤ 64 MiB above its level before the streams were created; every stream reads back")
	set := rowSettings["8"]
	r.use(set)
	m.rows = append(m.rows, r)
	defer func() { r.Elapsed = time.Since(t0) }()
	e, err := m.newPico(ctx, "8", set)
	if err != nil {
		r.Err = "starting PicoMQ: " + err.Error()
		return
	}
	defer e.close()
	// A few requests first, so the baseline includes a warmed-up server.
	if err := fillStream(ctx, e.caddy.url()+"/r8-warmup/s", 8, 1024); err != nil {
		r.Err = "warm-up: " + err.Error()
		return
	}
	for range 4 {
		if resp, err := http.Get(e.caddy.url() + "/r8-warmup/s?offset=-1"); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}
	sleepCtx(ctx, 2*time.Second)
	base, err := rssMiB(e.caddy.pid())
	if err != nil {
		r.Err = "reading RSS: " + err.Error()
		return
	}
	m.logf("  baseline RSS %.1f MiB; populating %s streams", base, fmtInt(float64(n)))
	pop := benchSpec{Mode: "populate", Prefix: "/r8/", Streams: n, Size: 1024, Writers: m.sc.IdleWorkers, Timeout: 10 * time.Minute}
	pr, err := m.measurePico(ctx, e, "r8-populate", pop)
	r.Commands = append(r.Commands, pr.cmd)
	if err != nil {
		r.Err = "populate: " + err.Error()
		return
	}
	peakAfterPopulate, _ := rssMiB(e.caddy.pid())
	m.logf("  populated (RSS now %.1f MiB); idle for %s", peakAfterPopulate, m.sc.IdleWait)
	// The path to the figure, not only the figure: whether memory is
	// still falling when the minute ends tells a slow release from a
	// leak.
	var path []string
	idleStart := time.Now()
	for step := m.sc.IdleWait / 12; time.Since(idleStart) < m.sc.IdleWait; {
		if !sleepCtx(ctx, min(step, m.sc.IdleWait-time.Since(idleStart))) {
			r.Err = ctx.Err().Error()
			return
		}
		if v, err := rssMiB(e.caddy.pid()); err == nil {
			path = append(path, fmt.Sprintf("%s %.1f", time.Since(idleStart).Round(time.Second), v))
		}
	}
	m.logf("  RSS during the idle wait (MiB): %s", strings.Join(path, ", "))
	after, err := rssMiB(e.caddy.pid())
	if err != nil {
		r.Err = "reading RSS: " + err.Error()
		return
	}
	r.Commands = append(r.Commands, fmt.Sprintf("# %s without requests, then VmRSS from /proc/<caddy pid>/status", m.sc.IdleWait))
	ver := benchSpec{Mode: "verify", Prefix: "/r8/", Streams: n, Size: 1024, Writers: m.sc.IdleWorkers, NoCreate: true, Timeout: 10 * time.Minute}
	vr, err := m.measurePico(ctx, e, "r8-verify", ver)
	r.Commands = append(r.Commands, vr.cmd)
	if err != nil {
		r.Err = "verify: " + err.Error()
		return
	}
	delta := after - base
	r.Reference = fmt.Sprintf("RSS before the streams: %.1f MiB", base)
	r.Measured = fmt.Sprintf("RSS after %s idle: %.1f MiB (+%.1f MiB); %s of %s streams read back",
		m.sc.IdleWait, after, delta, fmtInt(float64(vr.res.OK)), fmtInt(float64(n)))
	r.Checks = append(r.Checks,
		check{What: "RSS growth", Got: delta, Limit: 64, Unit: "MiB"},
		check{What: "streams read back", Got: float64(vr.res.OK), Limit: float64(n), Min: true},
		check{What: "mismatched", Got: float64(vr.res.Mismatched), Limit: 0},
	)
	r.Details = append(r.Details,
		fmt.Sprintf("populate: %s ops at %s ops/s, %d errors; RSS right after it %.1f MiB", fmtInt(float64(pr.res.Ops)), fmtInt(float64(pr.res.OpsPerS)), int64(pr.res.Errors), peakAfterPopulate),
		"RSS during the idle wait (MiB): "+strings.Join(path, ", "),
		"populate "+s3Breakdown(pr.s3, pr.marked),
		fmt.Sprintf("verify: %s ok, %s mismatched, %d errors, %s S3 requests", fmtInt(float64(vr.res.OK)), fmtInt(float64(vr.res.Mismatched)), int64(vr.res.Errors), fmtInt(float64(vr.s3.Total))),
	)
	r.Details = append(r.Details, errorDetail(vr.res)...)
}

// row9: time to serve reads again after a crash under load.
func (m *matrix) row9(ctx context.Context) {
	t0 := time.Now()
	r := newRow("9", "Recovery: SIGKILL at row 1's load, restart, read an existing stream", "200 within 5 s of the restart")
	set := rowSettings["9"]
	r.use(set)
	m.rows = append(m.rows, r)
	defer func() { r.Elapsed = time.Since(t0) }()
	e, err := m.newPico(ctx, "9", set)
	if err != nil {
		r.Err = "starting PicoMQ: " + err.Error()
		return
	}
	defer e.close()
	const probe = "/r9-probe/s"
	if err := fillStream(ctx, e.caddy.url()+probe, 1, 1024); err != nil {
		r.Err = "probe stream: " + err.Error()
		return
	}
	spec := appendSpec("/r9/", 64, 100, 1024, time.Second, m.sc.CrashLoad)
	spec.URL = e.caddy.url()
	spec.Timeout = 10 * time.Second
	bp, spec, err := m.startBench("r9", spec)
	r.Commands = append(r.Commands, "# load in the background, Caddy SIGKILLed "+m.sc.CrashAfter.String()+" after it starts", spec.commandLine())
	if err != nil {
		r.Err = err.Error()
		return
	}
	defer bp.kill()
	if !sleepCtx(ctx, m.sc.CrashAfter) {
		r.Err = ctx.Err().Error()
		return
	}
	m.logf("  SIGKILL caddy pid %d under load", e.caddy.pid())
	e.caddy.p.kill()
	restart := time.Now()
	if err := e.caddy.start(); err != nil {
		r.Err = "restart: " + err.Error()
		return
	}
	hc := &http.Client{Timeout: time.Second}
	var took time.Duration
	var last string
	for {
		resp, err := hc.Get(e.caddy.url() + probe + "?offset=-1")
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				took = time.Since(restart)
				break
			}
			last = resp.Status
		} else {
			last = err.Error()
		}
		if time.Since(restart) > 60*time.Second {
			r.Err = "no 200 within 60 s of the restart; last: " + last
			return
		}
		if !sleepCtx(ctx, 20*time.Millisecond) {
			r.Err = ctx.Err().Error()
			return
		}
	}
	m.logf("  first 200 after %s", took.Round(time.Millisecond))
	r.Commands = append(r.Commands, fmt.Sprintf("# kill -KILL <caddy pid>; caddy run (same node, bucket and port); GET %s?offset=-1 every 20 ms until 200", probe))
	r.Measured = fmt.Sprintf("first 200 %.2f s after the restart", took.Seconds())
	r.Checks = append(r.Checks, check{What: "time to first 200", Got: took.Seconds(), Limit: 5, Unit: "s"})
	// Let the load run out against the restarted node; its outcome is
	// recorded, not judged (appends in flight at the kill fail).
	select {
	case <-bp.done:
	case <-time.After(m.sc.CrashLoad + 30*time.Second):
		bp.kill()
	case <-ctx.Done():
	}
	if res, _, err := m.benchOutcome("r9", bp, spec); err == nil {
		r.Details = append(r.Details, fmt.Sprintf("the load across the crash: %s appends/s, %s errors (appends in flight at the kill, and refused connections until the restart)",
			fmtInt(float64(res.OpsPerS)), fmtInt(float64(res.Errors))))
	}
	if err := e.caddy.waitReady(ctx, 30*time.Second); err != nil {
		r.Details = append(r.Details, "the restarted Caddy did not log a full start: "+err.Error())
	}
}

// rowSweep: throughput and p99 against writer count, for the chart.
func (m *matrix) rowSweep(ctx context.Context) {
	e, err := m.newPico(ctx, "sweep", rowSettings["sweep"])
	if err != nil {
		m.logf("  sweep: starting PicoMQ: %v", err)
		return
	}
	defer e.close()
	for _, w := range m.sc.SweepWriters {
		if ctx.Err() != nil {
			return
		}
		spec := appendSpec("/sweep/", w, 100, 1024, m.sc.SweepWarmup, m.sc.SweepDuration)
		ceil, cl, err := m.measureCeiling(ctx, fmt.Sprintf("sweep-%d-ceiling", w), spec)
		m.sweepCmds = append(m.sweepCmds, cl)
		if err != nil {
			m.logf("  sweep %d writers: ceiling: %v", w, err)
			continue
		}
		pr, err := m.measurePico(ctx, e, fmt.Sprintf("sweep-%d", w), spec)
		m.sweepCmds = append(m.sweepCmds, pr.cmd)
		if err != nil {
			m.logf("  sweep %d writers: %v", w, err)
			continue
		}
		m.sweep = append(m.sweep, sweepPoint{
			Writers: w,
			PicoOps: float64(pr.res.OpsPerS), PicoP99: float64(pr.res.Latency.P99),
			CeilOps: float64(ceil.OpsPerS), CeilP99: float64(ceil.Latency.P99),
		})
	}
}
