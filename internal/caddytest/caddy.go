package caddytest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Environment variables set for the child (and for `caddy reload`), usable in
// a hand-written Caddyfile through Caddy's parse-time substitution, e.g.
// `http://:{$CADDYTEST_PORT}` and `admin {$CADDYTEST_ADMIN}`.
const (
	PortEnv  = "CADDYTEST_PORT"  // the HTTP port picked for the instance
	AdminEnv = "CADDYTEST_ADMIN" // host:port of the admin endpoint
)

// Options describe a Caddy instance to start.
type Options struct {
	// Caddyfile, when set, is used as is instead of generating one from the
	// fields below. It should listen on {$CADDYTEST_PORT}; the admin endpoint
	// defaults to {$CADDYTEST_ADMIN} (through CADDY_ADMIN) unless it sets one.
	Caddyfile string

	// Storage is the picomq storage URL (file://..., s3://...); empty keeps
	// the module's default (under the instance's data directory).
	Storage string
	// Directives are extra lines inside the picomq block, such as
	// "long_poll_timeout 500ms".
	Directives []string
	// PathPrefix, such as "/ds", mounts the module under handle_path
	// PREFIX/*; BaseURL then includes it.
	PathPrefix string

	// Env holds extra KEY=VALUE pairs for the child, such as S3 credentials
	// (see S3Env). AWS_* variables of the test process are not inherited.
	Env []string
	// DataDir is the node's home: HOME, XDG_DATA_HOME (Caddy's data
	// directory, which holds the node id and the default storage) and
	// XDG_CONFIG_HOME live under it. Pass the DataDir of an earlier instance
	// to start "the same node" again. Empty means a fresh temporary one.
	DataDir string
	// ReadyTimeout bounds the wait for the HTTP port to answer (default 60s).
	ReadyTimeout time.Duration
}

// Caddy is a running (or stopped) Caddy child process.
type Caddy struct {
	t       testing.TB
	bin     string
	dir     string // config file and log live here
	dataDir string
	opts    Options
	port    int
	admin   string // host:port

	mu        sync.Mutex
	caddyfile string
	cmd       *exec.Cmd
	done      chan struct{} // closed when cmd has exited
	exitErr   error
}

// Start builds Caddy if needed and starts an instance described by opts,
// failing the test if it does not come up. Everything it starts is killed
// and removed when the test ends; the log is printed if the test failed.
func Start(t testing.TB, opts Options) *Caddy {
	t.Helper()
	c, err := Launch(t, opts)
	if err != nil {
		t.Fatalf("caddytest: %v", err)
	}
	return c
}

// Launch is Start that returns an error instead of failing the test, for
// tests that expect a start-up to fail (the error then includes the log).
// Even on error, the returned *Caddy is usable for Logs and Restart.
func Launch(t testing.TB, opts Options) (*Caddy, error) {
	t.Helper()
	bin := BuildCaddy(t)
	// Created before the cleanup below is registered, so it is removed after
	// that cleanup has killed the process and printed the log.
	dir := t.TempDir()
	if opts.DataDir == "" {
		opts.DataDir = filepath.Join(dir, "node")
	}
	if err := os.MkdirAll(opts.DataDir, 0o755); err != nil {
		return nil, err
	}
	if opts.ReadyTimeout == 0 {
		opts.ReadyTimeout = 60 * time.Second
	}
	c := &Caddy{t: t, bin: bin, dir: dir, dataDir: opts.DataDir, opts: opts}
	t.Cleanup(func() {
		c.kill()
		if t.Failed() {
			t.Logf("caddytest: log of caddy on port %d (%s):\n%s", c.port, c.logPath(), tail(c.Logs(), 256<<10))
			c.keepLog()
		}
	})

	// A port picked free can be taken before Caddy binds it; try again then.
	var err error
	for attempt := 0; attempt < 3; attempt++ {
		var ports []int
		if ports, err = freePorts(2); err != nil {
			return c, err
		}
		c.port = ports[0]
		c.admin = net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[1]))
		c.caddyfile = opts.Caddyfile
		if c.caddyfile == "" {
			c.caddyfile = c.Config(opts)
		}
		err = c.start()
		if err == nil || !strings.Contains(err.Error(), "address already in use") {
			break
		}
	}
	return c, err
}

// Config renders the Caddyfile that Start generates for opts, on this
// instance's ports: handy for Reload with changed directives. Generated
// configs bind 127.0.0.1 only and turn off config persistence.
func (c *Caddy) Config(opts Options) string {
	var b strings.Builder
	fmt.Fprintf(&b, "{\n\tadmin %s\n\tpersist_config off\n}\n\n", c.admin)
	fmt.Fprintf(&b, "http://:%d {\n\tbind 127.0.0.1\n", c.port)
	indent := "\t"
	if opts.PathPrefix != "" {
		fmt.Fprintf(&b, "\thandle_path %s/* {\n", strings.TrimSuffix(opts.PathPrefix, "/"))
		indent += "\t"
	}
	// route keeps the directive where it is, whatever its registered order.
	fmt.Fprintf(&b, "%sroute {\n", indent)
	var lines []string
	if opts.Storage != "" {
		lines = append(lines, "storage "+quote(opts.Storage))
	}
	lines = append(lines, opts.Directives...)
	if len(lines) == 0 {
		fmt.Fprintf(&b, "%s\tpicomq\n", indent)
	} else {
		fmt.Fprintf(&b, "%s\tpicomq {\n", indent)
		for _, l := range lines {
			fmt.Fprintf(&b, "%s\t\t%s\n", indent, l)
		}
		fmt.Fprintf(&b, "%s\t}\n", indent)
	}
	fmt.Fprintf(&b, "%s}\n", indent)
	if opts.PathPrefix != "" {
		b.WriteString("\t}\n")
	}
	b.WriteString("}\n")
	return b.String()
}

// URL is the instance's root URL, http://127.0.0.1:PORT.
func (c *Caddy) URL() string { return fmt.Sprintf("http://127.0.0.1:%d", c.port) }

// BaseURL is URL plus Options.PathPrefix: where the module's paths start.
func (c *Caddy) BaseURL() string {
	return c.URL() + strings.TrimSuffix(c.opts.PathPrefix, "/")
}

// Port is the HTTP port; it stays the same across Restart.
func (c *Caddy) Port() int { return c.port }

// AdminAddr is the admin endpoint's host:port.
func (c *Caddy) AdminAddr() string { return c.admin }

// DataDir is the node's data directory (see Options.DataDir).
func (c *Caddy) DataDir() string { return c.dataDir }

// PID is the process id of the current (or last) run of the child, 0 when
// none was started; a Restart changes it.
func (c *Caddy) PID() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cmd == nil || c.cmd.Process == nil {
		return 0
	}
	return c.cmd.Process.Pid
}

// Caddyfile is the configuration the instance runs (after any Reload).
func (c *Caddy) Caddyfile() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.caddyfile
}

// Logs returns everything the process (and its earlier incarnations, across
// restarts) wrote to stdout and stderr.
func (c *Caddy) Logs() string {
	b, _ := os.ReadFile(c.logPath())
	return string(b)
}

// Running reports whether the child process is alive.
func (c *Caddy) Running() bool {
	c.mu.Lock()
	done := c.done
	c.mu.Unlock()
	if done == nil {
		return false
	}
	select {
	case <-done:
		return false
	default:
		return true
	}
}

// Kill ends the process with SIGKILL, as a crash would, and waits for it.
func (c *Caddy) Kill() {
	c.t.Helper()
	c.kill()
}

// Stop shuts Caddy down gracefully with SIGTERM and waits up to timeout
// (30s when zero) for it to exit; past that it kills it. It returns an error
// when Caddy had to be killed or exited with a failure status, so tests can
// check that shutdown ends long-polls and SSE promptly.
func (c *Caddy) Stop() error {
	return c.StopTimeout(30 * time.Second)
}

// StopTimeout is Stop with a chosen deadline.
func (c *Caddy) StopTimeout(timeout time.Duration) error {
	c.mu.Lock()
	cmd, done := c.cmd, c.done
	c.mu.Unlock()
	if done == nil {
		return nil
	}
	select {
	case <-done:
		return c.exitError()
	default:
	}
	start := time.Now()
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
		if err := c.exitError(); err != nil {
			return fmt.Errorf("caddy exited with %v after SIGTERM", err)
		}
		return nil
	case <-time.After(timeout):
		c.kill()
		return fmt.Errorf("caddy did not exit within %s of SIGTERM; killed it", time.Since(start).Round(time.Millisecond))
	}
}

// Restart starts the instance again on the same port, admin port and data
// directory, with its current Caddyfile: the same node coming back. A running
// process is stopped gracefully first; call Kill before it to simulate a
// crash. It fails the test if Caddy does not come up.
func (c *Caddy) Restart() {
	c.t.Helper()
	if err := c.TryRestart(); err != nil {
		c.t.Fatalf("caddytest: restart: %v", err)
	}
}

// TryRestart is Restart returning the error instead of failing the test.
func (c *Caddy) TryRestart() error {
	if c.Running() {
		if err := c.Stop(); err != nil {
			c.t.Logf("caddytest: stopping before restart: %v", err)
		}
	}
	return c.start()
}

// Reload replaces the running configuration with caddyfile through the
// admin API (`caddy reload --force`, which adapts it and POSTs it to
// /load). On success the file used by Restart is updated too; on failure
// the old configuration keeps running and the error carries Caddy's reason.
func (c *Caddy) Reload(caddyfile string) error {
	path := filepath.Join(c.dir, "Caddyfile.reload")
	if err := os.WriteFile(path, []byte(caddyfile), 0o644); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.bin, "reload", "--config", path, "--adapter", "caddyfile",
		"--address", c.admin, "--force")
	cmd.Env = c.env()
	cmd.Dir = c.dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("caddy reload: %v\n%s", err, out)
	}
	c.mu.Lock()
	c.caddyfile = caddyfile
	c.mu.Unlock()
	return os.WriteFile(c.configPath(), []byte(caddyfile), 0o644)
}

func (c *Caddy) configPath() string { return filepath.Join(c.dir, "Caddyfile") }
func (c *Caddy) logPath() string    { return filepath.Join(c.dir, "caddy.log") }

// KeepEnv names a directory that a failed test's whole Caddy logs are
// copied into (the test prints only their tail), for failures of long
// randomized runs whose cause lies far back.
const KeepEnv = "PICOMQ_KEEP"

func (c *Caddy) keepLog() {
	dir := os.Getenv(KeepEnv)
	if dir == "" {
		return
	}
	dst := filepath.Join(dir, fmt.Sprintf("caddy-%d.log", c.port))
	err := os.MkdirAll(dir, 0o755)
	if err == nil {
		err = os.WriteFile(dst, []byte(c.Logs()), 0o644)
	}
	if err != nil {
		c.t.Logf("caddytest: keeping the log: %v", err)
		return
	}
	c.t.Logf("caddytest: whole log kept in %s", dst)
}

// env is the child's environment: the test's, without AWS settings, with
// the node's own home and data directories, the admin address and Options.Env.
func (c *Caddy) env() []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch {
		case strings.HasPrefix(k, "AWS_"), k == "HOME", strings.HasPrefix(k, "XDG_"),
			k == "CADDY_ADMIN", k == PortEnv, k == AdminEnv:
			continue
		}
		env = append(env, kv)
	}
	env = append(env,
		"HOME="+c.dataDir,
		"XDG_DATA_HOME="+filepath.Join(c.dataDir, "data"),
		"XDG_CONFIG_HOME="+filepath.Join(c.dataDir, "config"),
		"CADDY_ADMIN="+c.admin,
		PortEnv+"="+strconv.Itoa(c.port),
		AdminEnv+"="+c.admin,
		// Never let the AWS SDK probe the EC2 metadata address.
		"AWS_EC2_METADATA_DISABLED=true",
	)
	return append(env, c.opts.Env...)
}

func (c *Caddy) start() error {
	c.mu.Lock()
	caddyfile := c.caddyfile
	c.mu.Unlock()
	if err := os.WriteFile(c.configPath(), []byte(caddyfile), 0o644); err != nil {
		return err
	}
	logf, err := os.OpenFile(c.logPath(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	var logStart int64
	if fi, err := logf.Stat(); err == nil {
		logStart = fi.Size()
	}
	fmt.Fprintf(logf, "=== caddytest: %s run (port %d, admin %s, data %s)\n",
		time.Now().Format(time.RFC3339Nano), c.port, c.admin, c.dataDir)
	cmd := exec.Command(c.bin, "run", "--config", c.configPath(), "--adapter", "caddyfile")
	cmd.Env = c.env()
	cmd.Dir = c.dir
	cmd.Stdout = logf
	cmd.Stderr = logf
	err = cmd.Start()
	logf.Close() // the child holds its own descriptor
	if err != nil {
		return err
	}
	done := make(chan struct{})
	c.mu.Lock()
	c.cmd, c.done, c.exitErr = cmd, done, nil
	c.mu.Unlock()
	go func() {
		err := cmd.Wait()
		c.mu.Lock()
		c.exitErr = err
		c.mu.Unlock()
		close(done)
	}()

	if err := c.waitReady(done, logStart); err != nil {
		c.kill()
		return fmt.Errorf("%v\n--- caddy log (%s) ---\n%s", err, c.logPath(), tail(c.Logs(), 64<<10))
	}
	// Caddy binds with SO_REUSEPORT: a port another process (another
	// test's Caddy) bound in the moment after it was picked binds without
	// an error, and the kernel shares the connections between the two.
	_, admin, _ := net.SplitHostPort(c.admin)
	adminPort, _ := strconv.Atoi(admin)
	for _, port := range []int{c.port, adminPort} {
		if n, ok := listeners(port); ok && n > 1 {
			c.kill()
			return fmt.Errorf("port %d has %d listening sockets: address already in use by another process", port, n)
		}
	}
	return nil
}

// listeners counts the listening TCP sockets on port, any address, as
// /proc/net/tcp and tcp6 list them; ok is false where /proc does not say.
func listeners(port int) (n int, ok bool) {
	for _, table := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(table)
		if err != nil {
			continue
		}
		ok = true
		n += countListeners(string(b), port)
	}
	return n, ok
}

// countListeners counts the rows of a /proc/net/tcp table in state LISTEN
// (0A) whose local address has port.
func countListeners(table string, port int) int {
	suffix := fmt.Sprintf(":%04X", port)
	n := 0
	for _, line := range strings.Split(table, "\n") {
		f := strings.Fields(line)
		if len(f) > 3 && f[3] == "0A" && strings.HasSuffix(f[1], suffix) {
			n++
		}
	}
	return n
}

// waitReady polls the HTTP port until it answers any HTTP response.
// waitReady waits until this run of Caddy answers on its port and has
// logged that its whole configuration is serving: the HTTP app can answer
// for a moment before another app (picomq, which opens the storage) fails
// to start and the process exits.
func (c *Caddy) waitReady(done <-chan struct{}, logStart int64) error {
	client := &http.Client{Timeout: 2 * time.Second}
	deadline := time.Now().Add(c.opts.ReadyTimeout)
	for {
		select {
		case <-done:
			return fmt.Errorf("caddy exited before serving on port %d: %v", c.port, c.exitError())
		default:
		}
		resp, err := client.Get(c.URL() + "/")
		if err == nil {
			resp.Body.Close()
			if logs := c.Logs(); int64(len(logs)) > logStart &&
				strings.Contains(logs[logStart:], "serving initial configuration") {
				return nil
			}
			err = errors.New("not serving its whole configuration yet")
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("caddy did not answer on port %d within %s: %v", c.port, c.opts.ReadyTimeout, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (c *Caddy) kill() {
	c.mu.Lock()
	cmd, done := c.cmd, c.done
	c.mu.Unlock()
	if done == nil {
		return
	}
	select {
	case <-done:
		return
	default:
	}
	_ = cmd.Process.Kill()
	<-done
}

func (c *Caddy) exitError() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.exitErr
}

// freePorts asks the kernel for n distinct free loopback TCP ports. Each is
// held until all are picked: a port closed before the next is asked for
// can come back again, and Caddy, which binds with SO_REUSEPORT, would then
// put its admin endpoint and its HTTP server on one port and share the
// connections between them (CI saw half of a test's requests answered by
// the admin API).
//
// Nor is a port handed out twice in one test process: closed again before
// its Caddy binds it, a port comes back from the kernel to the next caller,
// and parallel tests then put two Caddys on it, one's HTTP server and the
// other's admin endpoint (CI saw a PUT answered "404 page not found" by
// another instance's admin API). The start's check for a shared port
// catches that only after the second bind, while requests already flow.
func freePorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	for len(ports) < n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer l.Close() // held, even a port already handed out, so the kernel picks another
		port := l.Addr().(*net.TCPAddr).Port
		if _, dup := handedOut.LoadOrStore(port, struct{}{}); dup {
			continue
		}
		ports = append(ports, port)
	}
	return ports, nil
}

// handedOut holds every port freePorts gave in this process.
var handedOut sync.Map

// quote makes s one Caddyfile token.
func quote(s string) string {
	if !strings.ContainsAny(s, " \t\n\"{}#") {
		return s
	}
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(s) + `"`
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "[...]\n" + s[len(s)-n:]
}
