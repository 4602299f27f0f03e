//go:build linux

package main

import (
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// settings are what a row tunes beyond its load: directives of the picomq
// Caddyfile block, and the delay the S3 proxy adds to every request.
type settings struct {
	Directives []string
	Latency    time.Duration // fixed delay per S3 request
	Jitter     time.Duration // plus a random delay in [0, Jitter)
	// Why is the row's Reason cell after its verdict: a sentence or two
	// on why it is tuned the way it is, or on what bounds it when it
	// misses.
	Why string
	// Notes says the row has a section of its own in
	// docs/benchmark-notes.md: what bounds it, how it is tuned and what was
	// tried, with the measurements. Those notes are written by hand, apart
	// from this generated report, so that they keep their figures when the
	// matrix runs again and can be edited without running it.
	Notes bool
}

// rowOneTuning is row 1's tuning for appends/s, which rows 4, 9 and the
// sweep share.
var rowOneTuning = []string{"flush_interval 5ms", "flush_quiet 300us"}

// rowSettings is the one place to tune the rows. Latency and S3 request
// count pull against each other (a shorter flush_interval means more PUTs),
// so a row may set flush_interval/flush_size as a user tuning for that goal
// would; "1-defaults" stays at the module's defaults.
var rowSettings = map[string]settings{
	"1": {Directives: rowOneTuning,
		Why: "Tuned for appends/s. What bounds it is the box: versitygw and the S3 proxy run on the 2 cores the ceiling gives to Caddy " +
			"and the load generator alone, and an append costs about 270 us of CPU across the four processes (Caddy 134, the load " +
			"generator 68, versitygw 39, the proxy 28, at a6940bf), so both cores busy all the time would give about 7,400 appends/s, " +
			"under 40% of a ceiling near 19,600 requests/s; each closed-loop writer also waits a WAL PUT (about 4 ms under this load) " +
			"for every append",
		Notes: true},
	"1-defaults": {Why: "flush_interval 20ms: at most 50 WAL PUTs/s; latency is about the interval plus a PUT"},
	"2": {Directives: []string{"flush_interval 60ms"},
		Why:   "Tuned for cost: flush_interval 60ms caps WAL PUTs at about 17/s; compaction adds a data PUT and a checkpoint per busy stream per cycle",
		Notes: true},
	"2-many": {Why: "Defaults. Many slow streams cost more than a few busy ones: their records go to pack objects shared by hundreds of " +
		"streams, and most of the window's requests are the WAL's PUTs (up to 50 a second at flush_interval 20ms)",
		Notes: true},
	"3": {Latency: 25 * time.Millisecond,
		Why: "Defaults. Throughput is bound by the box's CPU, as in row 1. The p99 target sits at the ceiling's own p99 for the same " +
			"1,024 closed-loop writers: at half the ceiling's rate they wait 1,024 / rate, about 90 ms, on average, and the p99 of " +
			"such a load is about twice its mean, the ceiling's included",
		Notes: true},
	"4": {Directives: rowOneTuning, Why: "Row 1's tuning"},
	"5": {Why: "Appends of 256 KiB and more are written once, as blobs the WAL entry names; each byte still crosses two more " +
		"sockets than in the reference",
		Notes: true},
	"6": {Why: "Each append is 5,000 events that Caddy writes and the load generator reads over loopback on the same 2 cores, a " +
		"system call on each side per event: a wave over every subscriber takes much of the 50 ms between appends, and the p99 is " +
		"where the slowest waves end (82 to 155 ms over the last runs, with the machine as much as with the code)",
		Notes: true},
	// Compaction must move the stream into data objects before the cold
	// read, so it runs often here.
	"7": {Directives: []string{"compact_interval 2s"},
		Why: "Each byte takes one more hop than in the reference (versitygw to Caddy to the reader), on the same two cores; the " +
			"reference's own speed differs from run to run, and the ratio with it",
		Notes: true},
	"7-warm": {Directives: []string{"compact_interval 2s"},
		Why:   "Not the issue's row: the same Caddy's second read, to show what a fresh process's first read pays",
		Notes: true},
	"7-cloud": {Directives: []string{"compact_interval 2s"}, Latency: 25 * time.Millisecond,
		Why:   "The read-ahead keeps up to 16 MiB of objects in flight; the reference reads one range at a time, each GET waiting the whole delay",
		Notes: true},
	"8": {Why: "Streams leave memory once a compaction has folded them, and a sweep that finds 1,000 idle streams waiting for one starts it",
		Notes: true},
	// "At row 1's load": row 1's settings too.
	"9":     {Directives: rowOneTuning, Why: "Row 1's settings and load"},
	"sweep": {Directives: rowOneTuning},
}

func (s settings) String() string {
	var parts []string
	if len(s.Directives) == 0 {
		parts = append(parts, "defaults")
	} else {
		for _, d := range s.Directives {
			parts = append(parts, "`"+d+"`")
		}
	}
	switch {
	case s.Latency > 0 && s.Jitter > 0:
		parts = append(parts, fmt.Sprintf("S3 +%s (+0–%s jitter)", s.Latency, s.Jitter))
	case s.Latency > 0:
		parts = append(parts, fmt.Sprintf("S3 +%s per request", s.Latency))
	case s.Jitter > 0:
		parts = append(parts, fmt.Sprintf("S3 +0–%s jitter", s.Jitter))
	}
	return strings.Join(parts, ", ")
}

func sweepSettings() string { return rowSettings["sweep"].String() }

// scale holds the window lengths and sizes of a run.
type scale struct {
	Warmup, Duration         time.Duration // rows 1, 3, 4, 5 and Node
	CostWarmup, CostDuration time.Duration // row 2
	ManyStreams              int           // row 2-many: streams sharing ManyRate appends/s
	ManyRate                 float64
	ManyWarmup, ManyDuration time.Duration // row 2-many
	SSESubscribers           int
	SSERate                  float64
	SSEDuration              time.Duration
	CatchupMiB               int // row 7
	IdleStreams              int // row 8
	IdleWorkers              int // row 8: concurrent creates (populate) and reads (verify)
	IdleWait                 time.Duration
	CrashLoad, CrashAfter    time.Duration // row 9: load length, SIGKILL after
	SweepWriters             []int
	SweepWarmup              time.Duration
	SweepDuration            time.Duration
	// Rounds is how many times rows 1, 3 and 4 measure their ceiling and
	// PicoMQ, alternately (row 7, whose rounds last seconds, takes
	// 2*Rounds+1); the ratio is the median round's. Row 6 runs as many
	// rounds and counts the median round's p99. On a shared
	// 2-core VM one window can be off by a fifth either way.
	Rounds int
}

// fullScale is the matrix.
var fullScale = scale{
	Warmup: 5 * time.Second, Duration: 20 * time.Second,
	CostWarmup: 10 * time.Second, CostDuration: 60 * time.Second,
	ManyStreams: 10_000, ManyRate: 2000,
	// Streams leave the packs 5 to 10 minutes after they came in, each
	// with a data PUT and a checkpoint: a window that ended before would
	// count none of that. Seven minutes in, the first streams are leaving.
	ManyWarmup: 7 * time.Minute, ManyDuration: 3 * time.Minute,
	SSESubscribers: 5000, SSERate: 20, SSEDuration: 30 * time.Second,
	CatchupMiB: 256,
	// 256 workers, not 64: creating and reading back 100,000 streams is
	// the row's set-up, not its measure (memory after the idle minute),
	// and at 64 workers it took 16 of the matrix's 28 minutes.
	IdleStreams: 100_000, IdleWorkers: 256, IdleWait: 60 * time.Second,
	CrashLoad: 15 * time.Second, CrashAfter: 5 * time.Second,
	SweepWriters: []int{1, 4, 16, 64, 256, 1024},
	SweepWarmup:  2 * time.Second, SweepDuration: 6 * time.Second,
	Rounds: 3,
}

// quickScale is a smoke run of every code path in a few minutes.
var quickScale = scale{
	Warmup: time.Second, Duration: 3 * time.Second,
	CostWarmup: 2 * time.Second, CostDuration: 5 * time.Second,
	ManyStreams: 1000, ManyRate: 500,
	ManyWarmup: 2 * time.Second, ManyDuration: 5 * time.Second,
	SSESubscribers: 200, SSERate: 20, SSEDuration: 5 * time.Second,
	CatchupMiB:  16,
	IdleStreams: 2000, IdleWorkers: 256, IdleWait: 5 * time.Second,
	CrashLoad: 6 * time.Second, CrashAfter: 2 * time.Second,
	SweepWriters: []int{1, 16, 256},
	SweepWarmup:  500 * time.Millisecond, SweepDuration: 2 * time.Second,
	Rounds: 1,
}

// rowDefs are the rows in the order they run; key is what -rows takes.
var rowDefs = []struct {
	key, title string
	run        func(*matrix, context.Context)
}{
	{"1", "appends, 64 writers over 100 streams: tuned, defaults, Node reference", (*matrix).row1},
	{"2", "object-store cost, 256 writers over 100 streams; and 10,000 slow streams", (*matrix).row2AndMany},
	{"3", "cloud-like S3 (+25 ms), 1,024 writers over 1,000 streams", (*matrix).row3},
	{"4", "one hot stream, 64 writers", (*matrix).row4},
	{"5", "1 MiB appends, 8 writers", (*matrix).row5},
	{"6", "fan-out to SSE subscribers, and on the Node reference server", (*matrix).row6},
	{"7", "cold catch-up read", (*matrix).row7},
	{"8", "idle streams cost no memory", (*matrix).row8},
	{"9", "recovery after SIGKILL", (*matrix).row9},
	{"sweep", "writer sweep for the chart", (*matrix).rowSweep},
}

// picoEnv is one PicoMQ Caddy on a fresh bucket behind a fresh S3 proxy.
type picoEnv struct {
	m      *matrix
	id     string
	bucket string
	proxy  *testenv.Proxy
	caddy  *caddyInst
	set    settings
}

func (m *matrix) newPico(ctx context.Context, id string, set settings) (*picoEnv, error) {
	m.buckets++
	bucket := fmt.Sprintf("bench-%s-%d", strings.ToLower(strings.NewReplacer("_", "-", " ", "-").Replace(id)), m.buckets)
	if err := m.versity.CreateBucket(ctx, bucket); err != nil {
		return nil, err
	}
	p, err := testenv.NewProxy(m.versity.Endpoint)
	if err != nil {
		return nil, err
	}
	p.SetLatency(set.Latency, set.Jitter)
	m.ctrl.use(p)
	storage := testenv.StoreURL(p.URL(), bucket, caddytest.S3Prefix)
	c, err := m.newCaddy(ctx, id, func(port int) string { return caddyPicoMQ(port, storage, set.Directives) }, caddytest.S3Env(m.versity))
	if err != nil {
		m.ctrl.use(nil)
		p.Close()
		return nil, err
	}
	m.logf("  picomq caddy %s: pid %d on %s, bucket %s, settings: %s", id, c.pid(), c.url(), bucket, set)
	return &picoEnv{m: m, id: id, bucket: bucket, proxy: p, caddy: c, set: set}, nil
}

func (e *picoEnv) close() {
	e.caddy.close()
	e.m.ctrl.use(nil)
	e.proxy.Close()
	// Nothing reads a row's bucket after its row, and on a tmpfs the
	// buckets of a whole run would otherwise stay in memory.
	if err := os.RemoveAll(filepath.Join(e.m.versityDir, e.bucket)); err != nil {
		e.m.logf("  removing bucket %s: %v", e.bucket, err)
	}
}

// ceilingInst starts the respond ceiling on first use; it runs until the
// matrix ends.
func (m *matrix) ceilingInst(ctx context.Context) (*caddyInst, error) {
	if m.ceiling != nil && m.ceiling.p.running() {
		return m.ceiling, nil
	}
	c, err := m.newCaddy(ctx, "ceiling", caddyRespond, nil)
	if err != nil {
		return nil, err
	}
	m.logf("  ceiling caddy (respond 204): pid %d on %s", c.pid(), c.url())
	m.ceiling = c
	return c, nil
}

// measureCeiling runs spec against the respond ceiling.
func (m *matrix) measureCeiling(ctx context.Context, name string, spec benchSpec) (*benchResult, string, error) {
	c, err := m.ceilingInst(ctx)
	if err != nil {
		return nil, "", err
	}
	spec.URL = c.url()
	spec.Pids = map[string]int{"caddy": c.pid()}
	spec.Mark = ""
	r, cl, err := m.runBench(ctx, name, spec)
	if err == nil {
		m.logf("  ceiling: %s", benchSummary(r))
	}
	return r, cl, err
}

// picoRun is a load-generator run against a PicoMQ instance with the S3
// requests of its measured window.
type picoRun struct {
	res    *benchResult
	s3     s3Window
	marked bool // s3 covers exactly the marked window (else the whole run)
	cmd    string
}

func (pr *picoRun) per1k() float64 {
	if pr.res == nil || pr.res.Ops <= 0 {
		return math.NaN()
	}
	return float64(pr.s3.Total) * 1000 / float64(pr.res.Ops)
}

// measurePico runs spec against e with the proxy's marks.
func (m *matrix) measurePico(ctx context.Context, e *picoEnv, name string, spec benchSpec) (*picoRun, error) {
	spec.URL = e.caddy.url()
	// versitygw and this process (the S3 proxy runs in it) share the
	// cores with Caddy; their CPU time shows where the box's time goes.
	spec.Pids = map[string]int{"caddy": e.caddy.pid(), "versitygw": m.versity.PID(), "proxy": os.Getpid()}
	spec.Mark = m.ctrl.markURL()
	m.ctrl.use(e.proxy)
	before := e.proxy.Counts()
	t0 := time.Now()
	r, cl, err := m.runBench(ctx, name, spec)
	pr := &picoRun{res: r, cmd: cl}
	if err != nil {
		return pr, err
	}
	if w, ok := m.ctrl.window(); ok {
		pr.s3, pr.marked = w, true
	} else {
		pr.s3 = diffCounts(before, e.proxy.Counts(), time.Since(t0))
	}
	m.logf("  picomq: %s, %s S3 requests/1,000 ops", benchSummary(r), fmtNum(pr.per1k()))
	return pr, nil
}

// appendSpec is an append load.
func appendSpec(prefix string, writers, streams, size int, warmup, dur time.Duration) benchSpec {
	return benchSpec{Mode: "append", Prefix: prefix, Writers: writers, Streams: streams, Size: size, Warmup: warmup, Duration: dur}
}

// appendMeasured describes an append run for the Measured column.
func appendMeasured(pr *picoRun) string {
	r := pr.res
	s := fmt.Sprintf("%s appends/s, p99 %s ms", fmtInt(float64(r.OpsPerS)), fmtNum(float64(r.Latency.P99)))
	if pr.s3.Total > 0 {
		s += fmt.Sprintf(", %s S3 req/1,000 appends", fmtNum(pr.per1k()))
	}
	if r.Errors > 0 {
		s += fmt.Sprintf(", %s errors", fmtInt(float64(r.Errors)))
	}
	return s
}

func ceilingRef(r *benchResult) string {
	return fmt.Sprintf("respond 204: %s requests/s, p99 %s ms", fmtInt(float64(r.OpsPerS)), fmtNum(float64(r.Latency.P99)))
}

func s3Breakdown(w s3Window, marked bool) string {
	s := fmt.Sprintf("S3 requests in the window: %d (PUT %d, GET %d, LIST %d, DELETE %d, HEAD %d, other %d), %s uploaded",
		w.Total, w.Put, w.Get, w.List, w.Delete, w.Head, w.Other, fmtBytes(w.BytesPut))
	if !marked {
		s += "; the load generator did not mark its window, so these cover the whole run including warm-up and stream creation"
	}
	return s
}

func fmtBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

func errorCheck(r *benchResult) check {
	return check{What: "errors", Got: float64(r.Errors), Limit: 0}
}

func errorDetail(r *benchResult) []string {
	if r.Errors == 0 || len(r.ErrorSamples) == 0 {
		return nil
	}
	n := min(len(r.ErrorSamples), 3)
	return []string{fmt.Sprintf("error samples: %s", strings.Join(r.ErrorSamples[:n], "; "))}
}

func processDetail(r *benchResult) []string {
	var out []string
	for _, p := range r.Processes {
		out = append(out, fmt.Sprintf("%s (pid %d) over the window: %.1f s CPU, RSS %.0f MiB, peak %.0f MiB, %s minor page faults",
			p.Name, int(p.PID), float64(p.CPUS), float64(p.RSSMiB), float64(p.PeakRSSMiB), fmtInt(float64(p.Faults))))
	}
	return out
}

// throughputRows measures the ceiling for spec and then PicoMQ with each
// id's settings (a fresh instance each time), as rows with the same
// targets; it does so m.sc.Rounds times, alternately, and judges each row
// by its median round (ratio and p99). It returns the median round's
// ceiling.
func (m *matrix) throughputRows(ctx context.Context, ids []string, titles []string, target string, spec benchSpec, minRatio, maxP99 float64) *benchResult {
	rounds := max(m.sc.Rounds, 1)
	rows := make([]*rowResult, len(ids))
	runs := make([][]*picoRun, len(ids))
	took := make([]time.Duration, len(ids))
	for i, id := range ids {
		r := newRow(id, titles[i], target)
		set := rowSettings[id]
		r.use(set)
		m.rows = append(m.rows, r)
		rows[i] = r
	}
	var ceils []*benchResult
	var ceilTook time.Duration
	for round := 1; round <= rounds; round++ {
		t1 := time.Now()
		ceil, ceilCmd, err := m.measureCeiling(ctx, fmt.Sprintf("r%s-ceiling-%d", ids[0], round), spec)
		ceilTook += time.Since(t1)
		for _, r := range rows {
			if round == 1 {
				r.Commands = append(r.Commands, "# reference: the respond ceiling", ceilCmd)
			}
			if err != nil && r.Err == "" {
				r.Err = "ceiling: " + err.Error()
			}
		}
		if err != nil {
			break
		}
		ceils = append(ceils, ceil)
		for i, id := range ids {
			r := rows[i]
			if r.Err != "" {
				continue
			}
			// A fresh instance every round: one left running would
			// compact in the background through the next ceiling.
			t2 := time.Now()
			e, err := m.newPico(ctx, id, rowSettings[id])
			if err != nil {
				r.Err = "starting PicoMQ: " + err.Error()
				continue
			}
			pr, err := m.measurePico(ctx, e, fmt.Sprintf("r%s-%d", id, round), spec)
			e.close()
			took[i] += time.Since(t2)
			if round == 1 {
				r.Commands = append(r.Commands, "# PicoMQ", pr.cmd)
			}
			if err != nil {
				r.Err = err.Error()
				continue
			}
			runs[i] = append(runs[i], pr)
		}
	}
	if rounds > 1 {
		for _, r := range rows {
			r.Commands = append(r.Commands, fmt.Sprintf("# both commands %d times, alternately (ceiling, PicoMQ, ceiling, ...), PicoMQ on a fresh instance and bucket each time", rounds))
		}
	}
	for i, r := range rows {
		r.Elapsed = took[i] + ceilTook
		if r.Err != "" || len(runs[i]) != len(ceils) || len(ceils) == 0 {
			continue
		}
		judgeRounds(r, ceils, runs[i], minRatio, maxP99)
	}
	if len(ceils) == 0 {
		return nil
	}
	return medianCeiling(ceils)
}

// judgeRounds fills r from paired rounds: the ratio and p99 checked are
// the medians; Measured and the details are the median-ratio round's.
func judgeRounds(r *rowResult, ceils []*benchResult, runs []*picoRun, minRatio, maxP99 float64) {
	ratios := make([]float64, len(runs))
	p99s := make([]float64, len(runs))
	for k, pr := range runs {
		if c := ceils[k].OpsPerS; c > 0 {
			ratios[k] = float64(pr.res.OpsPerS) / float64(c)
		}
		p99s[k] = float64(pr.res.Latency.P99)
	}
	mid := medianIndex(ratios)
	pr, ceil := runs[mid], ceils[mid]
	sortedP99 := append([]float64(nil), p99s...)
	sort.Float64s(sortedP99)
	medP99 := sortedP99[len(sortedP99)/2]

	r.Reference = ceilingRef(ceil)
	r.Measured = appendMeasured(pr)
	r.Ratio = ratios[mid]
	if len(runs) > 1 {
		var parts []string
		for k := range runs {
			parts = append(parts, fmt.Sprintf("%s/%s = %.1f%% (p99 %s ms)", fmtInt(float64(runs[k].res.OpsPerS)),
				fmtInt(float64(ceils[k].OpsPerS)), 100*ratios[k], fmtNum(p99s[k])))
		}
		r.Reference += fmt.Sprintf(" (round %d of %d, whose ratio is the median)", mid+1, len(runs))
		r.Measured += fmt.Sprintf("; that round's figures, of %d rounds", len(runs))
		r.Details = append(r.Details, "rounds (PicoMQ/ceiling appends/s): "+strings.Join(parts, "; "))
	}
	r.Checks = append(r.Checks, ratioCheck(r.Ratio, minRatio))
	if maxP99 > 0 {
		r.Checks = append(r.Checks, check{What: "p99 (median of the rounds)", Got: medP99, Limit: maxP99, Unit: "ms"})
	}
	r.Checks = append(r.Checks, errorCheck(pr.res))
	r.Details = append(r.Details, s3Breakdown(pr.s3, pr.marked))
	r.Details = append(r.Details, fmt.Sprintf("PicoMQ latency ms: p50 %s, p90 %s, p99 %s, p99.9 %s, max %s",
		fmtNum(float64(pr.res.Latency.P50)), fmtNum(float64(pr.res.Latency.P90)), fmtNum(float64(pr.res.Latency.P99)),
		fmtNum(float64(pr.res.Latency.P999)), fmtNum(float64(pr.res.Latency.Max))))
	r.Details = append(r.Details, processDetail(pr.res)...)
	r.Details = append(r.Details, errorDetail(pr.res)...)
}

// medianIndex returns the index of the median of values (the upper one of
// an even count).
func medianIndex(values []float64) int {
	order := make([]int, len(values))
	for k := range order {
		order[k] = k
	}
	sort.Slice(order, func(a, b int) bool { return values[order[a]] < values[order[b]] })
	return order[len(order)/2]
}

// medianCeiling returns the ceiling run with the median throughput.
func medianCeiling(ceils []*benchResult) *benchResult {
	c := append([]*benchResult(nil), ceils...)
	sort.Slice(c, func(a, b int) bool { return c[a].OpsPerS < c[b].OpsPerS })
	return c[len(c)/2]
}

// row1: 64 writers over 100 streams, tuned and at the defaults, and the
// Node reference server under the same load.
func (m *matrix) row1(ctx context.Context) {
	spec := appendSpec("/r1/", 64, 100, 1024, m.sc.Warmup, m.sc.Duration)
	m.row1Ceiling = m.throughputRows(ctx, []string{"1", "1-defaults"},
		[]string{"Appends, 64 writers over 100 streams", "Row 1 at the module's defaults"},
		"≥ 50% of the ceiling; p99 ≤ 25 ms", spec, 0.5, 25)

	r, res := m.nodeRow(ctx, "1-node", "1", spec)
	if res == nil {
		return
	}
	r.Measured = fmt.Sprintf("%s appends/s, p99 %s ms", fmtInt(float64(res.OpsPerS)), fmtNum(float64(res.Latency.P99)))
	if res.Errors > 0 {
		r.Measured += fmt.Sprintf(", %s errors", fmtInt(float64(res.Errors)))
	}
	if c := m.row1Ceiling; c != nil && c.OpsPerS > 0 {
		r.Reference = ceilingRef(c) + " (row 1's ceiling with the median throughput)"
		r.Ratio = float64(res.OpsPerS) / float64(c.OpsPerS)
	}
}

// nodeRow runs spec against a fresh Node reference server (in memory) as
// row id, the comparison for row of. It returns the row and the result,
// which is nil when the run failed (the row's Err says why).
func (m *matrix) nodeRow(ctx context.Context, id, of string, spec benchSpec) (*rowResult, *benchResult) {
	t0 := time.Now()
	r := newRow(id, "Row "+of+"'s load on the Node reference server (`@durable-streams/server`, in memory, not durable)", "none: a comparison")
	r.Settings = "in memory, `compression: false`"
	m.rows = append(m.rows, r)
	defer func() { r.Elapsed = time.Since(t0) }()
	p, url, err := m.nodeServer(ctx)
	if err != nil {
		r.Err = "starting the Node server: " + err.Error()
		return r, nil
	}
	defer p.stop(5 * time.Second)
	m.logf("  node server: pid %d on %s", p.pid(), url)
	spec.URL = url
	spec.Pids = map[string]int{"node": p.pid()}
	res, cl, err := m.runBench(ctx, "r"+id, spec)
	r.Commands = append(r.Commands, cl)
	if err != nil {
		r.Err = err.Error()
		return r, nil
	}
	m.logf("  node: %s", benchSummary(res))
	r.Details = append(r.Details, processDetail(res)...)
	r.Details = append(r.Details, errorDetail(res)...)
	return r, res
}

// row2AndMany runs row 2, then the same cost spread over many streams,
// which it compares with row 2's figure.
func (m *matrix) row2AndMany(ctx context.Context) {
	_, busy, ok := m.costRow(ctx, "2", "Object-store cost, 256 writers over 100 streams",
		"≤ 10 S3 requests of any kind per 1,000 appends", 10, appendSpec("/r2/", 256, 100, 1024, m.sc.CostWarmup, m.sc.CostDuration))
	title := fmt.Sprintf("Object-store cost, %s streams sharing %s appends/s (64 writers)",
		fmtInt(float64(m.sc.ManyStreams)), fmtInt(m.sc.ManyRate))
	spec := appendSpec("/r2m/", 64, m.sc.ManyStreams, 1024, m.sc.ManyWarmup, m.sc.ManyDuration)
	spec.Rate = m.sc.ManyRate
	r, _, _ := m.costRow(ctx, "2-many", title, "none: a comparison", 0, spec)
	r.Reference = "row 2 (100 busy streams): see its row"
	if ok {
		r.Reference = fmt.Sprintf("row 2 (100 busy streams): %s S3 req/1,000 appends", fmtNum(busy.per1k()))
	}
}

// costRow measures S3 requests per 1,000 appends of spec on a fresh
// instance with row id's settings, and checks it against limit; with
// limit 0 the row is a comparison, which has no target to miss, but
// errors void its figure. It reports whether the figure was measured.
func (m *matrix) costRow(ctx context.Context, id, title, target string, limit float64, spec benchSpec) (*rowResult, *picoRun, bool) {
	t0 := time.Now()
	r := newRow(id, title, target)
	set := rowSettings[id]
	r.use(set)
	m.rows = append(m.rows, r)
	defer func() { r.Elapsed = time.Since(t0) }()
	e, err := m.newPico(ctx, id, set)
	if err != nil {
		r.Err = "starting PicoMQ: " + err.Error()
		return r, nil, false
	}
	defer e.close()
	pr, err := m.measurePico(ctx, e, "r"+id, spec)
	r.Commands = append(r.Commands, pr.cmd)
	if err != nil {
		r.Err = err.Error()
		return r, nil, false
	}
	r.Measured = fmt.Sprintf("%s S3 req/1,000 appends over %s; %s appends/s, p99 %s ms",
		fmtNum(pr.per1k()), spec.Duration, fmtInt(float64(pr.res.OpsPerS)), fmtNum(float64(pr.res.Latency.P99)))
	switch {
	case limit > 0:
		r.Checks = append(r.Checks, check{What: "S3 requests per 1,000 appends", Got: pr.per1k(), Limit: limit}, errorCheck(pr.res))
	case pr.res.Errors > 0:
		r.Err = fmt.Sprintf("%d appends failed", int64(pr.res.Errors))
	}
	r.Details = append(r.Details, s3Breakdown(pr.s3, pr.marked))
	r.Details = append(r.Details, processDetail(pr.res)...)
	r.Details = append(r.Details, errorDetail(pr.res)...)
	return r, pr, true
}

// row3: a cloud-like store, many writers and streams.
func (m *matrix) row3(ctx context.Context) {
	spec := appendSpec("/r3/", 1024, 1000, 1024, m.sc.Warmup, m.sc.Duration)
	m.throughputRows(ctx, []string{"3"}, []string{"Cloud-like S3 (+25 ms per request), 1,024 writers over 1,000 streams"},
		"≥ 50% of the ceiling with the same 1,024 writers; p99 ≤ 100 ms", spec, 0.5, 100)
}

// row4: one hot stream.
func (m *matrix) row4(ctx context.Context) {
	spec := appendSpec("/r4/", 64, 1, 1024, m.sc.Warmup, m.sc.Duration)
	m.throughputRows(ctx, []string{"4"}, []string{"One hot stream, 64 writers"},
		"≥ 30% of the ceiling", spec, 0.3, 0)
}
