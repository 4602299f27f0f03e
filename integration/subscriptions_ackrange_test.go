package integration

import (
	"net/http"
	"strconv"
	"strings"
	"testing"
)

// TestAckOutsideCursorAndTailThroughCaddy: through Caddy on versitygw, a
// pull-wake ack behind the stream's acknowledged offset or beyond its tail
// is 409 INVALID_OFFSET, as the reference server answers, and changes
// nothing: the cursor stays, and a done with it does not end the wake (a
// second worker's claim still finds it held). Both were 200 before, the
// cursor left where it was, so a worker acking records not written yet
// was never told. An ack at the cursor, a retry, is 200.
//
// An ack of a stream the subscription does not link, or at an offset that
// is no position (-1, now, junk, empty), is 409 INVALID_OFFSET too, as the
// reference server answers (it was 400 INVALID_REQUEST), also when another
// ack of the request is good; an ack entry without its offset is a
// malformed body, 400 INVALID_REQUEST.
//
// Offsets are compared in both parts: at the tail's seq, with a byte part,
// an offset is beyond the tail (it was 200, and with done ended the wake,
// as its seq was all that was looked at). Inside a record between the
// cursor and the tail it is taken as the record's start.
func TestAckOutsideCursorAndTailThroughCaddy(t *testing.T) {
	e := fhStart(t, fhOptions{})
	const sub, wake = "/v1/stream/__ds/subscriptions/p1", "/v1/stream/wake/pool"
	e.create(wake, "application/json")
	if st, v := e.subCall("PUT", sub, `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake/pool","lease_ttl_ms":600000}`); st != http.StatusCreated {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	e.create("/v1/stream/events/a", "application/json")
	for i := 0; i < 3; i++ {
		e.append("/v1/stream/events/a", "application/json", []byte(`{"n":`+strconv.Itoa(i)+`}`))
	}
	if err := e.waitWakes(wake, "p1", 1); err != nil {
		t.Fatalf("no wake for events/a: %v", err)
	}
	st, claim := e.subCall("POST", sub+"/claim", `{"worker":"w1"}`)
	if st != http.StatusOK {
		t.Fatalf("claim: %d %v", st, claim)
	}
	bearer := "Bearer " + claim["token"].(string)
	ack := func(done bool, acks ...string) string {
		return `{"wake_id":"` + claim["wake_id"].(string) + `","generation":` + strconv.Itoa(int(claim["generation"].(float64))) +
			`,"acks":[` + strings.Join(acks, ",") + `],"done":` + strconv.FormatBool(done) + `}`
	}
	entry := func(stream, offset string) string { return `{"stream":"` + stream + `","offset":"` + offset + `"}` }
	at := func(seq int) string { return entry("events/a", subOffset(seq)) }
	acked := func() string {
		t.Helper()
		_, v := e.subCall("GET", sub, "")
		return v["streams"].([]any)[0].(map[string]any)["acked_offset"].(string)
	}
	// The scheme in any case (RFC 9110 section 11.1): it was 401 unless
	// spelt "Bearer".
	lower := "bearer  " + claim["token"].(string)
	if st, v := e.subCall("POST", sub+"/ack", ack(false, at(2)), "Authorization", lower); st != http.StatusOK {
		t.Fatalf("ack at 2 of 3 with %.9q...: %d %v", lower, st, v)
	}
	for _, tc := range []struct {
		name   string
		body   string
		status int
		code   string
	}{
		{"behind the cursor", ack(false, at(1)), http.StatusConflict, "INVALID_OFFSET"},
		{"beyond the tail", ack(false, at(4)), http.StatusConflict, "INVALID_OFFSET"},
		{"behind the cursor, done", ack(true, at(0)), http.StatusConflict, "INVALID_OFFSET"},
		{"beyond the tail, done", ack(true, at(9)), http.StatusConflict, "INVALID_OFFSET"},
		{"unlinked stream, done", ack(true, entry("events/b", subOffset(3))), http.StatusConflict, "INVALID_OFFSET"},
		{"offset -1", ack(false, entry("events/a", "-1")), http.StatusConflict, "INVALID_OFFSET"},
		{"offset now, done", ack(true, entry("events/a", "now")), http.StatusConflict, "INVALID_OFFSET"},
		{"malformed offset", ack(false, entry("events/a", "3")), http.StatusConflict, "INVALID_OFFSET"},
		{"empty offset", ack(false, entry("events/a", "")), http.StatusConflict, "INVALID_OFFSET"},
		{"a good ack, then an unlinked stream, done", ack(true, at(3), entry("events/b", subOffset(3))), http.StatusConflict, "INVALID_OFFSET"},
		{"inside the record at the cursor", ack(false, entry("events/a", subOffset(2)[:17]+"0000000000000005")), http.StatusOK, ""},
		{"a byte part at the tail, done", ack(true, entry("events/a", subOffset(3)[:17]+"0000000000000001")), http.StatusConflict, "INVALID_OFFSET"},
		{"no offset, done", ack(true, `{"stream":"events/a"}`), http.StatusBadRequest, "INVALID_REQUEST"},
		{"at the cursor (a retry)", ack(false, at(2)), http.StatusOK, ""},
	} {
		if st, v := e.subCall("POST", sub+"/ack", tc.body, "Authorization", bearer); st != tc.status || errCodeOf(v) != tc.code {
			t.Errorf("%s (acked 2, tail 3): %d %v, want %d %q", tc.name, st, v, tc.status, tc.code)
		}
		if got := acked(); got != subOffset(2) {
			t.Fatalf("after %s: acked_offset %s, want %s", tc.name, got, subOffset(2))
		}
	}
	// The refused dones ended nothing: the wake is still w1's.
	if st, v := e.subCall("POST", sub+"/claim", `{"worker":"w2"}`); st != http.StatusConflict || errCodeOf(v) != "ALREADY_CLAIMED" {
		t.Fatalf("claim by w2 after w1's refused dones: %d %v, want 409 ALREADY_CLAIMED", st, v)
	}
	if st, v := e.subCall("POST", sub+"/ack", ack(true, at(3)), "Authorization", bearer); st != http.StatusOK || v["ok"] != true {
		t.Fatalf("ack at the tail with done: %d %v", st, v)
	}
	if got := acked(); got != subOffset(3) {
		t.Fatalf("after the ack at the tail: acked_offset %s, want %s", got, subOffset(3))
	}
}
