package integration

import (
	"bytes"
	"fmt"
	"net/http"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Group commit under load: 64 concurrent writers over 100 streams, with the
// module's default flush settings.
const (
	fhGCWriters = 64
	fhGCStreams = 100
	// fhGCMinBatch is the fewest appends a WAL PUT may carry on average:
	// a quarter of the appends in flight. On an idle machine a PUT
	// carries about all 64 (15.6 PUTs per 1,000 appends); on a busy one
	// fewer writers are back within a flush interval, and with an xcaddy
	// build beside the test it measured 29.7 per 1,000, about 34 each.
	// Without group commit it would be one.
	fhGCMinBatch = 16
	// fhGCFlushInterval is the module's default flush_interval, which
	// these runs use: WAL uploads start at least this far apart.
	fhGCFlushInterval = 20 * time.Millisecond
	// fhGCRecord is the size of each append's body.
	fhGCRecord = 64
)

// fhGCResult is the outcome of one group-commit run.
type fhGCResult struct {
	appends  int
	failures []string
	elapsed  time.Duration
	walPuts  int // PUTs of keys containing "/wal/"
	s3       int // every request to the store
	latency  []time.Duration
	sent     [fhGCStreams][][]byte // bodies acknowledged, per stream
}

func (r *fhGCResult) perThousand(n int) float64 {
	if r.appends == 0 {
		return 0
	}
	return float64(n) * 1000 / float64(r.appends)
}

func (r *fhGCResult) String() string {
	return fmt.Sprintf("%d appends in %s: %.0f appends/s, %d WAL PUTs (%.1f per 1,000 appends), "+
		"%d S3 requests (%.1f per 1,000 appends), latency p50 %s p99 %s",
		r.appends, r.elapsed.Round(time.Millisecond), float64(r.appends)/r.elapsed.Seconds(),
		r.walPuts, r.perThousand(r.walPuts), r.s3, r.perThousand(r.s3),
		fhPercentile(r.latency, 50).Round(time.Microsecond), fhPercentile(r.latency, 99).Round(time.Microsecond))
}

// fhGCStream is the path of stream i.
func fhGCStream(i int) string { return fmt.Sprintf("/gc/stream-%03d", i) }

// fhGCSetup starts Caddy with default settings (storage only) and creates
// the streams.
func fhGCSetup(tb testing.TB) *fhEnv {
	tb.Helper()
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns = 2 * fhGCWriters
	tr.MaxIdleConnsPerHost = 2 * fhGCWriters
	e := fhStart(tb, fhOptions{Client: &http.Client{Transport: tr, Timeout: time.Minute}})
	tb.Cleanup(tr.CloseIdleConnections)
	for i := range fhGCStreams {
		e.create(fhGCStream(i), "application/octet-stream")
	}
	return e
}

// fhGCBody is the body of append n to stream s: fhGCRecord bytes, the last
// a newline, so a stream's content splits back into its appends.
func fhGCBody(n, s int) []byte {
	b := fmt.Appendf(nil, "append %012d to stream %03d ", n, s)
	b = append(b, bytes.Repeat([]byte("."), fhGCRecord-1-len(b))...)
	return append(b, '\n')
}

// fhGCRun makes total appends with fhGCWriters closed-loop writers (each
// sends its next append when the previous one is answered), counting the
// store requests at the proxy meanwhile. first numbers the appends, so
// that runs on one instance never repeat a body.
func fhGCRun(e *fhEnv, first, total int) *fhGCResult {
	r := &fhGCResult{appends: total}
	var next atomic.Int64
	var mu sync.Mutex
	var wg sync.WaitGroup
	before := e.proxy.Counts()
	start := time.Now()
	for range fhGCWriters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lat := make([]time.Duration, 0, total/fhGCWriters+1)
			var fails []string
			var acked [fhGCStreams][][]byte
			for {
				i := int(next.Add(1)) - 1
				if i >= total {
					break
				}
				n := first + i
				s := n % fhGCStreams
				body := fhGCBody(n, s)
				resp, err := e.send(fhReq{
					Method: http.MethodPost, Path: fhGCStream(s),
					Header: map[string]string{"Content-Type": "application/octet-stream"}, Body: body,
				})
				lat = append(lat, resp.Took)
				switch {
				case err != nil:
					fails = append(fails, fmt.Sprintf("append %d: %v", n, err))
				case resp.Status/100 != 2:
					fails = append(fails, fmt.Sprintf("append %d: %s", n, resp))
				default:
					acked[s] = append(acked[s], body)
				}
			}
			mu.Lock()
			r.latency = append(r.latency, lat...)
			r.failures = append(r.failures, fails...)
			for s := range acked {
				r.sent[s] = append(r.sent[s], acked[s]...)
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	r.elapsed = time.Since(start)
	after := e.proxy.Counts()
	r.walPuts = after.Containing("PUT", "/wal/") - before.Containing("PUT", "/wal/")
	r.s3 = after.Total() - before.Total()
	slices.Sort(r.latency)
	return r
}

// BenchmarkGroupCommit measures appends through Caddy on versitygw with 64
// concurrent writers over 100 streams and default flush settings. One
// benchmark op is one append. Run it with e.g.
//
//	go test ./integration -run '^$' -bench GroupCommit -benchtime 20000x
func BenchmarkGroupCommit(b *testing.B) {
	e := fhGCSetup(b)
	// A warm-up round opens the writers' connections.
	if r := fhGCRun(e, 0, fhGCWriters); len(r.failures) > 0 {
		b.Fatalf("warm-up: %d appends failed, first: %s", len(r.failures), r.failures[0])
	}
	first := fhGCWriters
	b.Run(fmt.Sprintf("writers=%d/streams=%d", fhGCWriters, fhGCStreams), func(b *testing.B) {
		b.ResetTimer()
		r := fhGCRun(e, first, b.N)
		b.StopTimer()
		first += b.N
		if len(r.failures) > 0 {
			b.Fatalf("%d of %d appends failed, first: %s", len(r.failures), r.appends, r.failures[0])
		}
		b.ReportMetric(float64(r.appends)/r.elapsed.Seconds(), "appends/s")
		b.ReportMetric(r.perThousand(r.walPuts), "walPUTs/1000appends")
		b.ReportMetric(r.perThousand(r.s3), "s3req/1000appends")
		b.ReportMetric(float64(fhPercentile(r.latency, 50))/1e6, "p50-ms")
		b.ReportMetric(float64(fhPercentile(r.latency, 99))/1e6, "p99-ms")
		b.Logf("%s", r)
	})
}

// TestGroupCommitWALPutBound is the short companion of BenchmarkGroupCommit:
// its bounds are counts, not speeds (WAL PUTs per flush interval, appends
// per PUT with room for a busy machine), so they hold on a slow machine
// too. It also checks that every acknowledged append is stored exactly
// once.
func TestGroupCommitWALPutBound(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhGCSetup(t)
	if r := fhGCRun(e, 0, fhGCWriters); len(r.failures) > 0 {
		t.Fatalf("warm-up: %d appends failed, first: %s", len(r.failures), r.failures[0])
	}
	const total = 100 * fhGCWriters
	r := fhGCRun(e, fhGCWriters, total)
	t.Logf("group commit, %d writers over %d streams, default settings: %s", fhGCWriters, fhGCStreams, r)
	if len(r.failures) > 0 {
		t.Fatalf("%d of %d appends failed, first: %s", len(r.failures), total, r.failures[0])
	}
	// How many appends a PUT carries depends on how fast the machine
	// turns the writers round; how often PUTs start does not: at most one
	// per flush interval, however many appends wait (the run's elapsed
	// time spans every start, plus one for the first and one for a
	// boundary).
	if limit := int(r.elapsed/fhGCFlushInterval) + 2; r.walPuts > limit {
		t.Errorf("%d WAL PUTs in %s, want at most %d (one per %s)",
			r.walPuts, r.elapsed.Round(time.Millisecond), limit, fhGCFlushInterval)
	}
	if got := r.perThousand(r.walPuts); got > 1000.0/fhGCMinBatch {
		t.Errorf("%.1f WAL PUTs per 1,000 appends (%d for %d), want at most %.1f (%d appends a PUT)",
			got, r.walPuts, r.appends, 1000.0/fhGCMinBatch, fhGCMinBatch)
	}

	// Every acknowledged append is in its stream once; nothing else is.
	for s := range fhGCStreams {
		got, _, err := e.readBytes(fhGCStream(s))
		if err != nil {
			t.Fatal(err)
		}
		var stored [][]byte
		for _, line := range bytes.SplitAfter(got, []byte("\n")) {
			if len(line) > 0 {
				stored = append(stored, line)
			}
		}
		// The warm-up's appends are stored too.
		var want [][]byte
		for n := s; n < fhGCWriters; n += fhGCStreams {
			want = append(want, fhGCBody(n, s))
		}
		want = append(want, r.sent[s]...)
		sortBytes := func(x [][]byte) { sort.Slice(x, func(i, j int) bool { return bytes.Compare(x[i], x[j]) < 0 }) }
		sortBytes(stored)
		sortBytes(want)
		if len(stored) != len(want) {
			t.Errorf("%s holds %d appends, want %d", fhGCStream(s), len(stored), len(want))
			continue
		}
		for i := range want {
			if !bytes.Equal(stored[i], want[i]) {
				t.Errorf("%s: stored %q, want %q", fhGCStream(s), stored[i], want[i])
				break
			}
		}
	}
}

// flush_quiet lets writers that come back as a burst share one WAL upload:
// appends 20 ms apart on an idle writer go out together once they pause,
// long before flush_interval. Without it the first append takes an upload
// alone and the rest wait for the interval.
func TestFlushQuietBurstSharesOneUpload(t *testing.T) {
	// The quiet time is fifty times the spacing: on a busy machine the
	// appends, each a request of its own, reach the engine less evenly
	// than they are sent, and with flush_quiet 200ms one came over 200 ms
	// after the one before it (2 WAL PUTs, the burst acknowledged only at
	// the interval).
	const (
		interval = 5 * time.Second
		appends  = 5
		spacing  = 20 * time.Millisecond
	)
	for _, tc := range []struct {
		name     string
		quiet    string // flush_quiet directive, if any
		wantPuts int
		fast     bool // every append acknowledged well inside the interval
	}{
		{name: "off", wantPuts: 2},
		{name: "1s", quiet: "flush_quiet 1s", wantPuts: 1, fast: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dirs := []string{fmt.Sprintf("flush_interval %s", interval)}
			if tc.quiet != "" {
				dirs = append(dirs, tc.quiet)
			}
			e := fhStart(t, fhOptions{Directives: dirs, Optional: []string{"compact_interval 1h"}})
			for i := range appends {
				e.create(fmt.Sprintf("/quiet/s%d", i), "application/octet-stream")
			}
			// Let any upload of the creations fall out of the interval, so
			// the first append finds the writer idle.
			time.Sleep(interval + 200*time.Millisecond)

			before := e.proxy.Counts().Containing("PUT", "/wal/")
			start := time.Now()
			var wg sync.WaitGroup
			results := make([]fhResp, appends)
			errs := make([]error, appends)
			for i := range appends {
				wg.Add(1)
				go func() {
					defer wg.Done()
					results[i], errs[i] = e.send(fhReq{Method: http.MethodPost, Path: fmt.Sprintf("/quiet/s%d", i),
						Header: map[string]string{"Content-Type": "application/octet-stream"}, Body: fmt.Appendf(nil, "burst %d", i)})
				}()
				time.Sleep(spacing)
			}
			wg.Wait()
			took := time.Since(start)
			for i := range appends {
				if errs[i] != nil || results[i].Status != http.StatusNoContent {
					t.Fatalf("append %d: %v %s", i, errs[i], results[i])
				}
			}
			puts := e.proxy.Counts().Containing("PUT", "/wal/") - before
			t.Logf("%d appends %s apart: %d WAL PUTs, all acknowledged in %s", appends, spacing, puts, took.Round(time.Millisecond))
			if puts != tc.wantPuts {
				t.Errorf("%d WAL PUTs for the burst, want %d", puts, tc.wantPuts)
			}
			if tc.fast && took > interval*2/3 {
				t.Errorf("the burst took %s to be acknowledged; want well under flush_interval %s", took, interval)
			}
			for i := range appends {
				got, _, err := e.readBytes(fmt.Sprintf("/quiet/s%d", i))
				if err != nil {
					t.Fatal(err)
				}
				if want := fmt.Sprintf("burst %d", i); string(got) != want {
					t.Errorf("stream %d holds %q, want %q", i, got, want)
				}
			}
		})
	}
}

// flush_size sends a batch as soon as it holds that many bytes, without
// waiting out flush_interval: a burst of 8 KiB of appends right after an
// upload goes out in 4 KiB batches at once, where by default it waits for
// the interval and goes out as one.
func TestFlushSizeSendsAFullBatchAtOnce(t *testing.T) {
	const (
		interval = 3 * time.Second
		appends  = 8
		record   = 1024
	)
	for _, tc := range []struct {
		name string
		size string // flush_size directive, if any
		fast bool   // the burst is acknowledged well inside the interval
	}{
		{name: "default"},
		{name: "4KiB", size: "flush_size 4KiB", fast: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dirs := []string{fmt.Sprintf("flush_interval %s", interval)}
			if tc.size != "" {
				dirs = append(dirs, tc.size)
			}
			e := fhStart(t, fhOptions{Directives: dirs, Optional: []string{"compact_interval 1h"}})
			const ct = "application/octet-stream"
			e.create("/size/s", ct)
			// An idle writer sends the first append at once; its upload
			// starts the interval the burst then falls in.
			time.Sleep(interval + 200*time.Millisecond)
			before := e.proxy.Counts().Containing("PUT", "/wal/")
			e.append("/size/s", ct, []byte("lead"))

			bodies := fhRandomRecords(41, appends, record)
			start := time.Now()
			var wg sync.WaitGroup
			results := make([]fhResp, appends)
			errs := make([]error, appends)
			for i := range appends {
				wg.Go(func() {
					results[i], errs[i] = e.send(fhReq{Method: http.MethodPost, Path: "/size/s",
						Header: map[string]string{"Content-Type": ct}, Body: bodies[i]})
				})
			}
			wg.Wait()
			took := time.Since(start)
			for i := range appends {
				if errs[i] != nil || results[i].Status != http.StatusNoContent {
					t.Fatalf("append %d: %v %s", i, errs[i], results[i])
				}
			}
			puts := e.proxy.Counts().Containing("PUT", "/wal/") - before - 1
			t.Logf("%d appends of %d bytes after an upload: %d WAL PUTs, acknowledged in %s", appends, record, puts, took.Round(time.Millisecond))
			if tc.fast {
				if puts < 2 {
					t.Errorf("%d WAL PUTs for %d KiB of appends, want 2 or more (one per 4 KiB)", puts, appends*record>>10)
				}
				if took > interval/2 {
					t.Errorf("the burst took %s; want it sent as its batches filled, well before flush_interval %s", took, interval)
				}
			} else {
				if puts != 1 {
					t.Errorf("%d WAL PUTs for the burst, want 1 (one batch at the interval)", puts)
				}
				if took < interval/2 {
					t.Errorf("the burst took %s; by default it waits for flush_interval %s", took, interval)
				}
			}
			got, _, err := e.readBytes("/size/s")
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != len("lead")+appends*record {
				t.Errorf("the stream holds %d bytes, want %d", len(got), len("lead")+appends*record)
			}
		})
	}
}
