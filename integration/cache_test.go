package integration

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/url"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// fhRandomRecords returns n records of size random bytes each.
func fhRandomRecords(seed uint64, n, size int) [][]byte {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	out := make([][]byte, n)
	for i := range out {
		out[i] = make([]byte, size)
		for j := range out[i] {
			out[i][j] = byte(rng.UintN(256))
		}
	}
	return out
}

// TestCacheColdReadGoesToBucket: with a 4 KiB cache, a catch-up read of a
// stream written earlier cannot be served from memory; it must go to the
// bucket, and still return every byte.
func TestCacheColdReadGoesToBucket(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"cache_size 4KiB"}})
	const path = "/cache/cold"
	const ct = "application/octet-stream"
	e.create(path, ct)
	// 48 KiB in 48 records: twelve times the cache.
	recs := fhRandomRecords(1, 48, 1024)
	for _, r := range recs {
		e.append(path, ct, r)
	}
	want := bytes.Join(recs, nil)

	before := e.proxy.Counts()
	got, _, err := e.readBytes(path)
	if err != nil {
		t.Fatal(err)
	}
	after := e.proxy.Counts()
	if !bytes.Equal(got, want) {
		t.Fatalf("catch-up read returned %d bytes, want the %d written (equal prefix %d)", len(got), len(want), fhCommonPrefix(got, want))
	}
	gets := after.Get - before.Get
	t.Logf("catch-up read of %d bytes with cache_size 4KiB: %d GETs, %d LISTs (%d on the read path)",
		len(want), gets, after.List-before.List, fhReadPathRequests(after)-fhReadPathRequests(before))
	if gets == 0 {
		t.Errorf("catch-up read of %d bytes with a 4 KiB cache made no GET: it cannot have come from the bucket", len(want))
	}
}

// TestCacheTailReadCostsNoGets: with the default cache, readers at the tail
// get fresh appends from memory, by catch-up read and by long-poll, without
// a single GET.
func TestCacheTailReadCostsNoGets(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{
		Directives: []string{"long_poll_timeout 20s"},
		Optional:   []string{"compact_interval 1h"},
	})
	const path = "/cache/hot"
	const ct = "application/octet-stream"
	e.create(path, ct)
	for _, r := range fhRandomRecords(2, 5, 512) {
		e.append(path, ct, r)
	}
	_, tail, err := e.readBytes(path)
	if err != nil {
		t.Fatal(err)
	}

	t.Run("catch-up", func(t *testing.T) {
		fresh := fhRandomRecords(3, 10, 512)
		for _, r := range fresh {
			e.append(path, ct, r)
		}
		before := e.proxy.Counts()
		chunks, next, err := e.readFrom(path, tail)
		if err != nil {
			t.Fatal(err)
		}
		after := e.proxy.Counts()
		if got, want := bytes.Join(chunks, nil), bytes.Join(fresh, nil); !bytes.Equal(got, want) {
			t.Fatalf("tail read returned %d bytes, want the %d just appended", len(got), len(want))
		}
		fhExpectNoReadCost(t, "catch-up read of fresh data", before, after)
		tail = next
	})

	t.Run("long-poll", func(t *testing.T) {
		fresh := fhRandomRecords(4, 1, 512)[0]
		before := e.proxy.Counts()
		type result struct {
			resp fhResp
			err  error
		}
		done := make(chan result, 1)
		go func() {
			resp, err := e.send(fhReq{Method: http.MethodGet, Path: path + "?live=long-poll&offset=" + url.QueryEscape(tail)})
			done <- result{resp, err}
		}()
		// Let the reader park, then append: a fixed pause could end
		// first on a busy machine, and the read would then be a
		// catch-up read, not the wake-up this is about.
		fhWaitLongPolls(t, e.caddy.AdminAddr(), 1)
		e.append(path, ct, fresh)
		var r result
		select {
		case r = <-done:
		case <-time.After(30 * time.Second):
			t.Fatal("long-poll did not answer within 30s of the append")
		}
		after := e.proxy.Counts()
		if r.err != nil {
			t.Fatal(r.err)
		}
		if r.resp.Status != http.StatusOK || !bytes.Equal(r.resp.Body, fresh) {
			t.Fatalf("long-poll: %d with %d bytes, want 200 with the %d appended", r.resp.Status, len(r.resp.Body), len(fresh))
		}
		fhExpectNoReadCost(t, "long-poll wake-up with fresh data", before, after)
	})
}

// fhExpectNoReadCost fails the test if any GET, or any listing of data
// objects, reached the store between the two snapshots. Background reads of
// the manifest, lease or format object are reported but not counted against
// the read.
func fhExpectNoReadCost(t *testing.T, what string, before, after testenv.Counts) {
	t.Helper()
	readPath := fhReadPathRequests(after) - fhReadPathRequests(before)
	gets := after.Get - before.Get
	t.Logf("%s: %d GETs in all, %d on the read path", what, gets, readPath)
	if readPath != 0 {
		diff := map[string]int{}
		for _, op := range []string{testenv.OpGet, testenv.OpList} {
			b := before.Keys(op)
			for k, n := range after.Keys(op) {
				if d := n - b[k]; d > 0 {
					diff[op+" "+k] = d
				}
			}
		}
		t.Errorf("%s went to the bucket:%s", what, fhSortedKeys(diff))
	}
}

func fhCommonPrefix(a, b []byte) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

// TestCacheSizeBoundsMemoryOfTinyRecords: cache_size bounds the memory the
// cache holds, however small the records. Streams of one-byte JSON
// messages are written and read back, several times what the cache holds,
// and Caddy's live heap grows by about cache_size. The cache counted each
// record at its encoded size, 17 bytes, where it holds a 64-byte Record
// and a 64-byte buffer of its own: it held several times cache_size.
//
// Compaction stays away (an hour's interval, fewer WAL objects and
// smaller entries than start one early), so what the cache holds is the
// WAL entries it is given at commit and the ones the reads bring back.
func TestCacheSizeBoundsMemoryOfTinyRecords(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const cacheSize = 8 << 20
	e := fhStart(t, fhOptions{Directives: []string{"cache_size 8MiB", "compact_interval 1h"}})
	const (
		streams = 8
		appends = 100 // per stream: 800 WAL objects in all, under the 1000 that start a compaction
		perPost = 960 // records of an append: 16 KB encoded, under a large entry's size
	)
	const ct = "application/json"
	for s := range streams {
		e.create(fmt.Sprintf("/tiny/%d", s), ct)
	}
	body := digitMessages(perPost)
	base := e.heapAlloc(true)

	for range appends {
		for s := range streams {
			e.append(fmt.Sprintf("/tiny/%d", s), ct, body)
		}
	}
	written := e.heapAlloc(true)
	for s := range streams {
		msgs, _, err := e.readJSON(fmt.Sprintf("/tiny/%d", s))
		if err != nil {
			t.Fatal(err)
		}
		if len(msgs) != appends*perPost {
			t.Fatalf("/tiny/%d holds %d messages, want %d", s, len(msgs), appends*perPost)
		}
	}
	read := e.heapAlloc(true)

	mib := func(b float64) float64 { return b / (1 << 20) }
	t.Logf("%d one-byte records (%.1f MiB encoded) with cache_size %d MiB: live heap %.1f MiB before, %.1f MiB after writing them, %.1f MiB after reading them",
		streams*appends*perPost, mib(float64(streams*appends*perPost*17)), cacheSize>>20, mib(base), mib(written), mib(read))
	for _, m := range []struct {
		when string
		heap float64
	}{{"writing", written}, {"reading", read}} {
		if grew := m.heap - base; grew > 2*cacheSize {
			t.Errorf("after %s, the live heap grew by %.1f MiB with cache_size %d MiB", m.when, mib(grew), cacheSize>>20)
		}
	}
}

// TestBacklogOfTinyRecordsCompactsBeforeLeavingTheCache: the WAL backlog
// that starts a compaction early is weighed as the cache weighs it. With
// cache_size 2MiB, appends of 1,000 one-byte JSON messages (17 KB encoded,
// about 130 KB in the cache) start a compaction while the cache still
// holds them all, and it fetches none back from the bucket. Weighed
// encoded, the backlog reached three quarters of the cache only after
// most entries had been pushed out.
func TestBacklogOfTinyRecordsCompactsBeforeLeavingTheCache(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"cache_size 2MiB", "compact_interval 1h", "pack_below off"}})
	const ct = "application/json"
	const name = "/backlog/tiny"
	e.create(name, ct)
	body := digitMessages(1000)
	before := e.proxy.Counts()
	appends := 0
	for ; len(e.mustList("data/")) == 0; appends++ {
		if appends == 300 {
			t.Fatalf("no compaction after %d appends of 1,000 one-byte messages with cache_size 2MiB", appends)
		}
		e.append(name, ct, body)
	}
	after := e.proxy.Counts()
	gets := after.Containing("GET", "/wal/") - before.Containing("GET", "/wal/")
	t.Logf("a compaction wrote data within %d appends of 1,000 one-byte messages with cache_size 2MiB; %d WAL GETs", appends, gets)
	if gets != 0 {
		t.Errorf("the compaction fetched %d WAL objects back from the bucket: its entries had left the cache", gets)
	}
}
