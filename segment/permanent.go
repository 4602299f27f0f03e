package segment

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"syscall"

	"github.com/aws/smithy-go"
)

// Permanent reports whether err, from a Store, is a refusal that does not
// pass by itself: the operator must act (remount, fix permissions or
// credentials, free space, create the bucket). Retrying it with backoff
// only holds the client until its timeout, so callers answer at once,
// naming the cause, and leave the retries to the background.
//
// A full disk (ENOSPC, EDQUOT) counts: it may clear (compaction and
// retention delete objects, an operator frees space), but not within an
// append's wait, and a write that could only land after it clears is
// better refused now than answered 503 half a minute later.
func Permanent(err error) bool {
	if err == nil {
		return false
	}
	// A socket's errno (EACCES from a firewall rule, say) is a network
	// fault of the S3 path; Transient judges those.
	// (Not net.Error: a bare syscall.Errno satisfies it.)
	var opErr *net.OpError
	if errors.As(err, &opErr) {
		return false
	}
	for _, errno := range []syscall.Errno{syscall.EROFS, syscall.EACCES, syscall.EPERM, syscall.ENOSPC, syscall.EDQUOT} {
		if errors.Is(err, errno) {
			return true
		}
	}
	switch errorCode(err) {
	case "AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch",
		"NoSuchBucket", "AccountProblem":
		return true
	}
	return httpStatus(err) == http.StatusForbidden
}

// RefusedError is the error of a write the storage refuses in a way that
// does not pass by itself (see Permanent): no write lands until the
// operator acts.
type RefusedError struct {
	// Cause is the storage's refusal.
	Cause error
}

func (e *RefusedError) Error() string { return "storage refuses writes: " + e.Cause.Error() }

// Unwrap returns the storage's refusal.
func (e *RefusedError) Unwrap() error { return e.Cause }

// Reason names the refusal briefly, for a client of the server: the S3
// error code, status and message, or the file system's error, without
// the object keys and paths the full error holds.
func (e *RefusedError) Reason() string {
	var ae smithy.APIError
	if errors.As(e.Cause, &ae) {
		reason := ae.ErrorCode()
		if status := httpStatus(e.Cause); status != 0 {
			reason += fmt.Sprintf(" (HTTP %d)", status)
		}
		if msg := ae.ErrorMessage(); msg != "" {
			reason += ": " + msg
		}
		return reason
	}
	var errno syscall.Errno
	if errors.As(e.Cause, &errno) {
		return errno.Error()
	}
	return e.Cause.Error()
}
