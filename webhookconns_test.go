package picomq

import (
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"
)

// The webhook client's pooled connections end with the engine they
// served: a receiver that keeps idle connections open (Go's own server
// does, with no IdleTimeout) would otherwise hold a socket and two
// goroutines of Caddy's for every webhook host ever called, for the life of
// the process, across reloads.
func TestWebhookConnectionsCloseWithTheEngine(t *testing.T) {
	var mu sync.Mutex
	open := map[net.Conn]bool{}
	recv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`{"done":true}`))
	}))
	recv.Config.ConnState = func(c net.Conn, st http.ConnState) {
		mu.Lock()
		defer mu.Unlock()
		switch st {
		case http.StateNew:
			open[c] = true
		case http.StateClosed, http.StateHijacked:
			delete(open, c)
		}
	}
	recv.Start()
	defer recv.Close()
	conns := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(open)
	}

	n := startSubNode(t, t.TempDir())
	const sub = "/s/__ds/subscriptions/hook"
	if st, v := n.call(t, "PUT", sub, `{"type":"webhook","streams":["orders"],"webhook":{"url":"`+recv.URL+`/h"}}`); st != 201 {
		t.Fatalf("create: %d %v", st, v)
	}
	if st, _ := n.call(t, "PUT", "/s/orders", `{"n":1}`); st != 201 {
		t.Fatalf("create stream: %d", st)
	}
	for deadline := time.Now().Add(5 * time.Second); conns() == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the webhook was never called")
		}
	}
	n.stop(t)
	for deadline := time.Now().Add(3 * time.Second); conns() > 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d connections to the webhook still open 3s after the engine closed", conns())
		}
	}
}
