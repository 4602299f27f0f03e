package integration

import (
	"net/http"
	"testing"
)

// TestCreateOfAnEvictedStreamWithATTLWritesNothingThroughCaddy: through
// Caddy on versitygw, a create with a TTL of a stream the restart left out
// of memory is refused (other settings, If-None-Match: *) or confirmed
// without a write. It wrote the expiry marker a new stream needs, and then
// deleted it once the name was found taken.
func TestCreateOfAnEvictedStreamWithATTLWritesNothingThroughCaddy(t *testing.T) {
	e := fhStart(t, fhOptions{Optional: []string{"compact_interval 1h"}})
	const path = "/ev/ttl"
	ttl := map[string]string{"Content-Type": "text/plain", "Stream-TTL": "3600"}
	if r := e.must(fhReq{Method: http.MethodPut, Path: path, Header: ttl}); r.Status != http.StatusCreated {
		t.Fatalf("create: %s", r)
	}
	if err := e.caddy.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if err := e.caddy.TryRestart(); err != nil {
		t.Fatalf("restart: %v", err)
	}
	for _, tc := range []struct {
		name   string
		header map[string]string
		status int
	}{
		{"other TTL", map[string]string{"Content-Type": "text/plain", "Stream-TTL": "60"}, http.StatusConflict},
		{"new stream asked for", map[string]string{"Content-Type": "text/plain", "Stream-TTL": "3600", "If-None-Match": "*"}, http.StatusPreconditionFailed},
		{"same settings", ttl, http.StatusOK},
	} {
		r, writes := fhExpectNoWrites(t, e, fhReq{Method: http.MethodPut, Path: path, Header: tc.header})
		if r.Status != tc.status {
			t.Errorf("%s: %s, want %d", tc.name, r, tc.status)
		}
		if len(writes) != 0 {
			t.Errorf("%s: wrote %v", tc.name, writes)
		}
	}
}
