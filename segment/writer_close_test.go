package segment

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// lateStore answers its first PUT only once the writer's context has
// ended and its uploaders refuse work: an upload already sent, whose
// success comes back while Close stops the writer. Every later PUT waits
// for gate, and all are recorded with whether Close had returned.
type lateStore struct {
	w        *Writer
	closed   *atomic.Bool
	first    chan struct{} // closed when the first PUT has begun
	gate     chan struct{}
	mu       sync.Mutex
	puts     int
	putsLate []string // keys PUT after Close returned
}

func (s *lateStore) Put(ctx context.Context, key string, _ []byte, _ PutOptions) (string, error) {
	s.mu.Lock()
	s.puts++
	n := s.puts
	s.mu.Unlock()
	if n == 1 {
		close(s.first)
		<-ctx.Done()
		for s.w.uploaders.Go(func() {}) {
			runtime.Gosched()
		}
		return "etag", nil
	}
	<-s.gate
	if s.closed.Load() {
		s.mu.Lock()
		s.putsLate = append(s.putsLate, key)
		s.mu.Unlock()
	}
	return "", ctx.Err()
}

func (s *lateStore) Get(context.Context, string, int64, int64) ([]byte, string, error) {
	return nil, "", ErrNotFound
}

func (s *lateStore) List(context.Context, string, string, int) ([]ObjectInfo, bool, error) {
	return nil, false, nil
}
func (s *lateStore) Delete(context.Context, []string) error              { return nil }
func (s *lateStore) DeleteIfMatch(context.Context, string, string) error { return nil }

// closeHooks records the hook calls made after Close returned.
type closeHooks struct {
	closed *atomic.Bool
	late   atomic.Int32
}

func (h *closeHooks) Committed(*Batch) {
	if h.closed.Load() {
		h.late.Add(1)
	}
}

func (h *closeHooks) Aborted(*Batch, error) {
	if h.closed.Load() {
		h.late.Add(1)
	}
}

// TestWriterCloseLeavesNoUpload: when Close gives up waiting while an
// upload is in flight and a batch waits for its slot, the upload's
// success (arriving as the uploaders stop) does not start the waiting
// batch on a goroutine of its own. That goroutine called the store and
// the owner's hooks after Close had returned, when the engine owning the
// writer had closed. The batch is settled before Close returns instead:
// aborted, never uploaded.
func TestWriterCloseLeavesNoUpload(t *testing.T) {
	var closed atomic.Bool
	st := &lateStore{closed: &closed, first: make(chan struct{}), gate: make(chan struct{})}
	hooks := &closeHooks{closed: &closed}
	w := NewWriter(st, 1, 0, WriterConfig{FlushInterval: time.Millisecond, MaxInFlight: 1}, WriterDeps{Hooks: hooks})
	st.w = w
	entry := func(seq uint64) *Entry {
		return &Entry{StreamID: "s", Name: "s", FirstSeq: seq, Records: []Record{{Seq: seq, Body: []byte("x")}}}
	}
	first, err := w.Add(entry(0))
	if err != nil {
		t.Fatal(err)
	}
	w.Flush()
	<-st.first
	waiting, err := w.Add(entry(1))
	if err != nil {
		t.Fatal(err)
	}
	if waiting == first {
		t.Fatal("the second entry joined the batch already uploading")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // Close gives up at once
	if err := w.Close(ctx); err == nil {
		t.Fatal("Close with an upload in flight and its context ended reported no error")
	}
	closed.Store(true)
	close(st.gate)
	select {
	case <-waiting.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the batch waiting for a slot at Close was never settled")
	}
	if waiting.Err() == nil {
		t.Error("the batch that was never uploaded committed")
	}
	if !waiting.Lost() {
		t.Errorf("the batch that Close left no upload to is not known lost: %v", waiting.Err())
	}
	if n := hooks.late.Load(); n != 0 {
		t.Errorf("%d hook calls after Close returned", n)
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if len(st.putsLate) > 0 {
		t.Errorf("PUTs after Close returned: %v", st.putsLate)
	}
}
