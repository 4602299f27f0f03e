package integration

import (
	"net/http"
	"strings"
	"testing"
)

// TestContentTypeMismatchNamesBothTypes sends appends whose Content-Type is
// not their stream's, in both protocols, and checks that the 409 names the
// type sent and the stream's. A newcomer's first `curl -X POST --data x`
// sends application/x-www-form-urlencoded without saying so; "does not
// match the stream's" alone left them to guess which type either side had.
func TestContentTypeMismatchNamesBothTypes(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, nil, nil)
	e.create("/ds/ct/text", "text/plain")
	e.create("/ds/ct/json", "application/json")

	cases := []struct {
		name, path, sent string
		body             string
		stream           string
	}{
		// curl's --data without -H: the engine's check.
		{"durable-streams/form", "/ds/ct/text", "application/x-www-form-urlencoded", "a=b", "text/plain"},
		// A body that is not valid JSON, labelled JSON, to a text stream:
		// the mismatch is found on the body's error path.
		{"durable-streams/not-json", "/ds/ct/text", "application/json", `{"k":`, "text/plain"},
		{"pico/record", "/pico/ct/json", "text/plain", `"x"`, "application/json"},
		// A record that is not JSON, to a JSON stream, in another type:
		// Pico looks the stream up before the engine does.
		{"pico/not-json", "/pico/ct/json", "text/plain", "x", "application/json"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := e.must(fhReq{Method: http.MethodPost, Path: c.path, Body: []byte(c.body),
				Header: map[string]string{"Content-Type": c.sent}})
			if r.Status != http.StatusConflict {
				t.Fatalf("POST %s as %s: %s, want 409", c.path, c.sent, r)
			}
			for _, want := range []string{c.sent, c.stream} {
				if !strings.Contains(string(r.Body), want) {
					t.Errorf("POST %s as %s: %s, want a reason naming %q", c.path, c.sent, r, want)
				}
			}
		})
	}
	// The type is judged before the producer's seq and epoch (section 5.2's
	// order): a retry in another type is no retry of what was stored, and
	// a stale epoch is told the type first.
	e.create("/ds/ct/prod", "text/plain")
	producer := func(epoch, seq, ct, body string) fhResp {
		return e.must(fhReq{Method: http.MethodPost, Path: "/ds/ct/prod", Body: []byte(body), Header: map[string]string{
			"Content-Type": ct, "Producer-Id": "p", "Producer-Epoch": epoch, "Producer-Seq": seq}})
	}
	for _, step := range []struct {
		name, epoch, seq, ct string
		status               int
	}{
		{"first append", "0", "0", "text/plain", http.StatusOK},
		{"its retry in another type", "0", "0", "application/x-www-form-urlencoded", http.StatusConflict},
		{"its retry", "0", "0", "text/plain", http.StatusNoContent},
		{"a new epoch", "1", "0", "text/plain", http.StatusOK},
		{"the stale epoch in another type", "0", "1", "application/x-www-form-urlencoded", http.StatusConflict},
		{"the stale epoch", "0", "1", "text/plain", http.StatusForbidden},
	} {
		if r := producer(step.epoch, step.seq, step.ct, "x"); r.Status != step.status {
			t.Errorf("%s (epoch %s, seq %s, %s): %s, want %d", step.name, step.epoch, step.seq, step.ct, r, step.status)
		}
	}

	// A body refused for itself on a stream that is not there: the
	// stream's answer, 404, or 410 once soft-deleted (section 4.2 gives it
	// every operation on its URL), not the body's 400.
	e.create("/ds/ct/src", "application/json")
	if r := e.must(fhReq{Method: http.MethodPut, Path: "/ds/ct/fork", Header: map[string]string{"Stream-Forked-From": "/ds/ct/src"}}); r.Status != http.StatusCreated {
		t.Fatalf("fork: %s", r)
	}
	if r := e.must(fhReq{Method: http.MethodDelete, Path: "/ds/ct/src"}); r.Status != http.StatusNoContent {
		t.Fatalf("delete the source: %s", r)
	}
	for path, want := range map[string]int{"/ds/ct/src": http.StatusGone, "/ds/ct/none": http.StatusNotFound} {
		r := e.must(fhReq{Method: http.MethodPost, Path: path, Body: []byte(`{"k":`), Header: map[string]string{"Content-Type": "application/json"}})
		if r.Status != want {
			t.Errorf("invalid JSON to %s: %s, want %d", path, r, want)
		}
	}

	// Nothing was appended.
	for _, p := range []string{"/ds/ct/text", "/ds/ct/json"} {
		if _, next, err := e.readBytes(p); err != nil || next != "0000000000000000_0000000000000000" {
			t.Errorf("%s after the refused appends: tail %q %v, want it empty", p, next, err)
		}
	}
}
