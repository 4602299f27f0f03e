// Package caddytest runs the picomq module inside a real Caddy child process
// for integration tests: it builds ./cmd/caddy once per test binary, writes a
// Caddyfile, starts `caddy run` on free ports with an isolated data directory,
// and can kill, stop, restart and reload it.
//
// Typical use:
//
//	c := caddytest.Start(t, caddytest.Options{
//		Storage:    "file://" + t.TempDir(),
//		Directives: []string{"long_poll_timeout 500ms"},
//	})
//	resp, err := http.Get(c.URL() + "/v1/stream/x")
//
// Set PICOMQ_CADDY_BIN to a prebuilt binary to skip the build.
package caddytest

import (
	"fmt"
	"hash/fnv"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"
)

// BinEnv names an environment variable that, when set, points at a prebuilt
// Caddy binary (with the picomq module) to use instead of building one.
const BinEnv = "PICOMQ_CADDY_BIN"

var (
	buildOnce sync.Once
	buildPath string
	buildErr  error
)

// BuildCaddy builds ./cmd/caddy of the repository that contains the test's
// working directory, once per test binary, and returns the binary's path.
//
// The binary lives in a per-user cache directory under os.TempDir(), one
// file per repository checkout, replaced atomically by every test binary that
// builds it: Go's build cache makes the rebuild cheap, a concurrent test
// binary (go test ./... runs packages in parallel) waits on a file lock
// instead of compiling Caddy a second time, and no per-process copy is left
// behind.
func BuildCaddy(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		if bin := os.Getenv(BinEnv); bin != "" {
			buildPath, buildErr = filepath.Abs(bin)
			return
		}
		buildPath, buildErr = build()
	})
	if buildErr != nil {
		t.Fatalf("caddytest: building caddy: %v", buildErr)
	}
	return buildPath
}

func build() (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	cacheDir := filepath.Join(os.TempDir(), fmt.Sprintf("picomq-caddytest-%d", os.Getuid()))
	if err := os.MkdirAll(cacheDir, 0o755); err != nil {
		return "", err
	}
	// One binary per checkout, so that two clones never share a binary.
	h := fnv.New32a()
	h.Write([]byte(root))
	name := fmt.Sprintf("caddy-%08x", h.Sum32())
	bin := filepath.Join(cacheDir, name)

	lock, err := os.OpenFile(bin+".lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return "", err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return "", fmt.Errorf("locking %s: %w", lock.Name(), err)
	}
	defer syscall.Flock(int(lock.Fd()), syscall.LOCK_UN) //nolint:errcheck // closing releases it too

	tmp := fmt.Sprintf("%s.tmp-%d", bin, os.Getpid())
	defer os.Remove(tmp)
	start := time.Now()
	cmd := exec.Command("go", "build", "-o", tmp, "./cmd/caddy")
	cmd.Dir = root
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build ./cmd/caddy in %s: %v\n%s", root, err, out)
	}
	if err := os.Rename(tmp, bin); err != nil {
		return "", err
	}
	if d := time.Since(start); d > 10*time.Second {
		fmt.Fprintf(os.Stderr, "caddytest: built %s in %s\n", bin, d.Round(time.Second))
	}
	return bin, nil
}

// RepoRoot returns the directory holding go.mod, searching upwards from the
// working directory (a test's working directory is its package directory).
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("no go.mod above the working directory")
		}
		dir = parent
	}
}
