// Package memstore is an in-memory segment.Store for unit tests of pure
// logic. It is never the proof that a feature works: integration tests run
// against versitygw.
package memstore

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"sort"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/picomq/caddy-picomq/segment"
)

// Store keeps objects in a map. A hook set with SetFail is consulted before
// every operation and may return an error to inject a fault.
type Store struct {
	mu   sync.Mutex
	objs map[string][]byte
	// failHook is read by the engine's background goroutines while a test
	// swaps it.
	failHook atomic.Pointer[func(op, key string) error]
}

// SetFail makes f decide, before every operation, whether it fails (a
// non-nil error) or goes ahead; nil removes the hook. Safe while the store
// is in use.
func (m *Store) SetFail(f func(op, key string) error) {
	if f == nil {
		m.failHook.Store(nil)
		return
	}
	m.failHook.Store(&f)
}

// New returns an empty store.
func New() *Store { return &Store{objs: map[string][]byte{}} }

func etagOf(b []byte) string {
	s := md5.Sum(b)
	return `"` + hex.EncodeToString(s[:]) + `"`
}

func (m *Store) fail(op, key string) error {
	if f := m.failHook.Load(); f != nil {
		return (*f)(op, key)
	}
	return nil
}

// Put implements segment.Store.
func (m *Store) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	if err := m.fail("PUT", key); err != nil {
		return "", err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	cur, exists := m.objs[key]
	if opts.IfNoneMatch && exists {
		return "", segment.ErrPreconditionFailed
	}
	if opts.IfMatch != "" && (!exists || etagOf(cur) != opts.IfMatch) {
		return "", segment.ErrPreconditionFailed
	}
	m.objs[key] = append([]byte(nil), data...)
	return etagOf(data), nil
}

// Get implements segment.Store.
func (m *Store) Get(ctx context.Context, key string, off, n int64) ([]byte, string, error) {
	if err := m.fail("GET", key); err != nil {
		return nil, "", err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	b, ok := m.objs[key]
	if !ok {
		return nil, "", segment.ErrNotFound
	}
	off = min(off, int64(len(b)))
	end := int64(len(b))
	if n >= 0 {
		end = min(end, off+n)
	}
	return append([]byte(nil), b[off:end]...), etagOf(b), nil
}

// List implements segment.Store.
func (m *Store) List(ctx context.Context, prefix, after string, max int) ([]segment.ObjectInfo, bool, error) {
	if err := m.fail("LIST", prefix); err != nil {
		return nil, false, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var keys []string
	for k := range m.objs {
		if strings.HasPrefix(k, prefix) && k > after {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	more := len(keys) > max
	if more {
		keys = keys[:max]
	}
	out := make([]segment.ObjectInfo, len(keys))
	for i, k := range keys {
		out[i] = segment.ObjectInfo{Key: k, Size: int64(len(m.objs[k])), ETag: etagOf(m.objs[k])}
	}
	return out, more, nil
}

// Delete implements segment.Store.
func (m *Store) Delete(ctx context.Context, keys []string) error {
	for _, k := range keys {
		if err := m.fail("DELETE", k); err != nil {
			return err
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, k := range keys {
		delete(m.objs, k)
	}
	return nil
}

// DeleteIfMatch implements segment.Store.
func (m *Store) DeleteIfMatch(ctx context.Context, key, etag string) error {
	if err := m.fail("DELETE", key); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	cur, ok := m.objs[key]
	if !ok {
		return nil
	}
	if etagOf(cur) != etag {
		return segment.ErrPreconditionFailed
	}
	delete(m.objs, key)
	return nil
}

// Keys returns every key under prefix, sorted.
func (m *Store) Keys(prefix string) []string {
	objs, _, _ := m.List(context.Background(), prefix, "", 1<<30)
	out := make([]string, len(objs))
	for i, o := range objs {
		out[i] = o.Key
	}
	return out
}
