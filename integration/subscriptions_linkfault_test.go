package integration

import (
	"encoding/hex"
	"net/http"
	"strconv"
	"testing"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestExplicitLinkWhenTheStreamCannotBeRead: through Caddy on versitygw, a
// subscription create or a streams add that names an existing stream the
// server cannot read (its metadata refused by the store) is 503
// UNAVAILABLE and links nothing. It was 201 and 204, the stream linked at
// offset 0 as if it did not exist, so its whole history was offered to
// the worker as pending work, where section 6.4 links a stream at its
// tail. The answer has Retry-After and names no object key (it named the
// stream's metadata key and the S3 error). Once the store answers, the
// same requests link it at its tail.
func TestExplicitLinkWhenTheStreamCannotBeRead(t *testing.T) {
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s", "pack_below off"}})
	const root = "/v1/stream/"
	e.create(root+"wake/pool", "application/json")
	// One stream per case: a case that reads its stream keeps it in memory.
	for _, stream := range []string{"events/c1", "events/a1"} {
		e.create(root+stream, "application/json")
		for i := 0; i < 3; i++ {
			e.append(root+stream, "application/json", []byte(`{"n":`+strconv.Itoa(i)+`}`))
		}
	}
	// Compacted out of the WAL, the stream is read from the store again
	// after a restart.
	if err := e.waitGone("wal/"); err != nil {
		t.Fatalf("not compacted: %v", err)
	}
	e.caddy.Restart()

	for _, tc := range []struct {
		name   string
		id     string
		stream string
		setup  string // PUT body; "" when the subscription is made first
		method string
		path   string
		body   string
		ok     int
	}{
		{name: "create", id: "c1", stream: "events/c1", method: "PUT",
			body: `{"type":"pull-wake","streams":["events/c1"],"wake_stream":"wake/pool"}`, ok: http.StatusCreated},
		{name: "add", id: "a1", stream: "events/a1", setup: `{"type":"pull-wake","streams":["events/other"],"wake_stream":"wake/pool"}`,
			method: "POST", path: "/streams", body: `{"streams":["events/a1"]}`, ok: http.StatusNoContent},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sub, stream := root+"__ds/subscriptions/"+tc.id, tc.stream
			if tc.setup != "" {
				if st, v := e.subCall("PUT", sub, tc.setup); st != http.StatusCreated {
					t.Fatalf("create: %d %v", st, v)
				}
			}
			remove := e.proxy.AddFault(testenv.Fault{KeyContains: hex.EncodeToString([]byte(stream)), Status: http.StatusForbidden})
			r := e.must(fhReq{Method: tc.method, Path: sub + tc.path, Header: map[string]string{"Content-Type": "application/json"}, Body: []byte(tc.body)})
			remove()
			t.Logf("with the stream unreadable: %s, Retry-After %q", r, r.Header.Get("Retry-After"))
			if r.Status != http.StatusServiceUnavailable || r.Header.Get("Retry-After") != "1" {
				t.Errorf("with the stream unreadable: %s, Retry-After %q; want 503 with Retry-After 1", r, r.Header.Get("Retry-After"))
			}
			// The store's error, with the stream's key, goes to the log.
			if fhContainsAny(string(r.Body), hex.EncodeToString([]byte(stream)), "streams/", "operation error", "segment:") {
				t.Errorf("with the stream unreadable: %s names the stream's key or the store's error", r)
			}
			if st, v := e.subCall("GET", sub, ""); st == http.StatusOK {
				for _, l := range v["streams"].([]any) {
					if l := l.(map[string]any); l["path"] == stream {
						t.Errorf("linked while the stream could not be read, at %v", l["acked_offset"])
					}
				}
			}
			if st, v := e.subCall(tc.method, sub+tc.path, tc.body); st != tc.ok && st != http.StatusOK {
				t.Fatalf("with the store back: %d %v", st, v)
			}
			st, v := e.subCall("GET", sub, "")
			if st != http.StatusOK {
				t.Fatalf("get: %d %v", st, v)
			}
			found := false
			for _, l := range v["streams"].([]any) {
				if l := l.(map[string]any); l["path"] == stream {
					found = true
					if l["acked_offset"] != subOffset(3) {
						t.Errorf("linked at %v, want its tail %s", l["acked_offset"], subOffset(3))
					}
				}
			}
			if !found {
				t.Errorf("%s not linked: %v", stream, v["streams"])
			}
		})
	}
}
