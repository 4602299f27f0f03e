package integration

import (
	"bufio"
	"context"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestStreamsAreNotActiveContent: a stream's Content-Type is the writer's
// choice, so one created as text/html or image/svg+xml is served as that
// to a browser that navigates to its URL. Without a policy of its own the
// page ran its scripts in the stream origin, where they could read every
// stream the visitor may read (same-origin fetches carry its cookies and
// cached Basic credentials) and write as the visitor. Every answer, reads
// of both protocols (catch-up, raw, long-poll, SSE) and errors alike,
// carries a Content-Security-Policy that sandboxes such a page and loads
// nothing for it.
func TestStreamsAreNotActiveContent(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy")
	}
	e := picoStart(t, []string{"long_poll_timeout 1s"}, nil)
	page := []byte(`<script>fetch("/ds/private?offset=-1",{credentials:"include"})</script>`)
	for _, ct := range []string{"text/html", "image/svg+xml"} {
		name := "/xss-" + strings.ReplaceAll(ct, "/", "-")
		e.create("/ds"+name, ct)
		next := e.append("/ds"+name, ct, page)
		reqs := []fhReq{
			{Method: http.MethodGet, Path: "/ds" + name},
			{Method: http.MethodGet, Path: "/ds" + name + "?offset=-1"},
			{Method: http.MethodGet, Path: "/ds" + name + "?offset=-1&live=long-poll"},
			{Method: http.MethodGet, Path: "/ds" + name + "?offset=" + next + "&live=long-poll"},
			{Method: http.MethodHead, Path: "/ds" + name},
			{Method: http.MethodGet, Path: "/ds/missing"},
			{Method: http.MethodGet, Path: "/pico" + name + "?format=raw"},
			{Method: http.MethodGet, Path: "/pico" + name + "?seq=0&format=raw"},
			{Method: http.MethodGet, Path: "/pico" + name + "?seq=0"},
			{Method: http.MethodGet, Path: "/pico/?prefix=/"},
		}
		for _, r := range reqs {
			resp := e.must(r)
			if resp.Status >= 500 {
				t.Errorf("%s %s: %s", r.Method, r.Path, resp)
			}
			checkSandboxed(t, r.Method+" "+r.Path, resp.Header)
		}
		for _, path := range []string{"/ds" + name + "?offset=-1&live=sse", "/pico" + name + "?seq=0&live=sse"} {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.caddy.URL()+path, nil)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := e.client.Do(req)
			if err != nil {
				t.Fatalf("GET %s: %v", path, err)
			}
			line, _ := bufio.NewReader(resp.Body).ReadString('\n')
			if resp.StatusCode != http.StatusOK || !strings.HasPrefix(line, "event:") {
				t.Errorf("GET %s: %d, first line %q", path, resp.StatusCode, line)
			}
			checkSandboxed(t, "GET "+path, resp.Header)
			resp.Body.Close()
			cancel()
		}
	}
}

// checkSandboxed fails the test unless h carries a Content-Security-Policy
// that sandboxes a document (no scripts, an opaque origin) and allows it
// no resources.
func checkSandboxed(t *testing.T, what string, h http.Header) {
	t.Helper()
	csp := h.Get("Content-Security-Policy")
	var sandbox, none bool
	for d := range strings.SplitSeq(csp, ";") {
		switch f := strings.Fields(d); {
		case len(f) == 1 && f[0] == "sandbox":
			sandbox = true // no allow-scripts, no allow-same-origin
		case len(f) == 2 && f[0] == "default-src" && f[1] == "'none'":
			none = true
		}
	}
	if !sandbox || !none {
		t.Errorf("%s: Content-Security-Policy %q, want sandbox and default-src 'none'", what, csp)
	}
}
