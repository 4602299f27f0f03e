package integration

import (
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestManySubscriptionsLoadAfterARestart: through Caddy on versitygw, a
// restart finds 70 subscription documents in a bucket that takes a second
// to answer each read. They are read 16 at a time, each within its own
// deadline, and the subscriptions are served seconds after the restart.
// They were read one at a time within one minute for the whole load: past
// about 2,400 documents 25 ms away (here 60 a second away) the load ran
// out of time, started over, and no subscription was ever served again.
func TestManySubscriptionsLoadAfterARestart(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	const root = "/v1/stream/"
	const subs = 70
	e.create(root+"wake/pool", "application/json")
	for i := range subs {
		path := fmt.Sprintf("%s__ds/subscriptions/s%02d", root, i)
		if st, v := e.subCall("PUT", path, `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake/pool"}`); st != http.StatusCreated {
			t.Fatalf("create %s: %d %v", path, st, v)
		}
	}
	if err := e.caddy.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpGet, KeyContains: "/subs/", Stall: time.Second})
	defer remove()
	before := e.proxy.Counts().Containing(testenv.OpGet, "/subs/")
	if err := e.caddy.TryRestart(); err != nil {
		t.Fatalf("restart: %v", err)
	}
	restarted := time.Now()

	last := fmt.Sprintf("%s__ds/subscriptions/s%02d", root, subs-1)
	client := &http.Client{Timeout: 5 * time.Second}
	var status string
	err := fhWaitFor(45*time.Second, 100*time.Millisecond, func() error {
		resp, err := client.Get(e.caddy.URL() + last)
		if err != nil {
			status = err.Error()
			return err
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		status = fmt.Sprintf("%d %s", resp.StatusCode, body)
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("%s", status)
		}
		return nil
	})
	gets := e.proxy.Counts().Containing(testenv.OpGet, "/subs/") - before
	if err != nil {
		t.Fatalf("the subscriptions were not served 45 s after the restart (%d document reads so far): %s", gets, status)
	}
	t.Logf("served %v after the restart, %d document reads at a second each", time.Since(restarted).Round(100*time.Millisecond), gets)
	if gets < subs {
		t.Fatalf("%d document reads; want the %d subscriptions' at least", gets, subs)
	}
}
