package segment_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// lostAnswers is a store whose next PUTs of one key land but answer with
// an error, as when the connection resets after the request went out.
type lostAnswers struct {
	segment.Store
	mu   sync.Mutex
	key  string
	lose int
}

func (s *lostAnswers) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	etag, err := s.Store.Put(ctx, key, data, opts)
	s.mu.Lock()
	defer s.mu.Unlock()
	if err == nil && key == s.key && s.lose > 0 {
		s.lose--
		return "", errors.New("connection reset by peer")
	}
	return etag, err
}

func (s *lostAnswers) loseNext(key string, n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.key, s.lose = key, n
}

// A lease write whose answer was lost has still landed: the holder must
// see its own write in the lease, not another node's takeover. A write by
// another holder, even under the same node name (a copied data
// directory), is a takeover.
func TestLeaseSurvivesItsOwnLostWrite(t *testing.T) {
	ctx := context.Background()
	store := &lostAnswers{Store: memstore.New()}
	const ttl = 30 * time.Second
	l, err := segment.AcquireLease(ctx, store, "node-a", ttl)
	if err != nil {
		t.Fatal(err)
	}

	time.Sleep(2 * time.Millisecond) // a later expiry: other bytes, another ETag
	store.loseNext("lease", 1)
	if err := l.Renew(ctx); err == nil || errors.Is(err, segment.ErrFenced) {
		t.Fatalf("renew with its answer lost: %v, want a plain error", err)
	}
	if err := l.Confirm(ctx); err != nil || !l.Valid() {
		t.Fatalf("confirm after our own write landed unanswered: %v (valid %v)", err, l.Valid())
	}
	store.loseNext("lease", 1)
	l.Renew(ctx)
	if err := l.Renew(ctx); err != nil {
		t.Fatalf("renew after a lost answer: %v", err)
	}
	if !l.Valid() {
		t.Fatal("the renewed lease is not valid")
	}

	// Another process under the same node name takes the lease over (it
	// may: the node's own restart takes it back at once). The first one
	// must stop.
	other, err := segment.AcquireLease(ctx, store, "node-a", ttl)
	if err != nil {
		t.Fatalf("the same node taking its lease back: %v", err)
	}
	if err := l.Confirm(ctx); !errors.Is(err, segment.ErrFenced) {
		t.Errorf("confirm after a takeover: %v, want ErrFenced", err)
	}
	if err := l.Renew(ctx); !errors.Is(err, segment.ErrFenced) || !strings.Contains(err.Error(), "precondition") {
		t.Errorf("renew after a takeover: %v, want ErrFenced", err)
	}
	if err := other.Renew(ctx); err != nil {
		t.Errorf("the new holder's renew: %v", err)
	}
	// The replaced holder has nothing to give up, and says why; the new
	// holder keeps the lease.
	if err := l.Release(ctx); !errors.Is(err, segment.ErrFenced) {
		t.Errorf("release after a takeover: %v, want ErrFenced", err)
	}
	if err := other.Renew(ctx); err != nil {
		t.Errorf("the new holder's renew after the replaced one's release: %v", err)
	}
}

// Giving the lease up after a write whose answer was lost still lets
// another node take it at once.
func TestLeaseReleaseAfterLostWrite(t *testing.T) {
	ctx := context.Background()
	store := &lostAnswers{Store: memstore.New()}
	l, err := segment.AcquireLease(ctx, store, "node-a", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	// A later expiry, so the lost write's bytes (and ETag) differ.
	time.Sleep(2 * time.Millisecond)
	store.loseNext("lease", 1)
	if err := l.Renew(ctx); err == nil {
		t.Fatal("renew with its answer lost succeeded")
	}
	if err := l.Release(ctx); err != nil {
		t.Fatalf("release: %v", err)
	}
	if l.Valid() {
		t.Error("the lease is still valid after its release")
	}
	if _, err := segment.AcquireLease(ctx, store, "node-b", time.Minute); err != nil {
		t.Errorf("another node after the release: %v", err)
	}
}

// With NotFromThisProcess, a lease a live Lease of this process holds is
// refused rather than taken over, as a restart of the node takes it: one
// process's two engines on one storage would fence each other. Once it is
// released or abandoned (a start that failed after taking it), it is taken.
// Without the option, or from another process, the node takes it at once.
func TestLeaseNotTakenFromThisProcess(t *testing.T) {
	ctx := context.Background()
	store := memstore.New()
	here := segment.LeaseOptions{NotFromThisProcess: true}
	first, err := segment.AcquireLeaseWith(ctx, store, "node-a", time.Minute, here)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := segment.AcquireLeaseWith(ctx, store, "node-a", time.Minute, here); !errors.Is(err, segment.ErrLeaseHeldHere) {
		t.Fatalf("a second lease of this process while the first is live: %v, want ErrLeaseHeldHere", err)
	}
	if err := first.Renew(ctx); err != nil {
		t.Errorf("the first lease after the refused takeover: %v", err)
	}

	first.Abandon()
	second, err := segment.AcquireLeaseWith(ctx, store, "node-a", time.Minute, here)
	if err != nil {
		t.Fatalf("after the first was abandoned: %v", err)
	}
	if err := second.Release(ctx); err != nil {
		t.Fatal(err)
	}
	third, err := segment.AcquireLeaseWith(ctx, store, "node-a", time.Minute, here)
	if err != nil {
		t.Fatalf("after the second was released: %v", err)
	}
	// Without the option: a restart played in one process.
	if _, err := segment.AcquireLease(ctx, store, "node-a", time.Minute); err != nil {
		t.Errorf("without NotFromThisProcess: %v", err)
	}
	third.Abandon()
}
