package integration

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestOutageLogsSparsely has the store refuse every stream metadata write
// and sends creates, each answered 503: Caddy's log warns of the first
// failure of each kind and holds the rest back for a later line to count
// (it warned once per request, so that clients retrying through an outage
// buried the log in identical lines).
func TestOutageLogsSparsely(t *testing.T) {
	e := fhStart(t, fhOptions{})
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/streams/", Status: http.StatusServiceUnavailable})
	defer remove()
	const creates = 8
	var wg sync.WaitGroup
	statuses := make([]int, creates)
	for i := range creates {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := e.send(fhReq{Method: http.MethodPut, Path: fmt.Sprintf("/out%d", i), Header: map[string]string{"Content-Type": textPlain}})
			if err != nil {
				t.Errorf("create %d: %v", i, err)
				return
			}
			statuses[i] = r.Status
		}()
	}
	wg.Wait()
	for i, s := range statuses {
		if s != http.StatusServiceUnavailable {
			t.Fatalf("create %d with its metadata write refused: %d, want 503", i, s)
		}
	}
	logs := e.caddy.Logs()
	lines := strings.Count(logs, `"msg":"write not confirmed in time"`) + strings.Count(logs, `"msg":"storage unavailable"`)
	// One of each kind at most, within the interval.
	if lines == 0 || lines > 2 {
		t.Errorf("%d failed creates gave %d warnings, want 1 or 2", creates, lines)
	}
}
