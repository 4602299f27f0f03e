package integration

import (
	"net/http"
	"testing"
	"time"
)

// A read within a quarter of the TTL of the stream's last saved access
// renews its TTL in memory only; a graceful stop writes that renewal, so
// the stream expires a TTL after the read, not a TTL after the access
// before it. (A crash still loses it.)
func TestGracefulStopKeepsARenewal(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	t.Parallel() // waits on the TTL most of its run
	e := fhStart(t, fhOptions{Directives: []string{"expiry_sweep_interval 300ms"}})
	const path, ttl = "/renewal/stop", 30 * time.Second
	if r := e.must(fhReq{Method: http.MethodPut, Path: path, Header: map[string]string{"Content-Type": "text/plain", "Stream-TTL": "30"}}); r.Status != http.StatusCreated {
		t.Fatalf("create: %s", r)
	}
	// The append saves its access with it: the read below comes within a
	// quarter of the TTL of it.
	e.append(path, "text/plain", []byte("x"))
	saved := time.Now() // no later than the append's access
	time.Sleep(2 * time.Second)
	read := time.Now()
	if r := e.must(fhReq{Method: http.MethodGet, Path: path + "?offset=-1"}); r.Status != http.StatusOK {
		t.Fatalf("read: %s", r)
	}
	e.caddy.Restart() // SIGTERM, then the same node again
	if waited := time.Since(saved); waited > ttl-3*time.Second {
		t.Fatalf("the restart took until %v after the append; the check needs it before %v", waited, ttl-3*time.Second)
	}
	// Past the TTL from the append, before the TTL from the read.
	time.Sleep(time.Until(saved.Add(ttl + time.Second)))
	if r := e.must(fhReq{Method: http.MethodHead, Path: path}); r.Status != http.StatusOK {
		t.Fatalf("HEAD %v after the append, %v after the read, a graceful restart between: %s, want 200 (the read renewed the TTL)",
			time.Since(saved).Round(time.Millisecond), time.Since(read).Round(time.Millisecond), r)
	}
	time.Sleep(time.Until(read.Add(ttl + 2*time.Second)))
	if r := e.must(fhReq{Method: http.MethodHead, Path: path}); r.Status != http.StatusNotFound {
		t.Fatalf("HEAD %v after the read: %s, want 404 (expired)", time.Since(read).Round(time.Millisecond), r)
	}
}
