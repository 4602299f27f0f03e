package integration

import (
	"bytes"
	"compress/gzip"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// fhBadCase is one request the module must refuse.
type fhBadCase struct {
	name   string
	req    fhReq
	status int
	// reason: the body must mention one of these (ignoring case).
	reason []string
	// absent, when set, is a stream that must not exist afterwards.
	absent string
}

// fhMaxAppend is the max_append_size the bad-input test runs with.
const fhMaxAppend = 1024

// TestBadInputChangesNothing sends malformed and refused requests and checks
// that each gets a clear 4xx with a reason in the body and makes no write
// to the object store (invariant 6), and that the streams it aimed at are
// unchanged.
func TestBadInputChangesNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	began := time.Now()
	e := fhStart(t, fhOptions{
		Directives: []string{"max_append_size 1KiB"},
		// No compaction pass during the test: its writes are not the
		// requests' (the counting below copes without it too).
		Optional: []string{"compact_interval 1h"},
	})
	const (
		jsonPath   = "/bi/json"
		textPath   = "/bi/text"
		closedPath = "/bi/closed"
	)
	e.create(jsonPath, "application/json")
	e.append(jsonPath, "application/json", []byte(`{"k":1}`))
	if r := e.must(fhReq{Method: http.MethodPut, Path: closedPath, Body: []byte(`[1]`),
		Header: map[string]string{"Content-Type": "application/json", "Stream-Closed": "true"}}); r.Status != http.StatusCreated {
		t.Fatalf("creating %s closed: %s", closedPath, r)
	}
	e.create(textPath, "text/plain")
	e.append(textPath, "text/plain", []byte("hello"))
	jsonBefore, jsonTail, err := e.readBytes(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	textBefore, textTail, err := e.readBytes(textPath)
	if err != nil {
		t.Fatal(err)
	}
	// A stream name exactly at the documented maximum is accepted; one
	// byte more is not (below).
	maxName := "/" + strings.Repeat("m", 255)
	e.create(maxName, "text/plain")

	hdr := func(kv ...string) map[string]string {
		m := map[string]string{}
		for i := 0; i+1 < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	get := func(query string) fhReq { return fhReq{Method: http.MethodGet, Path: textPath + "?" + query} }
	put := func(path string, kv ...string) fhReq {
		return fhReq{Method: http.MethodPut, Path: path, Header: hdr(append([]string{"Content-Type", "text/plain"}, kv...)...)}
	}
	post := func(path string, body []byte, kv ...string) fhReq {
		return fhReq{Method: http.MethodPost, Path: path, Header: hdr(kv...), Body: body}
	}
	tooBig := bytes.Repeat([]byte("x"), 2*fhMaxAppend)
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write([]byte("hello"))
	zw.Close()
	gzipped := gz.Bytes()
	badOffset := []string{"offset"}
	badTTL := []string{"ttl"}
	badAt := []string{"expires"}
	badName := []string{"name", "path", "segment"}
	badJSON := []string{"json"}
	badCT := []string{"content-type", "content type"}
	tooLarge := []string{"large", "size", "limit", "exceed", "max"}
	cases := []fhBadCase{
		{name: "offset/letters", req: get("offset=abc"), status: 400, reason: badOffset},
		{name: "offset/bare-number", req: get("offset=12"), status: 400, reason: badOffset},
		{name: "offset/minus-two", req: get("offset=-2"), status: 400, reason: badOffset},
		{name: "offset/fraction", req: get("offset=1.5"), status: 400, reason: badOffset},
		{name: "offset/trailing-junk", req: get("offset=" + textTail + "x"), status: 400, reason: badOffset},
		{name: "offset/slash", req: get("offset=0%2F1"), status: 400, reason: badOffset},
		{name: "offset/comma", req: get("offset=1%2C2"), status: 400, reason: badOffset},
		{name: "offset/long-poll-bad", req: get("live=long-poll&offset=zz"), status: 400, reason: badOffset},
		{name: "offset/long-poll-missing", req: get("live=long-poll"), status: 400, reason: badOffset},
		{name: "offset/sse-missing", req: get("live=sse"), status: 400, reason: badOffset},
		{name: "offset/twice", req: get("offset=-1&offset=now"), status: 400, reason: []string{"more than once"}},
		{name: "live/twice", req: get("offset=-1&live=long-poll&live=sse"), status: 400, reason: []string{"more than once"}},

		{name: "ttl/plus", req: put("/bi/new-ttl", "Stream-TTL", "+3600"), status: 400, reason: badTTL, absent: "/bi/new-ttl"},
		{name: "ttl/leading-zero", req: put("/bi/new-ttl", "Stream-TTL", "03600"), status: 400, reason: badTTL, absent: "/bi/new-ttl"},
		{name: "ttl/exponent", req: put("/bi/new-ttl", "Stream-TTL", "3.6e3"), status: 400, reason: badTTL, absent: "/bi/new-ttl"},
		{name: "ttl/decimal", req: put("/bi/new-ttl", "Stream-TTL", "3600.0"), status: 400, reason: badTTL, absent: "/bi/new-ttl"},
		{name: "ttl/negative", req: put("/bi/new-ttl", "Stream-TTL", "-1"), status: 400, reason: badTTL, absent: "/bi/new-ttl"},
		{name: "ttl/letters", req: put("/bi/new-ttl", "Stream-TTL", "abc"), status: 400, reason: badTTL, absent: "/bi/new-ttl"},
		{name: "expires/words", req: put("/bi/new-exp", "Stream-Expires-At", "tomorrow"), status: 400, reason: badAt, absent: "/bi/new-exp"},
		{name: "expires/month-13", req: put("/bi/new-exp", "Stream-Expires-At", "2030-13-01T00:00:00Z"), status: 400, reason: badAt, absent: "/bi/new-exp"},
		{name: "expires/unix-seconds", req: put("/bi/new-exp", "Stream-Expires-At", "1900000000"), status: 400, reason: badAt, absent: "/bi/new-exp"},
		// Go's parser takes these; RFC 3339 section 5.6 does not.
		{name: "expires/offset-24h", req: put("/bi/new-exp", "Stream-Expires-At", "2030-01-01T00:00:00+24:00"), status: 400, reason: badAt, absent: "/bi/new-exp"},
		{name: "expires/comma-fraction", req: put("/bi/new-exp", "Stream-Expires-At", "2030-01-01T00:00:00,5Z"), status: 400, reason: badAt, absent: "/bi/new-exp"},
		{name: "expires/no-zone", req: put("/bi/new-exp", "Stream-Expires-At", "2030-01-01T00:00:00"), status: 400, reason: badAt, absent: "/bi/new-exp"},
		// A stream that would be expired as soon as it is written.
		{name: "expires/past", req: put("/bi/new-exp", "Stream-Expires-At", "2001-01-01T00:00:00Z"), status: 400, reason: []string{"future"}, absent: "/bi/new-exp"},
		{
			name:   "ttl-and-expires",
			req:    put("/bi/new-both", "Stream-TTL", "60", "Stream-Expires-At", time.Now().Add(time.Hour).UTC().Format(time.RFC3339)),
			status: 400, reason: append(badTTL, badAt...), absent: "/bi/new-both",
		},

		{name: "content-type/mismatch", req: post(jsonPath, []byte("x"), "Content-Type", "text/plain"), status: 409, reason: badCT},
		{
			name:   "content-type/mismatch-on-create",
			req:    fhReq{Method: http.MethodPut, Path: jsonPath, Header: hdr("Content-Type", "text/plain")},
			status: 409, reason: append(badCT, "configuration", "exists"),
		},
		{name: "content-type/missing", req: post(textPath, []byte("x")), status: 400, reason: badCT},
		// Section 5.2: closure, then a content-type mismatch, come before
		// the body's own validity.
		{name: "content-type/mismatch-not-json", req: post(textPath, []byte(`{"k":`), "Content-Type", "application/json"), status: 409, reason: badCT},
		{name: "content-type/mismatch-empty-array", req: post(textPath, []byte(`[]`), "Content-Type", "application/json"), status: 409, reason: badCT},
		{name: "closed/empty-array", req: post(closedPath, []byte(`[]`), "Content-Type", "application/json"), status: 409, reason: []string{"closed"}},
		{name: "closed/not-json", req: post(closedPath, []byte(`{"k":`), "Content-Type", "application/json"), status: 409, reason: []string{"closed"}},
		{name: "post/empty-without-close", req: post(textPath, nil, "Content-Type", "text/plain"), status: 400, reason: []string{"empty", "body"}},
		{name: "post/over-max-append-size", req: post(textPath, tooBig, "Content-Type", "text/plain"), status: 413, reason: tooLarge},
		// A gzip-encoded body is not the bytes the client means to append.
		{name: "post/content-encoding", req: post(textPath, gzipped, "Content-Type", "text/plain", "Content-Encoding", "gzip"), status: 415, reason: []string{"content-encoding", "coding"}},
		{
			name:   "create-with-body/content-encoding",
			req:    fhReq{Method: http.MethodPut, Path: "/bi/encoded", Header: hdr("Content-Type", "text/plain", "Content-Encoding", "gzip"), Body: gzipped},
			status: 415, reason: []string{"content-encoding", "coding"}, absent: "/bi/encoded",
		},
		{
			name:   "post/over-max-append-size-chunked",
			req:    fhReq{Method: http.MethodPost, Path: textPath, Header: hdr("Content-Type", "text/plain"), Body: tooBig, Chunked: true},
			status: 413, reason: tooLarge,
		},
		{
			name:   "put/initial-body-over-max",
			req:    fhReq{Method: http.MethodPut, Path: "/bi/new-big", Header: hdr("Content-Type", "text/plain"), Body: tooBig},
			status: 413, reason: tooLarge, absent: "/bi/new-big",
		},

		{name: "name/dot-dot", req: put("/bi/../escape"), status: 400, reason: badName},
		{name: "name/dot-dot-escaped", req: put("/bi/%2E%2E/escape"), status: 400, reason: badName},
		{name: "name/dot-dot-last", req: put("/bi/x/.."), status: 400, reason: badName},
		{name: "name/nul", req: put("/bi/a%00b"), status: 400, reason: badName},
		{name: "name/empty-segment", req: put("/bi//x"), status: 400, reason: badName},
		{name: "name/257-bytes", req: put(maxName + "m"), status: 400, reason: badName},
		{name: "name/257-bytes-append", req: post(maxName+"m", []byte("x"), "Content-Type", "text/plain"), status: 400, reason: badName},

		{name: "json/invalid", req: post(jsonPath, []byte(`{"k":`), "Content-Type", "application/json"), status: 400, reason: badJSON},
		{name: "json/trailing-garbage", req: post(jsonPath, []byte(`{"k":1} x`), "Content-Type", "application/json"), status: 400, reason: badJSON},
		{name: "json/empty-array", req: post(jsonPath, []byte(`[]`), "Content-Type", "application/json"), status: 400, reason: []string{"empty", "array"}},
		// JSON is UTF-8 (RFC 8259 section 8.1).
		{name: "json/not-utf8", req: post(jsonPath, []byte("{\"k\":\"\xff\xfe\"}"), "Content-Type", "application/json"), status: 400, reason: []string{"utf-8"}},
		{
			name:   "json/not-utf8-initial-body",
			req:    fhReq{Method: http.MethodPut, Path: "/bi/new-json-utf8", Header: hdr("Content-Type", "application/json"), Body: []byte("[\"\xc3\x28\"]")},
			status: 400, reason: []string{"utf-8"}, absent: "/bi/new-json-utf8",
		},
		{
			name:   "json/invalid-initial-body",
			req:    fhReq{Method: http.MethodPut, Path: "/bi/new-json", Header: hdr("Content-Type", "application/json"), Body: []byte(`[1,`)},
			status: 400, reason: badJSON, absent: "/bi/new-json",
		},

		// Section 5.2: a Stream-Seq sent must sort after the last one, and
		// an empty one sorts before every other.
		{name: "stream-seq/empty", req: post(textPath, []byte("x"), "Content-Type", "text/plain", "Stream-Seq", ""), status: 400, reason: []string{"stream-seq"}},
		{name: "producer/partial", req: post(textPath, []byte("x"), "Content-Type", "text/plain", "Producer-Id", "p1"), status: 400, reason: []string{"producer"}},

		// A header of one value sent twice with two means two things.
		{
			name: "repeated/ttl",
			req: fhReq{Method: http.MethodPut, Path: "/bi/new-ttl", Header: hdr("Content-Type", "text/plain", "Stream-TTL", "100"),
				More: [][2]string{{"Stream-TTL", "200"}}},
			status: 400, reason: []string{"stream-ttl", "more than once"}, absent: "/bi/new-ttl",
		},
		{
			name: "repeated/producer-id",
			req: fhReq{Method: http.MethodPost, Path: textPath, Body: []byte("x"),
				Header: hdr("Content-Type", "text/plain", "Producer-Id", "p", "Producer-Epoch", "0", "Producer-Seq", "0"),
				More:   [][2]string{{"Producer-Id", "q"}}},
			status: 400, reason: []string{"producer-id", "more than once"},
		},
		{
			name:   "repeated/content-type",
			req:    fhReq{Method: http.MethodPost, Path: textPath, Body: []byte("x"), Header: hdr("Content-Type", "text/plain"), More: [][2]string{{"Content-Type", "application/json"}}},
			status: 400, reason: []string{"content-type", "more than once"},
		},
		{
			name:   "producer/bad-epoch",
			req:    post(textPath, []byte("x"), "Content-Type", "text/plain", "Producer-Id", "p1", "Producer-Epoch", "x", "Producer-Seq", "0"),
			status: 400, reason: []string{"producer-epoch", "epoch"},
		},
	}

	// Let the set-up's writes and the start-up's settle.
	time.Sleep(500 * time.Millisecond)
	t.Logf("set-up took %s", time.Since(began).Round(time.Millisecond))
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			resp, writes := fhExpectNoWrites(t, e, tc.req)
			t.Logf("%s %s → %s", tc.req.Method, fhClip(tc.req.Path, 40), resp)
			if resp.Status != tc.status {
				t.Errorf("%s %s: %s, want %d", tc.req.Method, tc.req.Path, resp, tc.status)
			}
			if !fhContainsAny(string(resp.Body), tc.reason...) {
				t.Errorf("%s %s: %d body %q does not say why (want it to mention one of %q)",
					tc.req.Method, tc.req.Path, resp.Status, fhClip(string(resp.Body), 300), tc.reason)
			}
			if len(writes) > 0 {
				t.Errorf("%s %s (%d) wrote to the object store:%s", tc.req.Method, tc.req.Path, resp.Status, fhSortedKeys(writes))
			}
			if tc.absent != "" {
				if h := e.must(fhReq{Method: http.MethodHead, Path: tc.absent}); h.Status != http.StatusNotFound {
					t.Errorf("HEAD %s after the refused create: %d, want 404", tc.absent, h.Status)
				}
			}
		})
	}

	// The streams the requests aimed at are unchanged.
	for _, s := range []struct {
		path       string
		body, tail string
	}{{jsonPath, string(jsonBefore), jsonTail}, {textPath, string(textBefore), textTail}, {closedPath, "[1]", "0000000000000001_0000000000000000"}} {
		got, tail, err := e.readBytes(s.path)
		if err != nil {
			t.Error(err)
			continue
		}
		if string(got) != s.body || tail != s.tail {
			t.Errorf("%s changed: %q (tail %s), was %q (tail %s)", s.path, got, tail, s.body, s.tail)
		}
	}
}

// fhExpectNoWrites sends r and returns its answer and the object-store
// writes seen meanwhile (and shortly after, for anything the request set
// off asynchronously). A window that background work wrote in is not
// conclusive, and the request is sent again, up to three times: a
// compaction pass or the collector's, told by writes no request makes
// (fhBackgroundWrite) in the window, or just after it when the window saw
// only what such a pass writes first (a compaction writes its checkpoints
// before its manifest, the collector a grave's index before it deletes
// the tombstone).
func fhExpectNoWrites(t *testing.T, e *fhEnv, r fhReq) (fhResp, map[string]int) {
	t.Helper()
	var resp fhResp
	var writes map[string]int
	for attempt := 0; attempt < 3; attempt++ {
		before := e.proxy.Counts()
		resp = e.must(r)
		// Twenty flush intervals: an append wrongly let through would
		// be uploaded by then.
		time.Sleep(200 * time.Millisecond)
		after := e.proxy.Counts()
		writes = fhWrites(before, after)
		if len(writes) == 0 {
			return resp, writes
		}
		background := fhBackgroundWrites(writes)
		if len(background) == 0 && fhPassBegun(writes) {
			// Only writes a pass makes before its signature (a
			// checkpoint, a grave's index): a pass under way when the
			// window ended shows its signature in a moment.
			time.Sleep(fhPassSettle)
			background = fhBackgroundWrites(fhWrites(after, e.proxy.Counts()))
		}
		if len(background) == 0 {
			return resp, writes
		}
		t.Logf("background work wrote during the request (%s); sending it again:%s", fhSortedKeys(background), fhSortedKeys(writes))
	}
	return resp, writes
}

// fhPassSettle is how long after a window fhExpectNoWrites looks for the
// end of a background pass that the window caught begun.
const fhPassSettle = time.Second

// fhPassBegun reports whether writes could all be the start of a background
// pass whose signature comes after them: a compaction's checkpoints (stream
// metadata PUTs), the collector's grave index. Any other write is a
// request's.
func fhPassBegun(writes map[string]int) bool {
	for w := range writes {
		op, key, _ := strings.Cut(w, " ")
		key = strings.TrimPrefix(key, fhPrefix)
		if op != testenv.OpPut || !(strings.HasPrefix(key, "streams/") || strings.HasPrefix(key, "graves/")) {
			return false
		}
	}
	return true
}

// fhBackgroundWrites returns the writes (as fhWrites gives them) that only
// the engine's background work makes.
func fhBackgroundWrites(writes map[string]int) map[string]int {
	out := map[string]int{}
	for w, n := range writes {
		if fhBackgroundWrite(w) {
			out[w] = n
		}
	}
	return out
}

// fhBackgroundWrite reports whether a write ("OP key", as fhWrites names
// them) is one that no request makes itself, only compaction (data
// objects and packs written, the manifest moved on, WAL objects retired,
// trimmed data deleted) or the collector (a deleted stream's data
// removed, its tombstone done with). The collector's index of a grave is
// not one: a request that deletes a subscription writes it too; the
// tombstone's DELETE follows it at once.
func fhBackgroundWrite(w string) bool {
	op, key, _ := strings.Cut(w, " ")
	key = strings.TrimPrefix(key, fhPrefix)
	switch op {
	case testenv.OpPut:
		return key == "manifest" || strings.HasPrefix(key, "data/") || strings.HasPrefix(key, "pack/")
	case testenv.OpDelete:
		return strings.HasPrefix(key, "wal/") || strings.HasPrefix(key, "data/") || strings.HasPrefix(key, "pack/") ||
			strings.HasPrefix(key, "gc/")
	}
	return false
}
