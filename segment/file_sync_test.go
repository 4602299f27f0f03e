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

// failingSyncs makes s's folder syncs fail while fail holds for the
// folder, and records the folders it synced.
type failingSyncs struct {
	mu     sync.Mutex
	fail   func(dir string) bool
	synced []string
}

func (f *failingSyncs) install(s *FileStore) {
	s.syncDir = func(dir string) error {
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.fail != nil && f.fail(dir) {
			return errors.New("injected fsync failure")
		}
		f.synced = append(f.synced, dir)
		return syncDir(dir)
	}
}

func (f *failingSyncs) set(fail func(dir string) bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fail, f.synced = fail, nil
}

func (f *failingSyncs) syncs() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.synced)
}

// TestFileStoreSyncsBeforeShowing: after a Put placed a name and failed to
// sync its folder, a read of a key there, or a create-only Put that finds
// its key taken, syncs the folder before answering, and fails while the
// sync does: the caller may act on what it finds (the WAL writer settles a
// failed upload by reading its key back, then acknowledges the batch).
func TestFileStoreSyncsBeforeShowing(t *testing.T) {
	for _, tc := range []struct {
		name string
		look func(s *FileStore) error // looks at key "d/k"
		want error                    // its error once the folder syncs
	}{
		{"Get", func(s *FileStore) error {
			_, _, err := s.Get(context.Background(), "d/k", 0, -1)
			return err
		}, nil},
		{"GetBuffer", func(s *FileStore) error {
			_, err := s.GetBuffer(context.Background(), "d/k", func(n int) []byte { return make([]byte, n) })
			return err
		}, nil},
		{"create-only Put", func(s *FileStore) error {
			_, err := s.Put(context.Background(), "d/k", []byte("other"), PutOptions{IfNoneMatch: true})
			return err
		}, ErrPreconditionFailed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			root := filepath.Join(t.TempDir(), "root")
			s, err := NewFileStore(root)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := s.Put(ctx, "d/seed", []byte("x"), PutOptions{}); err != nil {
				t.Fatal(err)
			}
			dir := filepath.Join(root, "d")
			syncs := &failingSyncs{}
			syncs.install(s)
			syncs.set(func(d string) bool { return d == dir })
			if _, err := s.Put(ctx, "d/k", []byte("v"), PutOptions{IfNoneMatch: true}); !errors.Is(err, ErrUnknownOutcome) {
				t.Fatalf("Put whose folder sync failed = %v, want an unknown outcome", err)
			}
			if err := tc.look(s); err == nil || errors.Is(err, ErrPreconditionFailed) {
				t.Fatalf("with the folder still failing to sync: %v, want an error that shows nothing", err)
			}
			syncs.set(nil)
			if err := tc.look(s); !errors.Is(err, tc.want) || (tc.want == nil && err != nil) {
				t.Fatalf("once the folder syncs: %v, want %v", err, tc.want)
			}
			if got := syncs.syncs(); !slices.Contains(got, dir) {
				t.Fatalf("answered having synced %q: not the folder a crash could take the name from", got)
			}
			// Synced once: the next look costs no sync.
			syncs.set(nil)
			if err := tc.look(s); !errors.Is(err, tc.want) || (tc.want == nil && err != nil) {
				t.Fatal(err)
			}
			if got := syncs.syncs(); slices.Contains(got, dir) {
				t.Errorf("a second look synced %q again", got)
			}
		})
	}
}

// syncedAtCommit records, for each batch committed, whether the WAL
// folder had been synced since the failure by then.
type syncedAtCommit struct {
	noted   func() bool
	mu      sync.Mutex
	commits []bool
}

func (h *syncedAtCommit) Committed(*Batch) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.commits = append(h.commits, h.noted())
}

func (h *syncedAtCommit) Aborted(*Batch, error) {}

// TestWriterSettlesOnDurableObject: on a file store, a WAL upload whose
// object was placed but whose folder failed to sync is settled by its
// seal, which finds the object there. The batch is acknowledged only once
// that folder has been synced: before, the seal read the object back and
// the batch was acknowledged with its name still one power cut from gone.
func TestWriterSettlesOnDurableObject(t *testing.T) {
	root := filepath.Join(t.TempDir(), "root")
	s, err := NewFileStore(root)
	if err != nil {
		t.Fatal(err)
	}
	walDir := filepath.Join(root, filepath.FromSlash(filepath.Dir(WALKey(1, 0))))
	if err := os.MkdirAll(walDir, 0o755); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex // guards failed and synced
	failed, synced := false, false
	syncs := &failingSyncs{}
	syncs.install(s)
	syncs.set(func(d string) bool {
		if d != walDir {
			return false
		}
		mu.Lock()
		defer mu.Unlock()
		if !failed {
			failed = true
			return true // the upload's own sync
		}
		synced = true
		return false
	})
	hooks := &syncedAtCommit{noted: func() bool {
		mu.Lock()
		defer mu.Unlock()
		return synced
	}}
	w := NewWriter(s, 1, 0, WriterConfig{FlushInterval: time.Millisecond}, WriterDeps{
		Hooks:        hooks,
		Token:        "t",
		NewNamespace: func(context.Context) (uint64, error) { return 2, nil },
	})
	b, err := w.Add(&Entry{StreamID: "s", Name: "s", FirstSeq: 0, Records: []Record{{Seq: 0, Body: []byte("x")}}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := w.Close(ctx); err != nil {
		t.Fatal(err)
	}
	<-b.Done()
	if err := b.Err(); err != nil {
		t.Fatalf("the batch whose object landed was not committed: %v", err)
	}
	hooks.mu.Lock()
	defer hooks.mu.Unlock()
	if len(hooks.commits) != 1 || !hooks.commits[0] {
		t.Fatalf("commits (folder synced by then): %v, want one, after the sync", hooks.commits)
	}
}
