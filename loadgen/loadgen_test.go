package loadgen

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/iotest"
	"time"
)

func TestDiscard(t *testing.T) {
	broken := errors.New("connection reset")
	tests := []struct {
		name    string
		r       io.Reader
		want    int64
		wantErr error
	}{
		{"empty", strings.NewReader(""), 0, nil},
		{"past one buffer", bytes.NewReader(make([]byte, 600<<10+7)), 600<<10 + 7, nil},
		{"a byte at a time", iotest.OneByteReader(strings.NewReader("hello")), 5, nil},
		{"error after data", io.MultiReader(strings.NewReader("abc"), iotest.ErrReader(broken)), 3, broken},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n, err := Discard(tt.r)
			if n != tt.want || !errors.Is(err, tt.wantErr) {
				t.Fatalf("Discard = %d, %v; want %d, %v", n, err, tt.want, tt.wantErr)
			}
		})
	}
}

func TestPercentile(t *testing.T) {
	ten := []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	thousand := make([]float64, 1000)
	for i := range thousand {
		thousand[i] = float64(i + 1)
	}
	tests := []struct {
		name   string
		sorted []float64
		p      float64
		want   float64
	}{
		{"empty", nil, 50, 0},
		{"one value", []float64{7}, 99.9, 7},
		{"median of ten", ten, 50, 5},
		{"p90 of ten", ten, 90, 9},
		{"p91 of ten rounds up", ten, 91, 10},
		{"p100 of ten", ten, 100, 10},
		{"tiny p is the minimum", ten, 0.001, 1},
		{"p99 of 1000", thousand, 99, 990},
		{"p99.9 of 1000", thousand, 99.9, 999},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Percentile(tt.sorted, tt.p); got != tt.want {
				t.Errorf("Percentile(%v, %g) = %g, want %g", tt.sorted, tt.p, got, tt.want)
			}
		})
	}
}

func TestLatencyOf(t *testing.T) {
	samples := []int64{5e6, 1e6, 3e6, 2e6, 4e6} // unsorted, nanoseconds
	got := latencyOf(samples)
	want := Latency{P50: 3, P90: 5, P99: 5, P999: 5, Max: 5}
	if got != want {
		t.Errorf("latencyOf = %+v, want %+v", got, want)
	}
	if (latencyOf(nil) != Latency{}) {
		t.Errorf("latencyOf(nil) is not zero")
	}
}

func TestParseSize(t *testing.T) {
	tests := []struct {
		in      string
		want    int
		wantErr bool
	}{
		{"1024", 1024, false},
		{"0", 0, false},
		{"1KiB", 1024, false},
		{"1kib", 1024, false},
		{"1MiB", 1 << 20, false},
		{"1 MiB", 1 << 20, false},
		{"1.5KiB", 1536, false},
		{"1KB", 1000, false},
		{"2k", 2000, false},
		{"1GiB", 1 << 30, false},
		{"10B", 10, false},
		{"", 0, true},
		{"KiB", 0, true},
		{"1XB", 0, true},
		{"1.3B", 0, true},
		{"-1", 0, true},
		{"1.2.3", 0, true},
		{"2TiB", 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := ParseSize(tt.in)
			if (err != nil) != tt.wantErr || got != tt.want {
				t.Errorf("ParseSize(%q) = %d, %v; want %d, error %v", tt.in, got, err, tt.want, tt.wantErr)
			}
		})
	}
	// An unknown unit's error lists the ones there are: TiB is a unit,
	// just not one the bench takes.
	if _, err := ParseSize("2TiB"); err == nil || !strings.Contains(err.Error(), "(want B, KB, KiB, MB, MiB, GB or GiB)") {
		t.Errorf("ParseSize(2TiB): %v, want the units it takes", err)
	}
}

func TestParsePID(t *testing.T) {
	tests := []struct {
		in      string
		want    NamedPID
		wantErr bool
	}{
		{"caddy=123", NamedPID{"caddy", 123}, false},
		{"a=b=1", NamedPID{}, true},
		{"caddy", NamedPID{}, true},
		{"=5", NamedPID{}, true},
		{"x=0", NamedPID{}, true},
		{"x=-3", NamedPID{}, true},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := ParsePID(tt.in)
			if (err != nil) != tt.wantErr || got != tt.want {
				t.Errorf("ParsePID(%q) = %+v, %v; want %+v, error %v", tt.in, got, err, tt.want, tt.wantErr)
			}
		})
	}
}

func TestRandomPrefix(t *testing.T) {
	a, b := RandomPrefix(), RandomPrefix()
	if !strings.HasPrefix(a, "bench-") || len(a) != len("bench-")+6 {
		t.Errorf("RandomPrefix() = %q", a)
	}
	if a == b {
		t.Errorf("two prefixes are both %q", a)
	}
}

// Every mode's summary has its errors line, the count then the samples,
// labelled as such; read mode's names the stream it read.
func TestResultSummary(t *testing.T) {
	tests := []struct {
		name string
		res  Result
		want []string
	}{
		{"append", Result{Mode: ModeAppend, Errors: 2, ErrorSamples: []string{"500: boom"}},
			[]string{"errors     2\n", "samples    500: boom\n"}},
		{"sse", Result{Mode: ModeSSE, Errors: 3, ErrorSamples: []string{"subscriber: 400: no", "append: 503"}},
			[]string{"errors     3\n", "samples    subscriber: 400: no\n           append: 503\n"}},
		{"read", Result{Mode: ModeRead, Stream: "pop-17", Readers: 4, Errors: 4, ErrorSamples: []string{"404: stream not found"}},
			[]string{"stream pop-17  readers 4\n", "errors     4\n", "samples    404: stream not found\n"}},
		{"populate", Result{Mode: ModePopulate, Errors: 1, ErrorSamples: []string{"409: exists"}},
			[]string{"errors     1\n", "samples    409: exists\n"}},
		{"verify", Result{Mode: ModeVerify, Mismatched: 1, ErrorSamples: []string{"pop-1: mismatch: 3 bytes, want 2"}},
			[]string{"mismatched 1\n", "errors     0\n", "samples    pop-1: mismatch"}},
		{"no errors", Result{Mode: ModeVerify, OK: 3},
			[]string{"errors     0\n"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var b bytes.Buffer
			tt.res.WriteSummary(&b)
			for _, want := range tt.want {
				if !strings.Contains(b.String(), want) {
					t.Errorf("the summary lacks %q:\n%s", want, b.String())
				}
			}
			if len(tt.res.ErrorSamples) == 0 && strings.Contains(b.String(), "samples") {
				t.Errorf("samples label without samples:\n%s", b.String())
			}
		})
	}
}

// A result echoes only the settings its mode uses; the others are zero,
// not the command's defaults (64 writers and 100 streams in read mode).
func TestResultLeavesUnusedSettingsZero(t *testing.T) {
	cfg := Config{URL: "http://x/", Prefix: "p-", Writers: 64, Streams: 100, Size: 1024, Rate: 5}
	for _, tt := range []struct {
		mode                 string
		prefix               string
		writers, streams, sz int
		rate                 float64
	}{
		{ModeAppend, "p-", 64, 100, 1024, 5},
		{ModeSSE, "p-", 0, 0, 1024, 5}, // runSSE sets its one writer and stream
		{ModeRead, "", 0, 0, 0, 0},
		{ModePopulate, "p-", 64, 100, 1024, 0},
		{ModeVerify, "p-", 64, 100, 1024, 0},
	} {
		res := (&runner{cfg: cfg}).result(tt.mode)
		if res.Prefix != tt.prefix || res.Writers != tt.writers || res.Streams != tt.streams || res.Size != tt.sz || res.Rate != tt.rate {
			t.Errorf("%s: prefix %q writers %d streams %d size %d rate %g; want %q %d %d %d %g", tt.mode,
				res.Prefix, res.Writers, res.Streams, res.Size, res.Rate, tt.prefix, tt.writers, tt.streams, tt.sz, tt.rate)
		}
	}
}

func TestFlagUsed(t *testing.T) {
	for _, tt := range []struct {
		mode, flag string
		want       bool
	}{
		{ModeRead, "writers", false},
		{ModeRead, "streams", false},
		{ModeRead, "readers", true},
		{ModeRead, "url", true}, // every mode's
		{"", "writers", true},   // empty is append
		{ModeAppend, "stream", false},
		{ModeSSE, "subscribers", true},
		{ModeSSE, "writers", false},
		{ModePopulate, "create", true},
		{ModeVerify, "create", false},
		{ModeVerify, "warmup", false},
	} {
		if got := FlagUsed(tt.mode, tt.flag); got != tt.want {
			t.Errorf("FlagUsed(%q, %q) = %v, want %v", tt.mode, tt.flag, got, tt.want)
		}
	}
}

// TestResultJSONShape pins the field names the matrix script reads.
func TestResultJSONShape(t *testing.T) {
	var buf bytes.Buffer
	res := (&runner{cfg: Config{URL: "http://x/", Prefix: "p-", Writers: 2, Streams: 3, Size: 4}}).result(ModeAppend)
	res.finish()
	if err := res.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(buf.Bytes(), &m); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, buf.String())
	}
	for _, k := range []string{"mode", "url", "writers", "streams", "size", "rate", "duration_s", "ops", "ops_per_s",
		"bytes", "mb_per_s", "errors", "error_samples", "warnings", "latency_ms", "processes", "subscribers", "delivered",
		"expected", "lost", "ok", "mismatched", "stream", "readers", "requests"} {
		if _, ok := m[k]; !ok {
			t.Errorf("JSON has no %q: %s", k, buf.String())
		}
	}
	if string(m["error_samples"]) != "[]" || string(m["processes"]) != "[]" || string(m["warnings"]) != "[]" {
		t.Errorf("empty lists must be [], got error_samples %s, processes %s", m["error_samples"], m["processes"])
	}
	var lat map[string]float64
	if err := json.Unmarshal(m["latency_ms"], &lat); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"p50", "p90", "p99", "p999", "max"} {
		if _, ok := lat[k]; !ok {
			t.Errorf("latency_ms has no %q", k)
		}
	}
	p, _ := json.Marshal(Process{Name: "caddy", PID: 1, CPUS: 1.5, RSSMiB: 2, PeakRSSMiB: 3, MinorFaults: 4})
	if want := `{"name":"caddy","pid":1,"cpu_s":1.5,"rss_mib":2,"peak_rss_mib":3,"minor_faults":4}`; string(p) != want {
		t.Errorf("process JSON = %s, want %s", p, want)
	}
}

func TestProcOwn(t *testing.T) {
	pid := os.Getpid()
	before, err := ProcCPU(pid)
	if err != nil {
		t.Fatal(err)
	}
	// Burn 300ms of CPU by the kernel's own account (getrusage), however
	// busy the machine, and compare /proc's figure with it: they count the
	// same ticks, so they may differ by a tick or two per thread at most.
	ru0 := rusageCPU(t)
	for deadline := time.Now().Add(20 * time.Second); rusageCPU(t)-ru0 < 300*time.Millisecond && time.Now().Before(deadline); {
		for i := 0; i < 1e6; i++ {
			sink += i
		}
	}
	after, err := ProcCPU(pid)
	ru1 := rusageCPU(t)
	if err != nil {
		t.Fatal(err)
	}
	if d, want := after-before, ru1-ru0; d < want-100*time.Millisecond || d > want+100*time.Millisecond {
		t.Errorf("/proc/%d/stat says %s of CPU, getrusage %s", pid, d, want)
	}
	rss, err := ProcRSS(pid)
	if err != nil {
		t.Fatal(err)
	}
	if rss < 1<<20 || rss > 1<<40 {
		t.Errorf("own RSS %d bytes is implausible", rss)
	}
	if _, err := ProcCPU(1 << 30); err == nil {
		t.Errorf("ProcCPU of a pid that cannot exist did not fail")
	}
	if _, err := startProcWatch([]NamedPID{{"ghost", 1 << 30}}); err == nil {
		t.Errorf("watching a pid that cannot exist did not fail")
	}
	w, err := startProcWatch([]NamedPID{{"me", pid}})
	if err != nil {
		t.Fatal(err)
	}
	// Touch 8 MiB of freshly mapped memory: a minor fault per 4 KiB page
	// at least, which the watch must count.
	const fresh = 8 << 20
	mem, err := syscall.Mmap(-1, 0, fresh, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(mem)
	for i := 0; i < fresh; i += 4096 {
		mem[i] = 1
	}
	procs, err := w.finish()
	if err != nil || len(procs) != 1 || procs[0].RSSMiB <= 0 || procs[0].PeakRSSMiB <= 0 || procs[0].PID != pid {
		t.Errorf("finish = %+v, %v", procs, err)
	}
	if len(procs) == 1 && procs[0].MinorFaults < fresh/4096 {
		t.Errorf("%d minor page faults counted after touching %d fresh pages", procs[0].MinorFaults, fresh/4096)
	}
}

var sink int

// The peak RSS is never below the RSS at the end, however the process
// grows between the samples and the final read.
func TestProcWatchPeakCoversEnd(t *testing.T) {
	var mu sync.Mutex
	var reads int64
	growing := func(int) (int64, error) { // 1 MiB more on every read
		mu.Lock()
		defer mu.Unlock()
		reads++
		return reads << 20, nil
	}
	w, err := startProcWatchRSS([]NamedPID{{"me", os.Getpid()}}, growing)
	if err != nil {
		t.Fatal(err)
	}
	procs, err := w.finish()
	if err != nil || len(procs) != 1 {
		t.Fatalf("finish = %+v, %v", procs, err)
	}
	if p := procs[0]; p.PeakRSSMiB < p.RSSMiB {
		t.Errorf("peak RSS %.0f MiB is below the RSS at the end, %.0f MiB", p.PeakRSSMiB, p.RSSMiB)
	}
}

// rusageCPU is this process's user + system time by getrusage.
func rusageCPU(t *testing.T) time.Duration {
	t.Helper()
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func TestHistogram(t *testing.T) {
	var h histogram
	if h.quantile(0.99) != 0 {
		t.Errorf("empty histogram has a p99")
	}
	for i := 1; i <= 1000; i++ {
		h.record(time.Duration(i) * time.Microsecond)
	}
	for _, tt := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 500 * time.Microsecond}, {0.99, 990 * time.Microsecond}, {1, time.Millisecond}} {
		got := h.quantile(tt.q)
		if got < tt.want || float64(got) > float64(tt.want)*1.07 {
			t.Errorf("quantile(%g) = %s, want %s within 7%% above", tt.q, got, tt.want)
		}
	}
}

// The progress line's p99 is of its last interval: after a slow warm-up,
// a line over fast answers shows them, not the warm-up's tail; a line
// over no answers shows none.
func TestProgressLineP99IsOfTheLastInterval(t *testing.T) {
	r := &runner{}
	var p progressState
	for _, tt := range []struct {
		name    string
		samples int
		lat     time.Duration
		want    string // the p99 past "p99 (last 1s) ": a bucket edge, within 6% above
	}{
		{"slow warm-up", 1000, 100 * time.Millisecond, "100.66ms"},
		{"fast window", 200, time.Millisecond, "1.02ms"},
		{"nothing answered", 0, 0, "-"},
		{"fast again", 10, time.Millisecond, "1.02ms"},
	} {
		for range tt.samples {
			r.hist.record(tt.lat)
			r.ops.Add(1)
		}
		line := r.progressLine(&p, time.Second)
		_, got, ok := strings.Cut(line, "p99 (last 1s) ")
		if !ok || got != tt.want {
			t.Errorf("%s: line %q, want p99 (last 1s) %s", tt.name, line, tt.want)
		}
		if want := fmt.Sprintf("  %d/s  ", tt.samples); !strings.Contains(line, want) {
			t.Errorf("%s: line %q, want %q", tt.name, line, want)
		}
	}
}

// A line that comes late (a busy machine put the ticker off) gives the
// rate over its own interval: 1,400 answers in 1.4 s are 1,000/s, not
// 1,400/s.
func TestProgressLineRateOfALateTick(t *testing.T) {
	r := &runner{}
	var p progressState
	for _, tt := range []struct {
		at   time.Duration
		ops  int
		want string
	}{
		{time.Second, 1000, "  1000/s  "},
		{2400 * time.Millisecond, 1400, "  1000/s  "},
		{2900 * time.Millisecond, 250, "  500/s  "},
	} {
		r.ops.Add(int64(tt.ops))
		if line := r.progressLine(&p, tt.at); !strings.Contains(line, tt.want) {
			t.Errorf("at %v: line %q, want %q", tt.at, line, tt.want)
		}
	}
}

func TestBodiesAndTags(t *testing.T) {
	tests := []struct {
		name string
		size int
		ct   string
		tag  int
	}{
		{"binary", 1024, "application/octet-stream", 17},
		{"text", 64, "text/plain", 123456},
		{"json", 100, "application/json", 9},
		{"json with charset", 100, "application/json; charset=utf-8", 9},
		{"too short for the tag", 3, "text/plain", 12345},
		{"empty", 0, "text/plain", 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := PopulateBody(tt.tag, tt.size, tt.ct)
			if len(b) != tt.size {
				t.Fatalf("len = %d, want %d", len(b), tt.size)
			}
			if !bytes.Equal(b, PopulateBody(tt.tag, tt.size, tt.ct)) {
				t.Errorf("body is not deterministic")
			}
			if tt.size > 0 && bytes.Equal(b, PopulateBody(tt.tag+1, tt.size, tt.ct)) {
				t.Errorf("streams %d and %d get the same body", tt.tag, tt.tag+1)
			}
			if strings.HasPrefix(tt.ct, "application/json") && !json.Valid(b) {
				t.Errorf("JSON body is not JSON: %q", b)
			}
			var tags []int
			scanTags(b, func(n int) { tags = append(tags, n) })
			wantTags := []int{tt.tag}
			if tt.size < len(appendTag(nil, tt.tag))+1 {
				wantTags = nil
			}
			if !slices.Equal(tags, wantTags) {
				t.Errorf("tags in %q = %v, want %v", b, tags, wantTags)
			}
		})
	}
	var got []int
	scanTags([]byte("#1#abc\n#22#\"#x#3a#4#5"), func(n int) { got = append(got, n) })
	if !slices.Equal(got, []int{1, 22, 4}) {
		t.Errorf("scanTags = %v, want [1 22 4]", got)
	}
}

// run runs cfg against srv with a short timeout and no progress output.
func run(t *testing.T, cfg Config) *Result {
	t.Helper()
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Second
	}
	res, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatalf("Run(%+v): %v", cfg, err)
	}
	return res
}

func TestRunAppend(t *testing.T) {
	f, srv := newFake(t)
	var progress bytes.Buffer
	res := run(t, Config{URL: srv.URL + "/", Prefix: "a-", Writers: 5, Streams: 3, Size: 100, Create: true,
		Duration: 1200 * time.Millisecond, Warmup: 100 * time.Millisecond, Mark: srv.URL + "/mark",
		PIDs: []NamedPID{{"me-again", os.Getpid()}}, Progress: &progress})
	if res.Ops <= 0 || res.Errors != 0 || len(res.ErrorSamples) != 0 {
		t.Fatalf("ops %d, errors %d %v", res.Ops, res.Errors, res.ErrorSamples)
	}
	if res.Bytes != res.Ops*100 || res.OpsPerS != float64(res.Ops)/1.2 || res.Latency.P50 <= 0 || res.Latency.Max < res.Latency.P99 {
		t.Errorf("inconsistent figures: %+v", res)
	}
	// Only the window counts: the server saw at least as many appends.
	var stored int
	for i := range 3 {
		s := f.stream("a-" + itoa(int64(i)))
		if s == nil || s.appends == 0 {
			t.Fatalf("stream a-%d got no appends", i)
		}
		stored += len(s.data)
	}
	if int64(stored) < res.Bytes {
		t.Errorf("the server stored %d bytes, fewer than the %d counted", stored, res.Bytes)
	}
	if f.appends < int(res.Ops) {
		t.Errorf("server saw %d appends, bench counted %d", f.appends, res.Ops)
	}
	if !slices.Equal(f.marks, []string{"start", "end"}) {
		t.Errorf("marks = %v, want [start end]", f.marks)
	}
	if len(res.Processes) != 2 || res.Processes[0].Name != "me-again" || res.Processes[1].Name != "bench" ||
		res.Processes[1].PID != os.Getpid() || res.Processes[1].RSSMiB <= 0 {
		t.Errorf("processes = %+v", res.Processes)
	}
	if !strings.Contains(progress.String(), "ops ") {
		t.Errorf("no progress line: %q", progress.String())
	}
	var sum bytes.Buffer
	res.WriteSummary(&sum)
	for _, want := range []string{"ops", "p99", "errors     0", "bench"} {
		if !strings.Contains(sum.String(), want) {
			t.Errorf("summary lacks %q:\n%s", want, sum.String())
		}
	}
}

func TestRunAppendShares(t *testing.T) {
	tests := []struct {
		name             string
		writers, streams int
	}{
		{"more streams than writers", 3, 10},
		{"more writers than streams", 7, 2},
		{"equal", 4, 4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f, srv := newFake(t)
			res := run(t, Config{URL: srv.URL + "/", Prefix: "s-", Writers: tt.writers, Streams: tt.streams, Size: 10,
				Create: true, Duration: 300 * time.Millisecond})
			if res.Ops == 0 {
				t.Fatal("no ops")
			}
			for i := range tt.streams {
				if s := f.stream("s-" + itoa(int64(i))); s == nil || s.appends == 0 {
					t.Errorf("stream %d got no load", i)
				}
			}
		})
	}
}

func TestRunAppendErrors(t *testing.T) {
	f, srv := newFake(t)
	f.failAppends = true
	res := run(t, Config{URL: srv.URL + "/", Writers: 2, Streams: 2, Size: 10, Create: true, Duration: 300 * time.Millisecond})
	if res.Ops != 0 || res.Errors == 0 {
		t.Errorf("ops %d errors %d, want 0 ops and some errors", res.Ops, res.Errors)
	}
	if len(res.ErrorSamples) != 1 || !strings.HasPrefix(res.ErrorSamples[0], "500: injected failure") {
		t.Errorf("error samples = %q", res.ErrorSamples)
	}
}

// A closed-loop writer whose requests get no answer (nobody listens)
// pauses between them instead of retrying at once, which took more than a
// core of the machine the server shares to come back on.
func TestRunAppendPausesWhenNothingAnswers(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	url := dead.URL + "/"
	dead.Close()
	res := run(t, Config{URL: url, Writers: 2, Streams: 2, Size: 10, Duration: 500 * time.Millisecond})
	// Each writer: one attempt, then one per pause, over the window.
	limit := int64(2 * (500*time.Millisecond/noAnswerPause + 2))
	if res.Ops != 0 || res.Errors == 0 || res.Errors > limit {
		t.Errorf("ops %d, errors %d; want none and some errors, at most %d (one per writer per pause)", res.Ops, res.Errors, limit)
	}
}

func TestRunAppendRate(t *testing.T) {
	_, srv := newFake(t)
	res := run(t, Config{URL: srv.URL + "/", Writers: 4, Streams: 4, Size: 10, Create: true, Duration: time.Second, Rate: 200})
	if res.Ops < 140 || res.Ops > 205 {
		t.Errorf("200/s for 1s made %d appends", res.Ops)
	}
}

// An open-loop writer that falls behind its rate stops at the window's
// end: it went on sending every append scheduled before then, so a run at
// ten times what the server does lasted ten times its duration, all of it
// load that nothing measured.
func TestRunAppendRateStopsAtTheWindowsEnd(t *testing.T) {
	var posts atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.Method {
		case http.MethodPut:
			w.WriteHeader(http.StatusCreated)
		case http.MethodPost:
			posts.Add(1)
			time.Sleep(10 * time.Millisecond) // at most 100 appends a second
			w.Header().Set("Stream-Next-Offset", "1")
			w.WriteHeader(http.StatusNoContent)
		}
	}))
	t.Cleanup(srv.Close)
	res := run(t, Config{URL: srv.URL + "/", Writers: 1, Streams: 1, Size: 10, Create: true, Duration: time.Second, Rate: 1000})
	// One writer, one append at a time: about 100 in the second, never
	// the 1,000 the rate scheduled.
	if n := posts.Load(); n > 300 {
		t.Errorf("the server saw %d appends (the run counted %d); want the window's, about 100", n, res.Ops)
	}
}

func TestRunFatal(t *testing.T) {
	_, srv := newFake(t)
	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{"mark fails", Config{URL: srv.URL + "/", Writers: 1, Streams: 1, Size: 1, Create: true, Duration: time.Second, Mark: srv.URL + "/badmark"}, "mark start: 500"},
		{"sse mark fails", Config{URL: srv.URL + "/", Mode: ModeSSE, Subscribers: 2, Writers: 1, Streams: 1, Size: 10, Create: true, Duration: 20 * time.Second, Mark: srv.URL + "/badmark"}, "mark start: 500"},
		{"no url", Config{Writers: 1, Streams: 1, Size: 1, Duration: time.Second}, "--url"},
		{"create fails", Config{URL: srv.URL + "/forbidden/", Writers: 1, Streams: 1, Size: 1, Create: true, Duration: time.Second}, "creating"},
		{"bad pid", Config{URL: srv.URL + "/", Writers: 1, Streams: 1, Size: 1, Duration: time.Second, PIDs: []NamedPID{{"x", 1 << 30}}}, "--pid x=1073741824"},
		{"bad mode", Config{URL: srv.URL + "/", Mode: "nope", Writers: 1, Streams: 1, Duration: time.Second}, "unknown mode"},
		{"read without stream", Config{URL: srv.URL + "/", Mode: ModeRead, Writers: 1, Streams: 1}, "--stream"},
		{"sse without subscribers", Config{URL: srv.URL + "/", Mode: ModeSSE, Writers: 1, Streams: 1, Duration: time.Second}, "--subscribers"},
		{"pico appends", Config{URL: srv.URL + "/", Protocol: ProtocolPico, Writers: 1, Streams: 1, Size: 1, Duration: time.Second}, "--protocol pico is for sse mode"},
		{"bad protocol", Config{URL: srv.URL + "/", Mode: ModeSSE, Protocol: "mqtt", Subscribers: 1, Writers: 1, Streams: 1, Duration: time.Second}, "unknown protocol"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			start := time.Now()
			_, err := Run(context.Background(), tt.cfg)
			if took := time.Since(start); took > 5*time.Second {
				t.Errorf("a fatal error took %s to end the run", took)
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %v, want one containing %q", err, tt.want)
			}
		})
	}
}

// Input that cannot make a meaningful run is refused before the first
// request: nothing is created on the server, and no warm-up is spent.
func TestRunRefusesBadInput(t *testing.T) {
	f, srv := newFake(t)
	ok := Config{URL: srv.URL + "/", Writers: 1, Streams: 1, Size: 1, Create: true, Duration: time.Second, Warmup: time.Second}
	hostPort := strings.TrimPrefix(srv.URL, "http://")
	tests := []struct {
		name string
		edit func(c *Config)
		want string
	}{
		{"not http", func(c *Config) { c.URL = "ftp://" + hostPort + "/" }, "want an http:// or https:// URL"},
		{"no scheme", func(c *Config) { c.URL = hostPort + "/" }, "want an http:// or https:// URL"},
		{"no host", func(c *Config) { c.URL = "http:///streams/" }, "no host"},
		{"no path", func(c *Config) { c.URL = srv.URL }, "end it with a slash (" + srv.URL + "/)"},
		{"query", func(c *Config) { c.URL = srv.URL + "/?x=1" }, "query or a fragment"},
		{"fragment", func(c *Config) { c.URL = srv.URL + "/#s" }, "query or a fragment"},
		{"negative timeout", func(c *Config) { c.Timeout = -time.Second }, "--timeout -1s: want more than 0"},
		{"no readers", func(c *Config) { c.Mode, c.Stream, c.Readers = ModeRead, "s", 0 }, "--readers 0: want at least 1"},
		{"negative readers", func(c *Config) { c.Mode, c.Stream, c.Readers = ModeRead, "s", -3 }, "--readers -3: want at least 1"},
		{"pid of no process", func(c *Config) { c.PIDs = []NamedPID{{"ghost", 1 << 30}} }, "--pid ghost=1073741824: cannot read the process"},
		{"rate NaN", func(c *Config) { c.Rate = math.NaN() }, "--rate NaN: want 0 or more"},
		{"rate Inf", func(c *Config) { c.Rate = math.Inf(1) }, "--rate +Inf: want 0 or more"},
		{"mark not a URL", func(c *Config) { c.Mark = "localhost:9999/mark" }, `--mark "localhost:9999/mark": want an http:// or https:// URL`},
		{"mark without host", func(c *Config) { c.Mark = "http:///mark" }, `--mark "http:///mark": want an http:// or https:// URL`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := ok
			tt.edit(&cfg)
			before := f.requests.Load()
			res, err := Run(context.Background(), cfg)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %v, want one containing %q", err, tt.want)
			}
			if res != nil {
				t.Errorf("a refused run returned a result: %+v", res)
			}
			if n := f.requests.Load() - before; n != 0 {
				t.Errorf("the server got %d requests before the input was refused", n)
			}
		})
	}
}

// A URL without a path takes a prefix that starts one, as the benchmark
// matrix passes them (--url http://host:port --prefix /r1/): the stream
// names land in the path, nothing is glued to the port.
func TestRunTakesAPathFromThePrefix(t *testing.T) {
	_, srv := newFake(t)
	cfg := Config{URL: srv.URL, Prefix: "/r1/", Writers: 1, Streams: 1, Size: 1, Create: true, Duration: 200 * time.Millisecond}
	res, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatalf("run with --url %s --prefix /r1/: %v", srv.URL, err)
	}
	if res.Ops == 0 || res.Errors != 0 {
		t.Errorf("ops %d errors %d, want appends and no errors", res.Ops, res.Errors)
	}
}

func TestResultCheck(t *testing.T) {
	tests := []struct {
		name string
		res  Result
		want string // "" for no error
	}{
		{"append", Result{Mode: ModeAppend, Ops: 10}, ""},
		{"append with some errors", Result{Mode: ModeAppend, Ops: 10, Errors: 2}, ""},
		{"append, nothing succeeded", Result{Mode: ModeAppend, Errors: 5}, "no operation succeeded (errors: 5)"},
		{"append, nothing done", Result{Mode: ModeAppend}, ""},
		{"read, nothing succeeded", Result{Mode: ModeRead, Errors: 1}, "no operation succeeded (errors: 1)"},
		{"populate with some errors", Result{Mode: ModePopulate, Ops: 3, Errors: 1}, ""},
		{"verify", Result{Mode: ModeVerify, Streams: 4, Ops: 4, OK: 4}, ""},
		{"verify, a mismatch", Result{Mode: ModeVerify, Streams: 4, Ops: 4, OK: 3, Mismatched: 1}, "verify failed: 1 of 4 streams mismatched, 0 could not be read"},
		{"verify, an unreadable stream", Result{Mode: ModeVerify, Streams: 4, Ops: 3, OK: 3, Errors: 1}, "verify failed: 0 of 4 streams mismatched, 1 could not be read"},
		{"sse, all delivered", Result{Mode: ModeSSE, Ops: 5, Expected: 10, Delivered: 10}, ""},
		{"sse, some lost", Result{Mode: ModeSSE, Ops: 5, Expected: 10, Delivered: 7, Lost: 3, Errors: 1}, ""},
		{"sse, feeds refused", Result{Mode: ModeSSE, Ops: 5, Expected: 10, Lost: 10, Errors: 30}, "no subscriber received a record (errors: 30)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.res.Check()
			if tt.want == "" && err != nil || tt.want != "" && (err == nil || err.Error() != tt.want) {
				t.Errorf("Check() = %v, want %q", err, tt.want)
			}
		})
	}
}

func TestRunSSE(t *testing.T) {
	readings := map[feedReading]string{feedsByURL: "poller", feedsNetHTTP: "net-http", feedsGoroutine: "goroutine"}
	for _, ct := range []string{"text/plain", "application/octet-stream"} {
		for reading, how := range readings {
			t.Run(ct+"/"+how, func(t *testing.T) {
				f, srv := newFake(t)
				f.sseEvents = 7 // responses end now and then: subscribers resume
				// No --writers or --streams: sse mode does not read them.
				res := run(t, Config{URL: srv.URL + "/", Mode: ModeSSE, Size: 64, ContentType: ct,
					Create: true, Subscribers: 30, Rate: 40, Duration: time.Second, feeds: reading})
				if res.Ops < 35 || res.Errors != 0 {
					t.Fatalf("ops %d errors %d %v", res.Ops, res.Errors, res.ErrorSamples)
				}
				if res.Expected != res.Ops*30 || res.Delivered != res.Expected || res.Lost != 0 || res.Subscribers != 30 {
					t.Errorf("delivered %d expected %d lost %d ops %d", res.Delivered, res.Expected, res.Lost, res.Ops)
				}
				if res.Latency.Max <= 0 || res.Latency.Max > 1000 {
					t.Errorf("delivery latency %+v", res.Latency)
				}
			})
		}
	}
}

// The progress line counts the subscribers' errors, as the summary does:
// feeds the server refuses must not show as "errors 0" while the run goes.
func TestRunSSEProgressCountsSubscriberErrors(t *testing.T) {
	f, srv := newFake(t)
	f.failSSE = true
	var progress bytes.Buffer
	res := run(t, Config{URL: srv.URL + "/", Mode: ModeSSE, Writers: 1, Streams: 1, Size: 64, ContentType: "text/plain",
		Create: true, Subscribers: 3, Rate: 20, Duration: 1500 * time.Millisecond, Timeout: time.Second, Progress: &progress})
	if res.Errors == 0 || res.Delivered != 0 {
		t.Fatalf("errors %d delivered %d: want refused feeds", res.Errors, res.Delivered)
	}
	lines := strings.Split(strings.TrimSpace(progress.String()), "\n")
	last := lines[len(lines)-1]
	_, after, _ := strings.Cut(last, "  errors ")
	if errs, _, _ := strings.Cut(after, " "); errs == "" || errs == "0" {
		t.Errorf("the last progress line shows no errors while the summary has %d:\n%s", res.Errors, progress.String())
	}
}

// A run whose 2xx answers carry no stream offset is counted as usual but
// warned about: its URL is not a stream server's (say a Caddy site whose
// host does not match the URL's, which answers everything with an empty
// 200). Runs against a stream server have no warning.
func TestRunWarnsWhenNotStreams(t *testing.T) {
	for _, plain := range []bool{false, true} {
		for _, mode := range []string{ModeAppend, ModeRead, ModePopulate} {
			t.Run(fmt.Sprintf("%s/plain=%v", mode, plain), func(t *testing.T) {
				f, srv := newFake(t)
				f.plain = plain
				f.streams["s"] = &fakeStream{contentType: "text/plain", data: []byte("abc")}
				res := run(t, Config{URL: srv.URL + "/", Mode: mode, Stream: "s", Readers: 1, Writers: 2, Streams: 2, Size: 10,
					Create: true, Duration: 200 * time.Millisecond})
				if res.Ops == 0 || res.Errors != 0 {
					t.Fatalf("ops %d errors %d %q", res.Ops, res.Errors, res.ErrorSamples)
				}
				var sum bytes.Buffer
				res.WriteSummary(&sum)
				warned := len(res.Warnings) == 1 && strings.Contains(res.Warnings[0], "no answer carried Stream-Next-Offset") &&
					strings.Contains(sum.String(), "warning    no answer carried")
				if warned != plain || !plain && len(res.Warnings) != 0 {
					t.Errorf("warnings %q (plain server: %v); summary:\n%s", res.Warnings, plain, sum.String())
				}
			})
		}
	}
}

// Feeds answered with a 200 that is not an event stream (Caddy's empty
// one, where no route serves the URL) are errors, each followed by the
// pause before a retry: before, each ended at once, was asked again at
// once, and counted nothing.
func TestRunSSENotAnEventStream(t *testing.T) {
	for reading, how := range map[feedReading]string{feedsByURL: "poller", feedsNetHTTP: "net-http"} {
		t.Run(how, func(t *testing.T) {
			f, srv := newFake(t)
			f.plain = true
			res := run(t, Config{URL: srv.URL + "/", Mode: ModeSSE, Writers: 1, Streams: 1, Size: 64, ContentType: "text/plain",
				Create: true, Subscribers: 2, Rate: 20, Duration: time.Second, Timeout: time.Second, feeds: reading})
			if res.Errors == 0 || len(res.ErrorSamples) == 0 || !strings.Contains(res.ErrorSamples[0], "not an SSE feed") {
				t.Errorf("errors %d %q: want the feeds' empty 200s counted", res.Errors, res.ErrorSamples)
			}
			if err := res.Check(); err == nil {
				t.Errorf("Check() passed a run in which no record reached a subscriber")
			}
			// Two subscribers, each pausing 200ms after a failure, for about
			// two seconds: some tens of requests, not a busy loop's thousands.
			if n := f.requests.Load(); n > 200 {
				t.Errorf("the server got %d requests: the feeds did not pause between failures", n)
			}
		})
	}
}

// The sse writer's failed appends count inside the window only, as its
// acknowledged ones do (and as append mode's do).
func TestRunSSEAppendErrorsInWindow(t *testing.T) {
	f, srv := newFake(t)
	f.failAppends = true
	const rate = 20
	res := run(t, Config{URL: srv.URL + "/", Mode: ModeSSE, Writers: 1, Streams: 1, Size: 64, ContentType: "text/plain",
		Create: true, Subscribers: 1, Rate: rate, Warmup: time.Second, Duration: time.Second, Timeout: time.Second})
	// About rate appends in the window, as many before it.
	if res.Ops != 0 || res.Errors == 0 || res.Errors > rate+2 {
		t.Errorf("ops %d errors %d; want about %d errors (the window's appends), none of the warm-up's", res.Ops, res.Errors, rate)
	}
}

// The subscribers' failures count inside the window only, as the writer's
// do: a feed refused all run long shows the window's share of failures, not
// the warm-up's and the grace period's too.
func TestRunSSESubscriberErrorsInWindow(t *testing.T) {
	f, srv := newFake(t)
	f.failSSE = true
	res := run(t, Config{URL: srv.URL + "/", Mode: ModeSSE, Writers: 1, Streams: 1, Size: 64, ContentType: "text/plain",
		Create: true, Subscribers: 1, Rate: 20, Warmup: time.Second, Duration: time.Second, Timeout: time.Second})
	// One subscriber pausing 200ms after each failure: about 5 in the
	// window, about 15 over warm-up, window and grace period.
	if res.Errors == 0 || res.Errors > 8 {
		t.Errorf("errors %d; want about 5 (the window's failed feeds), none of the warm-up's or the grace period's", res.Errors)
	}
}

func TestRunRead(t *testing.T) {
	f, srv := newFake(t)
	f.maxChunk = 1000
	content := bytes.Repeat([]byte("0123456789"), 1050) // 10,500 bytes: 11 GETs
	f.streams["big"] = &fakeStream{contentType: "text/plain", data: content}
	res := run(t, Config{URL: srv.URL + "/", Mode: ModeRead, Stream: "big", Readers: 3}) // --writers and --streams are not read mode's
	if res.Requests != 33 || res.Ops != 33 || res.Bytes != 3*10500 || res.Errors != 0 || res.Readers != 3 || res.Stream != "big" {
		t.Errorf("requests %d ops %d bytes %d errors %d stream %q", res.Requests, res.Ops, res.Bytes, res.Errors, res.Stream)
	}
	res = run(t, Config{URL: srv.URL + "/", Mode: ModeRead, Stream: "missing", Readers: 1, Writers: 1, Streams: 1})
	if res.Errors != 1 || len(res.ErrorSamples) != 1 || !strings.HasPrefix(res.ErrorSamples[0], "404: ") {
		t.Errorf("reading a missing stream: errors %d %q", res.Errors, res.ErrorSamples)
	}
}

func TestRunPopulateVerify(t *testing.T) {
	f, srv := newFake(t)
	f.maxChunk = 300 // verify must follow offsets to the tail
	base := Config{URL: srv.URL + "/", Prefix: "pv-", Writers: 8, Streams: 50, Size: 1000, Create: true}
	pop := base
	pop.Mode = ModePopulate
	res := run(t, pop)
	if res.Ops != 50 || res.Errors != 0 || res.Bytes != 50*1000 {
		t.Fatalf("populate: ops %d errors %d bytes %d %v", res.Ops, res.Errors, res.Bytes, res.ErrorSamples)
	}
	ver := base
	ver.Mode = ModeVerify
	if res = run(t, ver); res.OK != 50 || res.Mismatched != 0 || res.Errors != 0 {
		t.Fatalf("verify: ok %d mismatched %d errors %d %v", res.OK, res.Mismatched, res.Errors, res.ErrorSamples)
	}
	f.stream("pv-17").data[500] ^= 1
	f.stream("pv-3").data = append(f.stream("pv-3").data, 'x')
	delete(f.streams, "pv-40")
	res = run(t, ver)
	if res.OK != 47 || res.Mismatched != 2 || res.Errors != 1 {
		t.Errorf("verify after damage: ok %d mismatched %d errors %d %v", res.OK, res.Mismatched, res.Errors, res.ErrorSamples)
	}
	joined := strings.Join(res.ErrorSamples, "\n")
	for _, want := range []string{"pv-17: mismatch", "first difference at byte 500", "pv-3: mismatch", "pv-40: 404"} {
		if !strings.Contains(joined, want) {
			t.Errorf("error samples lack %q:\n%s", want, joined)
		}
	}
	// With --create=false populate appends to streams that exist.
	pop.Create = false
	pop.Prefix = "pv2-"
	pop.Streams = 2
	if res = run(t, pop); res.Errors != 2 || !strings.HasPrefix(res.ErrorSamples[0], "404: ") {
		t.Errorf("populate without create on missing streams: errors %d %q", res.Errors, res.ErrorSamples)
	}
}

func TestRunCancel(t *testing.T) {
	_, srv := newFake(t)
	for _, mode := range []string{ModeAppend, ModeSSE} {
		t.Run(mode, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
			defer cancel()
			start := time.Now()
			res, err := Run(ctx, Config{URL: srv.URL + "/", Mode: mode, Subscribers: 3, Writers: 2, Streams: 2, Size: 10,
				Create: true, Duration: 30 * time.Second, Timeout: 5 * time.Second})
			if err == nil || res != nil {
				t.Errorf("a cancelled run returned %+v, %v; want no result and an error", res, err)
			}
			if took := time.Since(start); took > 5*time.Second {
				t.Errorf("cancelling took %s", took)
			}
		})
	}
}

// The control parsers of both protocols: the fast path for the server's
// own encoding, encoding/json for anything else.
func TestParseControl(t *testing.T) {
	ds, pico := parseControl, parsePicoControl
	tests := []struct {
		parse  func([]byte) ([]byte, bool, error)
		in     string
		next   string
		closed bool
		err    bool
	}{
		{ds, `{"streamNextOffset":"0000000000000003_0000000000000000","streamCursor":"c1"}`, "0000000000000003_0000000000000000", false, false},
		{ds, `{"streamNextOffset":"7_0","streamClosed":true}`, "7_0", true, false},
		{ds, `{"streamCursor":"c","streamNextOffset":"a\"b"}`, `a"b`, false, false}, // escaped: through encoding/json
		{ds, `{ "streamNextOffset" : "x" }`, "x", false, false},                     // spaced: through encoding/json
		{ds, `{"streamClosed":true}`, "", true, false},
		{ds, `not json`, "", false, true},
		{ds, ``, "", false, true},
		{pico, `{"next_seq":3,"up_to_date":true}`, "3", false, false},
		{pico, `{"next_seq":12,"up_to_date":true,"closed":true}`, "12", true, false},
		{pico, `{"up_to_date":false,"next_seq":0}`, "0", false, false},
		{pico, `{ "next_seq" : 5 }`, "5", false, false}, // spaced: through encoding/json
		{pico, `{"next_seq":5e1}`, "", false, true},     // not the server's: encoding/json refuses it
		{pico, `{"up_to_date":true}`, "", false, true},
		{pico, `not json`, "", false, true},
		{pico, ``, "", false, true},
	}
	for i, tt := range tests {
		next, closed, err := tt.parse([]byte(tt.in))
		if string(next) != tt.next || closed != tt.closed || (err != nil) != tt.err {
			t.Errorf("case %d: parse(%s) = %q, %v, %v", i, tt.in, next, closed, err)
		}
	}
}

// A run shorter than the progress tick still prints a line, with its rate
// over the time it ran rather than over a second it did not last.
func TestShortRunPrintsOneProgressLine(t *testing.T) {
	_, srv := newFake(t)
	var progress bytes.Buffer
	res := run(t, Config{URL: srv.URL + "/", Prefix: "s-", Writers: 2, Streams: 1, Size: 10, Create: true,
		Duration: 300 * time.Millisecond, Progress: &progress})
	lines := strings.Split(strings.TrimSpace(progress.String()), "\n")
	if len(lines) != 1 || !strings.Contains(lines[0], "ops ") {
		t.Fatalf("progress = %q, want one line", progress.String())
	}
	var secs float64
	var ops, rate int64
	if _, err := fmt.Sscanf(strings.TrimSpace(lines[0]), "%fs  ops %d  %d/s", &secs, &ops, &rate); err != nil {
		t.Fatalf("parse %q: %v", lines[0], err)
	}
	if ops < res.Ops || rate < ops*2 {
		t.Errorf("line %q: %d ops at %d/s, want at least the run's %d ops at their rate over about 0.3 s", lines[0], ops, rate, res.Ops)
	}
}

func TestParseHeader(t *testing.T) {
	tests := []struct {
		in, name, value, err string
	}{
		{in: "Authorization: Bearer abc", name: "Authorization", value: "Bearer abc"},
		{in: "x-api-key:k1", name: "X-Api-Key", value: "k1"},
		{in: " host :  localhost ", name: "Host", value: "localhost"},
		{in: "X-Empty:", name: "X-Empty", value: ""},
		{in: "X-Tab: a\tb", name: "X-Tab", value: "a\tb"},
		{in: "no colon", err: "want NAME: VALUE"},
		{in: ": value", err: "want NAME: VALUE"},
		{in: "bad name: v", err: "want NAME: VALUE"},
		{in: "X-Split: a\r\nInjected: 1", err: "control character"},
		{in: "Content-Type: text/plain", err: "use --content-type"},
		{in: "content-length: 5", err: "sets Content-Length itself"},
		{in: "Transfer-Encoding: chunked", err: "sets Transfer-Encoding itself"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			name, value, err := ParseHeader(tt.in)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("ParseHeader(%q) = %q, %q, %v; want an error with %q", tt.in, name, value, err, tt.err)
				}
				return
			}
			if err != nil || name != tt.name || value != tt.value {
				t.Fatalf("ParseHeader(%q) = %q, %q, %v; want %q, %q", tt.in, name, value, err, tt.name, tt.value)
			}
		})
	}
}

// The configured headers go with every request to the server, in every
// mode and whichever way the SSE feeds are read, and never to the mark URL.
// A Host header sets the requests' Host. The fake server answers 401 to a
// request without them, and 400 to a mark with the Authorization.
func TestRunSendsHeaders(t *testing.T) {
	const auth = "Bearer s3cret"
	header := http.Header{"Authorization": {auth}, "Host": {"streams.example"}}
	newAuthFake := func(t *testing.T) (*fakeServer, string) {
		t.Helper()
		f, srv := newFake(t)
		f.auth, f.host = auth, "streams.example"
		return f, srv.URL
	}
	t.Run("append", func(t *testing.T) {
		_, url := newAuthFake(t)
		// The marks go to another host, which must not get them.
		var mu sync.Mutex
		var marks []string
		mark := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			defer mu.Unlock()
			marks = append(marks, r.URL.Query().Get("phase")+" "+r.Header.Get("Authorization"))
		}))
		defer mark.Close()
		res := run(t, Config{URL: url + "/", Prefix: "h-", Writers: 2, Streams: 2, Size: 10, Create: true,
			Duration: 300 * time.Millisecond, Mark: mark.URL, Header: header})
		if res.Ops == 0 || res.Errors != 0 {
			t.Fatalf("ops %d, errors %d %q", res.Ops, res.Errors, res.ErrorSamples)
		}
		mu.Lock()
		defer mu.Unlock()
		if !slices.Equal(marks, []string{"start ", "end "}) {
			t.Errorf("marks %q, want start and end without the server's Authorization", marks)
		}
	})
	t.Run("populate, verify and read", func(t *testing.T) {
		_, url := newAuthFake(t)
		base := Config{URL: url + "/", Prefix: "hp-", Writers: 2, Streams: 3, Size: 10, Create: true, Header: header}
		pop, ver := base, base
		pop.Mode, ver.Mode = ModePopulate, ModeVerify
		if res := run(t, pop); res.Errors != 0 || res.Ops != 3 {
			t.Fatalf("populate: ops %d errors %d %q", res.Ops, res.Errors, res.ErrorSamples)
		}
		if res := run(t, ver); res.Errors != 0 || res.OK != 3 {
			t.Fatalf("verify: ok %d errors %d %q", res.OK, res.Errors, res.ErrorSamples)
		}
		res := run(t, Config{URL: url + "/", Mode: ModeRead, Stream: "hp-1", Readers: 1, Header: header})
		if res.Ops == 0 || res.Errors != 0 {
			t.Fatalf("read: ops %d errors %d %q", res.Ops, res.Errors, res.ErrorSamples)
		}
	})
	readings := map[feedReading]string{feedsByURL: "poller", feedsNetHTTP: "net-http", feedsGoroutine: "goroutine"}
	for reading, how := range readings {
		t.Run("sse/"+how, func(t *testing.T) {
			_, url := newAuthFake(t)
			res := run(t, Config{URL: url + "/", Mode: ModeSSE, Size: 16, ContentType: "text/plain", Create: true,
				Subscribers: 3, Rate: 20, Duration: 400 * time.Millisecond, feeds: reading, Header: header})
			if res.Ops == 0 || res.Errors != 0 || res.Delivered != res.Expected {
				t.Fatalf("ops %d errors %d delivered %d of %d %q", res.Ops, res.Errors, res.Delivered, res.Expected, res.ErrorSamples)
			}
		})
	}
	// Without the headers the same server refuses the run: the test's 401s
	// are what the headers prevent.
	t.Run("without", func(t *testing.T) {
		_, url := newAuthFake(t)
		res := run(t, Config{URL: url + "/", Mode: ModeRead, Stream: "x", Readers: 1})
		if res.Errors != 1 || !strings.HasPrefix(res.ErrorSamples[0], "401") {
			t.Fatalf("without the headers: errors %d %q, want a 401", res.Errors, res.ErrorSamples)
		}
	})
}

// Basic auth in the URL's user info reaches the server from the feeds read
// by hand as from net/http's client, unless an Authorization is configured.
func TestRawRequestHeaders(t *testing.T) {
	u, err := url.Parse("http://user:pw@127.0.0.1:9/s?offset=now&live=sse")
	if err != nil {
		t.Fatal(err)
	}
	basic := "Authorization: Basic " + base64.StdEncoding.EncodeToString([]byte("user:pw")) + "\r\n"
	tests := []struct {
		name   string
		header http.Header
		want   []string
		not    []string
	}{
		{"user info", nil, []string{"GET /s?offset=now&live=sse HTTP/1.1\r\n", "Host: 127.0.0.1:9\r\n", basic}, nil},
		{"configured", http.Header{"Authorization": {"Bearer t"}, "Host": {"h.example"}, "X-A": {"1", "2"}},
			[]string{"Host: h.example\r\n", "Authorization: Bearer t\r\n", "X-A: 1\r\nX-A: 2\r\n"}, []string{basic, "Host: 127.0.0.1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &runner{cfg: Config{Header: tt.header}}
			got := string(r.rawRequest(u))
			if !strings.HasSuffix(got, "\r\n\r\n") || strings.Count(got, "\r\n\r\n") != 1 {
				t.Errorf("request not ended by one blank line: %q", got)
			}
			for _, w := range tt.want {
				if !strings.Contains(got, w) {
					t.Errorf("request lacks %q:\n%s", w, got)
				}
			}
			for _, n := range tt.not {
				if strings.Contains(got, n) {
					t.Errorf("request has %q:\n%s", n, got)
				}
			}
		})
	}
}

// An https:// server whose certificate chains to RootCAs is reached in
// every mode that uses the network's client, SSE feeds included; without
// them its certificate is refused.
func TestRunTrustsRootCAs(t *testing.T) {
	f := &fakeServer{streams: map[string]*fakeStream{}, changed: make(chan struct{})}
	srv := httptest.NewTLSServer(f)
	t.Cleanup(srv.Close)
	pool := x509.NewCertPool()
	pool.AddCert(srv.Certificate())

	res := run(t, Config{URL: srv.URL + "/", Prefix: "tls-", Writers: 2, Streams: 2, Size: 10, Create: true,
		Duration: 300 * time.Millisecond, RootCAs: pool})
	if res.Ops == 0 || res.Errors != 0 {
		t.Fatalf("append: ops %d, errors %d %q", res.Ops, res.Errors, res.ErrorSamples)
	}
	res = run(t, Config{URL: srv.URL + "/", Mode: ModeSSE, Size: 16, ContentType: "text/plain", Create: true,
		Subscribers: 3, Rate: 20, Duration: 400 * time.Millisecond, RootCAs: pool})
	if res.Ops == 0 || res.Errors != 0 || res.Delivered != res.Expected {
		t.Fatalf("sse: ops %d errors %d delivered %d of %d %q", res.Ops, res.Errors, res.Delivered, res.Expected, res.ErrorSamples)
	}
	res = run(t, Config{URL: srv.URL + "/", Mode: ModeRead, Stream: "tls-0", Readers: 1})
	if res.Errors != 1 || !strings.Contains(res.ErrorSamples[0], "certificate") {
		t.Fatalf("without the CA: errors %d %q, want the certificate refused", res.Errors, res.ErrorSamples)
	}
}

func TestParseCACert(t *testing.T) {
	srv := httptest.NewTLSServer(http.NotFoundHandler())
	defer srv.Close()
	pemCert := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	if pool, err := ParseCACert(pemCert); err != nil || pool == nil {
		t.Fatalf("ParseCACert of a certificate: %v", err)
	}
	if _, err := ParseCACert([]byte("not a certificate")); err == nil || !strings.Contains(err.Error(), "no PEM certificate") {
		t.Fatalf("ParseCACert of text: %v, want no PEM certificate", err)
	}
}
