package integration

import (
	"bytes"
	"io"
	"net/http"
	"strings"
	"testing"
)

// TestBodyTooLargeNamesItsLimit sends bodies over each limit a body can
// meet, in both protocols, and checks that the 413 names the setting
// that refused it, not only a byte count: max_append_size, the site's
// request_body max_size (a chunked body reaches the module, which finds
// the limit Caddy put in front of it), and the subscription API's own.
// With the number alone an operator, told by a client of "the
// 1000-byte limit", had to guess which of the settings it was.
func TestBodyTooLargeNamesItsLimit(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	guard := "\t\t@limited path /limited/*\n\t\trequest_body @limited {\n\t\t\tmax_size 1KB\n\t\t}\n"
	e := picoStartGuarded(t, []string{"max_append_size 2KiB"}, nil, guard)
	for _, p := range []string{"/ds/open/s", "/ds/limited/s"} {
		e.create(p, "text/plain")
	}
	cases := []struct {
		name, method, path string
		size               int
		chunked            bool
		want               string
	}{
		{"durable-streams/max_append_size", http.MethodPost, "/ds/open/s", 3000, false, "max_append_size"},
		{"durable-streams/max_append_size-chunked", http.MethodPost, "/ds/open/s", 3000, true, "max_append_size"},
		{"pico/max_append_size", http.MethodPost, "/pico/open/s", 3000, false, "max_append_size"},
		{"durable-streams/request_body", http.MethodPost, "/ds/limited/s", 1500, true, "request_body max_size"},
		{"pico/request_body", http.MethodPost, "/pico/limited/s", 1500, true, "request_body max_size"},
		{"subscription", http.MethodPut, "/ds/v1/__ds/subscriptions/big", 1<<20 + 10, false, "subscription"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			body := bytes.Repeat([]byte(" "), c.size)
			var rd io.Reader = bytes.NewReader(body)
			if c.chunked {
				rd = io.MultiReader(rd) // no length: sent chunked
			}
			req, err := http.NewRequest(c.method, e.caddy.URL()+c.path, rd)
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Content-Type", "text/plain")
			if strings.Contains(c.path, "__ds") {
				req.Header.Set("Content-Type", "application/json")
			}
			resp, err := e.client.Do(req)
			if err != nil {
				t.Fatalf("%s %s: %v", c.method, c.path, err)
			}
			msg, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusRequestEntityTooLarge || !strings.Contains(string(msg), c.want) {
				t.Errorf("%s %s of %d bytes (chunked %v): %d %q, want 413 naming %s",
					c.method, c.path, c.size, c.chunked, resp.StatusCode, msg, c.want)
			}
		})
	}
	for _, p := range []string{"/ds/open/s", "/ds/limited/s"} {
		if _, next, err := e.readBytes(p); err != nil || next != "0000000000000000_0000000000000000" {
			t.Errorf("%s after the refused appends: tail %q %v, want it empty", p, next, err)
		}
	}
}
