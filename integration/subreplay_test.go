package integration

import (
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestPatternLinkLostInACrashThroughCaddy: through Caddy on versitygw, a
// new stream that a subscription's pattern matches is linked by its first
// append before the append is acknowledged, but the document that keeps
// the link is written after. Here that write fails (storage refuses the
// subscription documents) and Caddy is killed: the restart links the
// stream again from the appends its replay of the WAL found, at offset 0.
// It was not linked until its next append, and then from there: the
// acknowledged record 0 was never offered.
func TestPatternLinkLostInACrashThroughCaddy(t *testing.T) {
	e := fhStart(t, fhOptions{})
	const root = "/v1/stream/"
	sub := root + "__ds/subscriptions/p1"
	e.create(root+"wake", "application/json")
	if st, v := e.subCall("PUT", sub, `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake"}`); st != http.StatusCreated {
		t.Fatalf("create the subscription: %d %v", st, v)
	}
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "subs/", Status: http.StatusServiceUnavailable})
	if r := e.must(fhReq{Method: http.MethodPut, Path: root + "events/new", Header: map[string]string{"Content-Type": "application/json"}, Body: []byte(`[{"n":1}]`)}); r.Status != http.StatusCreated {
		t.Fatalf("create events/new: %s", r)
	}
	// Linked in memory (a GET answers from there), not in the bucket.
	if !waitFor(10*time.Second, func() bool {
		_, v := e.subCall("GET", sub, "")
		_, ok := subLinkedAt(v, "events/new")
		return ok
	}) {
		t.Fatal("events/new not linked in memory")
	}
	e.caddy.Kill()
	remove()
	if err := e.caddy.TryRestart(); err != nil {
		t.Fatalf("restart: %v", err)
	}
	st, v := e.subCall("GET", sub, "")
	acked, ok := subLinkedAt(v, "events/new")
	if st != http.StatusOK || !ok || acked != "0000000000000000_0000000000000000" {
		t.Fatalf("after the crash: %d, events/new linked %v at %q; want at offset 0 (%v)", st, ok, acked, v)
	}
	if !waitFor(10*time.Second, func() bool { return e.wakeCount(root+"wake", "p1") >= 1 }) {
		t.Error("no wake for the stream linked again")
	}
}

// subLinkedAt is the acked offset at which subscription view v links
// stream path, and whether it does.
func subLinkedAt(v map[string]any, path string) (string, bool) {
	streams, _ := v["streams"].([]any)
	for _, x := range streams {
		l, _ := x.(map[string]any)
		if l["path"] == path {
			acked, _ := l["acked_offset"].(string)
			return acked, true
		}
	}
	return "", false
}
