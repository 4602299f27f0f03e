package integration

import (
	"errors"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestRepeatedChangeAgreesWithItsAnswer: a client sends a close (Durable
// Streams) or a trim (Pico), and sends it again while the first one's WAL
// upload is still failing its attempts. Whatever either request is
// answered, an acknowledged change must be there, now and after a restart.
// A repeat used to be answered success at once, from the first attempt's
// change still in flight; when that upload then failed, the change rolled
// back and the acknowledged close or trim was gone.
func TestRepeatedChangeAgreesWithItsAnswer(t *testing.T) {
	tests := []struct {
		name   string
		path   string
		change fhReq
		// applied reports whether the change shows in a HEAD answer.
		applied func(h http.Header) bool
	}{
		{
			name:    "close",
			path:    "/ds/repeat",
			change:  fhReq{Method: http.MethodPost, Path: "/ds/repeat", Header: map[string]string{"Stream-Closed": "true"}},
			applied: func(h http.Header) bool { return h.Get("Stream-Closed") == "true" },
		},
		{
			name:    "trim",
			path:    "/pico/repeat",
			change:  fhReq{Method: http.MethodPost, Path: "/pico/repeat", Header: map[string]string{"Pico-Trim-Seq": "1"}},
			applied: func(h http.Header) bool { return h.Get("Pico-Start-Seq") == "1" },
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := picoStart(t, []string{"s3_timeout 500ms", "compact_interval 1h"}, nil)
			e.create("/ds/repeat", "text/plain")
			e.append("/ds/repeat", "text/plain", []byte("a"))
			e.append("/ds/repeat", "text/plain", []byte("b"))
			head := func() http.Header {
				t.Helper()
				resp := e.must(fhReq{Method: http.MethodHead, Path: tc.path})
				if resp.Status != http.StatusOK {
					t.Fatalf("HEAD %s: %s", tc.path, resp)
				}
				return resp.Header
			}
			if tc.applied(head()) {
				t.Fatal("the change shows before it was asked for")
			}

			// Every WAL PUT fails, slowly, until the fault is removed, the
			// seal that would settle the first upload's fate included: the
			// first request's change stays in flight until both requests
			// have been answered.
			remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "wal/", Status: http.StatusServiceUnavailable,
				Stall: 200 * time.Millisecond})
			defer remove()

			var wg sync.WaitGroup
			answers := make([]fhResp, 2)
			errs := make([]error, 2)
			send := func(i int) {
				defer wg.Done()
				answers[i], errs[i] = e.send(tc.change)
			}
			wg.Add(1)
			go send(0)
			if err := fhWaitFor(10*time.Second, 10*time.Millisecond, func() error {
				if e.proxy.Counts().Faults == 0 {
					return errors.New("no fault yet")
				}
				return nil
			}); err != nil {
				t.Fatalf("the first request's upload never reached the fault: %v", err)
			}
			wg.Add(1)
			go send(1)
			wg.Wait()
			acked := false
			for i, resp := range answers {
				if errs[i] != nil {
					t.Fatalf("request %d: %v", i+1, errs[i])
				}
				t.Logf("request %d: %s after %v", i+1, resp, resp.Took.Round(time.Millisecond))
				switch {
				case resp.Status/100 == 2:
					acked = true
				case resp.Status != http.StatusServiceUnavailable:
					t.Fatalf("request %d: %s, want 2xx or 503", i+1, resp)
				}
			}
			if answers[0].Status/100 == 2 {
				t.Fatal("the first request was acknowledged although every attempt of its upload failed")
			}
			// Only now can the first upload's seal land; nothing may show
			// that was not acknowledged.
			remove()
			if acked != tc.applied(head()) {
				t.Fatalf("acknowledged: %v, but the change shows: %v", acked, !acked)
			}

			// With the bucket answering, the change goes through and stays.
			if err := fhWaitFor(30*time.Second, 100*time.Millisecond, func() error {
				resp, err := e.send(tc.change)
				if err != nil {
					return err
				}
				if resp.Status/100 != 2 {
					return fmt.Errorf("answered %s", resp)
				}
				return nil
			}); err != nil {
				t.Fatalf("the change was never acknowledged once the bucket answered: %v", err)
			}
			if !tc.applied(head()) {
				t.Fatal("the change does not show after it was acknowledged")
			}
			e.caddy.Kill()
			e.caddy.Restart()
			if !tc.applied(head()) {
				t.Fatal("the acknowledged change is gone after a restart")
			}
		})
	}
}
