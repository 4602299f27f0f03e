package integration

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/picomq/caddy-picomq/internal/caddytest"
)

// TestCaddyfileErrorsReachTheOperator starts Caddy with a bad picomq line:
// it must refuse to start, saying which line and what is wrong with it.
func TestCaddyfileErrorsReachTheOperator(t *testing.T) {
	for _, tc := range []struct{ line, want, before string }{
		{"flush_size lots", `flush_size: invalid size "lots"`, ""},
		{"protocol mqtt", `protocol: unknown protocol "mqtt"`, ""},
		{"flush_quite 1ms", `unrecognized picomq option "flush_quite"`, ""},
		{"pack_below 32MiB", "pack_below: must be at most 16MiB, got 32MiB", ""},
		{"compact_interval 10ms", "compact_interval: must be at least 100ms, got 10ms", ""},
		{"storage s3://my-bucket/p?regoin=eu-west-1", `storage: storage URL: unknown parameter "regoin"`, ""},
		{"storage s3://my-bucket/p region=eu-west-1", "storage: wrong argument count: it takes one value, got 2 (s3://my-bucket/p region=eu-west-1)", ""},
		{"storage s3://my-bucket/team#1", `storage: storage URL "s3://my-bucket/team": a '#' ends the URL there`, ""},
		{"cache_size 64", "cache_size: 64 has no unit, and 64 bytes is too small to be meant; write the unit: 64MiB, 64KiB, or 64B", ""},
		{"max_pending 64", "max_pending: 64 has no unit", ""},
		{"max_append_size 100", "max_append_size: 100 has no unit", ""},
	} {
		t.Run(tc.line, func(t *testing.T) {
			directives := []string{"long_poll_timeout 5s"}
			if tc.before != "" {
				directives = append(directives, tc.before)
			}
			c, err := caddytest.Launch(t, caddytest.Options{Directives: append(directives, tc.line)})
			if err == nil {
				c.Kill()
				t.Fatalf("Caddy started with %q", tc.line)
			}
			line := 0
			for i, l := range strings.Split(c.Caddyfile(), "\n") {
				if strings.TrimSpace(l) == tc.line {
					line = i + 1
				}
			}
			at := "Caddyfile:" + strconv.Itoa(line) + ","
			msg := strings.ReplaceAll(err.Error(), `\"`, `"`)
			if line == 0 || !strings.Contains(msg, tc.want) || !strings.Contains(msg, at) {
				t.Errorf("Caddy refused %q without naming the problem (%q) and its line (%s):\n%s",
					tc.line, tc.want, at, truncateTail(msg, 2000))
			}
		})
	}
}

// TestStartErrorSaysItOnce starts Caddy on a storage it cannot open (a
// format object that is not PicoMQ's): Caddy refuses to start, saying
// which storage and why, and names the engine's start once (it said
// "starting engine: start engine: ...").
func TestStartErrorSaysItOnce(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "format"), []byte("not a format"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := caddytest.Launch(t, caddytest.Options{Storage: "file://" + dir})
	if err == nil {
		c.Kill()
		t.Fatal("Caddy started on a storage of an unknown format")
	}
	want := "starting storage file://" + dir + ": start engine: format object is not PicoMQ's"
	msg := strings.ReplaceAll(err.Error(), `\"`, `"`)
	if !strings.Contains(msg, want) || strings.Contains(msg, "starting engine") {
		t.Errorf("Caddy's refusal does not say %q alone:\n%s", want, truncateTail(msg, 2000))
	}
}

// TestGlobalPicomqOptionRefused starts Caddy with picomq written among
// the global options: it refuses to start saying where picomq goes, and
// on which line it was.
func TestGlobalPicomqOptionRefused(t *testing.T) {
	caddyfile := "{\n\tpersist_config off\n\tpicomq {\n\t\tstorage file:///srv/streams\n\t}\n}\n\n" +
		"http://:{$" + caddytest.PortEnv + "} {\n\tbind 127.0.0.1\n\trespond 200\n}\n"
	c, err := caddytest.Launch(t, caddytest.Options{Caddyfile: caddyfile})
	if err == nil {
		c.Kill()
		t.Fatal("Caddy started with picomq as a global option")
	}
	for _, want := range []string{"picomq is a site directive, not a global option: put it inside a site block", "Caddyfile:3"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the start error does not say %q:\n%s", want, truncateTail(err.Error(), 2000))
		}
	}
}

// TestPicoHandlerWarnsOfSubscriptionOptions: a Pico handler given the
// options of subscriptions, which only Durable Streams handlers use (a
// snippet shared by both, say), starts and serves, and Caddy's log names
// the options it ignores. They were taken without a word.
func TestPicoHandlerWarnsOfSubscriptionOptions(t *testing.T) {
	c, err := caddytest.Launch(t, caddytest.Options{Directives: []string{"protocol pico", "max_subscriptions 10", "allow_loopback_webhooks"}})
	if err != nil {
		t.Fatalf("Caddy with subscription options on a Pico handler: %v", err)
	}
	logs := c.Logs()
	if !strings.Contains(logs, "only Durable Streams handlers use are ignored") ||
		!strings.Contains(logs, `"options":["max_subscriptions","allow_loopback_webhooks"]`) {
		t.Errorf("no warning naming the ignored options:\n%s", truncateTail(logs, 3000))
	}
}
