package picomq

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/picomq/caddy-picomq/segment"
	"github.com/picomq/caddy-picomq/streamstore"
)

// lostAnswerStore writes every Put whose key holds lose and then answers
// as if its answer was lost: it landed, and the caller cannot know; Gets
// of such a key fail, so that reading it back tells nothing either.
type lostAnswerStore struct {
	segment.Store
	mu   sync.Mutex
	lose string
	puts atomic.Int64 // Puts of a key holding lose
}

func (s *lostAnswerStore) setLose(sub string) {
	s.mu.Lock()
	s.lose = sub
	s.mu.Unlock()
}

func (s *lostAnswerStore) Get(ctx context.Context, key string, offset, length int64) ([]byte, string, error) {
	s.mu.Lock()
	lose := s.lose
	s.mu.Unlock()
	if lose != "" && strings.Contains(key, lose) {
		return nil, "", fmt.Errorf("get %s: connection reset", key)
	}
	return s.Store.Get(ctx, key, offset, length)
}

func (s *lostAnswerStore) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	s.mu.Lock()
	lose := s.lose
	s.mu.Unlock()
	ver, err := s.Store.Put(ctx, key, data, opts)
	if lose != "" && strings.Contains(key, lose) {
		s.puts.Add(1)
		if err == nil {
			return "", fmt.Errorf("put %s: connection reset: %w", key, segment.ErrUnknownOutcome)
		}
	}
	return ver, err
}

// TestDeleteNotConfirmedIsFinished: a subscription whose delete landed
// while the server saw a lost answer is out of service at once (404, an
// append writes nothing of it), a PUT of its id waits and is 503 while the
// delete is not confirmed, and the server finishes the delete once the
// store answers again: the document is gone, a repeated DELETE is 204 and
// a PUT creates the subscription anew. A create whose answer was lost is
// undone the same way.
func TestDeleteNotConfirmedIsFinished(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	inner, err := segment.Open("file://"+dir, segment.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	store := &lostAnswerStore{Store: inner}
	eng := streamstore.New(store, streamstore.Config{NodeID: "test-node", FlushInterval: time.Millisecond}, zaptest.NewLogger(t))
	if err := eng.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = eng.Close(context.Background()) })
	d := &durableStreams{
		engine: func(context.Context) (*streamstore.Engine, error) { return eng, nil }, shutdown: ctx,
		log: zaptest.NewLogger(t), longPollTimeout: 300 * time.Millisecond, sseInterval: time.Second,
		maxAppend: 1 << 20, chunkBytes: dsChunkBytes, jitter: randomJitter, allowLoopback: true,
		subs: loopbackSubManagers(),
	}
	n := &subNode{Server: httptest.NewServer(d), eng: eng}
	t.Cleanup(n.Close)

	const sub = "/v1/stream/__ds/subscriptions/p1"
	const subBody = `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake/pool","lease_ttl_ms":600000}`
	key := subDocKey("/v1/stream/", "p1")
	n.pullSubscribe(t, sub)
	if st, _ := n.call(t, "PUT", "/v1/stream/events/a", `{"n":1}`); st != 201 {
		t.Fatalf("create stream: %d", st)
	}
	// gone fails the test unless the document is a grave (or absent),
	// read past the store's faults.
	gone := func(what string) {
		t.Helper()
		b, _, err := inner.Get(ctx, "subs/"+key, 0, -1)
		if err == nil && !strings.HasPrefix(string(b), `{"grave":`) {
			t.Fatalf("%s: the document is there: %q", what, b)
		}
		if err != nil && !errors.Is(err, segment.ErrNotFound) {
			t.Fatal(err)
		}
	}

	store.setLose(key)
	st, v := n.call(t, "DELETE", sub, "")
	if st != 503 {
		t.Fatalf("delete whose answer was lost: %d %v, want 503", st, v)
	}
	if !strings.Contains(fmt.Sprint(v), "the server goes on deleting it") {
		t.Errorf("delete whose answer was lost: %v does not say the server finishes it", v)
	}
	gone("after the delete landed")
	if st, v := n.call(t, "GET", sub, ""); st != 404 {
		t.Fatalf("GET while the delete is finished: %d %v, want 404", st, v)
	}
	// An append the subscription followed: nothing of it is written (the
	// PUT below waits seconds, and the document is looked at after it).
	before := store.puts.Load()
	if st, _ := n.call(t, "POST", "/v1/stream/events/a", `{"n":2}`); st != 204 {
		t.Fatalf("append: %d", st)
	}
	if st, v := n.call(t, "PUT", sub, subBody); st != 503 {
		t.Fatalf("PUT while the delete is not confirmed: %d %v, want 503", st, v)
	}
	gone("after an append and a PUT while the delete is finished")
	if got := store.puts.Load(); got <= before {
		t.Errorf("no attempt to finish the delete while the PUT waited (%d writes of the document before, %d after)", before, got)
	}
	store.setLose("")
	if st, v := n.call(t, "DELETE", sub, ""); st != 204 {
		t.Fatalf("DELETE once the store answers: %d %v, want 204", st, v)
	}
	gone("after the delete was confirmed")
	if st, v := n.call(t, "PUT", sub, subBody); st != 201 {
		t.Fatalf("PUT after the delete: %d %v, want 201", st, v)
	}

	// A create whose answer was lost is undone: a DELETE of its id waits
	// for that, and the document is gone.
	const sub2 = "/v1/stream/__ds/subscriptions/p2"
	key2 := subDocKey("/v1/stream/", "p2")
	store.setLose(key2)
	if st, v := n.call(t, "PUT", sub2, subBody); st != 503 ||
		!strings.Contains(fmt.Sprint(v), "the server undoes it") {
		t.Fatalf("create whose answer was lost: %d %v", st, v)
	}
	store.setLose("")
	if st, v := n.call(t, "DELETE", sub2, ""); st != 204 {
		t.Fatalf("DELETE of the unconfirmed create: %d %v, want 204", st, v)
	}
	key = key2
	gone("after the DELETE of the unconfirmed create")
}
