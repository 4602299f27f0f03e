package integration

import (
	"context"
	"encoding/hex"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestAppendWhileSubscriptionIsCreated: through Caddy on versitygw, a
// record appended to a stream while a subscription linking it (by name or
// by pattern) is being created, after the stream was looked up at its
// tail and before the subscription's document is stored, is pending work
// once the create is answered: a claim is offered it. The append's note
// found no subscription to tell and was dropped, so the link kept the tail
// of the look-up: the claim was 409 NO_PENDING_WORK, nothing woke the
// subscription until the stream's next append, and a worker that acked
// the record it read was refused (beyond the tail).
func TestAppendWhileSubscriptionIsCreated(t *testing.T) {
	e := fhStart(t, fhOptions{})
	const root = "/v1/stream/"
	e.create(root+"wake/pool", "application/json")
	for _, tc := range []struct{ id, stream, body string }{
		{"named", "events/a", `{"type":"pull-wake","streams":["events/a"],"wake_stream":"wake/pool"}`},
		{"pattern", "logs/a", `{"type":"pull-wake","pattern":"logs/*","wake_stream":"wake/pool"}`},
	} {
		t.Run(tc.id, func(t *testing.T) {
			e.create(root+tc.stream, "application/json")
			e.append(root+tc.stream, "application/json", []byte(`{"n":0}`))
			sub := root + "__ds/subscriptions/" + tc.id
			doc := hex.EncodeToString([]byte(root)) + "/" + hex.EncodeToString([]byte(tc.id))
			release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: doc})
			created := make(chan int, 1)
			go func() {
				st, _ := e.subCall("PUT", sub, tc.body)
				created <- st
			}()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := e.proxy.WaitHeld(ctx, 1); err != nil {
				release()
				t.Fatalf("the create's write never came: %v", err)
			}
			e.append(root+tc.stream, "application/json", []byte(`{"n":1}`))
			// A claim of another id applies the append's note first.
			if st, v := e.subCall("POST", root+"__ds/subscriptions/none/claim", `{"worker":"w"}`); st != http.StatusNotFound {
				t.Errorf("claim of no subscription: %d %v", st, v)
			}
			release()
			if st := <-created; st != http.StatusCreated {
				t.Fatalf("create: %d", st)
			}
			st, claim := e.subCall("POST", sub+"/claim", `{"worker":"w1"}`)
			if st != http.StatusOK {
				t.Fatalf("claim after an append during the create: %d %v, want 200", st, claim)
			}
			l := claim["streams"].([]any)[0].(map[string]any)
			if l["acked_offset"] != subOffset(1) || l["tail_offset"] != subOffset(2) {
				t.Errorf("claim offers %v to %v, want %s to %s", l["acked_offset"], l["tail_offset"], subOffset(1), subOffset(2))
			}
		})
	}
}
