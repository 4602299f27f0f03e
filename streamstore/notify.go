package streamstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/segment"
)

// AppendHook is told about records that became durable: the stream's name,
// its id (fresh at every create, so a stream deleted and created again
// under the name has another one), the seq of the first new record and the
// stream's next seq after them. It is called on the WAL commit path, in
// commit order and with the stream's lock held, so it must not block (hand
// the work to another goroutine) and must not call the engine. No call
// for a stream comes after the DeleteHook call for it.
type AppendHook func(name, streamID string, firstSeq, nextSeq uint64)

// DeleteHook is told that a stream was deleted for clients (by a request
// or because it expired): its name and id. Every AppendHook call for that
// stream came before. The same rules as for AppendHook apply.
type DeleteHook func(name, streamID string)

// OnAppend registers fn as the engine's append hook, replacing any earlier
// one; nil removes it. See AppendHook for what fn may do.
func (e *Engine) OnAppend(fn AppendHook) {
	if fn == nil {
		e.appendHook.Store(nil)
		return
	}
	e.appendHook.Store(&fn)
}

// OnDelete registers fn as the engine's delete hook, replacing any earlier
// one; nil removes it. See DeleteHook for what fn may do.
func (e *Engine) OnDelete(fn DeleteHook) {
	if fn == nil {
		e.deleteHook.Store(nil)
		return
	}
	e.deleteHook.Store(&fn)
}

// appended is called by the commit hook once an entry is durable, with
// s.mu held: an entry that commits after its stream was deleted (it was
// on its way when the delete came) is not announced, and one that is,
// is announced before the delete is (deleted, below, runs after the
// stream is marked gone under s.mu).
func (e *Engine) appended(s *stream, ent *segment.Entry) {
	if len(ent.Records) == 0 || s.gone || s.meta.Deleted {
		return
	}
	if fn := e.appendHook.Load(); fn != nil {
		(*fn)(ent.Name, ent.StreamID, ent.FirstSeq, ent.EndSeq())
	}
}

// deleted tells the delete hook that the stream name with id is gone.
func (e *Engine) deleted(name, id string) {
	if fn := e.deleteHook.Load(); fn != nil {
		(*fn)(name, id)
	}
}

// Done is closed when the engine begins to close; background work tied to
// the engine ends then.
func (e *Engine) Done() <-chan struct{} { return e.closing }

// docPrefix is where small documents that are not streams (subscription
// state, keys) live in the bucket.
const docPrefix = "subs/"

// ErrDocConflict is returned by PutDoc when the document changed (or exists,
// or is gone) since the version the caller read.
var ErrDocConflict = segment.ErrPreconditionFailed

// DocObjectKey is the object key document key is stored under, for
// messages that name it to an operator.
func DocObjectKey(key string) string { return docPrefix + key }

func docKey(key string) (string, error) {
	if key == "" || strings.Contains(key, "..") || strings.HasPrefix(key, "/") || len(key) > 600 {
		return "", fmt.Errorf("%w: bad document key %q", ErrBadRequest, key)
	}
	return docPrefix + key, nil
}

// GetDoc reads the document stored under subs/KEY and its version.
// A missing document returns ErrNotFound, and so does a deleted one: its
// grave, which GetDoc removes once it is GraveTime old (the collector
// does too, through the grave index).
func (e *Engine) GetDoc(ctx context.Context, key string) ([]byte, string, error) {
	k, err := docKey(key)
	if err != nil {
		return nil, "", err
	}
	data, etag, err := e.store.Get(ctx, k, 0, -1)
	if err == segment.ErrNotFound {
		return nil, "", ErrNotFound
	}
	if err != nil {
		return nil, "", err
	}
	if g, ok := decodeGrave(data); ok {
		if e.checkLease() == nil {
			// Best effort: a grave left behind is read and tried again.
			_, _ = e.dropGraveIfDue(ctx, k, etag, g)
		}
		return nil, "", ErrNotFound
	}
	return data, etag, nil
}

// mayWrite refuses a document write while the storage is not certainly
// this process's: its lease lapsed, or another process took it over.
func (e *Engine) mayWrite() error {
	if _, err := e.writer(); err != nil {
		return err // not started: there is no lease yet
	}
	if err := e.fenced(); err != nil {
		return fmt.Errorf("%w: %w: %v", ErrUnavailable, ErrTakenOver, err)
	}
	if err := e.checkLease(); err != nil {
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	return nil
}

// ConfirmOwner reads the storage lease and checks that it is still this
// process's (one GET), fencing the engine if another process took it:
// for a caller about to write over a document version it did not write,
// which only a process that took the storage over can have written.
func (e *Engine) ConfirmOwner(ctx context.Context) error {
	if err := e.confirmOwner(ctx); err != nil {
		if errors.Is(err, segment.ErrFenced) {
			return fmt.Errorf("%w: %w: %v", ErrUnavailable, ErrTakenOver, err)
		}
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	return nil
}

// PutDoc writes a document with compare-and-swap: version "" creates it
// only if absent (or deleted: over its grave), any other version replaces
// it only if it is still that version. It returns the new version, or
// ErrDocConflict.
func (e *Engine) PutDoc(ctx context.Context, key string, data []byte, version string) (string, error) {
	k, err := docKey(key)
	if err != nil {
		return "", err
	}
	if err := e.mayWrite(); err != nil {
		return "", err
	}
	var ver string
	if version == "" {
		ver, err = e.putOverGrave(ctx, k, data)
	} else {
		ver, err = e.store.Put(ctx, k, data, segment.PutOptions{IfMatch: version})
	}
	return ver, docWriteError(err)
}

// docWriteError is err, a document write's failure, as ErrUnavailable:
// with ErrUnconfirmed when the write may still have landed (an attempt
// timed out, lost its answer or got a 5xx, and no later one settled it),
// and with a refusal of the storage's that needs the operator kept as one
// (a segment.RefusedError, which StorageRefusal names), for the answer to
// say which. ErrDocConflict stays as it is.
func docWriteError(err error) error {
	switch {
	case err == nil, errors.Is(err, ErrDocConflict):
		return err
	case errors.Is(err, segment.ErrUnknownOutcome):
		return fmt.Errorf("%w: %w: %w", ErrUnavailable, ErrUnconfirmed, storeCause(err))
	}
	return fmt.Errorf("%w: %w", ErrUnavailable, storeCause(err))
}

// DeleteDoc replaces a document with a grave while it is still version:
// a delete held up on its way and landing late cannot touch a document
// written under the key after it, and a create held up on its way fails
// against the grave instead of bringing the document back. Another
// version, a grave or no document at all is ErrDocConflict: the caller
// reads the key to tell them apart.
func (e *Engine) DeleteDoc(ctx context.Context, key, version string) error {
	k, err := docKey(key)
	if err != nil {
		return err
	}
	if err := e.mayWrite(); err != nil {
		return err
	}
	now := time.Now()
	if _, err := e.store.Put(ctx, k, encodeGrave("", now), segment.PutOptions{IfMatch: version}); err != nil {
		return docWriteError(err)
	}
	// Best effort: a grave the index misses is removed when it is read,
	// at the latest at the next start.
	due := now.Add(e.config().GraveTime)
	if _, err := e.store.Put(ctx, graveIndexKey(due, docGraveID+newID()), []byte(k), segment.PutOptions{}); err != nil {
		e.log.Warn("indexing a deleted document's grave failed; it goes when next read", zap.String("key", k), zap.Error(err))
	}
	e.kickGC() // so that the collector knows when it is due
	return nil
}

// docGraveID starts the id of a document grave's index entry, whose body
// is the document's object key (a stream's entry has the stream's id and
// its name). A document's grave itself names no id.
const docGraveID = "doc."

// ListDocs returns the keys (without the subs/ prefix) of every document
// whose key starts with prefix, deleted ones' graves included (GetDoc
// answers ErrNotFound for those).
func (e *Engine) ListDocs(ctx context.Context, prefix string) ([]string, error) {
	var keys []string
	after := ""
	for {
		objs, more, err := e.store.List(ctx, docPrefix+prefix, after, 1000)
		if err != nil {
			return nil, err
		}
		for _, o := range objs {
			keys = append(keys, strings.TrimPrefix(o.Key, docPrefix))
			after = o.Key
		}
		if !more || len(objs) == 0 {
			return keys, nil
		}
	}
}
