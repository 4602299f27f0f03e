package picomq

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
)

// benchServer is a server that counts the requests it gets and answers
// every one with 404.
func benchServer(t *testing.T) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		http.NotFound(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv, &n
}

// execBench runs `caddy picomq bench --quiet` with args and returns what
// it wrote to stdout (the summary); cobra's own error report is dropped.
func execBench(t *testing.T, args ...string) (string, error) {
	t.Helper()
	return execBenchStderr(t, io.Discard, args...)
}

// execBenchStderr is execBench with the command's stderr (warnings, and
// cobra's error report) written to stderr.
func execBenchStderr(t *testing.T, stderr io.Writer, args ...string) (string, error) {
	t.Helper()
	var out bytes.Buffer
	cmd := benchCommand()
	cmd.SetArgs(append([]string{"--quiet"}, args...))
	cmd.SetOut(&out)
	cmd.SetErr(stderr)
	err := cmd.Execute()
	return out.String(), err
}

// Bad input to the bench command fails it with a message naming the flag,
// before any request reaches the server.
func TestBenchCommandRefusesBadInput(t *testing.T) {
	srv, requests := benchServer(t)
	base := srv.URL + "/"
	missing := filepath.Join(t.TempDir(), "missing")
	notPEM := filepath.Join(t.TempDir(), "ca.txt")
	if err := os.WriteFile(notPEM, []byte("not a certificate\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"unknown mode", []string{"--url", base, "--mode", "soak"}, `unknown mode "soak"`},
		{"zero writers", []string{"--url", base, "--writers", "0"}, "--writers 0: want at least 1"},
		{"negative streams", []string{"--url", base, "--streams", "-5"}, "--streams -5: want at least 1"},
		{"negative size", []string{"--url", base, "--size", "-1"}, `size "-1"`},
		{"zero duration", []string{"--url", base, "--duration", "0s"}, "--duration 0s: want more than 0"},
		{"negative rate", []string{"--url", base, "--rate", "-1"}, "--rate -1: want 0 or more"},
		{"zero timeout", []string{"--url", base, "--timeout", "0s"}, "--timeout 0s: want more than 0"},
		{"negative timeout", []string{"--url", base, "--timeout", "-1s"}, "--timeout -1s: want more than 0"},
		{"zero readers", []string{"--url", base, "--mode", "read", "--stream", "s", "--readers", "0"}, "--readers 0: want at least 1"},
		{"negative readers", []string{"--url", base, "--mode", "read", "--stream", "s", "--readers", "-3"}, "--readers -3: want at least 1"},
		{"no url", nil, "--url is required"},
		{"not http", []string{"--url", "ftp://example.invalid/"}, "want an http:// or https:// URL"},
		{"no host", []string{"--url", "http://"}, "no host"},
		{"no path", []string{"--url", srv.URL}, "end it with a slash"},
		{"pid of no process", []string{"--url", base, "--pid", "caddy=1073741824"}, "--pid caddy=1073741824: cannot read the process"},
		{"pid without a name", []string{"--url", base, "--pid", "1234"}, "want NAME=PID"},
		{"header without a colon", []string{"--url", base, "--header", "Authorization Bearer x"}, `--header "Authorization Bearer x": want NAME: VALUE`},
		{"header content type", []string{"--url", base, "--header", "Content-Type: text/plain"}, "use --content-type"},
		{"cacert missing", []string{"--url", base, "--cacert", missing}, "--cacert: open " + missing},
		{"cacert not PEM", []string{"--url", base, "--cacert", notPEM}, "no PEM certificate in it"},
		{"an argument", []string{"--url", base, "append"}, `unknown command "append"`},
		{"rate NaN", []string{"--url", base, "--rate", "NaN"}, "--rate NaN: want 0 or more"},
		{"mark not a URL", []string{"--url", base, "--mark", "localhost:9999/mark"}, `--mark "localhost:9999/mark": want an http:// or https:// URL`},
		// Files the run would write are opened before it, not after
		// minutes of load.
		{"json in no directory", []string{"--url", base, "--json", filepath.Join(missing, "r.json")}, "--json: open " + missing},
		{"cpuprofile in no directory", []string{"--url", base, "--cpuprofile", filepath.Join(missing, "cpu.out")}, "--cpuprofile: open " + missing},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := requests.Load()
			_, err := execBench(t, tt.args...)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %v, want one containing %q", err, tt.want)
			}
			if n := requests.Load() - before; n != 0 {
				t.Errorf("the server got %d requests before the input was refused", n)
			}
		})
	}
}

// A run that failed at what it was for exits non-zero after writing its
// figures: verify of streams that are not there, and runs in which no
// request succeeded (here every one is answered 404).
func TestBenchCommandFailsWhenNothingSucceeds(t *testing.T) {
	srv, _ := benchServer(t)
	base := srv.URL + "/"
	dead := httptest.NewServer(http.NotFoundHandler())
	deadURL := dead.URL
	dead.Close()
	tests := []struct {
		name       string
		url        string // base when empty
		args       []string
		wantErr    string
		wantErrors int64
	}{
		{"verify", "", []string{"--mode", "verify", "--streams", "3", "--writers", "2"}, "verify failed: 0 of 3 streams mismatched, 3 could not be read", 3},
		{"read", "", []string{"--mode", "read", "--stream", "gone", "--readers", "2"}, "no operation succeeded (errors: 2)", 2},
		{"populate", "", []string{"--mode", "populate", "--streams", "4", "--writers", "2", "--create=false"}, "no operation succeeded (errors: 4)", 4},
		{"read, nobody listening", deadURL + "/", []string{"--mode", "read", "--stream", "s"}, "no operation succeeded (errors: 1)", 1},
		{"append", "", []string{"--mode", "append", "--streams", "1", "--writers", "1", "--create=false", "--duration", "200ms"}, "no operation succeeded", -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "result.json")
			url := base
			if tt.url != "" {
				url = tt.url
			}
			summary, err := execBench(t, append([]string{"--url", url, "--json", path}, tt.args...)...)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %v, want one containing %q", err, tt.wantErr)
			}
			b, rerr := os.ReadFile(path)
			if rerr != nil {
				t.Fatalf("no JSON result: %v", rerr)
			}
			var res struct {
				Errors       int64    `json:"errors"`
				ErrorSamples []string `json:"error_samples"`
			}
			if err := json.Unmarshal(b, &res); err != nil {
				t.Fatal(err)
			}
			if res.Errors <= 0 || tt.wantErrors >= 0 && res.Errors != tt.wantErrors || len(res.ErrorSamples) == 0 {
				t.Errorf("JSON errors %d %q, want %d and samples", res.Errors, res.ErrorSamples, tt.wantErrors)
			}
			if want := fmt.Sprintf("errors     %d\n", res.Errors); !strings.Contains(summary, want) || !strings.Contains(summary, res.ErrorSamples[0]) {
				t.Errorf("the summary lacks %q and the first error sample:\n%s", want, summary)
			}
		})
	}
}

// A run whose end mark is refused still writes its figures (here of
// appends the server refuses), with the error in "failure": the window's S3 counts behind the mark are missing,
// and a reader of the JSON alone (the matrix) took the figures as whole.
func TestBenchCommandWritesARunsFailure(t *testing.T) {
	srv, _ := benchServer(t)
	mark := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("phase") == "end" {
			http.Error(w, "no end", http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(mark.Close)
	path := filepath.Join(t.TempDir(), "result.json")
	_, err := execBench(t, "--url", srv.URL+"/", "--json", path, "--mark", mark.URL+"/mark",
		"--streams", "1", "--writers", "1", "--create=false", "--duration", "200ms")
	if err == nil || !strings.Contains(err.Error(), "mark end") {
		t.Fatalf("error %v, want the refused end mark", err)
	}
	b, rerr := os.ReadFile(path)
	if rerr != nil {
		t.Fatalf("no JSON result: %v", rerr)
	}
	var res struct {
		Ops     int64  `json:"ops"`
		Failure string `json:"failure"`
	}
	if err := json.Unmarshal(b, &res); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(res.Failure, "mark end") {
		t.Errorf("JSON failure %q, want the refused end mark", res.Failure)
	}
}

// The --json file is opened before the run; a run that ends with no
// result to write (its streams could not be created) leaves no empty file
// behind that a script would take for one.
func TestBenchCommandNoResultLeavesNoJSONFile(t *testing.T) {
	srv, _ := benchServer(t)
	path := filepath.Join(t.TempDir(), "result.json")
	_, err := execBench(t, "--url", srv.URL+"/", "--json", path, "--streams", "1", "--writers", "1", "--duration", "200ms")
	if err == nil || !strings.Contains(err.Error(), "creating") {
		t.Fatalf("error %v, want the failed create", err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("%s: %v; want no file", path, err)
	}
	// Nor does a run refused after the file was opened.
	_, err = execBench(t, "--url", srv.URL+"/", "--json", path, "--cpuprofile", filepath.Join(t.TempDir(), "no", "cpu.out"))
	if err == nil || !strings.Contains(err.Error(), "--cpuprofile") {
		t.Fatalf("error %v, want the --cpuprofile one", err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("after a refused --cpuprofile, %s: %v; want no file", path, err)
	}
}

// The bench's examples, in its help and in the README, run as written
// against the example Caddyfiles: each --url is on the site those serve
// (a URL whose host does not match the site's gets Caddy's empty 200 to
// every request, which the bench counts as success), the help's parse,
// and every mode has one.
func TestBenchExamplesMatchExampleCaddyfiles(t *testing.T) {
	sites := map[string]string{} // Caddyfile: its site address
	for _, f := range []string{"examples/Caddyfile", "examples/pico.Caddyfile"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		m := regexp.MustCompile(`(?m)^(https?://\S+) \{$`).FindSubmatch(b)
		if m == nil {
			t.Fatalf("%s: no site address", f)
		}
		sites[f] = string(m[1])
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, bench, _ := strings.Cut(string(readme), "### Benchmarking")
	help := benchCommand().Example
	urlFlag := regexp.MustCompile(`--url (\S+)`)
	for name, text := range map[string]string{"help": help, "README": bench[:strings.Index(bench, "| flag |")]} {
		lines := 0
		for line := range strings.Lines(text) {
			m := urlFlag.FindStringSubmatch(line)
			if m == nil {
				continue
			}
			lines++
			want := sites["examples/Caddyfile"] + "/"
			if strings.Contains(line, "--protocol pico") {
				want = sites["examples/pico.Caddyfile"] + "/pico/"
			}
			if m[1] != want {
				t.Errorf("%s: example URL %s, want %s (the example Caddyfiles' site):\n%s", name, m[1], want, line)
			}
		}
		if lines < 6 {
			t.Errorf("%s: %d examples with a --url, want one per mode and the Pico one", name, lines)
		}
	}
	modes := map[string]bool{}
	for line := range strings.Lines(help) {
		args := strings.Fields(line)
		if len(args) < 3 || args[0] != "caddy" {
			continue
		}
		cmd := benchCommand()
		if err := cmd.ParseFlags(args[3:]); err != nil {
			t.Errorf("help example does not parse: %v\n%s", err, line)
			continue
		}
		mode, _ := cmd.Flags().GetString("mode")
		modes[mode] = true
	}
	for _, mode := range []string{"append", "sse", "read", "populate", "verify"} {
		if !modes[mode] {
			t.Errorf("the help has no example of %s mode", mode)
		}
	}
}

// A flag that only some modes read names them in its help, so that a
// newcomer does not expect --streams to change a read or --warmup to warm
// up a populate.
func TestBenchFlagsHelp(t *testing.T) {
	modes := map[string][]string{
		"writers":     {"append", "populate", "verify"},
		"streams":     {"append", "populate", "verify"},
		"duration":    {"append", "sse"},
		"warmup":      {"append", "sse"},
		"subscribers": {"sse"},
		"protocol":    {"sse"},
		"stream":      {"read"},
		"readers":     {"read"},
		"create":      {"populate"},
	}
	f := benchCommand().Flags()
	for name, ms := range modes {
		usage := f.Lookup(name).Usage
		for _, m := range ms {
			if !strings.Contains(usage, m) {
				t.Errorf("--%s: usage %q does not name %s mode", name, usage, m)
			}
		}
	}
	// --pid names every figure the summary gives of the process.
	for _, figure := range []string{"CPU time", "page faults", "RSS", "peak"} {
		if pid := f.Lookup("pid").Usage; !strings.Contains(pid, figure) {
			t.Errorf("--pid: usage %q does not name %s, which the summary reports", pid, figure)
		}
	}
	if json := f.Lookup("json").Usage; !strings.Contains(json, "instead of the text summary") {
		t.Errorf("--json: usage %q does not say - replaces the summary", json)
	}
}

// A flag given to a mode that does not read it gets one warning line that
// names it, and the run goes on; flags left at their defaults, and flags
// the mode reads, get none. The JSON result of such a run leaves the
// settings the mode does not use at zero rather than echoing defaults.
func TestBenchCommandWarnsOfUnusedFlags(t *testing.T) {
	srv, _ := benchServer(t)
	base := srv.URL + "/"
	tests := []struct {
		name string
		args []string
		warn string // "" for no warning
	}{
		{"read with append's flags", []string{"--mode", "read", "--stream", "s", "--writers", "2", "--streams", "10"},
			"bench: warning: read mode does not use --streams, --writers; ignored\n"},
		{"read with its own flags", []string{"--mode", "read", "--stream", "s", "--readers", "2"}, ""},
		{"populate with a rate and a warm-up", []string{"--mode", "populate", "--streams", "1", "--create=false", "--rate", "5", "--warmup", "1s"},
			"bench: warning: populate mode does not use --rate, --warmup; ignored\n"},
		{"verify with --create", []string{"--mode", "verify", "--streams", "1", "--create=false"},
			"bench: warning: verify mode does not use --create; ignored\n"},
		{"append with its own flags", []string{"--writers", "1", "--streams", "1", "--create=false", "--duration", "100ms", "--size", "8"}, ""},
		// Refused over the flag: an "ignored" above the refusal said the
		// opposite of the error.
		{"read with --protocol pico", []string{"--mode", "read", "--stream", "s", "--protocol", "pico"}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "result.json")
			var stderr bytes.Buffer
			// The server answers 404: each run fails for want of a
			// success, which says nothing of its flags; a refused run
			// fails before it starts.
			_, err := execBenchStderr(t, &stderr, append([]string{"--url", base, "--json", path}, tt.args...)...)
			if err == nil || !strings.Contains(err.Error(), "no operation succeeded") && !strings.Contains(err.Error(), "verify failed") &&
				!strings.Contains(err.Error(), "is for sse mode") {
				t.Fatalf("error %v, want the run to fail against the 404 server, or be refused", err)
			}
			warnings := ""
			for line := range strings.Lines(stderr.String()) {
				if strings.Contains(line, "warning") {
					warnings += line
				}
			}
			if warnings != tt.warn {
				t.Errorf("warnings %q, want %q (stderr %q)", warnings, tt.warn, stderr.String())
			}
		})
	}
}

// Read mode's JSON result does not carry the append defaults (64
// writers, 100 streams, the random prefix, 1024-byte size) as if they had
// shaped the run.
func TestBenchCommandReadResultLeavesOtherModesSettingsZero(t *testing.T) {
	srv, _ := benchServer(t)
	path := filepath.Join(t.TempDir(), "result.json")
	if _, err := execBench(t, "--url", srv.URL+"/", "--json", path, "--mode", "read", "--stream", "s", "--readers", "2"); err == nil {
		t.Fatal("a read of a 404 stream succeeded")
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("no JSON result: %v", err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	want := map[string]any{"mode": "read", "stream": "s", "readers": 2.0, "writers": 0.0, "streams": 0.0, "prefix": "", "size": 0.0, "rate": 0.0}
	for k, v := range want {
		if got, ok := m[k]; !ok || got != v {
			t.Errorf("%s = %v (present %v), want %v", k, got, ok, v)
		}
	}
}
