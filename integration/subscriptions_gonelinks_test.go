package integration

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestGoneLinksOfAnUnclaimedWakeGo: through Caddy on versitygw, a pull-wake
// subscription's wake stays unclaimed while streams its pattern matches
// are created, appended to and deleted, one after another. No worker holds
// the wake, so none can ack those streams: their links go with them. They
// stayed in the subscription's document as links of deleted streams until
// the wake ended, which for a wake nobody claims is never: the document
// (rewritten whole at every change) grew by one link per stream.
func TestGoneLinksOfAnUnclaimedWakeGo(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	const root = "/v1/stream/"
	e.create(root+"wake/pool", "application/json")
	if st, v := e.subCall("PUT", root+"__ds/subscriptions/p", `{"type":"pull-wake","pattern":"tmp/*","wake_stream":"wake/pool"}`); st != http.StatusCreated {
		t.Fatalf("create: %d %v", st, v)
	}
	e.create(root+"tmp/a", textPlain)
	e.append(root+"tmp/a", textPlain, []byte("a"))
	if err := e.waitWakes(root+"wake/pool", "p", 1); err != nil {
		t.Fatalf("no wake: %v", err)
	}
	const churn = 20
	for i := range churn {
		p := fmt.Sprintf("%stmp/x%d", root, i)
		e.create(p, textPlain)
		e.append(p, textPlain, []byte("x"))
		if r := e.must(fhReq{Method: http.MethodDelete, Path: p}); r.Status != http.StatusNoContent {
			t.Fatalf("DELETE %s: %s", p, r)
		}
	}
	// A last stream that stays: once the document links it, the manager
	// has applied every delete before it.
	e.create(root+"tmp/z", textPlain)
	e.append(root+"tmp/z", textPlain, []byte("z"))
	key := "subs/" + hex.EncodeToString([]byte(root)) + "/" + hex.EncodeToString([]byte("p"))
	var doc string
	err := fhWaitFor(15*time.Second, 50*time.Millisecond, func() error {
		doc = e.mustDoc(t, key)
		if !strings.Contains(doc, `"tmp/z"`) {
			return fmt.Errorf("the document does not link tmp/z yet")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var parsed struct {
		Links map[string]json.RawMessage `json:"links"`
	}
	if err := json.Unmarshal([]byte(doc), &parsed); err != nil {
		t.Fatalf("the document is not JSON: %v", err)
	}
	n := 0
	for p := range parsed.Links {
		if strings.HasPrefix(p, "tmp/x") {
			n++
		}
	}
	if n != 0 {
		t.Errorf("the document keeps %d links of the %d deleted streams: %s", n, churn, fhClip(doc, 400))
	}
	if parsed.Links["tmp/a"] == nil {
		t.Errorf("the document lost the link of the stream still there: %s", fhClip(doc, 400))
	}
}
