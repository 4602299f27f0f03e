package integration

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestColdReadSurvivesTheFirstReaderLeaving: through Caddy on versitygw,
// two readers of a stream whose records are in a data object the restarted
// node has not cached share the one GET of it, held at the proxy. The
// reader whose miss started the GET goes away before it lands; the other
// still gets the records. The GET ran on the first reader's request
// context, so the other got a 503 over a bucket that was fine.
func TestColdReadSurvivesTheFirstReaderLeaving(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"pack_below off", "compact_interval 200ms"}})
	const path, ct = "/shared/cold", "text/plain"
	e.create(path, ct)
	e.append(path, ct, []byte("cold record"))
	if err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
		if wal := e.mustList("wal/"); len(wal) > 0 {
			return fmt.Errorf("WAL objects %v", wal)
		}
		return nil
	}); err != nil {
		t.Fatalf("the append was not compacted into a data object: %v", err)
	}
	if err := e.caddy.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if err := e.caddy.TryRestart(); err != nil {
		t.Fatalf("restart: %v", err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	getsBefore := e.proxy.Counts().Containing("GET", "/data/")
	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpGet, KeyContains: "/data/"})
	defer release()
	get := func(ctx context.Context) (int, string, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.caddy.URL()+path+"?offset=-1", nil)
		if err != nil {
			return 0, "", err
		}
		resp, err := e.client.Do(req)
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body), err
	}
	firstCtx, leave := context.WithCancel(ctx)
	firstDone := make(chan error, 1)
	go func() {
		_, _, err := get(firstCtx)
		firstDone <- err
	}()
	if err := e.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("the data object's GET never reached the proxy: %v", err)
	}
	type answer struct {
		status int
		body   string
		err    error
	}
	second := make(chan answer, 1)
	go func() {
		status, body, err := get(ctx)
		second <- answer{status, body, err}
	}()
	// The second reader counts its cache miss just before it joins the GET
	// held at the proxy. Were it to leave before the join, the fix would
	// go untested: the second reader would start a GET of its own.
	if err := fhWaitFor(10*time.Second, 10*time.Millisecond, func() error {
		if n := mMust(t, e.caddy.AdminAddr()).sum("picomq_cache_misses_total"); n < 2 {
			return fmt.Errorf("%v cache misses, want both readers'", n)
		}
		return nil
	}); err != nil {
		t.Fatalf("the second reader never missed the cache: %v", err)
	}
	time.Sleep(50 * time.Millisecond) // from its counted miss to the join: microseconds
	leave()
	<-firstDone
	time.Sleep(100 * time.Millisecond) // a cancellation would reach the held GET now
	release()
	a := <-second
	if n := e.proxy.Counts().Containing("GET", "/data/") - getsBefore; n != 1 {
		t.Fatalf("%d GETs of the data object, want the one both readers shared", n)
	}
	if a.err != nil || a.status != http.StatusOK || a.body != "cold record" {
		t.Fatalf("the reader that stayed got %d %q (%v); want 200 with the record", a.status, a.body, a.err)
	}
}
