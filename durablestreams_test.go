package picomq

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/picomq/caddy-picomq/internal/picowire"
	"github.com/picomq/caddy-picomq/segment"
	"github.com/picomq/caddy-picomq/streamstore"
)

// dsServer is a Durable Streams handler on a real engine over a file store,
// served by httptest. Paths under /api/ reach it with "/api" stripped, as
// handle_path would, so URL-space tests can use them.
type dsServer struct {
	*httptest.Server
	eng      *streamstore.Engine
	proto    *durableStreams
	shutdown context.CancelFunc
}

func newDSServer(t testing.TB, tweak ...func(*durableStreams)) *dsServer {
	t.Helper()
	store, err := segment.Open("file://"+t.TempDir(), segment.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	eng := streamstore.New(store, streamstore.Config{NodeID: "test-node", FlushInterval: time.Millisecond}, zaptest.NewLogger(t))
	if err := eng.Start(context.Background()); err != nil {
		t.Fatalf("starting engine: %v", err)
	}
	return newDSServerOn(t, eng, zaptest.NewLogger(t), tweak...)
}

// newDSServerOn is newDSServer on the started engine eng, with the
// handler logging to log; it closes eng at the test's end.
func newDSServerOn(t testing.TB, eng *streamstore.Engine, log *zap.Logger, tweak ...func(*durableStreams)) *dsServer {
	t.Helper()
	shutdown, cancel := context.WithCancel(context.Background())
	d := &durableStreams{
		engine:          func(context.Context) (*streamstore.Engine, error) { return eng, nil },
		shutdown:        shutdown,
		log:             log,
		longPollTimeout: 300 * time.Millisecond,
		sseInterval:     5 * time.Second,
		maxAppend:       1 << 20,
		chunkBytes:      dsChunkBytes,
		jitter:          randomJitter,
		hubs:            &sseHubs{},
		subs:            &subManagers{},
	}
	for _, f := range tweak {
		f(d)
	}
	h := &Handler{proto: d, shutdown: shutdown, cancelShutdown: cancel}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// What Caddy does for every request, and what handle_path adds.
		orig := *r.Clone(r.Context())
		r = r.WithContext(context.WithValue(r.Context(), caddyhttp.OriginalRequestCtxKey, orig))
		if rest, ok := strings.CutPrefix(r.URL.Path, "/api"); ok {
			r.URL.Path = rest
		}
		if err := h.ServeHTTP(w, r, nil); err != nil {
			t.Errorf("ServeHTTP returned %v", err)
		}
	}))
	s := &dsServer{Server: srv, eng: eng, proto: d, shutdown: cancel}
	t.Cleanup(func() {
		cancel()
		srv.Close()
		if err := eng.Close(context.Background()); err != nil {
			t.Errorf("closing engine: %v", err)
		}
	})
	return s
}

// resp is a finished response.
type resp struct {
	status int
	h      http.Header
	body   string
}

func (s *dsServer) do(t testing.TB, method, path string, body string, hdr ...string) resp {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, s.URL+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		t.Fatalf("%s %s: reading body: %v", method, path, err)
	}
	return resp{status: res.StatusCode, h: res.Header, body: string(b)}
}

func (r resp) want(t testing.TB, status int) resp {
	t.Helper()
	if r.status != status {
		t.Fatalf("status %d, want %d; body %q; headers %v", r.status, status, r.body, r.h)
	}
	return r
}

func (r resp) header(t *testing.T, name, want string) resp {
	t.Helper()
	if got := r.h.Get(name); got != want {
		t.Errorf("%s = %q, want %q", name, got, want)
	}
	return r
}

const ct = "Content-Type"

func TestCreateAppendRead(t *testing.T) {
	s := newDSServer(t)
	r := s.do(t, "PUT", "/s", "hello", ct, "text/plain").want(t, 201)
	r.header(t, ct, "text/plain").header(t, hdrStreamNextOffset, position{1, 0}.String())
	if loc := r.h.Get("Location"); loc != s.URL+"/s" {
		t.Errorf("Location %q", loc)
	}
	s.do(t, "POST", "/s", " world", ct, "TEXT/PLAIN").want(t, 204).header(t, hdrStreamNextOffset, position{2, 0}.String())
	r = s.do(t, "GET", "/s?offset=-1", "").want(t, 200)
	if r.body != "hello world" {
		t.Errorf("body %q", r.body)
	}
	r.header(t, hdrStreamUpToDate, "true").header(t, hdrStreamNextOffset, position{2, 0}.String()).
		header(t, "Cache-Control", cacheControlCatchUp).header(t, ct, "text/plain")
	// The bare URL reads the same, but is HEAD's URL too: caches that
	// fetch a HEAD as a GET would answer HEADs with this chunk's headers.
	r = s.do(t, "GET", "/s", "").want(t, 200).header(t, "Cache-Control", cacheControlNoStore)
	if r.body != "hello world" {
		t.Errorf("bare URL body %q", r.body)
	}
	if r.h.Get(hdrStreamClosed) != "" || r.h.Get("ETag") == "" {
		t.Errorf("headers %v", r.h)
	}
	// So is the URL with a query of the site's own but no offset, which
	// clients send with their HEADs too.
	r = s.do(t, "GET", "/s?tenant=acme", "").want(t, 200).header(t, "Cache-Control", cacheControlNoStore)
	if r.body != "hello world" {
		t.Errorf("body without an offset %q", r.body)
	}
	// Resume from an offset handed out earlier.
	r = s.do(t, "GET", "/s?offset="+position{1, 0}.String(), "").want(t, 200)
	if r.body != " world" {
		t.Errorf("resumed body %q", r.body)
	}
	// At the tail: empty, up to date.
	r = s.do(t, "GET", "/s?offset="+position{2, 0}.String(), "").want(t, 200)
	if r.body != "" || r.h.Get(hdrStreamUpToDate) != "true" || r.h.Get("Cache-Control") != "no-store" {
		t.Errorf("tail read %q %v", r.body, r.h)
	}
}

func TestLocationKeepsTheStrippedPrefix(t *testing.T) {
	s := newDSServer(t)
	r := s.do(t, "PUT", "/api/v1/a%20b", "", ct, "text/plain").want(t, 201)
	if loc := r.h.Get("Location"); loc != s.URL+"/api/v1/a%20b" {
		t.Errorf("Location %q", loc)
	}
	// The stream's name is the stripped path.
	if _, err := s.eng.Head(context.Background(), "/v1/a b"); err != nil {
		t.Errorf("head: %v", err)
	}
}

// A create of a JSON stream that exists is judged on its settings,
// whatever its body (section 5.1): a body that is not JSON, or that holds
// too many messages, is 200 with the same settings and 409 with others.
// Where no stream exists it is the body's 400 or 413, and makes nothing.
func TestCreateRepeatedWithABadBody(t *testing.T) {
	s := newDSServer(t)
	const js = "application/json"
	s.do(t, "PUT", "/j", `[1]`, ct, js).want(t, 201)
	fork := []string{"Stream-Forked-From", "/j", "Stream-Fork-Offset", position{1, 0}.String()}
	s.do(t, "PUT", "/jf", "", fork...).want(t, 201)
	tooMany := "[" + strings.Repeat("1,", picowire.MaxRecords) + "1]"
	for _, tc := range []struct {
		name, path, body string
		hdr              []string
		want             int
	}{
		{"not JSON, same settings", "/j", `{`, nil, 200},
		{"too many messages, same settings", "/j", tooMany, nil, 200},
		{"not JSON, other settings", "/j", `{`, []string{"Stream-TTL", "60"}, 409},
		{"not JSON, no stream", "/none", `{`, nil, 400},
		{"too many messages, no stream", "/none", tooMany, nil, 413},
		{"fork, not JSON, same settings", "/jf", `{`, fork, 200},
		{"fork, too many messages, same settings", "/jf", tooMany, fork, 200},
		{"fork, not JSON, other settings", "/jf", `{`, append([]string{"Stream-TTL", "60"}, fork...), 409},
		{"fork, not JSON, no stream", "/none", `{`, fork, 400},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := s.do(t, "PUT", tc.path, tc.body, append([]string{ct, js}, tc.hdr...)...).want(t, tc.want)
			if tc.want == 200 {
				r.header(t, hdrStreamNextOffset, position{1, 0}.String())
			}
		})
	}
	s.do(t, "HEAD", "/none", "").want(t, 404)
	if r := s.do(t, "GET", "/j?offset=-1", "").want(t, 200); r.body != "[1]" {
		t.Errorf("the stream reads %q after the creates", r.body)
	}
}

func TestCreateIdempotence(t *testing.T) {
	s := newDSServer(t)
	s.do(t, "PUT", "/s", "", ct, "application/json", "Stream-TTL", "3600").want(t, 201)
	s.do(t, "PUT", "/s", "", ct, "APPLICATION/JSON", "Stream-TTL", "3600").want(t, 200)
	s.do(t, "PUT", "/s", "", ct, "text/plain", "Stream-TTL", "3600").want(t, 409)
	s.do(t, "PUT", "/s", "", ct, "application/json", "Stream-TTL", "60").want(t, 409)
	s.do(t, "PUT", "/s", "", ct, "application/json").want(t, 409)
	s.do(t, "PUT", "/s", "", ct, "application/json", "Stream-TTL", "3600", "Stream-Closed", "true").want(t, 409)
	// An expiry finer than the milliseconds the engine keeps: the same
	// PUT again is still the same configuration.
	at := []string{ct, "text/plain", "Stream-Expires-At", "2099-01-01T00:00:00.123456Z"}
	s.do(t, "PUT", "/at", "", at...).want(t, 201)
	s.do(t, "PUT", "/at", "", at...).want(t, 200)
	s.do(t, "HEAD", "/at", "").want(t, 200).header(t, hdrStreamExpiresAt, "2099-01-01T00:00:00.123Z")
	// No Content-Type: application/octet-stream.
	s.do(t, "PUT", "/raw", "").want(t, 201).header(t, ct, "application/octet-stream")
}

func TestCreateRejectsBadHeadersWithoutCreating(t *testing.T) {
	s := newDSServer(t)
	for _, hdr := range [][]string{
		{"Stream-TTL", "00060"},
		{"Stream-TTL", "+60"},
		{"Stream-TTL", "1e3"},
		{"Stream-TTL", "abc"},
		{"Stream-Expires-At", "not-a-timestamp"},
		{"Stream-Expires-At", "2001-01-01T00:00:00Z"}, // in the past
		{"Stream-TTL", "60", "Stream-Expires-At", "2099-01-01T00:00:00Z"},
		{ct, "not a type"},
		{"Stream-Fork-Offset", position{}.String()},
		{"Stream-Fork-Sub-Offset", "0"},
	} {
		r := s.do(t, "PUT", "/s", "", hdr...)
		if r.status != 400 || r.body == "" {
			t.Errorf("%v: %d %q", hdr, r.status, r.body)
		}
	}
	s.do(t, "HEAD", "/s", "").want(t, 404)
}

func TestInvalidNames(t *testing.T) {
	s := newDSServer(t)
	for _, tt := range []struct{ path, reason string }{
		{"/", "stream name must be a path below /"},
		{"/a//b", "stream name has an empty, '.' or '..' segment"},
		{"/a/./b", "stream name has an empty, '.' or '..' segment"},
		{"/a/../b", "stream name has an empty, '.' or '..' segment"},
		{"/a/", "stream name has an empty, '.' or '..' segment"},
		{"/" + strings.Repeat("x", 300), "stream name is 301 bytes; the limit is 256"},
	} {
		req, _ := http.NewRequest("PUT", s.URL, nil)
		req.URL.Opaque = tt.path // keep dots and slashes as they are
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(res.Body)
		res.Body.Close()
		// The reason alone: the 400 says "bad request" already.
		if res.StatusCode != 400 || strings.TrimSpace(string(body)) != tt.reason {
			t.Errorf("PUT %q: %d %q, want 400 %q", tt.path, res.StatusCode, body, tt.reason)
		}
	}
}

func TestAppendErrors(t *testing.T) {
	s := newDSServer(t, func(d *durableStreams) { d.maxAppend = 10 })
	s.do(t, "POST", "/missing", "x", ct, "text/plain").want(t, 404)
	s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201)
	s.do(t, "POST", "/s", "").want(t, 400)
	s.do(t, "POST", "/s", "", ct, "text/plain").want(t, 400)
	s.do(t, "POST", "/s", "data").want(t, 400) // no Content-Type
	s.do(t, "POST", "/s", "{}", ct, "application/json").want(t, 409)
	s.do(t, "POST", "/s", "12345678901", ct, "text/plain").want(t, 413)
	s.do(t, "POST", "/s", "1234567890", ct, "text/plain").want(t, 204)

	// A chunked body over the limit is refused too.
	req, _ := http.NewRequest("POST", s.URL+"/s", io.MultiReader(strings.NewReader("123456"), strings.NewReader("789012")))
	req.Header.Set(ct, "text/plain")
	req.ContentLength = -1
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != 413 {
		t.Errorf("chunked oversized body: %d", res.StatusCode)
	}
	if got := s.do(t, "GET", "/s", "").body; got != "1234567890" {
		t.Errorf("rejected appends changed the stream: %q", got)
	}
}

// TestAppendConflictsComeBeforeBodyValidation: a closed stream's 409, a
// content-type mismatch's 409 and a missing stream's 404 come before a
// JSON body's 400 (section 5.2's precedence), and none of them writes.
func TestAppendConflictsComeBeforeBodyValidation(t *testing.T) {
	s := newDSServer(t)
	s.do(t, "PUT", "/text", "", ct, "text/plain").want(t, 201)
	s.do(t, "PUT", "/json", "", ct, "application/json").want(t, 201)
	s.do(t, "PUT", "/sealed", `[1]`, ct, "application/json", "Stream-Closed", "true").want(t, 201)
	tests := []struct {
		name, path, body string
		status           int
		closed           string // Stream-Closed
	}{
		{"text stream, not JSON", "/text", "hello", 409, ""},
		{"text stream, empty array", "/text", "[]", 409, ""},
		{"closed JSON stream, empty array", "/sealed", "[]", 409, "true"},
		{"closed JSON stream, not JSON", "/sealed", "nope", 409, "true"},
		{"closed JSON stream, not UTF-8", "/sealed", "\"\xff\"", 409, "true"},
		{"open JSON stream, not JSON", "/json", "nope", 400, ""},
		{"open JSON stream, empty array", "/json", "[]", 400, ""},
		// The stream's state comes first there too: none is 404 (and a
		// soft-deleted one 410, as for every operation on its URL).
		{"no stream, not JSON", "/missing", "nope", 404, ""},
	}
	for _, tc := range tests {
		r := s.do(t, "POST", tc.path, tc.body, ct, "application/json")
		if r.status != tc.status || r.h.Get(hdrStreamClosed) != tc.closed || r.body == "" {
			t.Errorf("%s: %d %q, Stream-Closed %q; want %d and %q", tc.name, r.status, r.body, r.h.Get(hdrStreamClosed), tc.status, tc.closed)
		}
		if tc.closed != "" && r.h.Get(hdrStreamNextOffset) != (position{1, 0}).String() {
			t.Errorf("%s: Stream-Next-Offset %q", tc.name, r.h.Get(hdrStreamNextOffset))
		}
	}
	for path, want := range map[string]string{"/text": "", "/json": "[]", "/sealed": "[1]"} {
		if got := s.do(t, "GET", path+"?offset=-1", "").want(t, 200).body; got != want {
			t.Errorf("%s holds %q, want %q", path, got, want)
		}
	}
}

func TestStreamSeq(t *testing.T) {
	s := newDSServer(t)
	s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201)
	s.do(t, "POST", "/s", "a", ct, "text/plain", "Stream-Seq", "09").want(t, 204)
	s.do(t, "POST", "/s", "b", ct, "text/plain", "Stream-Seq", "10").want(t, 204)
	s.do(t, "POST", "/s", "c", ct, "text/plain", "Stream-Seq", "10").want(t, 409)
	s.do(t, "POST", "/s", "d", ct, "text/plain", "Stream-Seq", "2").want(t, 204)
	s.do(t, "POST", "/s", "e", ct, "text/plain", "Stream-Seq", "10").want(t, 409)
	// The scope is the stream, as the README says: another writer (here a
	// producer of its own) is held to the same order, while another
	// stream, or a fork (section 4.2), has an order of its own.
	s.do(t, "POST", "/s", "f", ct, "text/plain", "Stream-Seq", "1",
		"Producer-Id", "other", "Producer-Epoch", "0", "Producer-Seq", "0").want(t, 409)
	s.do(t, "PUT", "/t", "", ct, "text/plain").want(t, 201)
	s.do(t, "POST", "/t", "a", ct, "text/plain", "Stream-Seq", "1").want(t, 204)
	s.do(t, "PUT", "/f", "", "Stream-Forked-From", "/s").want(t, 201)
	s.do(t, "POST", "/f", "g", ct, "text/plain", "Stream-Seq", "1").want(t, 204)
}

func TestClose(t *testing.T) {
	s := newDSServer(t)
	s.do(t, "PUT", "/s", "content", ct, "text/plain").want(t, 201)
	tail := position{1, 0}.String()
	// Close-only ignores the content type.
	s.do(t, "POST", "/s", "", ct, "application/json", "Stream-Closed", "true").want(t, 204).
		header(t, hdrStreamClosed, "true").header(t, hdrStreamNextOffset, tail)
	s.do(t, "POST", "/s", "", "Stream-Closed", "TRUE").want(t, 204).header(t, hdrStreamClosed, "true")
	s.do(t, "POST", "/s", "more", ct, "text/plain").want(t, 409).
		header(t, hdrStreamClosed, "true").header(t, hdrStreamNextOffset, tail)
	s.do(t, "POST", "/s", "more", ct, "text/plain", "Stream-Closed", "true").want(t, 409).header(t, hdrStreamClosed, "true")
	// Closed and mismatched: closed wins.
	s.do(t, "POST", "/s", "{}", ct, "application/json").want(t, 409).header(t, hdrStreamClosed, "true")
	s.do(t, "HEAD", "/s", "").want(t, 200).header(t, hdrStreamClosed, "true")
	r := s.do(t, "GET", "/s", "").want(t, 200)
	if r.body != "content" || r.h.Get(hdrStreamClosed) != "true" || !strings.HasSuffix(r.h.Get("ETag"), `:c"`) {
		t.Errorf("read of closed stream: %q %v", r.body, r.h)
	}
	s.do(t, "GET", "/s?offset="+tail, "").want(t, 200).header(t, hdrStreamClosed, "true").header(t, hdrStreamUpToDate, "true")
	s.do(t, "GET", "/s?offset=now", "").want(t, 200).header(t, hdrStreamClosed, "true").header(t, hdrStreamNextOffset, tail)

	// "Stream-Closed: yes" is no close.
	s.do(t, "PUT", "/t", "", ct, "text/plain").want(t, 201)
	s.do(t, "POST", "/t", "x", ct, "text/plain", "Stream-Closed", "yes").want(t, 204)
	if s.do(t, "HEAD", "/t", "").h.Get(hdrStreamClosed) != "" {
		t.Error("Stream-Closed: yes closed the stream")
	}
	// Append and close in one request.
	s.do(t, "POST", "/t", "final", ct, "text/plain", "Stream-Closed", "true").want(t, 204).header(t, hdrStreamClosed, "true")
	if got := s.do(t, "GET", "/t", "").body; got != "xfinal" {
		t.Errorf("body %q", got)
	}
	// Created closed.
	s.do(t, "PUT", "/u", "only", ct, "text/plain", "Stream-Closed", "true").want(t, 201).header(t, hdrStreamClosed, "true")
	s.do(t, "PUT", "/u", "", ct, "text/plain", "Stream-Closed", "true").want(t, 200)
}

func TestProducers(t *testing.T) {
	s := newDSServer(t)
	s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201)
	p := func(epoch, seq string) []string {
		return []string{ct, "text/plain", "Producer-Id", "p1", "Producer-Epoch", epoch, "Producer-Seq", seq}
	}
	s.do(t, "POST", "/s", "a", p("0", "0")...).want(t, 200).header(t, hdrProducerEpoch, "0").header(t, hdrProducerSeq, "0")
	s.do(t, "POST", "/s", "b", p("0", "1")...).want(t, 200).header(t, hdrProducerSeq, "1")
	s.do(t, "POST", "/s", "a", p("0", "0")...).want(t, 204).header(t, hdrProducerSeq, "1")
	s.do(t, "POST", "/s", "x", p("0", "5")...).want(t, 409).
		header(t, hdrProducerExpected, "2").header(t, hdrProducerReceived, "5")
	s.do(t, "POST", "/s", "x", p("1", "3")...).want(t, 400)
	s.do(t, "POST", "/s", "c", p("1", "0")...).want(t, 200).header(t, hdrProducerEpoch, "1")
	s.do(t, "POST", "/s", "z", p("0", "2")...).want(t, 403).header(t, hdrProducerEpoch, "1")
	s.do(t, "POST", "/s", "x", ct, "text/plain", "Producer-Id", "p1").want(t, 400)
	s.do(t, "POST", "/s", "x", ct, "text/plain", "Producer-Id", "", "Producer-Epoch", "0", "Producer-Seq", "0").want(t, 400)
	// Close with a final append, then its retry.
	s.do(t, "POST", "/s", "end", append(p("1", "1"), "Stream-Closed", "true")...).want(t, 200).header(t, hdrStreamClosed, "true")
	s.do(t, "POST", "/s", "END", append(p("1", "1"), "Stream-Closed", "true")...).want(t, 204).header(t, hdrStreamClosed, "true")
	s.do(t, "POST", "/s", "no", append(p("1", "2"), "Stream-Closed", "true")...).want(t, 409).header(t, hdrStreamClosed, "true")
	// On the closed stream a stale epoch is told the stream is closed
	// (section 5.2.1), not fenced.
	s.do(t, "POST", "/s", "z", p("0", "3")...).want(t, 409).header(t, hdrStreamClosed, "true").
		header(t, hdrStreamNextOffset, position{4, 0}.String())
	if got := s.do(t, "GET", "/s", "").body; got != "abcend" {
		t.Errorf("body %q", got)
	}
}

func TestCatchUpChunking(t *testing.T) {
	s := newDSServer(t, func(d *durableStreams) { d.chunkBytes = 10 })
	parts := []string{"0123", strings.Repeat("L", 25), "ab", "é€😀é€😀", "z"}
	s.do(t, "PUT", "/s", "", ct, "text/plain; charset=utf-8").want(t, 201)
	for _, p := range parts {
		s.do(t, "POST", "/s", p, ct, "text/plain; charset=utf-8").want(t, 204)
	}
	want := strings.Join(parts, "")
	var got strings.Builder
	off, prev := "-1", ""
	for i := 0; ; i++ {
		if i > 50 {
			t.Fatal("no end in sight")
		}
		r := s.do(t, "GET", "/s?offset="+off, "").want(t, 200)
		if len(r.body) > 10 {
			t.Errorf("chunk of %d bytes", len(r.body))
		}
		got.WriteString(r.body)
		next := r.h.Get(hdrStreamNextOffset)
		if next <= prev {
			t.Fatalf("offset %s after %s", next, prev)
		}
		if r.h.Get(hdrStreamUpToDate) == "true" {
			if next != (position{uint64(len(parts)), 0}).String() {
				t.Errorf("final offset %s", next)
			}
			break
		}
		prev, off = next, next
	}
	if got.String() != want {
		t.Errorf("got %q, want %q", got.String(), want)
	}
}

// A catch-up read's records take at most dsChunkBytes in memory, however
// small they are: counted by their bodies alone, one read of one-byte
// messages held every record up to the tail (64 bytes each).
func TestCatchUpOfTinyRecordsIsChunkedByMemory(t *testing.T) {
	s := newDSServer(t)
	s.do(t, "PUT", "/tiny", "", ct, "application/json").want(t, 201)
	const n = dsChunkRecords + dsChunkRecords/2
	var body strings.Builder
	body.WriteByte('[')
	for i := range n {
		if i > 0 {
			body.WriteByte(',')
		}
		body.WriteByte('0' + byte(i%10))
	}
	body.WriteByte(']')
	s.do(t, "POST", "/tiny", body.String(), ct, "application/json").want(t, 204)

	var counts []int
	total := 0
	for off := "-1"; ; {
		if len(counts) > 10 {
			t.Fatalf("no end in sight after responses of %v", counts)
		}
		r := s.do(t, "GET", "/tiny?offset="+off, "").want(t, 200)
		var msgs []json.RawMessage
		if err := json.Unmarshal([]byte(r.body), &msgs); err != nil {
			t.Fatalf("response %d: %v", len(counts), err)
		}
		for i, m := range msgs {
			if want := string(rune('0' + (total+i)%10)); string(m) != want {
				t.Fatalf("message %d is %s, want %s", total+i, m, want)
			}
		}
		counts = append(counts, len(msgs))
		total += len(msgs)
		if r.h.Get(hdrStreamUpToDate) == "true" {
			break
		}
		off = r.h.Get(hdrStreamNextOffset)
	}
	if total != n {
		t.Fatalf("read %d messages in responses of %v, want %d", total, counts, n)
	}
	for i, c := range counts {
		if c > dsChunkRecords {
			t.Errorf("response %d of %v held %d records: %d KiB of them besides their bodies, over the %d KiB a response holds",
				i, counts, c, c*int(unsafe.Sizeof(streamstore.Record{}))>>10, dsChunkBytes>>10)
		}
	}
}

func TestETag(t *testing.T) {
	s := newDSServer(t)
	s.do(t, "PUT", "/s", "data", ct, "text/plain").want(t, 201)
	tag := s.do(t, "GET", "/s", "").want(t, 200).h.Get("ETag")
	r := s.do(t, "GET", "/s", "", "If-None-Match", tag).want(t, 304)
	if r.body != "" {
		t.Errorf("304 with body %q", r.body)
	}
	s.do(t, "GET", "/s", "", "If-None-Match", `"wrong-etag"`).want(t, 200)
	// Closing changes the tag of the final chunk.
	s.do(t, "POST", "/s", "", "Stream-Closed", "true").want(t, 204)
	r = s.do(t, "GET", "/s", "", "If-None-Match", tag).want(t, 200)
	if r.h.Get(hdrStreamClosed) != "true" || r.h.Get("ETag") == tag {
		t.Errorf("after close: %v", r.h)
	}
	// offset=now answers carry no ETag and are not cached.
	r = s.do(t, "GET", "/s?offset=now", "").want(t, 200)
	if r.h.Get("ETag") != "" || r.h.Get("Cache-Control") != "no-store" {
		t.Errorf("offset=now: %v", r.h)
	}
}

func TestReadOffsets(t *testing.T) {
	s := newDSServer(t)
	s.do(t, "PUT", "/s", "abc", ct, "text/plain").want(t, 201)
	for _, q := range []string{"offset=", "offset=a&offset=b", "offset=0%2C1", "offset=0%201", "offset=..%2Fx",
		"offset=" + position{2, 0}.String(), "offset=" + position{1, 1}.String(), "offset=" + position{0, 4}.String(),
		"live=long-poll", "live=sse", "offset=-1&live=bogus", "offset=%zz"} {
		r := s.do(t, "GET", "/s?"+q, "")
		if r.status != 400 || r.body == "" {
			t.Errorf("%s: %d %q", q, r.status, r.body)
		}
	}
	r := s.do(t, "GET", "/s?offset=-1&foo=bar", "").want(t, 200)
	if r.body != "abc" {
		t.Errorf("body %q", r.body)
	}
	r = s.do(t, "GET", "/s?offset="+position{0, 1}.String(), "").want(t, 200)
	if r.body != "bc" {
		t.Errorf("mid-record body %q", r.body)
	}
	r = s.do(t, "GET", "/s?offset=now", "").want(t, 200)
	if r.body != "" || r.h.Get(hdrStreamNextOffset) != (position{1, 0}).String() || r.h.Get(hdrStreamUpToDate) != "true" {
		t.Errorf("offset=now: %q %v", r.body, r.h)
	}
	s.do(t, "GET", "/missing?offset=now", "").want(t, 404)
}

func TestHeadAndDelete(t *testing.T) {
	s := newDSServer(t)
	s.do(t, "PUT", "/ttl", "", ct, "text/plain", "Stream-TTL", "3600").want(t, 201)
	s.do(t, "HEAD", "/ttl", "").want(t, 200).header(t, hdrStreamTTL, "3600").header(t, "Cache-Control", "no-store").
		header(t, hdrStreamNextOffset, position{}.String()).header(t, ct, "text/plain")
	at := time.Now().Add(time.Hour).UTC().Truncate(time.Millisecond)
	s.do(t, "PUT", "/exp", "", ct, "text/plain", "Stream-Expires-At", at.Format(time.RFC3339Nano)).want(t, 201)
	r := s.do(t, "HEAD", "/exp", "").want(t, 200)
	if got, err := time.Parse(time.RFC3339Nano, r.h.Get(hdrStreamExpiresAt)); err != nil || !got.Equal(at) {
		t.Errorf("Stream-Expires-At %q (%v), want %v", r.h.Get(hdrStreamExpiresAt), err, at)
	}
	if r.h.Get(hdrStreamClosed) != "" {
		t.Error("open stream says closed")
	}
	s.do(t, "DELETE", "/ttl", "").want(t, 204)
	s.do(t, "DELETE", "/ttl", "").want(t, 404)
	s.do(t, "HEAD", "/ttl", "").want(t, 404)
	s.do(t, "GET", "/ttl", "").want(t, 404)
	// A new stream under the name starts empty.
	s.do(t, "PUT", "/ttl", "new", ct, "text/plain").want(t, 201)
	if got := s.do(t, "GET", "/ttl", "").body; got != "new" {
		t.Errorf("recreated stream reads %q", got)
	}
	s.do(t, "PATCH", "/ttl", "").want(t, 405)
}

func TestCommonHeadersAndPreflight(t *testing.T) {
	s := newDSServer(t)
	for _, r := range []resp{
		s.do(t, "GET", "/missing", "").want(t, 404),
		s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201),
		s.do(t, "GET", "/s", "").want(t, 200),
	} {
		r.header(t, "X-Content-Type-Options", "nosniff").header(t, "Cross-Origin-Resource-Policy", "cross-origin").
			header(t, "Access-Control-Allow-Origin", "*").header(t, "Content-Security-Policy", "default-src 'none'; sandbox")
		if !strings.Contains(r.h.Get("Access-Control-Expose-Headers"), "Stream-Next-Offset") {
			t.Errorf("expose headers %q", r.h.Get("Access-Control-Expose-Headers"))
		}
	}
	r := s.do(t, "OPTIONS", "/s", "", "Origin", "https://example.com", "Access-Control-Request-Method", "GET",
		"Access-Control-Request-Headers", "if-none-match").want(t, 204)
	r.header(t, "Access-Control-Allow-Headers", "if-none-match")
	if !strings.Contains(r.h.Get("Access-Control-Allow-Methods"), "POST") {
		t.Errorf("allow methods %q", r.h.Get("Access-Control-Allow-Methods"))
	}
}

func TestJSONMode(t *testing.T) {
	s := newDSServer(t, func(d *durableStreams) { d.chunkBytes = 16 })
	s.do(t, "PUT", "/j", "[]", ct, "application/json").want(t, 201).header(t, hdrStreamNextOffset, position{}.String())
	if got := s.do(t, "GET", "/j", "").want(t, 200).body; got != "[]" {
		t.Errorf("empty JSON stream reads %q", got)
	}
	s.do(t, "POST", "/j", "[]", ct, "application/json").want(t, 400)
	s.do(t, "POST", "/j", "{ invalid json }", ct, "application/json").want(t, 400)
	// JSON is UTF-8 (RFC 8259 section 8.1): a string of other bytes is
	// not JSON, at create or append.
	s.do(t, "POST", "/j", "{\"a\":\"\xff\xfe\"}", ct, "application/json").want(t, 400)
	s.do(t, "PUT", "/j2", "[\"\xc3\x28\"]", ct, "application/json").want(t, 400)
	s.do(t, "HEAD", "/j2", "").want(t, 404)
	s.do(t, "POST", "/j", `{"a": 1}`, ct, "application/json; charset=utf-8").want(t, 204)
	s.do(t, "POST", "/j", `[[1,2], {"b": "a long string value"}, 3]`, ct, "application/json").want(t, 204).
		header(t, hdrStreamNextOffset, position{4, 0}.String())
	// Pages never split a message, even one larger than the chunk limit.
	var all []any
	off := "-1"
	for i := 0; i < 10; i++ {
		r := s.do(t, "GET", "/j?offset="+off, "").want(t, 200)
		var page []any
		if err := json.Unmarshal([]byte(r.body), &page); err != nil {
			t.Fatalf("page %q: %v", r.body, err)
		}
		all = append(all, page...)
		if r.h.Get(hdrStreamUpToDate) == "true" {
			break
		}
		off = r.h.Get(hdrStreamNextOffset)
	}
	if b, _ := json.Marshal(all); string(b) != `[{"a":1},[1,2],{"b":"a long string value"},3]` {
		t.Errorf("messages %s", b)
	}
	if got := s.do(t, "GET", "/j?offset=now", "").body; got != "[]" {
		t.Errorf("offset=now on JSON reads %q", got)
	}
	s.do(t, "GET", "/j?offset="+position{0, 1}.String(), "").want(t, 400)
}

// waitEngineWaits waits until n goroutines are parked in the engine's Wait
// (a live read at its stream's tail), failing the test after 5 s. A fixed
// pause let an append land before a long-poll at offset=now had read where
// the tail was, on a busy machine, and the long-poll then waited for the
// append after it.
func waitEngineWaits(t *testing.T, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		got := engineWaits()
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d live reads parked in the engine after 5 s, want %d", got, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// engineWaits counts the goroutines blocked in streamstore's Engine.Wait.
func engineWaits() int { return goroutinesIn("[select", "streamstore.(*Engine).Wait(") }

// goroutinesIn counts the goroutines whose header shows state (such as
// "[select" or "[IO wait") and whose stack holds call.
func goroutinesIn(state, call string) int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	count := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		header, _, _ := strings.Cut(g, "\n")
		if strings.Contains(header, state) && strings.Contains(g, call) {
			count++
		}
	}
	return count
}

func TestLongPoll(t *testing.T) {
	s := newDSServer(t)
	s.do(t, "PUT", "/s", "old", ct, "text/plain").want(t, 201)
	tail := position{1, 0}.String()

	// Data already there: at once, with a cursor.
	r := s.do(t, "GET", "/s?offset=-1&live=long-poll", "").want(t, 200)
	if r.body != "old" || r.h.Get(hdrStreamUpToDate) != "true" || r.h.Get(hdrStreamCursor) == "" {
		t.Errorf("immediate: %q %v", r.body, r.h)
	}
	// Cursor collision: strictly larger.
	c1 := r.h.Get(hdrStreamCursor)
	c2 := s.do(t, "GET", "/s?offset=-1&live=long-poll&cursor="+c1, "").want(t, 200).h.Get(hdrStreamCursor)
	if !(len(c2) > len(c1) || (len(c2) == len(c1) && c2 > c1)) {
		t.Errorf("cursor %s after %s", c2, c1)
	}
	// Timeout: 204 with the tail.
	start := time.Now()
	r = s.do(t, "GET", "/s?offset="+tail+"&live=long-poll", "").want(t, 204)
	r.header(t, hdrStreamNextOffset, tail).header(t, hdrStreamUpToDate, "true")
	if r.h.Get(hdrStreamCursor) == "" {
		t.Error("204 without a cursor")
	}
	if d := time.Since(start); d < 250*time.Millisecond || d > 3*time.Second {
		t.Errorf("long-poll timeout took %v", d)
	}
	// offset=now waits too.
	s.do(t, "GET", "/s?offset=now&live=long-poll", "").want(t, 204).header(t, hdrStreamNextOffset, tail)

	// Data arriving during the wait.
	s.proto.longPollTimeout = 5 * time.Second
	done := make(chan resp, 1)
	go func() { done <- s.do(t, "GET", "/s?offset=now&live=long-poll", "") }()
	waitEngineWaits(t, 1)
	s.do(t, "POST", "/s", "new", ct, "text/plain").want(t, 204)
	select {
	case r = <-done:
	case <-time.After(4 * time.Second):
		t.Fatal("long-poll did not answer the append")
	}
	if r.status != 200 || r.body != "new" || r.h.Get(hdrStreamNextOffset) != (position{2, 0}).String() {
		t.Errorf("woken long-poll: %d %q %v", r.status, r.body, r.h)
	}

	// Closed at the tail: at once, 204 closed.
	s.do(t, "POST", "/s", "", "Stream-Closed", "true").want(t, 204)
	start = time.Now()
	s.do(t, "GET", "/s?offset="+position{2, 0}.String()+"&live=long-poll", "").want(t, 204).
		header(t, hdrStreamClosed, "true").header(t, hdrStreamUpToDate, "true")
	s.do(t, "GET", "/s?offset=now&live=long-poll", "").want(t, 204).header(t, hdrStreamClosed, "true")
	if d := time.Since(start); d > time.Second {
		t.Errorf("closed long-polls took %v", d)
	}
	s.do(t, "GET", "/missing?offset=now&live=long-poll", "").want(t, 404)
}

func TestLongPollEndsAtShutdown(t *testing.T) {
	s := newDSServer(t, func(d *durableStreams) { d.longPollTimeout = time.Minute })
	s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201)
	done := make(chan resp, 1)
	go func() { done <- s.do(t, "GET", "/s?offset=now&live=long-poll", "") }()
	waitEngineWaits(t, 1)
	s.shutdown()
	select {
	case r := <-done:
		r.want(t, 204).header(t, hdrStreamNextOffset, position{}.String()).header(t, hdrStreamUpToDate, "true")
	case <-time.After(3 * time.Second):
		t.Fatal("long-poll outlived the shutdown")
	}
}

// sseReader reads events from a live SSE response.
type sseReader struct {
	res    *http.Response
	events chan sseEvent
	done   chan struct{} // closed when the server ends the response
}

func (s *dsServer) sse(t *testing.T, query string) *sseReader {
	t.Helper()
	return openSSE(t, http.DefaultClient, s.URL+query)
}

// openSSE opens a live SSE response of url with client.
func openSSE(t *testing.T, client *http.Client, url string) *sseReader {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
	res, err := client.Do(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	r := &sseReader{res: res, events: make(chan sseEvent, 100), done: make(chan struct{})}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(r.done)
		sc := bufio.NewScanner(res.Body)
		sc.Buffer(nil, 4<<20)
		var ev sseEvent
		var data []string
		for sc.Scan() {
			line := sc.Text()
			switch {
			case line == "":
				ev.data = strings.Join(data, "\n")
				r.events <- ev
				ev, data = sseEvent{}, nil
			case strings.HasPrefix(line, "event: "):
				ev.typ = line[len("event: "):]
			case strings.HasPrefix(line, "data:"):
				data = append(data, line[len("data:"):])
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		res.Body.Close()
		wg.Wait()
	})
	return r
}

func (r *sseReader) next(t *testing.T) sseEvent {
	t.Helper()
	select {
	case ev := <-r.events:
		return ev
	case <-r.done:
		select {
		case ev := <-r.events:
			return ev
		default:
		}
		t.Fatal("SSE response ended")
	case <-time.After(5 * time.Second):
		t.Fatal("no SSE event in 5s")
	}
	return sseEvent{}
}

func (r *sseReader) control(t *testing.T) sseControl {
	t.Helper()
	ev := r.next(t)
	if ev.typ != "control" {
		t.Fatalf("got a %s event (%q), want control", ev.typ, ev.data)
	}
	var c sseControl
	if err := json.Unmarshal([]byte(ev.data), &c); err != nil {
		t.Fatalf("control %q: %v", ev.data, err)
	}
	return c
}

func (r *sseReader) ends(t *testing.T, within time.Duration) {
	t.Helper()
	select {
	case <-r.done:
	case <-time.After(within):
		t.Fatalf("SSE response still open after %v", within)
	}
}

func TestSSEText(t *testing.T) {
	s := newDSServer(t)
	s.do(t, "PUT", "/s", "line1\nline2", ct, "text/plain").want(t, 201)
	r := s.sse(t, "/s?offset=-1&live=sse")
	if r.res.StatusCode != 200 || r.res.Header.Get(ct) != "text/event-stream" ||
		!strings.Contains(r.res.Header.Get("Cache-Control"), "no-cache") || r.res.Header.Get(hdrSSEDataEncoding) != "" {
		t.Fatalf("SSE response %d %v", r.res.StatusCode, r.res.Header)
	}
	if ev := r.next(t); ev.typ != "data" || ev.data != "line1\nline2" {
		t.Errorf("data event %+v", ev)
	}
	c := r.control(t)
	if c.StreamNextOffset != (position{1, 0}).String() || !c.UpToDate || c.StreamCursor == "" || c.StreamClosed {
		t.Errorf("control %+v", c)
	}
	// Live data, then a close carrying a final append.
	s.do(t, "POST", "/s", "live", ct, "text/plain").want(t, 204)
	if ev := r.next(t); ev.data != "live" {
		t.Errorf("live event %+v", ev)
	}
	if c := r.control(t); c.StreamNextOffset != (position{2, 0}).String() || !c.UpToDate {
		t.Errorf("control %+v", c)
	}
	s.do(t, "POST", "/s", "bye", ct, "text/plain", "Stream-Closed", "true").want(t, 204)
	if ev := r.next(t); ev.data != "bye" {
		t.Errorf("final event %+v", ev)
	}
	if c := r.control(t); !c.StreamClosed || c.StreamCursor != "" || c.StreamNextOffset != (position{3, 0}).String() {
		t.Errorf("final control %+v", c)
	}
	r.ends(t, 2*time.Second)
}

func TestSSEBinaryAndJSON(t *testing.T) {
	s := newDSServer(t)
	s.do(t, "PUT", "/b", "\x00\x01\xff", ct, "application/octet-stream").want(t, 201)
	s.do(t, "POST", "/b", "\n\r", ct, "application/octet-stream").want(t, 204)
	r := s.sse(t, "/b?offset=-1&live=sse")
	if r.res.Header.Get(hdrSSEDataEncoding) != "base64" {
		t.Errorf("headers %v", r.res.Header)
	}
	ev := r.next(t)
	if got, err := base64.StdEncoding.DecodeString(ev.data); err != nil || !bytes.Equal(got, []byte("\x00\x01\xff\n\r")) {
		t.Errorf("binary event %q: %q %v", ev.data, got, err)
	}
	r.control(t)

	s.do(t, "PUT", "/j", `[{"n":1},{"n":2}]`, ct, "application/json").want(t, 201)
	r = s.sse(t, "/j?offset=-1&live=sse")
	if r.res.Header.Get(hdrSSEDataEncoding) != "" {
		t.Errorf("JSON stream is base64: %v", r.res.Header)
	}
	if ev := r.next(t); ev.data != `[{"n":1},{"n":2}]` {
		t.Errorf("JSON event %q", ev.data)
	}
	r.control(t)
}

func TestSSEAtTail(t *testing.T) {
	s := newDSServer(t)
	s.do(t, "PUT", "/s", "history", ct, "text/plain").want(t, 201)
	r := s.sse(t, "/s?offset=now&live=sse")
	if c := r.control(t); c.StreamNextOffset != (position{1, 0}).String() || !c.UpToDate {
		t.Errorf("first control %+v", c)
	}
	s.do(t, "POST", "/s", "", "Stream-Closed", "true").want(t, 204)
	if c := r.control(t); !c.StreamClosed || c.StreamNextOffset != (position{1, 0}).String() {
		t.Errorf("close control %+v", c)
	}
	r.ends(t, 2*time.Second)

	// Already closed at the tail: one control event, then the end.
	r = s.sse(t, "/s?offset="+position{1, 0}.String()+"&live=sse")
	if c := r.control(t); !c.StreamClosed || !c.UpToDate || c.StreamCursor != "" {
		t.Errorf("closed control %+v", c)
	}
	r.ends(t, 2*time.Second)
	s.do(t, "GET", "/missing?offset=now&live=sse", "").want(t, 404)
}

func TestSSERecyclesAndEndsAtShutdown(t *testing.T) {
	s := newDSServer(t, func(d *durableStreams) { d.sseInterval = 300 * time.Millisecond })
	s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201)
	r := s.sse(t, "/s?offset=-1&live=sse")
	r.control(t)
	r.ends(t, 2*time.Second)

	s.proto.sseInterval = time.Minute
	r = s.sse(t, "/s?offset=-1&live=sse")
	r.control(t)
	s.shutdown()
	if c := r.control(t); c.StreamNextOffset != (position{}).String() {
		t.Errorf("shutdown control %+v", c)
	}
	r.ends(t, 2*time.Second)
}

func TestForks(t *testing.T) {
	s := newDSServer(t)
	s.do(t, "PUT", "/api/src", "hello", ct, "text/plain").want(t, 201)
	s.do(t, "POST", "/api/src", " world", ct, "text/plain").want(t, 204)
	// At the tail by default; the source path is in the client's URL space.
	s.do(t, "PUT", "/api/f1", "", "Stream-Forked-From", "/api/src").want(t, 201).header(t, ct, "text/plain")
	s.do(t, "POST", "/api/f1", "!", ct, "text/plain").want(t, 204)
	if got := s.do(t, "GET", "/api/f1", "").body; got != "hello world!" {
		t.Errorf("fork reads %q", got)
	}
	s.do(t, "PUT", "/api/f1", "", "Stream-Forked-From", "/api/src").want(t, 200)
	// At an offset plus a byte sub-offset.
	r := s.do(t, "PUT", "/api/f2", "", ct, "text/plain", "Stream-Forked-From", "/api/src",
		"Stream-Fork-Offset", position{1, 0}.String(), "Stream-Fork-Sub-Offset", "3").want(t, 201)
	if got := s.do(t, "GET", "/api/f2", "").body; got != "hello wo" {
		t.Errorf("sub-offset fork reads %q", got)
	}
	tail := r.h.Get(hdrStreamNextOffset)
	s.do(t, "GET", "/api/f2?offset="+tail, "").want(t, 200).header(t, hdrStreamUpToDate, "true")
	// A fork cut inside a record reads on from the source offset there.
	s.do(t, "PUT", "/api/f3", "", "Stream-Forked-From", "/api/src", "Stream-Fork-Offset", position{1, 2}.String()).want(t, 201)
	s.do(t, "POST", "/api/f3", "X", ct, "text/plain").want(t, 204)
	if got := s.do(t, "GET", "/api/f3?offset="+(position{1, 2}).String(), "").body; got != "X" {
		t.Errorf("reading the fork from its fork offset: %q", got)
	}
	// Errors.
	s.do(t, "PUT", "/api/f4", "", "Stream-Forked-From", "/api/nope").want(t, 404)
	s.do(t, "PUT", "/api/f4", "", "Stream-Forked-From", "/src").want(t, 400) // outside /api
	s.do(t, "PUT", "/api/f4", "", "Stream-Forked-From", "/api/src", "Stream-Fork-Offset", "9999999999999999_9999999999999999").want(t, 400)
	s.do(t, "PUT", "/api/f4", "", "Stream-Forked-From", "/api/src", "Stream-Fork-Offset", position{0, 0}.String(),
		"Stream-Fork-Sub-Offset", "05").want(t, 400)
	s.do(t, "PUT", "/api/f4", "", "Stream-Forked-From", "/api/src", "Stream-Fork-Sub-Offset", "1").want(t, 400)
	// A 409 says why: here the fork does not exist, so not "stream exists".
	r = s.do(t, "PUT", "/api/f4", "", ct, "application/json", "Stream-Forked-From", "/api/src").want(t, 409)
	if !strings.Contains(r.body, `source's content type "text/plain"`) || strings.Contains(r.body, "exists") {
		t.Errorf("fork of another content type: 409 %q, want the source's content type as the reason", r.body)
	}
	s.do(t, "HEAD", "/api/f4", "").want(t, 404)

	// JSON sub-offsets count messages.
	s.do(t, "PUT", "/api/j", `[1,2,3]`, ct, "application/json").want(t, 201)
	s.do(t, "PUT", "/api/jf", "", "Stream-Forked-From", "/api/j", "Stream-Fork-Offset", position{}.String(),
		"Stream-Fork-Sub-Offset", "2").want(t, 201)
	if got := s.do(t, "GET", "/api/jf", "").body; got != "[1,2]" {
		t.Errorf("JSON fork reads %q", got)
	}
	s.do(t, "PUT", "/api/jg", "", "Stream-Forked-From", "/api/j", "Stream-Fork-Offset", position{}.String(),
		"Stream-Fork-Sub-Offset", "4").want(t, 400)

	// Soft delete: the source is gone, the fork reads on.
	s.do(t, "DELETE", "/api/src", "").want(t, 204)
	s.do(t, "HEAD", "/api/src", "").want(t, 410)
	r = s.do(t, "PUT", "/api/src", "", ct, "text/plain").want(t, 409)
	if !strings.Contains(r.body, "deleted stream that forks still read holds this name") {
		t.Errorf("create over a soft-deleted name: 409 %q, want that reason", r.body)
	}
	s.do(t, "PUT", "/api/f5", "", "Stream-Forked-From", "/api/src").want(t, 409)
	if got := s.do(t, "GET", "/api/f1", "").body; got != "hello world!" {
		t.Errorf("fork of a deleted source reads %q", got)
	}
}

// TestForkOfATrimmedSource: a fork point before the source's first
// retained offset is 410 with a reason and creates nothing, whether or
// not compaction removed the trimmed bytes yet; a fork from -1 starts at
// that offset, and a fork above it reads only retained records.
func TestForkOfATrimmedSource(t *testing.T) {
	tests := []struct {
		name, offset, sub string
		status            int
		body              string // the fork read from -1
	}{
		{name: "below the start", offset: position{1, 0}.String(), status: 410},
		{name: "offset 0", offset: position{}.String(), status: 410},
		{name: "sub-offset reaching past the start", offset: position{}.String(), sub: "5", status: 410},
		{name: "-1", offset: "-1", status: 201, body: ""},
		{name: "at the start", offset: position{2, 0}.String(), status: 201, body: ""},
		{name: "inside a retained record", offset: position{2, 1}.String(), status: 201, body: "c"},
		{name: "above the start", offset: position{3, 0}.String(), status: 201, body: "cc"},
	}
	for _, compact := range []bool{false, true} {
		t.Run(fmt.Sprintf("compacted=%t", compact), func(t *testing.T) {
			s := newDSServer(t)
			s.do(t, "PUT", "/src", "", ct, "text/plain").want(t, 201)
			for _, b := range []string{"aa", "bb", "cc", "dd"} {
				s.do(t, "POST", "/src", b, ct, "text/plain").want(t, 204)
			}
			if _, err := s.eng.Trim(context.Background(), "/src", 2); err != nil {
				t.Fatal(err)
			}
			if compact {
				if err := s.eng.Compact(context.Background()); err != nil {
					t.Fatal(err)
				}
			}
			for i, tc := range tests {
				fork := fmt.Sprintf("/f%d", i)
				hdr := []string{"Stream-Forked-From", "/src", "Stream-Fork-Offset", tc.offset}
				if tc.sub != "" {
					hdr = append(hdr, "Stream-Fork-Sub-Offset", tc.sub)
				}
				r := s.do(t, "PUT", fork, "", hdr...)
				if r.status != tc.status {
					t.Errorf("%s: fork %d %q, want %d", tc.name, r.status, r.body, tc.status)
					continue
				}
				if tc.status != 201 {
					if !strings.Contains(r.body, "retained") || !strings.Contains(r.body, position{2, 0}.String()) {
						t.Errorf("%s: body %q does not give the retained start", tc.name, r.body)
					}
					s.do(t, "HEAD", fork, "").want(t, 404)
					continue
				}
				g := s.do(t, "GET", fork+"?offset=-1", "").want(t, 200)
				if g.body != tc.body {
					t.Errorf("%s: the fork reads %q, want %q", tc.name, g.body, tc.body)
				}
			}
		})
	}
}

// TestConcurrentAppends checks that parallel appends all land, in some
// order, each acknowledged with a distinct offset.
func TestConcurrentAppends(t *testing.T) {
	s := newDSServer(t)
	s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201)
	var wg sync.WaitGroup
	offsets := make([]string, 20)
	for i := range offsets {
		wg.Add(1)
		go func() {
			defer wg.Done()
			offsets[i] = s.do(t, "POST", "/s", fmt.Sprintf("<%d>", i), ct, "text/plain").want(t, 204).h.Get(hdrStreamNextOffset)
		}()
	}
	wg.Wait()
	seen := map[string]bool{}
	for _, o := range offsets {
		if seen[o] {
			t.Errorf("offset %s acknowledged twice", o)
		}
		seen[o] = true
	}
	body := s.do(t, "GET", "/s", "").body
	for i := range offsets {
		if !strings.Contains(body, fmt.Sprintf("<%d>", i)) {
			t.Errorf("append %d missing from %q", i, body)
		}
	}
}

func TestStorageThatFailedToOpen(t *testing.T) {
	ref := &engineRef{ready: make(chan struct{})}
	ref.startOnce.Do(func() {
		ref.startErr = fmt.Errorf("start engine: %w", errors.New("storage is in use by another PicoMQ node"))
		close(ref.ready)
	})
	s := newDSServer(t, func(d *durableStreams) {
		d.engine = func(ctx context.Context) (*streamstore.Engine, error) { return ref.engine(ctx, nil) }
	})
	r := s.do(t, "POST", "/s", "x", ct, "text/plain").want(t, 503)
	if !strings.Contains(r.body, "in use by another PicoMQ node") || r.h.Get("Retry-After") == "" {
		t.Errorf("503 %q %v", r.body, r.h)
	}
}

// A body sent with a content coding is not the bytes the client means to
// append: both protocols refuse it with 415 and Accept-Encoding: identity,
// and the stream is left as it was. identity is no coding at all.
func TestContentEncodedBodiesAreRefused(t *testing.T) {
	ds := newDSServer(t)
	ds.do(t, "PUT", "/s", "a", ct, "text/plain").want(t, 201)
	pico := newPicoServer(t)
	pico.do(t, "PUT", "/pico/p", []byte("a"), ct, "text/plain").want(t, 201)
	for _, tc := range []struct {
		name, coding string
		status       int
	}{
		{"gzip", "gzip", 415},
		{"upper case", "GZIP", 415},
		{"a list", "identity, br", 415},
		{"identity", "identity", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dsWant, picoWant := 204, 200
			if tc.status != 0 {
				dsWant, picoWant = tc.status, tc.status
			}
			r := ds.do(t, "POST", "/s", "b", ct, "text/plain", "Content-Encoding", tc.coding).want(t, dsWant)
			p := pico.do(t, "POST", "/pico/p", []byte("b"), ct, "text/plain", "Content-Encoding", tc.coding).want(t, picoWant)
			if tc.status == 0 {
				return
			}
			if r.h.Get("Accept-Encoding") != "identity" || !strings.Contains(r.body, "Content-Encoding") {
				t.Errorf("Durable Streams: Accept-Encoding %q, body %q", r.h.Get("Accept-Encoding"), r.body)
			}
			if p.h.Get("Accept-Encoding") != "identity" || !strings.Contains(string(p.body), "Content-Encoding") {
				t.Errorf("Pico: Accept-Encoding %q, body %q", p.h.Get("Accept-Encoding"), p.body)
			}
			ds.do(t, "PUT", "/new-"+tc.name, "x", ct, "text/plain", "Content-Encoding", tc.coding).want(t, tc.status)
			ds.do(t, "HEAD", "/new-"+tc.name, "").want(t, 404)
		})
	}
	// Only the identity appends landed.
	if got := ds.do(t, "GET", "/s?offset=-1", "").want(t, 200).body; got != "ab" {
		t.Errorf("Durable Streams stream holds %q, want \"ab\"", got)
	}
	if recs := pico.do(t, "GET", "/pico/p?seq=0", nil).want(t, 200).records(t); len(recs) != 2 {
		t.Errorf("Pico stream holds %d records, want 2", len(recs))
	}
}

// TestProducerCloseOnlyOnAClosedStream: a close-only request with producer
// headers on a closed stream. The retry of the request that closed it
// (same Producer-Id, epoch and seq) is an idempotent success: 204 with
// Stream-Closed and the producer echo headers (section 5.2.1). Any other
// producer tuple is refused as an append to a closed stream is: 409 with
// Stream-Closed and the final offset, as the reference server answers and
// as Pico does. It was answered 204 without the producer headers, telling
// a producer whose close never applied that it had.
func TestProducerCloseOnlyOnAClosedStream(t *testing.T) {
	prod := func(id, epoch, seq string) []string {
		return []string{"Stream-Closed", "true", "Producer-Id", id, "Producer-Epoch", epoch, "Producer-Seq", seq}
	}
	tail := position{2, 0}.String()
	for _, tc := range []struct {
		name   string
		closer []string // the close-only request that closed the stream
		req    []string // the close-only request sent afterwards
		status int
		epoch  string // Producer-Epoch and Producer-Seq wanted ("" absent)
		seq    string
	}{
		{"retry of the producer's close", prod("p1", "0", "2"), prod("p1", "0", "2"), 204, "0", "2"},
		{"the producer's next seq", prod("p1", "0", "2"), prod("p1", "0", "3"), 409, "", ""},
		{"another producer", prod("p1", "0", "2"), prod("p2", "0", "0"), 409, "", ""},
		{"a producer on a stream closed without one", []string{"Stream-Closed", "true"}, prod("p1", "0", "2"), 409, "", ""},
		{"no producer", prod("p1", "0", "2"), []string{"Stream-Closed", "true"}, 204, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newDSServer(t)
			s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201)
			for i, b := range []string{"a", "b"} {
				s.do(t, "POST", "/s", b, ct, "text/plain", "Producer-Id", "p1", "Producer-Epoch", "0", "Producer-Seq", fmt.Sprint(i)).want(t, 200)
			}
			s.do(t, "POST", "/s", "", tc.closer...).want(t, 204).header(t, hdrStreamClosed, "true")
			s.do(t, "POST", "/s", "", tc.req...).want(t, tc.status).
				header(t, hdrStreamClosed, "true").header(t, hdrStreamNextOffset, tail).
				header(t, hdrProducerEpoch, tc.epoch).header(t, hdrProducerSeq, tc.seq)
			if got := s.do(t, "GET", "/s", "").body; got != "ab" {
				t.Errorf("body %q, want %q", got, "ab")
			}
		})
	}
}

// TestLongPollAtNowIsNotCached: a long-poll at offset=now that data wakes
// answers 200 with the data, but "now" names another position a moment
// later, so a CDN must not hand that answer to the next client polling the
// same URL (it keyed every new subscriber of the stream to old records). A
// long-poll at a real offset stays cacheable (section 10.1).
func TestLongPollAtNowIsNotCached(t *testing.T) {
	s := newDSServer(t, func(d *durableStreams) { d.longPollTimeout = 10 * time.Second })
	s.do(t, "PUT", "/s", "", ct, "text/plain").want(t, 201)
	for _, tc := range []struct {
		offset, cacheControl string // offset "tail": the tail's own offset
		etag                 bool
	}{
		{"now", cacheControlNoStore, false},
		{"tail", cacheControlCatchUp, true},
	} {
		if tc.offset == "tail" {
			tc.offset = s.do(t, "HEAD", "/s", "").want(t, 200).h.Get(hdrStreamNextOffset)
		}
		done := make(chan resp, 1)
		go func() { done <- s.do(t, "GET", "/s?live=long-poll&offset="+tc.offset, "") }()
		// Append until the long-poll answers: an append that lands before
		// it reads the tail leaves it waiting for the next one.
		var r resp
		for r.status == 0 {
			s.do(t, "POST", "/s", "x", ct, "text/plain").want(t, 204)
			select {
			case r = <-done:
			case <-time.After(50 * time.Millisecond):
			}
		}
		r.want(t, 200)
		if got := r.h.Get("Cache-Control"); got != tc.cacheControl {
			t.Errorf("offset=%s: Cache-Control %q, want %q", tc.offset, got, tc.cacheControl)
		}
		if got := r.h.Get("ETag") != ""; got != tc.etag {
			t.Errorf("offset=%s: ETag %q, want one: %v", tc.offset, r.h.Get("ETag"), tc.etag)
		}
	}
}

// TestReadForkFromItsOffsetInsideALargeRecord: a fork cut deep inside a
// record that the source handed out in pieces (at the offset after a
// chunk-limited read), read from its fork offset, is at the end of the
// cut record and reads on with the fork's own records in every mode. When
// the cut part filled the engine's read by itself, the read came back
// with nothing and not up to date: catch-up answered an empty 200, a
// long-poll 500 and an SSE feed ended without an event.
func TestReadForkFromItsOffsetInsideALargeRecord(t *testing.T) {
	s := newDSServer(t, func(d *durableStreams) { d.chunkBytes = 10 })
	s.do(t, "PUT", "/src", strings.Repeat("s", 36), ct, "text/plain").want(t, 201)
	// The source hands out (0,10), then (0,20): the fork point is one the
	// server gave out.
	off := "-1"
	for range 2 {
		off = s.do(t, "GET", "/src?offset="+off, "").want(t, 200).h.Get(hdrStreamNextOffset)
	}
	if off != (position{0, 20}).String() {
		t.Fatalf("source's second offset %s", off)
	}
	s.do(t, "PUT", "/fork", "", "Stream-Forked-From", "/src", "Stream-Fork-Offset", off).want(t, 201)
	s.do(t, "POST", "/fork", "own", ct, "text/plain").want(t, 204)
	tail := position{2, 0}.String()

	r := s.do(t, "GET", "/fork?offset="+off, "").want(t, 200)
	if r.body != "own" || r.h.Get(hdrStreamNextOffset) != tail || r.h.Get(hdrStreamUpToDate) != "true" {
		t.Errorf("catch-up from the fork offset: %q, next %s, up to date %q; want %q to %s, up to date",
			r.body, r.h.Get(hdrStreamNextOffset), r.h.Get(hdrStreamUpToDate), "own", tail)
	}
	r = s.do(t, "GET", "/fork?live=long-poll&offset="+off, "")
	if r.status != 200 || r.body != "own" || r.h.Get(hdrStreamNextOffset) != tail {
		t.Errorf("long-poll from the fork offset: %d %q, next %s; want 200 %q to %s",
			r.status, r.body, r.h.Get(hdrStreamNextOffset), "own", tail)
	}
	sr := s.sse(t, "/fork?live=sse&offset="+off)
	if ev := sr.next(t); ev.typ != "data" || ev.data != "own" {
		t.Errorf("SSE from the fork offset: first event %+v, want data %q", ev, "own")
	}
	if c := sr.control(t); c.StreamNextOffset != tail || !c.UpToDate {
		t.Errorf("SSE control %+v, want next %s, up to date", c, tail)
	}
}

// TestLiveReadsEndWhenTheStreamIsSoftDeleted: a stream that forks still
// read is soft-deleted by DELETE, and then every request to it is 410
// (section 4.2). Live reads waiting at its tail used to go on waiting: a
// long-poll answered 204, up to date with a cursor to poll again, at its
// timeout, and an SSE feed stayed open until its reconnect interval. Now
// the long-poll answers 410 and the feed ends, as they answer 404 and end
// when a delete removes the stream.
func TestLiveReadsEndWhenTheStreamIsSoftDeleted(t *testing.T) {
	s := newDSServer(t, func(d *durableStreams) {
		d.longPollTimeout = 10 * time.Second
		d.sseInterval = 10 * time.Minute
		d.live = &liveReaders{}
	})
	s.do(t, "PUT", "/src", "a", ct, "text/plain").want(t, 201)
	s.do(t, "PUT", "/fork", "", "Stream-Forked-From", "/src").want(t, 201)
	tail := position{1, 0}.String()

	sr := s.sse(t, "/src?live=sse&offset="+tail)
	if c := sr.control(t); !c.UpToDate {
		t.Fatalf("SSE at the tail: %+v", c)
	}
	done := make(chan resp, 1)
	go func() { done <- s.do(t, "GET", "/src?live=long-poll&offset="+tail, "") }()
	// The long-poll has begun; its read of the tail is in memory, the
	// delete writes metadata first, so the long-poll waits by then.
	for s.proto.live.longPoll.Load() == 0 {
		runtime.Gosched()
	}
	s.do(t, "DELETE", "/src", "").want(t, 204)
	s.do(t, "GET", "/src", "").want(t, 410)

	r := <-done
	if r.status != 410 {
		t.Errorf("long-poll on a stream soft-deleted while it waited: %d %q %v, want 410", r.status, r.body, r.h)
	}
	// Within far less than the reconnect interval.
	sr.ends(t, 30*time.Second)
	// The fork still reads its inherited record.
	if got := s.do(t, "GET", "/fork", "").want(t, 200).body; got != "a" {
		t.Errorf("the fork reads %q", got)
	}
}

// TestLongPollKeepsATTLStreamAlive: a client that long-polls a stream
// without pause reads it all the while, and reads renew Stream-TTL
// (section 5.5). With a TTL shorter than the long-poll timeout the stream
// used to expire during the first long-poll, and the next one got 404.
func TestLongPollKeepsATTLStreamAlive(t *testing.T) {
	s := newDSServer(t, func(d *durableStreams) { d.longPollTimeout = 2500 * time.Millisecond })
	s.do(t, "PUT", "/s", "a", ct, "text/plain", "Stream-TTL", "1").want(t, 201)
	tail := position{1, 0}.String()
	for i := range 2 {
		r := s.do(t, "GET", "/s?live=long-poll&offset="+tail, "")
		if r.status != 204 {
			t.Fatalf("long-poll %d: %d %q, want 204 at the timeout", i, r.status, r.body)
		}
	}
	s.do(t, "GET", "/s?offset=-1", "").want(t, 200)
}

// TestForkCreateRepeated: a fork create repeated is 200 (section 4.2)
// whatever became of the source since: grown past the tail an omitted
// offset meant, trimmed past the fork point, deleted while its forks read
// it. A repeat that asks for another point or source is still 409, and so
// is one without an offset of a fork made with one.
func TestForkCreateRepeated(t *testing.T) {
	s := newDSServer(t)
	s.do(t, "PUT", "/src", "hello", ct, "text/plain").want(t, 201)
	s.do(t, "POST", "/src", " world", ct, "text/plain").want(t, 204)
	s.do(t, "PUT", "/other", "hello world", ct, "text/plain").want(t, 201)
	s.do(t, "PUT", "/js", `[1,2,3]`, ct, "application/json").want(t, 201)
	forks := []struct {
		name string
		hdr  []string
		body string // what the fork reads
	}{
		{"/tail", []string{"Stream-Forked-From", "/src"}, "hello world"},
		{"/at", []string{"Stream-Forked-From", "/src", "Stream-Fork-Offset", position{1, 0}.String(), "Stream-Fork-Sub-Offset", "3"}, "hello wo"},
		{"/start", []string{"Stream-Forked-From", "/src", "Stream-Fork-Offset", "-1"}, ""},
		{"/jf", []string{"Stream-Forked-From", "/js", "Stream-Fork-Offset", position{}.String(), "Stream-Fork-Sub-Offset", "2"}, "[1,2]"},
	}
	for _, f := range forks {
		s.do(t, "PUT", f.name, "", f.hdr...).want(t, 201)
	}
	ctx := context.Background()
	for _, step := range []struct {
		name string
		do   func()
	}{
		{"the source grew", func() { s.do(t, "POST", "/src", "!", ct, "text/plain").want(t, 204) }},
		{"the source was trimmed past the points", func() {
			if _, err := s.eng.Trim(ctx, "/src", 3); err != nil {
				t.Fatal(err)
			}
		}},
		{"the sources were deleted", func() {
			s.do(t, "DELETE", "/src", "").want(t, 204)
			s.do(t, "DELETE", "/js", "").want(t, 204)
		}},
	} {
		step.do()
		for _, f := range forks {
			if r := s.do(t, "PUT", f.name, "", f.hdr...); r.status != 200 {
				t.Errorf("%s: PUT %s repeated: %d %q, want 200", step.name, f.name, r.status, r.body)
			}
			if got := s.do(t, "GET", f.name, "").body; got != f.body {
				t.Errorf("%s: %s reads %q, want %q", step.name, f.name, got, f.body)
			}
		}
	}
	for _, c := range []struct {
		name string
		hdr  []string
	}{
		{"/at", []string{"Stream-Forked-From", "/src", "Stream-Fork-Offset", position{1, 0}.String(), "Stream-Fork-Sub-Offset", "2"}},
		{"/at", []string{"Stream-Forked-From", "/src", "Stream-Fork-Offset", "-1"}},
		{"/tail", []string{"Stream-Forked-From", "/other"}},
		// No offset is the fork's own point only for a fork made without
		// one: otherwise it is the source's tail now.
		{"/at", []string{"Stream-Forked-From", "/src"}},
		{"/jf", []string{"Stream-Forked-From", "/js", "Stream-Fork-Offset", position{}.String(), "Stream-Fork-Sub-Offset", "1"}},
		{"/tail", []string{"Stream-Forked-From", "/src", "Stream-TTL", "60"}},
	} {
		if r := s.do(t, "PUT", c.name, "", c.hdr...); r.status != 409 {
			t.Errorf("PUT %s %v: %d %q, want 409", c.name, c.hdr, r.status, r.body)
		}
	}
	s.do(t, "PUT", "/jf", "", "Stream-Forked-From", "/js", "Stream-Fork-Offset", position{0, 1}.String()).want(t, 400)
}

// TestLiveReadsEndAtSoftDelete: an SSE feed and a long-poll at the tail
// of a stream end when it is deleted while a fork reads it, as they do at
// a delete outright, rather than waiting out their time (a minute here)
// on a stream every request now answers 410.
func TestLiveReadsEndAtSoftDelete(t *testing.T) {
	s := newDSServer(t, func(d *durableStreams) { d.longPollTimeout, d.sseInterval = time.Minute, time.Minute })
	s.do(t, "PUT", "/src", "hello", ct, "text/plain").want(t, 201)
	tail := s.do(t, "PUT", "/f", "", "Stream-Forked-From", "/src").want(t, 201).h.Get(hdrStreamNextOffset)
	r := s.sse(t, "/src?offset=-1&live=sse")
	if ev := r.next(t); ev.typ != "data" || ev.data != "hello" {
		t.Fatalf("first event %s %q", ev.typ, ev.data)
	}
	if c := r.control(t); !c.UpToDate {
		t.Fatalf("control %+v, want up to date", c)
	}
	polled := make(chan resp, 1)
	go func() { polled <- s.do(t, "GET", "/src?live=long-poll&offset="+tail, "") }()
	s.do(t, "DELETE", "/src", "").want(t, 204)
	r.ends(t, 10*time.Second)
	select {
	case p := <-polled:
		if p.status != 410 {
			t.Errorf("long-poll across the soft delete: %d %q, want 410", p.status, p.body)
		}
	case <-time.After(10 * time.Second):
		t.Error("the long-poll is still waiting 10s after the soft delete")
	}
	s.do(t, "GET", "/src?offset=-1&live=sse", "").want(t, 410)
}

// TestReadsWithCredentialsArePrivate: a read answer a cache may keep says
// "public" only when the request carried no credentials, neither
// Authorization nor a Cookie (a login portal's session). With "public", a
// shared cache may give the answer to a request with credentials to clients
// without them (RFC 9111 sections 3 and 3.5); section 10.1 asks for
// "private" on streams that may be user-specific. Answers that must not be
// kept stay no-store either way.
func TestReadsWithCredentialsArePrivate(t *testing.T) {
	s := newDSServer(t, func(d *durableStreams) { d.longPollTimeout = 50 * time.Millisecond })
	s.do(t, "PUT", "/s", "abc", ct, "text/plain").want(t, 201)
	s.do(t, "PUT", "/c", "x", ct, "text/plain", hdrStreamClosed, "true").want(t, 201)
	tail := position{1, 0}.String()
	for _, tc := range []struct {
		name, path string
		status     int
		anonymous  string // Cache-Control without Authorization
		withAuth   string // with it
	}{
		{"catch-up data", "/s?offset=-1", 200, cacheControlCatchUp, cacheControlPrivate},
		{"catch-up closed EOF", "/c?offset=" + tail, 200, cacheControlCatchUp, cacheControlPrivate},
		{"long-poll data", "/s?offset=-1&live=long-poll", 200, cacheControlCatchUp, cacheControlPrivate},
		{"catch-up open tail", "/s?offset=" + tail, 200, cacheControlNoStore, cacheControlNoStore},
		{"catch-up now", "/s?offset=now", 200, cacheControlNoStore, cacheControlNoStore},
		{"long-poll timeout", "/s?offset=" + tail + "&live=long-poll", 204, cacheControlNoStore, cacheControlNoStore},
		{"SSE", "/c?offset=-1&live=sse", 200, cacheControlEventFeed, cacheControlPrivateFeed},
		// A feed at now would give a reader that a cache collapsed onto it
		// later records from before it asked.
		{"SSE at now", "/c?offset=now&live=sse", 200, cacheControlNoStore, cacheControlNoStore},
		// HEAD's URL: caches that fetch a HEAD as a GET would answer HEADs
		// with this chunk's headers.
		{"catch-up, bare URL", "/s", 200, cacheControlNoStore, cacheControlNoStore},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s.do(t, "GET", tc.path, "").want(t, tc.status).header(t, "Cache-Control", tc.anonymous).header(t, "Vary", "")
			for _, cred := range [][2]string{{"Authorization", "Bearer reader-1"}, {"Cookie", "session=reader-1"}} {
				s.do(t, "GET", tc.path, "", cred[0], cred[1]).want(t, tc.status).
					header(t, "Cache-Control", tc.withAuth).header(t, "Vary", "")
			}
		})
	}
}

// TestCacheReadsPrivate: with cache_reads private every read answer a
// cache may keep says "private", with its max-age, whatever the request
// carries (a token in the query, an API key header: credentials the
// module cannot see); answers that must not be kept stay no-store.
func TestCacheReadsPrivate(t *testing.T) {
	s := newDSServer(t, func(d *durableStreams) {
		d.longPollTimeout = 50 * time.Millisecond
		d.privateReads = true
	})
	s.do(t, "PUT", "/s", "abc", ct, "text/plain").want(t, 201)
	s.do(t, "PUT", "/c", "x", ct, "text/plain", hdrStreamClosed, "true").want(t, 201)
	tail := position{1, 0}.String()
	for _, tc := range []struct {
		name, path   string
		status       int
		cacheControl string
	}{
		{"catch-up data", "/s?offset=-1", 200, cacheControlPrivate},
		{"catch-up with a token", "/s?offset=-1&token=reader-1", 200, cacheControlPrivate},
		{"catch-up closed EOF", "/c?offset=" + tail, 200, cacheControlPrivate},
		{"long-poll data", "/s?offset=-1&live=long-poll", 200, cacheControlPrivate},
		{"catch-up open tail", "/s?offset=" + tail, 200, cacheControlNoStore},
		{"catch-up now", "/s?offset=now", 200, cacheControlNoStore},
		{"long-poll timeout", "/s?offset=" + tail + "&live=long-poll", 204, cacheControlNoStore},
		{"SSE", "/c?offset=-1&live=sse", 200, cacheControlPrivateFeed},
		{"SSE at now", "/c?offset=now&live=sse", 200, cacheControlNoStore},
		{"catch-up, bare URL", "/s", 200, cacheControlNoStore},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s.do(t, "GET", tc.path, "").want(t, tc.status).header(t, "Cache-Control", tc.cacheControl)
			s.do(t, "GET", tc.path, "", "X-Api-Key", "reader-1").want(t, tc.status).header(t, "Cache-Control", tc.cacheControl)
		})
	}
}

// TestNewNameWithControlCharacter: the engine refuses a create whose name
// has a control character (streamstore's TestValidateNewName has the
// classes), and the handler answers 400 and stores nothing.
func TestNewNameWithControlCharacter(t *testing.T) {
	s := newDSServer(t)
	s.do(t, "PUT", "/a%0Ab", "", ct, "text/plain").want(t, 400)
	s.do(t, "HEAD", "/a%0Ab", "").want(t, 404)
	s.do(t, "PUT", "/a%20b", "", ct, "text/plain").want(t, 201)
}

// TestRevalidationReplacesUpToDate: a chunk that ends exactly at the byte
// limit reaches the tail until the next append, its range unchanged after
// it. Its ETag says whether it is up to date, so a cache revalidating it
// after the append gets a 200 without Stream-Up-To-Date rather than a 304,
// which can add or replace a kept header but never drop one: the kept
// "up to date" would have stayed for good.
func TestRevalidationReplacesUpToDate(t *testing.T) {
	s := newDSServer(t, func(d *durableStreams) { d.chunkBytes = 4 })
	s.do(t, "PUT", "/s", "abcd", ct, "text/plain").want(t, 201)
	first := s.do(t, "GET", "/s?offset=-1", "").want(t, 200).header(t, hdrStreamUpToDate, "true")
	tag := first.h.Get("ETag")
	s.do(t, "GET", "/s?offset=-1", "", "If-None-Match", tag).want(t, 304)
	s.do(t, "POST", "/s", "efgh", ct, "text/plain").want(t, 204)
	r := s.do(t, "GET", "/s?offset=-1", "", "If-None-Match", tag).want(t, 200).header(t, hdrStreamUpToDate, "")
	if r.body != "abcd" || r.h.Get(hdrStreamNextOffset) != first.h.Get(hdrStreamNextOffset) {
		t.Errorf("after the append: %q to %s; want the same chunk", r.body, r.h.Get(hdrStreamNextOffset))
	}
}
