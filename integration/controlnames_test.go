package integration

import (
	"net/http"
	"testing"
)

// TestNamesWithControlCharacters: a stream name with a control character
// (a line break, a tab, DEL, a C1 control) was created like any other,
// though no client can type it, terminals and listings show it as
// something else (a CR moves the cursor back over what came before), and
// it goes into Location headers and webhook payloads. A create through
// either protocol, and a fork to such a name, is now 400 naming the
// reason, and writes nothing; names with other characters still work.
func TestNamesWithControlCharacters(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy")
	}
	e := picoStart(t, nil, nil)
	e.create("/ds/src", textPlain)
	e.append("/ds/src", textPlain, []byte("x"))
	bad := []string{"/a%0Ab", "/a%0D%0ASet-Cookie:%20x=1", "/a%09b", "/a%7Fb", "/a%C2%85b", "/a%1Bb", "/dir%0A/x"}
	for _, p := range bad {
		reqs := []fhReq{
			{Method: http.MethodPut, Path: "/ds" + p, Header: map[string]string{"Content-Type": textPlain}, Body: []byte("first")},
			{Method: http.MethodPut, Path: "/ds" + p, Header: map[string]string{"Content-Type": textPlain, "Stream-Forked-From": "/ds/src"}},
			{Method: http.MethodPut, Path: "/pico" + p, Header: map[string]string{"Content-Type": textPlain}, Body: []byte("first")},
		}
		for _, r := range reqs {
			resp := e.must(r)
			if resp.Status != http.StatusBadRequest || !fhContainsAny(string(resp.Body), "control") {
				t.Errorf("%s %s %v: %s, want 400 naming the control character", r.Method, r.Path, r.Header, resp)
			}
		}
		if r := e.must(fhReq{Method: http.MethodHead, Path: "/ds" + p}); r.Status != http.StatusNotFound {
			t.Errorf("HEAD %s after the refused creates: %d, want 404", p, r.Status)
		}
	}
	for _, o := range e.mustList("streams/") {
		if o.Key != "streams/2f737263.m" {
			t.Errorf("a stream was stored besides /src: %s", o.Key)
		}
	}
	// Other characters, look-alikes and format characters included, are
	// names like any other.
	for _, p := range []string{"/caf%C3%A9", "/a%E2%80%AEb", "/a%EF%BC%8Fb", "/a%20b", "/a%5Cb"} {
		if r := e.must(fhReq{Method: http.MethodPut, Path: "/ds" + p, Header: map[string]string{"Content-Type": textPlain}}); r.Status != http.StatusCreated {
			t.Errorf("PUT %s: %s, want 201", p, r)
		}
	}
}
