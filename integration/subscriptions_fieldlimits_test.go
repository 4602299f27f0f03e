package integration

import (
	"encoding/hex"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// TestWorkerAndWebhookURLLimitsThroughCaddy: through Caddy on versitygw, a
// claim's worker name is at most 256 bytes, a webhook URL at most 2 KiB,
// a description at most 4 KiB and a subscription's id 120 bytes; longer
// ones are 400 INVALID_REQUEST and change nothing. All went into the subscription's document as they
// came (up to the 1 MiB body), the worker name written again at every
// heartbeat and ack of its lease and echoed in every ALREADY_CLAIMED
// answer, the description with every claim, ack and wake.
func TestWorkerAndWebhookURLLimitsThroughCaddy(t *testing.T) {
	e := fhStart(t, fhOptions{})
	const root = "/v1/stream/"
	e.create(root+"wake/pool", "application/json")
	hook := func(n int) string {
		u := "https://hooks.example.com/h?q="
		return `{"type":"webhook","pattern":"none/*","webhook":{"url":"` + u + strings.Repeat("q", n-len(u)) + `"}}`
	}
	described := func(n int) string {
		return `{"type":"pull-wake","pattern":"none/*","wake_stream":"wake/pool","description":"` + strings.Repeat("d", n) + `"}`
	}
	for _, tc := range []struct {
		name, id, body string
		status         int
	}{
		{"webhook URL at the limit", "h1", hook(2048), http.StatusCreated},
		{"webhook URL over it", "h2", hook(2049), http.StatusBadRequest},
		{"webhook URL of a megabyte", "h3", hook(1000 << 10), http.StatusBadRequest},
		{"description at the limit", "d1", described(4096), http.StatusCreated},
		{"description over it", "d2", described(4097), http.StatusBadRequest},
		{"description of a megabyte", "d3", described(1000 << 10), http.StatusBadRequest},
		// A create with an id over 120 bytes was 404 "no such control
		// resource", as if the URL were wrong.
		{"id at the limit", strings.Repeat("i", 120), described(10), http.StatusCreated},
		{"id over it", strings.Repeat("i", 121), described(10), http.StatusBadRequest},
	} {
		st, v := e.subCall("PUT", root+"__ds/subscriptions/"+tc.id, tc.body)
		if st != tc.status || (st == http.StatusBadRequest && errCodeOf(v) != "INVALID_REQUEST") {
			t.Errorf("%s: %d %s, want %d", tc.name, st, fhClip(fmt.Sprint(v), 200), tc.status)
		}
	}

	sub := root + "__ds/subscriptions/p1"
	if st, v := e.subCall("PUT", sub, `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake/pool"}`); st != http.StatusCreated {
		t.Fatalf("create: %d %v", st, v)
	}
	e.create(root+"events/a", "application/json")
	e.append(root+"events/a", "application/json", []byte(`{"n":1}`))
	if err := e.waitWakes(root+"wake/pool", "p1", 1); err != nil {
		t.Fatalf("no wake: %v", err)
	}
	for _, n := range []int{257, 1000 << 10} {
		st, v := e.subCall("POST", sub+"/claim", `{"worker":"`+strings.Repeat("w", n)+`"}`)
		if st != http.StatusBadRequest || errCodeOf(v) != "INVALID_REQUEST" {
			t.Errorf("claim by a worker named with %d bytes: %d %s, want 400", n, st, fhClip(fmt.Sprint(v), 200))
		}
	}
	if st, v := e.subCall("POST", sub+"/claim", `{"worker":"`+strings.Repeat("w", 256)+`"}`); st != http.StatusOK {
		t.Errorf("claim by a worker named with 256 bytes: %d %v, want 200", st, v)
	}

	// wake_stream is pull-wake's: a webhook's megabyte of it was kept,
	// and hashed, so the configuration its GET shows was 409.
	withWake := strings.TrimSuffix(hook(100), "}") + `,"wake_stream":"` + strings.Repeat("w", 900<<10) + `"}`
	if st, v := e.subCall("PUT", root+"__ds/subscriptions/h4", withWake); st != http.StatusCreated {
		t.Fatalf("webhook with a wake_stream: %d %s", st, fhClip(fmt.Sprint(v), 200))
	}
	key := "subs/" + hex.EncodeToString([]byte(root)) + "/" + hex.EncodeToString([]byte("h4"))
	if doc, err := e.get(key); err != nil || len(doc) > 64<<10 {
		t.Errorf("the webhook's document: %d bytes, %v", len(doc), err)
	}
	if st, v := e.subCall("PUT", root+"__ds/subscriptions/h4", hook(100)); st != http.StatusOK {
		t.Errorf("re-confirm without the wake_stream: %d %s, want 200", st, fhClip(fmt.Sprint(v), 200))
	}
}
