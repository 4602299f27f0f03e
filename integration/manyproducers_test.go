package integration

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"
)

// TestManyProducersSurviveRestarts appends from a few thousand producer
// ids to one stream, then restarts Caddy on the same bucket, after a crash
// (the state comes back from the WAL) and then gracefully: every producer's
// progress must still be there (the protocol keeps producer state as long
// as the stream's data), so an early producer's retry is answered 204 as a
// duplicate, a stale epoch 403, and a producer's next seq is taken.
func TestManyProducersSurviveRestarts(t *testing.T) {
	const (
		name      = "/producers/many"
		producers = 3000
		workers   = 48
	)
	_, _, c, cl := startWithStream(t, name)
	id := func(i int) string { return fmt.Sprintf("device-%05d", i) }
	send := func(ctx context.Context, producer string, epoch, seq int) (*response, error) {
		hdr := http.Header{
			"Content-Type":   {textPlain},
			"Producer-Id":    {producer},
			"Producer-Epoch": {strconv.Itoa(epoch)},
			"Producer-Seq":   {strconv.Itoa(seq)},
		}
		return cl.do(ctx, http.MethodPost, name, "", hdr, []byte(fmt.Sprintf("%s %d %d\n", producer, epoch, seq)))
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	began := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			for i := w; i < producers; i += workers {
				r, err := send(ctx, id(i), 0, 0)
				if err == nil && r.status != http.StatusOK {
					err = fmt.Errorf("%s", r)
				}
				if err != nil {
					errs <- fmt.Errorf("%s seq 0: %w", id(i), err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	t.Logf("%d producers appended in %v", producers, time.Since(began).Round(time.Millisecond))
	// device-00001 moves to epoch 1: epoch 0 is stale from now on.
	if r, err := send(ctx, id(1), 1, 0); err != nil || r.status != http.StatusOK {
		t.Fatalf("%s epoch 1 seq 0: %v %v", id(1), r, err)
	}

	lines := producers + 1
	for _, restart := range []struct {
		how  string
		next int // the seq device-00002 takes after this restart
	}{
		{"a crash", 1},
		{"a graceful restart", 2},
	} {
		if restart.how == "a crash" {
			c.Kill()
		}
		restarted := time.Now()
		c.Restart()
		if err := waitServing(c, time.Minute); err != nil {
			t.Fatal(err)
		}
		t.Logf("back after %s in %v", restart.how, time.Since(restarted).Round(time.Millisecond))
		checks := []struct {
			what         string
			producer     string
			epoch, seq   int
			status       int
			epochHdr     string
			seqHdr       string
			appendsLines bool
		}{
			{"an early producer's retry", id(0), 0, 0, http.StatusNoContent, "0", "0", false},
			{"the last producer's retry", id(producers - 1), 0, 0, http.StatusNoContent, "0", "0", false},
			{"the fenced producer at its stale epoch", id(1), 0, 1, http.StatusForbidden, "1", "", false},
			{"the fenced producer's retry at its epoch", id(1), 1, 0, http.StatusNoContent, "1", "0", false},
			{"a producer's next seq", id(2), 0, restart.next, http.StatusOK, "0", strconv.Itoa(restart.next), true},
		}
		for _, ck := range checks {
			r, err := send(ctx, ck.producer, ck.epoch, ck.seq)
			if err != nil {
				t.Fatalf("after %s, %s (%s epoch %d seq %d): %v", restart.how, ck.what, ck.producer, ck.epoch, ck.seq, err)
			}
			if r.status != ck.status || r.header.Get("Producer-Epoch") != ck.epochHdr || r.header.Get("Producer-Seq") != ck.seqHdr {
				t.Fatalf("after %s, %s (%s epoch %d seq %d): %s, Producer-Epoch %q, Producer-Seq %q; want %d, %q, %q",
					restart.how, ck.what, ck.producer, ck.epoch, ck.seq, r,
					r.header.Get("Producer-Epoch"), r.header.Get("Producer-Seq"), ck.status, ck.epochHdr, ck.seqHdr)
			}
			if ck.appendsLines {
				lines++
			}
		}
		got, _, err := cl.readAll(name, 30*time.Second)
		if err != nil {
			t.Fatalf("read after %s: %v", restart.how, err)
		}
		if n := bytes.Count(got, []byte("\n")); n != lines {
			t.Fatalf("after %s the stream holds %d appends, want %d", restart.how, n, lines)
		}
	}
}
