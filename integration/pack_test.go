package integration

import (
	"bytes"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestPacksKeepManySlowStreamsCheap: many streams with a few appends each
// between compactions share pack objects instead of each getting a data
// object and a checkpoint at every compaction. It counts at the S3 proxy
// what retiring the WAL costs, reads every stream back byte-exact from
// the packs after a SIGKILL, and after a reload with pack_below off sees
// every stream folded into data objects of its own and the packs deleted.
func TestPacksKeepManySlowStreamsCheap(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s"}})
	const ct = "application/octet-stream"
	const streams, rounds = 200, 3
	paths := make([]string, streams)
	records := make([][][]byte, streams)
	tails := make([]string, streams)
	for s := range streams {
		paths[s] = fmt.Sprintf("/packs/s%03d", s)
		e.create(paths[s], ct)
		records[s] = fhRandomRecords(uint64(7000+s), rounds+1, 200+s)
	}

	// appendRound appends record r to every stream, 16 at a time.
	appendRound := func(r int) {
		t.Helper()
		var wg sync.WaitGroup
		errs := make(chan error, streams)
		sem := make(chan struct{}, 16)
		for s := range streams {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				resp, err := e.send(fhReq{Method: http.MethodPost, Path: paths[s], Header: map[string]string{"Content-Type": ct}, Body: records[s][r]})
				switch {
				case err != nil:
					errs <- err
				case resp.Status/100 != 2:
					errs <- fmt.Errorf("POST %s: %s", paths[s], resp)
				default:
					tails[s] = resp.Header.Get("Stream-Next-Offset")
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
	}
	// walRetired waits until no WAL object that held records is left.
	walRetired := func() {
		t.Helper()
		wal := e.mustList("wal/")
		err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
			now := fhKeySet(e.mustList("wal/"))
			for _, o := range wal {
				if now[o.Key] {
					return fmt.Errorf("%s is still there", o.Key)
				}
			}
			return nil
		})
		if err != nil {
			t.Fatalf("WAL objects not retired by compaction (compact_interval 1s): %v", err)
		}
	}

	walRetired() // the creates' entries
	var packPuts, walPuts int
	for r := range rounds {
		before := e.proxy.Counts()
		appendRound(r)
		walRetired()
		after := e.proxy.Counts()
		d := func(op, sub string) int { return after.Containing(op, sub) - before.Containing(op, sub) }
		packPuts += d(testenv.OpPut, "/pack/")
		walPuts += d(testenv.OpPut, "/wal/")
		if data, meta := d(testenv.OpPut, "/data/"), d(testenv.OpPut, "/streams/"); data != 0 || meta != 0 {
			t.Fatalf("round %d: compacting %d streams with one small append each wrote %d data objects and %d checkpoints; want them packed",
				r, streams, data, meta)
		}
		if d(testenv.OpPut, "/pack/") == 0 {
			t.Fatalf("round %d: the WAL was retired without a pack", r)
		}
	}
	t.Logf("%d appends over %d streams: %d WAL PUTs, %d pack PUTs, no data objects or checkpoints", streams*rounds, streams, walPuts, packPuts)
	m := mMust(t, e.caddy.AdminAddr())
	if packed, written, live := m.sum("picomq_compaction_packed_total"), m.sum("picomq_packs_written_total"), m.sum("picomq_packs_live"); packed < streams*rounds || written < float64(packPuts) || live < 1 {
		t.Fatalf("metrics: %v streams packed, %v packs written, %v live; want at least %d, %d, and at least 1", packed, written, live, streams*rounds, packPuts)
	}
	if data := e.mustList("data/"); len(data) != 0 {
		t.Fatalf("data objects after packing: %d", len(data))
	}

	readBack := func(when string, n int) {
		t.Helper()
		for s := range streams {
			got, tail, err := e.readBytes(paths[s])
			if err != nil {
				t.Fatalf("%s: %v", when, err)
			}
			if want := bytes.Join(records[s][:n], nil); !bytes.Equal(got, want) {
				t.Fatalf("%s: %s reads %d bytes, want the %d written (equal prefix %d)", when, paths[s], len(got), len(want), fhCommonPrefix(got, want))
			}
			if tail != tails[s] {
				t.Fatalf("%s: %s ends at %s; its last append answered %s", when, paths[s], tail, tails[s])
			}
		}
	}
	// A crash: the replay rebuilds the streams from the packs' indexes.
	e.caddy.Kill()
	e.caddy.Restart()
	before := e.proxy.Counts()
	readBack("after SIGKILL and restart", rounds)
	if gets := e.proxy.Counts().Containing(testenv.OpGet, "/pack/") - before.Containing(testenv.OpGet, "/pack/"); gets == 0 {
		t.Fatal("the reads after the restart fetched nothing from the packs")
	}
	appendRound(rounds) // the tails carry on where they were
	readBack("after appending past the restart", rounds+1)

	// pack_below off: the next compaction gives every stream data objects
	// of its own, and the packs leave the bucket.
	opts := caddytest.Options{Storage: testenv.StoreURL(e.proxy.URL(), e.bucket, caddytest.S3Prefix),
		Directives: []string{"compact_interval 1s", "pack_below off"}}
	if err := e.caddy.Reload(e.caddy.Config(opts)); err != nil {
		t.Fatal(err)
	}
	err := fhWaitFor(fhCompactWait, 200*time.Millisecond, func() error {
		if packs := e.mustList("pack/"); len(packs) != 0 {
			return fmt.Errorf("%d packs left, e.g. %s", len(packs), packs[0].Key)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("pack_below off: %v", err)
	}
	if data := e.mustList("data/"); len(data) < streams {
		t.Fatalf("%d data objects for %d folded streams", len(data), streams)
	}
	if m := mMust(t, e.caddy.AdminAddr()); m.sum("picomq_compaction_folds_total") < streams || m.sum("picomq_packs_live") != 0 {
		t.Fatalf("metrics after folding: %v folds, %v live packs; want at least %d and 0",
			m.sum("picomq_compaction_folds_total"), m.sum("picomq_packs_live"), streams)
	}
	e.caddy.Kill()
	e.caddy.Restart()
	readBack("after folding and a restart", rounds+1)
}
