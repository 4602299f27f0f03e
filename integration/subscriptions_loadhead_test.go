package integration

import (
	"encoding/hex"
	"fmt"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestTailsWrittenByNoneAfterALoadThatCouldNotReadTheStream: through Caddy
// on versitygw, records appended while a worker holds a lease are not
// written into the subscription's document: the load reads the stream's
// tail instead. When that read failed at the load (the stream's metadata
// refused by the store for a moment), the link kept the stored tail until
// the stream's next append: the worker's ack of the records it read was
// 409 beyond the tail for good, and they were not pending. The stream is
// now looked up again until the store answers, and the ack is taken.
func TestTailsWrittenByNoneAfterALoadThatCouldNotReadTheStream(t *testing.T) {
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s", "pack_below off"}})
	const root = "/v1/stream/"
	sub := root + "__ds/subscriptions/p1"
	e.create(root+"wake/pool", "application/json")
	e.create(root+"events/a", "application/json")
	if st, v := e.subCall("PUT", sub, `{"type":"pull-wake","streams":["events/a"],"wake_stream":"wake/pool","lease_ttl_ms":600000}`); st != http.StatusCreated {
		t.Fatalf("create: %d %v", st, v)
	}
	e.append(root+"events/a", "application/json", []byte(`{"n":0}`))
	if err := e.waitWakes(root+"wake/pool", "p1", 1); err != nil {
		t.Fatalf("no wake: %v", err)
	}
	st, claim := e.subCall("POST", sub+"/claim", `{"worker":"w1"}`)
	if st != http.StatusOK {
		t.Fatalf("claim: %d %v", st, claim)
	}
	for i := 1; i <= 3; i++ {
		e.append(root+"events/a", "application/json", []byte(`{"n":`+strconv.Itoa(i)+`}`))
	}
	if err := e.waitGone("wal/"); err != nil {
		t.Fatalf("not compacted: %v", err)
	}
	remove := e.proxy.AddFault(testenv.Fault{KeyContains: hex.EncodeToString([]byte("events/a")), Status: http.StatusForbidden})
	e.caddy.Restart()
	if st, v := e.subCall("GET", sub, ""); st != http.StatusOK {
		remove()
		t.Fatalf("get after the restart: %d %v", st, v)
	}
	remove()
	ack := `{"wake_id":"` + claim["wake_id"].(string) + `","generation":` + strconv.Itoa(int(claim["generation"].(float64))) +
		`,"acks":[{"stream":"events/a","offset":"` + subOffset(4) + `"}],"done":true}`
	if err := fhWaitFor(15*time.Second, 100*time.Millisecond, func() error {
		if st, v := e.subCall("POST", sub+"/ack", ack, "Authorization", "Bearer "+claim["token"].(string)); st != http.StatusOK {
			return fmt.Errorf("%d %v", st, v)
		}
		return nil
	}); err != nil {
		t.Fatalf("ack of the last record after the restart, the store answering again: %v", err)
	}
	// The wake ended with everything acked.
	if st, v := e.subCall("POST", sub+"/claim", `{"worker":"w2"}`); st != http.StatusConflict || errCodeOf(v) != "NO_PENDING_WORK" {
		t.Errorf("claim after the ack: %d %v, want 409 NO_PENDING_WORK", st, v)
	}
}
