package integration

import (
	"net/http"
	"testing"
)

// TestRepeatedHeaderLinesThatSayOneThing: through Caddy on versitygw, a
// header sent on two lines is refused only when the request uses it and
// its lines mean two different things.
//
//   - Content-Type twice with two values is refused where it names the
//     stream's type or the body's (a create, an append with data), but a
//     close-only append has no body, and section 5.2 says the server MUST
//     NOT reject it on its Content-Type; reads never use one.
//   - Stream-Closed counts by meaning (section 4.1): "true" and "TRUE" are
//     one close, and two values that are not "true" are both the header
//     absent, which the server SHOULD NOT answer with an error. Only
//     "true" with another value is two requests in one.
//   - If-None-Match is a list (RFC 9110 section 13.1.2), which a client or
//     proxy may send over several lines; a tag on the second line matches
//     as on the first (section 10.1: a matching tag MUST give 304).
func TestRepeatedHeaderLinesThatSayOneThing(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	const tp = "text/plain"
	hdr := func(kv ...string) map[string]string {
		h := map[string]string{}
		for i := 0; i+1 < len(kv); i += 2 {
			h[kv[i]] = kv[i+1]
		}
		return h
	}
	e.create("/lines/open", tp)
	tail := e.append("/lines/open", tp, []byte("abc"))
	e.create("/lines/close-ct", tp)
	e.create("/lines/close-case", tp)
	tag := e.must(fhReq{Method: http.MethodGet, Path: "/lines/open?offset=-1"}).Header.Get("ETag")
	if tag == "" {
		t.Fatal("a catch-up read of /lines/open has no ETag")
	}
	twoTypes := [][2]string{{"Content-Type", "application/json"}}

	for _, p := range []protocolRule{
		{"close-only with two Content-Types", fhReq{Method: "POST", Path: "/lines/close-ct", Header: hdr("Content-Type", tp, "Stream-Closed", "true"), More: twoTypes},
			204, hdr("Stream-Closed", "true"), nil},
		{"the close-only closed the stream", fhReq{Method: "HEAD", Path: "/lines/close-ct"}, 200, hdr("Stream-Closed", "true"), nil},
		{"a read with two Content-Types", fhReq{Method: "GET", Path: "/lines/open?offset=-1", Header: hdr("Content-Type", tp), More: twoTypes},
			200, hdr("Stream-Next-Offset", tail), nil},
		{"HEAD with two Content-Types", fhReq{Method: "HEAD", Path: "/lines/open", Header: hdr("Content-Type", tp), More: twoTypes},
			200, hdr("Stream-Next-Offset", tail), nil},
		{"an append of data with two Content-Types is still refused", fhReq{Method: "POST", Path: "/lines/open", Header: hdr("Content-Type", tp),
			More: twoTypes, Body: []byte("x")}, 400, nil, nil},
		{"a create with two Content-Types is still refused", fhReq{Method: "PUT", Path: "/lines/new", Header: hdr("Content-Type", tp), More: twoTypes},
			400, nil, nil},
		// Before the appends below move the tail, and with it the tag.
		{"If-None-Match with the tag on its second line", fhReq{Method: "GET", Path: "/lines/open?offset=-1", Header: hdr("If-None-Match", `"other"`),
			More: [][2]string{{"If-None-Match", tag}}}, 304, hdr("ETag", tag), nil},

		{"Stream-Closed: true and TRUE are one close", fhReq{Method: "POST", Path: "/lines/close-case", Header: hdr("Stream-Closed", "true"),
			More: [][2]string{{"Stream-Closed", "TRUE"}}}, 204, hdr("Stream-Closed", "true"), nil},
		{"Stream-Closed: yes and no are no close", fhReq{Method: "POST", Path: "/lines/open", Header: hdr("Content-Type", tp, "Stream-Closed", "yes"),
			More: [][2]string{{"Stream-Closed", "no"}}, Body: []byte("d")}, 204, hdr("Stream-Closed", ""), nil},
		{"the stream is still open", fhReq{Method: "HEAD", Path: "/lines/open"}, 200, hdr("Stream-Closed", ""), nil},
		{"Stream-Closed: true and false are still refused", fhReq{Method: "POST", Path: "/lines/open", Header: hdr("Content-Type", tp, "Stream-Closed", "true"),
			More: [][2]string{{"Stream-Closed", "false"}}, Body: []byte("e")}, 400, nil, nil},
	} {
		p.check(t, e)
	}
	if r := e.must(fhReq{Method: "HEAD", Path: "/lines/new"}); r.Status != http.StatusNotFound {
		t.Errorf("the refused create made /lines/new: HEAD %s", r)
	}
}
