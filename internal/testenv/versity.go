// Package testenv holds helpers for tests that need real S3-compatible
// storage: a versitygw server started on demand (Versity) and an S3 proxy
// that counts requests and injects faults and latency (Proxy).
//
// Every process started here is tied to the test that asked for it through
// t.Cleanup, and is also killed by the kernel if the test binary dies first.
package testenv

import (
	"bytes"
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
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
)

// VersityVersion is the versitygw release the tests run against.
const VersityVersion = "v1.8.0"

const versityPackage = "github.com/versity/versitygw/cmd/versitygw"

// Credentials of the root account of every versitygw started here.
const (
	VersityAccessKey = "picomqtestaccess"
	VersitySecretKey = "picomqtestsecretkey"
	VersityRegion    = "us-east-1"
)

// Versity is a running versitygw server with the posix backend: each bucket
// is a folder under Dir.
type Versity struct {
	Endpoint string // http://127.0.0.1:PORT, or https:// with TLS
	// CAFile, with TLS, is the PEM file of the authority that signed the
	// server's certificate (for AWS_CA_BUNDLE); empty without TLS.
	CAFile    string
	AccessKey string
	SecretKey string
	Region    string
	Dir       string
	Port      int

	cmd      *exec.Cmd
	exited   chan struct{}
	waitErr  error
	output   *limitedBuffer
	tls      *testTLS // nil: plain HTTP
	ownDir   bool
	stopOnce sync.Once
	stopErr  error
}

// NewVersity starts a versitygw on a fresh temporary directory and stops it
// when the test ends. It fails the test if the server cannot be started.
func NewVersity(t testing.TB) *Versity {
	t.Helper()
	return newVersity(t, false)
}

// NewVersityTLS is NewVersity serving HTTPS, with a certificate for
// 127.0.0.1 from an authority made for this server alone (its PEM in
// CAFile), as S3 in the cloud is always reached.
func NewVersityTLS(t testing.TB) *Versity {
	t.Helper()
	return newVersity(t, true)
}

func newVersity(t testing.TB, withTLS bool) *Versity {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	start := StartVersity
	if withTLS {
		start = StartVersityTLS
	}
	v, err := start(ctx, t.TempDir())
	if err != nil {
		t.Fatalf("testenv: start versitygw: %v", err)
	}
	t.Cleanup(func() {
		if err := v.Stop(); err != nil {
			t.Errorf("testenv: stop versitygw: %v", err)
		}
	})
	return v
}

// StartVersity starts `versitygw posix dir` on a free loopback port and
// returns once it answers HTTP. An empty dir means a new temporary directory,
// removed again by Stop. The binary is looked up on PATH, then in the Go bin
// directory, and installed with `go install` when missing (about two minutes
// the first time). Call Stop when done.
func StartVersity(ctx context.Context, dir string) (*Versity, error) {
	return startVersity(ctx, dir, false)
}

// StartVersityTLS is StartVersity serving HTTPS (see NewVersityTLS). The
// certificate files are written beside dir's buckets, in a folder of their
// own that Stop removes.
func StartVersityTLS(ctx context.Context, dir string) (*Versity, error) {
	return startVersity(ctx, dir, true)
}

func startVersity(ctx context.Context, dir string, withTLS bool) (*Versity, error) {
	bin, err := VersityBinary(ctx)
	if err != nil {
		return nil, err
	}
	ownDir := false
	if dir == "" {
		dir, err = os.MkdirTemp("", "picomq-versitygw-")
		if err != nil {
			return nil, err
		}
		ownDir = true
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var tt *testTLS
	if withTLS {
		if tt, err = newTestTLS(); err != nil {
			if ownDir {
				os.RemoveAll(dir)
			}
			return nil, err
		}
	}
	var lastErr error
	// A port found free can be taken by someone else before versitygw binds
	// it; try a few ports before giving up.
	for attempt := 0; attempt < 5; attempt++ {
		v, err := startVersityOnce(ctx, bin, dir, tt)
		if err == nil {
			v.ownDir = ownDir
			return v, nil
		}
		lastErr = err
		if ctx.Err() != nil || !errors.Is(err, errPortInUse) {
			break
		}
	}
	if ownDir {
		os.RemoveAll(dir)
	}
	if tt != nil {
		tt.remove()
	}
	return nil, lastErr
}

var errPortInUse = errors.New("port in use")

func startVersityOnce(ctx context.Context, bin, dir string, tt *testTLS) (*Versity, error) {
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	scheme := "http://"
	if tt != nil {
		scheme = "https://"
	}
	v := &Versity{
		Endpoint:  scheme + addr,
		AccessKey: VersityAccessKey,
		SecretKey: VersitySecretKey,
		Region:    VersityRegion,
		Dir:       dir,
		Port:      port,
		exited:    make(chan struct{}),
		output:    &limitedBuffer{max: 64 << 10},
		tls:       tt,
	}
	args := []string{"--port", addr, "--keep-alive", "--quiet"}
	if tt != nil {
		v.CAFile = tt.caFile
		args = append(args, "--cert", tt.certFile, "--key", tt.keyFile)
	}
	// Not CommandContext: the context bounds the start-up, not the life of
	// the server.
	cmd := exec.Command(bin, append(args, "posix", dir)...)
	// A clean environment: settings such as VGW_PORT or LOGFILE in the
	// caller's environment would otherwise change the server.
	cmd.Env = []string{
		"PATH=" + os.Getenv("PATH"),
		"HOME=" + os.Getenv("HOME"),
		"TMPDIR=" + os.TempDir(),
		"ROOT_ACCESS_KEY=" + v.AccessKey,
		"ROOT_SECRET_KEY=" + v.SecretKey,
	}
	cmd.Stdout = v.output
	cmd.Stderr = v.output
	cmd.SysProcAttr = serverProcAttr()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	v.cmd = cmd
	go func() {
		v.waitErr = cmd.Wait()
		close(v.exited)
	}()
	if err := v.waitReady(ctx); err != nil {
		v.Stop()
		out := v.output.String()
		if strings.Contains(out, "address already in use") {
			return nil, fmt.Errorf("%w: %s", errPortInUse, addr)
		}
		return nil, fmt.Errorf("versitygw on %s: %w; output:\n%s", addr, err, out)
	}
	return v, nil
}

// waitReady polls the port until versitygw answers an HTTP request.
func (v *Versity) waitReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	client := &http.Client{Timeout: 2 * time.Second, Transport: v.transport()}
	defer client.CloseIdleConnections()
	delay := 5 * time.Millisecond
	for {
		select {
		case <-v.exited:
			return fmt.Errorf("exited early: %v", v.waitErr)
		default:
		}
		conn, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(v.Port)), time.Second)
		if err == nil {
			conn.Close()
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, v.Endpoint+"/", nil)
			resp, err := client.Do(req)
			if err == nil {
				resp.Body.Close()
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("not answering: %w", ctx.Err())
		case <-v.exited:
			return fmt.Errorf("exited early: %v", v.waitErr)
		case <-time.After(delay):
		}
		if delay < 100*time.Millisecond {
			delay *= 2
		}
	}
}

// Stop kills the server and waits for it to exit. It is safe to call more
// than once.
func (v *Versity) Stop() error {
	v.stopOnce.Do(func() {
		if v.cmd != nil && v.cmd.Process != nil {
			select {
			case <-v.exited:
			default:
				// The whole process group, in case it ever forks.
				syscall.Kill(-v.cmd.Process.Pid, syscall.SIGKILL)
				v.cmd.Process.Kill()
			}
			select {
			case <-v.exited:
			case <-time.After(30 * time.Second):
				v.stopErr = fmt.Errorf("versitygw pid %d did not exit", v.cmd.Process.Pid)
			}
		}
		if v.ownDir {
			if err := os.RemoveAll(v.Dir); err != nil && v.stopErr == nil {
				v.stopErr = err
			}
		}
		if v.tls != nil {
			if err := v.tls.remove(); err != nil && v.stopErr == nil {
				v.stopErr = err
			}
		}
	})
	return v.stopErr
}

// PID is the server's process id (benchmarks report its CPU time).
func (v *Versity) PID() int { return v.cmd.Process.Pid }

// Output returns what the server printed so far (the last 64 KiB).
func (v *Versity) Output() string { return v.output.String() }

// Client returns an S3 client for the server with the root credentials,
// path-style addressing and the SDK's optional request checksums turned
// off (see segment/s3.go for why).
func (v *Versity) Client() *s3.Client { return v.ClientVia(v.Endpoint) }

// ClientVia is Client with requests sent to endpoint instead, such as a
// Proxy in front of the server (it keeps the Host header, so signatures
// hold).
func (v *Versity) ClientVia(endpoint string) *s3.Client {
	opts := s3.Options{
		Region:                     v.Region,
		BaseEndpoint:               aws.String(endpoint),
		UsePathStyle:               true,
		Credentials:                credentials.NewStaticCredentialsProvider(v.AccessKey, v.SecretKey, ""),
		RequestChecksumCalculation: aws.RequestChecksumCalculationWhenRequired,
		ResponseChecksumValidation: aws.ResponseChecksumValidationWhenRequired,
	}
	if v.tls != nil {
		opts.HTTPClient = &http.Client{Transport: v.transport()}
	}
	return s3.New(opts)
}

// CreateBucket creates a bucket (3 to 63 lowercase letters, digits, '-').
func (v *Versity) CreateBucket(ctx context.Context, name string) error {
	_, err := v.Client().CreateBucket(ctx, &s3.CreateBucketInput{Bucket: aws.String(name)})
	if err != nil {
		return fmt.Errorf("create bucket %q: %w", name, err)
	}
	return nil
}

var bucketSeq atomic.Int64

// NewBucket creates a bucket with a unique name and returns the name.
func (v *Versity) NewBucket(t testing.TB) string {
	t.Helper()
	name := fmt.Sprintf("test-%d-%d", os.Getpid(), bucketSeq.Add(1))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := v.CreateBucket(ctx, name); err != nil {
		t.Fatalf("testenv: %v", err)
	}
	return name
}

// StoreURL returns the segment.Open URL of bucket/prefix on endpoint (the
// server itself or a Proxy in front of it). Credentials are not part of the
// URL: pass v.AccessKey and v.SecretKey in the open options.
func StoreURL(endpoint, bucket, prefix string) string {
	u := "s3://" + bucket
	if prefix != "" {
		u += "/" + strings.Trim(prefix, "/")
	}
	return u + "?region=" + VersityRegion + "&path_style=true&endpoint=" + endpoint
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// ClosedURL is the http:// URL of a port on 127.0.0.1 that nothing listens
// on: it was bound a moment ago and closed, so a connection to it is
// refused at once, where an unroutable address would hang until a timeout.
func ClosedURL(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen on a local port: %v", err)
	}
	addr := l.Addr().String()
	if err := l.Close(); err != nil {
		t.Fatalf("close the local port: %v", err)
	}
	return "http://" + addr
}

var (
	binaryMu   sync.Mutex
	binaryPath string
)

// VersityBinary returns the path of a versitygw executable: from PATH, else
// from the Go bin directory ($GOBIN or $(go env GOPATH)/bin), else it
// installs VersityVersion with `go install` first.
func VersityBinary(ctx context.Context) (string, error) {
	binaryMu.Lock()
	defer binaryMu.Unlock()
	if binaryPath != "" {
		return binaryPath, nil
	}
	if p, err := exec.LookPath("versitygw"); err == nil {
		binaryPath = p
		return p, nil
	}
	gobin, err := goBinDir(ctx)
	if err != nil {
		return "", err
	}
	candidate := filepath.Join(gobin, "versitygw")
	if isExecutable(candidate) {
		binaryPath = candidate
		return candidate, nil
	}
	// Several test binaries may get here at once: one installs, the others
	// wait on the lock and then find the binary.
	unlock, err := lockFile(filepath.Join(os.TempDir(), "picomq-versitygw-install.lock"))
	if err != nil {
		return "", err
	}
	defer unlock()
	if !isExecutable(candidate) {
		cmd := exec.CommandContext(ctx, "go", "install", versityPackage+"@"+VersityVersion)
		cmd.Env = append(os.Environ(), "GOBIN="+gobin, "GOFLAGS=")
		var out bytes.Buffer
		cmd.Stdout = &out
		cmd.Stderr = &out
		if err := cmd.Run(); err != nil {
			return "", fmt.Errorf("go install %s@%s: %w\n%s", versityPackage, VersityVersion, err, out.String())
		}
		if !isExecutable(candidate) {
			return "", fmt.Errorf("go install %s@%s did not produce %s", versityPackage, VersityVersion, candidate)
		}
	}
	binaryPath = candidate
	return candidate, nil
}

func goBinDir(ctx context.Context) (string, error) {
	out, err := exec.CommandContext(ctx, "go", "env", "GOBIN", "GOPATH").Output()
	if err != nil {
		return "", fmt.Errorf("go env: %w", err)
	}
	lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
	if len(lines) >= 1 && strings.TrimSpace(lines[0]) != "" {
		return strings.TrimSpace(lines[0]), nil
	}
	if len(lines) >= 2 {
		gopath := strings.TrimSpace(lines[1])
		if i := strings.IndexByte(gopath, os.PathListSeparator); i >= 0 {
			gopath = gopath[:i]
		}
		if gopath != "" {
			return filepath.Join(gopath, "bin"), nil
		}
	}
	return "", errors.New("go env: neither GOBIN nor GOPATH is set")
}

func isExecutable(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0
}

func lockFile(path string) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o666)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return nil, err
	}
	return func() {
		syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		f.Close()
	}, nil
}

// limitedBuffer keeps the last max bytes written to it.
type limitedBuffer struct {
	mu  sync.Mutex
	buf []byte
	max int
}

func (b *limitedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if over := len(b.buf) - b.max; over > 0 {
		b.buf = append(b.buf[:0], b.buf[over:]...)
	}
	return len(p), nil
}

func (b *limitedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.buf)
}
