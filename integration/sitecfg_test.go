package integration

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// siteMount is where a site serves one protocol: the URL path prefix a
// client uses, and the protocol behind it.
type siteMount struct {
	prefix string // such as "/app/ds"; streams are prefix + "/name"
	pico   bool
}

// tag sets the mount's stream names apart from those of the site's other
// mounts, which share its storage.
func (m siteMount) tag() string { return strings.ReplaceAll(m.prefix, "/", "-") }

// siteResp is a response read in full, its body decoded from gzip when it
// came encoded; encoding is the Content-Encoding it came with.
type siteResp struct {
	status   int
	header   http.Header
	body     []byte
	encoding string
}

func (r *siteResp) String() string {
	return fmt.Sprintf("%d %q", r.status, truncate(string(r.body), 200))
}

// siteClient speaks to one site the way a browser does: it asks for gzip
// (Accept-Encoding: gzip) and decodes what comes back itself, so that the
// test sees what encoding each response carried.
type siteClient struct {
	origin string
	hc     *http.Client
	dials  *atomic.Int64 // connections the client opened
	// admin is the admin address of the Caddy the module runs in, whose
	// open subscribers gauge shows a long-poll open.
	admin string
	// longPolls is held by a check while it has a long-poll open on the
	// site (the mounts' checks run side by side), so that the gauge
	// counts its long-poll alone.
	longPolls *sync.Mutex
}

// holdLongPolls takes sc.longPolls and waits for every long-poll a check
// before held it for to have ended (the gauge comes down just after its
// client has the answer); the function it returns lets go, once however
// often it is called.
func (c *siteClient) holdLongPolls(t *testing.T) func() {
	t.Helper()
	c.longPolls.Lock()
	ok := false
	defer func() {
		if !ok {
			c.longPolls.Unlock()
		}
	}()
	fhWaitLongPolls(t, c.admin, 0)
	ok = true
	return sync.OnceFunc(c.longPolls.Unlock)
}

// do sends one request and reads the whole response.
func (c *siteClient) do(ctx context.Context, method, path string, hdr http.Header, body []byte) (*siteResp, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.origin+path, rd)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept-Encoding", "gzip")
	for k, vs := range hdr {
		req.Header[k] = vs
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("%s %s: body after %d: %w", method, path, resp.StatusCode, err)
	}
	r := &siteResp{status: resp.StatusCode, header: resp.Header, body: raw, encoding: resp.Header.Get("Content-Encoding")}
	if r.encoding == "gzip" {
		zr, err := gzip.NewReader(bytes.NewReader(raw))
		if err != nil {
			return nil, fmt.Errorf("%s %s: gzip: %w", method, path, err)
		}
		if r.body, err = io.ReadAll(zr); err != nil {
			return nil, fmt.Errorf("%s %s: gzip: %w", method, path, err)
		}
	}
	return r, nil
}

// openEvents opens an SSE read and delivers its events as they arrive;
// the feed ends with the test.
func (c *siteClient) openEvents(t *testing.T, path string) (<-chan sseEvent, <-chan error, *http.Response) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.origin+path, nil)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	req.Header.Set("Accept-Encoding", "gzip")
	resp, err := c.hc.Do(req)
	if err != nil {
		cancel()
		t.Fatalf("SSE %s: %v", path, err)
	}
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		cancel()
		t.Fatalf("SSE %s: %s", path, resp.Status)
	}
	evc := make(chan sseEvent, 64)
	errc := make(chan error, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		var body io.Reader = resp.Body
		if resp.Header.Get("Content-Encoding") == "gzip" {
			zr, err := gzip.NewReader(resp.Body)
			if err != nil {
				errc <- fmt.Errorf("gzip: %w", err)
				return
			}
			body = zr
		}
		br := bufio.NewReader(body)
		for {
			ev, err := readSSEEvent(br)
			if err != nil {
				errc <- err
				return
			}
			select {
			case evc <- ev:
			case <-ctx.Done():
				return
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		resp.Body.Close()
		<-done
	})
	return evc, errc, resp
}

// siteProto is what the checks need to know of one protocol.
type siteProto struct {
	appendStatus int
	readAll      string // query of a catch-up read from the start
	// tail is the query that starts a live read at r's tail (r answered
	// a read), with live= appended by the caller.
	tail func(r *siteResp) string
	// bodies are the records of a read's body (Durable Streams: the bytes).
	bodies func(t *testing.T, b []byte) string
	// event is the record bodies an SSE data event carries.
	event func(ev sseEvent) (string, bool)
}

// protoOf is what the checks need to know of m's protocol.
func protoOf(m siteMount) siteProto {
	if !m.pico {
		return siteProto{
			appendStatus: http.StatusNoContent,
			readAll:      "offset=-1",
			tail:         func(r *siteResp) string { return "offset=" + r.header.Get("Stream-Next-Offset") },
			bodies:       func(_ *testing.T, b []byte) string { return string(b) },
			event:        func(ev sseEvent) (string, bool) { return ev.data, ev.event == "data" },
		}
	}
	bodies := func(t *testing.T, b []byte) string {
		t.Helper()
		var recs []struct {
			Body string `json:"body"`
		}
		if err := json.Unmarshal(b, &recs); err != nil {
			t.Fatalf("Pico records %q: %v", b, err)
		}
		var s strings.Builder
		for _, r := range recs {
			s.WriteString(r.Body)
		}
		return s.String()
	}
	return siteProto{
		appendStatus: http.StatusOK,
		readAll:      "seq=0",
		tail:         func(r *siteResp) string { return "seq=" + r.header.Get("Pico-Next-Seq") },
		bodies:       bodies,
		event: func(ev sseEvent) (string, bool) {
			var recs []struct {
				Body string `json:"body"`
			}
			if ev.event != "data" || json.Unmarshal([]byte(ev.data), &recs) != nil || len(recs) != 1 {
				return "", false
			}
			return recs[0].Body, true
		},
	}
}

// siteCase is one Caddyfile users write around the module.
type siteCase struct {
	name string
	// caddyfile is the whole Caddyfile for a storage URL; sites listen on
	// {$CADDYTEST_PORT}.
	caddyfile func(storage string) string
	mounts    []siteMount
	// front, when set, starts a second Caddy whose Caddyfile this is,
	// given the first one's port; clients speak to it.
	front func(backPort int) string
	tls   bool
	// extra are the checks of what the case is about.
	extra func(t *testing.T, sc *siteClient, m siteMount)
}

// siteGlobal is a Caddyfile's global options, with more of them in %s.
const siteGlobal = "{\n\tpersist_config off\n%s}\n\n"

// siteMounts are the blocks of a site that serve mounts on storage: a
// handle_path each, unless mountBlock writes its own around the picomq
// block it is given.
func siteMounts(storage string, mounts []siteMount, mountBlock func(m siteMount, picomq string) string) string {
	var b strings.Builder
	for _, m := range mounts {
		proto := ""
		if m.pico {
			proto = "\t\t\tprotocol pico\n"
		}
		pm := fmt.Sprintf("\t\tpicomq {\n\t\t\tstorage %q\n%s\t\t}\n", storage, proto)
		if mountBlock != nil {
			b.WriteString(mountBlock(m, pm))
			continue
		}
		fmt.Fprintf(&b, "\thandle_path %s/* {\n%s\t}\n", m.prefix, pm)
	}
	return b.String()
}

var bothMounts = []siteMount{{prefix: "/ds"}, {prefix: "/pico", pico: true}}

// TestCommonSiteConfigs: the module inside the Caddyfiles users write,
// with other directives around it, on versitygw, through both protocols:
// appends are acknowledged, catch-up reads give the exact bytes, a
// long-poll returns on the next append and an SSE feed delivers that
// append at once (well before the feed's own end), whatever the site adds.
func TestCommonSiteConfigs(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	v := testenv.NewVersity(t)
	plainSite := func(global, siteTop string, mounts []siteMount, block func(siteMount, string) string) func(string) string {
		return func(storage string) string {
			return fmt.Sprintf(siteGlobal, global) +
				"http://127.0.0.1:{$" + caddytest.PortEnv + "} {\n\tbind 127.0.0.1\n" + siteTop +
				siteMounts(storage, mounts, block) + "}\n"
		}
	}
	stripped := []siteMount{{prefix: "/app/ds"}, {prefix: "/app/pico", pico: true}, {prefix: "/h/ds"}}
	stripBlock := func(m siteMount, pm string) string {
		switch m.prefix {
		case "/app/ds":
			return "\thandle_path /app/ds/* {\n" + pm + "\t}\n"
		case "/app/pico":
			return "\troute /app/pico/* {\n\t\turi strip_prefix /app/pico\n" + pm + "\t}\n"
		default:
			return "\thandle /h/ds/* {\n\t\turi strip_prefix /h/ds\n" + pm + "\t}\n"
		}
	}
	front := func(proxyOpts string) func(int) string {
		return func(back int) string {
			return fmt.Sprintf(siteGlobal, "") + "http://127.0.0.1:{$" + caddytest.PortEnv + "} {\n\tbind 127.0.0.1\n" +
				fmt.Sprintf("\treverse_proxy 127.0.0.1:%d%s\n}\n", back, proxyOpts)
		}
	}
	cases := []siteCase{
		{
			name:      "encode",
			caddyfile: plainSite("", "\tencode zstd gzip\n", bothMounts, nil),
			mounts:    bothMounts,
			extra:     checkEncoded,
		},
		{
			name:      "strip_prefix",
			caddyfile: plainSite("", "", stripped, stripBlock),
			mounts:    stripped,
			extra:     checkPrefixURLs,
		},
		{
			name:      "request_body",
			caddyfile: plainSite("", "\trequest_body {\n\t\tmax_size 1KB\n\t}\n", bothMounts, nil),
			mounts:    bothMounts,
			extra:     checkBodyLimit,
		},
		{
			name:      "server_timeouts",
			caddyfile: plainSite("\tservers {\n\t\ttimeouts {\n\t\t\tread_body 10s\n\t\t\twrite 5s\n\t\t\tidle 1m\n\t\t}\n\t}\n", "", bothMounts, nil),
			mounts:    bothMounts,
			extra:     checkWriteTimeout,
		},
		{
			name:      "reverse_proxy",
			caddyfile: plainSite("", "", bothMounts, nil),
			mounts:    bothMounts,
			front:     front(" {\n\t\tflush_interval -1\n\t}"),
		},
		{
			name:      "reverse_proxy_defaults",
			caddyfile: plainSite("", "", bothMounts, nil),
			mounts:    bothMounts,
			front:     front(""),
		},
		{
			name: "http2",
			caddyfile: func(storage string) string {
				return fmt.Sprintf(siteGlobal, "\tskip_install_trust\n\tlocal_certs\n\tauto_https disable_redirects\n") +
					"https://127.0.0.1:{$" + caddytest.PortEnv + "} {\n\tbind 127.0.0.1\n\ttls internal\n\tencode zstd gzip\n" +
					siteMounts(storage, bothMounts, nil) + "}\n"
			},
			mounts: bothMounts,
			tls:    true,
			extra:  checkManyFeeds,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			storage := caddytest.S3Storage(t, v, v.Endpoint)
			c := caddytest.Start(t, caddytest.Options{Caddyfile: tc.caddyfile(storage), Env: caddytest.S3Env(v), ReadyTimeout: 90 * time.Second})
			var dials atomic.Int64
			tr := &http.Transport{
				DisableCompression: true,
				ForceAttemptHTTP2:  tc.tls,
				DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
					dials.Add(1)
					return (&net.Dialer{Timeout: 3 * time.Second}).DialContext(ctx, network, addr)
				},
			}
			t.Cleanup(tr.CloseIdleConnections)
			sc := &siteClient{origin: c.URL(), hc: &http.Client{Transport: tr}, dials: &dials,
				admin: c.AdminAddr(), longPolls: &sync.Mutex{}}
			if tc.front != nil {
				f := caddytest.Start(t, caddytest.Options{Caddyfile: tc.front(c.Port()), ReadyTimeout: 90 * time.Second})
				sc.origin = f.URL()
			}
			if tc.tls {
				tr.TLSClientConfig = &tls.Config{RootCAs: localCA(t, c)}
				sc.origin = fmt.Sprintf("https://127.0.0.1:%d", c.Port())
				// The site's certificate is issued in the background.
				if !waitFor(30*time.Second, func() bool {
					r, err := sc.do(context.Background(), http.MethodGet, "/ds/none?offset=-1", nil, nil)
					return err == nil && r.status == http.StatusNotFound
				}) {
					t.Fatal("no HTTPS answer within 30s")
				}
			}
			// The mounts' checks use streams of their own and mostly wait
			// for live reads: they run side by side.
			for _, m := range tc.mounts {
				t.Run(strings.TrimPrefix(strings.ReplaceAll(m.prefix, "/", "_"), "_"), func(t *testing.T) {
					t.Parallel()
					checkSiteMount(t, sc, m)
					if tc.extra != nil {
						tc.extra(t, sc, m)
					}
				})
			}
		})
	}
}

// checkSiteMount runs the checks every site must pass on one mount.
func checkSiteMount(t *testing.T, sc *siteClient, m siteMount) {
	t.Helper()
	p := protoOf(m)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	text := http.Header{"Content-Type": {textPlain}}
	// One storage serves every mount: each gets a stream of its own.
	path := m.prefix + "/orders" + m.tag()
	// Records past encode's minimum_length (512 bytes), so that an
	// encoder in front compresses the reads.
	pad := strings.Repeat("x", 600)
	r, err := sc.do(ctx, http.MethodPut, path, text, nil)
	if err != nil || r.status != http.StatusCreated {
		t.Fatalf("create %s: %v %v", path, r, err)
	}
	// The module's URLs are the client's: the prefix it used, the origin
	// it reached (through a proxy too: reverse_proxy keeps the Host).
	wantLoc := sc.origin + path
	if m.pico {
		wantLoc = path
	}
	if loc := r.header.Get("Location"); loc != wantLoc {
		t.Errorf("create: Location %q, want %q", loc, wantLoc)
	}
	want := ""
	for i := range 3 {
		rec := fmt.Sprintf("record-%d:%s;", i, pad)
		if r, err := sc.do(ctx, http.MethodPost, path, text, []byte(rec)); err != nil || r.status != p.appendStatus {
			t.Fatalf("append %d: %v %v", i, r, err)
		}
		want += rec
	}
	r, err = sc.do(ctx, http.MethodGet, path+"?"+p.readAll, nil, nil)
	if err != nil || r.status != http.StatusOK {
		t.Fatalf("catch-up read: %v %v", r, err)
	}
	if got := p.bodies(t, r.body); got != want {
		t.Errorf("catch-up read gave %q, want %q", got, want)
	}
	tailQuery := p.tail(r)

	// Long-poll at the tail: it returns with the next append.
	type polled struct {
		r   *siteResp
		err error
	}
	func() {
		defer sc.holdLongPolls(t)()
		pc := make(chan polled, 1)
		go func() {
			r, err := sc.do(ctx, http.MethodGet, path+"?"+tailQuery+"&live=long-poll", nil, nil)
			pc <- polled{r, err}
		}()
		// Open before the append: one that came after it would answer at
		// once, and the wake-up would go untested.
		fhWaitLongPolls(t, sc.admin, 1)
		if r, err := sc.do(ctx, http.MethodPost, path, text, []byte("polled:"+pad)); err != nil || r.status != p.appendStatus {
			t.Fatalf("append for the long-poll: %v %v", r, err)
		}
		select {
		case got := <-pc:
			if got.err != nil || got.r.status != http.StatusOK {
				t.Errorf("long-poll: %v %v", got.r, got.err)
			} else if b := p.bodies(t, got.r.body); b != "polled:"+pad {
				t.Errorf("long-poll gave %q, want the append", b)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("the long-poll did not return within 20s of the append")
		}
	}()
	want += "polled:" + pad

	// SSE from the new tail: the next append arrives as an event while
	// the feed is open, long before it would end by itself.
	r, err = sc.do(ctx, http.MethodGet, path+"?"+p.readAll, nil, nil)
	if err != nil || r.status != http.StatusOK {
		t.Fatalf("read: %v %v", r, err)
	}
	events, errs, _ := sc.openEvents(t, path+"?"+p.tail(r)+"&live=sse")
	// The feed's first event at the tail is its control event, sent once
	// it has read where the tail is: an append after it is one the feed
	// must deliver live. Appended before it, the record would come as
	// the feed's catch-up, and the live delivery would go untested.
	select {
	case ev := <-events:
		if b, ok := p.event(ev); ok {
			t.Fatalf("SSE at the tail began with data %q, want its control event", b)
		}
	case err := <-errs:
		t.Fatalf("SSE feed ended before its first event: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("no control event from the SSE feed at the tail within 20s: nothing tested")
	}
	if r, err := sc.do(ctx, http.MethodPost, path, text, []byte("live;")); err != nil || r.status != p.appendStatus {
		t.Fatalf("append for the feed: %v %v", r, err)
	}
	deadline := time.After(20 * time.Second)
	for got := false; !got; {
		select {
		case ev := <-events:
			if b, ok := p.event(ev); ok {
				if b != "live;" {
					t.Errorf("SSE event %q, want %q", b, "live;")
				}
				got = true
			}
		case err := <-errs:
			t.Fatalf("SSE feed ended before the append's event: %v", err)
		case <-deadline:
			t.Fatalf("no SSE event within 20s of the append")
		}
	}
	want += "live;"
	r, err = sc.do(ctx, http.MethodGet, path+"?"+p.readAll, nil, nil)
	if err != nil || r.status != http.StatusOK || p.bodies(t, r.body) != want {
		t.Errorf("final read: %v %v, want %q", r, err, want)
	}
}

// checkEncoded: behind encode, a read's ETag names its encoding, and
// If-None-Match with it still gets 304: Caddy strips what it added
// before the module compares. A client that asks for no encoding gets
// the same bytes under the module's own ETag.
func checkEncoded(t *testing.T, sc *siteClient, m siteMount) {
	t.Helper()
	p := protoOf(m)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	path := m.prefix + "/orders" + m.tag() + "?" + p.readAll
	enc, err := sc.do(ctx, http.MethodGet, path, nil, nil)
	if err != nil || enc.status != http.StatusOK {
		t.Fatalf("read: %v %v", enc, err)
	}
	etag := enc.header.Get("ETag")
	if enc.encoding != "gzip" || !strings.HasSuffix(etag, `-gzip"`) || !slices.Contains(enc.header.Values("Vary"), "Accept-Encoding") {
		t.Errorf("read behind encode: Content-Encoding %q, ETag %q, Vary %q; want gzip, its ETag and Vary: Accept-Encoding",
			enc.encoding, etag, enc.header.Values("Vary"))
	}
	if r, err := sc.do(ctx, http.MethodGet, path, http.Header{"If-None-Match": {etag}}, nil); err != nil || r.status != http.StatusNotModified {
		t.Errorf("If-None-Match %s: %v %v, want 304", etag, r, err)
	}
	plain, err := sc.do(ctx, http.MethodGet, path, http.Header{"Accept-Encoding": {"identity"}}, nil)
	if err != nil || plain.status != http.StatusOK {
		t.Fatalf("read without encoding: %v %v", plain, err)
	}
	if plain.encoding != "" || !bytes.Equal(plain.body, enc.body) || plain.header.Get("ETag") != strings.TrimSuffix(etag, `-gzip"`)+`"` {
		t.Errorf("read without encoding: Content-Encoding %q, ETag %q, same body %v; want none, %q without -gzip, true",
			plain.encoding, plain.header.Get("ETag"), bytes.Equal(plain.body, enc.body), etag)
	}
}

// checkPrefixURLs: the URLs the module writes keep the prefix the client
// used, however Caddy stripped it and whatever its cleaning of the path
// changed, and a fork names its source by that path.
func checkPrefixURLs(t *testing.T, sc *siteClient, m siteMount) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	text := http.Header{"Content-Type": {textPlain}}
	path := m.prefix + "/made/here" + m.tag()
	r, err := sc.do(ctx, http.MethodPut, path, text, []byte("first;"))
	if err != nil || r.status != http.StatusCreated {
		t.Fatalf("create %s: %v %v", path, r, err)
	}
	want := sc.origin + path
	if m.pico {
		want = path
	}
	if loc := r.header.Get("Location"); loc != want {
		t.Errorf("Location %q, want %q", loc, want)
	}

	// Caddy cleans the path before it strips the prefix, so a repeated
	// slash after it names the stream without one; the URL written back
	// keeps the prefix all the same, and reaches the stream.
	r, err = sc.do(ctx, http.MethodPut, m.prefix+"/made//twice"+m.tag(), text, []byte("twice;"))
	if err != nil || r.status != http.StatusCreated {
		t.Fatalf("create %s: %v %v", m.prefix+"/made//twice"+m.tag(), r, err)
	}
	want = sc.origin + m.prefix + "/made/twice" + m.tag()
	if m.pico {
		want = m.prefix + "/made/twice" + m.tag()
	}
	if loc := r.header.Get("Location"); loc != want {
		t.Errorf("Location of a create at %s: %q, want %q", m.prefix+"/made//twice"+m.tag(), loc, want)
	}
	if m.pico {
		return
	}
	if r, err := sc.do(ctx, http.MethodGet, strings.TrimPrefix(want, sc.origin)+"?offset=-1", nil, nil); err != nil || string(r.body) != "twice;" {
		t.Errorf("read at the Location: %v %v, want %q", r, err, "twice;")
	}
	fork := http.Header{"Content-Type": {textPlain}, "Stream-Forked-From": {path}}
	if r, err := sc.do(ctx, http.MethodPut, m.prefix+"/made/copy"+m.tag(), fork, nil); err != nil || r.status != http.StatusCreated {
		t.Fatalf("fork from %s: %v %v", path, r, err)
	}
	if r, err := sc.do(ctx, http.MethodGet, m.prefix+"/made/copy"+m.tag()+"?offset=-1", nil, nil); err != nil || string(r.body) != "first;" {
		t.Errorf("fork's read: %v %v, want %q", r, err, "first;")
	}
}

// checkBodyLimit: behind request_body max_size 1KB, a larger append is
// 413, sent with a Content-Length or chunked, and nothing of it is
// stored; the module's 413 names that limit.
func checkBodyLimit(t *testing.T, sc *siteClient, m siteMount) {
	t.Helper()
	p := protoOf(m)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	path := m.prefix + "/limited" + m.tag()
	if r, err := sc.do(ctx, http.MethodPut, path, http.Header{"Content-Type": {textPlain}}, nil); err != nil || r.status != http.StatusCreated {
		t.Fatalf("create: %v %v", r, err)
	}
	big := bytes.Repeat([]byte("b"), 2000)
	for _, chunked := range []bool{false, true} {
		var body io.Reader = bytes.NewReader(big)
		if chunked {
			body = io.MultiReader(bytes.NewReader(big)) // no length: sent chunked
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, sc.origin+path, body)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", textPlain)
		resp, err := sc.hc.Do(req)
		if err != nil {
			t.Fatalf("append of 2000 bytes (chunked %v): %v", chunked, err)
		}
		msg, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		// With a Content-Length, request_body answers itself (an empty
		// 413); a chunked body reaches the module, whose 413 must name
		// the limit that applies, not max_append_size.
		if resp.StatusCode != http.StatusRequestEntityTooLarge || (chunked && !strings.Contains(string(msg), "the 1000-byte limit")) {
			t.Errorf("append of 2000 bytes (chunked %v): %d %q, want 413 naming the 1000-byte limit", chunked, resp.StatusCode, msg)
		}
	}
	if r, err := sc.do(ctx, http.MethodPost, path, http.Header{"Content-Type": {textPlain}}, []byte("small;")); err != nil || r.status != p.appendStatus {
		t.Fatalf("small append: %v %v", r, err)
	}
	if r, err := sc.do(ctx, http.MethodGet, path+"?"+p.readAll, nil, nil); err != nil || p.bodies(t, r.body) != "small;" {
		t.Errorf("read after the refused appends: %v %v, want only %q", r, err, "small;")
	}
	if !m.pico {
		checkSubscriptionBodyLimit(ctx, t, sc, m)
	}
}

// checkSubscriptionBodyLimit: a subscription's body sent chunked past
// request_body max_size 1KB is 413 naming that limit, as an append's is,
// not a 400 that tells the client its request is malformed; nothing is
// created.
func checkSubscriptionBodyLimit(ctx context.Context, t *testing.T, sc *siteClient, m siteMount) {
	t.Helper()
	sub := m.prefix + "/__ds/subscriptions/oversized"
	var streams []string
	for i := range 100 {
		streams = append(streams, fmt.Sprintf("%q", fmt.Sprintf("limited/stream-%03d", i)))
	}
	big := []byte(`{"type":"pull-wake","wake_stream":"wake/limited","streams":[` + strings.Join(streams, ",") + `]}`)
	if len(big) <= 1000 {
		t.Fatalf("the subscription body is %d bytes, not over the limit", len(big))
	}
	// No length: sent chunked, so that the body reaches the module.
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, sc.origin+sub, io.MultiReader(bytes.NewReader(big)))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := sc.hc.Do(req)
	if err != nil {
		t.Fatalf("subscription of %d bytes: %v", len(big), err)
	}
	msg, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge || !strings.Contains(string(msg), "the 1000-byte limit") {
		t.Errorf("subscription of %d bytes, chunked: %d %q, want 413 naming the 1000-byte limit", len(big), resp.StatusCode, msg)
	}
	if r, err := sc.do(ctx, http.MethodGet, sub, nil, nil); err != nil || r.status != http.StatusNotFound {
		t.Errorf("the refused subscription: %v %v, want 404", r, err)
	}
}

// checkManyFeeds: many SSE feeds of the same streams on one HTTP/2
// connection each get an append's event while the feed is open.
func checkManyFeeds(t *testing.T, sc *siteClient, m siteMount) {
	t.Helper()
	const streams, perStream = 4, 10
	p := protoOf(m)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	text := http.Header{"Content-Type": {textPlain}}
	dialsBefore := sc.dials.Load()
	type feed struct {
		events <-chan sseEvent
		errs   <-chan error
	}
	feeds := make([][]feed, streams)
	for i := range streams {
		path := fmt.Sprintf("%s/fan-%d%s", m.prefix, i, m.tag())
		if r, err := sc.do(ctx, http.MethodPut, path, text, nil); err != nil || r.status != http.StatusCreated {
			t.Fatalf("create %s: %v %v", path, r, err)
		}
		for range perStream {
			events, errs, resp := sc.openEvents(t, path+"?"+p.readAll+"&live=sse") // the stream is empty
			if resp.ProtoMajor != 2 {
				t.Fatalf("feed over %s, want HTTP/2", resp.Proto)
			}
			feeds[i] = append(feeds[i], feed{events, errs})
		}
	}
	time.Sleep(time.Second)
	for i := range streams {
		if r, err := sc.do(ctx, http.MethodPost, fmt.Sprintf("%s/fan-%d%s", m.prefix, i, m.tag()), text, []byte(fmt.Sprintf("fan-%d;", i))); err != nil || r.status != p.appendStatus {
			t.Fatalf("append: %v %v", r, err)
		}
	}
	deadline := time.After(20 * time.Second)
	for i, fs := range feeds {
		for j, f := range fs {
			for got := false; !got; {
				select {
				case ev := <-f.events:
					if b, ok := p.event(ev); ok {
						if b != fmt.Sprintf("fan-%d;", i) {
							t.Errorf("feed %d of stream %d: event %q", j, i, b)
						}
						got = true
					}
				case err := <-f.errs:
					t.Fatalf("feed %d of stream %d ended before its event: %v", j, i, err)
				case <-deadline:
					t.Fatalf("feed %d of stream %d: no event within 20s of the appends", j, i)
				}
			}
		}
	}
	if n := sc.dials.Load() - dialsBefore; n != 0 {
		t.Errorf("the %d feeds took %d new connections, want them all on the one open", streams*perStream, n)
	}
}

// checkWriteTimeout: under the server's `write 5s`, which bounds a whole
// response, live reads that an append wakes past it still answer whole:
// a long-poll gets the append or its 204 (it ended before), never a cut
// connection, and an SSE feed delivers the append or has ended between
// events, so that its client's reconnect gets it.
func checkWriteTimeout(t *testing.T, sc *siteClient, m siteMount) {
	t.Helper()
	const write = 5 * time.Second
	p := protoOf(m)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	text := http.Header{"Content-Type": {textPlain}}
	path := m.prefix + "/outlived" + m.tag()
	if r, err := sc.do(ctx, http.MethodPut, path, text, []byte("first;")); err != nil || r.status != http.StatusCreated {
		t.Fatalf("create: %v %v", r, err)
	}
	r, err := sc.do(ctx, http.MethodGet, path+"?"+p.readAll, nil, nil)
	if err != nil || r.status != http.StatusOK {
		t.Fatalf("read: %v %v", r, err)
	}
	tail := p.tail(r)

	// A connection of its own: Go's client sends a GET again, unseen, when
	// a reused connection closes without an answer.
	tr := &http.Transport{DisableKeepAlives: true, DisableCompression: true}
	defer tr.CloseIdleConnections()
	fresh := &siteClient{origin: sc.origin, hc: &http.Client{Transport: tr}}
	type polled struct {
		r   *siteResp
		err error
	}
	// Held until the long-poll has answered: the other mounts' checks
	// count their own long-poll on the gauge meanwhile.
	unhold := sc.holdLongPolls(t)
	defer unhold()
	pc := make(chan polled, 1)
	go func() {
		r, err := fresh.do(ctx, http.MethodGet, path+"?"+tail+"&live=long-poll", nil, nil)
		pc <- polled{r, err}
	}()
	events, errs, _ := sc.openEvents(t, path+"?"+tail+"&live=sse")
	time.Sleep(write + time.Second)
	if r, err := sc.do(ctx, http.MethodPost, path, text, []byte("after;")); err != nil || r.status != p.appendStatus {
		t.Fatalf("append: %v %v", r, err)
	}

	got := <-pc
	unhold()
	switch {
	case got.err != nil:
		t.Errorf("long-poll woken past write %v: %v, want the append or a 204", write, got.err)
	case got.r.status == http.StatusNoContent:
	case got.r.status != http.StatusOK || p.bodies(t, got.r.body) != "after;":
		t.Errorf("long-poll woken past write %v: %v, want the append or a 204", write, got.r)
	}

	deadline := time.After(20 * time.Second)
	for {
		select {
		case ev := <-events:
			if b, ok := p.event(ev); ok {
				if b != "after;" {
					t.Errorf("event %q, want %q", b, "after;")
				}
				return
			}
		case err := <-errs:
			if !errors.Is(err, io.EOF) {
				t.Fatalf("SSE feed open past write %v: %v, want the append's event or a clean end", write, err)
			}
			// Ended whole: the client reconnects from where it was.
			events, errs, _ = sc.openEvents(t, path+"?"+tail+"&live=sse")
		case <-deadline:
			t.Fatal("no SSE event within 20s of the append")
		}
	}
}
