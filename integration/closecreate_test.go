package integration

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestCreateRacingAPendingClose: a create (PUT) of an existing stream is
// judged on its Stream-Closed, and a close whose WAL upload is still on
// its way may yet fail. Here the close's upload is held at the proxy and
// then refused, so the close rolls back and the stream stays open. A PUT
// with Stream-Closed: true sent while the close was pending used to get
// 200 at once ("exists, closed") for a stream that then stayed open; one
// without it got 409 over a close that never happened. The PUT now waits
// for the close's fate, and its answer agrees with the stream afterwards.
func TestCreateRacingAPendingClose(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	for _, tc := range []struct {
		name   string
		closed bool // the PUT's Stream-Closed
		want   int  // once the close has rolled back
	}{
		{"PUT closed", true, http.StatusConflict},
		{"PUT open", false, http.StatusOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1h"}})
			const path, ct = "/pending/close", "text/plain"
			e.create(path, ct)

			// The close's WAL upload is parked, then refused (403 is not
			// retried): the seal wins and the close rolls back.
			match := testenv.Fault{Op: testenv.OpPut, KeyContains: "wal/", Times: 1}
			refuse := match
			refuse.Status = http.StatusForbidden
			removeFault := e.proxy.AddFault(refuse)
			defer removeFault()
			release := e.proxy.Hold(match)
			defer release()
			closed := make(chan fhResp, 1)
			go func() {
				resp, err := e.send(fhReq{Method: http.MethodPost, Path: path, Header: map[string]string{"Stream-Closed": "true"}})
				if err != nil {
					t.Errorf("close: %v", err)
				}
				closed <- resp
			}()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := e.proxy.WaitHeld(ctx, 1); err != nil {
				t.Fatalf("the close's WAL upload never reached the proxy: %v", err)
			}

			hdr := map[string]string{"Content-Type": ct}
			if tc.closed {
				hdr["Stream-Closed"] = "true"
			}
			created := make(chan fhResp, 1)
			go func() {
				resp, err := e.send(fhReq{Method: http.MethodPut, Path: path, Header: hdr})
				if err != nil {
					t.Errorf("create: %v", err)
				}
				created <- resp
			}()
			// Not synchronisation: a PUT judged on the pending close
			// answers at once, and this gives it the chance to. One that
			// waits for the close answers once the close is released.
			var put fhResp
			answered := false
			select {
			case put = <-created:
				answered = true
			case <-time.After(time.Second):
			}
			release()
			if resp := <-closed; resp.Status/100 == 2 {
				t.Fatalf("the close was acknowledged though its upload was refused: %s", resp)
			}
			if !answered {
				put = <-created
			}
			if put.Status != tc.want {
				t.Errorf("PUT (Stream-Closed %v) while a close was pending that then failed: %s, want %d", tc.closed, put, tc.want)
			}
			head := e.must(fhReq{Method: http.MethodHead, Path: path})
			if head.Header.Get("Stream-Closed") != "" {
				t.Errorf("HEAD after the failed close: Stream-Closed %q, want the stream open", head.Header.Get("Stream-Closed"))
			}
		})
	}
}
