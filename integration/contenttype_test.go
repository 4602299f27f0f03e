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
	// Nothing was appended.
	for _, p := range []string{"/ds/ct/text", "/ds/ct/json"} {
		if _, next, err := e.readBytes(p); err != nil || next != "0000000000000000_0000000000000000" {
			t.Errorf("%s after the refused appends: tail %q %v, want it empty", p, next, err)
		}
	}
}
