package integration

import (
	"net/http"
	"os"
	"slices"
	"testing"
	"time"
)

// TestIdleStreamKeepsItsLastRead: through Caddy on versitygw, a stream
// with Stream-TTL: 60 is created, read 12 s later, and then left alone.
// The read renews the TTL (section 5.1), so the stream must last until 60 s
// after it, not 60 s after the create. The engine keeps a renewal less than
// a quarter of the TTL after the last one it saved in memory only, and a
// stream unused for 30 s leaves memory: it went, the read with it, and the
// expiry sweep deleted the stream 60 s after the create, 48 s after a read
// that promised it 60.
func TestIdleStreamKeepsItsLastRead(t *testing.T) {
	t.Parallel() // waits on timers most of its run: beside the other such tests, not after them
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"expiry_sweep_interval 1s", "compact_interval 1s"}})
	const path = "/ttl/idle"
	const ttl = 60 * time.Second
	created := time.Now()
	if r := e.must(fhReq{Method: http.MethodPut, Path: path, Body: []byte("a"),
		Header: map[string]string{"Content-Type": textPlain, "Stream-TTL": "60"}}); r.Status != http.StatusCreated {
		t.Fatalf("PUT %s: %s", path, r)
	}
	time.Sleep(time.Until(created.Add(12 * time.Second)))
	read := time.Now()
	if r := e.must(fhReq{Method: http.MethodGet, Path: path + "?offset=-1"}); r.Status != http.StatusOK || string(r.Body) != "a" {
		t.Fatalf("GET %s: %s, want 200 %q", path, r, "a")
	}
	if time.Since(created) >= ttl/4 {
		// Locally a slow machine skips; in CI a skip would pass unseen,
		// with nothing tested.
		report := t.Skipf
		if os.Getenv("CI") != "" {
			report = t.Fatalf
		}
		report("the read came %v after the create, not within a quarter of the TTL: the machine is too slow for this test",
			time.Since(created).Round(time.Millisecond))
	}

	// Untouched, it leaves memory after 30 s; a TTL after the create
	// (plus sweeps) it must still be in the bucket.
	time.Sleep(time.Until(created.Add(ttl + 6*time.Second)))
	if !slices.Contains(streamNamesInBucket(t, e), path) {
		t.Fatalf("%s left the bucket within %v of its create; it was read %v after it, with a TTL of %v",
			path, time.Since(created).Round(time.Second), read.Sub(created).Round(time.Millisecond), ttl)
	}
	if r := e.must(fhReq{Method: http.MethodHead, Path: path}); r.Status != http.StatusOK {
		t.Fatalf("HEAD %s %v after the read: %s, want 200", path, time.Since(read).Round(time.Second), r)
	}

	// A TTL after the read, the sweep takes it (HEAD renews nothing).
	for {
		gone := !slices.Contains(streamNamesInBucket(t, e), path)
		if gone && time.Since(read) < ttl {
			t.Fatalf("%s left the bucket %v after its last read, within its TTL", path, time.Since(read).Round(time.Millisecond))
		}
		if gone {
			break
		}
		if time.Since(read) > ttl+20*time.Second {
			t.Fatalf("%s is still in the bucket %v after its last read (TTL %v)", path, time.Since(read).Round(time.Second), ttl)
		}
		time.Sleep(500 * time.Millisecond)
	}
}
