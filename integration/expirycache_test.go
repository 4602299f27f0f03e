package integration

import (
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestCacheLifetimeEndsWithTheStream: through Caddy on versitygw, a
// cacheable read answer of a stream that expires (Durable Streams
// Stream-TTL and Stream-Expires-At, Pico-TTL and Pico-Expires-At) lets a
// cache keep it, stale serving included, no longer than the stream lives.
// It used to say max-age=60, stale-while-revalidate=300 whatever the
// stream's lifetime, so a CDN went on serving a stream minutes after it
// expired.
func TestCacheLifetimeEndsWithTheStream(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"long_poll_timeout 30s"}, nil)
	expiresAt := time.Now().Add(90 * time.Second).UTC()
	at := expiresAt.Format(time.RFC3339Nano)
	for _, tc := range []struct {
		what, path, contentType, expiryHeader, expiry, read string
		life                                                time.Duration // the stream's lifetime, as of the read
	}{
		{"Durable Streams TTL catch-up", "/ds/ttl", "text/plain", "Stream-TTL", "30", "?offset=-1", 30 * time.Second},
		{"Durable Streams TTL long-poll", "/ds/ttl2", "text/plain", "Stream-TTL", "30", "?offset=-1&live=long-poll", 30 * time.Second},
		{"Durable Streams Expires-At", "/ds/at", "text/plain", "Stream-Expires-At", at, "?offset=-1", 0},
		{"Pico TTL", "/pico/pttl", "application/octet-stream", "Pico-TTL", "30", "?seq=0", 30 * time.Second},
		{"Pico Expires-At", "/pico/pat", "application/octet-stream", "Pico-Expires-At", at, "?seq=0", 0},
	} {
		put := e.must(fhReq{Method: http.MethodPut, Path: tc.path,
			Header: map[string]string{"Content-Type": tc.contentType, tc.expiryHeader: tc.expiry}})
		if put.Status != http.StatusCreated {
			t.Fatalf("%s: create: %s", tc.what, put)
		}
		if resp := e.must(fhReq{Method: http.MethodPost, Path: tc.path,
			Header: map[string]string{"Content-Type": tc.contentType}, Body: []byte("rec")}); resp.Status/100 != 2 {
			t.Fatalf("%s: append: %s", tc.what, resp)
		}
		sent := time.Now()
		resp := e.must(fhReq{Method: http.MethodGet, Path: tc.path + tc.read})
		if resp.Status != http.StatusOK {
			t.Fatalf("%s: read: %s", tc.what, resp)
		}
		life := tc.life
		if life == 0 {
			life = expiresAt.Sub(sent)
		}
		cc := resp.Header.Get("Cache-Control")
		keep, ok := cacheLifetime(cc)
		switch {
		case !ok:
			t.Errorf("%s: Cache-Control %q, want public with max-age", tc.what, cc)
		case keep > life:
			t.Errorf("%s: Cache-Control %q keeps the answer %v, past the stream's end in %v", tc.what, cc, keep, life.Round(time.Second))
		case keep < life-5*time.Second:
			t.Errorf("%s: Cache-Control %q keeps the answer %v, far less than the stream's %v", tc.what, cc, keep, life.Round(time.Second))
		}
	}
}

// cacheLifetime is how long a "public, max-age=N[, stale-while-revalidate=M]"
// Cache-Control lets a cache serve an answer: N+M seconds.
func cacheLifetime(cc string) (time.Duration, bool) {
	parts := strings.Split(cc, ", ")
	if len(parts) < 2 || parts[0] != "public" {
		return 0, false
	}
	var total int
	for _, p := range parts[1:] {
		name, v, _ := strings.Cut(p, "=")
		n, err := strconv.Atoi(v)
		if err != nil || (name != "max-age" && name != "stale-while-revalidate") {
			return 0, false
		}
		total += n
	}
	return time.Duration(total) * time.Second, strings.HasPrefix(parts[1], "max-age=")
}
