//go:build unix

package segment

import (
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// errFileStoreUnsupported is nil where a FileStore works: on Unix file
// systems, whose link, rename, unlink and directory fsync it relies on.
var errFileStoreUnsupported error

// oDirectory makes an open fail unless the path is a directory.
const oDirectory = syscall.O_DIRECTORY

// setETagAttr caches etag on f's inode, best effort: without xattrs the
// ETag is computed when needed.
func setETagAttr(f *os.File, etag string) {
	_ = unix.Fsetxattr(int(f.Fd()), etagXattr, []byte(etag), 0)
}

// getETagAttr reads the ETag cached on f's inode into buf.
func getETagAttr(f *os.File, buf []byte) (int, error) {
	return unix.Fgetxattr(int(f.Fd()), etagXattr, buf)
}

// unlink removes the file at path, never a folder (os.Remove would take
// an empty one).
func unlink(path string) error { return unix.Unlink(path) }

// rmdir removes the folder at path if it is empty.
func rmdir(path string) error { return unix.Rmdir(path) }
