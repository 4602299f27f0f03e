package integration

import (
	"encoding/hex"
	"fmt"
	"net/http"
	"strconv"
	"testing"
	"time"
)

// TestAppendsDuringALeaseWriteNoDocument: through Caddy on versitygw, while
// a worker holds a pull-wake lease, appends to a stream the subscription
// already links do not rewrite its document: only the tail moves, and the
// load reads every linked stream's tail from the stream anyway. Each such
// append wrote the whole document (every link, the configuration) once
// more, beside the worker's own heartbeats and acks. The tails are still
// known: the worker acks the last record appended, and after a restart a
// claim offers the records after it.
func TestAppendsDuringALeaseWriteNoDocument(t *testing.T) {
	e := fhStart(t, fhOptions{})
	const root, rounds = "/v1/stream/", 5
	sub := root + "__ds/subscriptions/p1"
	e.create(root+"wake/pool", "application/json")
	if st, v := e.subCall("PUT", sub, `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake/pool","lease_ttl_ms":600000}`); st != http.StatusCreated {
		t.Fatalf("create: %d %v", st, v)
	}
	e.create(root+"events/a", "application/json")
	e.append(root+"events/a", "application/json", []byte(`{"n":0}`))
	if err := e.waitWakes(root+"wake/pool", "p1", 1); err != nil {
		t.Fatalf("no wake: %v", err)
	}
	st, claim := e.subCall("POST", sub+"/claim", `{"worker":"w1"}`)
	if st != http.StatusOK {
		t.Fatalf("claim: %d %v", st, claim)
	}
	bearer := "Bearer " + claim["token"].(string)
	ack := func(seq int, done bool) string {
		acks := ""
		if seq > 0 {
			acks = `{"stream":"events/a","offset":"` + subOffset(seq) + `"}`
		}
		return `{"wake_id":"` + claim["wake_id"].(string) + `","generation":` + strconv.Itoa(int(claim["generation"].(float64))) +
			`,"acks":[` + acks + `],"done":` + strconv.FormatBool(done) + `}`
	}
	doc := hex.EncodeToString([]byte(root)) + "/" + hex.EncodeToString([]byte("p1"))
	before := e.proxy.Counts().Containing("PUT", doc)
	for i := 1; i <= rounds; i++ {
		e.append(root+"events/a", "application/json", []byte(`{"n":`+strconv.Itoa(i)+`}`))
		// A heartbeat takes the append's note and waits for any write of
		// the subscription the note started: one PUT of its own.
		if st, v := e.subCall("POST", sub+"/ack", ack(0, false), "Authorization", bearer); st != http.StatusOK {
			t.Fatalf("heartbeat %d: %d %v", i, st, v)
		}
	}
	if puts := e.proxy.Counts().Containing("PUT", doc) - before; puts != rounds {
		t.Errorf("%d appends and %d heartbeats during the lease wrote the document %d times, want %d (the heartbeats')", rounds, rounds, puts, rounds)
	}
	// The tail moved all the same: an ack of the last record is no ack
	// beyond it.
	if st, v := e.subCall("POST", sub+"/ack", ack(rounds, false), "Authorization", bearer); st != http.StatusOK {
		t.Errorf("ack of the last record appended: %d %v", st, v)
	}
	e.append(root+"events/a", "application/json", []byte(`{"n":"last"}`))
	e.caddy.Restart()
	if st, v := e.subCall("POST", sub+"/release", ack(0, false), "Authorization", bearer); st != http.StatusNoContent {
		t.Fatalf("release after the restart: %d %v", st, v)
	}
	var again map[string]any
	if err := fhWaitFor(15*time.Second, 50*time.Millisecond, func() error {
		st, again = e.subCall("POST", sub+"/claim", `{"worker":"w2"}`)
		if st != http.StatusOK {
			return fmt.Errorf("claim: %d %v", st, again)
		}
		return nil
	}); err != nil {
		t.Fatalf("claim after the restart: %v", err)
	}
	l := again["streams"].([]any)[0].(map[string]any)
	if l["acked_offset"] != subOffset(rounds) || l["tail_offset"] != subOffset(rounds+2) {
		t.Errorf("after the restart the claim offers %v to %v, want %s to %s", l["acked_offset"], l["tail_offset"], subOffset(rounds), subOffset(rounds+2))
	}
}
