// Package conformance runs the official Durable Streams server conformance
// suite (npm @durable-streams/server-conformance-tests, pinned in
// package-lock.json) against Caddy with the picomq module, once on versitygw
// (through the testenv S3 proxy) and once on file:// storage. The same vitest
// run drives the module with the official client library
// (@durable-streams/client, client.test.ts) as an application would.
//
// Environment:
//
//	PICOMQ_CONFORMANCE_ALL=1          run every group, not just conformanceSelection
//	PICOMQ_CONFORMANCE_FILTER=REGEX   vitest -t pattern instead of the selection
//	PICOMQ_CONFORMANCE_BACKENDS=file  comma-separated subset of: versitygw, file
//	PICOMQ_CONFORMANCE_URL=URL        test a server that is already running instead
//	PICOMQ_CONFORMANCE_TIMEOUT=10m    bound on one vitest run
//	PICOMQ_CONFORMANCE_VERBOSE=1      stream vitest's own output to stderr
//	DS_SUBSCRIPTIONS=false            leave out the suite's subscription tests
//	                                  (they run by default)
package conformance

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// conformanceSelection is the part of the suite that must pass today, and
// "Official client" is client.test.ts (the client library's tests): one
// describe() title path per line ("Group" or "Group > Subgroup"); a line
// starting with "-" leaves that path out. Widen it as protocol features land;
// once it covers everything, PICOMQ_CONFORMANCE_ALL's behaviour is the default.
const conformanceSelection = `
Basic Stream Operations
Append Operations
Read Operations
Long-Poll Operations
HTTP Protocol
Browser Security Headers
TTL and Expiry Validation
Case-Insensitivity
Content-Type Validation
HEAD Metadata
Offset Validation and Resumability
Protocol Edge Cases
Long-Poll Edge Cases
TTL and Expiry Edge Cases
HEAD Metadata Edge Cases
TTL Expiration Behavior
Caching and ETag
Chunking and Large Payloads
Read-Your-Writes Consistency
SSE Mode
JSON Mode
Property-Based Tests (fast-check)
Idempotent Producer Operations
Stream Closure
Fork - Creation
Fork - Reading
Fork - Appending
Fork - Recursive
Fork - Live Modes
Fork - Deletion and Lifecycle
Fork - TTL and Expiry
Fork - JSON Mode
Fork - Edge Cases
Reserved subscription APIs
Official client
`

// longPollTimeout is the module's long_poll_timeout during the run; the suite
// is told the same through DS_LONG_POLL_MS and waits that long plus a second.
const longPollTimeout = 500 * time.Millisecond

const (
	envAll      = "PICOMQ_CONFORMANCE_ALL"
	envFilter   = "PICOMQ_CONFORMANCE_FILTER"
	envBackends = "PICOMQ_CONFORMANCE_BACKENDS"
	envURL      = "PICOMQ_CONFORMANCE_URL"
	envTimeout  = "PICOMQ_CONFORMANCE_TIMEOUT"
	envVerbose  = "PICOMQ_CONFORMANCE_VERBOSE"
)

// backend is one storage the module is tested on.
type backend struct {
	name    string
	storage func(t *testing.T) (url string, env []string)
}

var backends = []backend{
	{"versitygw", func(t *testing.T) (string, []string) {
		v := testenv.NewVersity(t)
		p, err := testenv.NewProxy(v.Endpoint)
		if err != nil {
			t.Fatalf("S3 proxy: %v", err)
		}
		t.Cleanup(func() { p.Close() })
		return caddytest.S3Storage(t, v, p.URL()), caddytest.S3Env(v)
	}},
	{"file", func(t *testing.T) (string, []string) {
		return "file://" + filepath.ToSlash(t.TempDir()), nil
	}},
}

func TestConformance(t *testing.T) {
	if testing.Short() {
		t.Skip("conformance suite: builds Caddy and runs the npm suite")
	}
	requireNode(t)
	ensureNodeModules(t)
	sel := selectionFromEnv(t)

	if url := os.Getenv(envURL); url != "" {
		runSuite(t, "external", strings.TrimSuffix(url, "/"), sel)
		return
	}
	for _, b := range backends {
		if !backendWanted(b.name) {
			continue
		}
		t.Run(b.name, func(t *testing.T) {
			storage, env := b.storage(t)
			// allow_loopback_webhooks: the suite's webhook receivers are on 127.0.0.1.
			c := caddytest.Start(t, caddytest.Options{
				Storage:    storage,
				Directives: []string{"long_poll_timeout " + longPollTimeout.String(), "allow_loopback_webhooks"},
				Env:        env,
			})
			runSuite(t, b.name, c.URL(), sel)
			// Shutdown must not hang on anything the suite left open.
			if err := c.Stop(); err != nil {
				t.Errorf("graceful stop after the suite: %v", err)
			}
		})
	}
}

func backendWanted(name string) bool {
	list := os.Getenv(envBackends)
	if list == "" {
		return true
	}
	for _, b := range strings.Split(list, ",") {
		if strings.TrimSpace(b) == name {
			return true
		}
	}
	return false
}

// selection decides which tests run: by title path when known to Go (to
// tell "not selected" from "skipped by the suite"), and by a vitest -t
// pattern for vitest itself.
type selection struct {
	include, exclude [][]string // title paths
	pattern          string     // vitest -t; empty runs everything
	opaque           bool       // pattern came from the user: Go cannot evaluate it
}

func selectionFromEnv(t *testing.T) selection {
	t.Helper()
	if p := os.Getenv(envFilter); p != "" {
		return selection{pattern: p, opaque: true}
	}
	if os.Getenv(envAll) == "1" || os.Getenv(envAll) == "true" {
		return selection{}
	}
	s, err := parseSelection(conformanceSelection)
	if err != nil {
		t.Fatalf("conformanceSelection: %v", err)
	}
	return s
}

func parseSelection(text string) (selection, error) {
	var s selection
	for _, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		excl := strings.HasPrefix(line, "-")
		line = strings.TrimSpace(strings.TrimPrefix(line, "-"))
		var path []string
		for _, p := range strings.Split(line, ">") {
			if p = strings.TrimSpace(p); p == "" {
				return s, fmt.Errorf("empty title in %q", line)
			}
			path = append(path, p)
		}
		if excl {
			s.exclude = append(s.exclude, path)
		} else {
			s.include = append(s.include, path)
		}
	}
	if len(s.include) == 0 {
		return s, errors.New("no group selected")
	}
	// vitest matches -t against the test's full name: the describe titles
	// and the test title joined by spaces.
	alt := func(paths [][]string) string {
		var parts []string
		for _, p := range paths {
			parts = append(parts, regexp.QuoteMeta(strings.Join(p, " ")))
		}
		return strings.Join(parts, "|")
	}
	s.pattern = "^(?:" + alt(s.include) + ") "
	if len(s.exclude) > 0 {
		s.pattern = "^(?!(?:" + alt(s.exclude) + ") )" + s.pattern[1:]
	}
	return s, nil
}

// selected reports whether the test at path (describe titles, then the test
// title) is part of the selection.
func (s selection) selected(path []string) bool {
	if s.pattern == "" || s.opaque {
		return true
	}
	under := func(prefixes [][]string) bool {
		for _, p := range prefixes {
			if len(path) > len(p) && slices.Equal(path[:len(p)], p) {
				return true
			}
		}
		return false
	}
	return under(s.include) && !under(s.exclude)
}

func requireNode(t *testing.T) {
	t.Helper()
	for _, tool := range []string{"node", "npm"} {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CI") != "" {
				t.Fatalf("%s not found: the conformance suite needs Node.js 18+ and npm", tool)
			}
			t.Skipf("%s not found: skipping the conformance suite", tool)
		}
	}
}

// ensureNodeModules runs npm ci unless node_modules was installed from the
// current package.json and package-lock.json (recorded in a stamp file).
func ensureNodeModules(t *testing.T) {
	t.Helper()
	h := sha256.New()
	for _, f := range []string{"package.json", "package-lock.json"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		h.Write(b)
	}
	want := hex.EncodeToString(h.Sum(nil))
	stamp := filepath.Join("node_modules", ".picomq-lock-sha256")
	if got, err := os.ReadFile(stamp); err == nil && string(got) == want {
		if _, err := os.Stat(vitestEntry); err == nil {
			return
		}
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "npm", "ci", "--no-audit", "--no-fund", "--prefer-offline")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("npm ci: %v\n%s", err, out)
	}
	if err := os.WriteFile(stamp, []byte(want), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("npm ci: installed the conformance suite in %s", time.Since(start).Round(time.Second))
}

const vitestEntry = "node_modules/vitest/vitest.mjs"

// The parts of vitest's JSON report that are read here.
type vitestReport struct {
	TestResults []struct {
		Name             string `json:"name"`
		Status           string `json:"status"`
		Message          string `json:"message"`
		AssertionResults []struct {
			AncestorTitles  []string `json:"ancestorTitles"`
			Title           string   `json:"title"`
			FullName        string   `json:"fullName"`
			Status          string   `json:"status"`
			FailureMessages []string `json:"failureMessages"`
		} `json:"assertionResults"`
	} `json:"testResults"`
}

type tally struct{ passed, failed, skipped int }

func (c tally) String() string {
	return fmt.Sprintf("%d passed, %d failed, %d skipped", c.passed, c.failed, c.skipped)
}

// runSuite runs vitest against baseURL and reports the outcome under name.
func runSuite(t *testing.T, name, baseURL string, sel selection) {
	t.Helper()
	dir := t.TempDir()
	report := filepath.Join(dir, "report.json")
	logPath := filepath.Join(dir, "vitest.log")

	timeout := 10 * time.Minute
	if s := os.Getenv(envTimeout); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			t.Fatalf("%s: %v", envTimeout, err)
		}
		timeout = d
	}
	if dl, ok := t.Deadline(); ok && time.Until(dl)-30*time.Second < timeout {
		timeout = time.Until(dl) - 30*time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()

	args := []string{vitestEntry, "run", "--reporter=dot", "--reporter=json", "--outputFile.json=" + report}
	if sel.pattern != "" {
		args = append(args, "--testNamePattern="+sel.pattern)
	}
	cmd := exec.CommandContext(ctx, "node", args...)
	subs := os.Getenv("DS_SUBSCRIPTIONS")
	if subs == "" {
		subs = "true"
	}
	cmd.Env = append(os.Environ(),
		"DS_SUBSCRIPTIONS="+subs,
		"DS_BASE_URL="+baseURL,
		fmt.Sprintf("DS_LONG_POLL_MS=%d", longPollTimeout.Milliseconds()),
		"NO_COLOR=1",
	)
	// vitest may start workers: run it in its own process group and end the
	// whole group if it outlives the timeout.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 10 * time.Second
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	var out io.Writer = logf
	if os.Getenv(envVerbose) != "" {
		out = io.MultiWriter(logf, os.Stderr)
	}
	cmd.Stdout, cmd.Stderr = out, out

	start := time.Now()
	runErr := cmd.Run()
	elapsed := time.Since(start).Round(100 * time.Millisecond)
	if ctx.Err() != nil {
		t.Errorf("conformance (%s): vitest killed after %s (%s)", name, elapsed, envTimeout)
	}

	logTail := func() string {
		b, _ := os.ReadFile(logPath)
		if len(b) > 32<<10 {
			b = b[len(b)-32<<10:]
		}
		return string(b)
	}
	raw, err := os.ReadFile(report)
	var rep vitestReport
	if err == nil {
		err = json.Unmarshal(raw, &rep)
	}
	if err != nil {
		t.Fatalf("conformance (%s): no vitest report (%v; vitest: %v)\n%s", name, err, runErr, logTail())
	}

	var total tally
	notSelected := 0
	groups := map[string]*tally{}
	var order []string
	var failures []string
	for _, file := range rep.TestResults {
		if file.Status == "failed" && len(file.AssertionResults) == 0 {
			t.Errorf("conformance (%s): %s failed to load: %s", name, file.Name, file.Message)
		}
		for _, r := range file.AssertionResults {
			path := append(slices.Clone(r.AncestorTitles), r.Title)
			if !sel.selected(path) {
				notSelected++
				continue
			}
			group := "(top level)"
			if len(r.AncestorTitles) > 0 {
				group = r.AncestorTitles[0]
			}
			g := groups[group]
			if g == nil {
				g = &tally{}
				groups[group] = g
				order = append(order, group)
			}
			switch r.Status {
			case "passed":
				g.passed++
				total.passed++
			case "failed":
				g.failed++
				total.failed++
				failures = append(failures, fmt.Sprintf("  FAIL %s: %s", r.FullName, failureSummary(r.FailureMessages)))
			default:
				g.skipped++
				total.skipped++
			}
		}
	}

	var b strings.Builder
	fmt.Fprintf(&b, "conformance (%s) against %s, %s:\n", name, baseURL, elapsed)
	for _, g := range order {
		// With a user's filter, Go cannot tell the groups it left out.
		if c := groups[g]; !sel.opaque || c.passed+c.failed > 0 {
			fmt.Fprintf(&b, "  %-40s %s\n", g+":", c)
		}
	}
	const maxFailures = 150
	for i, f := range failures {
		if i == maxFailures {
			fmt.Fprintf(&b, "  ... and %d more failures\n", len(failures)-maxFailures)
			break
		}
		b.WriteString(f + "\n")
	}
	t.Log(b.String())

	line := fmt.Sprintf("conformance (%s): %s", name, total)
	switch {
	case sel.opaque:
		line += " (skipped includes tests " + envFilter + " left out)"
	case notSelected > 0:
		line += fmt.Sprintf(" (%d not selected; %s=1 runs them)", notSelected, envAll)
	}
	t.Log(line)

	if total.passed+total.failed == 0 {
		t.Errorf("conformance (%s): no test ran (vitest: %v)\n%s", name, runErr, logTail())
	}
	if total.failed > 0 {
		t.Errorf("conformance (%s): %d of %d tests failed", name, total.failed, total.passed+total.failed)
	}
}

// failureSummary is the first line of a test's first failure message.
func failureSummary(msgs []string) string {
	if len(msgs) == 0 {
		return "(no message)"
	}
	msg, _, _ := strings.Cut(msgs[0], "\n")
	// vitest's JSON report gives a timed-out test the stack captured when the
	// test was declared, not the timeout's message.
	if msg == "Error: STACK_TRACE_ERROR" {
		return "timed out"
	}
	if len(msg) > 300 {
		msg = msg[:300] + "..."
	}
	return msg
}

func TestSelection(t *testing.T) {
	s, err := parseSelection("A.B\nStream Closure\n-Stream Closure > Idem (x)\n")
	if err != nil {
		t.Fatal(err)
	}
	if want := `^(?!(?:Stream Closure Idem \(x\)) )(?:A\.B|Stream Closure) `; s.pattern != want {
		t.Errorf("pattern = %s, want %s", s.pattern, want)
	}
	for _, c := range []struct {
		path []string
		want bool
	}{
		{[]string{"A.B", "t"}, true},
		{[]string{"A.B"}, false}, // a group title alone is not a test
		{[]string{"Stream Closure", "Close Operations", "t"}, true},
		{[]string{"Stream Closure", "Idem (x)", "t"}, false},
		{[]string{"Fork - A.B", "t"}, false},
	} {
		if got := s.selected(c.path); got != c.want {
			t.Errorf("selected(%q) = %v, want %v", c.path, got, c.want)
		}
	}
	if _, err := parseSelection(conformanceSelection); err != nil {
		t.Errorf("conformanceSelection: %v", err)
	}
	if _, err := parseSelection("-A\n"); err == nil {
		t.Error("a selection with only exclusions was accepted")
	}
}
