package integration

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestCompactionBehindReadsEachWALObjectOnce: a compaction held up at the
// bucket while appends go on leaves a backlog far larger than the cache.
// Once the bucket answers again, compaction catches up reading back what
// the cache lost a WAL object at a time: each WAL object is read at most
// once, however many streams have entries in it (read stream by stream,
// it cost a GET per entry, and a node behind on many busy streams never
// caught up). Every stream then reads back byte-exact.
func TestCompactionBehindReadsEachWALObjectOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"cache_size 256KiB", "compact_interval 1s"}})
	const ct = "application/octet-stream"
	const streams, rounds = 30, 30
	paths := make([]string, streams)
	for i := range paths {
		paths[i] = fmt.Sprintf("/behind/s%02d", i)
		e.create(paths[i], ct)
	}

	// Compaction's writes wait at the proxy: the first compaction takes
	// the backlog so far and stops at its first PUT, and the appends after
	// it pile up in the WAL, far past the 256 KiB cache.
	releasePacks := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "pack/"})
	releaseData := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "data/"})
	released := false
	release := func() {
		if !released {
			released = true
			releasePacks()
			releaseData()
		}
	}
	defer release()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	written := make([][][]byte, streams)
	for round := range rounds {
		var wg sync.WaitGroup
		for i, path := range paths {
			body := fhRandomRecords(uint64(round*streams+i+1), 1, 2<<10)[0]
			written[i] = append(written[i], body)
			wg.Go(func() { e.append(path, ct, body) })
		}
		wg.Wait()
		if round == 0 {
			if err := e.proxy.WaitHeld(ctx, 1); err != nil {
				t.Fatalf("no compaction PUT reached the proxy within 30 s (compact_interval 1s): %v", err)
			}
		}
	}
	walObjects := len(e.mustList("wal/"))
	release()

	err := fhWaitFor(fhCompactWait, 200*time.Millisecond, func() error {
		if left := len(e.mustList("wal/")); left > 1 {
			return fmt.Errorf("%d of %d WAL objects still there", left, walObjects)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("compaction did not catch up: %v", err)
	}
	reads, total := 0, 0
	for key, n := range e.proxy.Counts().Keys(testenv.OpGet) {
		if !strings.Contains(key, "wal/") {
			continue
		}
		reads++
		total += n
		if n > 1 {
			t.Errorf("%s read %d times", key, n)
		}
	}
	t.Logf("catching up read %d of %d WAL objects with %d GETs, for %d entries", reads, walObjects, total, streams*rounds)
	if reads == 0 {
		t.Fatal("compaction read no WAL object back: the cache held the whole backlog, so this tests nothing")
	}
	for i, path := range paths {
		got, _, err := e.readBytes(path)
		if err != nil {
			t.Fatalf("read %s: %v", path, err)
		}
		if want := bytes.Join(written[i], nil); !bytes.Equal(got, want) {
			t.Fatalf("%s reads back %d bytes, want the %d written", path, len(got), len(want))
		}
	}
}
