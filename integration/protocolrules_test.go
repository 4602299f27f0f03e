package integration

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// protocolRule is one request and what the protocol says of its answer.
// Headers maps a name to its value; "" means absent, "*" present.
type protocolRule struct {
	what    string
	req     fhReq
	status  int
	headers map[string]string
	body    *string // nil: not checked
}

// check sends the rule's request and reports every difference.
func (p protocolRule) check(t *testing.T, e *fhEnv) fhResp {
	t.Helper()
	resp := e.must(p.req)
	if resp.Status != p.status {
		t.Errorf("%s (%s %s): %s, want %d", p.what, p.req.Method, p.req.Path, resp, p.status)
		return resp
	}
	for name, want := range p.headers {
		got, present := resp.Header.Get(name), len(resp.Header.Values(name)) > 0
		if (want == "*" && !present) || (want == "" && present) || (want != "*" && want != "" && got != want) {
			t.Errorf("%s (%s %s): %s = %q (present %v), want %q", p.what, p.req.Method, p.req.Path, name, got, present, want)
		}
	}
	if p.body != nil && string(resp.Body) != *p.body {
		t.Errorf("%s (%s %s): body %q, want %q", p.what, p.req.Method, p.req.Path, resp.Body, *p.body)
	}
	return resp
}

// TestProtocolRulesTheSuiteLeavesOpen pins down, through Caddy on
// versitygw, requirements of the Durable Streams protocol that the npm
// conformance suite does not test: the Stream-Closed value rule (section
// 4.1), closure before the other conflicts (5.2), soft-deleted streams on
// HEAD and live reads (4.2), offset=now on a closed stream in the live modes
// (8), what may be cached and what not (5.5, 10.1), malformed offsets and
// live modes (5.6), ETags that change with closure (10.1), and a create
// with If-None-Match: * (5.1, RFC 9110 section 13.1.2).
func TestProtocolRulesTheSuiteLeavesOpen(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"long_poll_timeout 300ms"}})
	const tp = "text/plain"
	const cacheable = "public, max-age=60, stale-while-revalidate=300"
	hdr := func(kv ...string) map[string]string {
		h := map[string]string{}
		for i := 0; i+1 < len(kv); i += 2 {
			h[kv[i]] = kv[i+1]
		}
		return h
	}
	e.create("/rules/open", tp)
	openTail := e.append("/rules/open", tp, []byte("abc"))
	if r := e.must(fhReq{Method: http.MethodPut, Path: "/rules/closed", Header: hdr("Content-Type", tp, "Stream-Closed", "true"), Body: []byte("x")}); r.Status != http.StatusCreated {
		t.Fatalf("create closed: %s", r)
	}
	closedTail := e.must(fhReq{Method: http.MethodHead, Path: "/rules/closed"}).Header.Get("Stream-Next-Offset")
	e.create("/rules/src", tp)
	e.append("/rules/src", tp, []byte("s"))
	if r := e.must(fhReq{Method: http.MethodPut, Path: "/rules/fork", Header: hdr("Stream-Forked-From", "/rules/src")}); r.Status != http.StatusCreated {
		t.Fatalf("fork: %s", r)
	}
	if r := e.must(fhReq{Method: http.MethodDelete, Path: "/rules/src"}); r.Status != http.StatusNoContent {
		t.Fatalf("delete the forked source: %s", r)
	}
	if r := e.must(fhReq{Method: http.MethodPut, Path: "/rules/jsonbody", Header: hdr("Content-Type", "application/json"), Body: []byte(`[1]`)}); r.Status != http.StatusCreated {
		t.Fatalf("create a JSON stream: %s", r)
	}
	jsonTail := e.must(fhReq{Method: http.MethodHead, Path: "/rules/jsonbody"}).Header.Get("Stream-Next-Offset")
	jsonFork := hdr("Stream-Forked-From", "/rules/jsonbody", "Stream-Fork-Offset", jsonTail)
	if r := e.must(fhReq{Method: http.MethodPut, Path: "/rules/jsonfork", Header: jsonFork}); r.Status != http.StatusCreated {
		t.Fatalf("fork the JSON stream: %s", r)
	}
	empty := ""
	closedControl := `event: control` + "\n" + `data:{"streamNextOffset":"` + closedTail + `","upToDate":true,"streamClosed":true}` + "\n\n"

	for _, p := range []protocolRule{
		// 4.1: only "true" (any case) counts; other values are no header.
		{"Stream-Closed: yes is absent, so an empty append is 400", fhReq{Method: "POST", Path: "/rules/open", Header: hdr("Content-Type", tp, "Stream-Closed", "yes"), Body: []byte{}}, 400, nil, nil},
		{"Stream-Closed: false is absent", fhReq{Method: "POST", Path: "/rules/open", Header: hdr("Content-Type", tp, "Stream-Closed", "false"), Body: []byte("d")}, 204, hdr("Stream-Closed", ""), nil},
		// 5.1: a repeated closed create is 200 with the create headers.
		{"repeated closed create", fhReq{Method: "PUT", Path: "/rules/closed", Header: hdr("Content-Type", tp, "Stream-Closed", "TRUE")}, 200,
			hdr("Stream-Closed", "true", "Stream-Next-Offset", closedTail, "Content-Type", tp), nil},
		// 5.1: a create of a stream that exists is judged on its
		// settings, whatever its body; where none exists, a bad body is
		// 400 and makes nothing.
		{"repeated create with a body that is not JSON", fhReq{Method: "PUT", Path: "/rules/jsonbody", Header: hdr("Content-Type", "application/json"), Body: []byte(`{`)}, 200,
			hdr("Stream-Next-Offset", jsonTail), nil},
		{"repeated create with other settings and a body that is not JSON", fhReq{Method: "PUT", Path: "/rules/jsonbody", Header: hdr("Content-Type", "application/json", "Stream-TTL", "60"), Body: []byte(`{`)}, 409, nil, nil},
		{"create with a body that is not JSON", fhReq{Method: "PUT", Path: "/rules/jsonbody-none", Header: hdr("Content-Type", "application/json"), Body: []byte(`{`)}, 400, nil, nil},
		{"which made nothing", fhReq{Method: "HEAD", Path: "/rules/jsonbody-none"}, 404, nil, nil},
		{"repeated fork create with a body that is not JSON", fhReq{Method: "PUT", Path: "/rules/jsonfork", Header: jsonFork, Body: []byte(`{`)}, 200,
			hdr("Stream-Next-Offset", jsonTail), nil},
		{"fork create with a body that is not JSON", fhReq{Method: "PUT", Path: "/rules/jsonfork-none", Header: jsonFork, Body: []byte(`{`)}, 400, nil, nil},
		{"which made no fork", fhReq{Method: "HEAD", Path: "/rules/jsonfork-none"}, 404, nil, nil},
		// 5.2: closure comes before a content-type mismatch and a Stream-Seq.
		{"closed before content-type mismatch", fhReq{Method: "POST", Path: "/rules/closed", Header: hdr("Content-Type", "application/json"), Body: []byte("1")}, 409,
			hdr("Stream-Closed", "true", "Stream-Next-Offset", closedTail), nil},
		{"closed before Stream-Seq", fhReq{Method: "POST", Path: "/rules/closed", Header: hdr("Content-Type", tp, "Stream-Seq", "a"), Body: []byte("y")}, 409,
			hdr("Stream-Closed", "true", "Stream-Next-Offset", closedTail), nil},
		// 8: offset=now on a closed stream answers at once in every mode.
		{"long-poll at now on a closed stream", fhReq{Method: "GET", Path: "/rules/closed?offset=now&live=long-poll"}, 204,
			hdr("Stream-Closed", "true", "Stream-Up-To-Date", "true", "Stream-Next-Offset", closedTail), nil},
		{"SSE at now on a closed stream", fhReq{Method: "GET", Path: "/rules/closed?offset=now&live=sse"}, 200,
			hdr("Content-Type", "text/event-stream"), &closedControl},
		{"SSE at the tail of a closed stream", fhReq{Method: "GET", Path: "/rules/closed?offset=" + closedTail + "&live=sse"}, 200,
			hdr("Content-Type", "text/event-stream"), &closedControl},
		// 4.2: a soft-deleted stream is 410 for HEAD and live reads too.
		{"HEAD of a soft-deleted stream", fhReq{Method: "HEAD", Path: "/rules/src"}, 410, nil, nil},
		{"long-poll of a soft-deleted stream", fhReq{Method: "GET", Path: "/rules/src?offset=-1&live=long-poll"}, 410, nil, nil},
		{"SSE of a soft-deleted stream", fhReq{Method: "GET", Path: "/rules/src?offset=-1&live=sse"}, 410, nil, nil},
		// 5.5, 10.1: what a cache may keep.
		{"HEAD is not cached", fhReq{Method: "HEAD", Path: "/rules/open"}, 200, hdr("Cache-Control", "no-store", "ETag", ""), &empty},
		// Nor is a GET of HEAD's URL: caches that fetch a HEAD as a GET
		// (nginx, Varnish) would answer HEADs with the chunk's headers.
		{"a GET of the bare URL is not cached", fhReq{Method: "GET", Path: "/rules/open"}, 200, hdr("Cache-Control", "no-store", "ETag", "*"), nil},
		{"nor one without an offset", fhReq{Method: "GET", Path: "/rules/open?tenant=acme"}, 200, hdr("Cache-Control", "no-store", "ETag", "*"), nil},
		// A feed at now collapsed by a cache would give later readers
		// records from before they asked.
		{"SSE at now is not cached", fhReq{Method: "GET", Path: "/rules/closed?offset=now&live=sse"}, 200,
			hdr("Cache-Control", "no-store"), &closedControl},
		{"catch-up data is cacheable", fhReq{Method: "GET", Path: "/rules/open?offset=-1"}, 200, hdr("Cache-Control", cacheable, "ETag", "*"), nil},
		{"the EOF of a closed stream is cacheable", fhReq{Method: "GET", Path: "/rules/closed?offset=" + closedTail}, 200,
			hdr("Cache-Control", cacheable, "Stream-Closed", "true", "Stream-Up-To-Date", "true"), &empty},
		{"long-poll data is cacheable", fhReq{Method: "GET", Path: "/rules/open?offset=-1&live=long-poll"}, 200,
			hdr("Cache-Control", cacheable, "Stream-Cursor", "*", "ETag", "*"), nil},
		{"a long-poll 204 is not cached", fhReq{Method: "GET", Path: "/rules/fork?offset=now&live=long-poll"}, 204,
			hdr("Cache-Control", "no-store", "Stream-Cursor", "*", "Stream-Up-To-Date", "true"), nil},
		{"errors are not cached", fhReq{Method: "GET", Path: "/rules/none?offset=-1&live=long-poll"}, 404, hdr("Cache-Control", "no-store"), nil},
		// 5.1 with RFC 9110 section 13.1.2: If-None-Match: * makes a
		// create of an existing stream 412, not the 200 of a create
		// confirmed; other settings are still 409 (a failure comes
		// before preconditions, 13.2.1), and a new stream is made.
		{"PUT If-None-Match: * of an existing stream", fhReq{Method: "PUT", Path: "/rules/open", Header: hdr("Content-Type", tp, "If-None-Match", "*")}, 412,
			hdr("Location", ""), nil},
		{"PUT If-None-Match: * of an existing stream with other settings", fhReq{Method: "PUT", Path: "/rules/open", Header: hdr("Content-Type", "application/json", "If-None-Match", "*")}, 409,
			nil, nil},
		{"PUT If-None-Match: * of a new stream", fhReq{Method: "PUT", Path: "/rules/inm", Header: hdr("Content-Type", tp, "If-None-Match", "*")}, 201,
			hdr("Location", "*"), nil},
		{"PUT If-None-Match naming a tag of an existing stream", fhReq{Method: "PUT", Path: "/rules/open", Header: hdr("Content-Type", tp, "If-None-Match", `"x"`)}, 200,
			nil, nil},
		// 5.6: malformed offsets and live modes are 400.
		{"offset -2", fhReq{Method: "GET", Path: "/rules/open?offset=-2"}, 400, nil, nil},
		{"offset NOW (sentinels are case-sensitive)", fhReq{Method: "GET", Path: "/rules/open?offset=NOW"}, 400, nil, nil},
		{"offset with a path segment", fhReq{Method: "GET", Path: "/rules/open?offset=" + openTail + "%2Fx"}, 400, nil, nil},
		{"unknown live mode", fhReq{Method: "GET", Path: "/rules/open?offset=-1&live=poll"}, 400, nil, nil},
	} {
		p.check(t, e)
	}

	// 10.1: an ETag changes when the stream closes, so a client holding
	// the open tail's tag learns of the close instead of getting 304.
	e.create("/rules/etag", tp)
	tail := e.append("/rules/etag", tp, []byte("e"))
	atTail := "/rules/etag?offset=" + tail
	open := protocolRule{"open tail", fhReq{Method: "GET", Path: atTail}, 200, hdr("ETag", "*", "Stream-Closed", ""), nil}.check(t, e)
	tag := open.Header.Get("ETag")
	protocolRule{"open tail, tag matches", fhReq{Method: "GET", Path: atTail, Header: hdr("If-None-Match", tag)}, 304, hdr("ETag", tag), &empty}.check(t, e)
	if r := e.must(fhReq{Method: "POST", Path: "/rules/etag", Header: hdr("Stream-Closed", "true")}); r.Status != http.StatusNoContent {
		t.Fatalf("close: %s", r)
	}
	closed := protocolRule{"closed tail with the open tail's tag", fhReq{Method: "GET", Path: atTail, Header: hdr("If-None-Match", tag)}, 200,
		hdr("Stream-Closed", "true", "ETag", "*"), &empty}.check(t, e)
	if closed.Header.Get("ETag") == tag {
		t.Errorf("the ETag %s did not change when the stream closed", tag)
	}
	protocolRule{"closed tail, weak form of its tag", fhReq{Method: "GET", Path: atTail, Header: hdr("If-None-Match", `"other", W/`+closed.Header.Get("ETag"))}, 304, nil, &empty}.check(t, e)

	// 9.1.4: an escaped half of a surrogate pair is valid JSON (RFC 8259
	// section 7), taken as the reference server takes it, and kept as
	// sent, so a read gives the same text back.
	e.create("/rules/json", "application/json")
	lone := `["\ud800"]`
	protocolRule{"a lone surrogate escape", fhReq{Method: "POST", Path: "/rules/json", Header: hdr("Content-Type", "application/json"), Body: []byte(`"\ud800"`)}, 204, nil, nil}.check(t, e)
	protocolRule{"the lone surrogate escape read back", fhReq{Method: "GET", Path: "/rules/json?offset=-1"}, 200, nil, &lone}.check(t, e)
	// 5.2: content types match by media type, as the reference server
	// and client compare them; the parameters do not count.
	e.create("/rules/charset", "text/plain; charset=utf-8")
	protocolRule{"another charset of the same media type", fhReq{Method: "POST", Path: "/rules/charset", Header: hdr("Content-Type", "text/plain; charset=latin1"), Body: []byte("x")}, 204, nil, nil}.check(t, e)
}

// TestLiveReadersAtTheTailSeeACloseOnly: through Caddy on versitygw, a
// close without data ends the live reads parked at the tail: a long-poll
// answers 204 with Stream-Closed, and an SSE feed sends a last control
// event with streamClosed and upToDate (sections 5.7, 5.8), then ends.
func TestLiveReadersAtTheTailSeeACloseOnly(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"long_poll_timeout 30s", "sse_reconnect_interval 5m"}})
	const path, tp = "/rules/live", "text/plain"
	e.create(path, tp)
	tail := e.append(path, tp, []byte("a"))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	br := openSSE(ctx, t, e, path+"?live=sse&offset="+tail)
	first := mustControl(t, br)
	if !first.UpToDate || first.StreamClosed || first.StreamCursor == "" {
		t.Fatalf("first control event at the tail: %+v", first)
	}
	type result struct {
		resp fhResp
		err  error
	}
	poll := make(chan result, 1)
	go func() {
		r, err := e.send(fhReq{Method: http.MethodGet, Path: path + "?live=long-poll&offset=" + tail})
		poll <- result{r, err}
	}()
	// The SSE feed is parked at the tail (its first control event said
	// so); the long-poll may or may not be yet, and either way it must
	// answer the close with 204 and Stream-Closed.
	if r := e.must(fhReq{Method: http.MethodPost, Path: path, Header: map[string]string{"Stream-Closed": "true"}}); r.Status != http.StatusNoContent {
		t.Fatalf("close: %s", r)
	}
	last := mustControl(t, br)
	if !last.StreamClosed || !last.UpToDate || last.StreamNextOffset != tail || last.StreamCursor != "" {
		t.Errorf("control event after the close: %+v, want streamClosed and upToDate at %s without a cursor", last, tail)
	}
	if ev, err := readSSEEvent(br); !errors.Is(err, io.EOF) {
		t.Errorf("after the closing control event: %+v, %v; want the feed to end", ev, err)
	}
	res := <-poll
	if res.err != nil {
		t.Fatal(res.err)
	}
	if r := res.resp; r.Status != http.StatusNoContent || r.Header.Get("Stream-Closed") != "true" ||
		r.Header.Get("Stream-Up-To-Date") != "true" || r.Header.Get("Stream-Next-Offset") != tail {
		t.Errorf("long-poll at the tail across the close: %s %v", r, r.Header)
	}
}

// mustControl reads the next SSE event, which must be a control event.
func mustControl(t *testing.T, br *bufio.Reader) sseControl {
	t.Helper()
	ev, err := readSSEEvent(br)
	if err != nil {
		t.Fatalf("reading an SSE event: %v", err)
	}
	var c sseControl
	if ev.event != "control" || json.Unmarshal([]byte(ev.data), &c) != nil {
		t.Fatalf("SSE event %q %q, want a control event", ev.event, strings.TrimSpace(ev.data))
	}
	return c
}

// TestSSEFeedsAtTheTailKeepTheirOwnCursors: through Caddy on versitygw,
// SSE feeds waiting at one stream's tail, some with a cursor of their own
// ahead of the clock and some without, each get every append with their
// own cursor in the control event after it, never another feed's: a
// cursor that went back to the clock's would let a CDN answer the feed's
// next request from its cache (section 10.1). Feeds at the tail share
// their data events (ssehub.go) and, up to a number of distinct cursors,
// their control events too; both sides of that number are checked.
func TestSSEFeedsAtTheTailKeepTheirOwnCursors(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"sse_reconnect_interval 5m"}})
	for _, ahead := range []int{3, 20} { // feeds with a cursor of their own ahead of the clock
		checkFeedCursors(t, e, "/rules/cursors/"+strconv.Itoa(ahead), ahead)
	}
}

// checkFeedCursors opens ahead+2 feeds at the tail of a new text stream
// at path, ahead of them with a cursor each, appends two records and
// checks that every feed's control events keep the feed's own cursor.
func checkFeedCursors(t *testing.T, e *fhEnv, path string, ahead int) {
	t.Helper()
	const tp = "text/plain"
	e.create(path, tp)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	type feed struct {
		br     *bufio.Reader
		sent   uint64 // the cursor the client sent; 0: none
		cursor string // the one the feed's first control event gave
	}
	// Sent cursors lie further apart than the server's jitter moves one
	// (an hour), so that every feed's own is distinct; the last two feeds
	// send none and share the clock's, the count of 20 s intervals since
	// 2024-10-09 (section 10.1).
	now := uint64(time.Since(time.Date(2024, 10, 9, 0, 0, 0, 0, time.UTC)) / (20 * time.Second))
	feeds := make([]feed, ahead+2)
	for i := range feeds {
		query := "?offset=now&live=sse"
		if i < ahead {
			feeds[i].sent = now + uint64(i+1)*1000
			query += "&cursor=" + strconv.FormatUint(feeds[i].sent, 10)
		}
		feeds[i].br = openSSE(ctx, t, e, path+query)
		c := mustControl(t, feeds[i].br)
		feeds[i].cursor = c.StreamCursor
		if n, err := strconv.ParseUint(c.StreamCursor, 10, 64); err != nil || n <= feeds[i].sent || !c.UpToDate {
			t.Fatalf("%s: feed %d sent cursor %d; first control event %+v", path, i, feeds[i].sent, c)
		}
	}
	// Every feed announced the tail and waits there for the next record,
	// in the stream's hub or, one that has not reached it yet, on its own.
	for i, rec := range []string{"one", "two"} {
		next := e.append(path, tp, []byte(rec))
		for j, f := range feeds {
			ev, err := readSSEEvent(f.br)
			if err != nil || ev.event != "data" || ev.data != rec {
				t.Fatalf("%s: feed %d, record %d: event %+v, %v", path, j, i, ev, err)
			}
			c := mustControl(t, f.br)
			if c.StreamCursor != f.cursor || c.StreamNextOffset != next || !c.UpToDate {
				t.Errorf("%s: feed %d (sent cursor %d), record %d: control %+v, want cursor %s at %s",
					path, j, f.sent, i, c, f.cursor, next)
			}
		}
	}
}
