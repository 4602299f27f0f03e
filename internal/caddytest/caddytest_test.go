package caddytest

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

func TestConfigGenerated(t *testing.T) {
	c := &Caddy{port: 8080, admin: "127.0.0.1:9090"}
	got := c.Config(Options{
		Storage:    "s3://b/p?region=us-east-1&endpoint=http://127.0.0.1:1&path_style=true",
		Directives: []string{"long_poll_timeout 500ms"},
		PathPrefix: "/ds/",
	})
	want := `{
	admin 127.0.0.1:9090
	persist_config off
}

http://:8080 {
	bind 127.0.0.1
	handle_path /ds/* {
		route {
			picomq {
				storage s3://b/p?region=us-east-1&endpoint=http://127.0.0.1:1&path_style=true
				long_poll_timeout 500ms
			}
		}
	}
}
`
	if got != want {
		t.Errorf("Config() =\n%s\nwant\n%s", got, want)
	}
	if got := c.Config(Options{}); !strings.Contains(got, "\troute {\n\t\tpicomq\n\t}\n") {
		t.Errorf("Config() with no options =\n%s", got)
	}
	if got := quote(`a b"c`); got != `"a b\"c"` {
		t.Errorf("quote = %s", got)
	}
}

// respondCaddyfile answers every request with body, so the lifecycle test
// exercises the harness with nothing but Caddy's standard modules.
func respondCaddyfile(body string) string {
	return "{\n\tpersist_config off\n}\n\nhttp://:{$" + PortEnv + "} {\n\tbind 127.0.0.1\n\trespond \"" + body + "\"\n}\n"
}

func get(t *testing.T, url string) string {
	t.Helper()
	client := &http.Client{Timeout: 10 * time.Second}
	resp, err := client.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	return string(b)
}

func TestLifecycle(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs Caddy")
	}
	c := Start(t, Options{Caddyfile: respondCaddyfile("one")})
	if got := get(t, c.URL()+"/x"); got != "one" {
		t.Fatalf("body = %q, want one", got)
	}
	port := c.Port()

	// A second instance gets its own ports and data directory.
	other := Start(t, Options{Caddyfile: respondCaddyfile("other")})
	if other.Port() == port || other.AdminAddr() == c.AdminAddr() || other.DataDir() == c.DataDir() {
		t.Fatalf("instances share ports or data: %d/%s/%s and %d/%s/%s", port, c.AdminAddr(), c.DataDir(),
			other.Port(), other.AdminAddr(), other.DataDir())
	}

	if err := c.Reload(respondCaddyfile("two")); err != nil {
		t.Fatalf("reload: %v", err)
	}
	if got := get(t, c.URL()+"/x"); got != "two" {
		t.Fatalf("after reload body = %q, want two", got)
	}
	if err := c.Reload("http://:{$" + PortEnv + "} {\n\tnot_a_directive\n}\n"); err == nil {
		t.Fatal("reload of a bad Caddyfile succeeded")
	}
	if got := get(t, c.URL()+"/x"); got != "two" {
		t.Fatalf("after failed reload body = %q, want two", got)
	}

	// A crash, then the same node comes back on the same port with the
	// configuration it last ran.
	c.Kill()
	if c.Running() {
		t.Fatal("running after Kill")
	}
	c.Restart()
	if c.Port() != port {
		t.Fatalf("port changed across restart: %d -> %d", port, c.Port())
	}
	if got := get(t, c.URL()+"/x"); got != "two" {
		t.Fatalf("after restart body = %q, want two", got)
	}

	if err := c.Stop(); err != nil {
		t.Fatalf("graceful stop: %v", err)
	}
	if c.Running() {
		t.Fatal("running after Stop")
	}
	if logs := c.Logs(); strings.Count(logs, "=== caddytest:") != 2 || !strings.Contains(logs, "SIGTERM") {
		t.Errorf("log misses a run marker or the SIGTERM shutdown:\n%s", logs)
	}
}

func TestLaunchFailureReportsLog(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs Caddy")
	}
	c, err := Launch(t, Options{Caddyfile: "http://:{$" + PortEnv + "} {\n\tnot_a_directive\n}\n", ReadyTimeout: 20 * time.Second})
	if err == nil {
		t.Fatal("Launch with a bad Caddyfile succeeded")
	}
	if !strings.Contains(err.Error(), "not_a_directive") {
		t.Errorf("error does not carry Caddy's reason: %v", err)
	}
	if c.Running() {
		t.Error("process still running after a failed launch")
	}
}

// TestGeneratedConfigSameNode runs the module from a generated Caddyfile
// under a path prefix on its default storage, and checks that a restart
// after a crash is the same node: same port, same data directory, so the
// stream created before the crash is still there.
func TestGeneratedConfigSameNode(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs Caddy")
	}
	c := Start(t, Options{PathPrefix: "/ds", Directives: []string{"long_poll_timeout 500ms"}})
	stream := c.BaseURL() + "/v1/stream/same-node"
	req, err := http.NewRequest(http.MethodPut, stream, strings.NewReader("hello"))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "text/plain")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("PUT %s: %s", stream, resp.Status)
	}

	c.Kill()
	c.Restart()
	if got := get(t, stream); got != "hello" {
		t.Fatalf("GET %s after restart = %q, want hello", stream, got)
	}
}

// TestFreePortsAreDistinct: an instance's HTTP and admin ports must never
// coincide (with SO_REUSEPORT both binds succeed and share connections).
func TestFreePortsAreDistinct(t *testing.T) {
	for range 500 {
		ports, err := freePorts(3)
		if err != nil {
			t.Fatal(err)
		}
		if ports[0] == ports[1] || ports[1] == ports[2] || ports[0] == ports[2] {
			t.Fatalf("freePorts(3) = %v", ports)
		}
	}
}

// TestFreePortsAreNeverHandedOutTwice: parallel tests each take ports, and
// two instances given one port share its connections.
func TestFreePortsAreNeverHandedOutTwice(t *testing.T) {
	seen := make(map[int]bool)
	for range 300 {
		ports, err := freePorts(1)
		if err != nil {
			t.Fatal(err)
		}
		if seen[ports[0]] {
			t.Fatalf("port %d handed out twice", ports[0])
		}
		seen[ports[0]] = true
	}
}

func TestCountListeners(t *testing.T) {
	const table = `  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:9470 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0
   1: 0100007F:9470 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1 0000000000000000 100 0 0 10 0
   2: 0100007F:9470 0100007F:D2A4 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0000000000000000 20 4 30 10 -1
   3: 0100007F:1470 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4 1 0000000000000000 100 0 0 10 0
`
	for _, tc := range []struct{ port, want int }{{0x9470, 2}, {0x1470, 1}, {0x470, 0}, {0xD2A4, 0}} {
		if got := countListeners(table, tc.port); got != tc.want {
			t.Errorf("countListeners(%#x) = %d, want %d", tc.port, got, tc.want)
		}
	}
}
