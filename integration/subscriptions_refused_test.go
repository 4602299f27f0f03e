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

// TestRefusedClaimAndAckChangeNothingThroughCaddy: through Caddy on
// versitygw, with the S3 proxy refusing every write of the subscription's
// document, a claim is answered 503 and grants nothing: once the bucket
// takes writes again, another worker's claim is granted. It got 409
// ALREADY_CLAIMED (holder w1) until the lease ran out, for a claim nobody
// was granted. Likewise a heartbeat ack answered 503 moves no cursor.
func TestRefusedClaimAndAckChangeNothingThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	// The wake event is written after the wake is saved: from then on the
	// document is written by requests only.
	e, sub, doc := wokenPullWakeSub(t, 3)
	refuse := func() (remove func()) {
		return e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: doc, Status: http.StatusServiceUnavailable})
	}

	remove := refuse()
	st, v := e.subCall("POST", sub+"/claim", `{"worker":"w1"}`)
	remove()
	if st != http.StatusServiceUnavailable {
		t.Fatalf("claim while the document cannot be written: %d %v, want 503", st, v)
	}
	st, claim := e.subCall("POST", sub+"/claim", `{"worker":"w2"}`)
	if st != http.StatusOK {
		t.Fatalf("claim by w2 after w1's claim was answered 503: %d %v, want 200", st, claim)
	}

	remove = refuse()
	body := `{"wake_id":"` + claim["wake_id"].(string) + `","generation":` +
		strconv.Itoa(int(claim["generation"].(float64))) + `,"acks":[{"stream":"events/a","offset":"` + subOffset(2) + `"}]}`
	st, v = e.subCall("POST", sub+"/ack", body, "Authorization", "Bearer "+claim["token"].(string))
	remove()
	if st != http.StatusServiceUnavailable {
		t.Fatalf("ack while the document cannot be written: %d %v, want 503", st, v)
	}
	_, v = e.subCall("GET", sub, "")
	if got := v["streams"].([]any)[0].(map[string]any)["acked_offset"]; got != subOffset(0) {
		t.Fatalf("after an ack answered 503, events/a is acked at %v; want it unchanged at %s", got, subOffset(0))
	}
}

// TestRefusedSubscriptionWriteNamesTheCause: a subscription request
// whose document the bucket refuses for good (403) is answered as a
// stream's write is then: 503 with Retry-After, naming the refusal
// without the document's key, and saying nothing was written. It was
// answered with the store's error as it came ("saving subscription p:
// ..." and the object key), with no Retry-After.
func TestRefusedSubscriptionWriteNamesTheCause(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e, sub, doc := wokenPullWakeSub(t, 1)

	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: doc, Status: http.StatusForbidden})
	r := e.must(fhReq{Method: http.MethodPost, Path: sub + "/claim", Header: map[string]string{"Content-Type": "application/json"},
		Body: []byte(`{"worker":"w1"}`)})
	remove()
	var body struct {
		Error struct{ Code, Message string }
	}
	_ = json.Unmarshal(r.Body, &body)
	t.Logf("claim while the bucket refuses the document: %s", r)
	if r.Status != http.StatusServiceUnavailable || body.Error.Code != "UNAVAILABLE" || r.Header.Get("Retry-After") != "1" {
		t.Errorf("claim while the bucket refuses the document: %s, Retry-After %q; want 503 UNAVAILABLE with Retry-After 1",
			r, r.Header.Get("Retry-After"))
	}
	for _, want := range []string{"storage refuses writes: ", "AccessDenied (HTTP 403)", "nothing was written"} {
		if !strings.Contains(body.Error.Message, want) {
			t.Errorf("claim refused by the bucket: message %q does not say %q", body.Error.Message, want)
		}
	}
	if strings.Contains(body.Error.Message, "subs/") {
		t.Errorf("claim refused by the bucket: message %q names the document's key", body.Error.Message)
	}
	if st, v := e.subCall("POST", sub+"/claim", `{"worker":"w2"}`); st != http.StatusOK {
		t.Fatalf("claim once the bucket takes writes again: %d %v, want 200", st, v)
	}
}

// startPullWakeSub starts Caddy on versitygw with a pull-wake subscription
// "p" on events/* (wake stream /r/wake) and the stream /r/events/a, and
// returns the subscription's URL path and the key of its document
// (subs/<hex root>/<hex id>).
func startPullWakeSub(t *testing.T) (e *fhEnv, sub, doc string) {
	t.Helper()
	e = fhStart(t, fhOptions{})
	sub = "/r/__ds/subscriptions/p"
	doc = "subs/" + hex.EncodeToString([]byte("/r/")) + "/" + hex.EncodeToString([]byte("p"))
	e.create("/r/wake", "application/json")
	if st, v := e.subCall("PUT", sub, `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake","lease_ttl_ms":600000}`); st != http.StatusCreated {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	e.create("/r/events/a", "application/json")
	return e, sub, doc
}

// wokenPullWakeSub is startPullWakeSub with n records appended to
// events/a and the wake they cause announced on the wake stream.
func wokenPullWakeSub(t *testing.T, n int) (e *fhEnv, sub, doc string) {
	t.Helper()
	e, sub, doc = startPullWakeSub(t)
	for i := 0; i < n; i++ {
		e.append("/r/events/a", "application/json", []byte(`{"n":`+strconv.Itoa(i)+`}`))
	}
	if err := e.waitWakes("/r/wake", "p", 1); err != nil {
		t.Fatal(err)
	}
	return e, sub, doc
}
