package picomq

import (
	"context"
	"io"
	"io/fs"
	"net/http"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/picomq/caddy-picomq/segment"
	"github.com/picomq/caddy-picomq/streamstore"
)

// readOnlyStore is a store whose writes fail as on a file system remounted
// read-only while refuse is set. (Tests run as root, which a directory
// made read-only with chmod does not stop.)
type readOnlyStore struct {
	segment.Store
	dir    string
	refuse atomic.Bool
}

func (s *readOnlyStore) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	if s.refuse.Load() {
		return "", &fs.PathError{Op: "open", Path: filepath.Join(s.dir, ".picomq-tmp", "put-1"), Err: syscall.EROFS}
	}
	return s.Store.Put(ctx, key, data, opts)
}

// readOnlyServer serves the Durable Streams protocol on an engine over a
// file:// store that refuses writes while its refuse is set, and returns
// the store, a request to /s (Content-Type text/plain), the warnings logged
// and the store's folder.
func readOnlyServer(t *testing.T) (*readOnlyStore, func(method, body string) (int, string), *observer.ObservedLogs, string) {
	t.Helper()
	dir := t.TempDir()
	inner, err := segment.Open("file://"+dir, segment.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	store := &readOnlyStore{Store: inner, dir: dir}
	core, logs := observer.New(zapcore.WarnLevel)
	log := zap.New(core)
	// An hour: an answer that waited for the timeout cannot pass.
	eng := streamstore.New(store, streamstore.Config{NodeID: "test-node", FlushInterval: time.Millisecond, AppendTimeout: time.Hour}, log)
	if err := eng.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	srv := newDSServerOn(t, eng, log)
	client := &http.Client{Timeout: time.Minute}
	do := func(method, body string) (int, string) {
		t.Helper()
		req, err := http.NewRequest(method, srv.URL+"/s", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "text/plain")
		res, err := client.Do(req)
		if err != nil {
			t.Fatalf("%s /s: %v", method, err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(b)
	}
	return store, do, logs, dir
}

// An append to a file:// storage that turned read-only is answered 503 at
// once, not after the append timeout, and the warning logged for it names
// the cause; once the storage takes writes again, appends succeed.
func TestAppendToReadOnlyStorageFailsFast(t *testing.T) {
	store, do, logs, dir := readOnlyServer(t)
	if code, body := do(http.MethodPut, "a"); code != http.StatusCreated {
		t.Fatalf("create: %d %s", code, body)
	}
	store.refuse.Store(true)
	// The answer names the cause, not the server's paths; the first
	// append was on its way to storage, the second never got there.
	for _, tt := range []struct{ what, want string }{
		{"first append", "storage refuses writes: read-only file system; the write was not acknowledged but may still be stored"},
		{"second append", "storage refuses writes: read-only file system; nothing was written"},
	} {
		code, body := do(http.MethodPost, "b")
		if code != http.StatusServiceUnavailable {
			t.Fatalf("%s on read-only storage: %d %s, want 503", tt.what, code, body)
		}
		if !strings.HasPrefix(body, tt.want) || strings.Contains(body, dir) {
			t.Errorf("%s on read-only storage: %q, want it to begin %q and name no path", tt.what, body, tt.want)
		}
	}
	named := 0
	for _, e := range logs.All() {
		for _, f := range e.Context {
			if f.Key == "error" && strings.Contains(f.Interface.(error).Error(), "read-only file system") {
				named++
			}
		}
	}
	if named < 2 {
		t.Errorf("%d warnings name the cause, want one per refused append: %v", named, logs.All())
	}
	store.refuse.Store(false)
	code, body := 0, ""
	for range 500 {
		if code, body = do(http.MethodPost, "c"); code == http.StatusNoContent || code == http.StatusOK {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if code != http.StatusNoContent && code != http.StatusOK {
		t.Fatalf("append once writable again: %d %s", code, body)
	}
}

// An append large enough to go to a blob of its own (256 KiB and more) is
// refused as any other by storage that turned read-only: the 503 names the
// refusal, as a small append's does, rather than saying the storage is
// unavailable.
func TestBlobAppendToReadOnlyStorageNamesTheRefusal(t *testing.T) {
	store, do, _, dir := readOnlyServer(t)
	if code, body := do(http.MethodPut, ""); code != http.StatusCreated {
		t.Fatalf("create: %d %s", code, body)
	}
	store.refuse.Store(true)
	t.Cleanup(func() { store.refuse.Store(false) }) // before the engine closes
	code, body := do(http.MethodPost, strings.Repeat("x", 300<<10))
	const want = "storage refuses writes: read-only file system"
	if code != http.StatusServiceUnavailable || !strings.HasPrefix(body, want) || strings.Contains(body, dir) {
		t.Fatalf("a 300 KiB append on read-only storage: %d %q, want 503 beginning %q and naming no path", code, body, want)
	}
}
