package integration

import (
	"net/http"
	"testing"
)

// apiKey is the secret the guards of TestCacheReadsPrivate want, in a
// header of the site's own or in the query.
const apiKey = "reader-key-1"

// TestCacheReadsPrivate: through Caddy on versitygw, a site that lets
// readers in by a credential the module cannot see as one (an X-Api-Key
// header checked by a matcher, as forward_auth would; a ?token= in the
// query) gets "public" read answers by default, which a CDN in front would
// hand to everyone asking for the same URL (the header case), or keep
// copies of in a shared cache (the token case); with cache_reads private
// every read answer a cache may keep says "private", max-age kept, guarded
// or not. Before the option there was no way to say so: the key and token
// streams' reads said "public".
func TestCacheReadsPrivate(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	guard := "\t\t@nokey {\n\t\t\tpath /key/*\n\t\t\tnot header X-Api-Key " + apiKey + "\n\t\t}\n" +
		"\t\terror @nokey 401\n" +
		"\t\t@notoken {\n\t\t\tpath /token/*\n\t\t\tnot query token=" + apiKey + "\n\t\t}\n" +
		"\t\terror @notoken 401\n"
	for _, site := range []struct {
		name       string
		directives []string
		private    bool
	}{
		{"default", nil, false},
		{"cache_reads private", []string{"cache_reads private"}, true},
	} {
		t.Run(site.name, func(t *testing.T) {
			e := picoStartGuarded(t, site.directives, nil, guard)
			for _, scope := range []struct {
				dir   string
				hdr   map[string]string
				query string
			}{
				{"key", map[string]string{"X-Api-Key": apiKey}, ""},
				{"token", nil, "token=" + apiKey},
				{"open", nil, ""},
			} {
				wantReadCaching(t, e, scope.dir, scope.hdr, scope.query, site.private)
			}
			// The guards are real: without the key or token a stream is
			// refused.
			for _, path := range []string{"/ds/key/s?offset=-1", "/ds/token/s?offset=-1", "/pico/key/p?seq=0"} {
				if resp := e.must(fhReq{Method: http.MethodGet, Path: path}); resp.Status != http.StatusUnauthorized {
					t.Errorf("GET %s without the key: %s, want 401", path, resp)
				}
			}
		})
	}
}
