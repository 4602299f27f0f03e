//go:build linux || darwin || freebsd || netbsd

package segment

import (
	"os"

	"golang.org/x/sys/unix"
)

// setETagAttr caches etag on f's inode, best effort: without xattrs the
// ETag is computed when needed.
func setETagAttr(f *os.File, etag string) {
	_ = unix.Fsetxattr(int(f.Fd()), etagXattr, []byte(etag), 0)
}

// getETagAttr reads the ETag cached on f's inode into buf.
func getETagAttr(f *os.File, buf []byte) (int, error) {
	return unix.Fgetxattr(int(f.Fd()), etagXattr, buf)
}
