package integration

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestColdCatchUpReadsEachObjectOnce: a freshly started Caddy reading a
// stream from the start, through many data objects, lists the stream's data
// keys once (not before every object) and fetches every data object exactly
// once, although a read-ahead runs in front of the reader.
func TestColdCatchUpReadsEachObjectOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s"}})
	const ct = "application/octet-stream"
	const path = "/cold/catchup"
	const rounds = 6
	e.create(path, ct)
	var written [][]byte
	for round := range rounds {
		// Each round is compacted on its own, so the stream ends up in
		// one data object per round.
		recs := fhRandomRecords(uint64(700+round), 8, 16<<10)
		for _, r := range recs {
			e.append(path, ct, r)
		}
		written = append(written, recs...)
		err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
			if n := len(e.mustList("wal/")); n > 0 {
				return fmt.Errorf("%d WAL objects left", n)
			}
			return nil
		})
		if err != nil {
			t.Fatalf("round %d not compacted: %v", round, err)
		}
	}
	dataObjs := e.mustList("data/")
	if len(dataObjs) < rounds {
		t.Fatalf("%d data objects after %d compacted rounds; the test needs one per round", len(dataObjs), rounds)
	}

	e.caddy.Kill()
	e.caddy.Restart()
	before := e.proxy.Counts()
	got, _, err := e.readBytes(path)
	if err != nil {
		t.Fatalf("cold read: %v", err)
	}
	after := e.proxy.Counts()
	if want := bytes.Join(written, nil); !bytes.Equal(got, want) {
		t.Fatalf("cold read returned %d bytes, want the %d written (equal prefix %d)", len(got), len(want), fhCommonPrefix(got, want))
	}
	lists := after.Containing("LIST", "/data/") - before.Containing("LIST", "/data/")
	gets := after.Keys("GET")
	prior := before.Keys("GET")
	perObject := map[string]int{}
	for k, n := range gets {
		if d := n - prior[k]; d > 0 && bytes.Contains([]byte(k), []byte("/data/")) {
			perObject[k] = d
		}
	}
	t.Logf("cold read of %d bytes in %d data objects: %d LISTs of data keys, data GETs per object %v",
		len(got), len(dataObjs), lists, perObject)
	if lists != 1 {
		t.Errorf("%d LISTs of data keys for one cold read; want 1", lists)
	}
	if len(perObject) != len(dataObjs) {
		t.Errorf("%d data objects fetched; want all %d", len(perObject), len(dataObjs))
	}
	for k, n := range perObject {
		if n != 1 {
			t.Errorf("data object %s fetched %d times; want once", k, n)
		}
	}
}

// TestColdCatchUpKeepsGETsInFlight holds every blob GET of a cold read at
// the S3 proxy: the reader's own and the read-ahead's must be out at once,
// the whole window ahead of the reader (11 objects here) and not a couple.
// Two at a time read 1 MiB objects from a bucket 25 ms away at a third of
// the speed of eight.
func TestColdCatchUpKeepsGETsInFlight(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	// A held GET must not time out and come again as a second one.
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s", "s3_timeout 2m"}})
	const ct = "application/octet-stream"
	const path = "/cold/inflight"
	const objects = 12
	e.create(path, ct)
	// Appends of 256 KiB are written as blobs, one object each.
	written := fhRandomRecords(900, objects, 256<<10)
	for _, r := range written {
		e.append(path, ct, r)
	}
	err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
		if n := len(e.mustList("wal/")); n > 0 {
			return fmt.Errorf("%d WAL objects left", n)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("not compacted: %v", err)
	}
	if n := len(e.mustList("blob/")); n != objects {
		t.Fatalf("%d blobs for %d appends of 256 KiB; the test needs one each", n, objects)
	}

	e.caddy.Kill()
	e.caddy.Restart()
	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpGet, KeyContains: "/blob/"})
	released := false
	defer func() {
		if !released {
			release()
		}
	}()
	type result struct {
		got []byte
		err error
	}
	done := make(chan result, 1)
	go func() {
		got, _, err := e.readBytes(path)
		done <- result{got, err}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := e.proxy.WaitHeld(ctx, objects); err != nil {
		t.Fatalf("the cold read had at most %d blob GETs out at once within 30 s; want %d (its own and %d ahead)",
			e.proxy.Held(), objects, objects-1)
	}
	release()
	released = true
	r := <-done
	if r.err != nil {
		t.Fatalf("cold read: %v", r.err)
	}
	if want := bytes.Join(written, nil); !bytes.Equal(r.got, want) {
		t.Fatalf("cold read returned %d bytes, want the %d written (equal prefix %d)", len(r.got), len(want), fhCommonPrefix(r.got, want))
	}
}
