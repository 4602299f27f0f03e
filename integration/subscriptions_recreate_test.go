package integration

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// subOffset is the Durable Streams offset of the position before seq.
func subOffset(seq int) string { return fmt.Sprintf("%016d_%016d", seq, 0) }

// subCall sends a JSON request and decodes the JSON answer (nil when the
// body is not JSON).
func (e *fhEnv) subCall(method, path, body string, hdr ...string) (int, map[string]any) {
	e.t.Helper()
	h := map[string]string{"Content-Type": "application/json"}
	for i := 0; i+1 < len(hdr); i += 2 {
		h[hdr[i]] = hdr[i+1]
	}
	var b []byte
	if body != "" {
		b = []byte(body)
	}
	resp := e.must(fhReq{Method: method, Path: path, Header: h, Body: b})
	var v map[string]any
	_ = json.Unmarshal(resp.Body, &v)
	return resp.Status, v
}

// wakeCount counts the wake events for subscription id on the wake stream.
func (e *fhEnv) wakeCount(wake, id string) int {
	e.t.Helper()
	msgs, _, err := e.readJSON(wake)
	if err != nil {
		e.t.Fatalf("reading the wake stream: %v", err)
	}
	n := 0
	for _, m := range msgs {
		if strings.Contains(string(m), `"subscription_id":"`+id+`"`) {
			n++
		}
	}
	return n
}

// waitWakes waits up to 15 s until the wake stream holds want wake events
// of subscription id, and says how many it saw if it does not.
func (e *fhEnv) waitWakes(wake, id string, want int) error {
	e.t.Helper()
	return fhWaitFor(15*time.Second, 20*time.Millisecond, func() error {
		if n := e.wakeCount(wake, id); n < want {
			return fmt.Errorf("%d wake events", n)
		}
		return nil
	})
}

// subLinkView is one stream of a claim answer.
type subLinkView struct{ acked, tail string }

// claimAndAck claims subscription sub, acks every linked stream at its
// tail with done, and returns what the claim offered, by path.
func (e *fhEnv) claimAndAck(sub string) map[string]subLinkView {
	e.t.Helper()
	st, claim := e.subCall("POST", sub+"/claim", `{"worker":"w1"}`)
	if st != http.StatusOK {
		e.t.Fatalf("claim %s: %d %v", sub, st, claim)
	}
	links := map[string]subLinkView{}
	var acks []string
	for _, s := range claim["streams"].([]any) {
		l := s.(map[string]any)
		p, tail := l["path"].(string), l["tail_offset"].(string)
		links[p] = subLinkView{acked: l["acked_offset"].(string), tail: tail}
		acks = append(acks, `{"stream":"`+p+`","offset":"`+tail+`"}`)
	}
	body := `{"wake_id":"` + claim["wake_id"].(string) + `","generation":` +
		strconv.Itoa(int(claim["generation"].(float64))) + `,"acks":[` + strings.Join(acks, ",") + `],"done":true}`
	if st, v := e.subCall("POST", sub+"/ack", body, "Authorization", "Bearer "+claim["token"].(string)); st != http.StatusOK || v["ok"] != true {
		e.t.Fatalf("ack %s: %d %v", sub, st, v)
	}
	return links
}

// TestSubscriptionFollowsRecreatedStream: a stream linked to pull-wake
// subscriptions (one by glob, one explicitly) is consumed and acked, then
// deleted and created again under the same name. The new stream starts at
// seq 0 again, and its records must reach the consumer: a wake, and a
// claim offering them from the new stream's start. Before, the links kept
// the old stream's acked offset and tail, so records of the new stream
// below them woke nobody. The second half does the same while the
// subscription documents cannot be written, and then kills Caddy: the
// restart loads links that name the old stream, and must notice that the
// stream under that name is another one now.
func TestSubscriptionFollowsRecreatedStream(t *testing.T) {
	e := fhStart(t, fhOptions{})
	const wake = "/r/wake"
	subs := map[string]string{
		"glob":     `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake","lease_ttl_ms":600000}`,
		"explicit": `{"type":"pull-wake","streams":["events/a"],"wake_stream":"wake","lease_ttl_ms":600000}`,
	}
	e.create(wake, "application/json")
	for id, cfg := range subs {
		if st, v := e.subCall("PUT", "/r/__ds/subscriptions/"+id, cfg); st != http.StatusCreated {
			t.Fatalf("create subscription %s: %d %v", id, st, v)
		}
	}
	appendN := func(n int) {
		t.Helper()
		for i := 0; i < n; i++ {
			e.append("/r/events/a", "application/json", []byte(`{"n":`+strconv.Itoa(i)+`}`))
		}
	}
	// consume waits for wake event number n of every subscription and
	// checks what a claim then offers for events/a.
	consume := func(step string, n int, want subLinkView) {
		t.Helper()
		for id := range subs {
			sub := "/r/__ds/subscriptions/" + id
			err := fhWaitFor(15*time.Second, 50*time.Millisecond, func() error {
				if got := e.wakeCount(wake, id); got < n {
					return fmt.Errorf("%d wake events", got)
				}
				return nil
			})
			if err != nil {
				_, v := e.subCall("GET", sub, "")
				t.Fatalf("%s: subscription %s not woken for events/a: %v; its links: %v", step, id, err, v["streams"])
			}
			if got := e.claimAndAck(sub)["events/a"]; got != want {
				t.Fatalf("%s: subscription %s offered events/a from %s to %s; want %s to %s", step, id, got.acked, got.tail, want.acked, want.tail)
			}
		}
	}

	e.create("/r/events/a", "application/json")
	appendN(3)
	consume("first stream", 1, subLinkView{subOffset(0), subOffset(3)})

	if resp := e.must(fhReq{Method: http.MethodDelete, Path: "/r/events/a"}); resp.Status != http.StatusNoContent {
		t.Fatalf("delete events/a: %s", resp)
	}
	e.create("/r/events/a", "application/json")
	appendN(2)
	consume("recreated stream", 2, subLinkView{subOffset(0), subOffset(2)})

	// Again, but no subscription document can be written meanwhile, and
	// Caddy dies before it can: the restart finds the links as they were
	// before the delete.
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/subs/", Status: http.StatusServiceUnavailable})
	if resp := e.must(fhReq{Method: http.MethodDelete, Path: "/r/events/a"}); resp.Status != http.StatusNoContent {
		t.Fatalf("delete events/a: %s", resp)
	}
	e.create("/r/events/a", "application/json")
	appendN(1)
	e.caddy.Kill()
	remove()
	e.caddy.Restart()
	if err := waitServing(e.caddy, 60*time.Second); err != nil {
		t.Fatal(err)
	}
	consume("stream recreated before a crash", 3, subLinkView{subOffset(0), subOffset(1)})
}
