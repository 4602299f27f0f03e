//go:build unix && !aix

package segment

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"
)

// TestFileStoreTidiesEmptyFolders leaves empty folders behind as a crash
// between a delete's unlink and its rmdir would, and checks that a later
// List through them or Delete of their last key removes them.
func TestFileStoreTidiesEmptyFolders(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		// tidy runs after the file of key "t/a/b/gone" was unlinked,
		// its folders left; "t/keep" stays throughout.
		tidy func(t *testing.T, s *FileStore)
	}{
		{"list of the parent", func(t *testing.T, s *FileStore) {
			if objs, _, err := s.List(ctx, "t/", "", 10); err != nil || len(objs) != 1 || objs[0].Key != "t/keep" {
				t.Fatalf("List = %v, %v; want t/keep", objs, err)
			}
		}},
		{"list of the folder", func(t *testing.T, s *FileStore) {
			if objs, _, err := s.List(ctx, "t/a/b/", "", 10); err != nil || len(objs) != 0 {
				t.Fatalf("List = %v, %v; want nothing", objs, err)
			}
		}},
		{"delete again", func(t *testing.T, s *FileStore) {
			if err := s.Delete(ctx, []string{"t/a/b/gone"}); err != nil {
				t.Fatal(err)
			}
		}},
		{"delete if match again", func(t *testing.T, s *FileStore) {
			if err := s.DeleteIfMatch(ctx, "t/a/b/gone", etagOf([]byte("x"))); err != nil && !errors.Is(err, ErrPreconditionFailed) {
				t.Fatal(err)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, err := NewFileStore(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			for _, k := range []string{"t/keep", "t/a/b/gone"} {
				if _, err := s.Put(ctx, k, []byte("x"), PutOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			// The crash: the file is gone, its folders stay, and they
			// were last changed a while ago.
			if err := os.Remove(s.path("t/a/b/gone")); err != nil {
				t.Fatal(err)
			}
			backdate(t, s.path("t/a/b"))
			backdate(t, s.path("t/a"))
			tc.tidy(t, s)
			if _, err := os.Stat(s.path("t/a")); !errors.Is(err, fs.ErrNotExist) {
				t.Fatalf("empty folders t/a/b/ and t/a/ left behind (stat t/a: %v)", err)
			}
			if _, _, err := s.Get(ctx, "t/keep", 0, -1); err != nil {
				t.Fatalf("t/keep: %v", err)
			}
		})
	}
}

// TestFileStoreTidyingLosesNoPut lists a folder over and over, removing
// the empty folders it finds at once, while keys are put into folders
// that come and go beneath it: no Put may fail or be lost.
func TestFileStoreTidyingLosesNoPut(t *testing.T) {
	ctx := context.Background()
	s, err := NewFileStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	s.tidyAge = -time.Hour // every empty folder is old enough
	var want []string
	var mu sync.Mutex
	stop := make(chan struct{})
	var lister sync.WaitGroup
	lister.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, _, err := s.List(ctx, "p/", "", 1000); err != nil {
				t.Error(err)
				return
			}
		}
	})
	var writers sync.WaitGroup
	for g := range 4 {
		writers.Go(func() {
			for i := range 50 {
				// A folder of its own, made and emptied again: each
				// Put has to make it, and the lister may find it empty.
				k := fmt.Sprintf("p/%d/%d/k", g, i%5)
				if _, err := s.Put(ctx, k, []byte("x"), PutOptions{}); err != nil {
					t.Error(err)
					return
				}
				if i < 45 {
					if err := s.Delete(ctx, []string{k}); err != nil {
						t.Error(err)
						return
					}
					continue
				}
				mu.Lock()
				want = append(want, k)
				mu.Unlock()
			}
		})
	}
	writers.Wait()
	close(stop)
	lister.Wait()
	objs, _, err := s.List(ctx, "p/", "", 1000)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, o := range objs {
		got = append(got, o.Key)
	}
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("listed %q\nwant %q", got, want)
	}
	for _, k := range want {
		if _, err := os.Stat(filepath.Join(s.Dir(), k)); err != nil {
			t.Fatalf("%s: %v", k, err)
		}
	}
}
