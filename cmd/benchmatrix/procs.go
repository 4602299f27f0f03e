//go:build linux

package main

import (
	"bufio"
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
	"time"
)

// proc is a child process the matrix started: Caddy, the Node server, or a
// bench run in the background. Every one is registered with the matrix so
// that it is killed on the way out, whatever the way out is.
type proc struct {
	name    string
	cmd     *exec.Cmd
	done    chan struct{}
	mu      sync.Mutex
	waitErr error
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

func (p *proc) err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.waitErr
}

// kill sends SIGKILL (to the process group too, in case the child forked)
// and waits for the exit.
func (p *proc) kill() {
	if p == nil || p.cmd == nil || p.cmd.Process == nil {
		return
	}
	if p.running() {
		syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		p.cmd.Process.Kill()
	}
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		fmt.Fprintf(os.Stderr, "benchmatrix: %s (pid %d) did not exit after SIGKILL\n", p.name, p.pid())
	}
}

// stop asks for a graceful exit with SIGTERM and kills after timeout.
func (p *proc) stop(timeout time.Duration) {
	if p == nil || p.cmd == nil || p.cmd.Process == nil || !p.running() {
		return
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(timeout):
		p.kill()
	}
}

// startProc starts cmd in its own process group, tied to the matrix: the
// kernel kills it if the matrix dies without cleaning up (Pdeathsig), and
// the matrix kills it at exit otherwise.
func (m *matrix) startProc(name string, cmd *exec.Cmd) (*proc, error) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		p.mu.Lock()
		p.waitErr = err
		p.mu.Unlock()
		close(p.done)
	}()
	m.mu.Lock()
	m.procs = append(m.procs, p)
	m.mu.Unlock()
	return p, nil
}

// killAll kills every child still running, newest first.
func (m *matrix) killAll() {
	m.mu.Lock()
	procs := append([]*proc(nil), m.procs...)
	m.procs = nil
	m.mu.Unlock()
	for i := len(procs) - 1; i >= 0; i-- {
		procs[i].kill()
	}
}

// caddyInst is one Caddy process with its own Caddyfile, data directory,
// log and port. Restart starts the same node again (same port, same data
// directory, so the same PicoMQ node id).
type caddyInst struct {
	m         *matrix
	name      string
	dir       string
	port      int
	caddyfile string
	env       []string
	p         *proc
	started   time.Time // when the current process was exec'd
}

func (c *caddyInst) url() string { return fmt.Sprintf("http://127.0.0.1:%d", c.port) }
func (c *caddyInst) pid() int    { return c.p.pid() }
func (c *caddyInst) logPath() string {
	return filepath.Join(c.dir, "caddy.log")
}

// caddyRespond is the Caddyfile of the ceiling: the same binary answering
// every request with 204 and nothing else.
func caddyRespond(port int) string {
	return fmt.Sprintf(`{
	admin off
	persist_config off
}

http://:%d {
	bind 127.0.0.1
	respond 204
}
`, port)
}

// caddyPicoMQ is the Caddyfile of a PicoMQ instance on storage with extra
// picomq directives. The directive sits in the site block as the README
// shows it and as the ceiling's respond does: a route block around it
// would compile a subroute on every request, a cost users do not pay.
func caddyPicoMQ(port int, storage string, directives []string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "{\n\tadmin off\n\tpersist_config off\n}\n\nhttp://:%d {\n\tbind 127.0.0.1\n\tpicomq {\n", port)
	fmt.Fprintf(&b, "\t\tstorage %q\n", storage)
	for _, d := range directives {
		fmt.Fprintf(&b, "\t\t%s\n", d)
	}
	b.WriteString("\t}\n}\n")
	return b.String()
}

// newCaddy prepares an instance (port, directory, environment) and starts
// it; makeConfig receives the port.
func (m *matrix) newCaddy(ctx context.Context, name string, makeConfig func(port int) string, env []string) (*caddyInst, error) {
	dir, err := os.MkdirTemp(m.work, "caddy-"+name+"-")
	if err != nil {
		return nil, err
	}
	var lastErr error
	for attempt := 0; attempt < 3; attempt++ {
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		c := &caddyInst{m: m, name: name, dir: dir, port: port, caddyfile: makeConfig(port), env: env}
		if err := c.start(); err != nil {
			return nil, err
		}
		if lastErr = c.waitReady(ctx, 90*time.Second); lastErr == nil {
			return c, nil
		}
		c.p.kill()
		if !strings.Contains(lastErr.Error(), "address already in use") {
			break
		}
	}
	return nil, lastErr
}

// start execs the process without waiting for it to serve.
func (c *caddyInst) start() error {
	cfg := filepath.Join(c.dir, "Caddyfile")
	if err := os.WriteFile(cfg, []byte(c.caddyfile), 0o644); err != nil {
		return err
	}
	logf, err := os.OpenFile(c.logPath(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	fmt.Fprintf(logf, "=== benchmatrix: %s run %s\n", time.Now().Format(time.RFC3339Nano), c.name)
	cmd := exec.Command(c.m.caddyBin, "run", "--config", cfg, "--adapter", "caddyfile")
	cmd.Dir = c.dir
	cmd.Env = caddyEnv(c.dir, c.env)
	cmd.Stdout = logf
	cmd.Stderr = logf
	c.started = time.Now()
	p, err := c.m.startProc("caddy "+c.name, cmd)
	if err != nil {
		return err
	}
	c.p = p
	return nil
}

// caddyEnv is the matrix's environment without AWS settings or home
// directories of its own, with the node's home under dir and extra.
func caddyEnv(dir string, extra []string) []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "AWS_") || k == "HOME" || strings.HasPrefix(k, "XDG_") || k == "CADDY_ADMIN" {
			continue
		}
		env = append(env, kv)
	}
	env = append(env,
		"HOME="+filepath.Join(dir, "home"),
		"XDG_DATA_HOME="+filepath.Join(dir, "home", "data"),
		"XDG_CONFIG_HOME="+filepath.Join(dir, "home", "config"),
		"AWS_EC2_METADATA_DISABLED=true",
	)
	return append(env, extra...)
}

// waitReady waits until the current run answers HTTP on its port and has
// logged that its whole configuration serves (an app that fails after the
// HTTP server started would otherwise look ready for a moment).
func (c *caddyInst) waitReady(ctx context.Context, timeout time.Duration) error {
	hc := &http.Client{Timeout: 2 * time.Second}
	deadline := time.Now().Add(timeout)
	for {
		if !c.p.running() {
			return fmt.Errorf("caddy %s exited during start-up (%v):\n%s", c.name, c.p.err(), c.logTail(4000))
		}
		resp, err := hc.Get(c.url() + "/")
		if err == nil {
			resp.Body.Close()
			logs := c.currentLog()
			if strings.Contains(logs, "serving initial configuration") {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("caddy %s not serving within %s:\n%s", c.name, timeout, c.logTail(4000))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(25 * time.Millisecond):
		}
	}
}

// currentLog is the log of the current run only.
func (c *caddyInst) currentLog() string {
	b, _ := os.ReadFile(c.logPath())
	s := string(b)
	if i := strings.LastIndex(s, "=== benchmatrix:"); i >= 0 {
		s = s[i:]
	}
	return s
}

func (c *caddyInst) logTail(n int) string {
	s := c.currentLog()
	if len(s) > n {
		s = "..." + s[len(s)-n:]
	}
	return s
}

// restart starts the same node again after the old process is gone.
func (c *caddyInst) restart(ctx context.Context) error {
	c.p.kill()
	if err := c.start(); err != nil {
		return err
	}
	return c.waitReady(ctx, 90*time.Second)
}

func (c *caddyInst) close() {
	if c != nil && c.p != nil {
		c.p.stop(15 * time.Second)
	}
}

// rssMiB reads VmRSS of pid from /proc, in MiB.
func rssMiB(pid int) (float64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			fields := strings.Fields(rest)
			if len(fields) >= 1 {
				kb, err := strconv.ParseFloat(fields[0], 64)
				if err != nil {
					return 0, err
				}
				return kb / 1024, nil
			}
		}
	}
	return 0, errors.New("no VmRSS line")
}

// freePort returns a loopback TCP port that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// nodeServer starts the Durable Streams Node reference server (in memory)
// from bench/node, installing its pinned packages first when needed.
func (m *matrix) nodeServer(ctx context.Context) (*proc, string, error) {
	dir := filepath.Join(m.root, "bench", "node")
	if _, err := exec.LookPath("node"); err != nil {
		return nil, "", errors.New("node is not installed")
	}
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "@durable-streams", "server")); err != nil {
		m.logf("npm ci in %s", dir)
		cmd := exec.CommandContext(ctx, "npm", "ci", "--no-audit", "--no-fund")
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			return nil, "", fmt.Errorf("npm ci: %v\n%s", err, out)
		}
	}
	port, err := freePort()
	if err != nil {
		return nil, "", err
	}
	logf, err := os.Create(filepath.Join(m.work, "node.log"))
	if err != nil {
		return nil, "", err
	}
	defer logf.Close()
	cmd := exec.Command("node", "start.mjs", strconv.Itoa(port))
	cmd.Dir = dir
	cmd.Stdout = logf
	cmd.Stderr = logf
	p, err := m.startProc("node", cmd)
	if err != nil {
		return nil, "", err
	}
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	deadline := time.Now().Add(30 * time.Second)
	for {
		if !p.running() {
			b, _ := os.ReadFile(logf.Name())
			return nil, "", fmt.Errorf("node server exited: %v\n%s", p.err(), b)
		}
		conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), time.Second)
		if err == nil {
			conn.Close()
			return p, url, nil
		}
		if time.Now().After(deadline) {
			p.kill()
			return nil, "", errors.New("node server not listening within 30s")
		}
		time.Sleep(50 * time.Millisecond)
	}
}
