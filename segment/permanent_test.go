package segment

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/aws/smithy-go"
)

// TestPermanent: the refusals that need the operator are told apart from
// faults that pass by themselves, for both backends.
func TestPermanent(t *testing.T) {
	pathErr := func(errno syscall.Errno) error {
		return fmt.Errorf("segment: put wal/x: %w", &fs.PathError{Op: "open", Path: "/data/.picomq-tmp/put-1", Err: errno})
	}
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{"read-only file system", pathErr(syscall.EROFS), true},
		{"permission denied", pathErr(syscall.EACCES), true},
		{"operation not permitted", &os.LinkError{Op: "link", Old: "a", New: "b", Err: syscall.EPERM}, true},
		{"no space left", pathErr(syscall.ENOSPC), true},
		{"I/O error", pathErr(syscall.EIO), false},
		{"not found", ErrNotFound, false},
		{"precondition", ErrPreconditionFailed, false},
		{"socket EACCES", &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.EACCES)}, false},
		{"AccessDenied", &smithy.GenericAPIError{Code: "AccessDenied"}, true},
		{"NoSuchBucket", &smithy.GenericAPIError{Code: "NoSuchBucket"}, true},
		{"SlowDown", &smithy.GenericAPIError{Code: "SlowDown"}, false},
		{"nil", nil, false},
		{"plain", errors.New("something"), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Permanent(tt.err); got != tt.want {
				t.Fatalf("Permanent(%v) = %v, want %v", tt.err, got, tt.want)
			}
		})
	}
}
