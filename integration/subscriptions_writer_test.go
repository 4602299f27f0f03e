package integration

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
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

// TestSubscriptionSlowReaderHoldsUpNoOther: a client that leaves large
// answers unread holds up no other subscription request. The handlers
// answered while holding the manager's lock, so the read of one
// subscription whose answer no longer fitted the sockets' buffers kept
// the lock for as long as its client did not read: every other request
// of the engine's subscriptions, and the loop that wakes them, waited.
func TestSubscriptionSlowReaderHoldsUpNoOther(t *testing.T) {
	e := fhStart(t, fhOptions{})
	e.create("/r/wake", "application/json")
	// The largest answer a subscription gives: as many explicit streams
	// as it may link, each named with as many bytes as a name may hold,
	// every one a '<' that the view's JSON spells \u003c. That is 1.6 MB;
	// the reads below ask for it six times on one connection, more than
	// the server's send buffer (at most 4 MiB here) and the client's
	// receive buffer hold. The streams need not exist.
	names := make([]string, 1000)
	for i := range names {
		name := fmt.Sprintf("%03d", i)
		names[i] = `"` + name + strings.Repeat("<", 256-len("/r/")-len(name)) + `"`
	}
	for _, c := range []struct{ id, body string }{
		{"big", `{"type":"pull-wake","streams":[` + strings.Join(names, ",") + `],"wake_stream":"wake"}`},
		{"small", `{"type":"pull-wake","pattern":"other/*","wake_stream":"wake"}`},
	} {
		if st, v := e.subCall(http.MethodPut, "/r/__ds/subscriptions/"+c.id, c.body); st != http.StatusCreated {
			t.Fatalf("create subscription %s: %d %s", c.id, st, fhClip(fmt.Sprint(v), 300))
		}
	}
	u, err := url.Parse(e.caddy.URL())
	if err != nil {
		t.Fatal(err)
	}
	conn, err := net.Dial("tcp", u.Host)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	if err := conn.(*net.TCPConn).SetReadBuffer(4096); err != nil {
		t.Fatal(err)
	}
	// Pipelined: the server takes each once it has written the answer
	// before, so the later ones are answered while the first wait unread.
	get := fmt.Sprintf("GET /r/__ds/subscriptions/big HTTP/1.1\r\nHost: %s\r\n\r\n", u.Host)
	if _, err := io.WriteString(conn, strings.Repeat(get, 6)); err != nil {
		t.Fatal(err)
	}
	// The answers are being written once the first byte is here; nothing
	// more is read, so the rest of them waits in the server's writes.
	conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, err := conn.Read(make([]byte, 1)); err != nil {
		t.Fatalf("the large answer never began: %v", err)
	}
	// The server gets to the answer whose write waits a moment after the
	// first byte: reads of another subscription are made for a second,
	// so that the later ones come after it, and each is answered.
	short := &http.Client{Timeout: 20 * time.Second}
	t.Cleanup(short.CloseIdleConnections)
	for i := range 20 {
		r, err := fhSend(short, e.caddy.URL(), fhReq{Method: http.MethodGet, Path: "/r/__ds/subscriptions/small"})
		if err != nil || r.Status != http.StatusOK {
			t.Fatalf("read %d of another subscription while a client leaves its answers unread: %v %v", i, r, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
