package picomq

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestSubscriptionLinkLimit: a subscription links at most maxLinks
// streams, explicit and matched by its pattern together. A create whose
// pattern matches more streams than that, or whose pattern and streams
// together would, is 400 and stores nothing; an add past the limit is 400
// and changes nothing; a stream the pattern matches later is not linked
// while the subscription is full (and is counted), and is once a link has
// gone. A "**" pattern linked every stream under its root: the
// subscription's document, written at every claim and ack, grew with
// them without bound.
func TestSubscriptionLinkLimit(t *testing.T) {
	metrics := new(engineMetrics)
	n := startSubNode(t, t.TempDir(), func(d *durableStreams) {
		d.subs.maxLinks = 3
		d.subs.metrics = metrics
	})
	const root, sub = "/v1/stream/", "/v1/stream/__ds/subscriptions/many"
	create := func(name string) {
		t.Helper()
		if st, v := n.call(t, "PUT", root+name, ""); st != 201 {
			t.Fatalf("create %s: %d %v", name, st, v)
		}
	}
	streamsOf := func() []string {
		t.Helper()
		st, v := n.call(t, "GET", sub, "")
		if st != 200 {
			t.Fatalf("GET %s: %d %v", sub, st, v)
		}
		var out []string
		list, _ := v["streams"].([]any)
		for _, x := range list {
			out = append(out, x.(map[string]any)["path"].(string))
		}
		return out
	}
	if st, _ := n.call(t, "PUT", root+"wake", "[]"); st != 201 {
		t.Fatal("create wake stream")
	}
	for i := 1; i <= 4; i++ {
		create(fmt.Sprintf("events/%d", i))
	}
	const glob = `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake"}`
	if st, v := n.call(t, "PUT", sub, glob); st != 400 || errCode(v) != "INVALID_REQUEST" {
		t.Fatalf("create matching 4 streams: %d %v, want 400 INVALID_REQUEST", st, v)
	}
	if st, v := n.call(t, "PUT", sub, `{"type":"pull-wake","pattern":"events/1","streams":["x/1","x/2","x/3"],"wake_stream":"wake"}`); st != 400 || errCode(v) != "INVALID_REQUEST" {
		t.Fatalf("create with a pattern matching 1 stream and 3 streams: %d %v, want 400 INVALID_REQUEST", st, v)
	}
	if st, v := n.call(t, "GET", sub, ""); st != 404 {
		t.Fatalf("GET after the refused creates: %d %v, want 404", st, v)
	}
	if st, v := n.call(t, "DELETE", root+"events/4", ""); st != 204 && st != 200 {
		t.Fatalf("delete events/4: %d %v", st, v)
	}
	if st, v := n.call(t, "PUT", sub, glob); st != 201 {
		t.Fatalf("create matching 3 streams: %d %v", st, v)
	}
	if st, v := n.call(t, "POST", sub+"/streams", `{"streams":["events/1","x/1"]}`); st != 400 || errCode(v) != "INVALID_REQUEST" {
		t.Fatalf("adding a fourth stream: %d %v, want 400", st, v)
	}
	if st, v := n.call(t, "POST", sub+"/streams", `{"streams":["events/1"]}`); st != 204 {
		t.Fatalf("adding a stream it links by its pattern: %d %v, want 204", st, v)
	}
	if got := streamsOf(); len(got) != 3 {
		t.Fatalf("streams after the adds: %v, want 3", got)
	}
	// Records pending on every link: none can make way. (The manager
	// applies the appends in order: these before the fifth stream's.)
	for i := 1; i <= 3; i++ {
		if st, v := n.call(t, "POST", root+fmt.Sprintf("events/%d", i), `{"n":1}`); st != 204 && st != 200 {
			t.Fatalf("append to events/%d: %d %v", i, st, v)
		}
	}
	// A fifth stream the pattern matches gets records: not linked.
	if st, v := n.call(t, "PUT", root+"events/5", `{"n":1}`); st != 201 {
		t.Fatalf("create events/5: %d %v", st, v)
	}
	deadline := time.Now().Add(10 * time.Second)
	for metrics.subLinksRefused.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if metrics.subLinksRefused.Load() == 0 {
		t.Fatal("the append to events/5 was not counted as a refused link")
	}
	if got := streamsOf(); len(got) != 3 {
		t.Fatalf("streams after an append to a fourth match: %v, want 3", got)
	}
	// With room again, the next append links it.
	if st, v := n.call(t, "DELETE", root+"events/3", ""); st != 204 && st != 200 {
		t.Fatalf("delete events/3: %d %v", st, v)
	}
	deadline = time.Now().Add(10 * time.Second)
	for len(streamsOf()) != 2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if st, v := n.call(t, "POST", root+"events/5", `{"n":2}`); st != 204 && st != 200 {
		t.Fatalf("append to events/5: %d %v", st, v)
	}
	deadline = time.Now().Add(10 * time.Second)
	for len(streamsOf()) != 3 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := streamsOf(); len(got) != 3 || got[2] != "events/5" {
		t.Fatalf("streams after events/3 went and events/5 got a record: %v, want events/5 among 3", got)
	}

	// Everything acked: a link with nothing pending makes way for a new
	// stream the pattern matches, which is linked from its record on. A
	// pattern over streams never deleted (a room per chat) used to stop
	// following new ones for good once full.
	ackAll(t, n, sub)
	refused := metrics.subLinksRefused.Load()
	if st, v := n.call(t, "PUT", root+"events/6", `{"n":1}`); st != 201 {
		t.Fatalf("create events/6: %d %v", st, v)
	}
	deadline = time.Now().Add(10 * time.Second)
	for !slices.Contains(streamsOf(), "events/6") && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	// events/1 is explicit; events/2 is the first glob link by name.
	got := streamsOf()
	if !slices.Contains(got, "events/6") || len(got) != 3 || slices.Contains(got, "events/2") {
		t.Fatalf("streams after everything was acked and events/6 got a record: %v; want events/6 in place of events/2, 3 in all", got)
	}
	if r := metrics.subLinksRefused.Load(); r != refused {
		t.Fatalf("%d links refused while one could make way", r-refused)
	}
	if pending := claimPending(t, n, sub); !slices.Equal(pending, []string{"events/6"}) {
		t.Fatalf("pending after events/6's record: %v; want events/6", pending)
	}
}

// claimPending claims subscription sub's wake and returns the streams it
// has records pending on.
func claimPending(t *testing.T, n *subNode, sub string) []string {
	t.Helper()
	claim := claimWake(t, n, sub)
	var out []string
	for _, x := range claim["streams"].([]any) {
		if l := x.(map[string]any); l["has_pending"] == true {
			out = append(out, l["path"].(string))
		}
	}
	return out
}

// claimWake claims subscription sub's wake, waiting for one.
func claimWake(t *testing.T, n *subNode, sub string) map[string]any {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, claim := n.call(t, "POST", sub+"/claim", `{"worker":"w1"}`)
		if st == 200 {
			return claim
		}
		if time.Now().After(deadline) {
			t.Fatalf("claim: %d %v", st, claim)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// ackAll claims subscription sub's wake and acks every link to its tail,
// ending the wake.
func ackAll(t *testing.T, n *subNode, sub string) {
	t.Helper()
	claim := claimWake(t, n, sub)
	var acks []string
	for _, x := range claim["streams"].([]any) {
		l := x.(map[string]any)
		acks = append(acks, fmt.Sprintf(`{"stream":%q,"offset":%q}`, l["path"], l["tail_offset"]))
	}
	body := fmt.Sprintf(`{"wake_id":%q,"generation":%v,"acks":[%s],"done":true}`,
		claim["wake_id"], claim["generation"], strings.Join(acks, ","))
	if st, v := n.call(t, "POST", sub+"/ack", body, "Authorization", "Bearer "+claim["token"].(string)); st != 200 {
		t.Fatalf("ack of everything: %d %v", st, v)
	}
	if st, v := n.call(t, "POST", sub+"/claim", `{"worker":"w1"}`); st != 409 || errCode(v) != "NO_PENDING_WORK" {
		t.Fatalf("claim after acking every link to its tail: %d %v; want 409 NO_PENDING_WORK", st, v)
	}
}
