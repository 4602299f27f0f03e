//go:build unix && !aix

package segment

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// countReads makes s count its folder reads.
func countReads(s *FileStore) *atomic.Int64 {
	var n atomic.Int64
	read := s.readDir
	s.readDir = func(dir string) ([]fs.DirEntry, fs.FileInfo, error) {
		n.Add(1)
		return read(dir)
	}
	return &n
}

// fillFolder writes n keys straight into the folder dir of s, out of
// order, as Put would leave them, and backdates the folder: it was last
// written a minute ago. It returns the keys in order.
func fillFolder(t testing.TB, s *FileStore, dir string, n int) []string {
	t.Helper()
	path := filepath.Join(s.Dir(), dir)
	if err := os.MkdirAll(path, 0o755); err != nil {
		t.Fatal(err)
	}
	keys := make([]string, 0, n)
	for i := range n {
		name := fmt.Sprintf("%08x.m", uint32(i)*2654435761)
		f, err := os.Create(filepath.Join(path, name))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.Write([]byte("m")); err != nil {
			t.Fatal(err)
		}
		setETagAttr(f, etagOf([]byte("m")))
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
		keys = append(keys, dir+"/"+name)
	}
	backdate(t, path)
	slices.Sort(keys)
	return keys
}

// backdate sets the modification time of the folder path a minute back.
func backdate(t testing.TB, path string) {
	t.Helper()
	old := time.Now().Add(-time.Minute)
	if err := os.Chtimes(path, old, old); err != nil {
		t.Fatal(err)
	}
}

// listPages pages through prefix after the key after, max keys a page,
// and returns the keys and the number of pages.
func listPages(t testing.TB, s *FileStore, prefix string, max int, after string) ([]string, int) {
	t.Helper()
	var keys []string
	for pages := 1; ; pages++ {
		objs, more, err := s.List(context.Background(), prefix, after, max)
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range objs {
			keys = append(keys, o.Key)
		}
		if !more {
			return keys, pages
		}
		after = objs[len(objs)-1].Key
	}
}

// TestFileStoreListPagingReadsFolderOnce pages through a folder of 2,000
// keys 100 at a time, as the engine pages through streams/: the folder is
// read once, not once a page (which made a full listing cost the square
// of the folder's size).
func TestFileStoreListPagingReadsFolderOnce(t *testing.T) {
	s, err := NewFileStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	want := fillFolder(t, s, "streams", 2000)
	reads := countReads(s)
	got, pages := listPages(t, s, "streams/", 100, "")
	if !slices.Equal(got, want) {
		t.Fatalf("listed %d keys, want the %d in order", len(got), len(want))
	}
	if n := reads.Load(); n != 1 {
		t.Fatalf("%d pages read the folder %d times, want once", pages, n)
	}
}

// KeepEveryList makes s keep the names of every folder a page of a
// listing ends in, even one just written (see TestFileStoreContractListKept).
func KeepEveryList(s *FileStore) { s.lists.settle = -time.Hour }

// TestFileStoreListContinuesFromCurrentNames changes a folder between the
// pages of a listing, through the store and behind its back (as another
// process on the directory would): the next page lists what the folder
// holds then, as a fresh read would.
func TestFileStoreListContinuesFromCurrentNames(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name   string
		change func(t *testing.T, s *FileStore, page1, rest []string) (add, del string)
	}{
		{"put", func(t *testing.T, s *FileStore, _, rest []string) (string, string) {
			k := rest[0] + "0"
			if _, err := s.Put(ctx, k, []byte("x"), PutOptions{}); err != nil {
				t.Fatal(err)
			}
			return k, ""
		}},
		{"delete", func(t *testing.T, s *FileStore, _, rest []string) (string, string) {
			if err := s.Delete(ctx, []string{rest[1]}); err != nil {
				t.Fatal(err)
			}
			return "", rest[1]
		}},
		{"file made by another process", func(t *testing.T, s *FileStore, _, rest []string) (string, string) {
			k := rest[0] + "0"
			if err := os.WriteFile(s.path(k), []byte("x"), 0o644); err != nil {
				t.Fatal(err)
			}
			return k, ""
		}},
		{"folder made by another process", func(t *testing.T, s *FileStore, _, rest []string) (string, string) {
			k := rest[0] + "0/sub"
			if err := os.MkdirAll(filepath.Dir(s.path(k)), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(s.path(k), []byte("x"), 0o644); err != nil {
				t.Fatal(err)
			}
			return k, ""
		}},
		{"file removed by another process", func(t *testing.T, s *FileStore, _, rest []string) (string, string) {
			if err := os.Remove(s.path(rest[1])); err != nil {
				t.Fatal(err)
			}
			return "", rest[1]
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, err := NewFileStore(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			all := fillFolder(t, s, "f", 30)
			reads := countReads(s)
			objs, more, err := s.List(ctx, "f/", "", 10)
			if err != nil || !more || len(objs) != 10 {
				t.Fatalf("first page: %d keys, more=%v, %v", len(objs), more, err)
			}
			add, del := tc.change(t, s, all[:10], all[10:])
			want := slices.DeleteFunc(slices.Clone(all[10:]), func(k string) bool { return k == del })
			if add != "" {
				want = append(want, add)
				slices.Sort(want)
			}
			got, _ := listPages(t, s, "f/", 10, all[9])
			if !slices.Equal(got, want) {
				t.Fatalf("after the change the listing went on with\n%q\nwant\n%q", got, want)
			}
			if n := reads.Load(); n < 2 {
				t.Fatalf("the folder was read %d times: the change went unseen", n)
			}
		})
	}
}

// TestFileStoreListWindow pages through a folder bigger than the names
// kept of one, nested folders and a prefix included: each read serves as
// many pages as its window holds, and the listing is whole and in order.
func TestFileStoreListWindow(t *testing.T) {
	s, err := NewFileStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	s.lists.window = 150
	all := fillFolder(t, s, "w", 1000)
	// Keys in subfolders, interleaved with the folder's own.
	for i := 0; i < len(all); i += 7 {
		sub := all[i] + "d"
		if err := os.MkdirAll(s.path(sub), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(s.path(sub+"/x"), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
		backdate(t, s.path(sub))
		all = append(all, sub+"/x")
	}
	backdate(t, s.path("w"))
	slices.Sort(all)
	for _, max := range []int{1, 99, 100, 149, 150, 151, 1000} {
		reads := countReads(s)
		got, pages := listPages(t, s, "w/", max, "")
		if !slices.Equal(got, all) {
			t.Fatalf("max %d: listed %d keys, want the %d in order", max, len(got), len(all))
		}
		t.Logf("max %d: %d pages, %d folder reads", max, pages, reads.Load())
	}
	// A prefix within the folder.
	pre := all[500][:5]
	var want []string
	for _, k := range all {
		if strings.HasPrefix(k, pre) {
			want = append(want, k)
		}
	}
	if got, _ := listPages(t, s, pre, 3, ""); !slices.Equal(got, want) {
		t.Fatalf("prefix %q: %q, want %q", pre, got, want)
	}
}

// TestFileStoreListKeepsNothingWhenIdle checks that the names kept for a
// listing's next page are dropped once their time is up, with the timer
// that drops them, and at Close: an idle store holds nothing.
func TestFileStoreListKeepsNothingWhenIdle(t *testing.T) {
	s, err := NewFileStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	fillFolder(t, s, "f", 30)
	held := func() (int, bool) {
		s.lists.mu.Lock()
		defer s.lists.mu.Unlock()
		return len(s.lists.snaps), s.lists.timer != nil
	}
	if n, timer := held(); n != 0 || timer {
		t.Fatalf("a new store keeps %d folders, timer %v", n, timer)
	}
	if _, more, err := s.List(context.Background(), "f/", "", 10); err != nil || !more {
		t.Fatalf("List: more=%v, %v", more, err)
	}
	if n, timer := held(); n != 1 || !timer {
		t.Fatalf("after a page: %d folders kept, timer %v; want 1 and a timer", n, timer)
	}
	s.lists.expire(time.Now().Add(fileListKeep - time.Second))
	if n, timer := held(); n != 1 || !timer {
		t.Fatalf("before its time: %d folders kept, timer %v; want 1 and a timer", n, timer)
	}
	s.lists.expire(time.Now().Add(fileListKeep))
	if n, timer := held(); n != 0 || timer {
		t.Fatalf("after its time: %d folders kept, timer %v; want none", n, timer)
	}
	if _, _, err := s.List(context.Background(), "f/", "", 10); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if n, timer := held(); n != 0 || timer {
		t.Fatalf("after Close: %d folders kept, timer %v; want none", n, timer)
	}
}

// TestFileStoreListRecentFolderNotKept pages through a folder written a
// moment ago: a change in the same tick of the file system's clock could
// go unseen by its modification time, so each page reads it again.
func TestFileStoreListRecentFolderNotKept(t *testing.T) {
	s, err := NewFileStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	want := fillFolder(t, s, "f", 30)
	now := time.Now()
	if err := os.Chtimes(s.path("f"), now, now); err != nil {
		t.Fatal(err)
	}
	reads := countReads(s)
	got, pages := listPages(t, s, "f/", 10, "")
	if !slices.Equal(got, want) {
		t.Fatalf("listed %q, want %q", got, want)
	}
	if n := reads.Load(); n != int64(pages) {
		t.Fatalf("%d pages read the folder %d times, want once each", pages, n)
	}
}
