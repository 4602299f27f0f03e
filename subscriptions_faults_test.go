package picomq

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/streamstore"
)

// wakeEvents returns the wake stream's body.
func (n *subNode) wakeEvents(t *testing.T, path string) string {
	t.Helper()
	res, err := http.Get(n.URL + path + "?offset=-1")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	if res.StatusCode != 200 {
		return ""
	}
	return string(b)
}

// A pull-wake whose wake event could not be appended (here its wake
// stream did not exist yet; a storage error does the same) is announced
// again, with backoff, until a worker claims it. It used to stay in
// flight unannounced for good: no lease runs for an unclaimed pull-wake,
// no other wake starts while one is in flight, and nothing retried the
// append, so pending work never produced a wake event again.
func TestPullWakeAnnouncedAgainAfterFailedAppend(t *testing.T) {
	n := startSubNode(t, t.TempDir())
	const sub = "/v1/stream/__ds/subscriptions/p1"
	if st, v := n.call(t, "PUT", sub, `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake/pool","lease_ttl_ms":1000}`); st != 201 {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	if st, _ := n.call(t, "PUT", "/v1/stream/events/a", `{"n":1}`); st != 201 {
		t.Fatalf("create stream: %d", st)
	}
	// The wake is issued; its event append fails (no wake stream). Wait
	// for that failure to be recorded (status "failed": Failures > 0 and a
	// retry time set) before the wake stream exists, or the append may run
	// after it and succeed, leaving the retry path untested.
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, v := n.call(t, "GET", sub, "")
		if v["status"] == "failed" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the wake event's append never failed (subscription %v): nothing tested", v)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if st, _ := n.call(t, "PUT", "/v1/stream/wake/pool", "[]"); st != 201 {
		t.Fatalf("create wake stream: %d", st)
	}
	// More records arrive; the subscription has pending work.
	for i := 0; i < 3; i++ {
		if st, _ := n.call(t, "POST", "/v1/stream/events/a", `{"n":2}`); st != 204 {
			t.Fatalf("append: %d", st)
		}
	}
	deadline = time.Now().Add(5 * time.Second) // five lease TTLs
	for time.Now().Before(deadline) {
		if strings.Contains(n.wakeEvents(t, "/v1/stream/wake/pool"), `"subscription_id":"p1"`) {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	_, v := n.call(t, "GET", sub, "")
	t.Fatalf("no wake event in 5s although the subscription has pending work: %v; wake stream %q",
		v["streams"], n.wakeEvents(t, "/v1/stream/wake/pool"))
}

// An ack whose second entry names a stream the subscription does not link
// is refused (409 INVALID_OFFSET, as the reference server answers) and
// moves no cursor: once, the first entry had already moved its link's
// before the bad one was found, and the next save made that durable.
func TestRefusedAckMovesNoCursor(t *testing.T) {
	n := startSubNode(t, t.TempDir())
	const sub = "/v1/stream/__ds/subscriptions/p1"
	n.pullSubscribe(t, sub)
	if st, _ := n.call(t, "PUT", "/v1/stream/events/a", `{"n":1}`); st != 201 {
		t.Fatalf("create stream: %d", st)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(n.wakeEvents(t, "/v1/stream/wake/pool"), `"subscription_id":"p1"`) {
		if time.Now().After(deadline) {
			t.Fatal("no wake event")
		}
		time.Sleep(20 * time.Millisecond)
	}
	st, claim := n.call(t, "POST", sub+"/claim", `{"worker":"w1"}`)
	if st != 200 {
		t.Fatalf("claim: %d %v", st, claim)
	}
	token, wake := claim["token"].(string), claim["wake_id"].(string)
	gen := int(claim["generation"].(float64))
	tail := claim["streams"].([]any)[0].(map[string]any)["tail_offset"].(string)
	body := `{"wake_id":"` + wake + `","generation":` + strconv.Itoa(gen) + `,"acks":[` +
		`{"stream":"events/a","offset":"` + tail + `"},{"stream":"events/not-linked","offset":"` + tail + `"}]}`
	if st, v := n.call(t, "POST", sub+"/ack", body, "Authorization", "Bearer "+token); st != 409 || errCode(v) != "INVALID_OFFSET" {
		t.Fatalf("ack with a bad entry: %d %v, want 409 INVALID_OFFSET", st, v)
	}
	_, v := n.call(t, "GET", sub, "")
	link := v["streams"].([]any)[0].(map[string]any)
	if link["acked_offset"] != (position{}).String() {
		t.Fatalf("after a refused (409) ack, events/a is acked at %v; want it unchanged at %s", link["acked_offset"], position{})
	}
}

// A heartbeat that arrives after its lease ran out, but before the
// manager's tick has cleared it, is fenced (409): section 7.3 ends a lease
// at its time. It used to be accepted and to renew the lease, since only
// the tick looked at LeaseUntil, not checkWakeLocked. The tick runs once
// an hour here, so the handler's own check is the only one that can end
// the lease before the heartbeat.
func TestHeartbeatAfterLeaseExpiryIsFenced(t *testing.T) {
	n := startSubNode(t, t.TempDir(), func(d *durableStreams) { d.subs.tick = time.Hour })
	const sub = "/v1/stream/__ds/subscriptions/p1"
	if st, _ := n.call(t, "PUT", "/v1/stream/wake/pool", "[]"); st != 201 {
		t.Fatal("wake stream")
	}
	if st, v := n.call(t, "PUT", sub, `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake/pool","lease_ttl_ms":1000}`); st != 201 {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	// Pending work, never acked: there is a wake to claim.
	if st, _ := n.call(t, "PUT", "/v1/stream/events/a", `{"n":1}`); st != 201 {
		t.Fatal("events/a")
	}
	st, claim := n.call(t, "POST", sub+"/claim", `{"worker":"w1"}`)
	if st != 200 {
		t.Fatalf("claim: %d %v", st, claim)
	}
	claimed := time.Now()
	token, wake := claim["token"].(string), claim["wake_id"].(string)
	gen := int(claim["generation"].(float64))
	// The lease ran out at most claimed+1s.
	time.Sleep(time.Until(claimed.Add(time.Second + 3*time.Millisecond)))
	body := `{"wake_id":"` + wake + `","generation":` + strconv.Itoa(gen) + `}`
	if st, v := n.call(t, "POST", sub+"/ack", body, "Authorization", "Bearer "+token); st != 409 || errCode(v) != "FENCED" {
		t.Fatalf("heartbeat %v after the lease expired: %d %v, want 409 FENCED", time.Since(claimed)-time.Second, st, v)
	}
}

// countWakes counts the wake events of subscription id on the wake stream.

// A subscription document that no longer decodes (bit rot on a local
// disk, a bad restore) is damage, as a stream's damaged metadata is: its
// subscription answers 500 naming the object instead of 404, the load logs
// it at error level and counts it in picomq_damaged_objects_total, and a
// create of the same id replaces it. It used to be skipped with a warning,
// the subscription silently gone.
func TestDamagedSubscriptionDocumentAnswers500(t *testing.T) {
	dir := t.TempDir()
	n := startSubNode(t, dir)
	const sub = "/v1/stream/__ds/subscriptions/p1"
	n.pullSubscribe(t, sub)
	n.stop(t)
	key := subDocKey("/v1/stream/", "p1")
	damageSubDoc(t, dir, key)

	metrics := new(engineMetrics)
	n = startSubNode(t, dir, func(d *durableStreams) { d.subs.metrics = metrics })
	for range 2 {
		st, v := n.call(t, "GET", sub, "")
		msg, _ := v["error"].(map[string]any)["message"].(string)
		if st != 500 || errCode(v) != "SUBSCRIPTION_DAMAGED" || !strings.Contains(msg, streamstore.DocObjectKey(key)) {
			t.Fatalf("GET of the subscription with a damaged document: %d %v; want 500 SUBSCRIPTION_DAMAGED naming %s", st, v, streamstore.DocObjectKey(key))
		}
	}
	if got := metrics.subDocsDamaged.Load(); got != 1 {
		t.Fatalf("%d damaged subscription documents counted; want 1", got)
	}
	if st, v := n.call(t, "PUT", sub, `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake/pool","lease_ttl_ms":600000}`); st != 201 {
		t.Fatalf("create the subscription again: %d %v", st, v)
	}
	if st, v := n.call(t, "GET", sub, ""); st != 200 {
		t.Fatalf("GET after the subscription was created again: %d %v", st, v)
	}
}

// damageSubDoc cuts the document key in the file store at dir short, as
// the module never writes it: a new inode.
func damageSubDoc(t *testing.T, dir, key string) {
	t.Helper()
	path := filepath.Join(dir, filepath.FromSlash(streamstore.DocObjectKey(key)))
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("the subscription's document: %v", err)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data[:len(data)/2], 0o644); err != nil {
		t.Fatal(err)
	}
}

// startWithDamagedSub starts a node whose pull-wake subscription p1 under
// /v1/stream/ has a damaged document (a GET of it is 500), and returns it
// with its directory and the document's key.
func startWithDamagedSub(t *testing.T) (*subNode, string, string) {
	t.Helper()
	dir := t.TempDir()
	n := startSubNode(t, dir)
	const sub = "/v1/stream/__ds/subscriptions/p1"
	n.pullSubscribe(t, sub)
	n.stop(t)
	key := subDocKey("/v1/stream/", "p1")
	damageSubDoc(t, dir, key)
	n = startSubNode(t, dir)
	if st, v := n.call(t, "GET", sub, ""); st != 500 {
		t.Fatalf("GET of the damaged subscription: %d %v", st, v)
	}
	return n, dir, key
}

// TestDamagedSubscriptionDocumentIsDeleted: a DELETE of a subscription
// whose document is damaged deletes the document (section 6.3). It
// answered 204 and deleted nothing: the next GET, and every start after,
// still found it damaged.
func TestDamagedSubscriptionDocumentIsDeleted(t *testing.T) {
	n, dir, key := startWithDamagedSub(t)
	const sub = "/v1/stream/__ds/subscriptions/p1"
	if st, v := n.call(t, "DELETE", sub, ""); st != 204 {
		t.Fatalf("DELETE: %d %v", st, v)
	}
	for _, when := range []string{"after the delete", "after a restart"} {
		if st, v := n.call(t, "GET", sub, ""); st != 404 {
			t.Errorf("GET %s: %d %v, want 404", when, st, v)
		}
		if _, _, err := n.eng.GetDoc(context.Background(), key); !errors.Is(err, streamstore.ErrNotFound) {
			t.Errorf("the document %s: %v, want none", when, err)
		}
		n.stop(t)
		n = startSubNode(t, dir)
	}
	if st, v := n.call(t, "DELETE", sub, ""); st != 204 {
		t.Errorf("DELETE repeated: %d %v", st, v)
	}
}

// TestRefusedControlRequestsWriteNothing: a control request refused on
// its own (not JSON, no such resource, a method it does not take) is
// answered before the signing key is made: on a bucket without one, each
// used to write it first.
func TestRefusedControlRequestsWriteNothing(t *testing.T) {
	dir := t.TempDir()
	n := startSubNode(t, dir)
	for _, tc := range []struct {
		method, path, body string
		status             int
	}{
		{"PUT", "/v1/stream/__ds/subscriptions/x", `{`, 400},
		{"POST", "/v1/stream/__ds/subscriptions/x/streams", `{"streams":`, 400},
		{"GET", "/v1/stream/__ds/bogus", "", 404},
		{"PATCH", "/v1/stream/__ds/subscriptions/x", `{}`, 405},
		{"PUT", "/v1/stream/__ds/subscriptions/x", `{"type":"pull-wake"}`, 400},
	} {
		if st, v := n.call(t, tc.method, tc.path, tc.body); st != tc.status {
			t.Errorf("%s %s %s: %d %v, want %d", tc.method, tc.path, tc.body, st, v, tc.status)
		}
	}
	key := filepath.Join(dir, filepath.FromSlash(streamstore.DocObjectKey(signatureKeyDocKey)))
	if _, err := os.Stat(key); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the signing key after refused requests only: %v, want none", err)
	}
}

// TestControlBodyOfWhitespace: a control request's body of whitespace
// only is an empty one ({}), as before its body was read ahead of the
// storage work: read again with the first length, it was 400.
func TestControlBodyOfWhitespace(t *testing.T) {
	n := startSubNode(t, t.TempDir())
	const sub = "/v1/stream/__ds/subscriptions/p1"
	n.pullSubscribe(t, sub)
	// A claim without a worker: 400, for the worker it lacks.
	want, wantV := n.call(t, "POST", sub+"/claim", "{}")
	for _, body := range []string{" ", "\n", "   \n"} {
		if st, v := n.call(t, "POST", sub+"/claim", body); st != want || fmt.Sprint(v) != fmt.Sprint(wantV) {
			t.Errorf("claim with body %q: %d %v, want %d %v as with {}", body, st, v, want, wantV)
		}
	}
}

// TestDeleteOfADamagedSubscriptionWaitsForItsCreate: a DELETE of an id
// whose document is damaged, while a create of the id is being written
// (which replaces the damaged document), waits for the create and deletes
// what it made. It took the damaged path at once, and its delete could
// remove the create's document while the created subscription stayed in
// memory.
func TestDeleteOfADamagedSubscriptionWaitsForItsCreate(t *testing.T) {
	n, _, key := startWithDamagedSub(t)
	const sub = "/v1/stream/__ds/subscriptions/p1"
	m := n.Config.Handler.(*durableStreams).subs.cur.Load()
	cr := &subCreate{root: "/v1/stream/", done: make(chan struct{})}
	m.mu.Lock()
	m.creating = map[string]*subCreate{key: cr} // a create being written
	m.mu.Unlock()
	answered := make(chan int, 1)
	go func() {
		st, _ := n.call(t, "DELETE", sub, "")
		answered <- st
	}()
	select {
	case st := <-answered:
		t.Fatalf("DELETE answered %d while a create of the id was being written", st)
	case <-time.After(300 * time.Millisecond):
	}
	m.mu.Lock()
	delete(m.creating, key)
	close(cr.done) // the create failed and wrote nothing: the document stays damaged
	m.mu.Unlock()
	select {
	case st := <-answered:
		if st != 204 {
			t.Fatalf("DELETE after the create: %d", st)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("DELETE did not answer after the create ended")
	}
	if st, _ := n.call(t, "GET", sub, ""); st != 404 {
		t.Errorf("GET after the delete: %d, want 404", st)
	}
}

// TestWebhookSlowerThanItsLeaseBacksOff: a receiver that answers no
// sooner than the subscription's lease runs out is a failed delivery: the
// next wake waits out the webhook's backoff and the status says failed.
// Its wake was issued again at once at every lease, with no backoff and
// status active, for as long as the receiver was slow.
func TestWebhookSlowerThanItsLeaseBacksOff(t *testing.T) {
	var posts atomic.Int64
	stop := make(chan struct{})
	recv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		posts.Add(1)
		select {
		case <-time.After(1500 * time.Millisecond):
		case <-stop:
		}
		http.Error(w, "too slow", http.StatusInternalServerError)
	}))
	defer recv.Close()
	defer close(stop)

	n := startSubNode(t, t.TempDir())
	const sub = "/s/__ds/subscriptions/hook"
	if st, v := n.call(t, "PUT", sub, `{"type":"webhook","streams":["orders"],"lease_ttl_ms":1000,"webhook":{"url":"`+recv.URL+`/h"}}`); st != 201 {
		t.Fatalf("create: %d %v", st, v)
	}
	if st, _ := n.call(t, "PUT", "/s/orders", `{"n":1}`); st != 201 {
		t.Fatalf("create stream: %d", st)
	}
	sawFailed := false
	for end := time.Now().Add(6 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if _, v := n.call(t, "GET", sub, ""); v["status"] == "failed" {
			sawFailed = true
		}
	}
	// With backoff: at about 0, 2 and 5 s (the backoff 1 s, then 2 s,
	// after each lease); without, one a second.
	if got := posts.Load(); got > 4 {
		t.Errorf("%d deliveries in 6 s to a receiver slower than the 1 s lease, want 4 at most", got)
	}
	if !sawFailed {
		t.Error("status never showed the failed deliveries")
	}
}
