package segment_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
	"github.com/picomq/caddy-picomq/segment"
	"github.com/picomq/caddy-picomq/segment/storetest"
)

var prefixSeq atomic.Int64

// openS3 opens a store under a fresh prefix of bucket, through endpoint.
func openS3(t *testing.T, v *testenv.Versity, endpoint, bucket string, opts segment.OpenOptions) *segment.S3Store {
	t.Helper()
	opts.AccessKeyID, opts.SecretAccessKey = v.AccessKey, v.SecretKey
	prefix := fmt.Sprintf("t%d/store", prefixSeq.Add(1))
	s, err := segment.Open(testenv.StoreURL(endpoint, bucket, prefix), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.(*segment.S3Store).Close() })
	return s.(*segment.S3Store)
}

// proxiedS3 opens a store on a fresh versitygw bucket through a test S3
// proxy, for tests that put faults between the store and the server.
func proxiedS3(t *testing.T, opts segment.OpenOptions) (*segment.S3Store, *testenv.Proxy) {
	t.Helper()
	v := testenv.NewVersity(t)
	bucket := v.NewBucket(t)
	p, err := testenv.NewProxy(v.Endpoint)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return openS3(t, v, p.URL(), bucket, opts), p
}

func TestS3StoreContract(t *testing.T) {
	v := testenv.NewVersity(t)
	bucket := v.NewBucket(t)
	storetest.Run(t, func(t *testing.T) segment.Store {
		return openS3(t, v, v.Endpoint, bucket, segment.OpenOptions{})
	})
}

// TestS3StoreContractTLS runs the contract against versitygw over HTTPS,
// as S3 in the cloud is reached. Over TLS the SDK signs requests without
// their bodies (UNSIGNED-PAYLOAD; over plain HTTP it signs the body's
// SHA-256), and the server's certificate comes from AWS_CA_BUNDLE, which
// the store's transport must honour.
func TestS3StoreContractTLS(t *testing.T) {
	v := testenv.NewVersityTLS(t)
	t.Setenv("AWS_CA_BUNDLE", v.CAFile)
	bucket := v.NewBucket(t)
	storetest.Run(t, func(t *testing.T) segment.Store {
		return openS3(t, v, v.Endpoint, bucket, segment.OpenOptions{})
	})
}

// TestS3StoreRefusesUnknownCertificateAtOnce: a server whose certificate
// does not verify is a setting to fix, reported by the first attempt with
// the reason, not after five attempts and their backoff.
func TestS3StoreRefusesUnknownCertificateAtOnce(t *testing.T) {
	v := testenv.NewVersityTLS(t)
	bucket := v.NewBucket(t)
	t.Setenv("AWS_CA_BUNDLE", "")
	os.Unsetenv("AWS_CA_BUNDLE")
	stats := &segment.RequestStats{}
	s := openS3(t, v, v.Endpoint, bucket, segment.OpenOptions{Stats: stats})
	_, err := s.Put(context.Background(), "k", []byte("v"), segment.PutOptions{})
	if err == nil || !strings.Contains(err.Error(), "x509") {
		t.Fatalf("Put to a server with an unknown authority: %v, want a certificate error", err)
	}
	var n uint64
	for _, o := range segment.Outcomes {
		n += stats.Requests(segment.OpPut, o)
	}
	if n != 1 {
		t.Fatalf("%d attempts, want 1: %v", n, err)
	}
}

// TestS3StorePrefixIsolation checks that keys live under the URL's prefix
// and that stores on neighbouring prefixes do not see each other.
func TestS3StorePrefixIsolation(t *testing.T) {
	ctx := context.Background()
	v := testenv.NewVersity(t)
	bucket := v.NewBucket(t)
	p, err := testenv.NewProxy(v.Endpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	open := func(prefix string) segment.Store {
		s, err := segment.Open(testenv.StoreURL(p.URL(), bucket, prefix), segment.OpenOptions{
			AccessKeyID: v.AccessKey, SecretAccessKey: v.SecretKey,
		})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	a, ab, root := open("pre/a"), open("pre/ab"), open("")
	if _, err := a.Put(ctx, "k/1", []byte("a"), segment.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := ab.Put(ctx, "k/1", []byte("ab"), segment.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	if n := p.Counts().PutsUnder("pre/a/k/1"); n != 1 {
		t.Fatalf("PUTs of pre/a/k/1 = %d, want 1", n)
	}
	objs, more, err := a.List(ctx, "", "", 10)
	if err != nil || more || len(objs) != 1 || objs[0].Key != "k/1" {
		t.Fatalf("List(a) = %+v, %v, %v", objs, more, err)
	}
	got, _, err := ab.Get(ctx, "k/1", 0, -1)
	if err != nil || string(got) != "ab" {
		t.Fatalf("Get(ab) = %q, %v", got, err)
	}
	objs, _, err = root.List(ctx, "pre/", "", 10)
	if err != nil || len(objs) != 2 || objs[0].Key != "pre/a/k/1" || objs[1].Key != "pre/ab/k/1" {
		t.Fatalf("List(root, pre/) = %+v, %v", objs, err)
	}
	if err := a.Delete(ctx, []string{"k/1"}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := ab.Get(ctx, "k/1", 0, -1); err != nil {
		t.Fatalf("delete in a removed ab's key: %v", err)
	}
}

// TestS3StoreRetries drives the backend through the fault proxy: transient
// errors are retried with backoff, stalls end at the attempt timeout, final
// errors are not retried, and a conditional write whose answer was lost is
// resolved correctly.
func TestS3StoreRetries(t *testing.T) {
	v := testenv.NewVersity(t)
	bucket := v.NewBucket(t)
	p, err := testenv.NewProxy(v.Endpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	opts := segment.OpenOptions{
		// Long enough that a slow answer on a loaded machine is not
		// taken for a stall, which would add attempts.
		RequestTimeout: 2 * time.Second,
		MaxAttempts:    4,
		MinBackoff:     time.Millisecond,
		MaxBackoff:     20 * time.Millisecond,
	}
	ctx := context.Background()

	cases := []struct {
		name     string
		fault    testenv.Fault
		op       func(s segment.Store) error
		wantErr  error // nil: success; errAny: any error
		attempts int   // requests of the op seen by the proxy
	}{
		{
			name:  "503 then success",
			fault: testenv.Fault{Op: testenv.OpPut, Status: 503, Times: 2},
			op: func(s segment.Store) error {
				_, err := s.Put(ctx, "k", []byte("v"), segment.PutOptions{})
				return err
			},
			attempts: 3,
		},
		{
			name:  "500 on get",
			fault: testenv.Fault{Op: testenv.OpGet, Status: 500, Times: 1},
			op: func(s segment.Store) error {
				_, _, err := s.Get(ctx, "seed", 1, 2)
				return err
			},
			attempts: 2,
		},
		{
			name:  "throttled list",
			fault: testenv.Fault{Op: testenv.OpList, Status: 429, Times: 2},
			op: func(s segment.Store) error {
				_, _, err := s.List(ctx, "", "", 10)
				return err
			},
			attempts: 3,
		},
		{
			name:  "409 conditional conflict is transient",
			fault: testenv.Fault{Op: testenv.OpPut, Status: 409, Times: 1},
			op: func(s segment.Store) error {
				_, err := s.Put(ctx, "cond", []byte("v"), segment.PutOptions{IfNoneMatch: true})
				return err
			},
			attempts: 2,
		},
		{
			// versitygw's answer when a concurrent DELETE removed the
			// folder a PUT was linking into.
			name:  "409 ExistingObjectIsDirectory is tried once more",
			fault: testenv.Fault{Op: testenv.OpPut, Status: 409, Code: "ExistingObjectIsDirectory", Times: 1},
			op: func(s segment.Store) error {
				_, err := s.Put(ctx, "wal/0001/0002", []byte("v"), segment.PutOptions{IfNoneMatch: true})
				return err
			},
			attempts: 2,
		},
		{
			name:  "409 ExistingObjectIsDirectory twice is final",
			fault: testenv.Fault{Op: testenv.OpPut, Status: 409, Code: "ExistingObjectIsDirectory"},
			op: func(s segment.Store) error {
				_, err := s.Put(ctx, "wal/0001/0003", []byte("v"), segment.PutOptions{})
				return err
			},
			wantErr:  errAny,
			attempts: 2,
		},
		{
			name:  "409 ObjectParentIsFile is final",
			fault: testenv.Fault{Op: testenv.OpPut, Status: 409, Code: "ObjectParentIsFile"},
			op: func(s segment.Store) error {
				_, err := s.Put(ctx, "seed/below", []byte("v"), segment.PutOptions{})
				return err
			},
			wantErr:  errAny,
			attempts: 1,
		},
		{
			name:  "connection reset",
			fault: testenv.Fault{Op: testenv.OpPut, Reset: true, Times: 1},
			op: func(s segment.Store) error {
				_, err := s.Put(ctx, "reset", []byte("v"), segment.PutOptions{})
				return err
			},
			attempts: 2,
		},
		{
			name:  "stall ends at the timeout and is retried",
			fault: testenv.Fault{Op: testenv.OpGet, Stall: 10 * time.Second, Times: 1},
			op: func(s segment.Store) error {
				_, _, err := s.Get(ctx, "seed", 0, -1)
				return err
			},
			attempts: 2,
		},
		{
			name:  "delete retried",
			fault: testenv.Fault{Op: testenv.OpDelete, Status: 503, Times: 1},
			op: func(s segment.Store) error {
				return s.Delete(ctx, []string{"seed", "nothing"})
			},
			attempts: 2,
		},
		{
			name:  "gives up after MaxAttempts",
			fault: testenv.Fault{Op: testenv.OpPut, Status: 503},
			op: func(s segment.Store) error {
				_, err := s.Put(ctx, "k", []byte("v"), segment.PutOptions{})
				return err
			},
			wantErr:  errAny,
			attempts: 4,
		},
		{
			name:  "403 is final",
			fault: testenv.Fault{Op: testenv.OpGet, Status: 403},
			op: func(s segment.Store) error {
				_, _, err := s.Get(ctx, "seed", 0, -1)
				return err
			},
			wantErr:  errAny,
			attempts: 1,
		},
		{
			name:  "412 is final",
			fault: testenv.Fault{Op: testenv.OpPut, Status: 412},
			op: func(s segment.Store) error {
				_, err := s.Put(ctx, "k", []byte("v"), segment.PutOptions{IfNoneMatch: true})
				return err
			},
			wantErr:  segment.ErrPreconditionFailed,
			attempts: 1,
		},
		{
			// The create lands, its answer is lost, the retry finds
			// the key taken: by our own bytes, so it succeeded.
			name:  "lost answer of a create",
			fault: testenv.Fault{Op: testenv.OpPut, Status: 500, AfterForward: true, Times: 1},
			op: func(s segment.Store) error {
				_, err := s.Put(ctx, "lost", []byte("mine"), segment.PutOptions{IfNoneMatch: true})
				return err
			},
			attempts: 2,
		},
		{
			name:  "lost answer of a compare-and-swap",
			fault: testenv.Fault{Op: testenv.OpPut, Reset: true, AfterForward: true, Times: 1},
			op: func(s segment.Store) error {
				_, etag, err := s.Get(ctx, "seed", 0, -1)
				if err != nil {
					return err
				}
				_, err = s.Put(ctx, "seed", []byte("swapped"), segment.PutOptions{IfMatch: etag})
				return err
			},
			attempts: 2,
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := openS3(t, v, p.URL(), bucket, opts)
			if _, err := s.Put(ctx, "seed", []byte("seed data"), segment.PutOptions{}); err != nil {
				t.Fatal(err)
			}
			p.Reset()
			remove := p.AddFault(c.fault)
			defer remove()
			start := time.Now()
			err := c.op(s)
			switch {
			case c.wantErr == nil && err != nil:
				t.Fatalf("error: %v", err)
			case c.wantErr == errAny && err == nil:
				t.Fatal("no error")
			case c.wantErr != nil && c.wantErr != errAny && !errors.Is(err, c.wantErr):
				t.Fatalf("error = %v, want %v", err, c.wantErr)
			}
			n := p.Counts()
			got := map[string]int{testenv.OpPut: n.Put, testenv.OpGet: n.Get, testenv.OpList: n.List, testenv.OpDelete: n.Delete}[c.fault.Op]
			if c.name == "lost answer of a create" || c.name == "lost answer of a compare-and-swap" {
				got = n.Put // plus the GET that resolved it
			}
			if got != c.attempts {
				t.Fatalf("%s requests = %d, want %d (counts %+v)", c.fault.Op, got, c.attempts, n)
			}
			if d := time.Since(start); d > 8*time.Second {
				t.Fatalf("took %v", d)
			}
		})
	}
}

var errAny = errors.New("any error")

// TestS3StorePutOfUnknownOutcome: a Put that fails after an attempt that
// may have been applied (a 5xx a store may send after writing, a
// dropped connection) matches ErrUnknownOutcome, conditional or not; one
// whose every attempt was refused before it was applied (503 SlowDown,
// 403) does not.
func TestS3StorePutOfUnknownOutcome(t *testing.T) {
	s, p := proxiedS3(t, segment.OpenOptions{
		RequestTimeout: 2 * time.Second,
		MaxAttempts:    3,
		MinBackoff:     time.Millisecond,
		MaxBackoff:     10 * time.Millisecond,
	})
	ctx := context.Background()
	for _, c := range []struct {
		name    string
		fault   testenv.Fault
		ifMatch bool
		unknown bool
	}{
		{"500 after the write, compare-and-swap", testenv.Fault{Op: testenv.OpPut, Status: 500, AfterForward: true}, true, true},
		{"500 after the write", testenv.Fault{Op: testenv.OpPut, Status: 500, AfterForward: true}, false, true},
		{"answer lost, compare-and-swap", testenv.Fault{Op: testenv.OpPut, Reset: true, AfterForward: true}, true, true},
		{"connection dropped", testenv.Fault{Op: testenv.OpPut, Reset: true}, false, true},
		{"503 SlowDown", testenv.Fault{Op: testenv.OpPut, Status: 503}, true, false},
		{"403", testenv.Fault{Op: testenv.OpPut, Status: 403}, true, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			etag, err := s.Put(ctx, "doc", []byte("before"), segment.PutOptions{})
			if err != nil {
				t.Fatal(err)
			}
			opts := segment.PutOptions{}
			if c.ifMatch {
				opts.IfMatch = etag
			}
			remove := p.AddFault(c.fault)
			_, err = s.Put(ctx, "doc", []byte("after"), opts)
			remove()
			if err == nil {
				t.Fatal("no error")
			}
			if got := errors.Is(err, segment.ErrUnknownOutcome); got != c.unknown {
				t.Fatalf("error %q: ErrUnknownOutcome %v, want %v", err, got, c.unknown)
			}
		})
	}
}

// TestS3StorePutCutShortIsUnknown: a PUT whose caller gave up (cancelled,
// or past its deadline) after the request was sent may still land, and
// here does: its error must say that the outcome is unknown, so that no
// one answers that nothing was written.
func TestS3StorePutCutShortIsUnknown(t *testing.T) {
	s, p := proxiedS3(t, segment.OpenOptions{RequestTimeout: 5 * time.Second})
	for _, c := range []struct {
		name string
		end  func() (context.Context, context.CancelFunc, func())
		want error
	}{
		{"cancelled", func() (context.Context, context.CancelFunc, func()) {
			ctx, cancel := context.WithCancel(context.Background())
			return ctx, cancel, cancel
		}, context.Canceled},
		{"past its deadline", func() (context.Context, context.CancelFunc, func()) {
			ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			return ctx, cancel, func() {}
		}, context.DeadlineExceeded},
	} {
		t.Run(c.name, func(t *testing.T) {
			key := "cut/" + strings.ReplaceAll(c.name, " ", "-")
			release := p.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: key, Times: 1})
			defer release()
			ctx, cancel, end := c.end()
			defer cancel()
			done := make(chan error, 1)
			go func() {
				_, err := s.Put(ctx, key, []byte("v"), segment.PutOptions{IfNoneMatch: true})
				done <- err
			}()
			wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer wcancel()
			if err := p.WaitHeld(wctx, 1); err != nil {
				t.Fatal(err)
			}
			end()
			err := <-done
			if !errors.Is(err, c.want) || !errors.Is(err, segment.ErrUnknownOutcome) {
				t.Fatalf("error %v: want %v, and ErrUnknownOutcome", err, c.want)
			}
			release()
			if err := p.WaitLanded(wctx); err != nil {
				t.Fatal(err)
			}
			if got, _, err := s.Get(context.Background(), key, 0, -1); err != nil || string(got) != "v" {
				t.Fatalf("the PUT cut short did not land after all (%q, %v): the test shows nothing", got, err)
			}
		})
	}
}

// TestS3StoreContextCancel checks that a caller's deadline ends a stalled
// request at once, without retries.
func TestS3StoreContextCancel(t *testing.T) {
	s, p := proxiedS3(t, segment.OpenOptions{RequestTimeout: 5 * time.Second})
	p.AddFault(testenv.Fault{Op: testenv.OpPut, Stall: time.Minute})
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := s.Put(ctx, "k", []byte("v"), segment.PutOptions{})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("error = %v, want DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("took %v", d)
	}
	if n := p.Counts().Put; n != 1 {
		t.Fatalf("PUTs = %d, want 1", n)
	}
}

func TestS3StoreServerDown(t *testing.T) {
	s, p := proxiedS3(t, segment.OpenOptions{
		MaxAttempts: 20, MinBackoff: 20 * time.Millisecond, MaxBackoff: 50 * time.Millisecond,
	})
	ctx := context.Background()
	if _, err := s.Put(ctx, "k", []byte("v1"), segment.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	p.Down()
	done := make(chan error, 1)
	go func() {
		_, err := s.Put(ctx, "k", []byte("v2"), segment.PutOptions{})
		done <- err
	}()
	time.Sleep(150 * time.Millisecond)
	if err := p.Up(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("Put across a restart: %v", err)
	}
	if got, _, err := s.Get(ctx, "k", 0, -1); err != nil || string(got) != "v2" {
		t.Fatalf("Get = %q, %v", got, err)
	}
}

func TestOpenS3Offline(t *testing.T) {
	// Open must not reach the network: an endpoint nobody listens on, no
	// credentials anywhere, and it still succeeds.
	t.Setenv("AWS_ACCESS_KEY_ID", "")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "")
	t.Setenv("AWS_REGION", "")
	t.Setenv("AWS_DEFAULT_REGION", "")
	t.Setenv("AWS_CONFIG_FILE", "/nonexistent")
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
	t.Setenv("AWS_EC2_METADATA_DISABLED", "true")
	s, err := segment.Open("s3://my-bucket/some/prefix?endpoint=http://127.0.0.1:1", segment.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if s.(fmt.Stringer).String() != "s3://my-bucket/some/prefix" {
		t.Fatalf("String() = %q", s.(fmt.Stringer).String())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, _, err := s.Get(ctx, "k", 0, -1); err == nil {
		t.Fatal("Get against nothing succeeded")
	}
}

func TestParseS3Location(t *testing.T) {
	good := []struct {
		url  string
		want segment.Location
	}{
		{"s3://bkt", segment.Location{Scheme: "s3", Bucket: "bkt"}},
		{"s3://bkt/", segment.Location{Scheme: "s3", Bucket: "bkt"}},
		{"s3://bkt/a/b/", segment.Location{Scheme: "s3", Bucket: "bkt", Prefix: "a/b"}},
		{"s3://bkt/p?region=eu-west-1", segment.Location{Scheme: "s3", Bucket: "bkt", Prefix: "p", Region: "eu-west-1"}},
		{"s3://my.bkt/p?endpoint=http://127.0.0.1:7070/&path_style=true&region=us-east-1",
			segment.Location{Scheme: "s3", Bucket: "my.bkt", Prefix: "p", Region: "us-east-1", Endpoint: "http://127.0.0.1:7070", PathStyle: true}},
	}
	for _, g := range good {
		got, err := segment.ParseLocation(g.url)
		if err != nil || got != g.want {
			t.Errorf("ParseLocation(%q) = %+v, %v; want %+v", g.url, got, err, g.want)
		}
	}
	bad := []string{
		"s3://", "s3:///prefix", "s3://b", "s3://UPPER/p", "s3://bkt/a//b",
		"s3://bkt?endpoint=ftp://x", "s3://bkt?endpoint=nohost", "s3://bkt?path_style=maybe",
		"s3://bkt?regoin=x", "s3://bkt?region=a&region=b", "s3://key:secret@bkt/p",
		// Wherever the URL syntax lets credentials in, errors leave them out.
		"s3://key:secret^@bkt/p", "s3://bkt?endpoint=ftp://key:secret@x", "file://key:secret@host/dir",
		"s4://key:secret@bkt/p", "s3://bkt?endpoint=http://key:secret@x", "s3://bkt?endpoint=https://key@x",
		// A fragment would be dropped; one may be the rest of a secret
		// with a '#' in it.
		"s3://bkt/p#x", "s3://bkt/p#", "file:///dir#x", "s3://bkt?endpoint=http://key:my#secret@x",
	}
	for _, b := range bad {
		if _, err := segment.ParseLocation(b); err == nil {
			t.Errorf("ParseLocation(%q) succeeded", b)
		} else if strings.Contains(err.Error(), "secret") {
			t.Errorf("ParseLocation(%q) error shows the secret: %v", b, err)
		}
	}
}

// An endpoint that is not an http(s) URL with a host is refused with an
// example of one: a MinIO address written as host:port, without its
// scheme, used to be refused as `endpoint "(unparsable)" must be an
// http(s) URL`, which showed neither what was wrong nor what to write.
func TestParseS3LocationEndpointErrors(t *testing.T) {
	for _, tc := range []struct{ endpoint, want string }{
		{"127.0.0.1:9000", "endpoint does not parse as a URL; it must be an http(s) URL with a host, such as http://127.0.0.1:9000"},
		{"localhost:9000", `endpoint "localhost:9000": it must be an http(s) URL with a host, such as http://127.0.0.1:9000`},
		{"minio.internal", `endpoint "minio.internal": it must be an http(s) URL with a host`},
		{"ftp://x", `endpoint "ftp://x": it must be an http(s) URL with a host`},
		{"http://", `endpoint "http:": it must be an http(s) URL with a host`},
	} {
		_, err := segment.ParseLocation("s3://bkt/p?endpoint=" + tc.endpoint)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("endpoint=%s: %v, want an error saying %q", tc.endpoint, err, tc.want)
		}
	}
}

// TestS3StoreFolderCollision checks that versitygw's answer to a key that
// collides with a folder (409 ExistingObjectIsDirectory or
// ObjectParentIsFile) is reported at once, not retried like a transient
// 409 ConditionalRequestConflict.
func TestS3StoreFolderCollision(t *testing.T) {
	ctx := context.Background()
	s, p := proxiedS3(t, segment.OpenOptions{MaxAttempts: 5, MinBackoff: time.Millisecond})
	if _, err := s.Put(ctx, "d/x", []byte("x"), segment.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	p.Reset()
	for _, c := range []struct {
		key  string
		opts segment.PutOptions
	}{
		{"d", segment.PutOptions{}},
		{"d", segment.PutOptions{IfNoneMatch: true}},
		{"d/x/y", segment.PutOptions{}},
	} {
		_, err := s.Put(ctx, c.key, []byte("y"), c.opts)
		if err == nil || errors.Is(err, segment.ErrPreconditionFailed) {
			t.Errorf("Put(%q, %+v) error = %v, want a collision error", c.key, c.opts, err)
		}
	}
	// A key that is a folder is tried once more (versitygw gives the same
	// answer when a concurrent DELETE removed the folder a PUT was linking
	// into); one whose parent is a file is not retried.
	if n := p.Counts().Put; n != 5 {
		t.Fatalf("PUTs = %d, want 5 (2 for each PUT of d, 1 for d/x/y)", n)
	}
}

// TestS3StoreAgainstFakeServer covers answers versitygw never gives:
// per-key DeleteObjects errors, and a server that ignores Range.
func TestS3StoreAgainstFakeServer(t *testing.T) {
	var deleteBodies []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodPost && r.URL.Query().Has("delete"):
			b, _ := io.ReadAll(r.Body)
			deleteBodies = append(deleteBodies, string(b))
			w.Header().Set("Content-Type", "application/xml")
			io.WriteString(w, `<?xml version="1.0" encoding="UTF-8"?>
<DeleteResult>
<Error><Key>pfx/locked</Key><Code>AccessDenied</Code><Message>Access Denied</Message></Error>
<Error><Key>pfx/gone</Key><Code>NoSuchKey</Code><Message>no such key</Message></Error>
</DeleteResult>`)
		case r.Method == http.MethodGet && r.URL.Path == "/bkt/pfx/whole":
			// Ignores the Range header: 200 with the whole object.
			w.Header().Set("ETag", `"abc"`)
			io.WriteString(w, "0123456789")
		default:
			http.Error(w, "unexpected", http.StatusBadRequest)
		}
	}))
	defer srv.Close()
	s, err := segment.Open("s3://bkt/pfx?path_style=true&endpoint="+srv.URL, segment.OpenOptions{
		AccessKeyID: "k", SecretAccessKey: "s", MaxAttempts: 1,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	keys := make([]string, 1001)
	for i := range keys {
		keys[i] = fmt.Sprintf("k%04d", i)
	}
	keys[3], keys[4] = "locked", "gone"
	err = s.Delete(ctx, keys)
	if err == nil || !strings.Contains(err.Error(), "locked") || !strings.Contains(err.Error(), "AccessDenied") {
		t.Fatalf("Delete error = %v, want the AccessDenied of key locked", err)
	}
	if strings.Contains(err.Error(), "gone") || strings.Contains(err.Error(), "pfx/") {
		t.Fatalf("Delete error = %v: NoSuchKey is no error, and keys are relative", err)
	}
	if len(deleteBodies) != 2 || strings.Count(deleteBodies[0], "<Key>") != 1000 || strings.Count(deleteBodies[1], "<Key>") != 1 {
		t.Fatalf("DeleteObjects requests: %d, want batches of 1000 and 1", len(deleteBodies))
	}
	got, etag, err := s.Get(ctx, "whole", 3, 4)
	if err != nil || string(got) != "3456" || etag != `"abc"` {
		t.Fatalf("Get(whole, 3, 4) = %q %s %v", got, etag, err)
	}
}
