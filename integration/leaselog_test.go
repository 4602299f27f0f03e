package integration

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestLeaseOutageLogsSparsely refuses the storage lease's renewals at the
// S3 proxy for a run of them, then lets them through again. Caddy's log
// warns of the failures at the first few only (it warned of each one, one
// identical line a second for as long as the store was out), and says
// when the lease is renewed again, with how many renewals failed.
func TestLeaseOutageLogsSparsely(t *testing.T) {
	t.Parallel() // waits on timers most of its run: beside the other such tests, not after them
	e := fhStart(t, fhOptions{})
	e.create("/up", textPlain)
	before := e.proxy.Counts().Containing(testenv.OpPut, "lease")
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "lease", Status: http.StatusServiceUnavailable})
	// The first renewal comes within a third of the 30 s lease; each
	// failed one is 5 attempts, retried a second later. Six failed
	// renewals stay well inside the lease.
	const failedAttempts = 6 * 5
	if err := fhWaitFor(40*time.Second, 100*time.Millisecond, func() error {
		if n := e.proxy.Counts().Containing(testenv.OpPut, "lease") - before; n < failedAttempts {
			return fmt.Errorf("%d lease PUTs refused, want %d", n, failedAttempts)
		}
		return nil
	}); err != nil {
		remove()
		t.Fatal(err)
	}
	remove()

	var renewed map[string]any
	err := fhWaitFor(20*time.Second, 100*time.Millisecond, func() error {
		for _, line := range strings.Split(e.caddy.Logs(), "\n") {
			if strings.Contains(line, `"storage lease renewed again"`) {
				return json.Unmarshal([]byte(line), &renewed)
			}
		}
		return fmt.Errorf("no log line says the lease was renewed again")
	})
	warned := strings.Count(e.caddy.Logs(), `"msg":"renew storage lease"`)
	if err != nil {
		t.Fatalf("%v (%d warnings of failed renewals)", err, warned)
	}
	failures, _ := renewed["failures"].(float64)
	if failures < 6 {
		t.Errorf("the renewal after the outage counts %v failures, want 6 or more: %v", renewed["failures"], renewed)
	}
	// 1, 2, 4, 8, ... of the failures in a row.
	if warned == 0 || float64(warned) >= failures {
		t.Errorf("%v failed renewals gave %d warnings, want fewer, and at least one", failures, warned)
	}
	t.Logf("%v failed renewals, %d warnings, renewed again after %vs", failures, warned, renewed["failing_for"])
	// The node writes on.
	e.append("/up", textPlain, []byte("after"))
}
