package integration

import (
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestAppendsGoOutAfterUploadsFailWithSlotsFull: four WAL uploads in
// flight (every slot the writer has) fail while a fifth batch waits for a
// slot. The failed batches and the waiting one are refused, the writer
// recovers in a new namespace, and the next append on the healthy bucket
// is acknowledged at once. It used to wait out its whole timeout and get
// 503: the waiting batch's wish to flush outlived it, so the next batch
// never armed its timer.
func TestAppendsGoOutAfterUploadsFailWithSlotsFull(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	// An attempt timeout above the stall, so each failed upload is one
	// request; the append timeout is then 20ms + 2 x (5 x 2s + 1s) = 22 s.
	e := fhStart(t, fhOptions{Directives: []string{"s3_timeout 2s"}, Optional: []string{"compact_interval 1h"}})
	const ct = "text/plain"
	const streams = 5
	for i := range streams {
		e.create(fmt.Sprintf("/stall/s%d", i), ct)
	}
	// The next four WAL uploads stall and are then refused for good.
	e.proxy.AddFault(testenv.Fault{Op: "PUT", KeyContains: "/wal/", Stall: time.Second, Status: http.StatusForbidden, Times: 4})
	var wg sync.WaitGroup
	results := make([]fhResp, streams)
	errs := make([]error, streams)
	for i := range streams {
		wg.Go(func() {
			results[i], errs[i] = e.send(fhReq{Method: http.MethodPost, Path: fmt.Sprintf("/stall/s%d", i),
				Header: map[string]string{"Content-Type": ct}, Body: fmt.Appendf(nil, "lost %d", i)})
		})
		// Past flush_interval (20ms), so each append is an upload of its
		// own while a slot is free and the fifth waits for one.
		time.Sleep(60 * time.Millisecond)
	}
	wg.Wait()
	for i := range streams {
		if errs[i] != nil {
			t.Fatalf("append %d: %v", i, errs[i])
		}
		if results[i].Status/100 == 2 {
			t.Fatalf("append %d was acknowledged though its upload was refused: %s", i, results[i])
		}
	}

	// The bucket answers again. Appends refused while the writer settles
	// the failures come back at once; the first one taken must be
	// acknowledged well inside its 22 s timeout.
	client := &http.Client{Timeout: 10 * time.Second}
	t.Cleanup(client.CloseIdleConnections)
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := fhSend(client, e.caddy.URL(), fhReq{Method: http.MethodPost, Path: "/stall/s0",
			Header: map[string]string{"Content-Type": ct}, Body: []byte("after")})
		if err != nil {
			t.Fatalf("append after the failures: %v (the writer never sent it)", err)
		}
		if resp.Status == http.StatusNoContent {
			t.Logf("append after the failures acknowledged in %s", resp.Took.Round(time.Millisecond))
			break
		}
		if resp.Status != http.StatusServiceUnavailable || time.Now().After(deadline) {
			t.Fatalf("append after the failures: %s", resp)
		}
		time.Sleep(50 * time.Millisecond)
	}
	got, _, err := e.readBytes("/stall/s0")
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != "after" {
		t.Errorf("/stall/s0 holds %q, want only the acknowledged %q", got, "after")
	}
}
