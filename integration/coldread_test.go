package integration

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/url"
	"path"
	"slices"
	"strings"
	"sync"
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
	// Without packs, which would hold the small rounds.
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s", "pack_below off"}})
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
		err := e.waitGone("wal/")
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
// the S3 proxy and lets them through one at a time, each once the reader
// waits for it: a reader that keeps finding its next object not there yet
// (a bucket far away) must grow its read-ahead to the whole window, 16
// GETs out at once, not a couple. Two at a time read 1 MiB objects from a
// bucket 25 ms away at a third of the speed of eight.
func TestColdCatchUpKeepsGETsInFlight(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const stream = "/cold/inflight"
	const window = 16
	e, written := fhColdBlobStream(t, stream, window+4)
	blobs := fhBlobsInReadOrder(t, e)
	releases := make([]func(), len(blobs))
	for i, blob := range blobs {
		releases[i] = e.proxy.Hold(testenv.Fault{Op: testenv.OpGet, KeyContains: blob})
	}
	defer func() {
		for _, release := range releases {
			release()
		}
	}()
	type result struct {
		got []byte
		err error
	}
	done := make(chan result, 1)
	go func() {
		got, _, err := e.readBytes(stream)
		done <- result{got, err}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Blob i is let through only once the GETs out show the reader has
	// moved on to it (and found it missing): its window doubles at each
	// such step, from 2, and each window's GETs go out with the blob the
	// reader waits on.
	for i, out := range []int{3, 5, 9, window} {
		if err := e.proxy.WaitHeld(ctx, out); err != nil {
			t.Fatalf("the cold read, at blob %d, had %d blob GETs out at once within 30 s; want %d", i, e.proxy.Held(), out)
		}
		if i < 3 {
			releases[i]()
		}
	}
	for _, release := range releases {
		release()
	}
	r := <-done
	if r.err != nil {
		t.Fatalf("cold read: %v", r.err)
	}
	if want := bytes.Join(written, nil); !bytes.Equal(r.got, want) {
		t.Fatalf("cold read returned %d bytes, want the %d written (equal prefix %d)", len(r.got), len(want), fhCommonPrefix(r.got, want))
	}
}

// fhBlobsInReadOrder returns the names of the blobs of the bucket's one
// stream in the order a reader meets them: their markers sort by end seq
// and end with the blob's name.
func fhBlobsInReadOrder(t *testing.T, e *fhEnv) []string {
	t.Helper()
	var keys []string
	for _, m := range e.mustList("data/") {
		keys = append(keys, m.Key)
	}
	slices.Sort(keys)
	blobs := make([]string, len(keys))
	for i, k := range keys {
		blobs[i] = strings.TrimPrefix(path.Ext(k), ".")
		if !strings.Contains(blobs[i], "-") {
			t.Fatalf("data key %s is not a blob marker", k)
		}
	}
	return blobs
}

// fhColdBlobStream writes a stream of n appends of 256 KiB, each a blob of
// its own, waits until compaction has retired the WAL, and restarts Caddy
// so that a read of it is cold. It returns the appends' bodies.
func fhColdBlobStream(t *testing.T, path string, n int) (*fhEnv, [][]byte) {
	t.Helper()
	// A held GET must not time out and come again as a second one.
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s", "s3_timeout 2m"}})
	written := fhBlobStream(t, e, path, n, 900)
	e.caddy.Kill()
	e.caddy.Restart()
	return e, written
}

// fhBlobStream creates stream path in e's empty bucket as n appends of
// 256 KiB of random bytes from seed, each a blob of its own, and waits
// until compaction has retired the WAL. It returns the appends' bodies.
func fhBlobStream(t *testing.T, e *fhEnv, path string, n int, seed uint64) [][]byte {
	t.Helper()
	const ct = "application/octet-stream"
	e.create(path, ct)
	written := fhRandomRecords(seed, n, 256<<10)
	for _, r := range written {
		e.append(path, ct, r)
	}
	err := e.waitGone("wal/")
	if err != nil {
		t.Fatalf("not compacted: %v", err)
	}
	if got := len(e.mustList("blob/")); got != n {
		t.Fatalf("%d blobs for %d appends of 256 KiB to %s; the test needs one each", got, n, path)
	}
	return written
}

// TestColdCatchUpAfterFailedReadAhead fails every attempt of the read-ahead's
// GET of one blob, retries included: the reader must still get every byte,
// in order, once it reaches that blob (fetching it itself), and a read that
// meets the failure is answered 503 with Retry-After, never a short or
// wrong body.
func TestColdCatchUpAfterFailedReadAhead(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const stream = "/cold/failed"
	const objects = 12
	e, written := fhColdBlobStream(t, stream, objects)
	blob := fhBlobsInReadOrder(t, e)[4]
	// Five attempts is what the store makes of one GET before it gives up.
	const attempts = 5
	e.proxy.AddFault(testenv.Fault{Op: testenv.OpGet, KeyContains: blob, Status: http.StatusInternalServerError, Times: attempts})
	before := e.proxy.Counts().Faults

	var got []byte
	offset, failed := "-1", 0
	for range fhMaxReads {
		resp, err := e.send(fhReq{Method: http.MethodGet, Path: stream + "?offset=" + url.QueryEscape(offset)})
		if err != nil {
			t.Fatal(err)
		}
		if resp.Status == http.StatusServiceUnavailable && resp.Header.Get("Retry-After") != "" {
			// The failed fetch is over once its attempts are; later reads
			// must fetch again rather than see it.
			if !strings.Contains(string(resp.Body), "storage unavailable") {
				t.Fatalf("GET %s?offset=%s: %s; want the reason", stream, offset, resp)
			}
			if failed++; failed > 20 {
				t.Fatalf("GET %s?offset=%s: still %s after %d tries", stream, offset, resp, failed)
			}
			time.Sleep(50 * time.Millisecond)
			continue
		}
		if resp.Status != http.StatusOK {
			t.Fatalf("GET %s?offset=%s: %s; want 200, or 503 with Retry-After", stream, offset, resp)
		}
		got = append(got, resp.Body...)
		offset = resp.Header.Get("Stream-Next-Offset")
		if resp.Header.Get("Stream-Up-To-Date") == "true" {
			break
		}
	}
	if want := bytes.Join(written, nil); !bytes.Equal(got, want) {
		t.Fatalf("cold read returned %d bytes, want the %d written (equal prefix %d)", len(got), len(want), fhCommonPrefix(got, want))
	}
	if n := e.proxy.Counts().Faults - before; n != attempts {
		t.Fatalf("%d GETs of blob %s failed; the test needs all %d attempts of one fetch to fail", n, blob, attempts)
	}
	t.Logf("every attempt of one blob's GET failed; the reader got all %d bytes, %d reads answered 503 first", len(got), failed)
}

// TestColdReadersOnRecycledBuffers has several readers catch up through one
// cold stream of blobs at once, over both protocols, twice: a freshly
// started Caddy reads each blob into a buffer that an earlier blob's read
// has given back (picomq_read_buffers_reused_total counts them), so a
// buffer reused while a response still held its bytes would show here as
// a wrong byte.
func TestColdReadersOnRecycledBuffers(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"compact_interval 1s"}, nil)
	const blobs = 24
	written := fhBlobStream(t, e, "/ds/cold/shared", blobs, 910)
	e.caddy.Kill()
	e.caddy.Restart()
	want := bytes.Join(written, nil)

	for round := range 2 {
		var wg sync.WaitGroup
		errs := make(chan error, 6)
		for r := range 6 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var got []byte
				var err error
				if r%2 == 0 {
					got, _, err = e.readBytes("/ds/cold/shared")
				} else {
					got, err = picoReadAllBinary(e, "/pico/cold/shared")
				}
				switch {
				case err != nil:
					errs <- fmt.Errorf("reader %d: %w", r, err)
				case !bytes.Equal(got, want):
					errs <- fmt.Errorf("reader %d read %d bytes, want the %d written (equal prefix %d)", r, len(got), len(want), fhCommonPrefix(got, want))
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Errorf("round %d: %v", round, err)
		}
	}
	s, err := mGet(e.caddy.AdminAddr())
	if err != nil {
		t.Fatal(err)
	}
	reused := s.sum("picomq_read_buffers_reused_total")
	t.Logf("6 readers, twice, through %d blobs: %v reads into a recycled buffer", blobs, reused)
	if reused == 0 {
		t.Fatal("no blob was read into a recycled buffer: the test proves nothing")
	}
}

// picoReadAllBinary reads a whole stream through Pico binary reads from
// seq 0 and returns its records' bodies, joined.
func picoReadAllBinary(e *fhEnv, path string) ([]byte, error) {
	var out []byte
	seq := "0"
	for range fhMaxReads {
		resp, err := e.send(fhReq{Method: http.MethodGet, Path: path + "?seq=" + seq + "&format=binary"})
		if err != nil {
			return nil, err
		}
		if resp.Status != http.StatusOK {
			return nil, fmt.Errorf("GET %s?seq=%s: %s", path, seq, resp)
		}
		recs, err := picoDecodeBinaryRead(resp.Body)
		if err != nil {
			return nil, fmt.Errorf("GET %s?seq=%s: %w", path, seq, err)
		}
		for _, r := range recs {
			out = append(out, r.body...)
		}
		if resp.Header.Get("Pico-Up-To-Date") == "true" {
			return out, nil
		}
		seq = resp.Header.Get("Pico-Next-Seq")
	}
	return nil, fmt.Errorf("GET %s: not up to date after %d reads", path, fhMaxReads)
}

// TestColdReadAheadSkipsWhatTheCacheCannotHold: with a cache too small
// for a decoded data object (50,000 one-byte messages: 850 KB stored,
// 4 MiB in memory, with cache_size 2MiB), a cold reader fetches each
// object for the responses that need it and nothing ahead: the cache
// dropped objects read ahead as they came, each a GET for nothing.
func TestColdReadAheadSkipsWhatTheCacheCannotHold(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"cache_size 2MiB", "compact_interval 1s", "pack_below off"}})
	const ct = "application/json"
	const name = "/cold/tiny"
	const rounds, perRound = 6, 50_000
	e.create(name, ct)
	body := digitMessages(perRound)
	for round := range rounds {
		e.append(name, ct, body)
		err := e.waitGone("wal/")
		if err != nil {
			t.Fatalf("round %d not compacted: %v", round, err)
		}
	}
	if n := len(e.mustList("data/")); n < rounds {
		t.Fatalf("%d data objects after %d compacted rounds; the test needs one per round", n, rounds)
	}

	e.caddy.Kill()
	e.caddy.Restart()
	before := e.proxy.Counts()
	chunks, _, err := e.readFrom(name, "-1")
	if err != nil {
		t.Fatalf("cold read: %v", err)
	}
	after := e.proxy.Counts()
	total := 0
	for _, c := range chunks {
		total += bytes.Count(c, []byte(","))
		if len(c) > 2 {
			total++
		}
	}
	if total != rounds*perRound {
		t.Fatalf("cold read returned %d messages, want %d", total, rounds*perRound)
	}
	gets, prior := after.Keys("GET"), before.Keys("GET")
	perObject := map[string]int{}
	for k, n := range gets {
		if d := n - prior[k]; d > 0 && strings.Contains(k, "/data/") {
			perObject[k] = d
		}
	}
	t.Logf("cold read in %d responses with cache_size 2MiB: data GETs per object %v", len(chunks), perObject)
	// A response of 65,536 messages touches at most two objects of 50,000,
	// and an object at most two responses.
	for k, n := range perObject {
		if n > 2 {
			t.Errorf("%s fetched %d times by a read in %d responses", path.Base(k), n, len(chunks))
		}
	}
}

// TestColdReadCacheMetrics: after a restart, a read of a stream held in one
// data object counts one cache miss (the object's one GET), and a second
// read one hit, in /metrics. The fetch after a miss looks in the cache
// again; that look once counted a second miss for every cold object.
func TestColdReadCacheMetrics(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s", "pack_below off"}})
	const ct = "application/octet-stream"
	const path = "/cold/metrics"
	e.create(path, ct)
	written := fhRandomRecords(42, 4, 1<<10)
	for _, r := range written {
		e.append(path, ct, r)
	}
	err := e.waitGone("wal/")
	if err != nil {
		t.Fatalf("not compacted: %v", err)
	}
	if objs := e.mustList("data/"); len(objs) != 1 {
		t.Fatalf("%d data objects; the test needs one", len(objs))
	}
	e.caddy.Kill()
	e.caddy.Restart()

	for _, tc := range []struct {
		name                 string
		wantHits, wantMisses float64
		wantGETs             int
	}{
		{"cold read", 0, 1, 1},
		{"read of the cached object", 1, 0, 0},
	} {
		before := mMust(t, e.caddy.AdminAddr())
		beforeGETs := e.proxy.Counts().Containing("GET", "/data/")
		got, _, err := e.readBytes(path)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if want := bytes.Join(written, nil); !bytes.Equal(got, want) {
			t.Fatalf("%s returned %d bytes, want the %d written", tc.name, len(got), len(want))
		}
		after := mMust(t, e.caddy.AdminAddr())
		gets := e.proxy.Counts().Containing("GET", "/data/") - beforeGETs
		hits := after.sum("picomq_cache_hits_total") - before.sum("picomq_cache_hits_total")
		misses := after.sum("picomq_cache_misses_total") - before.sum("picomq_cache_misses_total")
		t.Logf("%s: %v cache hits, %v misses, %d data GETs", tc.name, hits, misses, gets)
		if hits != tc.wantHits || misses != tc.wantMisses || gets != tc.wantGETs {
			t.Errorf("%s: %v cache hits and %v misses for %d data object GETs, want %v, %v and %d",
				tc.name, hits, misses, gets, tc.wantHits, tc.wantMisses, tc.wantGETs)
		}
	}
}
