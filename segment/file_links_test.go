//go:build unix && !aix

package segment

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestFileStoreCheckLinks: a directory whose file system has no hard
// links is refused at the start with a message that says so and what to
// do, not at every write with link's bare error; one that has them passes
// and keeps nothing of the probe.
func TestFileStoreCheckLinks(t *testing.T) {
	tests := []struct {
		name    string
		linkErr error // nil: the real link(2)
		want    string
	}{
		{name: "hard links"},
		{name: "FAT", linkErr: syscall.EPERM, want: "does not support hard links"},
		{name: "network mount", linkErr: syscall.EOPNOTSUPP, want: "s3://"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := NewFileStore(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			if tt.linkErr != nil {
				s.link = func(oldname, newname string) error {
					return &os.LinkError{Op: "link", Old: oldname, New: newname, Err: tt.linkErr}
				}
			}
			err = s.CheckLinks()
			if tt.want == "" {
				if err != nil {
					t.Fatalf("CheckLinks: %v", err)
				}
				left, _ := os.ReadDir(filepath.Join(s.Dir(), fileTmpDir))
				if len(left) != 0 {
					t.Fatalf("the probe left %d files behind", len(left))
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) || !errors.Is(err, tt.linkErr) {
				t.Fatalf("CheckLinks: %v, want an error saying %q", err, tt.want)
			}
		})
	}
}
