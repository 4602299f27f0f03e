package segment

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"syscall"
	"testing"

	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/smithy-go"
	smithyhttp "github.com/aws/smithy-go/transport/http"
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

// TestRefusedReason: what a client is told of a refusal names its kind
// without the keys and paths the full error holds.
func TestRefusedReason(t *testing.T) {
	status := func(code int, err error) error {
		return &awshttp.ResponseError{ResponseError: &smithyhttp.ResponseError{
			Response: &smithyhttp.Response{Response: &http.Response{StatusCode: code}}, Err: err}}
	}
	tests := []struct {
		name string
		err  error
		want string
	}{
		{"S3 refusal", fmt.Errorf("seal wal/0/2: put wal/0/2: %w",
			status(403, &smithy.GenericAPIError{Code: "AccessDenied", Message: "Access Denied."})), "AccessDenied (HTTP 403): Access Denied."},
		{"S3 code alone", &smithy.GenericAPIError{Code: "NoSuchBucket"}, "NoSuchBucket"},
		{"file system", fmt.Errorf("put wal/0/2: %w",
			&fs.PathError{Op: "open", Path: "/data/.picomq-tmp/put-1", Err: syscall.EROFS}), "read-only file system"},
		{"other", errors.New("refused"), "refused"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := &RefusedError{Cause: tt.err}
			if got := e.Reason(); got != tt.want {
				t.Errorf("Reason() = %q, want %q", got, tt.want)
			}
			if !errors.Is(e, tt.err) {
				t.Error("the refusal does not wrap its cause")
			}
		})
	}
}
