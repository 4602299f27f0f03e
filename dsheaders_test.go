package picomq

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"slices"
	"strings"
	"testing"
	"testing/iotest"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/picomq/caddy-picomq/internal/picowire"
	"github.com/picomq/caddy-picomq/streamstore"
)

func TestParseTTL(t *testing.T) {
	for _, ok := range []struct {
		in   string
		want time.Duration
	}{{"1", time.Second}, {"3600", time.Hour}, {"10", 10 * time.Second}} {
		got, err := parseTTL(ok.in)
		if err != nil || got != ok.want {
			t.Errorf("parseTTL(%q) = %v, %v; want %v", ok.in, got, err, ok.want)
		}
	}
	for _, bad := range []string{"", "0", "00060", "060", "+60", "-1", "60.5", "1e3", "abc", " 60", "60 ", "0x10",
		"99999999999999999999", "3153600001"} {
		if got, err := parseTTL(bad); err == nil {
			t.Errorf("parseTTL(%q) = %v, want an error", bad, got)
		}
	}
}

func TestParseExpiry(t *testing.T) {
	now := time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)
	h := http.Header{}
	if x, err := parseExpiry(h, now); err != nil || !x.IsZero() {
		t.Errorf("no headers: %+v %v", x, err)
	}
	h.Set("Stream-TTL", "60")
	if x, err := parseExpiry(h, now); err != nil || x.TTL != time.Minute {
		t.Errorf("TTL: %+v %v", x, err)
	}
	h.Set("Stream-Expires-At", "2030-01-02T03:04:05Z")
	if _, err := parseExpiry(h, now); err == nil {
		t.Error("TTL and Expires-At together were accepted")
	}
	h.Del("Stream-TTL")
	for in, want := range map[string]time.Time{
		"2030-01-02T03:04:05Z":          time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC),
		"2030-01-02T03:04:05.123Z":      time.Date(2030, 1, 2, 3, 4, 5, 123e6, time.UTC),
		"2030-01-02T05:04:05+02:00":     time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC),
		"2030-01-02T03:04:05.123+00:00": time.Date(2030, 1, 2, 3, 4, 5, 123e6, time.UTC),
		// Milliseconds are what the engine keeps.
		"2030-01-02T03:04:05.123456Z":    time.Date(2030, 1, 2, 3, 4, 5, 123e6, time.UTC),
		"2030-01-02T03:04:05.999999999Z": time.Date(2030, 1, 2, 3, 4, 5, 999e6, time.UTC),
		// RFC 3339 section 5.6 allows a lower-case t and z.
		"2030-01-02t03:04:05z": time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC),
	} {
		h.Set("Stream-Expires-At", in)
		x, err := parseExpiry(h, now)
		if err != nil || !x.ExpiresAt.Equal(want) || x.ExpiresAt.Location() != time.UTC {
			t.Errorf("%s: %+v %v", in, x, err)
		}
	}
	// Go's parser takes an offset of 24 hours or 60 minutes and a comma
	// before the fraction; RFC 3339 section 5.6 allows neither.
	for _, bad := range []string{"not-a-timestamp", "2030-01-02", "2030-01-02 03:04:05Z", "1767225600", "",
		"2030-01-02T03:04:05+24:00", "2030-01-02T03:04:05-23:60", "2030-01-02T03:04:05,5Z"} {
		h.Set("Stream-Expires-At", bad)
		if x, err := parseExpiry(h, now); err == nil {
			t.Errorf("Expires-At %q accepted: %+v", bad, x)
		}
	}
	// An expiry at or before now would make a stream that is gone at once.
	for _, tc := range []struct {
		at     string
		future bool
	}{
		{"2001-01-01T00:00:00Z", false},
		{"1970-01-01T00:00:00Z", false},
		{"2026-06-01T00:00:00Z", false},
		{"2026-06-01T02:00:00+02:00", false},
		{"2026-06-01T00:00:00.000999Z", false}, // a millisecond is what is kept
		{"2026-06-01T00:00:00.001Z", true},
	} {
		h.Set("Stream-Expires-At", tc.at)
		x, err := parseExpiry(h, now)
		switch {
		case tc.future && err != nil:
			t.Errorf("Expires-At %s, after now: %v", tc.at, err)
		case !tc.future && (err == nil || !strings.Contains(err.Error(), "not in the future")):
			t.Errorf("Expires-At %s, not after now: %+v %v", tc.at, x, err)
		}
	}
}

func TestIsTrue(t *testing.T) {
	for in, want := range map[string]bool{"true": true, "TRUE": true, "True": true, "": false, "false": false,
		"yes": false, "1": false, "true ": false} {
		if isTrue(in) != want {
			t.Errorf("isTrue(%q) != %v", in, want)
		}
	}
}

// TestNewStreamContentTypeIsBounded: a create's type, kept for as long as
// its stream lives, is at most streamstore.MaxContentTypeLength bytes as
// normalized; an append's is only compared, and is not bounded here.
func TestNewStreamContentTypeIsBounded(t *testing.T) {
	sub := func(n int) string { return "application/" + strings.Repeat("x", n-len("application/")) }
	for _, tc := range []struct {
		in, want string
		ok       bool
	}{
		{in: sub(256), want: sub(256), ok: true},
		{in: sub(257)},
		{in: strings.ToUpper(sub(256)), want: sub(256), ok: true},
		// The type kept is the normalized one: spaces dropped, a value
		// quoted.
		{in: "text/plain;" + strings.Repeat(" ", 300) + "a=b", want: "text/plain; a=b", ok: true},
		{in: "text/plain; a=\"" + strings.Repeat("b c", 80) + "\"", want: "text/plain; a=\"" + strings.Repeat("b c", 80) + "\"", ok: true},
		{in: "text/plain; a=\"" + strings.Repeat("b c", 81) + "\""},
		{in: "text"},
	} {
		got, err := newStreamContentType(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("newStreamContentType(%s, %d bytes) = %q, %v; want %q, ok %v", fhead(tc.in), len(tc.in), fhead(got), err, fhead(tc.want), tc.ok)
		}
		if err != nil && tc.in != "text" && !strings.Contains(err.Error(), "limit") {
			t.Errorf("newStreamContentType(%d bytes): %v, want the limit named", len(tc.in), err)
		}
	}
	if _, err := normalizeContentType(sub(4096)); err != nil {
		t.Errorf("normalizeContentType of a long type: %v; an append's type is compared, not kept", err)
	}
}

// fhead is the first bytes of s, for messages.
func fhead(s string) string { return s[:min(len(s), 24)] }

func TestContentTypes(t *testing.T) {
	for in, want := range map[string]string{
		"text/plain":                      "text/plain",
		"TEXT/PLAIN":                      "text/plain",
		"application/json; charset=utf-8": "application/json; charset=utf-8",
		"Application/JSON;Charset=UTF-8":  "application/json; charset=UTF-8",
	} {
		got, err := normalizeContentType(in)
		if err != nil || got != want {
			t.Errorf("normalizeContentType(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "text", "/plain", "text/plain; charset"} {
		if got, err := normalizeContentType(bad); err == nil {
			t.Errorf("normalizeContentType(%q) = %q, want an error", bad, got)
		}
	}
	// The fast path answers exactly as the parser would.
	for _, in := range []string{"application/octet-stream", "text/plain", "application/vnd.api+json", "a/b", "x-y/z.w_v",
		"text/plain ", "text/", "/x", "a/b/c", "text/Plain", "text/plain;a=b", "te xt/plain", "text/pla\x00in", "a/b!#$&-^_.+"} {
		fast, ferr := normalizeContentType(in)
		slow, serr := parseContentType(in)
		if fast != slow || (ferr == nil) != (serr == nil) {
			t.Errorf("%q: fast path %q, %v; parser %q, %v", in, fast, ferr, slow, serr)
		}
	}
	if !sameMediaType("application/json; charset=utf-8", "APPLICATION/JSON") || sameMediaType("text/plain", "text/html") {
		t.Error("sameMediaType")
	}
	if !isJSON("application/json; charset=utf-8") || isJSON("application/ndjson") {
		t.Error("isJSON")
	}
	for ct, want := range map[string]bool{"text/plain": true, "text/csv; charset=utf-8": true, "application/json": true,
		"application/octet-stream": false, "application/x-protobuf": false, "image/png": false, "application/ndjson": false} {
		if isTextual(ct) != want {
			t.Errorf("isTextual(%q) != %v", ct, want)
		}
	}
}

func TestParseProducer(t *testing.T) {
	mk := func(kv ...string) http.Header {
		h := http.Header{}
		for i := 0; i < len(kv); i += 2 {
			h[http.CanonicalHeaderKey(kv[i])] = []string{kv[i+1]}
		}
		return h
	}
	if p, err := parseProducer(mk()); p != nil || err != nil {
		t.Errorf("no headers: %v %v", p, err)
	}
	p, err := parseProducer(mk("Producer-Id", "a", "Producer-Epoch", "2", "Producer-Seq", "9007199254740991"))
	if err != nil || p.ID != "a" || p.Epoch != 2 || p.Seq != 1<<53-1 {
		t.Errorf("valid: %+v %v", p, err)
	}
	for _, bad := range []http.Header{
		mk("Producer-Id", "a"),
		mk("Producer-Id", "a", "Producer-Epoch", "0"),
		mk("Producer-Epoch", "0", "Producer-Seq", "0"),
		mk("Producer-Id", "", "Producer-Epoch", "0", "Producer-Seq", "0"),
		mk("Producer-Id", "a", "Producer-Epoch", "0", "Producer-Seq", "1abc"),
		mk("Producer-Id", "a", "Producer-Epoch", "0xyz", "Producer-Seq", "0"),
		mk("Producer-Id", "a", "Producer-Epoch", "1e3", "Producer-Seq", "0"),
		mk("Producer-Id", "a", "Producer-Epoch", "-1", "Producer-Seq", "0"),
		mk("Producer-Id", "a", "Producer-Epoch", "0", "Producer-Seq", "9007199254740992"),
		mk("Producer-Id", strings.Repeat("p", streamstore.MaxProducerIDLength+1), "Producer-Epoch", "0", "Producer-Seq", "0"),
	} {
		if p, err := parseProducer(bad); err == nil {
			t.Errorf("%v accepted: %+v", bad, p)
		}
	}
}

// TestProducerAndStreamSeqLimits: a producer id or Stream-Seq at the limit
// is taken, one byte more is refused, in both protocols.
func TestProducerAndStreamSeqLimits(t *testing.T) {
	at := strings.Repeat("p", streamstore.MaxProducerIDLength)
	for _, tc := range []struct {
		id, epoch, seq string
		parse          func(http.Header) (*streamstore.Producer, error)
	}{
		{"Producer-Id", "Producer-Epoch", "Producer-Seq", parseProducer},
		{"Pico-Producer-Id", "Pico-Producer-Epoch", "Pico-Producer-Seq", parsePicoProducer},
	} {
		h := http.Header{tc.id: {at}, tc.epoch: {"0"}, tc.seq: {"0"}}
		if p, err := tc.parse(h); err != nil || p.ID != at {
			t.Errorf("%s of %d bytes: %v", tc.id, len(at), err)
		}
		h[tc.id] = []string{at + "p"}
		if p, err := tc.parse(h); err == nil || !strings.Contains(err.Error(), "limit") {
			t.Errorf("%s of %d bytes: %+v, %v; want an error naming the limit", tc.id, len(at)+1, p, err)
		}
	}
	seq := strings.Repeat("s", streamstore.MaxStreamSeqLength)
	if v, err := parseStreamSeq(http.Header{"Stream-Seq": {seq}}); err != nil || v != seq {
		t.Errorf("Stream-Seq of %d bytes: %q, %v", len(seq), v, err)
	}
	if v, err := parseStreamSeq(http.Header{"Stream-Seq": {seq + "s"}}); err == nil {
		t.Errorf("Stream-Seq of %d bytes taken: %q", len(seq)+1, v)
	}
	if v, err := parseStreamSeq(http.Header{"Stream-Seq": {""}}); err == nil {
		t.Errorf("an empty Stream-Seq taken: %q", v)
	}
	if v, err := parseStreamSeq(http.Header{}); err != nil || v != "" {
		t.Errorf("no Stream-Seq: %q, %v", v, err)
	}
}

func TestJSONMessages(t *testing.T) {
	for in, want := range map[string][]string{
		`{"event": "created"}`:               {`{"event":"created"}`},
		`[{"event": "a"}, {"event": "b"}]`:   {`{"event":"a"}`, `{"event":"b"}`},
		`[[1,2], [3,4]]`:                     {`[1,2]`, `[3,4]`},
		`[[[1,2,3]]]`:                        {`[[1,2,3]]`},
		` 42 `:                               {`42`},
		`"a\nb"`:                             {`"a\nb"`},
		"{\n  \"multi\":\n  \"line\"\n}\n":   {`{"multi":"line"}`},
		`[]`:                                 {},
		` [ ] `:                              {},
		`[null, true, "x", 1.50e3]`:          {`null`, `true`, `"x"`, `1.50e3`},
		`[{"big": 12345678901234567890123}]`: {`{"big":12345678901234567890123}`},
	} {
		got, err := jsonMessages([]byte(in))
		if err != nil {
			t.Errorf("%q: %v", in, err)
			continue
		}
		if len(got) != len(want) {
			t.Errorf("%q: %d messages, want %d", in, len(got), len(want))
			continue
		}
		for i := range got {
			if string(got[i]) != want[i] {
				t.Errorf("%q message %d = %s, want %s", in, i, got[i], want[i])
			}
		}
	}
	for _, bad := range []string{``, `{ invalid json }`, `[1,`, `{"a":1}{"b":2}`, `[1] [2]`,
		// Not UTF-8 (RFC 8259 section 8.1), inside a string or a key.
		"{\"a\":\"\xff\xfe\"}", "[\"ok\", \"\xc3\x28\"]", "{\"\x80\":1}"} {
		if got, err := jsonMessages([]byte(bad)); err == nil {
			t.Errorf("%q accepted: %q", bad, got)
		}
	}
}

// TestJSONMessagesRecordLimit: a JSON array of more elements than an
// append may hold records is refused, as too large; one at the limit is
// taken.
func TestJSONMessagesRecordLimit(t *testing.T) {
	array := func(n int) []byte {
		return []byte("[" + strings.TrimSuffix(strings.Repeat("1,", n), ",") + "]")
	}
	got, err := jsonMessages(array(picowire.MaxRecords))
	if err != nil || len(got) != picowire.MaxRecords {
		t.Fatalf("an array of %d: %d messages, %v", picowire.MaxRecords, len(got), err)
	}
	_, err = jsonMessages(array(picowire.MaxRecords + 1))
	if !errors.Is(err, picowire.ErrTooManyRecords) {
		t.Fatalf("an array of %d: %v, want ErrTooManyRecords", picowire.MaxRecords+1, err)
	}
	if s := bodyErrorStatus(err); s != http.StatusRequestEntityTooLarge {
		t.Errorf("status of %v: %d, want 413", err, s)
	}
}

func TestReadBodyLimit(t *testing.T) {
	for _, tc := range []struct {
		body    string
		length  int64 // -1: chunked, length unknown
		wantErr error
	}{
		{"12345", 5, nil},
		{"123456", 6, errBodyTooLarge},
		{"123456", -1, errBodyTooLarge},
		{"12345", -1, nil},
		{"", 0, nil},
	} {
		r := httptest.NewRequest(http.MethodPost, "/s", strings.NewReader(tc.body))
		r.ContentLength = tc.length
		got, err := readBody(r, 5, limitMaxAppendSize)
		if !errors.Is(err, tc.wantErr) || (err == nil && string(got) != tc.body) {
			t.Errorf("%q (length %d): %q, %v", tc.body, tc.length, got, err)
		}
	}
	// An oversized chunked body is read no further than limit+1 bytes.
	src := &countingReader{r: bytes.NewReader(make([]byte, 1<<20))}
	r := httptest.NewRequest(http.MethodPost, "/s", src)
	r.ContentLength = -1
	if _, err := readBody(r, 100, limitMaxAppendSize); !errors.Is(err, errBodyTooLarge) {
		t.Fatalf("err = %v", err)
	}
	if src.n > 101 {
		t.Errorf("read %d bytes of an oversized body", src.n)
	}
}

// TestReadBodyNamesCaddysLimit: behind Caddy's request_body max_size, a
// body over it is refused as too large with that limit in the message, not
// max_append_size, whether it came with a length or chunked.
func TestReadBodyNamesCaddysLimit(t *testing.T) {
	for _, length := range []int64{2000, -1} {
		r := httptest.NewRequest(http.MethodPost, "/s", strings.NewReader(strings.Repeat("b", 2000)))
		r.ContentLength = length
		// What request_body does with max_size 1KB.
		r.Body = http.MaxBytesReader(httptest.NewRecorder(), r.Body, 1000)
		_, err := readBody(r, 16<<20, limitMaxAppendSize)
		if !errors.Is(err, errBodyTooLarge) || err.Error() != "body is larger than the 1000-byte limit (the site's request_body max_size)" {
			t.Errorf("length %d: %v, want the 1000-byte limit, request_body's", length, err)
		}
	}
	r := httptest.NewRequest(http.MethodPost, "/s", strings.NewReader("123456"))
	if _, err := readBody(r, 5, limitMaxAppendSize); err == nil || err.Error() != "body is larger than the 5-byte limit (max_append_size)" {
		t.Errorf("over max_append_size: %v, want the 5-byte limit", err)
	}
}

// TestReadBodyKnownLength: a body with a Content-Length is read whole
// whatever the sizes its reads come in, a short one is an error, and a
// client that announces a large body and sends little gets a buffer the
// size of what it sent, not of what it announced.
func TestReadBodyKnownLength(t *testing.T) {
	for _, n := range []int{1, bodyFirstRead - 1, bodyFirstRead, bodyFirstRead + 1, 1<<20 + 3} {
		want := make([]byte, n)
		for i := range want {
			want[i] = byte(i * 7)
		}
		r := httptest.NewRequest(http.MethodPost, "/s", iotest.HalfReader(bytes.NewReader(want)))
		r.ContentLength = int64(n)
		got, err := readBody(r, 2<<20, limitMaxAppendSize)
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("a %d-byte body: %d bytes, %v", n, len(got), err)
		}
		r = httptest.NewRequest(http.MethodPost, "/s", bytes.NewReader(want[:n-1]))
		r.ContentLength = int64(n)
		if got, err := readBody(r, 2<<20, limitMaxAppendSize); !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Errorf("a %d-byte body one byte short: %d bytes, %v", n, len(got), err)
		}
	}

	const announced = 16 << 20
	r := httptest.NewRequest(http.MethodPost, "/s", io.MultiReader(bytes.NewReader(make([]byte, 1000)), iotest.ErrReader(errors.New("client gone"))))
	r.ContentLength = announced
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err := readBody(r, announced, limitMaxAppendSize)
	runtime.ReadMemStats(&after)
	if err == nil {
		t.Fatal("a body cut short was taken")
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 1<<20 {
		t.Errorf("reading 1000 bytes of an announced %d allocated %d bytes", announced, got)
	}
}

type countingReader struct {
	r interface{ Read([]byte) (int, error) }
	n int
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += n
	return n, err
}

// The common headers of one response share a backing array; a later
// handler that adds to one of them must not change the others, nor those
// of another response.
func TestCommonHeadersIndependent(t *testing.T) {
	a, b := http.Header{}, http.Header{}
	setCommonHeaders(a)
	setCommonHeaders(b)
	a.Add("X-Content-Type-Options", "extra")
	a["Access-Control-Allow-Origin"][0] = "https://example.com"
	for _, tc := range []struct {
		h    http.Header
		name string
		want []string
	}{
		{a, "X-Content-Type-Options", []string{"nosniff", "extra"}},
		{a, "Cross-Origin-Resource-Policy", []string{"cross-origin"}},
		{a, "Access-Control-Allow-Origin", []string{"https://example.com"}},
		{a, "Access-Control-Expose-Headers", []string{exposedHeaders}},
		{b, "X-Content-Type-Options", []string{"nosniff"}},
		{b, "Cross-Origin-Resource-Policy", []string{"cross-origin"}},
		{b, "Access-Control-Allow-Origin", []string{"*"}},
		{b, "Access-Control-Expose-Headers", []string{exposedHeaders}},
		{a, "Content-Security-Policy", []string{contentSecurityPolicy}},
		{b, "Content-Security-Policy", []string{contentSecurityPolicy}},
	} {
		if got := tc.h.Values(tc.name); !slices.Equal(got, tc.want) {
			t.Errorf("%s = %q, want %q", tc.name, got, tc.want)
		}
	}
}

func TestConflictingHeader(t *testing.T) {
	names := []string{"Content-Type", hdrStreamTTL}
	for _, tc := range []struct {
		name string
		h    http.Header
		want string // "" when the request is fine
	}{
		{"none", http.Header{}, ""},
		{"once each", http.Header{"Content-Type": {"text/plain"}, "Stream-Ttl": {"60"}}, ""},
		{"the same value twice", http.Header{"Stream-Ttl": {"60", "60"}}, ""},
		{"two values", http.Header{"Stream-Ttl": {"60", "61"}}, hdrStreamTTL},
		{"a third that differs", http.Header{"Content-Type": {"a/b", "a/b", "c/d"}}, "Content-Type"},
		{"a header not listed", http.Header{"Accept": {"a/b", "c/d"}}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, bad := conflictingHeader(tc.h, names)
			if got != tc.want || bad != (tc.want != "") {
				t.Errorf("conflictingHeader = %q, %v; want %q", got, bad, tc.want)
			}
		})
	}
}

// TestConflictingClosed: Stream-Closed lines conflict only when one says
// "true" (in any case) and another does not, since every other value means
// the header is absent (section 4.1).
func TestConflictingClosed(t *testing.T) {
	for _, tc := range []struct {
		values []string
		want   bool
	}{
		{nil, false},
		{[]string{"true"}, false},
		{[]string{"true", "true"}, false},
		{[]string{"true", "TRUE", "True"}, false},
		{[]string{"yes", "no"}, false},
		{[]string{"false", ""}, false},
		{[]string{"true", "false"}, true},
		{[]string{"no", "TRUE"}, true},
		{[]string{"true", "true", "1"}, true},
	} {
		h := http.Header{}
		for _, v := range tc.values {
			h.Add(hdrStreamClosed, v)
		}
		if got := conflictingClosed(h); got != tc.want {
			t.Errorf("Stream-Closed %q: conflictingClosed = %v, want %v", tc.values, got, tc.want)
		}
	}
}

// TestCacheControlForExpiringStreams: a cacheable read answer of a stream
// that expires is kept no longer than the stream lives, stale serving
// included, and not at all in its last second.
func TestCacheControlForExpiringStreams(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, tc := range []struct {
		name   string
		x      streamstore.Expiry
		readAt time.Time
		creds  bool
		want   string
	}{
		{"no expiry", streamstore.Expiry{}, now, false, cacheControlCatchUp},
		{"no expiry, credentials", streamstore.Expiry{}, now, true, cacheControlPrivate},
		{"far deadline", streamstore.Expiry{ExpiresAt: now.Add(time.Hour)}, now, false, cacheControlCatchUp},
		{"deadline just fits", streamstore.Expiry{ExpiresAt: now.Add(360 * time.Second)}, now, false, cacheControlCatchUp},
		{"deadline in 5m", streamstore.Expiry{ExpiresAt: now.Add(5 * time.Minute)}, now, false,
			"public, max-age=60, stale-while-revalidate=240"},
		{"deadline in 90.9s", streamstore.Expiry{ExpiresAt: now.Add(90900 * time.Millisecond)}, now, true,
			"private, max-age=60, stale-while-revalidate=30"},
		{"deadline in 60s", streamstore.Expiry{ExpiresAt: now.Add(time.Minute)}, now, false, "public, max-age=60"},
		{"deadline in 10.5s", streamstore.Expiry{ExpiresAt: now.Add(10500 * time.Millisecond)}, now, false, "public, max-age=10"},
		{"deadline in 1s", streamstore.Expiry{ExpiresAt: now.Add(time.Second)}, now, true, "private, max-age=1"},
		{"deadline in 999ms", streamstore.Expiry{ExpiresAt: now.Add(999 * time.Millisecond)}, now, false, cacheControlNoStore},
		{"deadline passed", streamstore.Expiry{ExpiresAt: now.Add(-time.Second)}, now, false, cacheControlNoStore},
		// A sliding TTL runs from the read, which the answer follows.
		{"ttl 1h", streamstore.Expiry{TTL: time.Hour}, now, false, cacheControlCatchUp},
		{"ttl 30s", streamstore.Expiry{TTL: 30 * time.Second}, now, false, "public, max-age=30"},
		{"ttl 30s, read 200ms ago", streamstore.Expiry{TTL: 30 * time.Second}, now.Add(-200 * time.Millisecond), false,
			"public, max-age=29"},
		{"ttl 2m", streamstore.Expiry{TTL: 2 * time.Minute}, now, true, "private, max-age=60, stale-while-revalidate=60"},
		{"ttl 1s, read 1ms ago", streamstore.Expiry{TTL: time.Second}, now.Add(-time.Millisecond), false, cacheControlNoStore},
	} {
		if got := cacheControlFor(tc.creds, tc.x, tc.readAt, now); got != tc.want {
			t.Errorf("%s: Cache-Control %q, want %q", tc.name, got, tc.want)
		}
	}
}

// TestReadCacheControlPrivate: a cacheable read answer is "public", and an
// SSE feed without "private", only when the handler does not keep reads
// private (cache_reads), the request carries no credentials and Caddy's
// authentication did not let it through; max-age and
// stale-while-revalidate stay as they are, so the reader's browser still
// keeps the answer.
func TestReadCacheControlPrivate(t *testing.T) {
	creds := []struct {
		name  string
		key   string // header carrying the credential; "" none
		value string
		query string // query string of the read
	}{
		{"no credentials", "", "", "offset=-1"},
		{"authorization", "Authorization", "Bearer reader-1", "offset=-1"},
		{"cookie", "Cookie", "session=reader-1", "offset=-1"},
		// What the module cannot see as a credential: only the option
		// or Caddy's authentication makes these private.
		{"api key header", "X-Api-Key", "secret", "offset=-1"},
		{"token in the query", "", "", "offset=-1&token=secret"},
	}
	auths := []struct {
		name string
		// set fills the request's replacer as Caddy's handlers in front
		// of the module would; nil: no replacer at all.
		set     func(*caddy.Replacer)
		private bool
	}{
		{"no replacer", nil, false},
		{"not authenticated", func(*caddy.Replacer) {}, false},
		{"authenticated", func(repl *caddy.Replacer) { repl.Set("http.auth.user.id", "reader") }, true},
		// A provider may let a request through without naming a user.
		{"authenticated, no user id", func(repl *caddy.Replacer) { repl.Set("http.auth.user.id", "") }, true},
		// A failed attempt names a candidate, and the request is refused
		// before it reaches the module; the candidate is no principal.
		{"candidate only", func(repl *caddy.Replacer) { repl.Set("http.auth.candidate.id", "reader") }, false},
	}
	for _, option := range []bool{false, true} {
		for _, c := range creds {
			for _, a := range auths {
				r := httptest.NewRequest(http.MethodGet, "/s?"+c.query, nil)
				if c.key != "" {
					r.Header.Set(c.key, c.value)
				}
				if a.set != nil {
					// The replacer a Caddy server gives every request,
					// with its http.* placeholders.
					a.set(caddyhttp.NewTestReplacer(r))
				}
				want, wantFeed := cacheControlCatchUp, cacheControlEventFeed
				if option || c.key == "Authorization" || c.key == "Cookie" || a.private {
					want, wantFeed = cacheControlPrivate, cacheControlPrivateFeed
				}
				if got := readCacheControl(r, option, streamstore.Expiry{}, time.Now()); got != want {
					t.Errorf("cache_reads private %v, %s, %s: Cache-Control %q, want %q", option, c.name, a.name, got, want)
				}
				if got := eventFeedCacheControl(r, option); got != wantFeed {
					t.Errorf("cache_reads private %v, %s, %s: SSE Cache-Control %q, want %q", option, c.name, a.name, got, wantFeed)
				}
			}
		}
	}
}

// TestHasCredentials: Authorization and Cookie both make a read answer
// private; a blank value carries nothing, and other headers are not
// credentials.
func TestHasCredentials(t *testing.T) {
	for _, tc := range []struct {
		name string
		h    http.Header
		want bool
	}{
		{"none", http.Header{}, false},
		{"authorization", http.Header{"Authorization": {"Bearer t"}}, true},
		{"basic", http.Header{"Authorization": {"Basic cmVhZGVyOng="}}, true},
		{"session cookie", http.Header{"Cookie": {"session=abc"}}, true},
		{"second cookie header", http.Header{"Cookie": {"", "session=abc"}}, true},
		{"blank authorization", http.Header{"Authorization": {""}}, false},
		{"blank cookie", http.Header{"Cookie": {" "}}, false},
		{"other headers", http.Header{"X-Api-Key": {"k"}, "Accept": {"*/*"}}, false},
	} {
		if got := hasCredentials(tc.h); got != tc.want {
			t.Errorf("%s: hasCredentials(%v) = %v, want %v", tc.name, tc.h, got, tc.want)
		}
	}
}

// TestReadBodyTimeout: a body whose reads stop at the connection's read
// deadline (the server's read_body timeout cutting off a slow client) is
// errBodyTimeout, which both protocols and the subscription API answer 408, whatever the body's
// framing; other read errors stay 400.
func TestReadBodyTimeout(t *testing.T) {
	deadline := &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}
	for _, tc := range []struct {
		name    string
		length  int64 // -1: chunked
		readErr error
		want    error
		status  int
	}{
		{"known length, deadline", 64, deadline, errBodyTimeout, http.StatusRequestTimeout},
		{"chunked, deadline", -1, deadline, errBodyTimeout, http.StatusRequestTimeout},
		{"known length, HTTP/2 stream deadline", 64, fmt.Errorf("%w", os.ErrDeadlineExceeded), errBodyTimeout, http.StatusRequestTimeout},
		{"known length, client gone", 64, io.ErrUnexpectedEOF, io.ErrUnexpectedEOF, http.StatusBadRequest},
	} {
		t.Run(tc.name, func(t *testing.T) {
			newReq := func() *http.Request {
				t.Helper()
				body := io.MultiReader(strings.NewReader("drip"), iotest.ErrReader(tc.readErr))
				r := httptest.NewRequest(http.MethodPost, "/s", body)
				r.ContentLength = tc.length
				return r
			}
			if _, err := readBody(newReq(), 1<<20, limitMaxAppendSize); !errors.Is(err, tc.want) {
				t.Errorf("readBody: %v, want %v", err, tc.want)
			}
			ds := &durableStreams{maxAppend: 1 << 20}
			rec := httptest.NewRecorder()
			if _, ok := ds.readBody(rec, newReq()); ok || rec.Code != tc.status {
				t.Errorf("durable streams: ok %v, status %d %q, want %d", ok, rec.Code, rec.Body, tc.status)
			}
			pico := &picoProtocol{maxAppend: 1 << 20}
			rec = httptest.NewRecorder()
			if _, ok := pico.readBody(rec, newReq()); ok || rec.Code != tc.status {
				t.Errorf("pico: ok %v, status %d %q, want %d", ok, rec.Code, rec.Body, tc.status)
			}
			rec = httptest.NewRecorder()
			var v map[string]any
			if ok := readJSONBody(rec, newReq(), &v); ok || rec.Code != tc.status {
				t.Errorf("subscription control: ok %v, status %d %q, want %d", ok, rec.Code, rec.Body, tc.status)
			}
		})
	}
}

func TestDisplayHeader(t *testing.T) {
	for _, tc := range []struct{ name, want string }{
		{hdrPicoTTL, "Pico-TTL"},
		{hdrStreamTTL, "Stream-TTL"},
		{hdrLastEventID, "Last-Event-ID"},
		{"pico-ttl", "Pico-TTL"}, // any case on the wire
		{hdrPicoExpiresAt, "Pico-Expires-At"},
		{hdrPicoProducerID, "Pico-Producer-Id"}, // the reference's own spelling
		{"Content-Type", "Content-Type"},
	} {
		if got := displayHeader(tc.name); got != tc.want {
			t.Errorf("displayHeader(%q) = %q, want %q", tc.name, got, tc.want)
		}
	}
}
