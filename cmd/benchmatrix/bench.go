//go:build linux

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"
)

// benchSpec is one run of the load generator, `caddy picomq bench`.
type benchSpec struct {
	URL         string
	Prefix      string
	Mode        string // append, sse, read, populate, verify
	Writers     int
	Streams     int
	Size        int
	Duration    time.Duration
	Warmup      time.Duration
	Rate        float64
	Subscribers int
	Stream      string
	Readers     int
	Timeout     time.Duration
	ContentType string
	NoCreate    bool // --create=false: the streams exist already
	Pids        map[string]int
	Mark        string
	JSON        string
}

// args renders the spec as the load generator's flags, in a fixed order so
// that commands in the report are stable.
func (s benchSpec) args() []string {
	a := []string{"picomq", "bench", "--mode", s.Mode, "--url", s.URL}
	if s.Prefix != "" {
		a = append(a, "--prefix", s.Prefix)
	}
	if s.Stream != "" {
		a = append(a, "--stream", s.Stream)
	}
	if s.Writers > 0 {
		a = append(a, "--writers", strconv.Itoa(s.Writers))
	}
	if s.Streams > 0 {
		a = append(a, "--streams", strconv.Itoa(s.Streams))
	}
	if s.Readers > 0 {
		a = append(a, "--readers", strconv.Itoa(s.Readers))
	}
	if s.Subscribers > 0 {
		a = append(a, "--subscribers", strconv.Itoa(s.Subscribers))
	}
	if s.Size > 0 {
		a = append(a, "--size", strconv.Itoa(s.Size))
	}
	if s.Rate > 0 {
		a = append(a, "--rate", strconv.FormatFloat(s.Rate, 'f', -1, 64))
	}
	if s.ContentType != "" {
		a = append(a, "--content-type", s.ContentType)
	}
	if s.NoCreate {
		a = append(a, "--create=false")
	}
	if s.Warmup > 0 {
		a = append(a, "--warmup", s.Warmup.String())
	}
	if s.Duration > 0 {
		a = append(a, "--duration", s.Duration.String())
	}
	if s.Timeout > 0 {
		a = append(a, "--timeout", s.Timeout.String())
	}
	names := make([]string, 0, len(s.Pids))
	for n := range s.Pids {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		a = append(a, "--pid", fmt.Sprintf("%s=%d", n, s.Pids[n]))
	}
	if s.Mark != "" {
		a = append(a, "--mark", s.Mark)
	}
	if s.JSON != "" {
		a = append(a, "--json", s.JSON)
	}
	return a
}

// commandLine is the spec as a shell command, with "caddy" for the binary
// the matrix built and the JSON file named by its base name.
func (s benchSpec) commandLine() string {
	if s.JSON != "" {
		s.JSON = filepath.Base(s.JSON)
	}
	parts := []string{"caddy"}
	for _, a := range s.args() {
		parts = append(parts, shellQuote(a))
	}
	return strings.Join(parts, " ")
}

func shellQuote(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_./:=,@+%", r))
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// num is a JSON number that also accepts a boolean (true = 1), a numeric
// string or null, so that the report does not depend on such details of
// the load generator's output.
type num float64

func (n *num) UnmarshalJSON(b []byte) error {
	s := strings.TrimSpace(string(b))
	switch s {
	case "null", "":
		*n = 0
		return nil
	case "true":
		*n = 1
		return nil
	case "false":
		*n = 0
		return nil
	}
	s = strings.Trim(s, `"`)
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return fmt.Errorf("not a number: %s", b)
	}
	*n = num(f)
	return nil
}

// benchResult is the load generator's JSON result.
type benchResult struct {
	Mode         string   `json:"mode"`
	URL          string   `json:"url"`
	Writers      num      `json:"writers"`
	Streams      num      `json:"streams"`
	Size         num      `json:"size"`
	Rate         num      `json:"rate"`
	DurationS    num      `json:"duration_s"`
	Ops          num      `json:"ops"`
	OpsPerS      num      `json:"ops_per_s"`
	Bytes        num      `json:"bytes"`
	MBPerS       num      `json:"mb_per_s"`
	Errors       num      `json:"errors"`
	ErrorSamples []string `json:"error_samples"`
	Latency      struct {
		P50  num `json:"p50"`
		P90  num `json:"p90"`
		P99  num `json:"p99"`
		P999 num `json:"p999"`
		Max  num `json:"max"`
	} `json:"latency_ms"`
	Processes []struct {
		Name       string `json:"name"`
		PID        num    `json:"pid"`
		CPUS       num    `json:"cpu_s"`
		RSSMiB     num    `json:"rss_mib"`
		PeakRSSMiB num    `json:"peak_rss_mib"`
		Faults     num    `json:"minor_faults"`
	} `json:"processes"`
	Subscribers num `json:"subscribers"`
	Delivered   num `json:"delivered"`
	Expected    num `json:"expected"`
	Lost        num `json:"lost"`
	OK          num `json:"ok"`
	Mismatched  num `json:"mismatched"`
	// Failure is the error that ended the run early: its figures are
	// partial, and the matrix reports the error instead.
	Failure string `json:"failure"`
}

// mibPerS is the bandwidth of the run in MiB/s, from bytes and duration (so
// that it does not depend on which megabyte the generator prints).
func (r *benchResult) mibPerS() float64 {
	if r.DurationS <= 0 {
		return 0
	}
	return float64(r.Bytes) / float64(r.DurationS) / (1 << 20)
}

// process returns the figures of the named process, if reported.
func (r *benchResult) process(name string) (cpu, rss, peak float64, ok bool) {
	for _, p := range r.Processes {
		if p.Name == name {
			return float64(p.CPUS), float64(p.RSSMiB), float64(p.PeakRSSMiB), true
		}
	}
	return 0, 0, 0, false
}

func parseBenchResult(b []byte) (*benchResult, error) {
	var r benchResult
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, err
	}
	if r.Failure != "" {
		return nil, fmt.Errorf("the run failed: %s", r.Failure)
	}
	return &r, nil
}

// runBench runs the load generator to completion and reads its result. The
// spec's JSON file is placed in the work directory under name.
func (m *matrix) runBench(ctx context.Context, name string, s benchSpec) (*benchResult, string, error) {
	p, s, err := m.startBench(name, s)
	if err != nil {
		return nil, s.commandLine(), err
	}
	select {
	case <-p.done:
	case <-ctx.Done():
		p.kill()
		return nil, s.commandLine(), ctx.Err()
	}
	return m.benchOutcome(name, p, s)
}

// startBench starts the load generator in the background.
func (m *matrix) startBench(name string, s benchSpec) (*proc, benchSpec, error) {
	s.JSON = filepath.Join(m.work, name+".json")
	os.Remove(s.JSON)
	logf, err := os.Create(filepath.Join(m.work, name+".log"))
	if err != nil {
		return nil, s, err
	}
	defer logf.Close()
	m.logf("  $ %s", s.commandLine())
	cmd := exec.Command(m.caddyBin, s.args()...)
	cmd.Dir = m.work
	cmd.Stdout = logf
	cmd.Stderr = logf
	p, err := m.startProc("bench "+name, cmd)
	return p, s, err
}

// benchOutcome reads the result of a finished bench process.
func (m *matrix) benchOutcome(name string, p *proc, s benchSpec) (*benchResult, string, error) {
	cl := s.commandLine()
	b, rerr := os.ReadFile(s.JSON)
	if werr := p.err(); werr != nil && rerr != nil {
		log, _ := os.ReadFile(filepath.Join(m.work, name+".log"))
		return nil, cl, fmt.Errorf("bench %s: %v: %s", name, werr, lastLines(string(log), 6))
	}
	if rerr != nil {
		return nil, cl, fmt.Errorf("bench %s wrote no result: %v", name, rerr)
	}
	r, err := parseBenchResult(b)
	if err != nil {
		return nil, cl, fmt.Errorf("bench %s: result %s: %v", name, s.JSON, err)
	}
	return r, cl, nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.TrimSpace(strings.Join(lines, " | "))
}

// benchSummary is a one-line account of a result for the progress output.
func benchSummary(r *benchResult) string {
	var b bytes.Buffer
	switch r.Mode {
	case "sse":
		fmt.Fprintf(&b, "%d/%d delivered, lost %d, p99 %s ms", int64(r.Delivered), int64(r.Expected), int64(r.Lost), fmtNum(float64(r.Latency.P99)))
	case "verify", "populate":
		fmt.Fprintf(&b, "%d ops, ok %d, mismatched %d, errors %d", int64(r.Ops), int64(r.OK), int64(r.Mismatched), int64(r.Errors))
	default:
		fmt.Fprintf(&b, "%s ops/s, %.1f MiB/s, p50 %s ms, p99 %s ms, errors %d", fmtInt(float64(r.OpsPerS)), r.mibPerS(),
			fmtNum(float64(r.Latency.P50)), fmtNum(float64(r.Latency.P99)), int64(r.Errors))
	}
	if _, rss, peak, ok := r.process("caddy"); ok {
		fmt.Fprintf(&b, ", caddy rss %.0f MiB (peak %.0f)", rss, peak)
	}
	return b.String()
}
