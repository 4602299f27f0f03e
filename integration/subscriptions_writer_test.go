package integration

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestSubscriptionWriteHoldsUpNoOther: while the bucket has not answered
// the write of one subscription's document (an ack of s0, its PUT parked
// by the proxy), an ack of another subscription and a read of s0 are
// answered, the read with s0 as it was saved. The manager wrote every
// document while holding its one lock, so both waited for s0's PUT: the
// ack of s1 hung until the parked write was let go (or s0's write gave
// up, 30 s later).
func TestSubscriptionWriteHoldsUpNoOther(t *testing.T) {
	e := fhStart(t, fhOptions{})
	ws := subAckSetup(t, e, 2)
	auth := func(w subAckWorker) map[string]string {
		return map[string]string{"Content-Type": "application/json", "Authorization": "Bearer " + w.token}
	}
	// Document keys are subs/<hex root>/<hex id>.
	// Every write of s0's document is parked, retries too, until release.
	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: fmt.Sprintf("subs/%x/%x", "/r/", "s0")})
	t.Cleanup(release)
	ackA := make(chan fhResp, 1)
	go func() {
		r, err := e.send(fhReq{Method: http.MethodPost, Path: ws[0].ack, Body: []byte(ws[0].body), Header: auth(ws[0])})
		if err != nil {
			r.Status = 0
		}
		ackA <- r
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := e.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("the write of s0's document never reached the bucket: %v", err)
	}
	// The timeout tells a request held up by s0's write from one served:
	// nothing else here waits for the parked request.
	short := &http.Client{Timeout: 20 * time.Second}
	t.Cleanup(short.CloseIdleConnections)
	r, err := fhSend(short, e.caddy.URL(), fhReq{Method: http.MethodPost, Path: ws[1].ack, Body: []byte(ws[1].body), Header: auth(ws[1])})
	if err != nil || r.Status != http.StatusOK {
		t.Fatalf("ack of s1 while s0's document is being written: %v %v", r, err)
	}
	r, err = fhSend(short, e.caddy.URL(), fhReq{Method: http.MethodGet, Path: "/r/__ds/subscriptions/s0"})
	if err != nil || r.Status != http.StatusOK {
		t.Fatalf("read of s0 while its document is being written: %v %v", r, err)
	}
	select {
	case r := <-ackA:
		t.Fatalf("the ack of s0 was answered (%v) before its parked write was let go", r)
	default:
	}
	release()
	if r := <-ackA; r.Status != http.StatusOK {
		t.Fatalf("ack of s0 once its write landed: %v", r)
	}
}
