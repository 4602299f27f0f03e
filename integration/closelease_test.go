package integration

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestGracefulStopKeepsTheLeaseWhileItFlushes: through Caddy on
// versitygw, a graceful stop (with a grace period shorter than the
// append in flight) whose last WAL upload stalls past the
// lease's validity and fails keeps renewing the lease until the upload is
// settled, then stops promptly and releases the lease, so a standby can
// take the storage over at once. The engine stopped renewing before it
// flushed: the retry could not go out nor the writer confirm it still
// owned the storage, and the stop spun until Caddy's own deadline with
// the lease left to lapse.
func TestGracefulStopKeepsTheLeaseWhileItFlushes(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"lease_ttl 3s"}}) // valid 2.4 s after each renewal
	// With a grace period the stop does not wait for the append's answer:
	// the engine closes with its batch still going out.
	cf := e.caddy.Caddyfile()
	if err := e.reload(strings.Replace(cf, "persist_config off", "persist_config off\n\tgrace_period 200ms", 1)); err != nil {
		t.Fatalf("reload with a grace period: %v", err)
	}
	const path, ct = "/closelease/s", "text/plain"
	e.create(path, ct)
	before := e.proxy.Counts().Containing(testenv.OpPut, "/wal/")
	// The upload's first attempt stalls past the validity; its other
	// four fail at once, so the upload fails and the writer must retry it.
	e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Stall: 4 * time.Second, Status: http.StatusInternalServerError, Times: 1})
	e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Status: http.StatusInternalServerError, Times: 4})
	go func() {
		_, _ = e.send(fhReq{Method: http.MethodPost, Path: path, Body: []byte("a"), Header: map[string]string{"Content-Type": ct}})
	}()
	for deadline := time.Now().Add(10 * time.Second); e.proxy.Counts().Containing(testenv.OpPut, "/wal/") == before; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the append's WAL upload never reached the proxy")
		}
	}
	begun := time.Now()
	if err := e.caddy.StopTimeout(2 * time.Minute); err != nil {
		t.Errorf("graceful stop: %v", err)
	}
	took := time.Since(begun)
	t.Logf("the graceful stop took %v", took.Round(time.Millisecond))
	if took > 20*time.Second {
		t.Errorf("the graceful stop took %v; want it to end once the stalled upload is settled", took.Round(time.Millisecond))
	}
	lease, err := e.get("lease")
	if err != nil || !strings.Contains(string(lease), `"expires_at_ms":0`) {
		t.Errorf("the lease after the stop: %s (%v); want it released", lease, err)
	}
	if logs := e.caddy.Logs(); strings.Contains(logs, "release lease") {
		t.Errorf("the stop failed to release the lease:\n%s", truncateTail(logs, 3000))
	}
}
