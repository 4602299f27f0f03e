package integration

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestSubscriptionsSurviveSIGKILL: a webhook wake in flight and a pull-wake
// lease are both held when Caddy is SIGKILLed. After the restart the webhook
// wake is delivered again with the same generation (no wake is lost), the
// pull-wake lease still excludes other workers, stale generations are
// fenced, and acked offsets come back after another kill.
func TestSubscriptionsSurviveSIGKILL(t *testing.T) {
	v := testenv.NewVersity(t)
	bucket := v.NewBucket(t)
	storage := testenv.StoreURL(v.Endpoint, bucket, caddytest.S3Prefix)

	var mu sync.Mutex
	var deliveries []map[string]any
	recv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		json.NewDecoder(r.Body).Decode(&body)
		mu.Lock()
		deliveries = append(deliveries, body)
		mu.Unlock()
		io.WriteString(w, `{}`) // asynchronous: the wake stays in flight
	}))
	defer recv.Close()
	waitDeliveries := func(n int) map[string]any {
		t.Helper()
		deadline := time.Now().Add(15 * time.Second)
		for {
			mu.Lock()
			if len(deliveries) >= n {
				d := deliveries[n-1]
				mu.Unlock()
				return d
			}
			mu.Unlock()
			if time.Now().After(deadline) {
				t.Fatalf("fewer than %d webhook deliveries", n)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	c := caddytest.Start(t, caddyOptions(v, storage, "allow_loopback_webhooks"))
	call := func(method, path, body string, hdr ...string) (int, map[string]any) {
		t.Helper()
		req, _ := http.NewRequest(method, c.URL()+path, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		defer res.Body.Close()
		var out map[string]any
		b, _ := io.ReadAll(res.Body)
		json.Unmarshal(b, &out)
		return res.StatusCode, out
	}
	code := func(v map[string]any) string {
		e, _ := v["error"].(map[string]any)
		s, _ := e["code"].(string)
		return s
	}
	const hook, pull = "/r/__ds/subscriptions/hook", "/r/__ds/subscriptions/pull"
	if st, _ := call("PUT", "/r/wake", "[]"); st != 201 {
		t.Fatalf("wake stream: %d", st)
	}
	if st, v := call("PUT", hook, `{"type":"webhook","pattern":"events/*","webhook":{"url":"`+recv.URL+`/h"},"lease_ttl_ms":600000}`); st != 201 {
		t.Fatalf("webhook subscription: %d %v", st, v)
	}
	if st, v := call("PUT", pull, `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake","lease_ttl_ms":600000}`); st != 201 {
		t.Fatalf("pull subscription: %d %v", st, v)
	}
	if st, _ := call("PUT", "/r/events/a", `{"n":1}`); st != 201 {
		t.Fatal("events/a")
	}
	first := waitDeliveries(1)
	var claim map[string]any
	deadline := time.Now().Add(10 * time.Second)
	for {
		var st int
		if st, claim = call("POST", pull+"/claim", `{"worker":"w1"}`); st == 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("claim: %d %v", st, claim)
		}
		time.Sleep(20 * time.Millisecond)
	}

	c.Kill()
	c.Restart()
	if err := waitServing(c, 60*time.Second); err != nil {
		t.Fatal(err)
	}

	again := waitDeliveries(2)
	if again["generation"] != first["generation"] || again["wake_id"] != first["wake_id"] {
		t.Fatalf("redelivery after restart: generation %v wake %v, want %v %v", again["generation"], again["wake_id"], first["generation"], first["wake_id"])
	}
	gen := int(first["generation"].(float64))
	tail := first["streams"].([]any)[0].(map[string]any)["tail_offset"].(string)
	cb := func(g int) string {
		return `{"wake_id":"` + first["wake_id"].(string) + `","generation":` + strconv.Itoa(g) +
			`,"acks":[{"stream":"events/a","offset":"` + tail + `"}],"done":true}`
	}
	bearer := "Bearer " + again["callback_token"].(string)
	if st, v := call("POST", hook+"/callback", cb(gen-1), "Authorization", bearer); st != 409 || code(v) != "FENCED" {
		t.Fatalf("stale callback: %d %v", st, v)
	}
	if st, v := call("POST", hook+"/callback", cb(gen), "Authorization", bearer); st != 200 || v["ok"] != true {
		t.Fatalf("callback: %d %v", st, v)
	}
	if st, v := call("POST", pull+"/claim", `{"worker":"w2"}`); st != 409 || code(v) != "ALREADY_CLAIMED" || v["error"].(map[string]any)["current_holder"] != "w1" {
		t.Fatalf("claim while w1 holds the lease: %d %v", st, v)
	}
	pgen := int(claim["generation"].(float64))
	ack := `{"wake_id":"` + claim["wake_id"].(string) + `","generation":` + strconv.Itoa(pgen) +
		`,"acks":[{"stream":"events/a","offset":"` + tail + `"}],"done":true}`
	if st, v := call("POST", pull+"/ack", ack, "Authorization", "Bearer "+claim["token"].(string)); st != 200 || v["next_wake"] != false {
		t.Fatalf("pull ack after restart: %d %v", st, v)
	}

	c.Kill()
	c.Restart()
	if err := waitServing(c, 60*time.Second); err != nil {
		t.Fatal(err)
	}
	if st, v := call("POST", pull+"/ack", ack, "Authorization", "Bearer "+claim["token"].(string)); st != 409 || code(v) != "FENCED" {
		t.Fatalf("replayed ack after second restart: %d %v", st, v)
	}
	for _, sub := range []string{hook, pull} {
		st, v := call("GET", sub, "")
		if st != 200 {
			t.Fatalf("GET %s: %d", sub, st)
		}
		link := v["streams"].([]any)[0].(map[string]any)
		if link["acked_offset"] != tail {
			t.Errorf("%s: acked %v after restart, want %s", sub, link["acked_offset"], tail)
		}
	}
}
