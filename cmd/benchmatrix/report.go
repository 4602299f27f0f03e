//go:build linux

package main

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// notesFile is the hand-written companion of the report, beside it in
// docs/: a section per row whose settings have Notes, headed "Row <ID>".
const notesFile = "benchmark-notes.md"

// rowResult is one line of the table and its section below it.
type rowResult struct {
	ID        string // "1", "1-defaults", "1-node", "2", ...
	Title     string // what the row measures
	Settings  string // Caddyfile directives and proxy latency it ran with
	Target    string // the target, in words
	Reference string // the reference figure, with what it is
	Measured  string // the measured figure(s)
	Ratio     float64
	Checks    []check
	Err       string   // set when the row could not be measured
	Why       string   // the table's short reason, from the settings table
	Notes     bool     // the row has a section in docs/benchmark-notes.md
	Commands  []string // exact load-generator command lines
	Details   []string // further figures for the row's section
	Elapsed   time.Duration
	// Steal is the percentage of the machine's CPU time the hypervisor
	// gave to other guests while the row ran; NaN when unknown.
	Steal float64
}

func newRow(id, title, target string) *rowResult {
	return &rowResult{ID: id, Title: title, Target: target, Ratio: math.NaN(), Steal: math.NaN()}
}

// use records the settings the row runs with.
func (r *rowResult) use(set settings) {
	r.Settings, r.Why, r.Notes = set.String(), set.Why, set.Notes
}

// check is one target of a row: Got must be at least (Min) or at most Limit.
type check struct {
	What  string
	Got   float64
	Limit float64
	Min   bool
	Unit  string
}

func (c check) ok() bool {
	if math.IsNaN(c.Got) {
		return false
	}
	if c.Min {
		return c.Got >= c.Limit
	}
	return c.Got <= c.Limit
}

// String says how the check came out, such as "p99 31 ms > 25 ms".
func (c check) String() string {
	op := "≤"
	if c.Min {
		op = "≥"
	}
	if !c.ok() {
		if c.Min {
			op = "<"
		} else {
			op = ">"
		}
	}
	unit := c.Unit
	if unit != "" && unit != "%" {
		unit = " " + unit
	}
	got, limit := fmtNum(c.Got), fmtNum(c.Limit)
	// A figure that misses (or meets) its limit by less than the shown
	// precision must not read as equal to it: 69.994% is not "70.0% < 70%".
	shownAsLimit := func(s string) bool {
		f, err := strconv.ParseFloat(strings.ReplaceAll(s, ",", ""), 64)
		return err == nil && f == c.Limit
	}
	for digits := 2; shownAsLimit(got) && c.Got != c.Limit && digits <= 6; digits++ {
		got = strconv.FormatFloat(c.Got, 'f', digits, 64)
	}
	return fmt.Sprintf("%s %s%s %s %s%s", c.What, got, unit, op, limit, unit)
}

// ratioCheck is the check "measured/reference ≥ min" in percent.
func ratioCheck(ratio, min float64) check {
	return check{What: "ratio", Got: ratio * 100, Limit: min * 100, Min: true, Unit: "%"}
}

// verdict is the row's result and, unless it passed, why.
func (r *rowResult) verdict() (string, string) {
	if r.Err != "" {
		return "ERROR", r.Err
	}
	if len(r.Checks) == 0 {
		return "—", ""
	}
	var missed []string
	for _, c := range r.Checks {
		if !c.ok() {
			missed = append(missed, c.String())
		}
	}
	if len(missed) == 0 {
		return "PASS", ""
	}
	return "MISS", strings.Join(missed, "; ")
}

// fmtNum formats a figure with a precision that suits its size.
func fmtNum(f float64) string {
	switch {
	case math.IsNaN(f) || math.IsInf(f, 0):
		return "n/a"
	case math.Abs(f) >= 100:
		return fmtInt(f)
	case f == math.Trunc(f):
		return strconv.FormatFloat(f, 'f', 0, 64)
	case math.Abs(f) >= 10:
		return strconv.FormatFloat(f, 'f', 1, 64)
	default:
		return strconv.FormatFloat(f, 'f', 2, 64)
	}
}

// fmtInt rounds f and groups its digits by thousands.
func fmtInt(f float64) string {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return "n/a"
	}
	n := int64(math.Round(f))
	neg := n < 0
	if neg {
		n = -n
	}
	s := strconv.FormatInt(n, 10)
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

func fmtRatio(r float64) string {
	if math.IsNaN(r) {
		return "—"
	}
	return fmt.Sprintf("%.0f%%", r*100)
}

// cell makes s safe inside a Markdown table cell.
func cell(s string) string {
	s = strings.ReplaceAll(s, "|", `\|`)
	s = strings.ReplaceAll(s, "\n", " ")
	if s == "" {
		return "—"
	}
	return s
}

// anchor is the GitHub heading anchor of "Row <id>".
func anchor(id string) string {
	return "row-" + strings.ToLower(strings.ReplaceAll(id, " ", "-"))
}

// machineInfo describes where the matrix ran.
type machineInfo struct {
	CPU     string
	Cores   int
	MemGiB  float64
	Kernel  string
	Go      string
	Versity string
	// VersityDir says where versitygw kept the buckets.
	VersityDir string
	Node       string
	Commit     string
	Date       time.Time
	NoFile     uint64
	// PageFault is what the first write to a fresh page of memory costs
	// here (a minor fault): every page a freshly started process's heap
	// grows by pays it once.
	PageFault time.Duration
	PageKiB   int
	// Load averages (1 minute) when the matrix started and ended: other
	// work on the machine skews every figure.
	LoadStart, LoadEnd string
	// Steal is the percentage of CPU time stolen over the whole run (see
	// cpuTimes); NaN when unknown.
	Steal    float64
	Duration time.Duration
	Quick    bool
	Rows     string // the -rows selection, "" for all
}

// report is everything docs/benchmarks.md is made of.
type report struct {
	Machine machineInfo
	Rows    []*rowResult
	Sweep   []sweepPoint
	// SweepCommands are the load-generator runs behind the chart.
	SweepCommands []string
	Chart         string // file name of the chart, "" when the sweep did not run
	Scale         scale
}

// markdown renders the report.
func (rep *report) markdown() string {
	var b strings.Builder
	mi := rep.Machine
	b.WriteString("# Benchmarks\n\n")
	b.WriteString("<!-- Generated by bench/run (cmd/benchmatrix); edit the generator, not this file. -->\n\n")
	fmt.Fprintf(&b, "Measured %s UTC at commit `%s`; the matrix took %s.", mi.Date.UTC().Format("2006-01-02 15:04"), mi.Commit, mi.Duration.Round(time.Second))
	if mi.Quick {
		b.WriteString(" **This is a `-quick` smoke run: short windows and small sizes, not the issue's matrix; its figures are not comparable to the targets.**")
	}
	if mi.Rows != "" {
		fmt.Fprintf(&b, " Only these rows ran: %s.", mi.Rows)
	}
	b.WriteString("\n\n")

	b.WriteString("PicoMQ in Caddy, on [versitygw](https://github.com/versity/versitygw) (posix backend; where its directory was is in the table below) through the test suite's S3 proxy (row 7's timed read excepted, which goes straight to versitygw as its reference does), measured against what the same machine does without PicoMQ. ")
	b.WriteString("Every figure below comes from one run of `bench/run`; the load generator is `caddy picomq bench`, the same binary for every row and every reference.\n\n")

	b.WriteString("## Machine\n\n| | |\n| --- | --- |\n")
	fmt.Fprintf(&b, "| CPU | %s, %d cores (`nproc`) |\n", cell(mi.CPU), mi.Cores)
	fmt.Fprintf(&b, "| memory | %.0f GiB |\n", mi.MemGiB)
	fmt.Fprintf(&b, "| kernel | %s |\n", cell(mi.Kernel))
	fmt.Fprintf(&b, "| Go | %s |\n", cell(mi.Go))
	fmt.Fprintf(&b, "| versitygw | %s, %s |\n", cell(mi.Versity), cell(orDash(mi.VersityDir)))
	fmt.Fprintf(&b, "| Node.js | %s |\n", cell(mi.Node))
	fmt.Fprintf(&b, "| open files (`ulimit -n`) | %d |\n", mi.NoFile)
	if mi.PageFault > 0 {
		fmt.Fprintf(&b, "| first write to a fresh %d KiB page (a minor page fault) | %.1f us (best of 3 passes over %d MiB of new memory) |\n",
			mi.PageKiB, float64(mi.PageFault)/float64(time.Microsecond), faultProbeMiB)
	}
	fmt.Fprintf(&b, "| load average (1 min) at start, at end | %s, %s |\n", orDash(mi.LoadStart), orDash(mi.LoadEnd))
	fmt.Fprintf(&b, "| CPU time stolen by the hypervisor over the run (steal, /proc/stat) | %s |\n\n", fmtSteal(mi.Steal))
	b.WriteString("Caddy, versitygw, the S3 proxy, the load generator and the Node server all share these cores, as they would on a small single-box deployment; nothing is pinned. Anything else running on the machine at the same time (the load averages above show how busy it was) lowers and scatters the figures, the ceilings' as much as PicoMQ's. ")
	b.WriteString("The cores are a virtual machine's: when the host runs other guests on them, the time is stolen from every process here at once. The Steal column gives that share for each row; at the same code and settings, a row measured under a fifth of its time stolen lands well below one measured with none, and latency rows suffer most.\n\n")

	b.WriteString("## Results\n\n")
	b.WriteString("| Row | What | Settings | Reference | Measured | Ratio | Target | Result | Steal | Reason |\n")
	b.WriteString("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	for _, r := range rep.Rows {
		v, reason := r.verdict()
		if r.Why != "" {
			if reason != "" {
				reason += ". " + r.Why
			} else {
				reason = r.Why
			}
		}
		verdict := v
		if v == "PASS" || v == "MISS" || v == "ERROR" {
			verdict = "**" + v + "**"
		}
		fmt.Fprintf(&b, "| [%s](#%s) | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n",
			r.ID, anchor(r.ID), cell(r.Title), cell(r.Settings), cell(r.Reference), cell(r.Measured),
			fmtRatio(r.Ratio), cell(r.Target), verdict, fmtSteal(r.Steal), cell(reason))
	}
	b.WriteString("\n")

	b.WriteString("## Chart\n\n")
	if rep.Chart != "" && len(rep.Sweep) > 0 {
		fmt.Fprintf(&b, "![appends/s and p99 latency against writer count](%s)\n\n", rep.Chart)
		fmt.Fprintf(&b, "Appends of %s bodies over 100 streams with %s writers, each point a %s window after %s of warm-up. ",
			fmtSize(1024), joinInts(sweepWriters(rep.Sweep)), rep.Scale.SweepDuration, rep.Scale.SweepWarmup)
		fmt.Fprintf(&b, "PicoMQ runs with row 1's tuned settings (%s); the ceiling is the same Caddy binary with a `respond 204` route, so the gap between the two lines is what PicoMQ costs over a bare HTTP round trip on this machine. ", sweepSettings())
		b.WriteString("The left panel is throughput (higher is better), the right one p99 latency on a log scale (lower is better).\n\n")
		b.WriteString("| writers | PicoMQ appends/s | PicoMQ p99 ms | ceiling requests/s | ceiling p99 ms | ratio |\n| --- | --- | --- | --- | --- | --- |\n")
		for _, p := range rep.Sweep {
			ratio := math.NaN()
			if p.CeilOps > 0 {
				ratio = p.PicoOps / p.CeilOps
			}
			fmt.Fprintf(&b, "| %d | %s | %s | %s | %s | %s |\n", p.Writers, fmtInt(p.PicoOps), fmtNum(p.PicoP99), fmtInt(p.CeilOps), fmtNum(p.CeilP99), fmtRatio(ratio))
		}
		b.WriteString("\n")
		if len(rep.SweepCommands) > 0 {
			b.WriteString("<details><summary>The commands behind the chart</summary>\n\n```sh\n")
			for _, c := range rep.SweepCommands {
				b.WriteString(c + "\n")
			}
			b.WriteString("```\n\n</details>\n\n")
		}
	} else {
		b.WriteString("The writer sweep was not part of this run (`-rows` without `sweep`), so there is no chart; a full `bench/run` draws it.\n\n")
	}

	b.WriteString(rerunText)
	b.WriteString(columnsText)

	b.WriteString("## Rows in detail\n\n")
	for _, r := range rep.Rows {
		fmt.Fprintf(&b, "### Row %s\n\n", r.ID)
		v, reason := r.verdict()
		fmt.Fprintf(&b, "%s. Target: %s. Result: **%s**", r.Title, r.Target, v)
		if reason != "" {
			fmt.Fprintf(&b, " (%s)", reason)
		}
		fmt.Fprintf(&b, "; took %s.\n\n", r.Elapsed.Round(time.Second))
		fmt.Fprintf(&b, "- Settings: %s\n", r.Settings)
		fmt.Fprintf(&b, "- Reference: %s\n", orDash(r.Reference))
		fmt.Fprintf(&b, "- Measured: %s\n", orDash(r.Measured))
		if !math.IsNaN(r.Steal) {
			fmt.Fprintf(&b, "- Steal: %s of the machine's CPU time went to the host's other guests while this row ran\n", fmtSteal(r.Steal))
		}
		for _, c := range r.Checks {
			mark := "met"
			if !c.ok() {
				mark = "missed"
			}
			fmt.Fprintf(&b, "- Check (%s): %s\n", mark, c.String())
		}
		for _, d := range r.Details {
			fmt.Fprintf(&b, "- %s\n", d)
		}
		if r.Why != "" {
			fmt.Fprintf(&b, "- In short: %s\n", r.Why)
		}
		if r.Notes {
			fmt.Fprintf(&b, "- Notes: what bounds the row, how it is tuned and what was tried, with the measurements, in [benchmark-notes.md](%s#row-%s)\n", notesFile, r.ID)
		}
		if len(r.Commands) > 0 {
			b.WriteString("\n```sh\n")
			for _, c := range r.Commands {
				b.WriteString(c + "\n")
			}
			b.WriteString("```\n")
		}
		b.WriteString("\n")
	}
	return b.String()
}

// fmtSteal shows a steal percentage; a dash when unknown.
func fmtSteal(p float64) string {
	switch {
	case math.IsNaN(p):
		return "—"
	case p < 10:
		return fmt.Sprintf("%.1f%%", p)
	default:
		return fmt.Sprintf("%.0f%%", p)
	}
}

func orDash(s string) string {
	if s == "" {
		return "—"
	}
	return s
}

func joinInts(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, ", ")
}

// fmtSize writes a byte count the way the Caddyfile does.
func fmtSize(n int64) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}

const rerunText = "## Rerunning\n\n" +
	"```sh\n" +
	"bench/run                     # the whole matrix and the chart; rewrites docs/benchmarks.md and docs/benchmarks.svg (about 35 minutes; row 2-many's 10 minutes of load and creating the 100,000 streams of row 8 are most of it)\n" +
	"bench/run -rows 1 -quick      # row 1 only, short windows: a smoke run of a minute or so\n" +
	"bench/run -quick              # every row, short windows and small sizes (about 2 minutes)\n" +
	"bench/run -rows 2,5,sweep -out /tmp/b.md   # a subset, written elsewhere\n" +
	"bench/run -keep               # keep the work directory: Caddyfiles, Caddy logs, each bench's JSON and log\n" +
	"bench/run -s3dir disk         # versitygw's buckets on disk instead of tmpfs\n" +
	"```\n\n" +
	"`bench/run` raises the open-file limit (`ulimit -n`) as far as the hard limit allows, then runs " +
	"`go run ./cmd/benchmatrix`. That builds `./cmd/caddy` once, installs and starts versitygw with its buckets on a " +
	"tmpfs (`/dev/shm` when it has 8 GiB free; `-s3dir disk` puts them on disk), and for every PicoMQ row starts a fresh bucket, a fresh S3 proxy and a fresh Caddy with its own Caddyfile " +
	"(`admin off`, `persist_config off`, the `picomq` block with the row's settings). Why tmpfs: this machine's disk is ext4 without a journal, whose inode allocator skips every inode " +
	"freed in the last minute; with WAL objects created and deleted hundreds of times a second, versitygw spent a quarter of " +
	"its CPU in that scan, and row 4's load ran at 5,400-5,900 appends/s with the buckets on disk against 7,100-8,300 on tmpfs. That is the stand-in's file system, not an object " +
	"store, so it is kept out of every row and every reference alike. Each row's bucket is removed when the row ends.\n\n" +
	"The ceiling is the same binary with `respond 204`. The Node reference server is `@durable-streams/server`, pinned in `bench/node/package-lock.json` " +
	"(installed with `npm ci` when missing) and started in memory by `bench/node/start.mjs`. Every process the matrix " +
	"starts is killed when it ends, also on errors and Ctrl-C. The matrix is not part of `go test`.\n\n" +
	"Each row's tunable settings (Caddyfile directives, proxy latency) are in one table, `rowSettings` in " +
	"`cmd/benchmatrix/rows.go`; window lengths and sizes are in `fullScale` and `quickScale` beside it. " +
	"The commands in each row's section are the exact load-generator invocations, `caddy` standing for the binary " +
	"built from `./cmd/caddy`; the ports in their URLs were picked at random for that run.\n\n" +
	"The S3 proxy is `internal/testenv`'s, also available on its own as `go run ./cmd/s3proxy -target URL [-latency 25ms -jitter 5ms -error-rate 0.01]`, to put a cloud-like delay or errors in front of any S3 endpoint.\n\n"

const columnsText = "## Columns\n\n" +
	"- **Row**: the issue's row number; `1-defaults` is row 1 with the module's default settings, `1-node` and `6-node` rows 1's and 6's loads against the Node reference server, `7-warm` row 7's read again by the same Caddy right after it, `7-cloud` row 7's cold read with the S3 proxy adding 25 ms to every request. The link goes to the row's section below, which has the exact commands.\n" +
	"- **What**: the load. Appends carry 1 KiB bodies unless the row says otherwise; writers are closed-loop (each sends its next request when the previous one is answered) and spread over the streams.\n" +
	"- **Settings**: the `picomq` Caddyfile directives the row sets (anything not listed is the module's default, as in the README's Caddyfile table; \"defaults\" means none is set) and the delay the S3 proxy adds to every request.\n" +
	"- **Reference**: what the row is measured against, in the same run with the same load generator: the `respond 204` ceiling of the same Caddy binary with the same writers, or direct S3 requests to versitygw for the storage rows.\n" +
	"- **Measured**: PicoMQ's figure over the measured window (after the warm-up). p99 is the 99th percentile of the time from sending an append to its acknowledgement (for SSE, from an append's acknowledgement to its receipt). S3 requests are counted by the S3 proxy between the load generator's start and end marks, so compaction, lease renewals and deletes in that window count too; they do not come from the module's own counters.\n" +
	"- **Ratio**: measured ÷ reference.\n" +
	"- **Target**: the issue's target for the row.\n" +
	"- **Steal**: the share of the machine's CPU time that the hypervisor gave to other guests while the row (with its references) ran, from /proc/stat; a figure measured under steal is lower, or slower, than the same code gets on an idle host.\n" +
	"- **Result**: PASS when every target of the row is met, MISS when one is not, ERROR when the row could not be measured, — when the row has no target of its own.\n" +
	"- **Reason**: for a MISS, which target missed and by how much, as measured; for an ERROR, what went wrong; then, in a sentence or two, why the row is tuned as it is or what bounds it. The measurements behind that, and what was tried without gain, are in the hand-written [benchmark-notes.md](" + notesFile + "), linked from the row's section below.\n\n"
