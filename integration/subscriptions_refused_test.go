package integration

import (
	"encoding/hex"
	"net/http"
	"strconv"
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
	e := fhStart(t, fhOptions{})
	const sub = "/r/__ds/subscriptions/p"
	// The subscription's document: subs/<hex root>/<hex id>.
	doc := "subs/" + hex.EncodeToString([]byte("/r/")) + "/" + hex.EncodeToString([]byte("p"))
	e.create("/r/wake", "application/json")
	if st, v := e.subCall("PUT", sub, `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake","lease_ttl_ms":600000}`); st != http.StatusCreated {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	e.create("/r/events/a", "application/json")
	for i := 0; i < 3; i++ {
		e.append("/r/events/a", "application/json", []byte(`{"n":`+strconv.Itoa(i)+`}`))
	}
	// The wake event is written after the wake is saved: from then on the
	// document is written by requests only.
	if err := e.waitWakes("/r/wake", "p", 1); err != nil {
		t.Fatal(err)
	}
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
