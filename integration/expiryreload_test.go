package integration

import (
	"fmt"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestReloadShortensExpirySweep starts Caddy with expiry_sweep_interval 1h
// and reloads it with 1s: the next sweep (a LIST of the expiry markers)
// comes within seconds, as the README says of a reload's settings, not
// once the hour armed at start has run out.
func TestReloadShortensExpirySweep(t *testing.T) {
	e := fhStart(t, fhOptions{Directives: []string{"expiry_sweep_interval 1h"}})
	sweeps := func() int { return e.proxy.Counts().Containing(testenv.OpList, "expiry/") }
	before := sweeps()
	opts := caddytest.Options{
		Storage:    testenv.StoreURL(e.proxy.URL(), e.bucket, caddytest.S3Prefix),
		Directives: []string{"expiry_sweep_interval 1s"},
		Env:        caddytest.S3Env(e.v),
	}
	if err := e.reload(e.caddy.Config(opts)); err != nil {
		t.Fatalf("reload to expiry_sweep_interval 1s: %v", err)
	}
	if err := fhWaitFor(15*time.Second, 50*time.Millisecond, func() error {
		if sweeps() == before {
			return fmt.Errorf("no expiry sweep (LIST of expiry/) since the reload to expiry_sweep_interval 1s")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}
