//go:build linux

// Command benchmatrix runs the benchmark matrix of docs/benchmarks.md in one
// go and rewrites that file and its chart (Linux only: it reads the
// processes' figures from /proc). It builds ./cmd/caddy, starts versitygw,
// puts the test suite's S3 proxy between every PicoMQ Caddy and versitygw
// (its counts are the table's S3 requests), starts the respond
// ceiling and the Node reference server, and drives every row with the load
// generator `caddy picomq bench`. Run it through bench/run, which raises the
// open-file limit first:
//
//	bench/run                 # the whole matrix
//	bench/run -rows 1 -quick  # a smoke run of row 1
//
// It is not part of the test command.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// matrix is one run of the matrix: the shared services and what was
// measured so far.
type matrix struct {
	root     string // repository root
	work     string // temporary work directory
	caddyBin string
	sc       scale
	quick    bool

	versity    *testenv.Versity
	versityDir string // versitygw's posix root: a bucket is a directory in it
	ctrl       *control

	mu    sync.Mutex
	procs []*proc

	rows      []*rowResult
	sweep     []sweepPoint
	sweepCmds []string
	ceiling   *caddyInst
	buckets   int
	// row1Ceiling is row 1's reference, reused by the Node row.
	row1Ceiling *benchResult
}

func (m *matrix) logf(format string, args ...any) {
	fmt.Printf("%s %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}

func main() {
	rowsFlag := flag.String("rows", "", "comma-separated rows to run (1-9, sweep); empty runs all")
	quick := flag.Bool("quick", false, "short windows and small sizes: a smoke run, not the issue's matrix")
	out := flag.String("out", "docs/benchmarks.md", "the Markdown report to write; the chart goes beside it as .svg")
	keep := flag.Bool("keep", false, "keep the work directory (Caddyfiles, logs, bench JSON)")
	caddyBin := flag.String("caddy", "", "a prebuilt Caddy binary with the module (default: go build ./cmd/caddy)")
	s3dir := flag.String("s3dir", "auto", "where versitygw keeps its buckets: auto (tmpfs /dev/shm when it has room, else the work directory), disk (the work directory), or a directory")
	flag.Parse()

	selected, err := parseRows(*rowsFlag)
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchmatrix:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, selected, *rowsFlag, *quick, *out, *keep, *caddyBin, *s3dir)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, selected []string, rowsFlag string, quick bool, out string, keep bool, caddyBin, s3dir string) int {
	start := time.Now()
	root, err := repoRoot()
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchmatrix:", err)
		return 1
	}
	if !filepath.IsAbs(out) {
		out = filepath.Join(root, out)
	}
	work, err := os.MkdirTemp("", "picomq-benchmatrix-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchmatrix:", err)
		return 1
	}
	m := &matrix{root: root, work: work, sc: fullScale, quick: quick}
	if quick {
		m.sc = quickScale
	}
	nofile := raiseNoFile()
	loadStart := loadAvg()
	cpuStart, cpuOK := readCPUTimes()
	// The commit is the one the Caddy binary is built from: taken now, not
	// when the report is written, since work may land during a long run.
	mi := machine(ctx, root)
	// Whatever happens below, every child goes.
	defer func() {
		m.killAll()
		if m.versity != nil {
			m.versity.Stop()
		}
		if m.ctrl != nil {
			m.ctrl.close()
		}
		if keep {
			m.logf("work directory kept: %s", work)
		} else {
			os.RemoveAll(work)
		}
	}()
	m.logf("benchmatrix: rows %s%s, work directory %s, open-file limit %d", strings.Join(selected, ","), map[bool]string{true: " (quick)"}[quick], work, nofile)
	if l, err := strconv.ParseFloat(loadStart, 64); err == nil && l > float64(runtime.NumCPU()) {
		m.logf("warning: load average %s on %d cores: other work on the machine will skew the figures", loadStart, runtime.NumCPU())
	}

	if caddyBin != "" {
		m.caddyBin, _ = filepath.Abs(caddyBin)
	} else {
		m.logf("building ./cmd/caddy")
		m.caddyBin = filepath.Join(work, "caddy")
		cmd := exec.CommandContext(ctx, "go", "build", "-o", m.caddyBin, "./cmd/caddy")
		cmd.Dir = root
		if b, err := cmd.CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "benchmatrix: go build ./cmd/caddy: %v\n%s", err, b)
			return 1
		}
	}
	if err := checkBench(ctx, m.caddyBin); err != nil {
		fmt.Fprintln(os.Stderr, "benchmatrix:", err)
		return 1
	}

	dir, where, err := versityDir(s3dir, work)
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchmatrix:", err)
		return 1
	}
	if dir != filepath.Join(work, "versity") {
		defer os.RemoveAll(dir)
	}
	m.versityDir, mi.VersityDir = dir, where
	m.logf("starting versitygw on %s (%s)", dir, where)
	m.versity, err = testenv.StartVersity(ctx, dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchmatrix: versitygw:", err)
		return 1
	}
	m.ctrl, err = newControl()
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchmatrix: control endpoint:", err)
		return 1
	}
	m.logf("versitygw %s on %s; proxy control endpoint %s", testenv.VersityVersion, m.versity.Endpoint, m.ctrl.url)

	for _, def := range rowDefs {
		if !contains(selected, def.key) {
			continue
		}
		if ctx.Err() != nil {
			break
		}
		m.logf("== row %s: %s", def.key, def.title)
		m.settle()
		t0 := time.Now()
		c0, ok0 := readCPUTimes()
		n := len(m.rows)
		def.run(m, ctx)
		c1, ok1 := readCPUTimes()
		for _, r := range m.rows[n:] {
			if r.Elapsed == 0 {
				r.Elapsed = time.Since(t0)
			}
			if ok0 && ok1 {
				r.Steal = stealPercent(c0, c1)
			}
			v, reason := r.verdict()
			m.logf("   row %s: %s %s %s (steal %s)", r.ID, v, r.Measured, reason, fmtSteal(r.Steal))
		}
	}
	if m.ceiling != nil {
		m.ceiling.close()
	}
	if ctx.Err() != nil {
		m.logf("interrupted; not writing %s", out)
		return 130
	}

	rep := &report{Rows: m.rows, Sweep: m.sweep, SweepCommands: m.sweepCmds, Scale: m.sc}
	rep.Machine = mi
	rep.Machine.NoFile = nofile
	rep.Machine.LoadStart, rep.Machine.LoadEnd = loadStart, loadAvg()
	rep.Machine.Steal = math.NaN()
	if cpuEnd, ok := readCPUTimes(); ok && cpuOK {
		rep.Machine.Steal = stealPercent(cpuStart, cpuEnd)
	}
	rep.Machine.Duration = time.Since(start)
	rep.Machine.Quick = quick
	if rowsFlag != "" {
		rep.Machine.Rows = strings.Join(selected, ", ")
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		fmt.Fprintln(os.Stderr, "benchmatrix:", err)
		return 1
	}
	if len(m.sweep) > 0 {
		svg := strings.TrimSuffix(out, ".md") + ".svg"
		title := "PicoMQ appends vs the respond ceiling, " + rep.Machine.cpuShort()
		if err := os.WriteFile(svg, []byte(chartSVG(m.sweep, title)), 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "benchmatrix:", err)
			return 1
		}
		rep.Chart = filepath.Base(svg)
		m.logf("wrote %s", svg)
	}
	if err := os.WriteFile(out, []byte(rep.markdown()), 0o644); err != nil {
		fmt.Fprintln(os.Stderr, "benchmatrix:", err)
		return 1
	}
	m.logf("wrote %s; the matrix took %s", out, time.Since(start).Round(time.Second))
	failed := 0
	for _, r := range m.rows {
		if v, _ := r.verdict(); v == "ERROR" {
			failed++
		}
	}
	if failed > 0 {
		m.logf("%d row(s) could not be measured (ERROR)", failed)
		return 1
	}
	return 0
}

// checkBench makes sure the binary has the load generator.
func checkBench(ctx context.Context, bin string) error {
	cmd := exec.CommandContext(ctx, bin, "picomq", "bench", "--help")
	out, err := cmd.CombinedOutput()
	if err != nil && !strings.Contains(string(out), "--writers") && !strings.Contains(string(out), "-writers") {
		return fmt.Errorf("%s has no working `picomq bench` subcommand: %v\n%s", bin, err, lastLines(string(out), 10))
	}
	return nil
}

// parseRows turns "1,2,5" into the row keys to run, in matrix order.
func parseRows(s string) ([]string, error) {
	var all []string
	for _, d := range rowDefs {
		all = append(all, d.key)
	}
	if strings.TrimSpace(s) == "" {
		return all, nil
	}
	want := map[string]bool{}
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		if !contains(all, f) {
			return nil, fmt.Errorf("unknown row %q (rows: %s)", f, strings.Join(all, ","))
		}
		want[f] = true
	}
	var out []string
	for _, k := range all {
		if want[k] {
			out = append(out, k)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("-rows selects nothing")
	}
	return out, nil
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

// raiseNoFile lifts the soft open-file limit to the hard one; bench/run does
// it too, this covers `go run ./cmd/benchmatrix` on its own. Children
// inherit it.
func raiseNoFile() uint64 {
	var r syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &r); err != nil {
		return 0
	}
	if r.Cur < r.Max {
		r.Cur = r.Max
		syscall.Setrlimit(syscall.RLIMIT_NOFILE, &r)
		syscall.Getrlimit(syscall.RLIMIT_NOFILE, &r)
	}
	return r.Cur
}

func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && strings.Contains(string(b), "module github.com/picomq/caddy-picomq") {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("run benchmatrix inside the caddy-picomq repository")
		}
		dir = parent
	}
}

// settle writes back what the page cache holds for the disk before a
// measurement, so that no measurement pays for the writeback of what an
// earlier one wrote (kept data, which the kernel flushes in the background
// once it passes its dirty-page threshold, slowing whoever runs then).
func (m *matrix) settle() {
	t := time.Now()
	syscall.Sync()
	if d := time.Since(t); d > time.Second {
		m.logf("  flushed the page cache to disk in %s", d.Round(100*time.Millisecond))
	}
}

// tmpfsMagic is statfs's f_type of a tmpfs.
const tmpfsMagic = 0x01021994

// versityDir picks the directory versitygw keeps its buckets in, and says
// where that is for the report. The default is a tmpfs when one has room:
// on this project's 2-core machine the disk is ext4 without a journal,
// whose inode allocator skips every inode freed in the last minute, and a
// bucket whose WAL objects are created and deleted a few hundred times a
// second made versitygw spend a quarter of its CPU in that scan
// (recently_deleted); row 4's load ran 25-40% faster on a tmpfs. That is a
// cost of the stand-in's file system, not of an object store, so the
// matrix keeps it out of every row and every reference alike; "disk" puts
// it back.
func versityDir(choice, work string) (dir, where string, err error) {
	onDisk := filepath.Join(work, "versity")
	switch choice {
	case "disk":
		return onDisk, "posix backend on the work directory's disk", nil
	case "auto", "":
		var st syscall.Statfs_t
		const room = 8 << 30 // row 5 and its reference write a few GiB
		if err := syscall.Statfs("/dev/shm", &st); err != nil || st.Type != tmpfsMagic || st.Bavail*uint64(st.Bsize) < room {
			return onDisk, "posix backend on the work directory's disk (no tmpfs with 8 GiB free at /dev/shm)", nil
		}
		dir, err := os.MkdirTemp("/dev/shm", "picomq-benchmatrix-versity-")
		if err != nil {
			return "", "", fmt.Errorf("versitygw directory: %w", err)
		}
		return dir, "posix backend on tmpfs (/dev/shm)", nil
	default:
		dir, err := filepath.Abs(choice)
		if err != nil {
			return "", "", fmt.Errorf("versitygw directory: %w", err)
		}
		return dir, "posix backend on " + dir, nil
	}
}
