//go:build linux

package main

// Tests of the pure parts: verdicts, number formatting, the Markdown table,
// the chart and the load generator's command line and result. Nothing here
// starts a process; the matrix itself runs only through bench/run.

import (
	"context"
	"encoding/xml"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
	"github.com/picomq/caddy-picomq/loadgen"
)

func TestCheckAndVerdict(t *testing.T) {
	r := newRow("1", "Appends", "≥ 50% of the ceiling; p99 ≤ 25 ms")
	if v, why := r.verdict(); v != "—" || why != "" {
		t.Errorf("no checks: got %q %q, want — and no reason", v, why)
	}
	r.Ratio = 0.62
	r.Checks = []check{ratioCheck(r.Ratio, 0.5), {What: "p99", Got: 12.5, Limit: 25, Unit: "ms"}}
	if v, why := r.verdict(); v != "PASS" || why != "" {
		t.Errorf("all met: got %q %q", v, why)
	}
	r.Checks[1].Got = 31
	v, why := r.verdict()
	if v != "MISS" || why != "p99 31 ms > 25 ms" {
		t.Errorf("p99 missed: got %q %q, want MISS %q", v, why, "p99 31 ms > 25 ms")
	}
	r.Checks[0] = ratioCheck(0.423, 0.5)
	if _, why := r.verdict(); why != "ratio 42.3% < 50%; p99 31 ms > 25 ms" {
		t.Errorf("both missed: reason %q", why)
	}
	r.Err = "ceiling: connection refused"
	if v, why := r.verdict(); v != "ERROR" || why != r.Err {
		t.Errorf("error: got %q %q", v, why)
	}

	// Limits are inclusive, and NaN never passes.
	if !(check{Got: 10, Limit: 10}).ok() || !(check{Got: 50, Limit: 50, Min: true}).ok() {
		t.Error("a figure equal to its limit must pass")
	}
	if (check{Got: math.NaN(), Limit: 10}).ok() {
		t.Error("NaN must not pass")
	}
	if got := (check{What: "S3 requests per 1,000 appends", Got: 4.25, Limit: 10}).String(); got != "S3 requests per 1,000 appends 4.25 ≤ 10" {
		t.Errorf("met check reads %q", got)
	}
	// Rounding must not show a miss as equal to its limit.
	for _, c := range []struct {
		c    check
		want string
	}{
		{ratioCheck(655.7/936.8, 0.7), "ratio 69.99% < 70%"},
		{ratioCheck(0.6999996, 0.7), "ratio 69.99996% < 70%"},
		{check{What: "p99", Got: 25.04, Limit: 25, Unit: "ms"}, "p99 25.04 ms > 25 ms"},
		{ratioCheck(0.7, 0.7), "ratio 70% ≥ 70%"},
	} {
		if got := c.c.String(); got != c.want {
			t.Errorf("check reads %q, want %q", got, c.want)
		}
	}
}

func TestFormatting(t *testing.T) {
	for _, c := range []struct {
		f    float64
		want string
	}{
		{0, "0"}, {3, "3"}, {0.5, "0.50"}, {2.345, "2.35"}, {12.34, "12.3"}, {50, "50"},
		{123.6, "124"}, {17528.4, "17,528"}, {1234567, "1,234,567"}, {-4321, "-4,321"}, {math.NaN(), "n/a"},
	} {
		if got := fmtNum(c.f); got != c.want {
			t.Errorf("fmtNum(%v) = %q, want %q", c.f, got, c.want)
		}
	}
	if got := fmtRatio(0.253); got != "25%" {
		t.Errorf("fmtRatio = %q", got)
	}
	if got := fmtRatio(math.NaN()); got != "—" {
		t.Errorf("fmtRatio(NaN) = %q", got)
	}
	if got := fmtSize(256 << 20); got != "256 MiB" {
		t.Errorf("fmtSize = %q", got)
	}
	if got := cell("a | b"); got != `a \| b` {
		t.Errorf("cell = %q", got)
	}
	if got := anchor("1-defaults"); got != "row-1-defaults" {
		t.Errorf("anchor = %q", got)
	}
}

func TestCPUTimes(t *testing.T) {
	for _, c := range []struct {
		line       string
		total, stl uint64
		ok         bool
	}{
		{"cpu  100 5 50 800 10 1 4 30 0 0", 1000, 30, true},
		{"cpu  100 5 50 800 10 1 4 30", 1000, 30, true},
		{"cpu  100 5 50 800 10 1 4", 0, 0, false},        // no steal column
		{"cpu0 100 5 50 800 10 1 4 30 0 0", 0, 0, false}, // one processor's line
		{"cpu  100 5 x 800 10 1 4 30 0 0", 0, 0, false},
	} {
		got, ok := parseCPUTimes(c.line)
		if ok != c.ok || got.total != c.total || got.steal != c.stl {
			t.Errorf("parseCPUTimes(%q) = %+v, %v; want total %d steal %d, %v", c.line, got, ok, c.total, c.stl, c.ok)
		}
	}
	for _, c := range []struct {
		from, to cpuTimes
		want     float64
	}{
		{cpuTimes{1000, 30}, cpuTimes{1400, 130}, 25},
		{cpuTimes{1000, 30}, cpuTimes{1400, 30}, 0},
		{cpuTimes{1000, 30}, cpuTimes{1000, 30}, math.NaN()}, // no time passed
		{cpuTimes{1000, 30}, cpuTimes{900, 20}, math.NaN()},  // counters went back
	} {
		got := stealPercent(c.from, c.to)
		if got != c.want && !(math.IsNaN(got) && math.IsNaN(c.want)) {
			t.Errorf("stealPercent(%+v, %+v) = %v, want %v", c.from, c.to, got, c.want)
		}
	}
	if got := []string{fmtSteal(math.NaN()), fmtSteal(3.14), fmtSteal(42.6)}; got[0] != "—" || got[1] != "3.1%" || got[2] != "43%" {
		t.Errorf("fmtSteal = %q", got)
	}
}

func TestMarkdownTable(t *testing.T) {
	pass := newRow("1", "Appends, 64 writers over 100 streams", "≥ 50% of the ceiling; p99 ≤ 25 ms")
	pass.Settings = "`flush_interval 2ms`"
	pass.Reference = "respond 204: 40,000 requests/s"
	pass.Measured = "24,000 appends/s, p99 9 ms"
	pass.Ratio = 0.6
	pass.Checks = []check{ratioCheck(0.6, 0.5), {What: "p99", Got: 9, Limit: 25, Unit: "ms"}}
	pass.Commands = []string{"caddy picomq bench --mode append --url http://127.0.0.1:1 --writers 64"}
	pass.Steal = 23.4

	miss := newRow("2", "Object-store cost", "≤ 10 S3 requests of any kind per 1,000 appends")
	miss.Measured = "14.5 S3 req/1,000 appends"
	miss.Checks = []check{{What: "S3 requests per 1,000 appends", Got: 14.5, Limit: 10}}
	miss.use(settings{Why: "compaction lists every stream", Notes: true})

	broken := newRow("6", "Fan-out", "every event reaches every subscriber")
	broken.Err = "bench r6: exit status 1: dial tcp: too many open files"

	rep := &report{
		Machine: machineInfo{CPU: "Test CPU", Cores: 2, Commit: "abc123", Date: time.Date(2026, 11, 30, 8, 0, 0, 0, time.UTC), Duration: 14 * time.Minute},
		Rows:    []*rowResult{pass, miss, broken},
		Sweep:   []sweepPoint{{Writers: 1, PicoOps: 500, PicoP99: 11, CeilOps: 4000, CeilP99: 0.4}},
		Chart:   "benchmarks.svg",
		Scale:   fullScale,
	}
	md := rep.markdown()

	var rows []string
	for _, line := range strings.Split(md, "\n") {
		if strings.HasPrefix(line, "| [") {
			rows = append(rows, line)
		}
	}
	if len(rows) != 3 {
		t.Fatalf("want 3 table rows, got %d:\n%s", len(rows), md)
	}
	header := "| Row | What | Settings | Reference | Measured | Ratio | Target | Result | Steal | Reason |"
	if !strings.Contains(md, header) {
		t.Errorf("table header missing")
	}
	for i, row := range rows {
		// Ten columns: eleven unescaped pipes.
		if n := strings.Count(strings.ReplaceAll(row, `\|`, ""), "|"); n != 11 {
			t.Errorf("row %d has %d pipes, want 11: %s", i, n, row)
		}
	}
	for _, want := range []string{"[1](#row-1)", "60%", "**PASS** | 23% |"} {
		if !strings.Contains(rows[0], want) {
			t.Errorf("passing row lacks %q: %s", want, rows[0])
		}
	}
	for _, want := range []string{"**MISS**", "S3 requests per 1,000 appends 14.5 > 10. compaction lists every stream"} {
		if !strings.Contains(rows[1], want) {
			t.Errorf("missing row lacks %q: %s", want, rows[1])
		}
	}
	// The evidence lives in the hand-written notes: a row that has some
	// links its section there, and only such a row.
	notesLink := "\n- Notes: what bounds the row, how it is tuned and what was tried, with the measurements, in [benchmark-notes.md](benchmark-notes.md#row-2)\n"
	if !strings.Contains(md, notesLink) || strings.Contains(md, "benchmark-notes.md#row-1") {
		t.Errorf("notes link missing or on the wrong row:\n%s", md)
	}
	if !strings.Contains(rows[2], "**ERROR** | — |") || !strings.Contains(rows[2], "too many open files") {
		t.Errorf("error row: %s", rows[2])
	}
	for _, want := range []string{
		"### Row 1\n", "### Row 2\n", "### Row 6\n",
		"caddy picomq bench --mode append --url http://127.0.0.1:1 --writers 64",
		"![appends/s and p99 latency against writer count](benchmarks.svg)",
		"bench/run -rows 1 -quick", "## Columns", "Test CPU, 2 cores", "abc123",
		"- Steal: 23% of the machine's CPU time went to the host's other guests while this row ran\n",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q", want)
		}
	}

	rep.Chart, rep.Sweep = "", nil
	if md := rep.markdown(); strings.Contains(md, "benchmarks.svg)") || !strings.Contains(md, "no chart") {
		t.Error("without a sweep the report must not link a chart")
	}
}

func TestChartSVG(t *testing.T) {
	points := []sweepPoint{
		{Writers: 1, PicoOps: 480, PicoP99: 12.5, CeilOps: 3900, CeilP99: 0.45},
		{Writers: 16, PicoOps: 5200, PicoP99: 14, CeilOps: 21000, CeilP99: 1.9},
		{Writers: 1024, PicoOps: 9100, PicoP99: 240, CeilOps: 25000, CeilP99: 95},
	}
	svg := chartSVG(points, "PicoMQ <vs> ceiling & co")

	// Well-formed XML, an svg root, and one circle per series per panel per
	// point, carrying its value.
	dec := xml.NewDecoder(strings.NewReader(svg))
	var root string
	var values []string
	titles := 0
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("invalid XML: %v\n%s", err, svg)
		}
		se, ok := tok.(xml.StartElement)
		if !ok {
			continue
		}
		if root == "" {
			root = se.Name.Local
			if se.Name.Space != "http://www.w3.org/2000/svg" {
				t.Errorf("root namespace %q", se.Name.Space)
			}
		}
		if se.Name.Local == "title" {
			titles++
		}
		if se.Name.Local == "circle" {
			for _, a := range se.Attr {
				if a.Name.Local == "data-value" {
					values = append(values, a.Value)
				}
			}
		}
	}
	if root != "svg" {
		t.Fatalf("root element %q, want svg", root)
	}
	if want := len(points) * 2 * 2; len(values) != want || titles != want {
		t.Fatalf("%d circles with values and %d titles, want %d", len(values), titles, want)
	}
	for _, v := range []string{"480", "12.5", "3900", "0.45", "9100", "240", "25000", "95"} {
		found := false
		for _, got := range values {
			if got == v {
				found = true
			}
		}
		if !found {
			t.Errorf("no point with value %s in %v", v, values)
		}
	}
	if !strings.Contains(svg, "PicoMQ &lt;vs&gt; ceiling &amp; co") {
		t.Error("title not escaped")
	}
	for _, w := range []string{">1<", ">16<", ">1024<"} {
		if !strings.Contains(svg, w) {
			t.Errorf("x tick %s missing", w)
		}
	}

	// No data still gives a valid document.
	if err := xml.Unmarshal([]byte(chartSVG(nil, "empty")), new(struct{})); err != nil {
		t.Errorf("empty chart: %v", err)
	}
}

func TestNiceScale(t *testing.T) {
	for _, c := range []struct{ v, top, step float64 }{
		{0, 1, 0.2}, {9, 10, 2}, {21000, 25000, 5000}, {17528, 20000, 5000}, {480, 500, 100},
	} {
		top, step := niceScale(c.v)
		if top != c.top || step != c.step {
			t.Errorf("niceScale(%v) = %v, %v; want %v, %v", c.v, top, step, c.top, c.step)
		}
	}
}

func TestBenchCommandLine(t *testing.T) {
	s := benchSpec{
		URL: "http://127.0.0.1:8080", Prefix: "/r1/", Mode: "append", Writers: 64, Streams: 100, Size: 1024,
		Warmup: 5 * time.Second, Duration: 20 * time.Second, Pids: map[string]int{"caddy": 42, "a": 7},
		Mark: "http://127.0.0.1:9/mark", JSON: "/tmp/work/r1.json",
	}
	want := "caddy picomq bench --mode append --url http://127.0.0.1:8080 --prefix /r1/ --writers 64 --streams 100 --size 1024 " +
		"--warmup 5s --duration 20s --pid a=7 --pid caddy=42 --mark http://127.0.0.1:9/mark --json r1.json"
	if got := s.commandLine(); got != want {
		t.Errorf("command line\n got %s\nwant %s", got, want)
	}
	if a := s.args(); a[len(a)-1] != "/tmp/work/r1.json" {
		t.Errorf("args keep the full JSON path, got %q", a[len(a)-1])
	}
	v := benchSpec{URL: "http://h", Mode: "verify", Prefix: "/r8/", Streams: 10, NoCreate: true, ContentType: "text/plain; charset=utf-8"}
	if got := v.commandLine(); !strings.Contains(got, "--create=false") || !strings.Contains(got, "--content-type 'text/plain; charset=utf-8'") {
		t.Errorf("verify command line: %s", got)
	}
}

func TestParseBenchResult(t *testing.T) {
	r, err := parseBenchResult([]byte(`{"mode":"append","writers":64,"ops":1000,"ops_per_s":5000.5,"bytes":2097152,
		"duration_s":2,"errors":0,"error_samples":[],"latency_ms":{"p50":1.5,"p99":9.25},
		"processes":[{"name":"caddy","pid":12,"cpu_s":1.5,"rss_mib":80,"peak_rss_mib":96}],
		"ok":true,"lost":null}`))
	if err != nil {
		t.Fatal(err)
	}
	if r.OpsPerS != 5000.5 || r.Latency.P99 != 9.25 || r.OK != 1 || r.Lost != 0 {
		t.Errorf("parsed %+v", r)
	}
	if got := r.mibPerS(); got != 1 {
		t.Errorf("mibPerS = %v, want 1", got)
	}
	if _, _, peak, ok := r.process("caddy"); !ok || peak != 96 {
		t.Errorf("caddy peak = %v, %v", peak, ok)
	}
	if _, err := parseBenchResult([]byte(`{"ops":"many"}`)); err == nil {
		t.Error("a non-number must be an error")
	}
	// A run that ended early writes its partial figures with the error
	// (and exits non-zero, as a refused verify does too): not figures.
	if _, err := parseBenchResult([]byte(`{"mode":"append","ops":10,"failure":"mark end: 500"}`)); err == nil || !strings.Contains(err.Error(), "mark end: 500") {
		t.Errorf("a failed run's result: %v, want its failure", err)
	}
}

func TestParseRows(t *testing.T) {
	got, err := parseRows("5, 1,sweep")
	if err != nil || strings.Join(got, ",") != "1,5,sweep" {
		t.Errorf("parseRows = %v, %v", got, err)
	}
	if all, _ := parseRows(""); len(all) != len(rowDefs) {
		t.Errorf("empty selects %d rows, want all %d", len(all), len(rowDefs))
	}
	if _, err := parseRows("1,42"); err == nil {
		t.Error("unknown row must be an error")
	}
}

func TestSettingsTable(t *testing.T) {
	// Every row has an entry, so tuning happens in one place.
	for _, id := range []string{"1", "1-defaults", "2", "3", "4", "5", "6", "7", "8", "9", "sweep"} {
		if _, ok := rowSettings[id]; !ok {
			t.Errorf("rowSettings lacks %q", id)
		}
	}
	if len(rowSettings["1-defaults"].Directives) != 0 {
		t.Error("1-defaults must run the module's defaults")
	}
	if got := (settings{Directives: []string{"flush_interval 2ms"}, Latency: 25 * time.Millisecond}).String(); got != "`flush_interval 2ms`, S3 +25ms per request" {
		t.Errorf("settings string %q", got)
	}
	cf := caddyPicoMQ(8080, "s3://b/picomq?region=us-east-1&path_style=true&endpoint=http://127.0.0.1:9", []string{"flush_interval 2ms"})
	for _, want := range []string{"admin off", "persist_config off", "http://:8080", "bind 127.0.0.1", "\t\tflush_interval 2ms\n", `storage "s3://b/picomq?`} {
		if !strings.Contains(cf, want) {
			t.Errorf("Caddyfile lacks %q:\n%s", want, cf)
		}
	}
	// As the README configures it: no route block (a subroute per request).
	if strings.Contains(cf, "route") {
		t.Errorf("Caddyfile wraps picomq in a route:\n%s", cf)
	}
	if strings.Count(cf, "{") != strings.Count(cf, "}") {
		t.Errorf("unbalanced braces:\n%s", cf)
	}
}

func TestDiffCounts(t *testing.T) {
	w := diffCounts(countsOf(10, 5, 1), countsOf(40, 6, 3), time.Second)
	if w.Put != 30 || w.Get != 1 || w.List != 2 || w.Total != 33 {
		t.Errorf("window %+v", w)
	}
	pr := &picoRun{res: &benchResult{Ops: 3000}, s3: w}
	if got := pr.per1k(); got != 11 {
		t.Errorf("per1k = %v, want 11", got)
	}
	if got := (&picoRun{res: &benchResult{}}).per1k(); !math.IsNaN(got) {
		t.Errorf("per1k with no ops = %v, want NaN", got)
	}
}

func countsOf(put, get, list int) testenv.Counts {
	return testenv.Counts{Put: put, Get: get, List: list}
}

// Rounds are judged by their median: one window that the VM slowed down
// (or sped up) does not decide a row.
func TestJudgeRoundsTakesTheMedian(t *testing.T) {
	res := func(ops, p99 float64) *benchResult {
		r := &benchResult{OpsPerS: num(ops)}
		r.Latency.P99 = num(p99)
		return r
	}
	ceils := []*benchResult{res(20000, 5), res(13000, 5), res(19000, 5)}
	runs := []*picoRun{{res: res(5000, 40)}, {res: res(4500, 90)}, {res: res(5900, 20)}}
	// Ratios 25%, 34.6%, 31.1%: the median is round 3's.
	r := newRow("4", "t", "t")
	judgeRounds(r, ceils, runs, 0.3, 50)
	if got := r.Ratio; math.Abs(got-5900.0/19000) > 1e-9 {
		t.Fatalf("ratio %v, want round 3's %v", got, 5900.0/19000)
	}
	var p99 *check
	for i := range r.Checks {
		if strings.HasPrefix(r.Checks[i].What, "p99") {
			p99 = &r.Checks[i]
		}
	}
	if p99 == nil || p99.Got != 40 || !p99.ok() {
		t.Fatalf("p99 check %+v, want the median 40 ms within 50", p99)
	}
	if !strings.Contains(r.Reference, "round 3 of 3") || !strings.Contains(strings.Join(r.Details, "\n"), "4,500/13,000 = 34.6%") {
		t.Fatalf("reference %q, details %q", r.Reference, r.Details)
	}
	// Round 3's own figures, said to be one round's: neither is the
	// median of its kind (5,000 and 19,000 are).
	if strings.Contains(r.Measured, "median") || !strings.Contains(r.Measured, "5,900") || !strings.Contains(r.Reference, "whose ratio is the median") {
		t.Errorf("measured %q, reference %q: want round 3's figures, labelled as one round's", r.Measured, r.Reference)
	}
}

func TestVersityDir(t *testing.T) {
	work := t.TempDir()
	tests := []struct {
		choice, dir, where string
	}{
		{"disk", filepath.Join(work, "versity"), "posix backend on the work directory's disk"},
		{work + "/elsewhere", work + "/elsewhere", "posix backend on " + work + "/elsewhere"},
	}
	for _, tt := range tests {
		dir, where, err := versityDir(tt.choice, work)
		if err != nil || dir != tt.dir || where != tt.where {
			t.Errorf("versityDir(%q) = %q, %q, %v; want %q, %q", tt.choice, dir, where, err, tt.dir, tt.where)
		}
	}
	// auto is a fresh directory on a tmpfs, or the disk when there is none.
	dir, where, err := versityDir("auto", work)
	if err != nil {
		t.Fatal(err)
	}
	if dir != filepath.Join(work, "versity") {
		defer os.RemoveAll(dir)
		if !strings.HasPrefix(dir, "/dev/shm/") || !strings.Contains(where, "tmpfs") {
			t.Errorf("auto gave %q (%s)", dir, where)
		}
	}
}

// The reference PUTs' p99 is taken at the load generator's rank, the
// nearest rank (the smallest value with at least p% at or below it), so
// that the Reference and Measured columns of a row are the same statistic:
// of 1,060 values the 99th percentile is the 1,050th (0.99 × 1,060 =
// 1,049.4, rounded up), not the 1,049th.
func TestPercentileIsTheLoadGeneratorsRank(t *testing.T) {
	ranks := func(n int) []float64 {
		t.Helper()
		s := make([]float64, n)
		for i := range s {
			s[i] = float64(i + 1)
		}
		return s
	}
	if got := percentile(ranks(1060), 99); got != 1050 {
		t.Errorf("p99 of 1..1060 = %v, want 1050", got)
	}
	for _, n := range []int{1, 2, 99, 100, 101, 1000, 1060, 1110, 12345} {
		s := ranks(n)
		for _, p := range []float64{50, 90, 99, 99.9} {
			if got, want := percentile(s, p), loadgen.Percentile(s, p); got != want {
				t.Errorf("p%v of 1..%d = %v, the load generator's %v", p, n, got, want)
			}
		}
	}
}

// The reference PUTs are counted as the load generator counts appends:
// every PUT that completes inside the window, one that started in the
// warm-up included, and none that completes after it. Counting only PUTs
// that also started inside left out one PUT per writer, the one in flight
// as the window opened, and lowered the reference the ratio divides by.
func TestTimedPutsCountsWhatCompletesInTheWindow(t *testing.T) {
	const warmup, dur = 100 * time.Millisecond, 300 * time.Millisecond
	// One writer: its first PUT spans the window's start (ending at about
	// 200 ms), its second ends inside (about 210 ms), its third after the
	// window's end (about 610 ms); no fourth may start.
	sleeps := []time.Duration{200 * time.Millisecond, 10 * time.Millisecond, 400 * time.Millisecond}
	lat, elapsed, err := timedPuts(t.Context(), 1, warmup, dur, func(ctx context.Context, w, n int) error {
		if n >= len(sleeps) {
			return fmt.Errorf("PUT %d started after the window", n)
		}
		time.Sleep(sleeps[n])
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(lat) != 2 || lat[0] >= 200 || lat[1] < 200 || lat[1] >= 400 {
		t.Errorf("latencies counted %v ms, want the 10 ms and the 200 ms PUTs", lat)
	}
	if elapsed < dur {
		t.Errorf("window %s, want at least %s", elapsed, dur)
	}
}

// TestNotesCoverTheRows holds docs/benchmark-notes.md and the settings
// table together: every row whose settings say it has notes has a section
// there, under the heading the report links to, and every section there
// belongs to such a row.
func TestNotesCoverTheRows(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "docs", notesFile))
	if err != nil {
		t.Fatal(err)
	}
	sections := map[string]bool{}
	for _, line := range strings.Split(string(b), "\n") {
		if id, ok := strings.CutPrefix(line, "## Row "); ok {
			if sections[id] {
				t.Errorf("%s has two sections for row %s", notesFile, id)
			}
			sections[id] = true
		}
	}
	for id, set := range rowSettings {
		switch {
		case set.Notes && !sections[id]:
			t.Errorf("row %s has Notes but %s has no \"## Row %s\"", id, notesFile, id)
		case !set.Notes && sections[id]:
			t.Errorf("%s has a section for row %s, whose settings do not link it (Notes)", notesFile, id)
		}
	}
	for id := range sections {
		if _, ok := rowSettings[id]; !ok {
			t.Errorf("%s has a section for row %s, which the matrix does not have", notesFile, id)
		}
	}
}
