package integration

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/picowire"
	"github.com/picomq/caddy-picomq/streamstore"
)

// TestSubscriptionPatternCannotSpin: a subscription pattern of many "**"
// segments that fails at its end is matched against a stream of many
// segments at the subscription's create (backfill) and at every append
// under its root. A backtracking match took exponential time there: the
// create never answered and its goroutine spun a core for good. Both must
// answer at once, and a pattern longer than any stream name is refused
// without a write.
func TestSubscriptionPatternCannotSpin(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	// A hang shows as this client's timeout, not as the test's.
	e := fhStart(t, fhOptions{Client: &http.Client{Timeout: 30 * time.Second}})
	deep := "/g/" + strings.TrimSuffix(strings.Repeat("a/", 60), "/")
	e.create(deep, textPlain)
	e.create("/g/wake", textPlain)

	jsonHdr := map[string]string{"Content-Type": "application/json"}
	spin := strings.Repeat("**/", 25) + "zz"
	r, err := e.send(fhReq{Method: http.MethodPut, Path: "/g/__ds/subscriptions/spin", Header: jsonHdr,
		Body: []byte(`{"type":"pull-wake","pattern":"` + spin + `","wake_stream":"wake"}`)})
	if err != nil {
		t.Fatalf("PUT a subscription with pattern %q: %v (after %s)", spin, err, r.Took.Round(time.Millisecond))
	}
	if r.Status != http.StatusCreated {
		t.Fatalf("PUT a subscription with pattern %q: %s, want 201", spin, r)
	}
	// The append is matched against the pattern too.
	if _, err := e.send(fhReq{Method: http.MethodPost, Path: deep, Header: map[string]string{"Content-Type": textPlain}, Body: []byte("x")}); err != nil {
		t.Fatalf("append to %s under the subscription: %v", fhClip(deep, 20), err)
	}

	long := strings.Repeat("p", 300)
	r, writes := fhExpectNoWrites(t, e, fhReq{Method: http.MethodPut, Path: "/g/__ds/subscriptions/long", Header: jsonHdr,
		Body: []byte(`{"type":"pull-wake","pattern":"` + long + `","wake_stream":"wake"}`)})
	if r.Status != http.StatusBadRequest || !fhContainsAny(string(r.Body), "pattern") {
		t.Errorf("PUT a subscription with a %d-byte pattern: %s, want 400 naming the pattern", len(long), r)
	}
	if len(writes) > 0 {
		t.Errorf("the refused subscription wrote to the object store:%s", fhSortedKeys(writes))
	}
}

// TestNamesThatAreNotUTF8: a stream name with bytes that are not UTF-8 is
// refused by both protocols without a write. Such a name used to be
// created, and came back in a Pico listing as U+FFFD: a name no request can
// reach, and a page that ended on it was followed by itself for good,
// since the U+FFFD form sorts before the real bytes.
func TestNamesThatAreNotUTF8(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, nil, nil)
	picoWant(t, "PUT /pico/u/ok", picoDo(e, http.MethodPut, "/pico/u/ok", nil, "Content-Type", textPlain), http.StatusCreated)
	for _, path := range []string{"/pico/u/a%FFb", "/pico/u/a%FEb", "/ds/u/a%C3%28", "/ds/u/%ED%A0%80"} {
		for _, method := range []string{http.MethodPut, http.MethodPost} {
			req := fhReq{Method: method, Path: path, Header: map[string]string{"Content-Type": textPlain}}
			if method == http.MethodPost {
				req.Body = []byte("x")
			}
			r, writes := fhExpectNoWrites(t, e, req)
			if r.Status != http.StatusBadRequest || !fhContainsAny(string(r.Body), "utf-8") {
				t.Errorf("%s %s: %s, want 400 saying the name is not UTF-8", method, path, r)
			}
			if len(writes) > 0 {
				t.Errorf("%s %s (%d) wrote to the object store:%s", method, path, r.Status, fhSortedKeys(writes))
			}
		}
	}
	// A client paging through the listing one name at a time gets to
	// its end.
	after, names := "", []string{}
	for page := 0; ; page++ {
		if page > 10 {
			t.Fatalf("the listing of /u did not end after %d pages: %q", page, names)
		}
		r := picoDo(e, http.MethodGet, "/pico/?prefix=/u/&limit=1&start_after="+url.QueryEscape(after), nil)
		var out struct {
			Streams []struct {
				Name string `json:"name"`
			} `json:"streams"`
			HasMore bool `json:"has_more"`
		}
		if err := json.Unmarshal(r.Body, &out); err != nil || r.Status != http.StatusOK {
			t.Fatalf("listing after %q: %s (%v)", after, r, err)
		}
		for _, s := range out.Streams {
			names = append(names, s.Name)
			after = s.Name
		}
		if !out.HasMore {
			break
		}
	}
	if len(names) != 1 || names[0] != "/u/ok" {
		t.Errorf("listing of /u/: %q, want only /u/ok", names)
	}
}

// TestAppendRecordLimit: an append of more records than picowire.MaxRecords
// is 413 and writes nothing, in a Durable Streams JSON array (append and
// create) and in both Pico batch formats. Records of no bytes cost the
// engine a few hundred bytes each: a 16 MiB JSON array of 8 million took
// Caddy from 60 MiB to 2 GiB, and a dozen at once would have ended it.
func TestAppendRecordLimit(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, nil, nil)
	e.create("/ds/rl/json", "application/json")
	picoWant(t, "PUT /pico/rl/bin", picoDo(e, http.MethodPut, "/pico/rl/bin", nil, "Content-Type", "application/octet-stream"), http.StatusCreated)

	const over = picowire.MaxRecords + 1
	array := []byte("[" + strings.TrimSuffix(strings.Repeat("1,", over), ",") + "]")
	jsonBatch := []byte(`{"records":[` + strings.TrimSuffix(strings.Repeat(`{"body":""}`+",", over), ",") + "]}")
	cases := []struct {
		name   string
		req    fhReq
		absent string
	}{
		{name: "ds/append-array", req: fhReq{Method: http.MethodPost, Path: "/ds/rl/json", Body: array,
			Header: map[string]string{"Content-Type": "application/json"}}},
		{name: "ds/create-array", req: fhReq{Method: http.MethodPut, Path: "/ds/rl/new", Body: array,
			Header: map[string]string{"Content-Type": "application/json"}}, absent: "/ds/rl/new"},
		{name: "pico/binary-batch", req: fhReq{Method: http.MethodPost, Path: "/pico/rl/bin",
			Body: picowire.EncodeBinary(make([]picowire.Record, over)), Header: map[string]string{"Content-Type": picoBinaryBatch}}},
		{name: "pico/json-batch", req: fhReq{Method: http.MethodPost, Path: "/pico/rl/bin", Body: jsonBatch,
			Header: map[string]string{"Content-Type": picoJSONBatch}}},
		{name: "pico/create-batch", req: fhReq{Method: http.MethodPut, Path: "/pico/rl/new2", Body: jsonBatch,
			Header: map[string]string{"Content-Type": picoJSONBatch}}, absent: "/pico/rl/new2"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r, writes := fhExpectNoWrites(t, e, tc.req)
			if r.Status != http.StatusRequestEntityTooLarge || !fhContainsAny(string(r.Body), "records") {
				t.Errorf("%s %s with %d records: %s, want 413 naming the record limit", tc.req.Method, tc.req.Path, over, r)
			}
			if len(writes) > 0 {
				t.Errorf("%s %s (%d) wrote to the object store:%s", tc.req.Method, tc.req.Path, r.Status, fhSortedKeys(writes))
			}
			if tc.absent != "" {
				if h := e.must(fhReq{Method: http.MethodHead, Path: tc.absent}); h.Status != http.StatusNotFound {
					t.Errorf("HEAD %s after the refused create: %d, want 404", tc.absent, h.Status)
				}
			}
		})
	}
	// At the limit, the append is taken.
	at := []byte("[" + strings.TrimSuffix(strings.Repeat("1,", picowire.MaxRecords), ",") + "]")
	if r := e.must(fhReq{Method: http.MethodPost, Path: "/ds/rl/json", Body: at,
		Header: map[string]string{"Content-Type": "application/json"}}); r.Status != http.StatusNoContent {
		t.Errorf("an append of %d records: %s, want 204", picowire.MaxRecords, r)
	}
}

// TestAnnouncedBodyIsNotReserved: clients that announce a body of
// max_append_size and send a kilobyte of it hold no more than what they
// sent. The body buffer used to be allocated at its Content-Length before
// any of it arrived: 300 such connections, 300 KiB sent in all, took Caddy
// to 900 MiB. The Go heap of Caddy (its admin /metrics) is watched while
// the connections wait; with nothing to wait for when all is well, the
// window is a bounded look, not a deadline.
func TestAnnouncedBodyIsNotReserved(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"max_append_size 16MiB"}})
	e.create("/ab/s", textPlain)
	heap := func() float64 { return e.heapAlloc(false) }
	base := heap()

	const conns, announced = 50, 16 << 20
	addr := strings.TrimPrefix(e.caddy.URL(), "http://")
	for i := 0; i < conns; i++ {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		head := fmt.Sprintf("POST /ab/s HTTP/1.1\r\nHost: %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n", addr, announced)
		if _, err := io.WriteString(c, head+strings.Repeat("x", 1000)); err != nil {
			t.Fatal(err)
		}
	}
	// Half of what reserving every announced body would take.
	limit := base + conns*announced/2
	peak := base
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if h := heap(); h > peak {
			peak = h
		}
		if peak > limit {
			break
		}
	}
	t.Logf("Go heap: %.0f MiB before, at most %.0f MiB with %d connections that announced %d MiB and sent 1000 bytes",
		base/(1<<20), peak/(1<<20), conns, announced>>20)
	if peak > limit {
		t.Errorf("the Go heap grew by %.0f MiB for %d KiB sent: the announced bodies were reserved", (peak-base)/(1<<20), conns*1000>>10)
	}
}

// TestHostilePathsStayInTheDirectory: on the embedded file:// storage,
// requests whose paths try to climb out of the storage directory, or to
// land on the engine's own files (lease, manifest, WAL, subscription
// documents), are refused or stored as ordinary streams under their hex
// keys: nothing is written outside the directory, nothing at the top of
// it but the engine's own entries, and the lease still works.
func TestHostilePathsStayInTheDirectory(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy")
	}
	dir := t.TempDir()
	store := filepath.Join(dir, "store")
	sentinel := filepath.Join(dir, "outside")
	if err := os.WriteFile(sentinel, []byte("untouched"), 0o644); err != nil {
		t.Fatal(err)
	}
	c := caddytest.Start(t, caddytest.Options{Storage: "file://" + store})
	client := &http.Client{Timeout: time.Minute}
	paths := []string{
		"/../outside", "/%2e%2e/outside", "/%2E%2E%2Foutside", "/a/%2e%2e/%2e%2e/outside", "/..%2Foutside",
		"/a/..%5C..%5Coutside", "/..\\outside", "/%2e%2e%5coutside", "/./lease", "/lease", "/manifest", "/format",
		"/wal/0000000000000000/0000000000000000", "/streams/2f61.m", "/subs/key", "/.picomq-tmp/x", "/.picomq-locks/00", "/" + strings.Repeat("%2e", 200),
		"/" + strings.Repeat("z", 255), "/a%2F..%2F..%2Foutside", "/x/__ds/subscriptions/..%2F..%2Foutside",
		"/%2e%2e/__ds/subscriptions/s", "/x/__ds/subscriptions/" + strings.Repeat("i", 120),
	}
	for _, p := range paths {
		for _, m := range []string{http.MethodPut, http.MethodPost, http.MethodGet, http.MethodDelete} {
			req := fhReq{Method: m, Path: p, Header: map[string]string{"Content-Type": textPlain}}
			if m == http.MethodPost {
				req.Body = []byte("x")
			}
			if strings.Contains(p, "__ds") && m == http.MethodPut {
				req.Header["Content-Type"] = "application/json"
				req.Body = []byte(`{"type":"pull-wake","pattern":"*","wake_stream":"w"}`)
			}
			r, err := fhSend(client, c.URL(), req)
			if err != nil {
				t.Fatalf("%s %s: %v", m, fhClip(p, 60), err)
			}
			if r.Status >= 500 {
				t.Errorf("%s %s: %s", m, fhClip(p, 60), r)
			}
		}
	}
	if b, err := os.ReadFile(sentinel); err != nil || string(b) != "untouched" {
		t.Errorf("the file beside the storage directory: %q, %v", b, err)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.Name() != "store" && e.Name() != "outside" {
			t.Errorf("%s appeared beside the storage directory", e.Name())
		}
	}
	own := map[string]bool{"format": true, "lease": true, "manifest": true, "streams": true, "wal": true, "subs": true,
		"graves": true, "gc": true, "data": true, ".picomq-tmp": true, ".picomq-locks": true, "expiry": true, "pack": true, "blob": true}
	entries, err = os.ReadDir(store)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if !own[e.Name()] {
			t.Errorf("%s appeared at the top of the storage directory", e.Name())
		}
	}
	// The engine's own files were not written over: it still holds its
	// lease and serves a new stream.
	r, err := fhSend(client, c.URL(), fhReq{Method: http.MethodPut, Path: "/after", Header: map[string]string{"Content-Type": textPlain}})
	if err != nil || r.Status != http.StatusCreated {
		t.Errorf("PUT /after: %s %v", r, err)
	}
}

// TestKeptHeadersAreBounded: the producer id and Stream-Seq of an append
// are kept in its stream's writer state for as long as the stream lives,
// so each is bounded (streamstore.MaxProducerIDLength, MaxStreamSeqLength):
// one byte more is 400 and writes nothing, in both protocols. Without the
// bound each append could add as much as Caddy's header limit allows
// (about 16 KiB here) to state that is never dropped.
func TestKeptHeadersAreBounded(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, nil, nil)
	e.create("/ds/kh", textPlain)
	long := strings.Repeat("p", streamstore.MaxProducerIDLength+1)
	longSeq := strings.Repeat("s", streamstore.MaxStreamSeqLength+1)
	for _, req := range []fhReq{
		{Method: http.MethodPost, Path: "/ds/kh", Body: []byte("x"), Header: map[string]string{"Content-Type": textPlain,
			"Producer-Id": long, "Producer-Epoch": "0", "Producer-Seq": "0"}},
		{Method: http.MethodPost, Path: "/ds/kh", Body: []byte("x"), Header: map[string]string{"Content-Type": textPlain,
			"Stream-Seq": longSeq}},
		{Method: http.MethodPost, Path: "/pico/kh", Body: []byte("x"), Header: map[string]string{"Content-Type": textPlain,
			"Pico-Producer-Id": long, "Pico-Producer-Epoch": "0", "Pico-Producer-Seq": "0"}},
	} {
		r, writes := fhExpectNoWrites(t, e, req)
		if r.Status != http.StatusBadRequest || !fhContainsAny(string(r.Body), "limit") {
			t.Errorf("POST %s with headers of %d bytes: %s, want 400 naming the limit", req.Path, len(long), r)
		}
		if len(writes) > 0 {
			t.Errorf("POST %s (%d) wrote to the object store:%s", req.Path, r.Status, fhSortedKeys(writes))
		}
	}
	// At the limits, the append is taken.
	r := e.must(fhReq{Method: http.MethodPost, Path: "/ds/kh", Body: []byte("x"), Header: map[string]string{"Content-Type": textPlain,
		"Producer-Id": long[1:], "Producer-Epoch": "0", "Producer-Seq": "0", "Stream-Seq": longSeq[1:]}})
	if r.Status != http.StatusOK {
		t.Errorf("an append with a producer id and Stream-Seq at the limits: %s, want 200", r)
	}
}

// TestSubscriptionStreamsAreBounded: a subscription holds at most 1,000
// explicit streams. A create naming more is 400 before any of them is
// looked up, and writes nothing; each used to cost a lookup in the bucket
// (90,000 fit in one body) and a line in a document written again at every
// claim and ack.
func TestSubscriptionStreamsAreBounded(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	names := make([]string, 1001)
	for i := range names {
		names[i] = strconv.Quote("s/" + strconv.Itoa(i))
	}
	body := `{"type":"pull-wake","wake_stream":"w","streams":[` + strings.Join(names, ",") + `]}`
	req := fhReq{Method: http.MethodPut, Path: "/sb/__ds/subscriptions/many", Body: []byte(body),
		Header: map[string]string{"Content-Type": "application/json"}}
	// The manager's first start reads its key and documents: not this
	// request's.
	e.must(fhReq{Method: http.MethodGet, Path: "/sb/__ds/jwks.json"})
	before := e.proxy.Counts()
	r, writes := fhExpectNoWrites(t, e, req)
	reads := fhReadPathRequests(e.proxy.Counts()) - fhReadPathRequests(before)
	if r.Status != http.StatusBadRequest || !fhContainsAny(string(r.Body), "at most") {
		t.Errorf("PUT a subscription of %d streams: %s, want 400 naming the limit", len(names), r)
	}
	if len(writes) > 0 {
		t.Errorf("the refused subscription wrote to the object store:%s", fhSortedKeys(writes))
	}
	if reads > 10 {
		t.Errorf("the refused subscription read %d metadata objects", reads)
	}
}

// TestStreamTypeIsBounded: the content type a stream is created with is
// kept in its metadata for as long as it lives, held with it in memory,
// and sent with every read, HEAD and listing entry, so it is bounded
// (streamstore.MaxContentTypeLength): one byte more is 400 and writes
// nothing, in both protocols and for a fork. Without the bound a create
// kept as much as Caddy's header limit lets a client send (about 16 KiB
// by default, more where a site raises max_header_size), and a Pico
// listing page of a thousand such streams was 16 MiB.
func TestStreamTypeIsBounded(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, nil, nil)
	e.create("/ds/ctb/src", textPlain)
	typeOf := func(n int) string { return "text/" + strings.Repeat("x", n-len("text/")) }
	long := typeOf(streamstore.MaxContentTypeLength + 1)
	for _, req := range []fhReq{
		{Method: http.MethodPut, Path: "/ds/ctb/new", Header: map[string]string{"Content-Type": long}},
		{Method: http.MethodPut, Path: "/ds/ctb/body", Body: []byte("x"), Header: map[string]string{"Content-Type": long}},
		{Method: http.MethodPut, Path: "/ds/ctb/fork", Header: map[string]string{"Content-Type": long, "Stream-Forked-From": "/ds/ctb/src"}},
		{Method: http.MethodPut, Path: "/pico/ctb/pico", Header: map[string]string{"Content-Type": long}},
		{Method: http.MethodPut, Path: "/pico/ctb/huge", Header: map[string]string{"Content-Type": typeOf(12 << 10)}},
	} {
		r, writes := fhExpectNoWrites(t, e, req)
		if r.Status != http.StatusBadRequest || !fhContainsAny(string(r.Body), "limit") {
			t.Errorf("PUT %s with a %d-byte Content-Type: %s, want 400 naming the limit", req.Path, len(req.Header["Content-Type"]), r)
		}
		if len(writes) > 0 {
			t.Errorf("PUT %s (%d) wrote to the object store:%s", req.Path, r.Status, fhSortedKeys(writes))
		}
		if h := e.must(fhReq{Method: http.MethodHead, Path: req.Path}); h.Status != http.StatusNotFound {
			t.Errorf("HEAD %s after the refused create: %d, want 404", req.Path, h.Status)
		}
	}
	// At the limit, the create is taken, and an append in a type that long
	// is compared with the stream's as any other.
	at := typeOf(streamstore.MaxContentTypeLength)
	for _, p := range []string{"/ds/ctb/at", "/pico/ctb/at2"} {
		if r := e.must(fhReq{Method: http.MethodPut, Path: p, Header: map[string]string{"Content-Type": at}}); r.Status != http.StatusCreated {
			t.Errorf("PUT %s with a %d-byte Content-Type: %s, want 201", p, len(at), r)
		}
	}
	if r := e.must(fhReq{Method: http.MethodPost, Path: "/ds/ctb/at", Body: []byte("x"), Header: map[string]string{"Content-Type": at}}); r.Status != http.StatusNoContent {
		t.Errorf("an append in the stream's %d-byte type: %s, want 204", len(at), r)
	}
}

// TestLongCursorsAreRefused: a read's cursor is at most 64 bytes, 400
// naming the limit otherwise, in both protocols and every read mode. A
// client's cursor ahead of the clock is answered with a larger one, which
// past a uint64 is big-number arithmetic, quadratic in the digits: a
// cursor as long as Caddy's default header limit allows cost 3 ms of CPU
// per request (an append costs a few dozen microseconds), one of a
// megabyte, where a site raises max_header_size, 2 to 3 s; and every
// answer (each SSE control event too) carried the digits back. At the
// limit, the answer's cursor is still larger than the client's.
func TestLongCursorsAreRefused(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, nil, nil)
	e.create("/ds/cur/s", textPlain)
	e.append("/ds/cur/s", textPlain, []byte("x"))
	long := strings.Repeat("9", 65)
	for _, q := range []string{
		"/ds/cur/s?offset=-1&live=long-poll&cursor=",
		"/ds/cur/s?offset=-1&live=sse&cursor=",
		"/ds/cur/s?offset=-1&cursor=",
		"/pico/cur/s?live=long-poll&cursor=",
		"/pico/cur/s?live=sse&cursor=",
		"/pico/cur/s?cursor=",
	} {
		for _, c := range []string{long, strings.Repeat("9", 12<<10)} {
			r := e.must(fhReq{Method: http.MethodGet, Path: q + c})
			if r.Status != http.StatusBadRequest || !fhContainsAny(string(r.Body), "limit") {
				t.Errorf("GET %s<%d digits>: %s, want 400 naming the limit", q, len(c), fhClip(r.String(), 200))
			}
		}
	}
	at := strings.Repeat("9", 64)
	for _, tc := range []struct{ path, header string }{
		{"/ds/cur/s?offset=-1&live=long-poll&cursor=" + at, "Stream-Cursor"},
		{"/pico/cur/s?live=long-poll&cursor=" + at, "Pico-Cursor"},
		{"/pico/cur/s?cursor=" + at, "Pico-Cursor"},
	} {
		r := e.must(fhReq{Method: http.MethodGet, Path: tc.path})
		got := r.Header.Get(tc.header)
		if r.Status != http.StatusOK || len(got) != 65 || got[0] != '1' || strings.Trim(got[1:60], "0") != "" {
			t.Errorf("GET %s: %d with %s %q, want 200 with a cursor past the client's", fhClip(tc.path, 40), r.Status, tc.header, got)
		}
	}
}

// TestDeepForkReadsAreCheap: a read of a fork at the end of a chain of
// forks costs about what a read of the same records from the first
// source does. Each fork in the chain used to copy every record it
// inherited, so sixty creates made each read of the last fork allocate
// sixty times as much: hundreds of megabytes, and seconds of CPU, per
// response. Caddy's allocations (its admin /metrics) over one read of
// each are compared, not their time.
func TestDeepForkReadsAreCheap(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1h"}})
	const ct, messages, depth = "application/json", 60_000, 60
	e.create("/deep/0", ct)
	e.append("/deep/0", ct, digitMessages(messages))
	for d := 1; d <= depth; d++ {
		p := fmt.Sprintf("/deep/%d", d)
		r := e.must(fhReq{Method: http.MethodPut, Path: p, Header: map[string]string{"Stream-Forked-From": fmt.Sprintf("/deep/%d", d-1)}})
		if r.Status != http.StatusCreated {
			t.Fatalf("PUT %s forked from the one before: %s, want 201", p, r)
		}
	}
	last := fmt.Sprintf("/deep/%d", depth)
	read := func(p string) ([]byte, float64) {
		t.Helper()
		before := e.allocTotal()
		chunks, _, err := e.readFrom(p, "-1")
		after := e.allocTotal()
		if err != nil {
			t.Fatal(err)
		}
		return bytes.Join(chunks, []byte("\n")), after - before
	}
	read("/deep/0") // warm: the records in the cache, the chain in memory
	read(last)
	want, first := read("/deep/0")
	got, deep := read(last)
	t.Logf("a read of %d messages allocated %.1f MiB from the source, %.1f MiB %d forks down", messages, first/(1<<20), deep/(1<<20), depth)
	if !bytes.Equal(got, want) {
		t.Fatalf("%s read %d bytes, the source %d (equal prefix %d)", last, len(got), len(want), fhCommonPrefix(got, want))
	}
	if deep > 2*first+8<<20 {
		t.Errorf("a read %d forks down allocated %.1f MiB, against %.1f MiB for the source's", depth, deep/(1<<20), first/(1<<20))
	}
}
