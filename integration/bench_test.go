package integration

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// benchResult is the part of `caddy picomq bench --json` the test reads.
type benchResult struct {
	Mode         string   `json:"mode"`
	Prefix       string   `json:"prefix"`
	Size         int      `json:"size"`
	DurationS    float64  `json:"duration_s"`
	Ops          int64    `json:"ops"`
	OpsPerS      float64  `json:"ops_per_s"`
	Bytes        int64    `json:"bytes"`
	Errors       int64    `json:"errors"`
	ErrorSamples []string `json:"error_samples"`
	Warnings     []string `json:"warnings"`
	Latency      struct {
		P50, P99, Max float64
	} `json:"latency_ms"`
	Processes []struct {
		Name       string  `json:"name"`
		PID        int     `json:"pid"`
		CPUS       float64 `json:"cpu_s"`
		RSSMiB     float64 `json:"rss_mib"`
		PeakRSSMiB float64 `json:"peak_rss_mib"`
	} `json:"processes"`
	Subscribers int   `json:"subscribers"`
	Delivered   int64 `json:"delivered"`
	Expected    int64 `json:"expected"`
	Lost        int64 `json:"lost"`
	OK          int64 `json:"ok"`
	Mismatched  int64 `json:"mismatched"`
}

// runBench runs the Caddy binary's `picomq bench` with args plus --json
// and returns the parsed result; it fails the test if the command fails.
func runBench(t *testing.T, args ...string) benchResult {
	t.Helper()
	res, _, err := execBench(t, args...)
	if err != nil {
		t.Fatalf("bench failed: %v", err)
	}
	if len(res.Warnings) != 0 {
		t.Errorf("bench warned against the module: %q", res.Warnings)
	}
	return res
}

// runBenchFailing is runBench for a run that must exit non-zero with
// wantOutput in what it printed; it returns the result it wrote all the
// same, and the text summary.
func runBenchFailing(t *testing.T, wantOutput string, args ...string) (benchResult, string) {
	t.Helper()
	res, output, err := execBench(t, args...)
	if err == nil {
		t.Fatalf("bench succeeded; want it to fail with %q", wantOutput)
	}
	if !strings.Contains(output, wantOutput) {
		t.Fatalf("bench failed (%v) without %q in its output", err, wantOutput)
	}
	return res, output
}

// execBench runs the bench and returns its JSON result, its combined
// output and how it exited; a missing or unparsable result fails the test.
func execBench(t *testing.T, args ...string) (benchResult, string, error) {
	t.Helper()
	bin := caddytest.BuildCaddy(t)
	out := filepath.Join(t.TempDir(), "result.json")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, append([]string{"picomq", "bench", "--quiet", "--json", out}, args...)...)
	output, runErr := cmd.CombinedOutput()
	t.Logf("caddy picomq bench %s:\n%s", strings.Join(args, " "), output)
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatalf("no result (bench exited with %v): %v", runErr, err)
	}
	var res benchResult
	if err := json.Unmarshal(b, &res); err != nil {
		t.Fatalf("bench JSON: %v\n%s", err, b)
	}
	return res, string(output), runErr
}

// TestBench runs the benchmark command of the module's own Caddy binary
// against the module on versitygw: an append run whose every acknowledged
// append must be in the streams afterwards, populate + verify, and an SSE
// fan-out in which every subscriber gets every record.
func TestBench(t *testing.T) {
	e := fhStart(t, fhOptions{})
	base := e.caddy.URL() + "/"
	pid := e.caddy.PID()
	if pid <= 0 {
		t.Fatalf("no pid for the Caddy child")
	}

	t.Run("append", func(t *testing.T) {
		// The mark endpoint snapshots the S3 proxy's counters, as the
		// matrix script does, to check the marks bracket the window.
		var mu sync.Mutex
		var marks []string
		var atStart, atEnd testenv.Counts
		mark := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			defer mu.Unlock()
			phase := r.URL.Query().Get("phase")
			marks = append(marks, phase)
			switch phase {
			case "start":
				atStart = e.proxy.Counts()
			case "end":
				atEnd = e.proxy.Counts()
			}
			w.WriteHeader(http.StatusNoContent)
		}))
		defer mark.Close()

		const size, streams = 1024, 4
		res := runBench(t, "--url", base, "--mode", "append", "--writers", "8", "--streams", strconv.Itoa(streams),
			"--size", "1KiB", "--duration", "2s", "--prefix", "bench-app-", "--pid", "caddy="+strconv.Itoa(pid),
			"--mark", mark.URL)
		if res.Ops <= 0 || res.Errors != 0 {
			t.Fatalf("ops %d, errors %d %q", res.Ops, res.Errors, res.ErrorSamples)
		}
		if res.Bytes != res.Ops*size || res.DurationS != 2 || res.Latency.P50 <= 0 {
			t.Errorf("inconsistent result: %+v", res)
		}
		var caddyCPU float64 = -1
		names := []string{}
		for _, p := range res.Processes {
			names = append(names, p.Name)
			if p.Name == "caddy" {
				if p.PID != pid || p.RSSMiB <= 0 || p.PeakRSSMiB <= 0 {
					t.Errorf("caddy process figures: %+v", p)
				}
				caddyCPU = p.CPUS
			}
		}
		if caddyCPU <= 0 || len(res.Processes) != 2 || names[1] != "bench" {
			t.Errorf("processes %v, caddy cpu_s %g: want caddy with some CPU, then bench", names, caddyCPU)
		}
		// Every acknowledged append is stored.
		var stored int
		for i := range streams {
			content, _, err := e.readBytes("/bench-app-" + strconv.Itoa(i))
			if err != nil {
				t.Fatal(err)
			}
			if len(content)%size != 0 || len(content) == 0 {
				t.Errorf("stream %d holds %d bytes, not a positive multiple of %d", i, len(content), size)
			}
			stored += len(content)
		}
		if int64(stored) < res.Ops*size {
			t.Errorf("the streams hold %d bytes, fewer than the %d acknowledged in the window", stored, res.Ops*size)
		}
		t.Logf("append: %d ops (%.0f/s) in the window, %d bytes stored in all; caddy cpu %.2fs", res.Ops, res.OpsPerS, stored, caddyCPU)
		mu.Lock()
		defer mu.Unlock()
		if strings.Join(marks, ",") != "start,end" {
			t.Fatalf("marks %v, want start,end", marks)
		}
		if atEnd.Put <= atStart.Put {
			t.Errorf("no S3 PUTs between the marks (%d, then %d)", atStart.Put, atEnd.Put)
		}
	})

	t.Run("populate-verify", func(t *testing.T) {
		common := []string{"--url", base, "--streams", "200", "--size", "300", "--writers", "16", "--prefix", "bench-pop-"}
		res := runBench(t, append([]string{"--mode", "populate"}, common...)...)
		if res.Ops != 200 || res.Errors != 0 {
			t.Fatalf("populate: ops %d errors %d %q", res.Ops, res.Errors, res.ErrorSamples)
		}
		res = runBench(t, append([]string{"--mode", "verify"}, common...)...)
		if res.OK != 200 || res.Mismatched != 0 || res.Errors != 0 {
			t.Fatalf("verify: ok %d mismatched %d errors %d %q", res.OK, res.Mismatched, res.Errors, res.ErrorSamples)
		}
		// A stream that changed is caught, and fails the run.
		e.append("/bench-pop-7", "application/octet-stream", []byte("extra"))
		res, _ = runBenchFailing(t, "verify failed: 1 of 200 streams mismatched, 0 could not be read",
			append([]string{"--mode", "verify"}, common...)...)
		if res.OK != 199 || res.Mismatched != 1 {
			t.Errorf("verify after an extra append: ok %d mismatched %d %q", res.OK, res.Mismatched, res.ErrorSamples)
		}
	})

	// What the server refuses is counted and shown, in the text and the
	// JSON, and a run that measured nothing, or a verify that did not
	// verify, exits non-zero.
	t.Run("refused", func(t *testing.T) {
		tests := []struct {
			name       string
			args       []string
			wantOutput string
			wantErrors int64
		}{
			{"verify of streams never populated", []string{"--mode", "verify", "--streams", "5", "--writers", "2", "--prefix", "bench-never-"},
				"verify failed: 0 of 5 streams mismatched, 5 could not be read", 5},
			{"read of a missing stream", []string{"--mode", "read", "--stream", "bench-never-read", "--readers", "3"},
				"no operation succeeded (errors: 3)", 3},
			{"appends to missing streams", []string{"--mode", "append", "--create=false", "--writers", "1", "--streams", "2",
				"--duration", "500ms", "--prefix", "bench-never-"}, "no operation succeeded", -1},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				res, output := runBenchFailing(t, tt.wantOutput, append([]string{"--url", base}, tt.args...)...)
				if res.Errors <= 0 || tt.wantErrors >= 0 && res.Errors != tt.wantErrors || res.Ops != 0 {
					t.Errorf("errors %d ops %d, want %d errors and no ops", res.Errors, res.Ops, tt.wantErrors)
				}
				if len(res.ErrorSamples) == 0 || !strings.Contains(res.ErrorSamples[0], "404") {
					t.Errorf("error samples %q, want the 404s", res.ErrorSamples)
				}
				if line := "errors     " + strconv.FormatInt(res.Errors, 10) + "\n"; !strings.Contains(output, line) {
					t.Errorf("the text summary lacks %q", line)
				}
			})
		}
	})

	t.Run("sse", func(t *testing.T) {
		res := runBench(t, "--url", base, "--mode", "sse", "--subscribers", "50", "--rate", "20", "--duration", "2s",
			"--prefix", "bench-sse-", "--pid", "caddy="+strconv.Itoa(pid))
		if res.Ops < 10 || res.Errors != 0 {
			t.Fatalf("sse: ops %d errors %d %q", res.Ops, res.Errors, res.ErrorSamples)
		}
		if res.Subscribers != 50 || res.Expected != res.Ops*50 || res.Delivered != res.Expected || res.Lost != 0 {
			t.Errorf("sse: delivered %d of %d expected (%d appends, %d subscribers), lost %d",
				res.Delivered, res.Expected, res.Ops, res.Subscribers, res.Lost)
		}
	})
}

// TestBenchBehindAuth runs the benchmark command against the module on
// versitygw behind Caddy's basic_auth, which guards reads as well as
// writes: with --header carrying the credentials every mode succeeds, SSE
// feeds included (read by hand over plain HTTP); without it the run gets
// only 401s and fails.
func TestBenchBehindAuth(t *testing.T) {
	guard := "\t\tbasic_auth {\n\t\t\twriter " + readerHash + "\n\t\t}\n"
	e := picoStartGuarded(t, nil, nil, guard)
	base := e.caddy.URL() + "/ds/"
	auth := "Authorization: Basic " + base64.StdEncoding.EncodeToString([]byte("writer:"+readerPassword))

	benchAppendAndSSE(t, "auth-", "--url", base, "--header", auth)
	common := []string{"--url", base, "--header", auth, "--streams", "5", "--writers", "2", "--prefix", "auth-pop-"}
	if res := runBench(t, append([]string{"--mode", "populate"}, common...)...); res.Ops != 5 || res.Errors != 0 {
		t.Fatalf("populate with the credentials: ops %d, errors %d %q", res.Ops, res.Errors, res.ErrorSamples)
	}
	if res := runBench(t, append([]string{"--mode", "verify"}, common...)...); res.OK != 5 || res.Errors != 0 {
		t.Fatalf("verify with the credentials: ok %d, errors %d %q", res.OK, res.Errors, res.ErrorSamples)
	}
	if res := runBench(t, "--url", base, "--header", auth, "--mode", "read", "--stream", "auth-pop-3"); res.Ops <= 0 || res.Errors != 0 {
		t.Fatalf("read with the credentials: ops %d, errors %d %q", res.Ops, res.Errors, res.ErrorSamples)
	}

	res, _ := runBenchFailing(t, "no operation succeeded", "--url", base, "--mode", "read", "--stream", "auth-pop-3")
	if res.Errors != 1 || len(res.ErrorSamples) != 1 || !strings.HasPrefix(res.ErrorSamples[0], "401") {
		t.Errorf("read without the credentials: errors %d %q, want one 401", res.Errors, res.ErrorSamples)
	}
}

// TestBenchOverTLS runs the benchmark command against the module on
// versitygw behind an HTTPS site whose certificate Caddy's own local CA
// issued (tls internal): with --cacert naming that CA's root, appends and
// SSE feeds go through; without it the certificate is refused.
func TestBenchOverTLS(t *testing.T) {
	v := testenv.NewVersity(t)
	storage := caddytest.S3Storage(t, v, v.Endpoint)
	caddyfile := "{\n\tpersist_config off\n\tskip_install_trust\n\tauto_https disable_redirects\n}\n\n" +
		"https://localhost:{$" + caddytest.PortEnv + "} {\n\tbind 127.0.0.1\n\ttls internal\n" +
		"\tpicomq {\n\t\tstorage " + strconv.Quote(storage) + "\n\t}\n}\n"
	c := caddytest.Start(t, caddytest.Options{Caddyfile: caddyfile, Env: caddytest.S3Env(v), ReadyTimeout: 90 * time.Second})
	var root string
	filepath.WalkDir(c.DataDir(), func(path string, d os.DirEntry, err error) error {
		if err == nil && d.Name() == "root.crt" && strings.Contains(path, filepath.Join("pki", "authorities", "local")) {
			root = path
		}
		return nil
	})
	if root == "" {
		t.Fatalf("no root.crt of Caddy's local CA under %s", c.DataDir())
	}
	base := "https://localhost:" + strconv.Itoa(c.Port()) + "/"

	benchAppendAndSSE(t, "tls-", "--url", base, "--cacert", root)
	res, _ := runBenchFailing(t, "no operation succeeded", "--url", base, "--mode", "read", "--stream", "tls-app-0")
	if res.Errors != 1 || len(res.ErrorSamples) != 1 || !strings.Contains(res.ErrorSamples[0], "certificate") {
		t.Errorf("read without the CA: errors %d %q, want the certificate refused", res.Errors, res.ErrorSamples)
	}
}

// benchAppendAndSSE runs a short append run and a short SSE fan-out with
// args (the URL and how to reach it) on streams named after prefix, and
// fails the test unless both succeed with no error and every event arrives.
func benchAppendAndSSE(t *testing.T, prefix string, args ...string) {
	t.Helper()
	res := runBench(t, append(args, "--mode", "append", "--writers", "4", "--streams", "2", "--duration", "1s",
		"--prefix", prefix+"app-")...)
	if res.Ops <= 0 || res.Errors != 0 {
		t.Fatalf("append: ops %d, errors %d %q", res.Ops, res.Errors, res.ErrorSamples)
	}
	res = runBench(t, append(args, "--mode", "sse", "--subscribers", "10", "--rate", "20", "--duration", "1s",
		"--prefix", prefix+"sse-")...)
	if res.Ops < 5 || res.Errors != 0 || res.Delivered != res.Expected {
		t.Fatalf("sse: ops %d, errors %d, delivered %d of %d %q", res.Ops, res.Errors, res.Delivered, res.Expected, res.ErrorSamples)
	}
}

// TestBenchPicoSSE runs the benchmark command's SSE fan-out with Pico feeds
// against a Pico handler on versitygw, through a recording proxy: every
// subscriber gets every record, the feeds ask in Pico's terms (seq=, not
// offset=), and when the server recycles their responses they resume from
// the next_seq of the control events they read.
func TestBenchPicoSSE(t *testing.T) {
	e := picoStart(t, nil, []string{"sse_reconnect_interval 500ms"})
	target, err := url.Parse(e.caddy.URL())
	if err != nil {
		t.Fatal(err)
	}
	rp := httputil.NewSingleHostReverseProxy(target)
	var mu sync.Mutex
	var queries []string
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && strings.Contains(r.URL.RawQuery, "live=sse") {
			mu.Lock()
			queries = append(queries, r.URL.RawQuery)
			mu.Unlock()
		}
		rp.ServeHTTP(w, r)
	}))
	defer front.Close()

	const subs = 50
	res := runBench(t, "--url", front.URL+"/pico/", "--mode", "sse", "--protocol", "pico", "--subscribers", strconv.Itoa(subs),
		"--rate", "20", "--duration", "2s", "--prefix", "bench-pico-sse-", "--pid", "caddy="+strconv.Itoa(e.caddy.PID()))
	if res.Ops < 10 || res.Errors != 0 {
		t.Fatalf("pico sse: ops %d errors %d %q", res.Ops, res.Errors, res.ErrorSamples)
	}
	if res.Subscribers != subs || res.Expected != res.Ops*subs || res.Delivered != res.Expected || res.Lost != 0 {
		t.Errorf("pico sse: delivered %d of %d expected (%d appends, %d subscribers), lost %d",
			res.Delivered, res.Expected, res.Ops, res.Subscribers, res.Lost)
	}
	r := picoDo(e, "HEAD", "/pico/bench-pico-sse-0", nil)
	if got := r.Header.Get("Pico-Next-Seq"); r.Status != http.StatusOK || got != strconv.FormatInt(res.Ops, 10) {
		t.Errorf("HEAD after the run: %d, Pico-Next-Seq %q, want %d", r.Status, got, res.Ops)
	}
	mu.Lock()
	defer mu.Unlock()
	resumed := 0
	for _, q := range queries {
		v, err := url.ParseQuery(q)
		if err != nil || v.Has("offset") || !v.Has("seq") {
			t.Fatalf("an SSE request asked %q", q)
		}
		if n, err := strconv.Atoi(v.Get("seq")); err == nil && n > 0 {
			resumed++
		}
	}
	// Responses recycle every 500 ms of a run of 2 s or more: each feed
	// reconnects a few times, from where its last control event said.
	if len(queries) < 2*subs || resumed < subs {
		t.Errorf("%d SSE requests, %d of them resuming past seq 0; want at least %d and %d", len(queries), resumed, 2*subs, subs)
	}
}

// A Caddy URL that no route serves answers every request with an empty
// 200: here the module is mounted under /ds/ and the bench pointed at the
// root, as a URL whose host does not match the site's would be. Appends
// are counted as success (a respond route, the ceiling, is measured that
// way on purpose) but the run is warned about, and the same run under /ds/
// is not; SSE feeds answered so are errors, and the run fails.
func TestBenchOffRoute(t *testing.T) {
	e := picoStart(t, nil, nil)
	off := e.caddy.URL() + "/"

	t.Run("append", func(t *testing.T) {
		args := []string{"--mode", "append", "--writers", "2", "--streams", "2", "--duration", "1s"}
		res, output, err := execBench(t, append([]string{"--url", off}, args...)...)
		if err != nil {
			t.Fatalf("bench failed: %v", err)
		}
		if res.Ops == 0 || len(res.Warnings) != 1 || !strings.Contains(res.Warnings[0], "no answer carried Stream-Next-Offset") {
			t.Errorf("off the module's route: ops %d, warnings %q; want appends counted and one warning", res.Ops, res.Warnings)
		}
		if !strings.Contains(output, "warning    no answer carried Stream-Next-Offset") {
			t.Errorf("the text summary has no warning")
		}
		if res = runBench(t, append([]string{"--url", e.caddy.URL() + "/ds/"}, args...)...); res.Ops == 0 || res.Errors != 0 {
			t.Errorf("on the module's route: ops %d errors %d %q", res.Ops, res.Errors, res.ErrorSamples)
		}
	})

	t.Run("sse", func(t *testing.T) {
		res, _ := runBenchFailing(t, "no subscriber received a record", "--url", off, "--mode", "sse",
			"--subscribers", "2", "--rate", "20", "--duration", "1s", "--timeout", "1s")
		if res.Errors == 0 || len(res.ErrorSamples) == 0 || !strings.Contains(res.ErrorSamples[0], "not an SSE feed") {
			t.Errorf("errors %d %q: want the empty 200s to the feeds counted", res.Errors, res.ErrorSamples)
		}
	})
}
