//go:build unix && !aix

package segment

import (
	"context"
	"errors"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// errFileStoreUnsupported is nil where a FileStore works: on Unix file
// systems, whose link, rename, unlink, flock and directory fsync it relies
// on.
var errFileStoreUnsupported error

// oDirectory makes an open fail unless the path is a directory.
const oDirectory = syscall.O_DIRECTORY

// unlink removes the file at path, never a folder (os.Remove would take
// an empty one).
func unlink(path string) error { return unix.Unlink(path) }

// rmdir removes the folder at path if it is empty.
func rmdir(path string) error { return unix.Rmdir(path) }

// lockFile takes f's exclusive flock(2), waiting for another process to
// release it for as long as ctx allows. Holders keep it for a check and a
// rename, so the wait is short unless the holder is stopped.
func lockFile(ctx context.Context, f *os.File) error {
	wait := 100 * time.Microsecond
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		switch {
		case err == nil:
			return nil
		case errors.Is(err, unix.EINTR):
			continue
		case !errors.Is(err, unix.EWOULDBLOCK):
			return err
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		wait = min(2*wait, 10*time.Millisecond)
	}
}

// unlockFile releases lockFile's lock. Closing f would release it too, so
// an error here leaves nothing held for long.
func unlockFile(f *os.File) { _ = unix.Flock(int(f.Fd()), unix.LOCK_UN) }
