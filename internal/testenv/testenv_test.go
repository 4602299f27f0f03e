package testenv

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3types "github.com/aws/aws-sdk-go-v2/service/s3/types"
	"github.com/aws/smithy-go"
	"github.com/picomq/caddy-picomq/segment"
)

// rawClient talks to endpoint with the SDK directly and without retries,
// so every injected fault is seen as it is.
func rawClient(v *Versity, endpoint string) *s3.Client {
	return s3.New(s3.Options{
		Region:                     v.Region,
		BaseEndpoint:               aws.String(endpoint),
		UsePathStyle:               true,
		Credentials:                credentials.NewStaticCredentialsProvider(v.AccessKey, v.SecretKey, ""),
		RequestChecksumCalculation: aws.RequestChecksumCalculationWhenRequired,
		ResponseChecksumValidation: aws.ResponseChecksumValidationWhenRequired,
		RetryMaxAttempts:           1,
		HTTPClient:                 &http.Client{Timeout: 5 * time.Second},
	})
}

func newProxy(t *testing.T, v *Versity) *Proxy {
	t.Helper()
	p, err := NewProxy(v.Endpoint)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func put(ctx context.Context, c *s3.Client, bucket, key, body string) error {
	_, err := c.PutObject(ctx, &s3.PutObjectInput{
		Bucket: aws.String(bucket), Key: aws.String(key), Body: strings.NewReader(body),
	})
	return err
}

func get(ctx context.Context, c *s3.Client, bucket, key string) (string, error) {
	out, err := c.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(bucket), Key: aws.String(key)})
	if err != nil {
		return "", err
	}
	defer out.Body.Close()
	b, err := io.ReadAll(out.Body)
	return string(b), err
}

func httpStatus(err error) int {
	var re interface{ HTTPStatusCode() int }
	if errors.As(err, &re) {
		return re.HTTPStatusCode()
	}
	return 0
}

func TestVersityStartStop(t *testing.T) {
	ctx := context.Background()
	v, err := StartVersity(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	dir := v.Dir
	if err := v.CreateBucket(ctx, "startstop"); err != nil {
		t.Fatal(err)
	}
	c := rawClient(v, v.Endpoint)
	if err := put(ctx, c, "startstop", "a/b", "hello"); err != nil {
		t.Fatal(err)
	}
	if got, err := get(ctx, c, "startstop", "a/b"); err != nil || got != "hello" {
		t.Fatalf("get = %q, %v", got, err)
	}
	if err := v.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := v.Stop(); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
	if _, err := get(ctx, c, "startstop", "a/b"); err == nil {
		t.Fatal("server still answers after Stop")
	}
	if _, err := os.Stat(dir); err == nil {
		t.Fatalf("temporary dir %s not removed", dir)
	}
}

func TestProxyCounts(t *testing.T) {
	ctx := context.Background()
	v := NewVersity(t)
	bucket := v.NewBucket(t)
	p := newProxy(t, v)
	c := rawClient(v, p.URL())

	for _, k := range []string{"wal/1", "wal/2", "meta/x"} {
		if err := put(ctx, c, bucket, k, "12345"); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := get(ctx, c, bucket, "wal/1"); err != nil || got != "12345" {
		t.Fatalf("get through proxy = %q, %v", got, err)
	}
	if _, err := c.ListObjectsV2(ctx, &s3.ListObjectsV2Input{Bucket: aws.String(bucket), Prefix: aws.String("wal/")}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String(bucket), Key: aws.String("meta/x")}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.DeleteObjects(ctx, &s3.DeleteObjectsInput{Bucket: aws.String(bucket), Delete: &s3types.Delete{
		Objects: []s3types.ObjectIdentifier{{Key: aws.String("wal/1")}, {Key: aws.String("wal/2")}},
	}}); err != nil {
		t.Fatal(err)
	}
	n := p.Counts()
	if n.Put != 3 || n.Get != 1 || n.List != 1 || n.Head != 1 || n.Delete != 1 || n.Other != 0 {
		t.Fatalf("counts = %+v", n)
	}
	if n.BytesPut != 15 {
		t.Fatalf("BytesPut = %d, want 15", n.BytesPut)
	}
	if got := n.PutsUnder(bucket + "/"); got != 0 {
		// Keys are counted without the bucket.
		t.Fatalf("PutsUnder(bucket/) = %d", got)
	}
	if got := n.PutsUnder("wal/"); got != 2 {
		t.Fatalf("PutsUnder(wal/) = %d, want 2", got)
	}
	if got := n.Under(OpDelete, "wal/"); got != 2 {
		t.Fatalf("Under(DELETE, wal/) = %d, want 2", got)
	}
	if got := n.Under(OpList, "wal/"); got != 1 {
		t.Fatalf("Under(LIST, wal/) = %d, want 1", got)
	}
	if got := n.Keys(OpPut)["meta/x"]; got != 1 {
		t.Fatalf("Keys(PUT)[meta/x] = %d", got)
	}
	p.Reset()
	if n := p.Counts(); n.Total() != 0 || n.PutsUnder("") != 0 {
		t.Fatalf("after Reset: %+v", n)
	}
}

func TestProxyFaults(t *testing.T) {
	ctx := context.Background()
	v := NewVersity(t)
	bucket := v.NewBucket(t)
	p := newProxy(t, v)
	c := rawClient(v, p.URL())

	t.Run("status", func(t *testing.T) {
		remove := p.AddFault(Fault{Op: OpPut, KeyContains: "bad", Status: 503, Times: 2})
		defer remove()
		for i := 0; i < 2; i++ {
			if err := put(ctx, c, bucket, "x/bad", "v"); httpStatus(err) != 503 {
				t.Fatalf("put %d: err = %v, want 503", i, err)
			}
		}
		if err := put(ctx, c, bucket, "x/bad", "v"); err != nil {
			t.Fatalf("after Times ran out: %v", err)
		}
		if err := put(ctx, c, bucket, "x/good", "v"); err != nil {
			t.Fatalf("non-matching key: %v", err)
		}
	})
	t.Run("until removed", func(t *testing.T) {
		remove := p.AddFault(Fault{Op: OpGet, Status: 500})
		for i := 0; i < 3; i++ {
			if _, err := get(ctx, c, bucket, "x/good"); httpStatus(err) != 500 {
				t.Fatalf("get %d: err = %v, want 500", i, err)
			}
		}
		remove()
		if _, err := get(ctx, c, bucket, "x/good"); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("reset", func(t *testing.T) {
		// A PUT: Go's transport silently retries a GET whose reused
		// connection dropped before any answer.
		remove := p.AddFault(Fault{Op: OpPut, Reset: true, Times: 1})
		defer remove()
		err := put(ctx, c, bucket, "x/reset", "v")
		if err == nil || httpStatus(err) != 0 {
			t.Fatalf("err = %v, want a connection error", err)
		}
	})
	t.Run("stall", func(t *testing.T) {
		remove := p.AddFault(Fault{Op: OpGet, Stall: 5 * time.Second, Times: 1})
		defer remove()
		sctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		if _, err := get(sctx, c, bucket, "x/good"); err == nil {
			t.Fatal("stalled request succeeded")
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Fatalf("client waited %v", d)
		}
		if _, err := get(ctx, c, bucket, "x/good"); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("stall then forward", func(t *testing.T) {
		remove := p.AddFault(Fault{Op: OpGet, Stall: 150 * time.Millisecond, Times: 1})
		defer remove()
		start := time.Now()
		if _, err := get(ctx, c, bucket, "x/good"); err != nil {
			t.Fatal(err)
		}
		if d := time.Since(start); d < 150*time.Millisecond {
			t.Fatalf("request took %v, want >= 150ms", d)
		}
	})
	t.Run("after forward", func(t *testing.T) {
		remove := p.AddFault(Fault{Op: OpPut, KeyContains: "landed", Status: 500, AfterForward: true, Times: 1})
		defer remove()
		if err := put(ctx, c, bucket, "x/landed", "yes"); httpStatus(err) != 500 {
			t.Fatalf("err = %v, want 500", err)
		}
		if got, err := get(ctx, c, bucket, "x/landed"); err != nil || got != "yes" {
			t.Fatalf("the write did not land: %q, %v", got, err)
		}
	})
	t.Run("delete by key", func(t *testing.T) {
		remove := p.AddFault(Fault{Op: OpDelete, KeyContains: "good", Status: 503, Times: 1})
		defer remove()
		_, err := c.DeleteObjects(ctx, &s3.DeleteObjectsInput{Bucket: aws.String(bucket), Delete: &s3types.Delete{
			Objects: []s3types.ObjectIdentifier{{Key: aws.String("x/other")}, {Key: aws.String("x/good")}},
		}})
		if httpStatus(err) != 503 {
			t.Fatalf("err = %v, want 503", err)
		}
	})
	t.Run("latency", func(t *testing.T) {
		p.SetLatency(100*time.Millisecond, 50*time.Millisecond)
		defer p.SetLatency(0, 0)
		start := time.Now()
		if _, err := get(ctx, c, bucket, "x/good"); err != nil {
			t.Fatal(err)
		}
		if d := time.Since(start); d < 100*time.Millisecond {
			t.Fatalf("request took %v, want >= 100ms", d)
		}
	})
	if n := p.Counts(); n.Faults < 8 {
		t.Fatalf("Faults = %d, want >= 8", n.Faults)
	}
}

// A fault with a Rate fails about that fraction of its matches, at random,
// and Times counts only the requests it failed.
func TestProxyFaultRate(t *testing.T) {
	ctx := context.Background()
	v := NewVersity(t)
	bucket := v.NewBucket(t)
	p := newProxy(t, v)
	c := rawClient(v, p.URL())

	remove := p.AddFault(Fault{Op: OpPut, Status: 503, Rate: 0.25})
	const n = 200
	failed := 0
	for i := 0; i < n; i++ {
		err := put(ctx, c, bucket, "rate/k", "v")
		switch {
		case err == nil:
		case httpStatus(err) == 503:
			failed++
		default:
			t.Fatalf("put %d: %v", i, err)
		}
	}
	remove()
	// 50 expected; the bounds are more than four standard deviations out.
	if failed < 20 || failed > 85 {
		t.Errorf("%d of %d PUTs failed at rate 0.25, want about 50", failed, n)
	}
	if got := p.Counts().Faults; got != failed {
		t.Errorf("Counts().Faults = %d, want the %d failed requests", got, failed)
	}

	remove = p.AddFault(Fault{Op: OpPut, Status: 500, Rate: 0.5, Times: 3})
	defer remove()
	failed = 0
	for i := 0; i < 100; i++ {
		if err := put(ctx, c, bucket, "rate/t", "v"); httpStatus(err) == 500 {
			failed++
		} else if err != nil {
			t.Fatalf("put %d: %v", i, err)
		}
	}
	if failed != 3 {
		t.Errorf("Times 3 at rate 0.5: %d failures in 100 PUTs, want 3", failed)
	}
}

func TestProxyHold(t *testing.T) {
	ctx := context.Background()
	v := NewVersity(t)
	bucket := v.NewBucket(t)
	p := newProxy(t, v)
	c := rawClient(v, p.URL())

	release := p.Hold(Fault{Op: OpPut, KeyContains: "wal/"})
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for _, k := range []string{"wal/1", "wal/2"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- put(ctx, c, bucket, k, "held")
		}()
	}
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := p.WaitHeld(wctx, 2); err != nil {
		t.Fatalf("WaitHeld: %v (held %d)", err, p.Held())
	}
	// Other requests pass while those are parked.
	if err := put(ctx, c, bucket, "meta/1", "free"); err != nil {
		t.Fatal(err)
	}
	if _, err := get(ctx, c, bucket, "wal/1"); httpStatus(err) != 404 {
		t.Fatalf("held write visible early: err = %v", err)
	}
	release()
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if p.Held() != 0 {
		t.Fatalf("Held = %d after release", p.Held())
	}
	if got, err := get(ctx, c, bucket, "wal/2"); err != nil || got != "held" {
		t.Fatalf("get = %q, %v", got, err)
	}

	// A client that gives up while its request is parked does not stop the
	// request from landing on release.
	p.AddFault(Fault{Op: OpPut, KeyContains: "late", Stall: 300 * time.Millisecond, Times: 1}) // a slow way to the bucket
	release = p.Hold(Fault{Op: OpPut, KeyContains: "late", Times: 1})
	cctx, ccancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- put(cctx, c, bucket, "late/1", "late") }()
	if err := p.WaitHeld(wctx, 1); err != nil {
		t.Fatal(err)
	}
	ccancel()
	if err := <-done; err == nil {
		t.Fatal("cancelled put succeeded")
	}
	release()
	// WaitLanded returns once the released upload has its answer.
	if err := p.WaitLanded(wctx); err != nil {
		t.Fatalf("WaitLanded: %v", err)
	}
	if got, err := get(ctx, c, bucket, "late/1"); err != nil || got != "late" {
		t.Fatalf("right after WaitLanded: %q, %v; want the released upload there", got, err)
	}
}

func TestProxyDownUp(t *testing.T) {
	ctx := context.Background()
	v := NewVersity(t)
	bucket := v.NewBucket(t)
	p := newProxy(t, v)
	c := rawClient(v, p.URL())
	if err := put(ctx, c, bucket, "k/1", "v"); err != nil {
		t.Fatal(err)
	}
	p.Down()
	// The first request may still find its pooled connection and see it
	// broken; after that, connections are refused.
	for i := 0; i < 2; i++ {
		err := put(ctx, c, bucket, "k/2", "v")
		if err == nil || httpStatus(err) != 0 {
			t.Fatalf("put %d while down: err = %v, want a connection error", i, err)
		}
		if i == 1 && !strings.Contains(err.Error(), "connection refused") {
			t.Fatalf("err = %v, want connection refused", err)
		}
	}
	if err := p.Up(); err != nil {
		t.Fatal(err)
	}
	if err := put(ctx, c, bucket, "k/2", "v"); err != nil {
		t.Fatalf("after Up: %v", err)
	}
	var ae smithy.APIError
	_, err := get(ctx, c, bucket, "k/3")
	if !errors.As(err, &ae) || ae.ErrorCode() != "NoSuchKey" {
		t.Fatalf("get missing: %v", err)
	}
}

func TestStoreURL(t *testing.T) {
	got := StoreURL("http://127.0.0.1:1", "bkt", "/a/b/")
	want := "s3://bkt/a/b?region=us-east-1&path_style=true&endpoint=http://127.0.0.1:1"
	if got != want {
		t.Fatalf("StoreURL = %q, want %q", got, want)
	}
	if !bytes.HasPrefix([]byte(StoreURL("http://x", "b", "")), []byte("s3://b?")) {
		t.Fatal("empty prefix")
	}
}

// TestProxyThroughS3Store drives the proxy with the module's own S3 store,
// as the integration tests do: counts by operation and key prefix, a fault
// the store retries through, a held upload, and a server restart.
func TestProxyThroughS3Store(t *testing.T) {
	ctx := context.Background()
	v := NewVersity(t)
	bucket := v.NewBucket(t)
	p := newProxy(t, v)
	open := func(opts segment.OpenOptions) segment.Store {
		opts.AccessKeyID, opts.SecretAccessKey = v.AccessKey, v.SecretKey
		s, err := segment.Open(StoreURL(p.URL(), bucket, "pfx"), opts)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	s := open(segment.OpenOptions{MaxAttempts: 3, MinBackoff: time.Millisecond, MaxBackoff: 10 * time.Millisecond})

	// Counts.
	for _, k := range []string{"wal/1", "wal/2", "meta/a"} {
		if _, err := s.Put(ctx, k, []byte("0123456789"), segment.PutOptions{IfNoneMatch: true}); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := s.Get(ctx, "wal/1", 2, 3); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.List(ctx, "wal/", "", 10); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, []string{"wal/1", "wal/2"}); err != nil {
		t.Fatal(err)
	}
	n := p.Counts()
	if n.Put != 3 || n.Get != 1 || n.List != 1 || n.Delete != 1 || n.Head != 0 || n.Other != 0 || n.BytesPut != 30 {
		t.Fatalf("counts = %+v", n)
	}
	if n.PutsUnder("pfx/wal/") != 2 || n.Under(OpDelete, "pfx/wal/") != 2 || n.Under(OpList, "pfx/wal/") != 1 || n.GetsUnder("pfx/meta/") != 0 {
		t.Fatalf("per-prefix counts wrong: %+v", n)
	}
	p.Reset()

	// A transient fault is retried by the store; a permanent one is not
	// hidden.
	remove := p.AddFault(Fault{Op: OpPut, KeyContains: "wal/3", Status: 503, Times: 1})
	if _, err := s.Put(ctx, "wal/3", []byte("x"), segment.PutOptions{}); err != nil {
		t.Fatalf("put through one 503: %v", err)
	}
	remove()
	if n := p.Counts(); n.PutsUnder("pfx/wal/3") != 2 || n.Faults != 1 {
		t.Fatalf("counts = %+v", n)
	}
	remove = p.AddFault(Fault{Op: OpGet, Status: 500})
	if _, _, err := s.Get(ctx, "wal/3", 0, -1); err == nil {
		t.Fatal("get succeeded through a permanent 500")
	}
	remove()

	// Hold an upload; it lands only when released.
	release := p.Hold(Fault{Op: OpPut, KeyContains: "wal/4"})
	done := make(chan error, 1)
	go func() {
		_, err := s.Put(ctx, "wal/4", []byte("held"), segment.PutOptions{IfNoneMatch: true})
		done <- err
	}()
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := p.WaitHeld(wctx, 1); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Get(ctx, "wal/4", 0, -1); !errors.Is(err, segment.ErrNotFound) {
		t.Fatalf("held upload visible: %v", err)
	}
	release()
	if err := <-done; err != nil {
		t.Fatalf("released upload: %v", err)
	}

	// A body large enough for the SDK to send Expect: 100-continue.
	big := bytes.Repeat([]byte("picomq!!"), 3<<17) // 3 MiB
	p.Reset()
	if _, err := s.Put(ctx, "data/big", big, segment.PutOptions{IfNoneMatch: true}); err != nil {
		t.Fatalf("big put: %v", err)
	}
	if got, _, err := s.Get(ctx, "data/big", 1<<20, 8); err != nil || string(got) != "picomq!!" {
		t.Fatalf("big get = %q, %v", got, err)
	}
	if n := p.Counts(); n.BytesPut != int64(len(big)) {
		t.Fatalf("BytesPut = %d, want %d", n.BytesPut, len(big))
	}

	// Server down: a store without retries fails at once; one with
	// retries rides over a restart.
	once := open(segment.OpenOptions{MaxAttempts: 1})
	patient := open(segment.OpenOptions{MaxAttempts: 100, MinBackoff: 10 * time.Millisecond, MaxBackoff: 20 * time.Millisecond})
	p.Down()
	if _, _, err := once.Get(ctx, "wal/4", 0, -1); err == nil || errors.Is(err, segment.ErrNotFound) {
		t.Fatalf("get while down: %v", err)
	}
	go func() {
		_, err := patient.Put(ctx, "wal/5", []byte("after restart"), segment.PutOptions{IfNoneMatch: true})
		done <- err
	}()
	time.Sleep(100 * time.Millisecond)
	if err := p.Up(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("put across the restart: %v", err)
	}
	if got, _, err := once.Get(ctx, "wal/5", 0, -1); err != nil || string(got) != "after restart" {
		t.Fatalf("get after Up = %q, %v", got, err)
	}
}
