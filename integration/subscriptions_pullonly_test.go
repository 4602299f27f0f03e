package integration

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"
)

// TestWebhookSubscriptionRefusesPullWakeEndpoints: through Caddy on
// versitygw, a claim of a webhook subscription is refused with 400
// INVALID_REQUEST (claim, ack and release are pull-wake's, section 7.2;
// the reference server refuses them too), and the append that follows is
// delivered to the webhook. The claim used to be granted, and its lease
// (ten minutes here) kept every delivery off. Ack and release with the
// delivery's callback token are refused the same way, and leave the wake
// to the callback.
func TestWebhookSubscriptionRefusesPullWakeEndpoints(t *testing.T) {
	deliveries := make(chan map[string]any, 16)
	recv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		_ = json.NewDecoder(r.Body).Decode(&body)
		deliveries <- body
		io.WriteString(w, `{}`) // asynchronous: the wake stays in flight
	}))
	defer recv.Close()
	e := fhStart(t, fhOptions{Directives: []string{"allow_loopback_webhooks"}})
	const sub = "/v1/stream/__ds/subscriptions/hook"
	if st, v := e.subCall("PUT", sub, `{"type":"webhook","pattern":"events/*","webhook":{"url":"`+recv.URL+`/h"},"lease_ttl_ms":600000}`); st != http.StatusCreated {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	if st, v := e.subCall("POST", sub+"/claim", `{"worker":"w1"}`); st != http.StatusBadRequest || errCodeOf(v) != "INVALID_REQUEST" {
		t.Fatalf("claim of a webhook subscription: %d %v, want 400 INVALID_REQUEST", st, v)
	}
	if st, v := e.subCall("PUT", "/v1/stream/events/a", `{"n":1}`); st != http.StatusCreated {
		t.Fatalf("create stream: %d %v", st, v)
	}
	var d map[string]any
	select {
	case d = <-deliveries:
	case <-time.After(30 * time.Second):
		t.Fatal("no webhook delivery after the refused claim")
	}
	tail := d["streams"].([]any)[0].(map[string]any)["tail_offset"].(string)
	wake := `{"wake_id":"` + d["wake_id"].(string) + `","generation":` + strconv.Itoa(int(d["generation"].(float64)))
	acks := `,"acks":[{"stream":"events/a","offset":"` + tail + `"}],"done":true}`
	bearer := "Bearer " + d["callback_token"].(string)
	for _, tc := range []struct{ path, body string }{
		{sub + "/release", wake + `}`},
		{sub + "/ack", wake + acks},
	} {
		if st, v := e.subCall("POST", tc.path, tc.body, "Authorization", bearer); st != http.StatusBadRequest || errCodeOf(v) != "INVALID_REQUEST" {
			t.Errorf("POST %s of a webhook subscription: %d %v, want 400 INVALID_REQUEST", tc.path, st, v)
		}
	}
	if st, v := e.subCall("POST", sub+"/callback", wake+acks, "Authorization", bearer); st != http.StatusOK || v["ok"] != true {
		t.Fatalf("callback after the refused requests: %d %v (the wake should still be in flight)", st, v)
	}
	if _, v := e.subCall("GET", sub, ""); v["streams"].([]any)[0].(map[string]any)["acked_offset"] != tail {
		t.Fatalf("after the callback: %v, want acked %s", v, tail)
	}
}

// errCodeOf is the code of a control API error body, "" for another body.
func errCodeOf(v map[string]any) string {
	e, _ := v["error"].(map[string]any)
	c, _ := e["code"].(string)
	return c
}
