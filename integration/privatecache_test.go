package integration

import (
	"encoding/base64"
	"maps"
	"net/http"
	"strings"
	"testing"
)

// readerHash is the bcrypt hash (cost 4, for speed) of readerPassword;
// sessionCookie is the cookie the session guard lets through.
const (
	readerPassword = "reader-secret"
	readerHash     = "$2a$04$.ESBRVlown3JLYHIOWtdZu8ZrkWMeJAF2DF6pfN9frSD3OqLRGR9q"
	sessionCookie  = "session=reader-1"
)

// The Cache-Control of a read answer a cache may keep, of a stream that
// does not expire: anyone's, or the reader's alone.
const (
	cachePublic  = "public, max-age=60, stale-while-revalidate=300"
	cachePrivate = "private, max-age=60, stale-while-revalidate=300"
)

// TestReadsBehindAuthAreNotPublic: through Caddy on versitygw, with
// basic_auth in front of the streams under /private/ and /stripped/ (where
// the site removes Authorization before the module, so only Caddy's
// {http.auth.user.id} tells the request was authenticated) and a
// session-cookie guard (as forward_auth to a login portal would be) in
// front of those under /session/, every read answer a cache may keep
// (Durable Streams catch-up, long-poll and EOF, Pico catch-up) says
// "private" there and "public" for the streams anyone may read, and so
// does a Durable Streams SSE feed ("private, no-cache" or "no-cache"). It
// used to say "public" to the reader with credentials as well (and, later,
// to the reader with a session cookie, and to the one whose Authorization
// was stripped; the SSE feed said "no-cache" to all), which lets a shared
// cache (RFC 9111 section 3.5) hand a protected stream's records to
// clients that have none; section 10.1 of the protocol asks for "private"
// on streams that may be user-specific.
func TestReadsBehindAuthAreNotPublic(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	guard := "\t\t@private path /private/*\n\t\tbasic_auth @private {\n\t\t\treader " + readerHash + "\n\t\t}\n" +
		"\t\t@nosession {\n\t\t\tpath /session/*\n\t\t\tnot header Cookie *" + sessionCookie + "*\n\t\t}\n" +
		"\t\terror @nosession 401\n" +
		"\t\t@stripped path /stripped/*\n\t\tbasic_auth @stripped {\n\t\t\treader " + readerHash + "\n\t\t}\n" +
		"\t\trequest_header @stripped -Authorization\n"
	e := picoStartGuarded(t, []string{"long_poll_timeout 30s"}, nil, guard)
	auth := "Basic " + base64.StdEncoding.EncodeToString([]byte("reader:"+readerPassword))

	for _, scope := range []struct {
		dir, credential, value string
		private                bool
	}{
		{"public", "", "", false},
		{"private", "Authorization", auth, true},
		{"session", "Cookie", "theme=dark; " + sessionCookie, true},
		{"stripped", "Authorization", auth, true},
	} {
		hdr := map[string]string{}
		if scope.credential != "" {
			hdr[scope.credential] = scope.value
		}
		wantReadCaching(t, e, scope.dir, hdr, "", scope.private)
	}
	// The guards are real: without credentials a private stream is refused.
	for _, path := range []string{"/ds/private/s", "/ds/session/s", "/ds/stripped/s"} {
		if resp := e.must(fhReq{Method: http.MethodGet, Path: path}); resp.Status != http.StatusUnauthorized {
			t.Fatalf("GET %s without credentials: %s, want 401", path, resp)
		}
	}
}

// wantReadCaching creates, under dir of the /ds/ and /pico/ routes of e,
// a Durable Streams stream with data, a closed one and a Pico stream with
// a record, every request carrying the headers hdr and the query
// parameters query (such as "token=x"; "" for none), and fails the test
// unless every read answer of them a cache may keep says cachePrivate
// when private, else cachePublic, and a Durable Streams SSE feed says
// "private, no-cache" when private, else "no-cache".
func wantReadCaching(t *testing.T, e *fhEnv, dir string, hdr map[string]string, query string, private bool) {
	t.Helper()
	with := func(method, path string, body []byte, kv ...string) fhReq {
		if query != "" {
			sep := "?"
			if strings.Contains(path, "?") {
				sep = "&"
			}
			path += sep + query
		}
		h := map[string]string{}
		maps.Copy(h, hdr)
		for i := 0; i+1 < len(kv); i += 2 {
			h[kv[i]] = kv[i+1]
		}
		return fhReq{Method: method, Path: path, Header: h, Body: body}
	}
	ds, closed, pico := "/ds/"+dir+"/s", "/ds/"+dir+"/c", "/pico/"+dir+"/p"
	for _, r := range []fhReq{
		with(http.MethodPut, ds, []byte("abc"), "Content-Type", "text/plain"),
		with(http.MethodPut, closed, []byte("x"), "Content-Type", "text/plain", "Stream-Closed", "true"),
		with(http.MethodPut, pico, nil, "Content-Type", "application/octet-stream"),
		with(http.MethodPost, pico, []byte("rec"), "Content-Type", "application/octet-stream"),
	} {
		if resp := e.must(r); resp.Status != http.StatusCreated && resp.Status != http.StatusOK {
			t.Fatalf("%s %s: %s", r.Method, r.Path, resp)
		}
	}
	tail := e.must(with(http.MethodHead, closed, nil)).Header.Get("Stream-Next-Offset")
	for _, tc := range []struct{ what, path, public, private string }{
		{"catch-up", ds + "?offset=-1", cachePublic, cachePrivate},
		{"long-poll with data", ds + "?offset=-1&live=long-poll", cachePublic, cachePrivate},
		{"EOF of a closed stream", closed + "?offset=" + tail, cachePublic, cachePrivate},
		{"Pico catch-up", pico + "?seq=0", cachePublic, cachePrivate},
		// The feed of a closed stream ends by itself.
		{"SSE", closed + "?offset=-1&live=sse", "no-cache", "private, no-cache"},
	} {
		r := with(http.MethodGet, tc.path, nil)
		resp := e.must(r)
		if resp.Status != http.StatusOK {
			t.Fatalf("%s %s (GET %s): %s", dir, tc.what, r.Path, resp)
		}
		want := tc.public
		if private {
			want = tc.private
		}
		if got := resp.Header.Get("Cache-Control"); got != want {
			t.Errorf("%s %s (GET %s): Cache-Control %q, want %q", dir, tc.what, r.Path, got, want)
		}
	}
}
