package loadgen

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/bits"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Result is the outcome of a run; its JSON form is what --json writes.
type Result struct {
	Mode      string  `json:"mode"`
	URL       string  `json:"url"`
	Prefix    string  `json:"prefix"`
	Writers   int     `json:"writers"`
	Streams   int     `json:"streams"`
	Size      int     `json:"size"`
	Rate      float64 `json:"rate"`
	DurationS float64 `json:"duration_s"`

	Ops          int64    `json:"ops"`
	OpsPerS      float64  `json:"ops_per_s"`
	Bytes        int64    `json:"bytes"`
	MBPerS       float64  `json:"mb_per_s"` // MiB (2^20 bytes) per second
	Errors       int64    `json:"errors"`
	ErrorSamples []string `json:"error_samples"`
	// Warnings say why the figures may not be what they seem.
	Warnings []string `json:"warnings"`
	// Failure is the error that ended the run before it finished (its end
	// mark refused, a --pid process gone): the figures are then partial.
	Failure string  `json:"failure,omitempty"`
	Latency Latency `json:"latency_ms"`

	Processes []Process `json:"processes"`

	Subscribers int   `json:"subscribers"`
	Delivered   int64 `json:"delivered"`
	Expected    int64 `json:"expected"`
	Lost        int64 `json:"lost"`
	// AppendLatency is the sse writer's append latency (latency_ms is
	// delivery there).
	AppendLatency *Latency `json:"append_latency_ms,omitempty"`

	OK         int64 `json:"ok"`
	Mismatched int64 `json:"mismatched"`

	// Read mode.
	Stream   string `json:"stream"` // the stream read ("" in other modes)
	Readers  int    `json:"readers"`
	Requests int64  `json:"requests"`
}

// Latency holds percentiles in milliseconds.
type Latency struct {
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
	P999 float64 `json:"p999"`
	Max  float64 `json:"max"`
}

// Process is the resource use of one process over the measured window.
type Process struct {
	Name       string  `json:"name"`
	PID        int     `json:"pid"`
	CPUS       float64 `json:"cpu_s"`        // utime+stime used during the window
	RSSMiB     float64 `json:"rss_mib"`      // VmRSS at the end of the window
	PeakRSSMiB float64 `json:"peak_rss_mib"` // the largest VmRSS sampled (once a second) during the window
	// MinorFaults counts the minor page faults taken during the window:
	// first touches of fresh memory, each a trip into the kernel.
	MinorFaults uint64 `json:"minor_faults"`
}

// Check says whether the run did what it was for: a verify run fails on
// any mismatched or unreadable stream, and a run of any mode fails when
// errors left it nothing to measure (no operation succeeded, or in sse
// mode no record reached any subscriber). Errors in a run that measured
// something are figures of the run, not a failure of it.
func (r *Result) Check() error {
	switch {
	case r.Mode == ModeVerify && (r.Mismatched > 0 || r.Errors > 0):
		return fmt.Errorf("verify failed: %d of %d streams mismatched, %d could not be read", r.Mismatched, r.Streams, r.Errors)
	case r.Errors > 0 && r.Ops == 0:
		return fmt.Errorf("no operation succeeded (errors: %d)", r.Errors)
	case r.Mode == ModeSSE && r.Errors > 0 && r.Expected > 0 && r.Delivered == 0:
		return fmt.Errorf("no subscriber received a record (errors: %d)", r.Errors)
	}
	return nil
}

// WriteJSON writes r as indented JSON.
func (r *Result) WriteJSON(w io.Writer) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}

// WriteSummary writes a human summary of r.
func (r *Result) WriteSummary(w io.Writer) {
	var b strings.Builder
	fmt.Fprintf(&b, "mode %s  url %s", r.Mode, r.URL)
	switch r.Mode {
	case ModeRead:
		fmt.Fprintf(&b, "  stream %s  readers %d\n", r.Stream, r.Readers)
	case ModePopulate, ModeVerify:
		fmt.Fprintf(&b, "  prefix %s  workers %d  streams %d  size %d\n", r.Prefix, r.Writers, r.Streams, r.Size)
	case ModeSSE:
		fmt.Fprintf(&b, "  stream %s0  subscribers %d  rate %g/s  size %d\n", r.Prefix, r.Subscribers, r.Rate, r.Size)
	default:
		fmt.Fprintf(&b, "  prefix %s  writers %d  streams %d  size %d  rate %s\n", r.Prefix, r.Writers, r.Streams, r.Size, rateString(r.Rate))
	}
	what := map[string]string{ModeAppend: "appends", ModeSSE: "appends", ModeRead: "GETs", ModePopulate: "streams", ModeVerify: "streams"}[r.Mode]
	fmt.Fprintf(&b, "%-10s %d %s in %.2fs: %.1f/s, %.2f MB/s (MiB)\n", "ops", r.Ops, what, r.DurationS, r.OpsPerS, r.MBPerS)
	lname := map[string]string{ModeSSE: "delivery", ModeRead: "per GET", ModePopulate: "per create", ModeVerify: "per read"}[r.Mode]
	if lname == "" {
		lname = "per append"
	}
	fmt.Fprintf(&b, "%-10s p50 %.3f  p90 %.3f  p99 %.3f  p999 %.3f  max %.3f ms (%s)\n", "latency",
		r.Latency.P50, r.Latency.P90, r.Latency.P99, r.Latency.P999, r.Latency.Max, lname)
	if r.AppendLatency != nil {
		fmt.Fprintf(&b, "%-10s p50 %.3f  p90 %.3f  p99 %.3f  p999 %.3f  max %.3f ms (per append)\n", "",
			r.AppendLatency.P50, r.AppendLatency.P90, r.AppendLatency.P99, r.AppendLatency.P999, r.AppendLatency.Max)
	}
	if r.Mode == ModeSSE {
		fmt.Fprintf(&b, "%-10s %d of %d expected (%d subscribers), lost %d\n", "delivered", r.Delivered, r.Expected, r.Subscribers, r.Lost)
	}
	if r.Mode == ModeRead {
		fmt.Fprintf(&b, "%-10s %d bytes in %d GETs\n", "read", r.Bytes, r.Requests)
	}
	if r.Mode == ModeVerify {
		fmt.Fprintf(&b, "%-10s ok %d  mismatched %d\n", "verify", r.OK, r.Mismatched)
	}
	fmt.Fprintf(&b, "%-10s %d\n", "errors", r.Errors)
	// Labelled, since verify's mismatches are among them: under a bare
	// "errors 0" they read as errors that were not counted.
	for i, s := range r.ErrorSamples {
		label := ""
		if i == 0 {
			label = "samples"
		}
		fmt.Fprintf(&b, "%-10s %s\n", label, s)
	}
	for _, w := range r.Warnings {
		fmt.Fprintf(&b, "%-10s %s\n", "warning", w)
	}
	for _, p := range r.Processes {
		fmt.Fprintf(&b, "%-10s pid %d  cpu %.2fs (%.0f%% of one core)  rss %.1f MiB  peak %.1f MiB  page faults %d\n",
			p.Name, p.PID, p.CPUS, 100*p.CPUS/math.Max(r.DurationS, 1e-9), p.RSSMiB, p.PeakRSSMiB, p.MinorFaults)
	}
	io.WriteString(w, b.String())
}

func rateString(r float64) string {
	if r == 0 {
		return "closed loop"
	}
	return fmt.Sprintf("%g/s", r)
}

// Percentile returns the nearest-rank p-th percentile (0 < p <= 100) of
// sorted: the smallest value with at least p% of the values at or below it.
// It returns 0 for no values.
func Percentile(sorted []float64, p float64) float64 {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	// The epsilon keeps float error (99.9/100*1000 is 999.0000000000001)
	// from moving the rank up by one.
	rank := int(math.Ceil(p/100*float64(n) - 1e-9))
	rank = min(max(rank, 1), n)
	return sorted[rank-1]
}

// latencyOf sorts the samples (nanoseconds) and returns their percentiles
// in milliseconds.
func latencyOf(samples []int64) Latency {
	if len(samples) == 0 {
		return Latency{}
	}
	slices.Sort(samples)
	ms := make([]float64, len(samples))
	for i, v := range samples {
		ms[i] = float64(v) / 1e6
	}
	return Latency{
		P50:  Percentile(ms, 50),
		P90:  Percentile(ms, 90),
		P99:  Percentile(ms, 99),
		P999: Percentile(ms, 99.9),
		Max:  ms[len(ms)-1],
	}
}

// errorSamples keeps the first few distinct error messages.
type errorSamples struct {
	mu   sync.Mutex
	msgs []string
}

const maxErrorSamples = 5

func (e *errorSamples) add(msg string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.msgs) >= maxErrorSamples || slices.Contains(e.msgs, msg) {
		return
	}
	e.msgs = append(e.msgs, msg)
}

func (e *errorSamples) list() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string{}, e.msgs...)
}

// histogram is a lock-free log-linear latency histogram for the progress
// line (the summary uses every sample): 16 buckets per power of two, so a
// value is known within about 6%.
type histogram struct {
	counts [len(histCounts{})]atomic.Int64
}

func histBucket(ns int64) int {
	if ns < 16 {
		return int(max(ns, 0))
	}
	e := bits.Len64(uint64(ns)) - 1 // 4..62
	m := (ns >> (e - 4)) & 15       // the 4 bits after the leading one
	return (e-3)*16 + int(m)
}

// histUpper is the upper edge of bucket b.
func histUpper(b int) int64 {
	if b < 16 {
		return int64(b)
	}
	e := b/16 + 3
	m := int64(b % 16)
	return (16 + m + 1) << (e - 4)
}

func (h *histogram) record(d time.Duration) { h.counts[histBucket(int64(d))].Add(1) }

// histCounts is a copy of a histogram's counts at one moment.
type histCounts [64 * 16]int64

// quantile returns the upper edge of the bucket holding the q-th quantile
// (0 < q <= 1), or 0 with no samples.
func (h *histogram) quantile(q float64) time.Duration {
	var snap histCounts
	for i := range h.counts {
		snap[i] = h.counts[i].Load()
	}
	return snap.quantile(q)
}

// quantileSince returns the q-th quantile of the samples recorded since
// the counts in prev, and sets prev to the counts now; ok is false when
// there were none. The progress line shows the latency of its last
// interval with it, not of the whole run so far.
func (h *histogram) quantileSince(prev *histCounts, q float64) (d time.Duration, ok bool) {
	var delta histCounts
	var n int64
	for i := range h.counts {
		c := h.counts[i].Load()
		delta[i] = c - prev[i]
		prev[i] = c
		n += delta[i]
	}
	if n == 0 {
		return 0, false
	}
	return delta.quantile(q), true
}

// quantile returns the upper edge of the bucket holding the q-th quantile
// (0 < q <= 1) of the counts, or 0 with none.
func (snap *histCounts) quantile(q float64) time.Duration {
	var total int64
	for _, c := range snap {
		total += c
	}
	if total == 0 {
		return 0
	}
	rank := int64(math.Ceil(q * float64(total)))
	var seen int64
	for i, c := range snap {
		seen += c
		if seen >= rank {
			return time.Duration(histUpper(i))
		}
	}
	return time.Duration(histUpper(len(snap) - 1))
}
