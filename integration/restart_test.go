package integration

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestRestartLoadsStreamsConcurrently SIGKILLs Caddy with 100 streams
// whose appends are still in the WAL, and holds every metadata GET of the
// restart at the S3 proxy: the replay must have at least 8 of them out at
// once (one at a time, a restart after a busy minute on a bucket 25 ms away
// took a minute for 2,000 streams). Released, the node comes up and every
// stream reads back.
func TestRestartLoadsStreamsConcurrently(t *testing.T) {
	const streams = 100
	v := testenv.NewVersity(t)
	p := newProxy(t, v)
	storage := caddytest.S3Storage(t, v, p.URL())
	// A held GET must not time out and come again as a second one.
	c := caddytest.Start(t, caddyOptions(v, storage, "compact_interval 1h", "s3_timeout 2m"))
	cl := newClient(t, c.URL(), true)

	fillNamed(t, cl, "/restart/s%03d", streams)
	c.Kill()

	release := p.Hold(testenv.Fault{Op: "GET", KeyContains: "/streams/"})
	released := false
	defer func() {
		if !released {
			release()
		}
	}()
	began := time.Now()
	restarted := make(chan error, 1)
	go func() { restarted <- c.TryRestart() }()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := p.WaitHeld(ctx, 8); err != nil {
		t.Fatalf("the restart had at most %d metadata GETs out at once within 30 s; want 8 or more", p.Held())
	}
	t.Logf("%d metadata GETs held at once %v into the restart", p.Held(), time.Since(began).Round(time.Millisecond))
	release()
	released = true
	if err := <-restarted; err != nil {
		t.Fatalf("restart: %v", err)
	}
	if err := waitServing(c, time.Minute); err != nil {
		t.Fatal(err)
	}
	t.Logf("restart with %d streams to replay: %v", streams, time.Since(began).Round(time.Millisecond))
	for i := range streams {
		name := fmt.Sprintf("/restart/s%03d", i)
		got, _, err := cl.readAll(name, 30*time.Second)
		if err != nil {
			t.Fatalf("read %s after the restart: %v", name, err)
		}
		if string(got) != name {
			t.Fatalf("%s after the restart: %q, want %q", name, got, name)
		}
	}
}

// TestCompactionFoldsStreamsConcurrently holds every data object PUT of a
// compaction of 64 streams at the S3 proxy: at least 16 must be out at
// once. A few at a time, compaction of a thousand busy streams on a bucket
// 25 ms away fell behind for good and the WAL grew without bound.
func TestCompactionFoldsStreamsConcurrently(t *testing.T) {
	const streams = 64
	v := testenv.NewVersity(t)
	p := newProxy(t, v)
	storage := caddytest.S3Storage(t, v, p.URL())
	// A held PUT must not time out and come again as a second one. No
	// packs: these 64 small streams would go into one, and leave it only
	// when idle, 4 at a time (their records are safe in the pack).
	c := caddytest.Start(t, caddyOptions(v, storage, "compact_interval 2s", "s3_timeout 2m", "pack_below off"))
	cl := newClient(t, c.URL(), true)

	release := p.Hold(testenv.Fault{Op: "PUT", KeyContains: "/data/"})
	released := false
	defer func() {
		if !released {
			release()
		}
	}()
	fillNamed(t, cl, "/fold/s%03d", streams)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := p.WaitHeld(ctx, 16); err != nil {
		t.Fatalf("compaction had at most %d data object PUTs out at once within 30 s; want 16 or more", p.Held())
	}
	t.Logf("%d data object PUTs held at once", p.Held())
	release()
	released = true
	for i := range streams {
		name := fmt.Sprintf("/fold/s%03d", i)
		got, _, err := cl.readAll(name, 30*time.Second)
		if err != nil || string(got) != name {
			t.Fatalf("%s after compaction: %q, %v", name, got, err)
		}
	}
}

// fillNamed creates n text streams named by format (one %d verb) and
// appends each its own name, all at once.
func fillNamed(t *testing.T, cl *dsClient, format string, n int) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			name := fmt.Sprintf(format, i)
			if err := cl.tryCreate(name, 30*time.Second); err != nil {
				errs <- err
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancel()
			r, err := cl.appendBody(ctx, name, []byte(name))
			if err == nil && r.status/100 != 2 {
				err = fmt.Errorf("append to %s: %s", name, r)
			}
			if err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}
