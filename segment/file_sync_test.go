package segment

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"
)

// TestFileStoreSyncsFreshFolders checks that a Put into a folder whose
// entry in its parent may not be durable yet (its maker's fsync of the
// parent failed, or has not happened yet) syncs the parent before it
// returns: otherwise a power cut could take the folder, and the
// acknowledged object in it, back.
func TestFileStoreSyncsFreshFolders(t *testing.T) {
	ctx := context.Background()
	root := filepath.Join(t.TempDir(), "root")
	s, err := NewFileStore(root)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(ctx, "seed", []byte("x"), PutOptions{}); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var synced []string
	failRoot := true
	s.syncDir = func(dir string) error {
		mu.Lock()
		defer mu.Unlock()
		if dir == root && failRoot {
			return errors.New("injected fsync failure")
		}
		synced = append(synced, dir)
		return syncDir(dir)
	}
	// The first Put makes folder a/ and fails to sync the root: it is not
	// acknowledged, and a/ stays behind.
	if _, err := s.Put(ctx, "a/one", []byte("1"), PutOptions{}); err == nil {
		t.Fatal("Put succeeded although the root's fsync failed")
	}
	mu.Lock()
	failRoot, synced = false, nil
	mu.Unlock()
	if _, err := s.Put(ctx, "a/two", []byte("2"), PutOptions{IfNoneMatch: true}); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(synced, root) {
		t.Fatalf("Put of a/two synced %q: not the root, whose entry for a/ is not known to be durable", synced)
	}
	// Once the root is synced, the next Put there syncs only its folder.
	synced = nil
	if _, err := s.Put(ctx, "a/three", []byte("3"), PutOptions{}); err != nil {
		t.Fatal(err)
	}
	if want := []string{filepath.Join(root, "a")}; !slices.Equal(synced, want) {
		t.Fatalf("Put of a/three synced %q, want %q", synced, want)
	}
}

// TestFileStoreSweepsStagingFilesAgain checks that staging files a crash
// left behind are swept by the running process, not only by the first
// write after a start: a crash shortly before the start leaves files too
// young for that sweep, and they stayed until a later restart.
func TestFileStoreSweepsStagingFilesAgain(t *testing.T) {
	ctx := context.Background()
	root := filepath.Join(t.TempDir(), "root")
	s, err := NewFileStore(root)
	if err != nil {
		t.Fatal(err)
	}
	s.sweepEvery = 0 // every write is due for a sweep
	if _, err := s.Put(ctx, "first", []byte("x"), PutOptions{}); err != nil {
		t.Fatal(err)
	}
	// Left by a crash (of this process or another) after the first sweep,
	// and now old; and one of a write still in flight.
	stale := filepath.Join(root, fileTmpDir, "put-stale")
	young := filepath.Join(root, fileTmpDir, "put-young")
	for _, p := range []string{stale, young} {
		if err := os.WriteFile(p, []byte("partial"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	old := time.Now().Add(-2 * fileSweepEvery)
	if err := os.Chtimes(stale, old, old); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(ctx, "second", []byte("y"), PutOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(stale); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a staging file two sweep periods old is still there after a later write: %v", err)
	}
	if _, err := os.Stat(young); err != nil {
		t.Errorf("a young staging file (a write in flight) was swept: %v", err)
	}
}
