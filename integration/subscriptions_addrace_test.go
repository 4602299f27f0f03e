package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestAppendWhileStreamsAreAdded: a record appended to a stream while it
// is being added to a subscription (looked up, its link not yet stored)
// is in the link's tail once the add is answered, so the worker that
// reads the stream to its end can ack what it read. The append's note
// found no link to move and was dropped, so the link was stored at the
// tail its lookup saw: the ack of the stream's real tail was 409
// INVALID_OFFSET, beyond the tail, and the record was neither pending
// nor acked until the stream's next append.
func TestAppendWhileStreamsAreAdded(t *testing.T) {
	e := fhStart(t, fhOptions{})
	ws := subAckSetup(t, e, 1)
	e.create("/r/events/b", "application/json")
	e.append("/r/events/b", "application/json", []byte(`{"n":1}`))
	var wake struct {
		WakeID     string `json:"wake_id"`
		Generation uint64 `json:"generation"`
	}
	if err := json.Unmarshal([]byte(ws[0].body), &wake); err != nil {
		t.Fatal(err)
	}
	// The add's write of the document is parked: by then the stream has
	// been looked up, and its link is not stored.
	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: fmt.Sprintf("subs/%x/%x", "/r/", "s0")})
	t.Cleanup(release)
	added := make(chan fhResp, 1)
	go func() {
		r, err := e.send(fhReq{Method: http.MethodPost, Path: "/r/__ds/subscriptions/s0/streams",
			Header: map[string]string{"Content-Type": "application/json"}, Body: []byte(`{"streams":["events/b"]}`)})
		if err != nil {
			r.Status = 0
		}
		added <- r
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := e.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("the add's write never reached the bucket: %v", err)
	}
	e.append("/r/events/b", "application/json", []byte(`{"n":2}`))
	tail := subOffset(2)
	release()
	if r := <-added; r.Status != http.StatusNoContent {
		t.Fatalf("adding events/b: %v", r)
	}
	body := fmt.Sprintf(`{"wake_id":%q,"generation":%d,"acks":[{"stream":"events/b","offset":%q}]}`, wake.WakeID, wake.Generation, tail)
	st, v := e.subCall(http.MethodPost, ws[0].ack, body, "Authorization", "Bearer "+ws[0].token)
	if st != http.StatusOK {
		t.Fatalf("ack of events/b at its tail %s, appended while it was added: %d %v, want 200", tail, st, v)
	}
}
