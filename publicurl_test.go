package picomq

import (
	"context"
	"crypto/tls"
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// TestPublicURL: the scheme and host of the absolute URLs the module writes
// follow X-Forwarded-Proto and X-Forwarded-Host only when Caddy marked the
// peer as a trusted proxy, and then only for a plain scheme and host.
func TestPublicURL(t *testing.T) {
	tests := []struct {
		name    string
		trusted bool
		tls     bool
		hdr     [][2]string
		want    string
	}{
		{name: "plain", want: "http://caddy.internal:8080/s"},
		{name: "tls", tls: true, want: "https://caddy.internal:8080/s"},
		{name: "untrusted proto ignored", hdr: [][2]string{{"X-Forwarded-Proto", "https"}},
			want: "http://caddy.internal:8080/s"},
		{name: "untrusted host ignored", hdr: [][2]string{{"X-Forwarded-Host", "evil.example"}},
			want: "http://caddy.internal:8080/s"},
		{name: "untrusted over tls keeps https", tls: true, hdr: [][2]string{{"X-Forwarded-Proto", "http"}},
			want: "https://caddy.internal:8080/s"},
		{name: "trusted proto", trusted: true, hdr: [][2]string{{"X-Forwarded-Proto", "https"}},
			want: "https://caddy.internal:8080/s"},
		{name: "trusted proto and host", trusted: true,
			hdr:  [][2]string{{"X-Forwarded-Proto", "HTTPS"}, {"X-Forwarded-Host", "streams.example.com"}},
			want: "https://streams.example.com/s"},
		{name: "trusted host with port", trusted: true, hdr: [][2]string{{"X-Forwarded-Host", "streams.example.com:8443"}},
			want: "http://streams.example.com:8443/s"},
		{name: "trusted ipv6 host", trusted: true, hdr: [][2]string{{"X-Forwarded-Host", "[2001:db8::1]:8443"}},
			want: "http://[2001:db8::1]:8443/s"},
		{name: "trusted last line wins", trusted: true,
			hdr:  [][2]string{{"X-Forwarded-Proto", "http"}, {"X-Forwarded-Proto", "https"}},
			want: "https://caddy.internal:8080/s"},
		{name: "trusted without headers", trusted: true, want: "http://caddy.internal:8080/s"},
		{name: "trusted odd scheme ignored", trusted: true, hdr: [][2]string{{"X-Forwarded-Proto", "javascript"}},
			want: "http://caddy.internal:8080/s"},
		{name: "trusted list ignored", trusted: true, hdr: [][2]string{{"X-Forwarded-Proto", "https, http"}, {"X-Forwarded-Host", "a.example, b.example"}},
			want: "http://caddy.internal:8080/s"},
		{name: "trusted host with path ignored", trusted: true, hdr: [][2]string{{"X-Forwarded-Host", "a.example/x"}},
			want: "http://caddy.internal:8080/s"},
		{name: "trusted host with user ignored", trusted: true, hdr: [][2]string{{"X-Forwarded-Host", "u@a.example"}},
			want: "http://caddy.internal:8080/s"},
		{name: "trusted host with bad port ignored", trusted: true, hdr: [][2]string{{"X-Forwarded-Host", "a.example:x"}},
			want: "http://caddy.internal:8080/s"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest(http.MethodPut, "http://caddy.internal:8080/s", nil)
			if !tt.tls {
				r.TLS = nil
			} else {
				r.TLS = &tls.ConnectionState{}
			}
			for _, kv := range tt.hdr {
				r.Header.Add(kv[0], kv[1])
			}
			// What Caddy's server puts on every request.
			vars := map[string]any{caddyhttp.TrustedProxyVarKey: tt.trusted}
			r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, vars))
			if got := publicURL(r, "/s"); got != tt.want {
				t.Errorf("publicURL = %q, want %q", got, tt.want)
			}
		})
	}
}

// TestForkSourcePublicHost: a Stream-Forked-From that copies a Location
// written behind a trusted proxy names its source; the forwarded host of an
// untrusted peer is still another server.
func TestForkSourcePublicHost(t *testing.T) {
	tests := []struct {
		name    string
		trusted bool
		src     string
		ok      bool
	}{
		{name: "own host", src: "http://caddy.internal:8080/src", ok: true},
		{name: "path", src: "/src", ok: true},
		{name: "trusted forwarded host", trusted: true, src: "https://streams.example.com/src", ok: true},
		{name: "untrusted forwarded host", src: "https://streams.example.com/src"},
		{name: "other host", trusted: true, src: "https://other.example/src"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest(http.MethodPut, "http://caddy.internal:8080/dst", nil)
			r.Header.Set("X-Forwarded-Host", "streams.example.com")
			vars := map[string]any{caddyhttp.TrustedProxyVarKey: tt.trusted}
			r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, vars))
			name, err := forkSourceName(r, tt.src)
			if tt.ok && (err != nil || name != "/src") {
				t.Errorf("forkSourceName(%q) = %q, %v; want /src", tt.src, name, err)
			}
			if !tt.ok && err == nil {
				t.Errorf("forkSourceName(%q) = %q, want an error", tt.src, name)
			}
		})
	}
}

// TestClientPrefix: the prefix Caddy stripped is found whether or not its
// cleaning of the path (before strip_prefix) changed the rest of it.
func TestClientPrefix(t *testing.T) {
	tests := []struct {
		name       string
		orig, path string // the client's path, the handler's
		want       string
	}{
		{name: "no prefix", orig: "/a/b", path: "/a/b", want: ""},
		{name: "handle_path", orig: "/app/ds/a/b", path: "/a/b", want: "/app/ds"},
		{name: "client's spelling of the prefix kept", orig: "/APP/ds/a", path: "/a", want: "/APP/ds"},
		{name: "repeated slash in the name", orig: "/app/ds/a//b", path: "/a/b", want: "/app/ds"},
		{name: "repeated slash in the prefix", orig: "/app//ds/z", path: "/z", want: "/app//ds"},
		{name: "dot segments in the name", orig: "/app/ds/x/./y//z", path: "/x/y/z", want: "/app/ds"},
		{name: "dot-dot segment before the name", orig: "/app/ds/a/../b", path: "/b", want: "/app/ds"},
		{name: "dot segment before the name", orig: "/app/ds/./b", path: "/b", want: "/app/ds"},
		{name: "repeated slash before the name", orig: "/app/ds//b", path: "/b", want: "/app/ds"},
		{name: "unrelated paths", orig: "/other", path: "/a", want: ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest(http.MethodPut, "http://caddy.internal"+tt.path, nil)
			orig := *r
			orig.URL = &url.URL{Path: tt.orig}
			r = r.WithContext(context.WithValue(r.Context(), caddyhttp.OriginalRequestCtxKey, orig))
			if got := clientPrefix(r); got != tt.want {
				t.Errorf("clientPrefix = %q, want %q", got, tt.want)
			}
		})
	}
}
