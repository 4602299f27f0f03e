//go:build unix && !aix

package segment

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"
)

// TestFileStoreComputedETagAllocs lists keys whose ETags are not cached
// on their files (a file system without xattrs, or a copied tree) and
// checks what computing them allocates: a 32 KB copy buffer per key made
// such a listing, or WAL replay's, churn a megabyte per 32 keys.
func TestFileStoreComputedETagAllocs(t *testing.T) {
	s, err := NewFileStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	const n = 64
	dir := filepath.Join(s.Dir(), "plain")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	data := make([]byte, 10000)
	for i := range n {
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("%03d", i)), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	list := func() {
		objs, _, err := s.List(ctx, "plain/", "", n)
		if err != nil || len(objs) != n {
			t.Fatalf("List: %d keys, %v", len(objs), err)
		}
		if want := etagOf(data); objs[0].ETag != want {
			t.Fatalf("computed ETag %s, want %s", objs[0].ETag, want)
		}
	}
	list() // warm up
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	list()
	runtime.ReadMemStats(&after)
	per := (after.TotalAlloc - before.TotalAlloc) / n
	t.Logf("%d bytes allocated per key", per)
	if per > 4096 {
		t.Fatalf("listing a key whose ETag is computed allocated %d bytes, want at most 4096", per)
	}
}
