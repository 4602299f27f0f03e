package integration

import (
	"encoding/hex"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// Faults of a subscription document's PUT whose outcome the server cannot
// know: the PUT reaches versitygw and lands, and the server sees a 500 (an
// S3 InternalError, which may come after the write) or a dropped
// connection (a lost answer), on every attempt.
var (
	subLanded500  = testenv.Fault{Op: testenv.OpPut, Status: http.StatusInternalServerError, AfterForward: true}
	subLandedLost = testenv.Fault{Op: testenv.OpPut, Reset: true, AfterForward: true}
)

// subDoc is the key (relative to the storage prefix) of the document of
// subscription id under root.
func subDoc(root, id string) string {
	return "subs/" + hex.EncodeToString([]byte(root)) + "/" + hex.EncodeToString([]byte(id))
}

// subFailure sends a JSON request while fault applies to the PUTs of the
// document doc, and checks its answer: 503 UNAVAILABLE, Retry-After 1, a
// message with each of want and without the document's key or the
// store's error. It returns the message.
func (e *fhEnv) subFailure(t *testing.T, fault testenv.Fault, doc, method, path, body string, want []string, hdr ...string) string {
	t.Helper()
	fault.KeyContains = doc
	remove := e.proxy.AddFault(fault)
	h := map[string]string{"Content-Type": "application/json"}
	for i := 0; i+1 < len(hdr); i += 2 {
		h[hdr[i]] = hdr[i+1]
	}
	r := e.must(fhReq{Method: method, Path: path, Header: h, Body: []byte(body)})
	remove()
	var v struct {
		Error struct{ Code, Message string }
	}
	_ = json.Unmarshal(r.Body, &v)
	t.Logf("%s %s while its document's PUT fails: %s, Retry-After %q", method, path, r, r.Header.Get("Retry-After"))
	if r.Status != http.StatusServiceUnavailable || v.Error.Code != "UNAVAILABLE" || r.Header.Get("Retry-After") != "1" {
		t.Errorf("%s %s: %s, Retry-After %q; want 503 UNAVAILABLE with Retry-After 1", method, path, r, r.Header.Get("Retry-After"))
	}
	for _, w := range want {
		if !strings.Contains(v.Error.Message, w) {
			t.Errorf("%s %s: message %q does not say %q", method, path, v.Error.Message, w)
		}
	}
	if fhContainsAny(v.Error.Message, "subs/", doc, "operation error", "StatusCode", "segment:") {
		t.Errorf("%s %s: message %q names the document's key or the store's error", method, path, v.Error.Message)
	}
	return v.Error.Message
}

// mustDoc reads document doc from the bucket, failing the test if it
// cannot.
func (e *fhEnv) mustDoc(t *testing.T, doc string) string {
	t.Helper()
	b, err := e.get(doc)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// subAckBody is an ack of events/a at seq in the wake of claim.
func subAckBody(claim map[string]any, seq int, done bool) string {
	return `{"wake_id":"` + claim["wake_id"].(string) + `","generation":` +
		strconv.Itoa(int(claim["generation"].(float64))) + `,"acks":[{"stream":"events/a","offset":"` + subOffset(seq) +
		`"}],"done":` + strconv.FormatBool(done) + `}`
}

// subLinked returns the acked offsets of the streams subscription sub
// links, by path.
func (e *fhEnv) subLinked(t *testing.T, sub string) map[string]string {
	t.Helper()
	st, v := e.subCall("GET", sub, "")
	if st != http.StatusOK {
		t.Fatalf("GET %s: %d %v", sub, st, v)
	}
	out := map[string]string{}
	for _, s := range v["streams"].([]any) {
		l := s.(map[string]any)
		out[l["path"].(string)], _ = l["acked_offset"].(string)
	}
	return out
}

// TestUnconfirmedSubscriptionWritesAreRepeated: through Caddy on
// versitygw, each subscription request whose document's PUT landed while
// the server saw only failures (a 500 or a dropped connection at every
// attempt) is answered 503 with Retry-After, saying that it may or may not
// take effect and what a repeat does, without the document's key; the
// store's error goes to a sampled warning. The repeat the answer
// recommends then does what it says. Such a request was answered with the
// store's error as it came ("saving subscription p: segment: put
// subs/...: operation error S3: PutObject, ..."), which did not say that
// the change may have been made, and nothing was logged.
func TestUnconfirmedSubscriptionWritesAreRepeated(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e, sub, doc := startPullWakeSub(t)
	const maybe = "it was not acknowledged, and it may or may not take effect; "

	// A create that landed: the server undoes it, and an identical PUT
	// creates it once that is confirmed.
	const qBody = `{"type":"pull-wake","streams":["events/a"],"wake_stream":"wake","lease_ttl_ms":600000}`
	q, qDoc := "/r/__ds/subscriptions/q", subDoc("/r/", "q")
	e.subFailure(t, subLanded500, qDoc, "PUT", q, qBody,
		[]string{"storage did not confirm the create: it was not acknowledged, and the server undoes it until storage confirms that",
			"repeat it: an identical PUT creates the subscription once storage has confirmed the undo"})
	if st, v := e.subCall("PUT", q, qBody); st != http.StatusCreated {
		t.Fatalf("repeated create: %d %v, want 201", st, v)
	}
	if st, v := e.subCall("PUT", q, qBody); st != http.StatusOK {
		t.Fatalf("create once more: %d %v, want 200", st, v)
	}

	// A change of streams: its repeat links once, and removes.
	e.create("/r/events/b", "application/json")
	e.subFailure(t, subLanded500, qDoc, "POST", q+"/streams", `{"streams":["events/b"]}`,
		[]string{"storage did not confirm the change of the subscription's streams: " + maybe, "repeat it: it links each stream once"})
	if st, v := e.subCall("POST", q+"/streams", `{"streams":["events/b"]}`); st != http.StatusNoContent {
		t.Fatalf("repeated add of events/b: %d %v, want 204", st, v)
	}
	if got := e.subLinked(t, q); len(got) != 2 || got["events/b"] == "" {
		t.Fatalf("after the repeated add, q links %v; want events/a and events/b", got)
	}
	e.subFailure(t, subLandedLost, qDoc, "DELETE", q+"/streams/events/b", "",
		[]string{"storage did not confirm the change of the subscription's streams: " + maybe,
			"repeat it: a removal of a stream the subscription does not link succeeds"})
	if st, v := e.subCall("DELETE", q+"/streams/events/b", ""); st != http.StatusNoContent {
		t.Fatalf("repeated removal of events/b: %d %v, want 204", st, v)
	}
	if got := e.subLinked(t, q); len(got) != 1 || got["events/a"] == "" {
		t.Fatalf("after the repeated removal, q links %v; want events/a alone", got)
	}

	// A delete that landed: its repeat succeeds and the subscription is gone.
	e.subFailure(t, subLanded500, qDoc, "DELETE", q, "",
		[]string{"storage did not confirm the delete: it was not acknowledged, and the server goes on deleting it until storage confirms it", "repeat it: a repeat answers 204 once storage has confirmed the delete"})
	if st, v := e.subCall("DELETE", q, ""); st != http.StatusNoContent {
		t.Fatalf("repeated delete: %d %v, want 204", st, v)
	}
	if st, v := e.subCall("GET", q, ""); st != http.StatusNotFound {
		t.Fatalf("GET after the repeated delete: %d %v, want 404", st, v)
	}

	// A claim that landed: its repeat by the same worker is granted.
	for i := 0; i < 3; i++ {
		e.append("/r/events/a", "application/json", []byte(`{"n":`+strconv.Itoa(i)+`}`))
	}
	if err := e.waitWakes("/r/wake", "p", 1); err != nil {
		t.Fatal(err)
	}
	e.subFailure(t, subLanded500, doc, "POST", sub+"/claim", `{"worker":"w1"}`,
		[]string{"storage did not confirm the claim: " + maybe, "repeat it with the same worker: it is granted"})
	if got := e.mustDoc(t, doc); !strings.Contains(got, `"w1"`) {
		t.Fatalf("the claim's document did not land: %q", got)
	}
	st, claim := e.subCall("POST", sub+"/claim", `{"worker":"w1"}`)
	if st != http.StatusOK {
		t.Fatalf("repeated claim by w1: %d %v, want 200", st, claim)
	}
	tok := "Bearer " + claim["token"].(string)

	// A heartbeat ack that landed, then an ack with done: each repeat is
	// taken.
	e.subFailure(t, subLandedLost, doc, "POST", sub+"/ack", subAckBody(claim, 2, false),
		[]string{"storage did not confirm the ack: " + maybe, "repeat it as it was: an ack at the offsets it acknowledged is taken again"},
		"Authorization", tok)
	if st, v := e.subCall("POST", sub+"/ack", subAckBody(claim, 2, false), "Authorization", tok); st != http.StatusOK {
		t.Fatalf("repeated ack: %d %v, want 200", st, v)
	}
	if got := e.subLinked(t, sub)["events/a"]; got != subOffset(2) {
		t.Fatalf("after the repeated ack, events/a is acked at %s, want %s", got, subOffset(2))
	}
	e.subFailure(t, subLanded500, doc, "POST", sub+"/ack", subAckBody(claim, 3, true),
		[]string{"storage did not confirm the ack: " + maybe, "repeat it as it was: it is taken, or, where it took effect and ended the wake, answered 409 FENCED"},
		"Authorization", tok)
	if st, v := e.subCall("POST", sub+"/ack", subAckBody(claim, 3, true), "Authorization", tok); st != http.StatusOK {
		t.Fatalf("repeated ack with done: %d %v, want 200", st, v)
	}
	if got := e.subLinked(t, sub)["events/a"]; got != subOffset(3) {
		t.Fatalf("after the repeated ack with done, events/a is acked at %s, want %s", got, subOffset(3))
	}

	// A release that landed: its repeat is taken.
	e.append("/r/events/a", "application/json", []byte(`{"n":3}`))
	if err := e.waitWakes("/r/wake", "p", 2); err != nil {
		t.Fatal(err)
	}
	st, claim = e.subCall("POST", sub+"/claim", `{"worker":"w1"}`)
	if st != http.StatusOK {
		t.Fatalf("claim of the second wake: %d %v", st, claim)
	}
	tok = "Bearer " + claim["token"].(string)
	e.subFailure(t, subLanded500, doc, "POST", sub+"/release", subAckBody(claim, 3, false),
		[]string{"storage did not confirm the release: " + maybe, "repeat it: it is taken, or, where it took effect and ended the wake, answered 409 FENCED"},
		"Authorization", tok)
	if st, v := e.subCall("POST", sub+"/release", subAckBody(claim, 3, false), "Authorization", tok); st != http.StatusNoContent {
		t.Fatalf("repeated release: %d %v, want 204", st, v)
	}

	// The store's error, with the document's key, is in the log: the
	// first failure's (the create's); those after it within 10 s are
	// held back, as a stream's are.
	found := false
	for _, line := range strings.Split(e.caddy.Logs(), "\n") {
		if strings.Contains(line, `"msg":"write not confirmed in time"`) && strings.Contains(line, qDoc) && strings.Contains(line, q) {
			found = true
		}
	}
	if !found {
		t.Errorf("no \"write not confirmed in time\" warning naming %s and %s in Caddy's log", q, qDoc)
	}
}

// TestUnconfirmedSubscriptionWritesAfterARestart: a release and a claim
// whose documents landed while the server saw only failures are found
// done by the server that reads the documents anew (here the same node
// restarted), and their repeats are answered as the 503 said: the release
// 409 FENCED, the claim 409 ALREADY_CLAIMED naming the same worker.
func TestUnconfirmedSubscriptionWritesAfterARestart(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e, sub, doc := wokenPullWakeSub(t, 3)
	st, claim := e.subCall("POST", sub+"/claim", `{"worker":"w1"}`)
	if st != http.StatusOK {
		t.Fatalf("claim: %d %v", st, claim)
	}
	tok := "Bearer " + claim["token"].(string)
	e.subFailure(t, subLanded500, doc, "POST", sub+"/release", subAckBody(claim, 0, false),
		[]string{"storage did not confirm the release", "where it took effect and ended the wake, answered 409 FENCED"},
		"Authorization", tok)
	e.caddy.Restart()
	st, v := e.subCall("POST", sub+"/release", subAckBody(claim, 0, false), "Authorization", tok)
	if st != http.StatusConflict || v["error"].(map[string]any)["code"] != "FENCED" {
		t.Fatalf("release repeated after the restart: %d %v, want 409 FENCED", st, v)
	}

	// The release left work pending: the restarted server announces the
	// wake it stored with it.
	if err := e.waitWakes("/r/wake", "p", 2); err != nil {
		t.Fatal(err)
	}
	e.subFailure(t, subLanded500, doc, "POST", sub+"/claim", `{"worker":"w1"}`,
		[]string{"storage did not confirm the claim", "409 ALREADY_CLAIMED naming this worker until that lease runs out"})
	e.caddy.Restart()
	st, v = e.subCall("POST", sub+"/claim", `{"worker":"w1"}`)
	if st != http.StatusConflict || v["error"].(map[string]any)["code"] != "ALREADY_CLAIMED" ||
		v["error"].(map[string]any)["current_holder"] != "w1" {
		t.Fatalf("claim repeated after the restart: %d %v, want 409 ALREADY_CLAIMED by w1", st, v)
	}
}

// TestSubscriptionStorageFailureNamesNoKey: a subscription request whose
// document the bucket does not take (503 SlowDown at every attempt:
// nothing was written), is answered 503 with Retry-After and a message
// that names no object key and says nothing changed, and the store's
// error is logged as a sampled warning. It was answered with the store's
// error as it came, and nothing was logged.
func TestSubscriptionStorageFailureNamesNoKey(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e, sub, doc := wokenPullWakeSub(t, 1)
	slow := testenv.Fault{Op: testenv.OpPut, Status: http.StatusServiceUnavailable}
	msg := e.subFailure(t, slow, doc, "POST", sub+"/claim", `{"worker":"w1"}`, []string{"storage unavailable; nothing was changed, retry"})
	if strings.Contains(msg, "may") {
		t.Errorf("claim refused at every attempt: message %q says it may have taken effect", msg)
	}
	if st, v := e.subCall("POST", sub+"/claim", `{"worker":"w2"}`); st != http.StatusOK {
		t.Fatalf("claim by w2 after w1's was answered 503: %d %v, want 200", st, v)
	}

	logs := e.caddy.Logs()
	found := false
	for _, line := range strings.Split(logs, "\n") {
		if strings.Contains(line, `"msg":"storage unavailable"`) && strings.Contains(line, doc) && strings.Contains(line, sub) {
			found = true
		}
	}
	if !found {
		t.Errorf("no \"storage unavailable\" warning naming %s and %s in Caddy's log", sub, doc)
	}
}
