package streamstore

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/segment"
)

// Config holds the engine settings. Zero values take the defaults.
type Config struct {
	FlushInterval time.Duration // longest an append waits for its batch to be uploaded
	FlushSize     int           // bytes that start an upload at once
	MaxInFlight   int           // WAL uploads in flight at once
	CacheBytes    int64         // recent-record and block cache budget
	NodeID        string        // identity of this node for the storage lease
}

// Engine owns the streams of one storage location. It knows nothing of HTTP.
type Engine struct {
	store segment.Store
	cfg   Config
	log   *zap.Logger
}

var errNotImplemented = errors.New("not implemented yet")

// New builds an engine over store. It does no I/O; Start opens the storage.
func New(store segment.Store, cfg Config, log *zap.Logger) *Engine {
	return &Engine{store: store, cfg: cfg, log: log}
}

// Start takes the storage lease, checks the format version and replays the
// write-ahead log. It must succeed before any other call.
func (e *Engine) Start(ctx context.Context) error { return errNotImplemented }

// Close flushes pending batches, waits for their uploads and releases the lease.
func (e *Engine) Close(ctx context.Context) error { return nil }

// Create creates the stream name, or confirms an identical existing one.
func (e *Engine) Create(ctx context.Context, name string, req CreateRequest) (info Info, created bool, err error) {
	return Info{}, false, errNotImplemented
}

// Append appends to the stream and returns once the append is durable.
func (e *Engine) Append(ctx context.Context, name string, req AppendRequest) (AppendResult, error) {
	return AppendResult{}, errNotImplemented
}

// Read returns records from req.Seq, bounded by the durable tail. It renews a
// sliding TTL.
func (e *Engine) Read(ctx context.Context, name string, req ReadRequest) (ReadResult, error) {
	return ReadResult{}, errNotImplemented
}

// Head returns the stream's state without renewing its TTL.
func (e *Engine) Head(ctx context.Context, name string) (Info, error) {
	return Info{}, errNotImplemented
}

// Wait blocks until the stream identified by name and id has a durable record
// at seq (NextSeq > seq), is closed, or is deleted or recreated. It returns the
// stream's state then, ctx.Err() when ctx ends first, or ErrShuttingDown when
// the engine closes.
func (e *Engine) Wait(ctx context.Context, name, id string, seq uint64) (Info, error) {
	return Info{}, errNotImplemented
}

// Delete removes the stream; its data leaves the bucket in the background.
func (e *Engine) Delete(ctx context.Context, name string) error { return errNotImplemented }
