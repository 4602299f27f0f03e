package picomq

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"
)

// A process of the same node id takes the storage over at once, while the
// one it replaced keeps its subscriptions in memory, its lease valid by its
// own clock. A subscription change that process saves finds another
// version of the document (the new owner's), and saving took that for a
// write of its own whose answer was lost and wrote over it: the new
// owner's acknowledged ack was undone.
func TestReplacedProcessKeepsOffSubscriptions(t *testing.T) {
	dir := t.TempDir()
	old := startSubNode(t, dir)
	const sub = "/v1/stream/__ds/subscriptions/p1"
	old.pullSubscribe(t, sub)
	if st, _ := old.call(t, "PUT", "/v1/stream/events/a", `{"n":1}`); st != 201 {
		t.Fatalf("create stream: %d", st)
	}
	var claim map[string]any
	for deadline := time.Now().Add(5 * time.Second); ; {
		st, v := old.call(t, "POST", sub+"/claim", `{"worker":"w1"}`)
		if st == 200 {
			claim = v
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("claim: %d %v", st, v)
		}
		time.Sleep(20 * time.Millisecond)
	}
	gen := strconv.Itoa(int(claim["generation"].(float64)))
	token, wake := claim["token"].(string), claim["wake_id"].(string)
	tail := claim["streams"].([]any)[0].(map[string]any)["tail_offset"].(string)

	cur := startSubNode(t, dir) // the same node id: at once
	ack := `{"wake_id":"` + wake + `","generation":` + gen + `,"acks":[{"stream":"events/a","offset":"` + tail + `"}],"done":true}`
	if st, v := cur.call(t, "POST", sub+"/ack", ack, "Authorization", "Bearer "+token); st != 200 {
		t.Fatalf("ack on the new owner: %d %v", st, v)
	}
	// The replaced process lets the wake go; whatever it answers, it must
	// not write the subscription the new owner holds.
	st, v := old.call(t, "POST", sub+"/release", `{"wake_id":"`+wake+`","generation":`+gen+`}`, "Authorization", "Bearer "+token)
	t.Logf("release on the replaced process: %d %v", st, v)
	// It finds another process's version of the document, and the lease
	// object another's: it is told so, as a stream's write is.
	errBody, _ := v["error"].(map[string]any)
	if msg, _ := errBody["message"].(string); st != 503 || !strings.Contains(msg, "another server took this storage over") {
		t.Errorf("release on the replaced process: %d %v, want 503 saying another server took this storage over", st, v)
	}
	old.Close()
	// Its lease is another's: giving it up fails, and says so.
	_ = old.eng.Close(context.Background())

	cur.stop(t)
	again := startSubNode(t, dir)
	st, v = again.call(t, "GET", sub, "")
	if st != 200 {
		t.Fatalf("get: %d %v", st, v)
	}
	if link := v["streams"].([]any)[0].(map[string]any); link["acked_offset"] != tail {
		t.Errorf("after the replaced process's release the subscription has acked %v, want %s (the new owner's ack)",
			link["acked_offset"], tail)
	}
}

// A DELETE served by the replaced process finds the new owner's version
// of the document too. Deleting that version instead, as if it were a
// write of its own whose answer was lost, put a grave over a subscription
// the new owner serves and had just written: the delete must be refused
// as the replaced process's other writes are, and leave the document be.
func TestReplacedProcessDeletesNoSubscription(t *testing.T) {
	dir := t.TempDir()
	old := startSubNode(t, dir)
	const sub = "/v1/stream/__ds/subscriptions/p1"
	old.pullSubscribe(t, sub)
	if st, _ := old.call(t, "PUT", "/v1/stream/events/a", `{"n":1}`); st != 201 {
		t.Fatalf("create stream: %d", st)
	}
	for deadline := time.Now().Add(5 * time.Second); ; {
		_, v := old.call(t, "GET", sub, "")
		if g, _ := v["generation"].(float64); g > 0 {
			break // the wake is in the old process's document
		}
		if time.Now().After(deadline) {
			t.Fatalf("no wake on the old process: %v", v)
		}
		time.Sleep(20 * time.Millisecond)
	}

	cur := startSubNode(t, dir) // the same node id: at once
	if st, v := cur.call(t, "POST", sub+"/claim", `{"worker":"w1"}`); st != 200 {
		t.Fatalf("claim on the new owner: %d %v", st, v)
	}
	st, v := old.call(t, "DELETE", sub, "")
	t.Logf("delete on the replaced process: %d %v", st, v)
	errBody, _ := v["error"].(map[string]any)
	if msg, _ := errBody["message"].(string); st != 503 || !strings.Contains(msg, "another server took this storage over") {
		t.Errorf("delete on the replaced process: %d %v, want 503 saying another server took this storage over", st, v)
	}
	old.Close()
	_ = old.eng.Close(context.Background())

	cur.stop(t)
	again := startSubNode(t, dir)
	if st, v := again.call(t, "GET", sub, ""); st != 200 {
		t.Fatalf("after the replaced process's delete the subscription is %d %v, want 200 (the new owner's claim holds)", st, v)
	}
}
