package integration

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// readmeSection returns the lines of README.md under the heading that is
// exactly heading, up to the next heading.
func readmeSection(t *testing.T, heading string) []string {
	t.Helper()
	root, err := caddytest.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	in := false
	for _, line := range strings.Split(string(b), "\n") {
		if in && strings.HasPrefix(line, "#") {
			break
		}
		if line == heading {
			in = true
			continue
		}
		if in {
			out = append(out, line)
		}
	}
	if len(out) == 0 {
		t.Fatalf("README.md has no section %q", heading)
	}
	return out
}

// readmeCode is a name in backquotes.
var readmeCode = regexp.MustCompile("`([^`]+)`")

// tableNames returns, for each row of the Markdown tables in lines, the
// names in backquotes of its first cell that match re.
func tableNames(lines []string, re *regexp.Regexp) map[string]bool {
	names := make(map[string]bool)
	for _, line := range lines {
		if !strings.HasPrefix(line, "| `") {
			continue
		}
		cells := strings.SplitN(line, "|", 3)
		for _, m := range readmeCode.FindAllStringSubmatch(cells[1], -1) {
			if re.MatchString(m[1]) {
				names[m[1]] = true
			}
		}
	}
	return names
}

// siteMetrics fetches target and returns the help text of each metric family
// and its samples.
func siteMetrics(target string) (help map[string]string, samples mScrape, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return nil, nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, nil, fmt.Errorf("GET %s: %w", target, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return nil, nil, fmt.Errorf("GET %s: %d %s", target, resp.StatusCode, b)
	}
	help = make(map[string]string)
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, "# HELP "); ok {
			name, text, _ := strings.Cut(rest, " ")
			help[name] = text
			continue
		}
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		s, err := mParseLine(line)
		if err != nil {
			return nil, nil, err
		}
		samples = append(samples, s)
	}
	if err := sc.Err(); err != nil {
		return nil, nil, fmt.Errorf("reading %s: %w", target, err)
	}
	return help, samples, nil
}

// TestReadmeMetricsOnASiteRoute serves the metrics as the README's Metrics
// section shows for a Caddy without its admin endpoint: Caddy's metrics
// handler in a handle /metrics block beside picomq, on versitygw. /metrics
// is not taken for a stream, every metric the section lists is there with
// its storage label, every picomq metric there is listed, and a setting
// that a metric's help text names is a subdirective of the Caddyfile
// section (an operator reads that text on the endpoint and looks the
// setting up).
func TestReadmeMetricsOnASiteRoute(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	listed := tableNames(readmeSection(t, "### Metrics"), regexp.MustCompile(`^picomq_[a-z_]+$`))
	options := tableNames(readmeSection(t, "## Caddyfile"), regexp.MustCompile(`^[a-z][a-z0-9_]*$`))
	if len(listed) < 10 || len(options) < 10 {
		t.Fatalf("README.md lists %d metrics and %d subdirectives; its tables were not read", len(listed), len(options))
	}

	v := testenv.NewVersity(t)
	storage := caddytest.S3Storage(t, v, v.Endpoint)
	c := caddytest.Start(t, caddytest.Options{
		Caddyfile: fmt.Sprintf(`{
	admin off
	persist_config off
}

http://:{$%s} {
	bind 127.0.0.1
	handle /metrics {
		metrics
	}
	picomq {
		storage %q
	}
}
`, caddytest.PortEnv, storage),
		Env:          caddytest.S3Env(v),
		ReadyTimeout: 90 * time.Second,
	})
	cl := newClient(t, c.URL(), true)
	cl.create(t, "/m", 30*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if r, err := cl.appendBody(ctx, "/m", []byte("x")); err != nil || r.status/100 != 2 {
		t.Fatalf("append: %v %v", r, err)
	}

	u, err := url.Parse(storage)
	if err != nil {
		t.Fatal(err)
	}
	bucket := "s3://" + u.Host + "/"
	help, samples, err := siteMetrics(c.URL() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	for name := range listed {
		if _, ok := help[name]; !ok {
			t.Errorf("README lists %s; /metrics has no such metric", name)
			continue
		}
		if got := samples.labelValues(name, "storage"); len(got) != 1 || !strings.HasPrefix(got[0], bucket) {
			t.Errorf("%s: storage labels %q, want one, of %s", name, got, bucket)
		}
	}
	var picomq []string
	for name := range help {
		if strings.HasPrefix(name, "picomq_") {
			picomq = append(picomq, name)
		}
	}
	sort.Strings(picomq)
	word := regexp.MustCompile(`\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b`)
	for _, name := range picomq {
		if !listed[name] {
			t.Errorf("/metrics has %s; the README does not list it", name)
		}
		for _, w := range word.FindAllString(help[name], -1) {
			if !options[w] && help["picomq_"+w] == "" {
				t.Errorf("%s: its help names %q, neither a subdirective of the README's Caddyfile section nor a metric: %q", name, w, help[name])
			}
		}
	}
	t.Logf("%d picomq metrics on the site's /metrics, %d listed in the README, %d subdirectives", len(picomq), len(listed), len(options))
}
