// Package segment is PicoMQ's object-storage layer: the Store interface with
// its S3 and local-directory backends, and the write-ahead log, data objects,
// compaction and recovery built on top of it.
package segment

import (
	"context"
	"errors"
)

// ErrNotFound is returned by Get when the key does not exist.
var ErrNotFound = errors.New("object not found")

// ErrPreconditionFailed is returned by Put when an IfNoneMatch or IfMatch
// condition does not hold. Nothing was written.
var ErrPreconditionFailed = errors.New("precondition failed")

// PutOptions are the conditions of a Put. The zero value is an unconditional
// overwrite.
type PutOptions struct {
	// IfNoneMatch makes the Put create-only: it fails with
	// ErrPreconditionFailed when the key already exists.
	IfNoneMatch bool
	// IfMatch, when not empty, makes the Put a compare-and-swap: it fails with
	// ErrPreconditionFailed unless the object's current ETag equals it.
	IfMatch string
}

// ObjectInfo describes one object in a listing.
type ObjectInfo struct {
	Key  string
	Size int64
	ETag string
}

// BufferGetter is a Store that can read a whole object into a buffer its
// caller supplies: alloc(n) returns a slice of length n, n being the
// object's size, and GetBuffer returns it filled (or, when the size was not
// known ahead, a slice of its own). A reader that recycles its buffers
// reads objects without growing the heap by their size each time.
type BufferGetter interface {
	GetBuffer(ctx context.Context, key string, alloc func(n int) []byte) ([]byte, error)
}

// Store is the small subset of S3 that PicoMQ relies on. Implementations must
// be safe for concurrent use. Keys are '/'-separated; no key is ever both an
// object and the prefix-with-slash of another, no path component exceeds 255
// bytes and no key exceeds 1,024 bytes.
type Store interface {
	// Put writes data under key, subject to opts, and returns the new ETag.
	Put(ctx context.Context, key string, data []byte, opts PutOptions) (etag string, err error)
	// Get reads length bytes from offset; length < 0 reads to the end.
	// It returns ErrNotFound for a missing key. A range past the end of the
	// object returns the bytes that exist (possibly none).
	Get(ctx context.Context, key string, offset, length int64) (data []byte, etag string, err error)
	// List returns up to max keys that start with prefix and sort after
	// startAfter, in byte order, and whether more remain.
	List(ctx context.Context, prefix, startAfter string, max int) (objects []ObjectInfo, more bool, err error)
	// Delete removes keys; keys that do not exist are not an error.
	Delete(ctx context.Context, keys []string) error
	// DeleteIfMatch removes key only while its ETag is etag, so a delete
	// that arrives late cannot take a newer object under the same key
	// with it. It fails with ErrPreconditionFailed, removing nothing, when
	// key holds another version; a missing key is not an error.
	DeleteIfMatch(ctx context.Context, key, etag string) error
}
