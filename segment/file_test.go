package segment_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/picomq/caddy-picomq/segment"
	"github.com/picomq/caddy-picomq/segment/storetest"
)

func TestFileStoreContract(t *testing.T) {
	storetest.Run(t, func(t *testing.T) segment.Store {
		s, err := segment.Open("file://"+filepath.Join(t.TempDir(), "store"), segment.OpenOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return s
	})
}

// TestFileStoreContractListKept runs the contract suite with every folder
// read kept for the next page, even one just written, so that every
// listing page past the first continues from kept names.
func TestFileStoreContractListKept(t *testing.T) {
	storetest.Run(t, func(t *testing.T) segment.Store {
		s, err := segment.NewFileStore(filepath.Join(t.TempDir(), "store"))
		if err != nil {
			t.Fatal(err)
		}
		segment.KeepEveryList(s)
		t.Cleanup(func() { s.Close() })
		return s
	})
}

func newFileStore(t *testing.T) (*segment.FileStore, string) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "root")
	s, err := segment.NewFileStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	return s, dir
}

// TestFileStoreLayout checks what the store leaves on disk: keys as
// folders and files, no staging leftovers, empty folders pruned up to but
// not including the root.
func TestFileStoreLayout(t *testing.T) {
	ctx := context.Background()
	s, dir := newFileStore(t)
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("NewFileStore touched the disk: %v", err)
	}
	if _, _, err := s.Get(ctx, "a/b", 0, -1); !errors.Is(err, segment.ErrNotFound) {
		t.Fatalf("Get before any Put: %v", err)
	}
	if objs, more, err := s.List(ctx, "", "", 10); err != nil || len(objs) != 0 || more {
		t.Fatalf("List before any Put: %v %v %v", objs, more, err)
	}
	for _, k := range []string{"x/y/z", "x/y/w", "x/q"} {
		if _, err := s.Put(ctx, k, []byte(k), segment.PutOptions{IfNoneMatch: k == "x/q"}); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(filepath.Join(dir, "x", "y", "z"))
	if err != nil || string(b) != "x/y/z" {
		t.Fatalf("file x/y/z = %q, %v", b, err)
	}
	tmp, err := os.ReadDir(filepath.Join(dir, ".picomq-tmp"))
	if err != nil || len(tmp) != 0 {
		t.Fatalf("staging folder holds %v (%v)", tmp, err)
	}
	if err := s.Delete(ctx, []string{"x/y/z"}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "x", "y")); err != nil {
		t.Fatalf("folder with a key left was removed: %v", err)
	}
	if err := s.Delete(ctx, []string{"x/y/w", "x/q"}); err != nil {
		t.Fatal(err)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatalf("root removed: %v", err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if !slices.Equal(names, []string{".picomq-locks", ".picomq-tmp"}) {
		t.Fatalf("root holds %q after deleting everything", names)
	}
	// An empty folder left behind (by hand, or a crash) is not listed.
	if err := os.MkdirAll(filepath.Join(dir, "empty", "deeper"), 0o755); err != nil {
		t.Fatal(err)
	}
	if objs, _, err := s.List(ctx, "", "", 10); err != nil || len(objs) != 0 {
		t.Fatalf("List with empty folders = %v, %v", objs, err)
	}
}

func TestFileStoreBadKeys(t *testing.T) {
	ctx := context.Background()
	s, _ := newFileStore(t)
	bad := []string{"", ".hidden", ".picomq-tmp/x", "a//b", "/abs", "trailing/", "a/../b", "a/./b", "nul\x00", strings.Repeat("x", 256), strings.Repeat("a/", 513)}
	for _, k := range bad {
		if _, err := s.Put(ctx, k, []byte("x"), segment.PutOptions{}); err == nil {
			t.Errorf("Put(%q) succeeded", k)
		}
		if _, _, err := s.Get(ctx, k, 0, -1); err == nil || errors.Is(err, segment.ErrNotFound) {
			t.Errorf("Get(%q) error = %v, want a key error", k, err)
		}
	}
	// A key component may start with '.' below the top level.
	if _, err := s.Put(ctx, "a/.b", []byte("x"), segment.PutOptions{}); err != nil {
		t.Errorf("Put(a/.b): %v", err)
	}
	// An object cannot also be a folder.
	if _, err := s.Put(ctx, "a/.b/c", []byte("x"), segment.PutOptions{}); err == nil {
		t.Error("Put under an object succeeded")
	}
	if _, err := s.Put(ctx, "a", []byte("x"), segment.PutOptions{IfNoneMatch: true}); err == nil || errors.Is(err, segment.ErrPreconditionFailed) {
		t.Errorf("create of a folder's name: %v, want a key error", err)
	}
	if _, err := s.Put(ctx, "a", []byte("x"), segment.PutOptions{}); err == nil {
		t.Error("Put over a folder succeeded")
	}
}

// TestFileStoreETagWithoutXattr checks that ETags are computed from the
// content when the cached one is missing (a copied tree, or a file system
// without xattrs).
func TestFileStoreETagWithoutXattr(t *testing.T) {
	ctx := context.Background()
	s, dir := newFileStore(t)
	etag, err := s.Put(ctx, "k/v", []byte("content"), segment.PutOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// Replace the file by a plain copy without the xattr.
	p := filepath.Join(dir, "k", "v")
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte("content"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, e, err := s.Get(ctx, "k/v", 2, 2); err != nil || e != etag {
		t.Fatalf("Get ETag = %s, %v; want %s", e, err, etag)
	}
	if _, err := s.Put(ctx, "k/v", []byte("new"), segment.PutOptions{IfMatch: etag}); err != nil {
		t.Fatalf("IfMatch with the computed ETag: %v", err)
	}
}

func TestParseFileLocation(t *testing.T) {
	for _, bad := range []string{"file://relative/dir", "file:relative", "file://host/dir", "file:///dir?x=1", "/abs/dir", "ftp://x/y"} {
		if _, err := segment.Open(bad, segment.OpenOptions{}); err == nil {
			t.Errorf("Open(%q) succeeded", bad)
		}
	}
	loc, err := segment.ParseLocation("file:///var/lib/picomq/../picomq/")
	if err != nil || loc.Dir != "/var/lib/picomq" || loc.String() != "file:///var/lib/picomq" {
		t.Fatalf("ParseLocation = %+v, %v", loc, err)
	}
}

// childDirEnv names the directory a child process of
// TestFileStoreTwoProcesses increments the counter in.
const childDirEnv = "PICOMQ_FILESTORE_CHILD_DIR"

// TestFileStoreTwoProcesses runs compare-and-swap increments of one key
// from two processes on one directory, as a restart whose old process has
// not exited yet does with the manifest: no increment may be lost.
func TestFileStoreTwoProcesses(t *testing.T) {
	if dir := os.Getenv(childDirEnv); dir != "" {
		if err := incrementCounter(dir); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	const children, perChild = 2, 4 * childIncrements
	s, dir := newFileStore(t)
	ctx := context.Background()
	if _, err := s.Put(ctx, "cas/counter", []byte("0"), segment.PutOptions{IfNoneMatch: true}); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	outs := make([][]byte, children)
	errs := make([]error, children)
	for i := range children {
		wg.Go(func() {
			cmd := exec.Command(os.Args[0], "-test.run=^TestFileStoreTwoProcesses$")
			cmd.Env = append(os.Environ(), childDirEnv+"="+dir)
			outs[i], errs[i] = cmd.CombinedOutput()
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("child %d: %v\n%s", i, err, outs[i])
		}
	}
	got, _, err := s.Get(ctx, "cas/counter", 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	if want := strconv.Itoa(children * perChild); string(got) != want {
		t.Fatalf("counter = %s after %s compare-and-swap increments from %d processes: updates were lost", got, want, children)
	}
}

const childIncrements = 50

// incrementCounter is a child process's part: four goroutines each add
// childIncrements to the counter by compare-and-swap.
func incrementCounter(dir string) error {
	s, err := segment.NewFileStore(dir)
	if err != nil {
		return err
	}
	defer s.Close()
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for g := range errs {
		wg.Go(func() {
			for done := 0; done < childIncrements; {
				data, etag, err := s.Get(ctx, "cas/counter", 0, -1)
				if err != nil {
					errs[g] = err
					return
				}
				n, err := strconv.Atoi(string(data))
				if err != nil {
					errs[g] = fmt.Errorf("counter %q: %w", data, err)
					return
				}
				_, err = s.Put(ctx, "cas/counter", []byte(strconv.Itoa(n+1)), segment.PutOptions{IfMatch: etag})
				switch {
				case err == nil:
					done++
				case !errors.Is(err, segment.ErrPreconditionFailed):
					errs[g] = err
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}
