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
