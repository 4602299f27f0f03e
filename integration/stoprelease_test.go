package integration

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
)

// TestStopReleasesTheLease stops Caddy gracefully (SIGTERM) and starts
// another node (its own data directory, so another node id) on the same
// storage at once: the stopped process gave its lease up, so the other
// node must not be refused nor wait for the lease to expire, and it must
// serve what the first acknowledged.
func TestStopReleasesTheLease(t *testing.T) {
	const name = "/handover/s"
	v, storage, a, cl := startWithStream(t, name, "flush_interval 10ms")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if r, err := cl.appendBody(ctx, name, []byte("from a\n")); err != nil || r.status/100 != 2 {
		t.Fatalf("append: %v %v", r, err)
	}
	if err := a.Stop(); err != nil {
		t.Fatalf("stopping the first node: %v", err)
	}
	if !strings.Contains(a.Logs(), `"msg":"storage closed"`) {
		t.Errorf("the first node's log does not say it closed the storage")
	}

	b, err := caddytest.Launch(t, caddyOptions(v, storage, "flush_interval 10ms"))
	if err == nil {
		err = waitServing(b, 30*time.Second)
	}
	if err != nil {
		t.Fatalf("another node starting after a graceful stop: %v", err)
	}
	bcl := newClient(t, b.URL(), true)
	if r, err := bcl.appendBody(ctx, name, []byte("from b\n")); err != nil || r.status/100 != 2 {
		t.Fatalf("append on the other node: %v %v", r, err)
	}
	if got, _, err := bcl.readAll(name, 30*time.Second); err != nil || string(got) != "from a\nfrom b\n" {
		t.Errorf("the other node reads %q (%v), want %q", got, err, "from a\nfrom b\n")
	}
}
