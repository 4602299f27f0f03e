package integration

import (
	"encoding/base64"
	"net/http"
	"testing"
)

// readerHash is the bcrypt hash (cost 4, for speed) of readerPassword;
// sessionCookie is the cookie the session guard lets through.
const (
	readerPassword = "reader-secret"
	readerHash     = "$2a$04$.ESBRVlown3JLYHIOWtdZu8ZrkWMeJAF2DF6pfN9frSD3OqLRGR9q"
	sessionCookie  = "session=reader-1"
)

// TestReadsBehindAuthAreNotPublic: through Caddy on versitygw, with
// basic_auth in front of the streams under /private/ and a session-cookie
// guard (as forward_auth to a login portal would be) in front of those
// under /session/, every read answer a cache may keep (Durable Streams
// catch-up, long-poll and EOF, Pico catch-up) says "private" there and
// "public" for the streams anyone may read. It used to say "public" to the
// reader with credentials as well (and, later, to the reader with a
// session cookie), which lets a shared cache (RFC 9111 section 3.5) hand a
// protected stream's records to clients that have none; section 10.1 of
// the protocol asks for "private" on streams that may be user-specific.
func TestReadsBehindAuthAreNotPublic(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	guard := "\t\t@private path /private/*\n\t\tbasic_auth @private {\n\t\t\treader " + readerHash + "\n\t\t}\n" +
		"\t\t@nosession {\n\t\t\tpath /session/*\n\t\t\tnot header Cookie *" + sessionCookie + "*\n\t\t}\n" +
		"\t\terror @nosession 401\n"
	e := picoStartGuarded(t, []string{"long_poll_timeout 30s"}, nil, guard)
	auth := "Basic " + base64.StdEncoding.EncodeToString([]byte("reader:"+readerPassword))
	const public = "public, max-age=60, stale-while-revalidate=300"
	const private = "private, max-age=60, stale-while-revalidate=300"

	for _, scope := range []struct {
		dir, credential, value, cacheControl string
	}{
		{"public", "", "", public},
		{"private", "Authorization", auth, private},
		{"session", "Cookie", "theme=dark; " + sessionCookie, private},
	} {
		hdr := func(kv ...string) map[string]string {
			h := map[string]string{}
			if scope.credential != "" {
				h[scope.credential] = scope.value
			}
			for i := 0; i+1 < len(kv); i += 2 {
				h[kv[i]] = kv[i+1]
			}
			return h
		}
		ds, closed, pico := "/ds/"+scope.dir+"/s", "/ds/"+scope.dir+"/c", "/pico/"+scope.dir+"/p"
		setup := []fhReq{
			{Method: http.MethodPut, Path: ds, Header: hdr("Content-Type", "text/plain"), Body: []byte("abc")},
			{Method: http.MethodPut, Path: closed, Header: hdr("Content-Type", "text/plain", "Stream-Closed", "true"), Body: []byte("x")},
			{Method: http.MethodPut, Path: pico, Header: hdr("Content-Type", "application/octet-stream")},
			{Method: http.MethodPost, Path: pico, Header: hdr("Content-Type", "application/octet-stream"), Body: []byte("rec")},
		}
		for _, r := range setup {
			if resp := e.must(r); resp.Status != http.StatusCreated && resp.Status != http.StatusOK {
				t.Fatalf("%s %s: %s", r.Method, r.Path, resp)
			}
		}
		tail := e.must(fhReq{Method: http.MethodHead, Path: closed, Header: hdr()}).Header.Get("Stream-Next-Offset")
		for _, tc := range []struct{ what, path string }{
			{"catch-up", ds + "?offset=-1"},
			{"long-poll with data", ds + "?offset=-1&live=long-poll"},
			{"EOF of a closed stream", closed + "?offset=" + tail},
			{"Pico catch-up", pico + "?seq=0"},
		} {
			resp := e.must(fhReq{Method: http.MethodGet, Path: tc.path, Header: hdr()})
			if resp.Status != http.StatusOK {
				t.Fatalf("%s %s: %s", scope.dir, tc.what, resp)
			}
			if got := resp.Header.Get("Cache-Control"); got != scope.cacheControl {
				t.Errorf("%s %s (GET %s): Cache-Control %q, want %q", scope.dir, tc.what, tc.path, got, scope.cacheControl)
			}
		}
	}
	// The guards are real: without credentials a private stream is refused.
	for _, path := range []string{"/ds/private/s", "/ds/session/s"} {
		if resp := e.must(fhReq{Method: http.MethodGet, Path: path}); resp.Status != http.StatusUnauthorized {
			t.Fatalf("GET %s without credentials: %s, want 401", path, resp)
		}
	}
}
