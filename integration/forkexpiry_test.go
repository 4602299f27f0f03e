package integration

import (
	"net/http"
	"testing"
	"time"
)

// TestForkCreateRepeatedComparesExpiry: a fork create repeated without
// Stream-TTL or Stream-Expires-At asks for its source's expiry (section
// 4.2's table), so it is 200 only on a fork that has that expiry, and 409
// on one made with an expiry of its own that differs (section 4.2,
// idempotent fork creation). It used to be 200 whatever expiry the fork
// had, as if a header left out matched anything.
func TestForkCreateRepeatedComparesExpiry(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	at := time.Now().Add(48 * time.Hour).UTC().Truncate(time.Second).Format(time.RFC3339)
	for _, src := range []struct{ path, ttl string }{{"/forkexp/ttl", "3600"}, {"/forkexp/none", ""}} {
		h := map[string]string{"Content-Type": textPlain}
		if src.ttl != "" {
			h["Stream-TTL"] = src.ttl
		}
		if r := e.must(fhReq{Method: http.MethodPut, Path: src.path, Header: h}); r.Status != http.StatusCreated {
			t.Fatalf("PUT %s: %s", src.path, r)
		}
	}
	fork := func(src string, kv ...string) map[string]string {
		h := map[string]string{"Stream-Forked-From": src}
		for i := 0; i+1 < len(kv); i += 2 {
			h[kv[i]] = kv[i+1]
		}
		return h
	}
	for _, tc := range []struct {
		name   string
		path   string
		create map[string]string
		repeat map[string]string
		want   int
	}{
		{"inherited TTL, repeated without", "/forkexp/a", fork("/forkexp/ttl"), fork("/forkexp/ttl"), 200},
		{"inherited TTL, repeated with it", "/forkexp/b", fork("/forkexp/ttl"), fork("/forkexp/ttl", "Stream-TTL", "3600"), 200},
		{"own TTL equal to the source's, repeated without", "/forkexp/c", fork("/forkexp/ttl", "Stream-TTL", "3600"), fork("/forkexp/ttl"), 200},
		{"own TTL, repeated with it", "/forkexp/d", fork("/forkexp/ttl", "Stream-TTL", "100"), fork("/forkexp/ttl", "Stream-TTL", "100"), 200},
		{"own TTL, repeated without", "/forkexp/e", fork("/forkexp/ttl", "Stream-TTL", "100"), fork("/forkexp/ttl"), 409},
		{"own Expires-At over a TTL, repeated without", "/forkexp/f", fork("/forkexp/ttl", "Stream-Expires-At", at), fork("/forkexp/ttl"), 409},
		{"own TTL of a source without, repeated without", "/forkexp/g", fork("/forkexp/none", "Stream-TTL", "100"), fork("/forkexp/none"), 409},
		{"own Expires-At of a source without, repeated without", "/forkexp/h", fork("/forkexp/none", "Stream-Expires-At", at), fork("/forkexp/none"), 409},
		{"none inherited, repeated without", "/forkexp/i", fork("/forkexp/none"), fork("/forkexp/none"), 200},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if r := e.must(fhReq{Method: http.MethodPut, Path: tc.path, Header: tc.create}); r.Status != http.StatusCreated {
				t.Fatalf("PUT %s: %s", tc.path, r)
			}
			if r := e.must(fhReq{Method: http.MethodPut, Path: tc.path, Header: tc.repeat}); r.Status != tc.want {
				t.Errorf("PUT %s repeated with %v after %v: %s, want %d", tc.path, tc.repeat, tc.create, r, tc.want)
			}
		})
	}
}
