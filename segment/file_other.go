//go:build !unix || aix

package segment

import (
	"context"
	"errors"
	"os"
)

// errFileStoreUnsupported says why there is no FileStore here: its
// atomicity and durability rest on Unix file-system semantics (link(2)
// failing on an existing name, rename over a file others have open,
// flock(2), fsync of a directory) that this project neither has nor tests
// on other systems; AIX has no flock. S3 storage works everywhere.
var errFileStoreUnsupported = errors.New("segment: file:// storage needs a Unix file system with flock (Linux, macOS, BSD, illumos); configure s3:// storage on this system")

const oDirectory = 0

func setETagAttr(*os.File, string) {}

func getETagAttr(*os.File, []byte) (int, error) { return 0, errors.ErrUnsupported }

func unlink(string) error { return errors.ErrUnsupported }

func rmdir(string) error { return errors.ErrUnsupported }

func lockFile(context.Context, *os.File) error { return errors.ErrUnsupported }

func unlockFile(*os.File) {}
