package integration

import (
	"fmt"
	"net/http"
	"testing"
)

// TestCreateOfANewStreamIsOneRequest: through Caddy on versitygw, creating
// new streams writes each one's metadata object once and reads none. After
// a restart, when the streams are no longer in memory, a repeated create is
// judged by what the bucket holds: 200 with the same configuration, 409
// with another, and the stream is unchanged either way.
func TestCreateOfANewStreamIsOneRequest(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	const n = 20
	name := func(i int) string { return fmt.Sprintf("/create/s%02d", i) }
	metaPrefix := fhPrefix + "streams/"

	before := e.proxy.Counts()
	for i := range n {
		e.create(name(i), "text/plain")
	}
	after := e.proxy.Counts()
	gets := after.GetsUnder(metaPrefix) - before.GetsUnder(metaPrefix)
	puts := after.PutsUnder(metaPrefix) - before.PutsUnder(metaPrefix)
	t.Logf("%d creates of new streams: %d metadata GETs, %d metadata PUTs, %d S3 requests in all",
		n, gets, puts, after.Total()-before.Total())
	if gets != 0 || puts != n {
		t.Errorf("%d creates of new streams made %d metadata GETs and %d PUTs; want 0 and %d", n, gets, puts, n)
	}

	e.caddy.Restart()
	tests := []struct {
		contentType string
		want        int
	}{
		{"text/plain", http.StatusOK},
		{"application/json", http.StatusConflict},
	}
	for i, tt := range tests {
		before := e.proxy.Counts()
		resp := e.must(fhReq{Method: http.MethodPut, Path: name(i), Header: map[string]string{"Content-Type": tt.contentType}})
		after := e.proxy.Counts()
		if resp.Status != tt.want {
			t.Errorf("create %s again with %s after a restart: %s, want %d", name(i), tt.contentType, resp, tt.want)
		}
		if gets := after.GetsUnder(metaPrefix) - before.GetsUnder(metaPrefix); gets == 0 {
			t.Errorf("create %s again after a restart answered %d without reading the bucket", name(i), resp.Status)
		}
		head := e.must(fhReq{Method: http.MethodHead, Path: name(i)})
		if head.Status != http.StatusOK || head.Header.Get("Content-Type") != "text/plain" {
			t.Errorf("HEAD %s after the repeated create: %s, Content-Type %q; want 200, text/plain", name(i), head, head.Header.Get("Content-Type"))
		}
	}
}
