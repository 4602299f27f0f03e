package integration

import (
	"bytes"
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
)

// TestFileStorageSameNodeTakeover: on the embedded file:// storage, a
// second process of the same node (same data directory, same storage
// directory) starts while the first still runs, as a restart whose old
// process has not exited yet does. The second takes the storage over at
// once; whatever either process acknowledges must be readable from the
// second, as on S3: the two share the directory's compare-and-swap, which
// holds across processes.
func TestFileStorageSameNodeTakeover(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy")
	}
	const name = "/takeover/file"
	storage := "file://" + filepath.Join(t.TempDir(), "store")
	a := caddytest.Start(t, caddytest.Options{Storage: storage})
	ca := newClient(t, a.URL(), false)
	ca.create(t, name, 30*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	acked := [][]byte{[]byte("before\n")}
	if r, err := ca.appendBody(ctx, name, acked[0]); err != nil || r.status/100 != 2 {
		t.Fatalf("append to the first process: %v %v", r, err)
	}

	b, err := caddytest.Launch(t, caddytest.Options{Storage: storage, DataDir: a.DataDir()})
	if err == nil {
		err = waitServing(b, 30*time.Second)
	}
	if err != nil {
		t.Fatalf("second process of the same node: %v", err)
	}
	cb := newClient(t, b.URL(), false)

	// Both processes take appends for a while; the first is fenced from
	// the storage at some point, and what it acknowledged before that
	// counts as much as what the second acknowledges.
	deadline := time.Now().Add(3 * time.Second)
	for i := 0; time.Now().Before(deadline); i++ {
		for _, c := range []struct {
			who    string
			client *dsClient
		}{{"a", ca}, {"b", cb}} {
			body := fmt.Appendf(nil, "%s-%d\n", c.who, i)
			r, err := c.client.appendBody(ctx, name, body)
			if err == nil && r.status/100 == 2 {
				acked = append(acked, body)
			}
		}
	}
	got, _, err := cb.readAll(name, 30*time.Second)
	if err != nil {
		t.Fatalf("read from the second process: %v", err)
	}
	if !bytes.HasPrefix(got, acked[0]) {
		t.Fatalf("the second process reads %q, want it to begin with %q", truncate(string(got), 300), acked[0])
	}
	fromB := 0
	for _, body := range acked {
		if !bytes.Contains(got, body) {
			t.Errorf("%q was acknowledged, and the second process does not have it", body)
		}
		if bytes.HasPrefix(body, []byte("b-")) {
			fromB++
		}
	}
	if fromB == 0 {
		t.Errorf("the second process acknowledged no append: it did not take the storage over")
	}
	t.Logf("%d appends acknowledged after the takeover began, %d of them by the second process", len(acked)-1, fromB)
}
