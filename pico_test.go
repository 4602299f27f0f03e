package picomq

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap/zaptest"

	"github.com/picomq/caddy-picomq/internal/picowire"
	"github.com/picomq/caddy-picomq/segment"
	"github.com/picomq/caddy-picomq/streamstore"
)

// picoServer serves one engine over a file store through both protocols,
// as a Caddyfile with handle_path /pico/* { picomq { protocol pico } } and
// handle_path /ds/* { picomq } would: the prefix is stripped before the
// handler and kept in the original request.
type picoServer struct {
	*httptest.Server
	eng      *streamstore.Engine
	pico     *picoProtocol
	ds       *durableStreams // the handler under /ds
	shutdown context.CancelFunc
}

func newPicoServer(t *testing.T, tweak ...func(*picoProtocol)) *picoServer {
	t.Helper()
	return newPicoServerConfig(t, streamstore.Config{NodeID: "test-node", FlushInterval: time.Millisecond}, tweak...)
}

// newPicoServerConfig is newPicoServer with an engine configured by cfg.
func newPicoServerConfig(t *testing.T, cfg streamstore.Config, tweak ...func(*picoProtocol)) *picoServer {
	t.Helper()
	store, err := segment.Open("file://"+t.TempDir(), segment.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	eng := streamstore.New(store, cfg, zaptest.NewLogger(t))
	if err := eng.Start(context.Background()); err != nil {
		t.Fatalf("starting engine: %v", err)
	}
	shutdown, cancel := context.WithCancel(context.Background())
	engine := func(context.Context) (*streamstore.Engine, error) { return eng, nil }
	p := &picoProtocol{
		engine:          engine,
		shutdown:        shutdown,
		log:             zaptest.NewLogger(t),
		longPollTimeout: 300 * time.Millisecond,
		sseInterval:     5 * time.Second,
		maxAppend:       1 << 20,
		chunkBytes:      picoDefaultReadBytes,
		jitter:          randomJitter,
		hubs:            &sseHubs{},
	}
	for _, f := range tweak {
		f(p)
	}
	d := &durableStreams{
		engine:          engine,
		shutdown:        shutdown,
		log:             zaptest.NewLogger(t),
		longPollTimeout: 300 * time.Millisecond,
		sseInterval:     5 * time.Second,
		maxAppend:       1 << 20,
		chunkBytes:      picoDefaultReadBytes,
		jitter:          randomJitter,
		subs:            &subManagers{},
	}
	handlers := map[string]*Handler{
		"/pico": {proto: p, shutdown: shutdown, cancelShutdown: cancel},
		"/ds":   {proto: d, shutdown: shutdown, cancelShutdown: cancel},
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		orig := *r.Clone(r.Context())
		r = r.WithContext(context.WithValue(r.Context(), caddyhttp.OriginalRequestCtxKey, orig))
		for prefix, h := range handlers {
			if rest, ok := strings.CutPrefix(r.URL.Path, prefix+"/"); ok {
				r.URL.Path = "/" + rest
				r.URL.RawPath = ""
				if err := h.ServeHTTP(w, r, nil); err != nil {
					t.Errorf("ServeHTTP returned %v", err)
				}
				return
			}
		}
		http.NotFound(w, r)
	}))
	s := &picoServer{Server: srv, eng: eng, pico: p, ds: d, shutdown: cancel}
	t.Cleanup(func() {
		cancel()
		srv.Close()
		if err := eng.Close(context.Background()); err != nil {
			t.Errorf("closing engine: %v", err)
		}
	})
	return s
}

// picoResp is a finished response.
type picoResp struct {
	status int
	h      http.Header
	body   []byte
}

// do sends a request; hdr holds header name/value pairs.
func (s *picoServer) do(t *testing.T, method, path string, body []byte, hdr ...string) picoResp {
	t.Helper()
	h := http.Header{}
	for i := 0; i+1 < len(hdr); i += 2 {
		h.Set(hdr[i], hdr[i+1])
	}
	return s.send(t, method, path, body, h)
}

// doHeader sends a request without a body with the headers given, which
// may repeat a header.
func (s *picoServer) doHeader(t *testing.T, method, path string, h http.Header) picoResp {
	t.Helper()
	return s.send(t, method, path, nil, h)
}

func (s *picoServer) send(t *testing.T, method, path string, body []byte, h http.Header) picoResp {
	t.Helper()
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequest(method, s.URL+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	req.Header = h.Clone()
	if req.Header == nil {
		req.Header = http.Header{}
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
	return picoResp{status: res.StatusCode, h: res.Header, body: b}
}

func (r picoResp) want(t *testing.T, status int) picoResp {
	t.Helper()
	if r.status != status {
		t.Fatalf("status %d, want %d; body %q; headers %v", r.status, status, r.body, r.h)
	}
	return r
}

func (r picoResp) header(t *testing.T, name, want string) picoResp {
	t.Helper()
	if got := r.h.Get(name); got != want {
		t.Errorf("%s = %q, want %q (status %d, body %q)", name, got, want, r.status, r.body)
	}
	return r
}

// wantError checks a JSON error body: its error name and, when next is not
// negative, its next_seq.
func (r picoResp) wantError(t *testing.T, status int, code string, next int64) picoResp {
	t.Helper()
	r.want(t, status)
	var e struct {
		Error   string  `json:"error"`
		Message string  `json:"message"`
		NextSeq *uint64 `json:"next_seq"`
	}
	if err := json.Unmarshal(r.body, &e); err != nil {
		t.Fatalf("error body %q: %v", r.body, err)
	}
	if e.Error != code {
		t.Errorf("error %q, want %q (body %q)", e.Error, code, r.body)
	}
	if r.h.Get("Content-Type") != "application/json" || r.h.Get("Cache-Control") != "no-store" {
		t.Errorf("error headers %v", r.h)
	}
	switch {
	case next >= 0 && (e.NextSeq == nil || *e.NextSeq != uint64(next)):
		t.Errorf("next_seq %v, want %d (body %q)", e.NextSeq, next, r.body)
	case next < 0 && e.NextSeq != nil:
		t.Errorf("next_seq %d, want none", *e.NextSeq)
	}
	return r
}

// jsonRecord is a record of a JSON read.
type jsonRecord struct {
	Seq       uint64            `json:"seq"`
	Timestamp int64             `json:"timestamp"`
	Headers   map[string]string `json:"headers"`
	Body      *string           `json:"body"`
	BodyB64   []byte            `json:"body_b64"`
}

func (r jsonRecord) bytes() []byte {
	if r.Body != nil {
		return []byte(*r.Body)
	}
	return r.BodyB64
}

func (r picoResp) records(t *testing.T) []jsonRecord {
	t.Helper()
	var recs []jsonRecord
	if err := json.Unmarshal(r.body, &recs); err != nil {
		t.Fatalf("JSON read %q: %v", r.body, err)
	}
	return recs
}

const hCT = "Content-Type"

func TestPicoCreate(t *testing.T) {
	s := newPicoServer(t)
	r := s.do(t, "PUT", "/pico/orders", nil, hCT, "text/plain").want(t, 201)
	r.header(t, "Location", "/pico/orders").header(t, hdrPicoNextSeq, "0").header(t, hCT, "text/plain").
		header(t, "Cache-Control", "no-store")
	s.do(t, "PUT", "/pico/orders", nil, hCT, "Text/Plain").want(t, 200).header(t, hdrPicoNextSeq, "0").header(t, "Location", "")
	s.do(t, "PUT", "/pico/orders", nil, hCT, "application/json").wantError(t, 409, picoErrConflict, 0)

	// No Content-Type: application/octet-stream.
	s.do(t, "PUT", "/pico/raw", nil).want(t, 201)
	s.do(t, "HEAD", "/pico/raw", nil).want(t, 200).header(t, hCT, "application/octet-stream").
		header(t, hdrPicoStartSeq, "0").header(t, hdrPicoNextSeq, "0").header(t, hdrPicoClosed, "")

	// Names in the URL space: escapes and the stripped prefix.
	s.do(t, "PUT", "/pico/a%20b/c", nil).want(t, 201).header(t, "Location", "/pico/a%20b/c")
	if _, err := s.eng.Head(context.Background(), "/a b/c"); err != nil {
		t.Errorf("stream named by the stripped path: %v", err)
	}

	// A body is the first record; a batch body the first records.
	s.do(t, "PUT", "/pico/first", []byte("hello"), hCT, "text/plain").want(t, 201).header(t, hdrPicoNextSeq, "1")
	recs := s.do(t, "GET", "/pico/first", nil).want(t, 200).records(t)
	if len(recs) != 1 || string(recs[0].bytes()) != "hello" || recs[0].Seq != 0 || recs[0].Timestamp == 0 {
		t.Errorf("first record %+v", recs)
	}
	batch := picowire.EncodeBinary([]picowire.Record{{Body: []byte("a")}, {Body: []byte("b")}})
	s.do(t, "PUT", "/pico/firsts", batch, hCT, picowire.BinaryBatch).want(t, 201).header(t, hdrPicoNextSeq, "2").
		header(t, hCT, "application/octet-stream")
	s.do(t, "PUT", "/pico/firsts", batch, hCT, picowire.BinaryBatch).want(t, 200).header(t, hdrPicoNextSeq, "2")
	// A batch that ends in records weighing nothing (no body, no
	// headers) is confirmed as well: the comparison's read stopped at the
	// batch's weight before them, and the repeat was 409.
	for i, recs := range [][]picowire.Record{{{Body: []byte("a")}, {}}, {{}, {Body: []byte("a")}, {}}, {{}, {}}} {
		name := fmt.Sprintf("/pico/weightless%d", i)
		b := picowire.EncodeBinary(recs)
		next := strconv.Itoa(len(recs))
		s.do(t, "PUT", name, b, hCT, picowire.BinaryBatch).want(t, 201).header(t, hdrPicoNextSeq, next)
		s.do(t, "PUT", name, b, hCT, picowire.BinaryBatch).want(t, 200).header(t, hdrPicoNextSeq, next)
		// The first records are the body; the stream's others follow.
		s.do(t, "PUT", name, picowire.EncodeBinary(recs[:len(recs)-1]), hCT, picowire.BinaryBatch).want(t, 200)
		s.do(t, "PUT", name, picowire.EncodeBinary([]picowire.Record{{Body: []byte("z")}}), hCT, picowire.BinaryBatch).
			wantError(t, 409, picoErrConflict, int64(len(recs)))
	}
	s.do(t, "PUT", "/pico/badfirst", []byte{2, 0, 0, 0, 1}, hCT, picowire.BinaryBatch).wantError(t, 400, picoErrBadRequest, -1)
	s.do(t, "HEAD", "/pico/badfirst", nil).want(t, 404)
	// A batch type without a body is a create without initial records,
	// for the batches to come, not a malformed batch.
	for _, ct := range []string{picowire.BinaryBatch, picowire.JSONBatch} {
		s.do(t, "PUT", "/pico/forbatches", nil, hCT, ct).want(t, 201).header(t, hdrPicoNextSeq, "0").
			header(t, hCT, "application/octet-stream")
		s.do(t, "PUT", "/pico/forbatches", nil, hCT, ct).want(t, 200).header(t, hdrPicoNextSeq, "0")
		s.do(t, "DELETE", "/pico/forbatches", nil).want(t, 204)
	}

	// Closed at creation.
	s.do(t, "PUT", "/pico/sealed", nil, hdrPicoClosed, "true").want(t, 201).header(t, hdrPicoClosed, "true")
	s.do(t, "HEAD", "/pico/sealed", nil).want(t, 200).header(t, hdrPicoClosed, "true")
	s.do(t, "PUT", "/pico/sealed", nil).wantError(t, 409, picoErrConflict, 0)

	// The root is not a stream.
	s.do(t, "PUT", "/pico/", nil).wantError(t, 400, picoErrBadRequest, -1)
}

func TestPicoCreateExpiry(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/ttl", nil, hdrPicoTTL, "3600").want(t, 201)
	s.do(t, "HEAD", "/pico/ttl", nil).want(t, 200).header(t, hdrPicoTTL, "3600").header(t, hdrPicoExpiresAt, "")
	s.do(t, "PUT", "/pico/ttl", nil, hdrPicoTTL, "3600").want(t, 200)
	s.do(t, "PUT", "/pico/ttl", nil, hdrPicoTTL, "60").wantError(t, 409, picoErrConflict, 0)
	// The same setting as Durable Streams' Stream-TTL.
	s.do(t, "HEAD", "/ds/ttl", nil).want(t, 200).header(t, hdrStreamTTL, "3600")

	s.do(t, "PUT", "/pico/at-rfc", nil, hdrPicoExpiresAt, "2099-01-02T03:04:05.678Z").want(t, 201)
	s.do(t, "HEAD", "/pico/at-rfc", nil).want(t, 200).header(t, hdrPicoExpiresAt, "2099-01-02T03:04:05.678Z").header(t, hdrPicoTTL, "")
	at := time.Date(2099, 1, 2, 3, 4, 5, 678e6, time.UTC)
	ms := strconv.FormatInt(at.UnixMilli(), 10)
	// Unix milliseconds name the same instant: the create is idempotent.
	s.do(t, "PUT", "/pico/at-rfc", nil, hdrPicoExpiresAt, ms).want(t, 200)
	s.do(t, "PUT", "/pico/at-ms", nil, hdrPicoExpiresAt, ms).want(t, 201)
	s.do(t, "HEAD", "/pico/at-ms", nil).want(t, 200).header(t, hdrPicoExpiresAt, "2099-01-02T03:04:05.678Z")
	s.do(t, "HEAD", "/ds/at-ms", nil).want(t, 200).header(t, hdrStreamExpiresAt, "2099-01-02T03:04:05.678Z")

	for _, hdr := range [][]string{
		{hdrPicoTTL, "60", hdrPicoExpiresAt, "2099-01-01T00:00:00Z"},
		{hdrPicoTTL, "-1"},
		{hdrPicoTTL, "1.5"},
		{hdrPicoTTL, "0"},
		{hdrPicoTTL, ""},
		{hdrPicoExpiresAt, "tomorrow"},
		{hdrPicoExpiresAt, "99999999999999999999"},
		// Not in the future: 0 would otherwise read as "never expires".
		{hdrPicoExpiresAt, "0"},
		{hdrPicoExpiresAt, "2001-01-01T00:00:00Z"},
		{hCT, "not a type"},
	} {
		s.do(t, "PUT", "/pico/bad", nil, hdr...).wantError(t, 400, picoErrBadRequest, -1)
	}
	s.do(t, "HEAD", "/pico/bad", nil).want(t, 404)
}

// TestPicoHeaderMessages pins the text of the errors that name a header:
// they spell it as the Pico reference does (Pico-TTL, not Go's canonical
// Pico-Ttl) and say what is wrong and what is allowed.
func TestPicoHeaderMessages(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/ttl", nil, hdrPicoTTL, "3600").want(t, 201)
	s.do(t, "PUT", "/pico/plain", nil, hCT, "text/plain").want(t, 201)
	s.do(t, "PUT", "/pico/at", nil, hdrPicoExpiresAt, "2099-01-02T03:04:05Z").want(t, 201)
	for _, tc := range []struct {
		name   string
		method string
		path   string
		hdr    http.Header
		status int
		want   string
	}{
		{"TTL and Expires-At", "PUT", "/pico/new", http.Header{hdrPicoTTL: {"60"}, hdrPicoExpiresAt: {"2099-01-01T00:00:00Z"}}, 400,
			"Pico-TTL and Pico-Expires-At were both given; a stream expires either after idle seconds (Pico-TTL) " +
				"or at an instant (Pico-Expires-At), so send only one"},
		{"TTL not a number", "PUT", "/pico/new", http.Header{hdrPicoTTL: {"soon"}}, 400,
			`Pico-TTL must be a whole number of seconds from 1 to 3153600000, without sign or leading zeros, got "soon"`},
		{"TTL zero", "PUT", "/pico/new", http.Header{hdrPicoTTL: {"0"}}, 400,
			`Pico-TTL must be a whole number of seconds from 1 to 3153600000, without sign or leading zeros, got "0"`},
		{"TTL too large", "PUT", "/pico/new", http.Header{hdrPicoTTL: {"3153600001"}}, 400,
			`Pico-TTL must be a whole number of seconds from 1 to 3153600000, without sign or leading zeros, got "3153600001"`},
		{"TTL with a leading zero", "PUT", "/pico/new", http.Header{hdrPicoTTL: {"060"}}, 400,
			`Pico-TTL must be a whole number of seconds from 1 to 3153600000, without sign or leading zeros, got "060"`},
		{"producer epoch past 2^53-1", "POST", "/pico/ttl", http.Header{"Content-Type": {"text/plain"}, hdrPicoProducerID: {"p"},
			hdrPicoProducerEpoch: {"9007199254740992"}, hdrPicoProducerSeq: {"0"}}, 400,
			`Pico-Producer-Epoch must be an integer from 0 to 2^53-1, got "9007199254740992"`},
		{"producer seq past 2^53-1", "POST", "/pico/ttl", http.Header{"Content-Type": {"text/plain"}, hdrPicoProducerID: {"p"},
			hdrPicoProducerEpoch: {"0"}, hdrPicoProducerSeq: {"9007199254740992"}}, 400,
			`Pico-Producer-Seq must be an integer from 0 to 2^53-1, got "9007199254740992"`},
		{"Expires-At in the past", "PUT", "/pico/new", http.Header{hdrPicoExpiresAt: {"2001-01-01T00:00:00Z"}}, 400,
			"Pico-Expires-At 2001-01-01T00:00:00Z is not in the future: the stream would expire at once"},
		{"TTL given twice", "PUT", "/pico/new", http.Header{hdrPicoTTL: {"60", "61"}}, 400,
			"Pico-TTL is given more than once, with different values"},
		{"Last-Event-ID given twice", "GET", "/pico/ttl?live=sse", http.Header{hdrLastEventID: {"1", "2"}}, 400,
			"Last-Event-ID is given more than once, with different values"},
		{"trim with producer headers", "POST", "/pico/ttl", http.Header{hdrPicoTrimSeq: {"0"}, hdrPicoClosed: {"true"}, hdrPicoMatchSeq: {"0"}}, 400,
			"a trim (Pico-Trim-Seq) cannot be combined with Pico-Closed, Pico-Match-Seq; send them in a request of their own"},
		{"create with another TTL", "PUT", "/pico/ttl", http.Header{hdrPicoTTL: {"60"}}, 409,
			"stream exists with Pico-TTL 3600, not 60; a create of an existing stream must give the same settings, " +
				"or delete the stream first"},
		{"create without the TTL", "PUT", "/pico/ttl", nil, 409,
			"stream exists with Pico-TTL 3600, not none; a create of an existing stream must give the same settings, " +
				"or delete the stream first"},
		{"create with a TTL where none is", "PUT", "/pico/plain", http.Header{hCT: {"text/plain"}, hdrPicoTTL: {"60"}}, 409,
			"stream exists with Pico-TTL none, not 60; a create of an existing stream must give the same settings, " +
				"or delete the stream first"},
		{"create with a TTL instead of Expires-At", "PUT", "/pico/at", http.Header{hdrPicoTTL: {"60"}}, 409,
			"stream exists with Pico-TTL none, not 60; Pico-Expires-At 2099-01-02T03:04:05Z, not none; " +
				"a create of an existing stream must give the same settings, or delete the stream first"},
		{"create with another type", "PUT", "/pico/plain", http.Header{hCT: {"application/json"}}, 409,
			"stream exists with content type text/plain, not application/json; a create of an existing stream " +
				"must give the same settings, or delete the stream first"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := s.doHeader(t, tc.method, tc.path, tc.hdr)
			r.want(t, tc.status)
			var body struct{ Message string }
			if err := json.Unmarshal(r.body, &body); err != nil {
				t.Fatalf("error body %q: %v", r.body, err)
			}
			if body.Message != tc.want {
				t.Errorf("message\n%s\nwant\n%s", body.Message, tc.want)
			}
		})
	}
}

func TestParsePicoExpiry(t *testing.T) {
	now := time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)
	nowMS := strconv.FormatInt(now.UnixMilli(), 10)
	for _, tc := range []struct {
		at   string
		want time.Time // zero: refused
	}{
		{"0", time.Time{}}, // would otherwise read as "no expiry"
		{"1000", time.Time{}},
		{nowMS, time.Time{}},
		{"2001-01-01T00:00:00Z", time.Time{}},
		{strconv.FormatInt(now.UnixMilli()+1, 10), now.Add(time.Millisecond)},
		{"2099-01-02T03:04:05.678999Z", time.Date(2099, 1, 2, 3, 4, 5, 678e6, time.UTC)},
		{"2099-01-02t03:04:05z", time.Date(2099, 1, 2, 3, 4, 5, 0, time.UTC)},
	} {
		x, err := parsePicoExpiry(http.Header{"Pico-Expires-At": {tc.at}}, now)
		switch {
		case tc.want.IsZero() && (err == nil || !strings.Contains(err.Error(), "not in the future")):
			t.Errorf("Pico-Expires-At %s: %+v %v, want it refused as not in the future", tc.at, x, err)
		case !tc.want.IsZero() && (err != nil || !x.ExpiresAt.Equal(tc.want)):
			t.Errorf("Pico-Expires-At %s: %+v %v, want %v", tc.at, x, err, tc.want)
		}
	}
}

// readAll reads a stream through the Pico handler in format json.
func (s *picoServer) readAll(t *testing.T, name string) []jsonRecord {
	t.Helper()
	return s.do(t, "GET", "/pico"+name+"?seq=0", nil).want(t, 200).records(t)
}

// TestPicoAppendConflictsComeBeforeJSONValidation: on an application/json
// stream, closure and a content-type mismatch are told before a record that
// is not JSON, as the engine orders them; nothing is written.
func TestPicoAppendConflictsComeBeforeJSONValidation(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/j", []byte(`1`), hCT, "application/json").want(t, 201)
	s.do(t, "PUT", "/pico/sealed", []byte(`1`), hCT, "application/json", hdrPicoClosed, "true").want(t, 201)
	tests := []struct {
		name, path string
		hdr        []string
		status     int
		code       string
		next       int64
	}{
		{"closed", "/pico/sealed", nil, 409, picoErrClosed, 1},
		{"closed, other type", "/pico/sealed", []string{hCT, "text/plain"}, 409, picoErrClosed, 1},
		{"other type", "/pico/j", []string{hCT, "text/plain"}, 409, picoErrConflict, -1},
		{"the stream's type", "/pico/j", []string{hCT, "application/json"}, 400, picoErrBadRequest, -1},
		{"no type", "/pico/j", nil, 400, picoErrBadRequest, -1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := s.do(t, "POST", tc.path, []byte("not json"), tc.hdr...).wantError(t, tc.status, tc.code, tc.next)
			if tc.code == picoErrClosed {
				r.header(t, hdrPicoClosed, "true")
			}
		})
	}
	for _, name := range []string{"/j", "/sealed"} {
		if recs := s.readAll(t, name); len(recs) != 1 {
			t.Errorf("%s holds %d records, want 1", name, len(recs))
		}
	}
}

func TestPicoAppendSingleAndBatches(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/s", nil, hCT, "text/plain").want(t, 201)
	r := s.do(t, "POST", "/pico/s", []byte("one"), hCT, "text/plain; charset=utf-8").want(t, 200)
	r.header(t, hdrPicoStartSeq, "0").header(t, hdrPicoNextSeq, "1").header(t, "Cache-Control", "no-store")
	ts1, _ := strconv.ParseInt(r.h.Get(hdrPicoTimestamp), 10, 64)
	if ts1 < time.Now().Add(-time.Minute).UnixMilli() {
		t.Errorf("Pico-Timestamp %q", r.h.Get(hdrPicoTimestamp))
	}
	// Without a Content-Type a body is one record of the stream's type.
	s.do(t, "POST", "/pico/s", []byte("two")).want(t, 200).header(t, hdrPicoStartSeq, "1")
	// Another type is refused.
	s.do(t, "POST", "/pico/s", []byte("x"), hCT, "application/json").wantError(t, 409, picoErrConflict, -1)

	nonUTF8 := []byte{0, 0xff, 0xfe, '\n', 0x80}
	jsonBatch := `{"records":[{"body":"three","headers":{"k":"v","ü":"ß"}},{"body_b64":"AP/+CoA="}]}`
	r = s.do(t, "POST", "/pico/s", []byte(jsonBatch), hCT, picowire.JSONBatch).want(t, 200)
	r.header(t, hdrPicoStartSeq, "2").header(t, hdrPicoNextSeq, "4")
	tsJSON, _ := strconv.ParseInt(r.h.Get(hdrPicoTimestamp), 10, 64)
	bin := picowire.EncodeBinary([]picowire.Record{
		{Headers: []segment.Header{{Name: "trace", Value: "abc"}, {Name: "empty", Value: ""}}, Body: nonUTF8},
		{Body: []byte{}},
		{Body: []byte("six")},
	})
	r = s.do(t, "POST", "/pico/s", bin, hCT, picowire.BinaryBatch).want(t, 200)
	r.header(t, hdrPicoStartSeq, "4").header(t, hdrPicoNextSeq, "7")
	tsBin, _ := strconv.ParseInt(r.h.Get(hdrPicoTimestamp), 10, 64)
	if !(ts1 < tsJSON && tsJSON < tsBin) {
		t.Errorf("timestamps not increasing: %d %d %d", ts1, tsJSON, tsBin)
	}

	// JSON read: seqs, timestamps (one per append), headers, bodies.
	recs := s.readAll(t, "/s")
	if len(recs) != 7 {
		t.Fatalf("%d records", len(recs))
	}
	want := [][]byte{[]byte("one"), []byte("two"), []byte("three"), nonUTF8, nonUTF8, {}, []byte("six")}
	for i, rec := range recs {
		if rec.Seq != uint64(i) || !bytes.Equal(rec.bytes(), want[i]) {
			t.Errorf("record %d: seq %d body %q, want %q", i, rec.Seq, rec.bytes(), want[i])
		}
		if i > 0 && rec.Timestamp < recs[i-1].Timestamp {
			t.Errorf("timestamp of %d goes back", i)
		}
	}
	if recs[0].Timestamp != ts1 || recs[2].Timestamp != tsJSON || recs[3].Timestamp != tsJSON || recs[4].Timestamp != tsBin || recs[6].Timestamp != tsBin {
		t.Errorf("timestamps %+v, appends answered %d %d %d", recs, ts1, tsJSON, tsBin)
	}
	if recs[2].Headers["k"] != "v" || recs[2].Headers["ü"] != "ß" || recs[4].Headers["trace"] != "abc" || recs[0].Headers != nil {
		t.Errorf("headers %+v", recs)
	}
	if recs[3].Body != nil || recs[0].Body == nil {
		t.Errorf("body vs body_b64: %s", s.do(t, "GET", "/pico/s", nil).body)
	}

	// Binary read: the same records, headers in order.
	r = s.do(t, "GET", "/pico/s?format=binary", nil).want(t, 200).header(t, hCT, picowire.BinaryBatch)
	brecs, err := picowire.DecodeBinaryRead(r.body)
	if err != nil {
		t.Fatal(err)
	}
	if len(brecs) != 7 || brecs[4].Seq != 4 || brecs[4].Timestamp != tsBin || !bytes.Equal(brecs[4].Body, nonUTF8) ||
		len(brecs[4].Headers) != 2 || brecs[4].Headers[0] != (segment.Header{Name: "trace", Value: "abc"}) ||
		brecs[4].Headers[1] != (segment.Header{Name: "empty", Value: ""}) {
		t.Errorf("binary read %+v", brecs)
	}

	// Raw read: the bodies, in the stream's type.
	r = s.do(t, "GET", "/pico/s?format=raw&seq=5", nil).want(t, 200).header(t, hCT, "text/plain")
	if string(r.body) != "six" {
		t.Errorf("raw body %q", r.body)
	}
	r = s.do(t, "GET", "/pico/s?format=raw", nil).want(t, 200)
	if !bytes.Equal(r.body, bytes.Join(want, nil)) {
		t.Errorf("raw body %q", r.body)
	}
}

func TestPicoMalformedBatchesWriteNothing(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/s", []byte("keep"), hCT, "text/plain").want(t, 201)
	good := picowire.EncodeBinary([]picowire.Record{{Headers: []segment.Header{{Name: "k", Value: "v"}}, Body: []byte("b")}})
	badUTF8 := picowire.EncodeBinary([]picowire.Record{{Headers: []segment.Header{{Name: "k", Value: "\xff"}}, Body: []byte("b")}})
	for name, c := range map[string]struct {
		ct   string
		body []byte
	}{
		"bad version":          {picowire.BinaryBatch, append([]byte{2}, good[1:]...)},
		"truncated":            {picowire.BinaryBatch, good[:len(good)-1]},
		"trailing bytes":       {picowire.BinaryBatch, append(append([]byte{}, good...), 0)},
		"no records":           {picowire.BinaryBatch, []byte{1, 0, 0, 0, 0}},
		"invalid UTF-8 header": {picowire.BinaryBatch, badUTF8},
		"huge count":           {picowire.BinaryBatch, []byte{1, 0xff, 0xff, 0xff, 0xff}},
		"json empty records":   {picowire.JSONBatch, []byte(`{"records":[]}`)},
		"json no records":      {picowire.JSONBatch, []byte(`{}`)},
		"json bad base64":      {picowire.JSONBatch, []byte(`{"records":[{"body_b64":"!!"}]}`)},
		"json invalid UTF-8":   {picowire.JSONBatch, []byte("{\"records\":[{\"body\":\"\xff\"}]}")},
		"json no body":         {picowire.JSONBatch, []byte(`{"records":[{"headers":{"k":"v"}}]}`)},
		"json truncated":       {picowire.JSONBatch, []byte(`{"records":[{"body":"x"}`)},
		"json not an object":   {picowire.JSONBatch, []byte(`[{"body":"x"}]`)},
		"json header number":   {picowire.JSONBatch, []byte(`{"records":[{"body":"x","headers":{"k":1}}]}`)},
	} {
		t.Run(name, func(t *testing.T) {
			s.do(t, "POST", "/pico/s", c.body, hCT, c.ct).wantError(t, 400, picoErrBadRequest, -1)
		})
	}
	s.do(t, "HEAD", "/pico/s", nil).want(t, 200).header(t, hdrPicoNextSeq, "1")
	if recs := s.readAll(t, "/s"); len(recs) != 1 || string(recs[0].bytes()) != "keep" {
		t.Errorf("records %+v", recs)
	}
	// An empty body is no record.
	s.do(t, "POST", "/pico/s", nil, hCT, "text/plain").wantError(t, 400, picoErrBadRequest, -1)
	// A body over max_append_size.
	s.do(t, "POST", "/pico/s", bytes.Repeat([]byte("x"), 1<<20+1), hCT, "text/plain").wantError(t, 413, picoErrTooLarge, -1)
	s.do(t, "POST", "/pico/missing", []byte("x")).wantError(t, 404, picoErrNotFound, -1)
}

func TestPicoProducers(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/p", nil, hCT, "text/plain").want(t, 201)
	prod := func(epoch, seq int) []string {
		return []string{hCT, "text/plain", hdrPicoProducerID, "w1", hdrPicoProducerEpoch, strconv.Itoa(epoch), hdrPicoProducerSeq, strconv.Itoa(seq)}
	}
	s.do(t, "POST", "/pico/p", []byte("a"), prod(1, 0)...).want(t, 200).
		header(t, hdrPicoProducerEpoch, "1").header(t, hdrPicoProducerSeq, "0").header(t, hdrPicoStartSeq, "0").header(t, hdrPicoNextSeq, "1")
	s.do(t, "POST", "/pico/p", []byte("b"), prod(1, 1)...).want(t, 200).header(t, hdrPicoStartSeq, "1").header(t, hdrPicoNextSeq, "2")
	// A retry: 200, nothing written, no Pico-Start-Seq.
	r := s.do(t, "POST", "/pico/p", []byte("b"), prod(1, 1)...).want(t, 200).header(t, hdrPicoNextSeq, "2").
		header(t, hdrPicoStartSeq, "").header(t, hdrPicoTimestamp, "").header(t, hdrPicoProducerSeq, "1")
	_ = r
	// A gap.
	s.do(t, "POST", "/pico/p", []byte("d"), prod(1, 3)...).wantError(t, 409, picoErrSeqGap, -1).
		header(t, hdrPicoExpectedSeq, "2").header(t, hdrPicoReceivedSeq, "3")
	// A new epoch fences the old one.
	s.do(t, "POST", "/pico/p", []byte("c"), prod(2, 0)...).want(t, 200).header(t, hdrPicoStartSeq, "2")
	s.do(t, "POST", "/pico/p", []byte("x"), prod(1, 2)...).wantError(t, 403, picoErrFenced, -1).header(t, hdrPicoProducerEpoch, "2")
	// A new epoch starts at seq 0: another is a gap from it, as for a
	// producer the stream does not know yet (pico-wire.md's error table).
	s.do(t, "POST", "/pico/p", []byte("x"), prod(3, 5)...).wantError(t, 409, picoErrSeqGap, -1).
		header(t, hdrPicoExpectedSeq, "0").header(t, hdrPicoReceivedSeq, "5")
	s.do(t, "POST", "/pico/p", []byte("x"), hCT, "text/plain", hdrPicoProducerID, "w9", hdrPicoProducerEpoch, "0", hdrPicoProducerSeq, "4").
		wantError(t, 409, picoErrSeqGap, -1).header(t, hdrPicoExpectedSeq, "0").header(t, hdrPicoReceivedSeq, "4")
	// Producer headers come together.
	s.do(t, "POST", "/pico/p", []byte("x"), hdrPicoProducerID, "w1").wantError(t, 400, picoErrBadRequest, -1)
	s.do(t, "POST", "/pico/p", []byte("x"), hdrPicoProducerID, "w1", hdrPicoProducerEpoch, "x", hdrPicoProducerSeq, "0").
		wantError(t, 400, picoErrBadRequest, -1)
	// A batch is one producer step.
	batch := []byte(`{"records":[{"body":"d"},{"body":"e"}]}`)
	h := append(prod(2, 1), hCT, picowire.JSONBatch)
	s.do(t, "POST", "/pico/p", batch, h...).want(t, 200).header(t, hdrPicoStartSeq, "3").header(t, hdrPicoNextSeq, "5")
	s.do(t, "POST", "/pico/p", batch, h...).want(t, 200).header(t, hdrPicoStartSeq, "").header(t, hdrPicoNextSeq, "5")
	var got []string
	for _, rec := range s.readAll(t, "/p") {
		got = append(got, string(rec.bytes()))
	}
	if strings.Join(got, "") != "abcde" {
		t.Errorf("records %q", got)
	}
	// Once the stream is closed, a stale epoch is told so, not fenced.
	s.do(t, "POST", "/pico/p", nil, hdrPicoClosed, "true").want(t, 200)
	s.do(t, "POST", "/pico/p", []byte("x"), prod(1, 3)...).wantError(t, 409, picoErrClosed, 5).header(t, hdrPicoClosed, "true")
}

func TestPicoMatchSeq(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/m", []byte("a"), hCT, "text/plain").want(t, 201)
	s.do(t, "POST", "/pico/m", []byte("b"), hdrPicoMatchSeq, "0").wantError(t, 412, picoErrMatchFailed, 1).header(t, hdrPicoNextSeq, "1")
	s.do(t, "POST", "/pico/m", []byte("b"), hdrPicoMatchSeq, "1").want(t, 200).header(t, hdrPicoNextSeq, "2")
	s.do(t, "POST", "/pico/m", []byte("c"), hdrPicoMatchSeq, "1").wantError(t, 412, picoErrMatchFailed, 2)
	s.do(t, "POST", "/pico/m", []byte("c"), hdrPicoMatchSeq, "one").wantError(t, 400, picoErrBadRequest, -1)
	s.do(t, "HEAD", "/pico/m", nil).header(t, hdrPicoNextSeq, "2")
}

func TestPicoClose(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/c", []byte("a"), hCT, "text/plain").want(t, 201)
	// Append and close in one request.
	s.do(t, "PUT", "/pico/c2", nil, hCT, "text/plain").want(t, 201)
	s.do(t, "POST", "/pico/c2", []byte("last"), hdrPicoClosed, "true").want(t, 200).
		header(t, hdrPicoClosed, "true").header(t, hdrPicoStartSeq, "0").header(t, hdrPicoNextSeq, "1")
	// Close only.
	s.do(t, "POST", "/pico/c", nil, hdrPicoClosed, "true").want(t, 200).header(t, hdrPicoClosed, "true").
		header(t, hdrPicoNextSeq, "1").header(t, hdrPicoStartSeq, "")
	s.do(t, "POST", "/pico/c", nil, hdrPicoClosed, "true").want(t, 200).header(t, hdrPicoClosed, "true")
	s.do(t, "POST", "/pico/c", []byte("b")).wantError(t, 409, picoErrClosed, 1).
		header(t, hdrPicoClosed, "true").header(t, hdrPicoNextSeq, "1")
	s.do(t, "POST", "/pico/c", []byte(`{"records":[{"body":"x"}]}`), hCT, picowire.JSONBatch).wantError(t, 409, picoErrClosed, 1)
	s.do(t, "HEAD", "/pico/c", nil).want(t, 200).header(t, hdrPicoClosed, "true")
	// A read to the end says so; one that stops before does not.
	s.do(t, "GET", "/pico/c", nil).want(t, 200).header(t, hdrPicoClosed, "true").header(t, hdrPicoUpToDate, "true")
	s.do(t, "POST", "/pico/c2", nil, hdrPicoClosed, "true").want(t, 200)
	s.do(t, "POST", "/pico/c3", nil, hdrPicoClosed, "true").wantError(t, 404, picoErrNotFound, -1)
	// Through Durable Streams: the one closure.
	s.do(t, "HEAD", "/ds/c", nil).want(t, 200).header(t, hdrStreamClosed, "true")
}

func TestPicoTrim(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/t", nil, hCT, "text/plain").want(t, 201)
	for i := range 5 {
		s.do(t, "POST", "/pico/t", []byte{'a' + byte(i)}).want(t, 200)
	}
	s.do(t, "POST", "/pico/t", nil, hdrPicoTrimSeq, "2").want(t, 200).
		header(t, hdrPicoStartSeq, "2").header(t, hdrPicoNextSeq, "5").header(t, "Cache-Control", "no-store")
	s.do(t, "HEAD", "/pico/t", nil).header(t, hdrPicoStartSeq, "2")
	// Trimming less than before changes nothing.
	s.do(t, "POST", "/pico/t", nil, hdrPicoTrimSeq, "1").want(t, 200).header(t, hdrPicoStartSeq, "2")
	// A read from the beginning starts at the first retained record; an
	// explicit seq below it is gone.
	for _, q := range []string{"", "?seq=0"} {
		recs := s.do(t, "GET", "/pico/t"+q, nil).want(t, 200).records(t)
		if len(recs) != 3 || recs[0].Seq != 2 || string(recs[0].bytes()) != "c" {
			t.Errorf("read%s after trim: %+v", q, recs)
		}
	}
	s.do(t, "GET", "/pico/t?seq=1", nil).wantError(t, 410, picoErrGone, -1)
	s.do(t, "GET", "/pico/t?seq=1&live=sse", nil).wantError(t, 410, picoErrGone, -1)
	s.do(t, "GET", "/pico/t?seq=2", nil).want(t, 200)
	// Refused trims.
	s.do(t, "POST", "/pico/t", nil, hdrPicoTrimSeq, "9").wantError(t, 400, picoErrBadRequest, -1)
	s.do(t, "POST", "/pico/t", []byte("x"), hdrPicoTrimSeq, "3").wantError(t, 400, picoErrBadRequest, -1)
	s.do(t, "POST", "/pico/t", nil, hdrPicoTrimSeq, "x").wantError(t, 400, picoErrBadRequest, -1)
	s.do(t, "POST", "/pico/none", nil, hdrPicoTrimSeq, "0").wantError(t, 404, picoErrNotFound, -1)
	// A trim with headers only an append honours: refused whole, saying
	// which, rather than trimmed with them ignored.
	for _, tc := range []struct {
		name string
		hdr  []string
	}{
		{"close", []string{hdrPicoClosed, "true"}},
		{"match", []string{hdrPicoMatchSeq, "5"}},
		{"producer", []string{hdrPicoProducerID, "w", hdrPicoProducerEpoch, "0", hdrPicoProducerSeq, "0"}},
		{"partial producer", []string{hdrPicoProducerEpoch, "0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := s.do(t, "POST", "/pico/t", nil, append([]string{hdrPicoTrimSeq, "4"}, tc.hdr...)...).
				wantError(t, 400, picoErrBadRequest, -1)
			if !strings.Contains(string(r.body), tc.hdr[0]) {
				t.Errorf("body %s does not name %s", r.body, tc.hdr[0])
			}
		})
	}
	// Pico-Closed other than true is no close, here as everywhere.
	s.do(t, "POST", "/pico/t", nil, hdrPicoTrimSeq, "2", hdrPicoClosed, "false").want(t, 200)
	s.do(t, "HEAD", "/pico/t", nil).want(t, 200).header(t, hdrPicoStartSeq, "2").header(t, hdrPicoClosed, "")
	// Trim everything: the stream is empty but keeps its seqs.
	s.do(t, "POST", "/pico/t", nil, hdrPicoTrimSeq, "5").want(t, 200).header(t, hdrPicoStartSeq, "5")
	r := s.do(t, "GET", "/pico/t", nil).want(t, 200).header(t, hdrPicoNextSeq, "5").header(t, hdrPicoUpToDate, "true")
	if string(r.body) != "[]" {
		t.Errorf("body %q", r.body)
	}
	s.do(t, "POST", "/pico/t", []byte("f")).want(t, 200).header(t, hdrPicoStartSeq, "5")
}

func TestPicoReads(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/r", nil, hCT, "text/plain").want(t, 201)
	for i := range 10 {
		s.do(t, "POST", "/pico/r", []byte(strings.Repeat(strconv.Itoa(i), 10))).want(t, 200)
	}
	// count and bytes cap a read; Pico-Next-Seq continues it.
	r := s.do(t, "GET", "/pico/r?seq=2&count=3", nil).want(t, 200).header(t, hdrPicoNextSeq, "5").header(t, hdrPicoUpToDate, "")
	if recs := r.records(t); len(recs) != 3 || recs[0].Seq != 2 {
		t.Errorf("count=3: %+v", recs)
	}
	r = s.do(t, "GET", "/pico/r?seq=5&bytes=25", nil).want(t, 200).header(t, hdrPicoNextSeq, "7")
	// Two 10-byte records fit under 25 bytes; a third would not.
	if recs := r.records(t); len(recs) != 2 || recs[0].Seq != 5 || string(recs[1].bytes()) != "6666666666" {
		t.Errorf("bytes=25: %+v", recs)
	}
	// At least one record, whatever the byte cap.
	s.do(t, "GET", "/pico/r?seq=9&bytes=1", nil).want(t, 200).header(t, hdrPicoNextSeq, "10").header(t, hdrPicoUpToDate, "true")

	// Catch-up caching, ETag and 304.
	r = s.do(t, "GET", "/pico/r?seq=0", nil).want(t, 200).header(t, hdrPicoUpToDate, "true").
		header(t, "Cache-Control", cacheControlCatchUp).header(t, hCT, "application/json")
	tag := r.h.Get("ETag")
	if tag == "" {
		t.Fatal("no ETag")
	}
	r = s.do(t, "GET", "/pico/r?seq=0", nil, "If-None-Match", tag).want(t, 304)
	if len(r.body) != 0 {
		t.Errorf("304 body %q", r.body)
	}
	binTag := s.do(t, "GET", "/pico/r?seq=0&format=binary", nil).want(t, 200).h.Get("ETag")
	if binTag == tag {
		t.Error("the JSON and binary pages share an ETag")
	}
	// At the tail: empty, up to date, an ETag, but not cacheable.
	r = s.do(t, "GET", "/pico/r?seq=10", nil).want(t, 200).header(t, hdrPicoUpToDate, "true").
		header(t, "Cache-Control", "no-store").header(t, hdrPicoNextSeq, "10")
	tail := r.h.Get("ETag")
	s.do(t, "GET", "/pico/r?seq=10", nil, "If-None-Match", tail).want(t, 304)
	s.do(t, "POST", "/pico/r", []byte("x")).want(t, 200)
	s.do(t, "GET", "/pico/r?seq=10", nil, "If-None-Match", tail).want(t, 200).header(t, hdrPicoNextSeq, "11")
	s.do(t, "GET", "/pico/r?seq=0", nil, "If-None-Match", tag).want(t, 200)

	// seq=now: the tail, no records.
	r = s.do(t, "GET", "/pico/r?seq=now", nil).want(t, 200).header(t, hdrPicoNextSeq, "11").
		header(t, hdrPicoUpToDate, "true").header(t, "Cache-Control", "no-store")
	if string(r.body) != "[]" {
		t.Errorf("seq=now body %q", r.body)
	}
	s.do(t, "GET", "/pico/missing?seq=now", nil).wantError(t, 404, picoErrNotFound, -1)
	s.do(t, "GET", "/pico/missing", nil).wantError(t, 404, picoErrNotFound, -1)

	// Refused reads.
	for _, q := range []string{"?seq=-1", "?seq=x", "?seq=12", "?format=xml", "?live=poll", "?count=x", "?bytes=-5", "?seq=%zz"} {
		s.do(t, "GET", "/pico/r"+q, nil).wantError(t, 400, picoErrBadRequest, -1)
	}
	s.do(t, "PATCH", "/pico/r", nil).wantError(t, 405, picoErrMethod, -1)
}

func TestPicoLongPoll(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/lp", []byte("a"), hCT, "text/plain").want(t, 201)
	// Data there: at once.
	r := s.do(t, "GET", "/pico/lp?seq=0&live=long-poll", nil).want(t, 200).header(t, hdrPicoNextSeq, "1").
		header(t, "Cache-Control", "no-store")
	if r.h.Get(hdrPicoCursor) == "" {
		t.Error("no Pico-Cursor")
	}
	// Idle: 204 after the timeout.
	start := time.Now()
	r = s.do(t, "GET", "/pico/lp?seq=1&live=long-poll", nil).want(t, 204).header(t, hdrPicoUpToDate, "true").
		header(t, hdrPicoNextSeq, "1").header(t, "Cache-Control", "no-store")
	if r.h.Get(hdrPicoCursor) == "" || time.Since(start) < 250*time.Millisecond {
		t.Errorf("idle long-poll: cursor %q after %v", r.h.Get(hdrPicoCursor), time.Since(start))
	}
	// A parked long-poll wakes on the next append.
	s.pico.longPollTimeout = 10 * time.Second
	done := make(chan picoResp, 1)
	go func() { done <- s.do(t, "GET", "/pico/lp?seq=1&live=long-poll&format=binary", nil) }()
	waitEngineWaits(t, 1)
	s.do(t, "POST", "/pico/lp", []byte("b")).want(t, 200)
	select {
	case r := <-done:
		r.want(t, 200).header(t, hdrPicoNextSeq, "2").header(t, hCT, picowire.BinaryBatch)
		recs, err := picowire.DecodeBinaryRead(r.body)
		if err != nil || len(recs) != 1 || string(recs[0].Body) != "b" || recs[0].Seq != 1 {
			t.Errorf("woken long-poll: %+v %v", recs, err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("parked long-poll did not wake on the append")
	}
	// Closed and fully read: 204 with Pico-Closed at once.
	s.do(t, "POST", "/pico/lp", nil, hdrPicoClosed, "true").want(t, 200)
	s.do(t, "GET", "/pico/lp?seq=2&live=long-poll", nil).want(t, 204).header(t, hdrPicoClosed, "true")
	// A shutdown ends a parked long-poll with 204.
	s.do(t, "PUT", "/pico/lp2", nil).want(t, 201)
	go func() { done <- s.do(t, "GET", "/pico/lp2?live=long-poll", nil) }()
	waitEngineWaits(t, 1)
	s.shutdown()
	select {
	case r := <-done:
		r.want(t, 204).header(t, hdrPicoUpToDate, "true")
	case <-time.After(2 * time.Second):
		t.Fatal("long-poll still open after shutdown")
	}
}

// TestLongPollFromTheStartAfterATrim: long-polls from the start (Durable
// Streams offset=-1, Pico without seq) wait on an empty stream; three
// records and a trim past the first two land in one WAL upload. Both
// answer 200 with the record the trim kept: they asked for what is
// retained. They answered 410, having read again at the position they
// waited at, which the trim had dropped.
func TestLongPollFromTheStartAfterATrim(t *testing.T) {
	// One upload per second at most: the records and the trim, sent just
	// after an upload started, wait for the next one together.
	s := newPicoServerConfig(t, streamstore.Config{NodeID: "test-node", FlushInterval: time.Second},
		func(p *picoProtocol) { p.longPollTimeout = 20 * time.Second })
	s.ds.longPollTimeout = 20 * time.Second
	s.do(t, "PUT", "/ds/s", nil, hCT, "application/json").want(t, 201)
	s.do(t, "PUT", "/ds/other", nil, hCT, "text/plain").want(t, 201)
	done := make(chan picoResp, 2)
	for _, u := range []string{"/ds/s?offset=-1&live=long-poll", "/pico/s?live=long-poll"} {
		go func() { done <- s.do(t, "GET", u, nil) }()
	}
	waitEngineWaits(t, 2)
	s.do(t, "POST", "/ds/other", []byte("x"), hCT, "text/plain").want(t, 204)
	appended := make(chan picoResp, 1)
	go func() { appended <- s.do(t, "POST", "/ds/s", []byte(`["a","b","c"]`), hCT, "application/json") }()
	// The trim is refused until the append is pending.
	for s.do(t, "POST", "/pico/s", nil, hdrPicoTrimSeq, "2").status == 400 {
		time.Sleep(time.Millisecond)
	}
	(<-appended).want(t, 204)
	for range 2 {
		r := <-done
		switch r.want(t, 200); {
		case r.h.Get(hdrPicoNextSeq) != "":
			if recs := r.records(t); len(recs) != 1 || recs[0].Seq != 2 || string(recs[0].bytes()) != `"c"` {
				t.Errorf("Pico long-poll from the start: %+v, want the record the trim kept (seq 2)", recs)
			}
		default:
			if string(r.body) != `["c"]` {
				t.Errorf("Durable Streams long-poll from -1: %q, want %q", r.body, `["c"]`)
			}
		}
	}
}

// TestLongPollWokenOnAStreamCreatedAgain: a long-poll woken by an append
// whose stream is deleted and created again, with more records, before it
// reads them answers 404, as one woken by the delete does. It read the new
// stream from the position it waited at in the old one: 200 with records
// that are no continuation of what the client had.
func TestLongPollWokenOnAStreamCreatedAgain(t *testing.T) {
	s := newPicoServer(t, func(p *picoProtocol) { p.longPollTimeout = 20 * time.Second })
	s.ds.longPollTimeout = 20 * time.Second
	ctx := context.Background()
	recreate := func() {
		if err := s.eng.Delete(ctx, "/s"); err != nil {
			t.Errorf("delete in the hook: %v", err)
		}
		req := streamstore.CreateRequest{ContentType: "text/plain", Records: []streamstore.NewRecord{{Body: []byte("x")}, {Body: []byte("y")}, {Body: []byte("z")}}}
		if _, _, err := s.eng.Create(ctx, "/s", req); err != nil {
			t.Errorf("create in the hook: %v", err)
		}
	}
	s.ds.woken, s.pico.woken = recreate, recreate
	for _, u := range []string{"/ds/s?offset=" + position{seq: 1}.String() + "&live=long-poll", "/pico/s?seq=1&live=long-poll"} {
		t.Run(u, func(t *testing.T) {
			s.do(t, "DELETE", "/ds/s", nil)
			s.do(t, "PUT", "/ds/s", []byte("a"), hCT, "text/plain").want(t, 201)
			done := make(chan picoResp, 1)
			go func() { done <- s.do(t, "GET", u, nil) }()
			waitEngineWaits(t, 1)
			s.do(t, "POST", "/ds/s", []byte("b"), hCT, "text/plain").want(t, 204)
			if r := <-done; r.status != 404 {
				t.Errorf("long-poll woken on a stream created again: %d %q, want 404", r.status, r.body)
			}
		})
	}
}

// picoEvent is one SSE event.
type picoEvent struct{ typ, id, data string }

// picoSSE reads events from a live SSE response.
type picoSSE struct {
	res    *http.Response
	events chan picoEvent
	done   chan struct{} // closed when the server ends the response
}

func (s *picoServer) sse(t *testing.T, path string, hdr ...string) *picoSSE {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "GET", s.URL+path, nil)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	r := &picoSSE{res: res, events: make(chan picoEvent, 100), done: make(chan struct{})}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(r.done)
		sc := bufio.NewScanner(res.Body)
		sc.Buffer(nil, 4<<20)
		var ev picoEvent
		for sc.Scan() {
			line := sc.Text()
			switch {
			case line == "":
				r.events <- ev
				ev = picoEvent{}
			case strings.HasPrefix(line, "event: "):
				ev.typ = line[len("event: "):]
			case strings.HasPrefix(line, "id: "):
				ev.id = line[len("id: "):]
			case strings.HasPrefix(line, "data:"):
				ev.data += line[len("data:"):]
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

func (r *picoSSE) next(t *testing.T) picoEvent {
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
	return picoEvent{}
}

// data reads a data event and returns its records.
func (r *picoSSE) data(t *testing.T, id string) []jsonRecord {
	t.Helper()
	ev := r.next(t)
	if ev.typ != "data" || ev.id != id {
		t.Fatalf("got %+v, want a data event with id %s", ev, id)
	}
	var recs []jsonRecord
	if err := json.Unmarshal([]byte(ev.data), &recs); err != nil {
		t.Fatalf("data event %q: %v", ev.data, err)
	}
	return recs
}

// control reads a control event and checks it.
func (r *picoSSE) control(t *testing.T, next uint64, upToDate, closed bool) {
	t.Helper()
	ev := r.next(t)
	if ev.typ != "control" || ev.id != strconv.FormatUint(next, 10) {
		t.Fatalf("got %+v, want a control event with id %d", ev, next)
	}
	var raw map[string]any
	if err := json.Unmarshal([]byte(ev.data), &raw); err != nil {
		t.Fatalf("control %q: %v", ev.data, err)
	}
	want := map[string]any{"next_seq": float64(next), "up_to_date": upToDate}
	if closed {
		want["closed"] = true
	}
	if fmt.Sprint(raw) != fmt.Sprint(want) {
		t.Errorf("control %s, want %v", ev.data, want)
	}
}

func (r *picoSSE) ends(t *testing.T, within time.Duration) {
	t.Helper()
	select {
	case <-r.done:
	case <-time.After(within):
		t.Fatalf("SSE response still open after %v", within)
	}
}

func TestPicoSSE(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/e", nil, hCT, "application/octet-stream").want(t, 201)
	bin := picowire.EncodeBinary([]picowire.Record{
		{Headers: []segment.Header{{Name: "k", Value: "v"}}, Body: []byte{0xff, '\n', 0}},
		{Body: []byte("line1\nline2\r\n")},
	})
	s.do(t, "POST", "/pico/e", bin, hCT, picowire.BinaryBatch).want(t, 200)

	// Catch-up, then live.
	r := s.sse(t, "/pico/e?seq=0&live=sse")
	if r.res.StatusCode != 200 || r.res.Header.Get(hCT) != "text/event-stream" || r.res.Header.Get("Cache-Control") != "no-store" {
		t.Fatalf("SSE response %d %v", r.res.StatusCode, r.res.Header)
	}
	recs := r.data(t, "2")
	if len(recs) != 2 || !bytes.Equal(recs[0].bytes(), []byte{0xff, '\n', 0}) || recs[0].Headers["k"] != "v" ||
		string(recs[1].bytes()) != "line1\nline2\r\n" || recs[1].Seq != 1 {
		t.Errorf("catch-up records %+v", recs)
	}
	r.control(t, 2, true, false)
	s.do(t, "POST", "/pico/e", []byte("live")).want(t, 200)
	recs = r.data(t, "3")
	if len(recs) != 1 || string(recs[0].bytes()) != "live" || recs[0].Seq != 2 {
		t.Errorf("live records %+v", recs)
	}
	r.control(t, 3, true, false)

	// A reconnect with Last-Event-ID and no seq resumes there.
	s.do(t, "POST", "/pico/e", []byte("more"), hCT, "application/octet-stream").want(t, 200)
	r2 := s.sse(t, "/pico/e?live=sse", "Last-Event-ID", "3")
	recs = r2.data(t, "4")
	if len(recs) != 1 || string(recs[0].bytes()) != "more" || recs[0].Seq != 3 {
		t.Errorf("resumed records %+v", recs)
	}
	r2.control(t, 4, true, false)
	if recs = r.data(t, "4"); len(recs) != 1 || recs[0].Seq != 3 {
		t.Errorf("live records %+v", recs)
	}
	r.control(t, 4, true, false)
	// A seq wins over Last-Event-ID.
	r3 := s.sse(t, "/pico/e?live=sse&seq=1", "Last-Event-ID", "3")
	if recs = r3.data(t, "4"); len(recs) != 3 || recs[0].Seq != 1 {
		t.Errorf("seq beats Last-Event-ID: %+v", recs)
	}
	r3.control(t, 4, true, false)

	// At the tail: one control event; seq=now starts there.
	r4 := s.sse(t, "/pico/e?live=sse&seq=now")
	r4.control(t, 4, true, false)

	// Closing ends every feed with a closed control event.
	s.do(t, "POST", "/pico/e", []byte("end"), hdrPicoClosed, "true").want(t, 200)
	for _, rd := range []*picoSSE{r, r2, r3} {
		recs = rd.data(t, "5")
		if len(recs) != 1 || string(recs[0].bytes()) != "end" {
			t.Errorf("final records %+v", recs)
		}
		rd.control(t, 5, true, true)
		rd.ends(t, time.Second)
	}
	r4.data(t, "5")
	r4.control(t, 5, true, true)
	r4.ends(t, time.Second)
	r5 := s.sse(t, "/pico/e?live=sse&seq=5")
	r5.control(t, 5, true, true)
	r5.ends(t, time.Second)

	s.do(t, "GET", "/pico/missing?live=sse", nil).wantError(t, 404, picoErrNotFound, -1)
	s.do(t, "GET", "/pico/e?live=sse", nil, "Last-Event-ID", "x").wantError(t, 400, picoErrBadRequest, -1)
}

// TestPicoCloseWithoutRecordsEndsParkedFeeds: a close that appends nothing
// moves no tail, yet every SSE feed parked in the stream's hub must hear of
// it: a control event at the same id with "closed", then the end of the
// response, or its client would wait for records that never come.
func TestPicoCloseWithoutRecordsEndsParkedFeeds(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/c", []byte("a"), hCT, "text/plain").want(t, 201)
	tail := s.sse(t, "/pico/c?live=sse&seq=1")
	tail.control(t, 1, true, false)
	single := s.sse(t, "/pico/c?live=sse&count=1") // another hub: other read limits
	single.data(t, "1")
	single.control(t, 1, true, false)
	waitParked(t, s.pico.hubs, 2, 2)

	s.do(t, "POST", "/pico/c", nil, hdrPicoClosed, "true").want(t, 200).header(t, hdrPicoNextSeq, "1")
	for _, r := range []*picoSSE{tail, single} {
		r.control(t, 1, true, true)
		r.ends(t, 2*time.Second)
	}
	waitParked(t, s.pico.hubs, 0, 0)
	s.do(t, "GET", "/pico/c?seq=1&live=long-poll", nil).want(t, 204).header(t, hdrPicoClosed, "true")
}

func TestPicoSSERecyclesAndEndsAtShutdown(t *testing.T) {
	s := newPicoServer(t, func(p *picoProtocol) { p.sseInterval = 300 * time.Millisecond })
	s.do(t, "PUT", "/pico/e", []byte("a")).want(t, 201)
	r := s.sse(t, "/pico/e?live=sse")
	r.data(t, "1")
	r.control(t, 1, true, false)
	start := time.Now()
	r.ends(t, 3*time.Second)
	if d := time.Since(start); d < 200*time.Millisecond {
		t.Errorf("recycled after %v", d)
	}

	s.pico.sseInterval = time.Minute
	r = s.sse(t, "/pico/e?live=sse&seq=1")
	r.control(t, 1, true, false)
	s.shutdown()
	r.control(t, 1, true, false) // where to resume
	r.ends(t, 2*time.Second)
}

func TestPicoDelete(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/d", []byte("a")).want(t, 201)
	s.do(t, "DELETE", "/pico/d", nil).want(t, 204)
	s.do(t, "DELETE", "/pico/d", nil).wantError(t, 404, picoErrNotFound, -1)
	s.do(t, "HEAD", "/pico/d", nil).want(t, 404)
	s.do(t, "GET", "/pico/d", nil).wantError(t, 404, picoErrNotFound, -1)
	// The name is reusable at once, and starts empty.
	s.do(t, "PUT", "/pico/d", nil).want(t, 201).header(t, hdrPicoNextSeq, "0")

	// A stream with a fork is soft-deleted: 410 through both protocols
	// until the fork goes.
	s.do(t, "PUT", "/pico/src", []byte("shared"), hCT, "text/plain").want(t, 201)
	s.do(t, "PUT", "/ds/fork", nil, hCT, "text/plain", hdrForkedFrom, "/ds/src").want(t, 201)
	s.do(t, "DELETE", "/pico/src", nil).want(t, 204)
	s.do(t, "GET", "/pico/src", nil).wantError(t, 410, picoErrGone, -1)
	s.do(t, "HEAD", "/pico/src", nil).want(t, 410)
	s.do(t, "POST", "/pico/src", []byte("x")).wantError(t, 410, picoErrGone, -1)
	s.do(t, "DELETE", "/pico/src", nil).wantError(t, 410, picoErrGone, -1)
	s.do(t, "GET", "/ds/src", nil).want(t, 410)
	s.do(t, "PUT", "/pico/src", nil, hCT, "text/plain").wantError(t, 409, picoErrConflict, -1)
	// Nor does a listing show it.
	if p := s.list(t, ""); len(p.Streams) != 2 || p.Streams[0].Name != "/d" || p.Streams[1].Name != "/fork" {
		t.Errorf("listing with a soft-deleted stream: %+v", p)
	}
	// The fork still reads its inherited record, through Pico too.
	if recs := s.readAll(t, "/fork"); len(recs) != 1 || string(recs[0].bytes()) != "shared" {
		t.Errorf("fork records %+v", recs)
	}
	s.do(t, "DELETE", "/pico/fork", nil).want(t, 204)
	s.do(t, "GET", "/pico/src", nil).wantError(t, 404, picoErrNotFound, -1)
}

// listPage is a decoded listing.
type listPage struct {
	Streams []struct {
		Name        string  `json:"name"`
		ContentType string  `json:"content_type"`
		StartSeq    uint64  `json:"start_seq"`
		NextSeq     uint64  `json:"next_seq"`
		Closed      bool    `json:"closed"`
		TTL         *int64  `json:"ttl"`
		ExpiresAt   *string `json:"expires_at"`
	} `json:"streams"`
	HasMore bool `json:"has_more"`
}

func (s *picoServer) list(t *testing.T, query string) listPage {
	t.Helper()
	r := s.do(t, "GET", "/pico/"+query, nil).want(t, 200).header(t, hCT, "application/json").header(t, "Cache-Control", "no-store")
	var p listPage
	if err := json.Unmarshal(r.body, &p); err != nil {
		t.Fatalf("listing %q: %v", r.body, err)
	}
	if p.Streams == nil {
		t.Fatalf("listing without a streams array: %q", r.body)
	}
	return p
}

func TestPicoList(t *testing.T) {
	s := newPicoServer(t)
	names := []string{"/logs/a", "/logs/b", "/logs/b/c", "/logs/c", "/logs0", "/other"}
	for _, n := range names {
		s.do(t, "PUT", "/pico"+n, nil, hCT, "text/plain").want(t, 201)
	}
	s.do(t, "POST", "/pico/logs/b", []byte("x")).want(t, 200)
	s.do(t, "POST", "/pico/logs/b", nil, hdrPicoClosed, "true").want(t, 200)
	s.do(t, "PUT", "/pico/logs/ttl", nil, hdrPicoTTL, "60").want(t, 201)
	s.do(t, "PUT", "/pico/logs/exp", nil, hdrPicoExpiresAt, "2099-01-01T00:00:00Z").want(t, 201)

	all := s.list(t, "")
	if len(all.Streams) != 8 || all.HasMore {
		t.Fatalf("list all: %+v", all)
	}
	var got []string
	after := ""
	for pages := 0; ; pages++ {
		p := s.list(t, "?prefix=/logs/&limit=2&start_after="+after)
		for _, st := range p.Streams {
			got = append(got, st.Name)
		}
		if !p.HasMore {
			break
		}
		if pages > 10 || len(p.Streams) == 0 {
			t.Fatalf("paging does not end: %+v", p)
		}
		after = p.Streams[len(p.Streams)-1].Name
	}
	if want := "/logs/a /logs/b /logs/b/c /logs/c /logs/exp /logs/ttl"; strings.Join(got, " ") != want {
		t.Errorf("paged listing %q, want %q", strings.Join(got, " "), want)
	}
	p := s.list(t, "?prefix=/logs/b&limit=1")
	if len(p.Streams) != 1 || !p.HasMore {
		t.Fatalf("prefix /logs/b: %+v", p)
	}
	b := p.Streams[0]
	if b.Name != "/logs/b" || b.ContentType != "text/plain" || b.NextSeq != 1 || b.StartSeq != 0 || !b.Closed || b.TTL != nil || b.ExpiresAt != nil {
		t.Errorf("entry %+v", b)
	}
	p = s.list(t, "?prefix=/logs/t")
	if len(p.Streams) != 1 || p.Streams[0].TTL == nil || *p.Streams[0].TTL != 60 {
		t.Errorf("ttl entry %+v", p)
	}
	p = s.list(t, "?prefix=/logs/e")
	if len(p.Streams) != 1 || p.Streams[0].ExpiresAt == nil || *p.Streams[0].ExpiresAt != "2099-01-01T00:00:00Z" {
		t.Errorf("expires entry %+v", p)
	}
	if p = s.list(t, "?prefix=/nothing"); len(p.Streams) != 0 || p.HasMore {
		t.Errorf("empty listing %+v", p)
	}
	s.do(t, "GET", "/pico/?limit=x", nil).wantError(t, 400, picoErrBadRequest, -1)
	s.do(t, "POST", "/pico/", []byte("x")).wantError(t, 400, picoErrBadRequest, -1)

	// Streams a listing leaves out (expired, soft-deleted) do not make a
	// page empty while more follow: a client has no name to go on from.
	soon := streamstore.Expiry{ExpiresAt: time.Now().Add(50 * time.Millisecond)}
	for _, n := range []string{"/hid/a", "/hid/b"} {
		if _, _, err := s.eng.Create(context.Background(), n, streamstore.CreateRequest{ContentType: "text/plain", Expiry: soon}); err != nil {
			t.Fatal(err)
		}
	}
	s.do(t, "PUT", "/pico/hid/c", nil, hCT, "text/plain").want(t, 201)
	s.do(t, "PUT", "/ds/fork-of-c", nil, "Stream-Forked-From", "/ds/hid/c").want(t, 201)
	s.do(t, "DELETE", "/pico/hid/c", nil).want(t, 204) // soft: its fork reads it
	s.do(t, "PUT", "/pico/hid/d", nil, hCT, "text/plain").want(t, 201)
	time.Sleep(100 * time.Millisecond)
	for _, limit := range []string{"1", "2"} {
		p = s.list(t, "?prefix=/hid/&limit="+limit)
		if len(p.Streams) != 1 || p.Streams[0].Name != "/hid/d" || p.HasMore {
			t.Errorf("limit %s past hidden streams: %+v", limit, p)
		}
	}
}

func TestPicoCrossProtocol(t *testing.T) {
	s := newPicoServer(t)
	// Pico writes, Durable Streams reads: seq n is offset (n, 0).
	s.do(t, "PUT", "/pico/x", nil, hCT, "text/plain").want(t, 201)
	s.do(t, "POST", "/pico/x", []byte(`{"records":[{"body":"ab"},{"body":"cd","headers":{"h":"1"}}]}`), hCT, picowire.JSONBatch).want(t, 200)
	s.do(t, "POST", "/pico/x", []byte("ef")).want(t, 200).header(t, hdrPicoNextSeq, "3")
	r := s.do(t, "GET", "/ds/x?offset=-1", nil).want(t, 200).header(t, hdrStreamNextOffset, position{3, 0}.String())
	if string(r.body) != "abcdef" {
		t.Errorf("DS read %q", r.body)
	}
	r = s.do(t, "GET", "/ds/x?offset="+position{1, 0}.String(), nil).want(t, 200)
	if string(r.body) != "cdef" {
		t.Errorf("DS read from seq 1: %q", r.body)
	}
	// Durable Streams writes, Pico reads: the next offset's seq is Pico's.
	r = s.do(t, "POST", "/ds/x", []byte("gh"), hCT, "text/plain").want(t, 204)
	if r.h.Get(hdrStreamNextOffset) != (position{4, 0}).String() {
		t.Errorf("DS append next offset %q", r.h.Get(hdrStreamNextOffset))
	}
	recs := s.do(t, "GET", "/pico/x?seq=3", nil).want(t, 200).header(t, hdrPicoNextSeq, "4").records(t)
	if len(recs) != 1 || recs[0].Seq != 3 || string(recs[0].bytes()) != "gh" || recs[0].Headers != nil || recs[0].Timestamp == 0 {
		t.Errorf("Pico read of a DS append: %+v", recs)
	}
	// One closure, one TTL.
	s.do(t, "PUT", "/ds/y", nil, hCT, "application/json", hdrStreamTTL, "120").want(t, 201)
	// Records of a JSON stream are JSON values, through either protocol.
	s.do(t, "POST", "/pico/y", []byte("not json")).wantError(t, 400, picoErrBadRequest, -1)
	s.do(t, "POST", "/pico/y", []byte("{"), hCT, "application/json").wantError(t, 400, picoErrBadRequest, -1)
	s.do(t, "POST", "/pico/y", []byte(`{"records":[{"body":"1"},{"body":"x"}]}`), hCT, picowire.JSONBatch).wantError(t, 400, picoErrBadRequest, -1)
	s.do(t, "PUT", "/pico/z", []byte("nope"), hCT, "application/json").wantError(t, 400, picoErrBadRequest, -1)
	s.do(t, "HEAD", "/pico/z", nil).want(t, 404)
	// JSON is UTF-8 (RFC 8259 section 8.1).
	notUTF8 := []byte("{\"a\":\"\xff\xfe\"}")
	s.do(t, "POST", "/pico/y", notUTF8, hCT, "application/json").wantError(t, 400, picoErrBadRequest, -1)
	s.do(t, "POST", "/pico/y", []byte(`{"records":[{"body_b64":"eyJhIjoi//4ifQ=="}]}`), hCT, picowire.JSONBatch).
		wantError(t, 400, picoErrBadRequest, -1)
	s.do(t, "PUT", "/pico/z", notUTF8, hCT, "application/json").wantError(t, 400, picoErrBadRequest, -1)
	s.do(t, "HEAD", "/pico/z", nil).want(t, 404)
	s.do(t, "POST", "/ds/y", []byte(`[1,{"a":2}]`), hCT, "application/json").want(t, 204)
	s.do(t, "HEAD", "/pico/y", nil).want(t, 200).header(t, hdrPicoTTL, "120").header(t, hdrPicoNextSeq, "2")
	recs = s.readAll(t, "/y")
	if len(recs) != 2 || string(recs[0].bytes()) != "1" || string(recs[1].bytes()) != `{"a":2}` {
		t.Errorf("JSON messages as records: %+v", recs)
	}
	// One producer state: a producer's DS append is a Pico duplicate, and
	// its Pico seqs continue the DS ones.
	s.do(t, "POST", "/ds/y", []byte(`"p0"`), hCT, "application/json",
		hdrProducerID, "p", hdrProducerEpoch, "0", hdrProducerSeq, "0").want(t, 200)
	s.do(t, "POST", "/pico/y", []byte(`"p0"`), hdrPicoProducerID, "p", hdrPicoProducerEpoch, "0", hdrPicoProducerSeq, "0").
		want(t, 200).header(t, hdrPicoStartSeq, "").header(t, hdrPicoNextSeq, "3")
	s.do(t, "POST", "/pico/y", []byte(`"p2"`), hdrPicoProducerID, "p", hdrPicoProducerEpoch, "0", hdrPicoProducerSeq, "2").
		wantError(t, 409, picoErrSeqGap, -1).header(t, hdrPicoExpectedSeq, "1")
	s.do(t, "POST", "/pico/y", []byte(`"p1"`), hdrPicoProducerID, "p", hdrPicoProducerEpoch, "0", hdrPicoProducerSeq, "1").
		want(t, 200).header(t, hdrPicoStartSeq, "3")
	s.do(t, "POST", "/ds/y", []byte(`"x"`), hCT, "application/json",
		hdrProducerID, "p", hdrProducerEpoch, "0", hdrProducerSeq, "1").want(t, 204)
	s.do(t, "POST", "/ds/y", nil, hdrStreamClosed, "true").want(t, 204)
	s.do(t, "POST", "/pico/y", []byte("3")).wantError(t, 409, picoErrClosed, 4)
	s.do(t, "PUT", "/pico/y", nil, hCT, "application/json", hdrPicoTTL, "120", hdrPicoClosed, "true").want(t, 200)
}

func TestPicoStorageUnavailable(t *testing.T) {
	s := newPicoServer(t, func(p *picoProtocol) {
		p.engine = func(context.Context) (*streamstore.Engine, error) {
			return nil, fmt.Errorf("%w: the bucket is down", streamstore.ErrUnavailable)
		}
	})
	for _, m := range []string{"GET", "PUT", "POST", "DELETE"} {
		r := s.do(t, m, "/pico/s", []byte("x")).wantError(t, 503, picoErrDurability, -1)
		if r.h.Get("Retry-After") == "" {
			t.Errorf("%s: no Retry-After", m)
		}
	}
	s.do(t, "GET", "/pico/", nil).wantError(t, 503, picoErrDurability, -1)
	s = newPicoServer(t, func(p *picoProtocol) {
		p.engine = func(context.Context) (*streamstore.Engine, error) {
			return nil, &storageStartError{err: errors.New("lease held by node x")}
		}
	})
	r := s.do(t, "GET", "/pico/s", nil).want(t, 503)
	if !strings.Contains(string(r.body), "lease held by node x") {
		t.Errorf("body %q", r.body)
	}
}

func TestPicoCORS(t *testing.T) {
	s := newPicoServer(t)
	r := s.do(t, "PUT", "/pico/c", nil).want(t, 201)
	exposed := r.h.Get("Access-Control-Expose-Headers")
	for _, h := range []string{"Pico-Next-Seq", "Pico-Start-Seq", "Pico-Timestamp", "Pico-Up-To-Date", "Pico-Closed",
		"Pico-Cursor", "Pico-Expected-Seq", "Pico-Received-Seq", "Pico-Producer-Epoch", "ETag", "Content-Type"} {
		if !strings.Contains(exposed, h) {
			t.Errorf("%s is not exposed: %q", h, exposed)
		}
	}
	if r.h.Get("Access-Control-Allow-Origin") != "*" {
		t.Errorf("headers %v", r.h)
	}
	s.do(t, "OPTIONS", "/pico/c", nil, "Access-Control-Request-Headers", "pico-match-seq").want(t, 204).
		header(t, "Access-Control-Allow-Headers", "pico-match-seq")

	// A preflight that names no headers gets each protocol's own: the
	// request headers of the Pico reference, and the Pico-* response
	// headers exposed.
	for _, c := range []struct {
		path           string
		allowed, shown []string
	}{
		{"/pico/c", []string{"Content-Type", "If-None-Match", "Last-Event-ID", "Pico-TTL", "Pico-Expires-At", "Pico-Closed",
			"Pico-Match-Seq", "Pico-Trim-Seq", "Pico-Producer-Id", "Pico-Producer-Epoch", "Pico-Producer-Seq"},
			[]string{"Pico-Next-Seq", "Pico-Start-Seq", "Pico-Cursor", "Pico-TTL", "ETag", "Content-Type"}},
		{"/ds/c", []string{"Content-Type", "Stream-TTL", "Producer-Id"}, []string{"Stream-Next-Offset", "ETag"}},
	} {
		r := s.do(t, "OPTIONS", c.path, nil).want(t, 204)
		allowed := strings.Split(r.h.Get("Access-Control-Allow-Headers"), ", ")
		shown := strings.Split(r.h.Get("Access-Control-Expose-Headers"), ", ")
		for _, h := range c.allowed {
			if !slices.Contains(allowed, h) {
				t.Errorf("OPTIONS %s: %s is not allowed: %q", c.path, h, allowed)
			}
		}
		for _, h := range c.shown {
			if !slices.Contains(shown, h) {
				t.Errorf("OPTIONS %s: %s is not exposed: %q", c.path, h, shown)
			}
		}
	}
}

func TestPicoConfigValidates(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	dir := t.TempDir()
	js := adapt(t, `{
		admin off
	}
	:0 {
		handle_path /ds/* {
			picomq {
				storage file://`+dir+`
			}
		}
		handle_path /pico/* {
			picomq {
				protocol pico
				storage file://`+dir+`
			}
		}
	}`)
	if err := validate(t, js); err != nil {
		t.Fatalf("two protocols on one storage: %v", err)
	}
}

// Control events are written by hand; they must read as json.Marshal of
// picoControl would have made them.
func TestPicoControlEncoding(t *testing.T) {
	for _, c := range []picoControl{
		{}, {NextSeq: 7, UpToDate: true}, {NextSeq: 1<<64 - 1, UpToDate: true, Closed: true}, {NextSeq: 3, Closed: true},
	} {
		want, err := json.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		wantEvent := "event: control\nid: " + strconv.FormatUint(c.NextSeq, 10) + "\ndata:" + string(want) + "\n\n"
		if got := string(appendPicoControl(nil, c)); got != wantEvent {
			t.Errorf("%+v: %q, want %q", c, got, wantEvent)
		}
	}
}

// A storage failure is a 503 with Retry-After in either protocol; a write's
// reason says nothing of it was acknowledged, a read's does not talk of
// acknowledgements at all.
func TestUnavailableAnswers(t *testing.T) {
	failed := fmt.Errorf("%w: read data/x: connection refused", streamstore.ErrUnavailable)
	log := zaptest.NewLogger(t)
	for _, p := range []struct {
		name   string
		answer func(http.ResponseWriter, *http.Request, error)
	}{
		{"durable-streams", (&durableStreams{log: log}).engineError},
		{"pico", (&picoProtocol{log: log}).engineError},
	} {
		for _, tc := range []struct {
			method string
			acked  bool // the reason speaks of acknowledgement
		}{
			{http.MethodGet, false},
			{http.MethodHead, false},
			{http.MethodPost, true},
			{http.MethodPut, true},
			{http.MethodDelete, true},
		} {
			t.Run(p.name+"/"+tc.method, func(t *testing.T) {
				w := httptest.NewRecorder()
				p.answer(w, httptest.NewRequest(tc.method, "/s", nil), failed)
				if w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") == "" {
					t.Fatalf("%d, Retry-After %q; want 503 with Retry-After", w.Code, w.Header().Get("Retry-After"))
				}
				body := w.Body.String()
				if tc.method != http.MethodHead && !strings.Contains(body, "storage unavailable") {
					t.Errorf("body %q does not say the storage is unavailable", body)
				}
				if got := strings.Contains(body, "acknowledged"); got != tc.acked {
					t.Errorf("body %q: speaks of acknowledgement %v, want %v", body, got, tc.acked)
				}
			})
		}
	}
}

// An append refused because too many bytes wait for storage is a 503 with
// Retry-After and the reason, in either protocol, not a storage failure.
func TestBusyAnswers(t *testing.T) {
	busy := fmt.Errorf("%w: %w", streamstore.ErrUnavailable, streamstore.ErrBusy)
	log := zaptest.NewLogger(t)
	for _, tc := range []struct {
		name   string
		answer func(http.ResponseWriter, *http.Request, error)
		code   string // the Pico error name; "" for Durable Streams
	}{
		{"durable-streams", (&durableStreams{log: log}).engineError, ""},
		{"pico", (&picoProtocol{log: log}).engineError, picoErrUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := httptest.NewRecorder()
			tc.answer(w, httptest.NewRequest(http.MethodPost, "/s", nil), busy)
			if w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") == "" {
				t.Fatalf("%d, Retry-After %q; want 503 with Retry-After", w.Code, w.Header().Get("Retry-After"))
			}
			if !strings.Contains(w.Body.String(), busyMessage) {
				t.Errorf("body %q does not say %q", w.Body, busyMessage)
			}
			if tc.code != "" && !strings.Contains(w.Body.String(), `"error":"`+tc.code+`"`) {
				t.Errorf("body %q lacks error %q", w.Body, tc.code)
			}
		})
	}
}

// A read (or a Pico listing) that names one of its parameters twice is
// refused in both protocols rather than answered by whichever value came
// first.
func TestRepeatedReadParametersAreRefused(t *testing.T) {
	ds := newDSServer(t)
	ds.do(t, "PUT", "/s", "a", ct, "text/plain").want(t, 201)
	for _, q := range []string{"offset=-1&offset=now", "offset=-1&live=long-poll&live=sse", "offset=now&live=sse&cursor=1&cursor=2"} {
		r := ds.do(t, "GET", "/s?"+q, "").want(t, 400)
		if !strings.Contains(r.body, "more than once") {
			t.Errorf("Durable Streams ?%s: body %q", q, r.body)
		}
	}
	ds.do(t, "GET", "/s?offset=-1", "").want(t, 200)

	pico := newPicoServer(t)
	pico.do(t, "PUT", "/pico/p", []byte("a"), ct, "text/plain").want(t, 201)
	for _, q := range []string{"seq=0&seq=1", "seq=0&live=sse&live=long-poll", "format=json&format=raw", "count=1&count=2", "bytes=1&bytes=2"} {
		r := pico.do(t, "GET", "/pico/p?"+q, nil).want(t, 400)
		if !strings.Contains(string(r.body), "more than once") {
			t.Errorf("Pico ?%s: body %q", q, r.body)
		}
	}
	pico.do(t, "GET", "/pico/p?seq=0&count=1", nil).want(t, 200)
	// The stream listing's parameters too.
	for _, q := range []string{"prefix=/&prefix=/p", "limit=1&limit=2", "start_after=/a&start_after=/b"} {
		r := pico.do(t, "GET", "/pico/?"+q, nil).want(t, 400)
		if !strings.Contains(string(r.body), "more than once") {
			t.Errorf("Pico list ?%s: body %q", q, r.body)
		}
	}
	pico.do(t, "GET", "/pico/?prefix=/&limit=1", nil).want(t, 200)
}

// TestPicoReadsWithCredentialsArePrivate: a cacheable Pico catch-up page
// says "private" when the request carried Authorization or a Cookie, as Durable
// Streams reads do (TestReadsWithCredentialsArePrivate); "public" would let
// a shared cache give it to clients without credentials.
func TestPicoReadsWithCredentialsArePrivate(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/r", nil, hCT, "application/octet-stream").want(t, 201)
	s.do(t, "POST", "/pico/r", []byte("x"), hCT, "application/octet-stream").want(t, 200)
	s.do(t, "GET", "/pico/r?seq=0", nil).want(t, 200).header(t, "Cache-Control", "public, max-age=60, stale-while-revalidate=300")
	for _, cred := range [][2]string{{"Authorization", "Bearer reader-1"}, {"Cookie", "session=reader-1"}} {
		s.do(t, "GET", "/pico/r?seq=0", nil, cred[0], cred[1]).want(t, 200).
			header(t, "Cache-Control", "private, max-age=60, stale-while-revalidate=300")
		// At the tail nothing may be kept, credentials or not.
		s.do(t, "GET", "/pico/r?seq=1", nil, cred[0], cred[1]).want(t, 200).header(t, "Cache-Control", "no-store")
	}
}

// TestPicoLastEventIDReadsAreNotShared: a catch-up read without seq= starts
// where Last-Event-ID says, so its page depends on a header the URL does
// not show. A page positioned by the header is never stored, and every
// seq-less page says it varies on the header, so that no cache answers a
// reader from the first record with a page from the middle, or the other
// way round. A read whose URL names the position depends on no header.
func TestPicoLastEventIDReadsAreNotShared(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/r", nil, hCT, "text/plain").want(t, 201)
	for _, b := range []string{"a", "b", "c"} {
		s.do(t, "POST", "/pico/r", []byte(b)).want(t, 200)
	}
	tests := []struct {
		name, path, lastEventID string
		first                   uint64
		cacheControl, vary      string
	}{
		{"from the start, no header", "/pico/r?count=3", "", 0, cacheControlCatchUp, "Last-Event-ID"},
		// HEAD's URL: caches that fetch a HEAD as a GET would answer HEADs
		// with the page's headers.
		{"the bare URL", "/pico/r", "", 0, cacheControlNoStore, "Last-Event-ID"},
		{"from Last-Event-ID", "/pico/r", "1", 1, cacheControlNoStore, "Last-Event-ID"},
		{"seq= wins over Last-Event-ID", "/pico/r?seq=2", "1", 2, cacheControlCatchUp, ""},
		{"seq= alone", "/pico/r?seq=0", "", 0, cacheControlCatchUp, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var hdr []string
			if tc.lastEventID != "" {
				hdr = []string{"Last-Event-ID", tc.lastEventID}
			}
			r := s.do(t, "GET", tc.path, nil, hdr...).want(t, 200).
				header(t, "Cache-Control", tc.cacheControl).header(t, "Vary", tc.vary)
			if recs := r.records(t); len(recs) == 0 || recs[0].Seq != tc.first {
				t.Errorf("records %+v, want them from seq %d", recs, tc.first)
			}
		})
	}
}

// TestPicoCacheReadsPrivate: with cache_reads private a cacheable Pico
// catch-up page says "private" though the request carries no credentials
// the module can see, as Durable Streams reads do (TestCacheReadsPrivate).
func TestPicoCacheReadsPrivate(t *testing.T) {
	s := newPicoServer(t, func(p *picoProtocol) { p.privateReads = true })
	s.do(t, "PUT", "/pico/r", nil, hCT, "application/octet-stream").want(t, 201)
	s.do(t, "POST", "/pico/r", []byte("x"), hCT, "application/octet-stream").want(t, 200)
	for _, path := range []string{"/pico/r?seq=0", "/pico/r?seq=0&token=reader-1"} {
		s.do(t, "GET", path, nil).want(t, 200).header(t, "Cache-Control", cacheControlPrivate)
	}
	s.do(t, "GET", "/pico/r?seq=0", nil, "X-Api-Key", "reader-1").want(t, 200).header(t, "Cache-Control", cacheControlPrivate)
	// At the tail nothing may be kept.
	s.do(t, "GET", "/pico/r?seq=1", nil).want(t, 200).header(t, "Cache-Control", cacheControlNoStore)
}

// A stream name with a __ds segment is refused at create: Durable Streams
// serves its control resources there, so it could not reach the stream.
// One made before the rule (here straight through the engine) is still
// read and deleted.
func TestPicoReservedSegment(t *testing.T) {
	s := newPicoServer(t)
	for _, tt := range []struct {
		path    string
		refused bool
	}{
		{"/pico/w/__ds", true},
		{"/pico/__ds/subscriptions/s9", true},
		{"/pico/a/__ds/b", true},
		{"/pico/w/__dsx", false},
		{"/pico/x__ds", false},
		{"/pico/__d/s", false},
	} {
		if tt.refused {
			s.do(t, "PUT", tt.path, []byte("x"), hCT, "text/plain").wantError(t, 400, picoErrBadRequest, -1)
			s.do(t, "HEAD", tt.path, nil).want(t, 404)
		} else {
			s.do(t, "PUT", tt.path, []byte("x"), hCT, "text/plain").want(t, 201)
		}
	}
	if _, _, err := s.eng.Create(context.Background(), "/old/__ds", streamstore.CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	s.do(t, "HEAD", "/pico/old/__ds", nil).want(t, 200)
	s.do(t, "DELETE", "/pico/old/__ds", nil).want(t, 204)
}

// sameHeaders compares headers as a map, in any order, and in linear time
// however many there are: the quadratic comparison took many seconds for
// a record of a hundred thousand headers, which any client could send in
// a create and then repeat.
func TestSameHeaders(t *testing.T) {
	hs := func(kv ...string) []streamstore.Header {
		var out []streamstore.Header
		for i := 0; i+1 < len(kv); i += 2 {
			out = append(out, streamstore.Header{Name: kv[i], Value: kv[i+1]})
		}
		return out
	}
	many := func(n int, reversed bool, last string) []streamstore.Header {
		out := make([]streamstore.Header, n)
		for i := range out {
			j := i
			if reversed {
				j = n - 1 - i
			}
			out[i] = streamstore.Header{Name: fmt.Sprintf("h%07d", j), Value: "v"}
		}
		if last != "" {
			out[len(out)-1].Value = last
		}
		return out
	}
	for _, tc := range []struct {
		name string
		a, b []streamstore.Header
		want bool
	}{
		{"none", nil, nil, true},
		{"same order", hs("a", "1", "b", "2"), hs("a", "1", "b", "2"), true},
		{"other order", hs("a", "1", "b", "2"), hs("b", "2", "a", "1"), true},
		{"another value", hs("a", "1", "b", "2"), hs("a", "1", "b", "3"), false},
		{"another name", hs("a", "1"), hs("c", "1"), false},
		{"more", hs("a", "1"), hs("a", "1", "b", "2"), false},
		{"a name twice against two names", hs("a", "1", "a", "1"), hs("a", "1", "b", "1"), false},
		{"many, other order", many(200_000, false, ""), many(200_000, true, ""), true},
		{"many, one value differs", many(200_000, false, ""), many(200_000, true, "x"), false},
		{"many, a name twice in one", many(20, false, ""), append(many(19, false, ""), streamstore.Header{Name: "h0000000", Value: "v"}), false},
	} {
		if got := sameHeaders(tc.a, tc.b); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

// A Pico 410 says "deleted" only for a stream that was: a read below the
// retained records, whether the handler found it (belowStartError) or the
// engine did (a TrimmedError, as when a trim overtakes a read from the
// start between its reads), names the seqs instead.
func TestGoneMessage(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want string
	}{
		{"below the start", &belowStartError{seq: 2, start: 7}, "seq 2 was trimmed; the stream's first retained seq is 7"},
		{"trimmed, from the engine", fmt.Errorf("read /s: %w", &streamstore.TrimmedError{Seq: 3, StartSeq: 9}), "seq 3 was trimmed; the stream's first retained seq is 9"},
		{"soft-deleted", fmt.Errorf("read /s: %w", streamstore.ErrGone), "stream was deleted; its forks still use it"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := goneMessage(tt.err); got != tt.want {
				t.Errorf("goneMessage(%v) = %q, want %q", tt.err, got, tt.want)
			}
		})
	}
}

// TestPicoRevalidationReplacesUpToDate: a page of count records that
// reaches the tail is not up to date once a record is appended, its range
// unchanged. Its ETag says whether it is, so a cache revalidating it gets a
// 200 without Pico-Up-To-Date rather than a 304, which could not drop the
// kept header.
func TestPicoRevalidationReplacesUpToDate(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/u", nil, hCT, "text/plain").want(t, 201)
	s.do(t, "POST", "/pico/u", []byte("a")).want(t, 200)
	first := s.do(t, "GET", "/pico/u?seq=0&count=1", nil).want(t, 200).header(t, hdrPicoUpToDate, "true")
	tag := first.h.Get("ETag")
	s.do(t, "GET", "/pico/u?seq=0&count=1", nil, "If-None-Match", tag).want(t, 304)
	s.do(t, "POST", "/pico/u", []byte("b")).want(t, 200)
	s.do(t, "GET", "/pico/u?seq=0&count=1", nil, "If-None-Match", tag).want(t, 200).
		header(t, hdrPicoUpToDate, "").header(t, hdrPicoNextSeq, "1")
}

// TestPicoReadFromStartRacesTrims: a read without seq starts at the first
// record a trim left, wherever trims landing meanwhile moved it: one that
// landed between the read's look at the start and its read from there was
// 410 for a seq the client never asked for.
func TestPicoReadFromStartRacesTrims(t *testing.T) {
	s := newPicoServer(t)
	s.do(t, "PUT", "/pico/t", nil, hCT, "text/plain").want(t, 201)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		recs := make([]streamstore.NewRecord, 100)
		for i := range recs {
			recs[i].Body = []byte("x")
		}
		for ctx.Err() == nil {
			res, err := s.eng.Append(ctx, "/t", streamstore.AppendRequest{Records: recs})
			if err != nil {
				return
			}
			// A record at a time: the start moves as often as it can.
			for seq := res.NextSeq - uint64(len(recs)) + 1; seq <= res.NextSeq; seq++ {
				if _, err := s.eng.Trim(ctx, "/t", seq); err != nil {
					return
				}
			}
		}
	}()
	var gone, reads atomic.Int64
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for ctx.Err() == nil {
				req, _ := http.NewRequest("GET", s.URL+"/pico/t?count=1", nil)
				res, err := http.DefaultClient.Do(req)
				if err != nil {
					continue
				}
				io.Copy(io.Discard, res.Body)
				res.Body.Close()
				if res.StatusCode == 410 {
					gone.Add(1)
				}
				reads.Add(1)
			}
		})
	}
	wg.Wait()
	<-done
	if n := gone.Load(); n > 0 {
		t.Errorf("%d of %d reads from the start were 410 while trims landed", n, reads.Load())
	}
}
