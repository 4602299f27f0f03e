//go:build unix && !aix

package segment

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// BenchmarkFileStoreListFolder lists, page by page, every key of one
// folder of n keys, as the engine lists streams/ (Pico's GET /). Each page
// used to read the whole folder, so a full listing cost n²/1000; now the
// pages after the first continue from the names the first read.
func BenchmarkFileStoreListFolder(b *testing.B) {
	for _, n := range []int{1000, 10000, 50000} {
		b.Run(fmt.Sprintf("keys=%d", n), func(b *testing.B) {
			s, err := NewFileStore(b.TempDir())
			if err != nil {
				b.Fatal(err)
			}
			// Written straight to the folder: n Puts, each fsynced,
			// would take longer than the listings measured.
			dir := filepath.Join(s.Dir(), "streams")
			if err := os.MkdirAll(dir, 0o755); err != nil {
				b.Fatal(err)
			}
			for i := range n {
				// Not in creation order: a folder's order is the file
				// system's, not the keys'.
				name := fmt.Sprintf("%08x.m", uint32(i)*2654435761)
				f, err := os.Create(filepath.Join(dir, name))
				if err != nil {
					b.Fatal(err)
				}
				if _, err := f.Write([]byte("m")); err != nil {
					b.Fatal(err)
				}
				setETagAttr(f, etagOf([]byte("m"))) // as Put does
				if err := f.Close(); err != nil {
					b.Fatal(err)
				}
			}
			// A folder not written in the last seconds, as streams/
			// between creations: one just written is read for every
			// page (see fileListSettle).
			backdate(b, dir)
			ctx := context.Background()
			b.ResetTimer()
			for range b.N {
				got, after := 0, ""
				for {
					objs, more, err := s.List(ctx, "streams/", after, 1000)
					if err != nil {
						b.Fatal(err)
					}
					got += len(objs)
					if !more {
						break
					}
					after = objs[len(objs)-1].Key
				}
				if got != n {
					b.Fatalf("listed %d keys of %d", got, n)
				}
			}
		})
	}
}
