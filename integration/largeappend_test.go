package integration

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestLargeAppendsWrittenOnce: appends of 256 KiB and more go to the
// bucket once, as blobs the WAL refers to, and compaction lists them as
// data with empty markers instead of copying them; every byte reads back
// live, from a restarted Caddy before compaction (WAL replay) and cold
// after it.
func TestLargeAppendsWrittenOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1h"}})
	const ct = "application/octet-stream"
	const path = "/large/once"
	e.create(path, ct)
	var written [][]byte
	before := e.proxy.Counts()
	for i, size := range []int{1 << 20, 300 << 10, 1 << 20, 4 << 10, 1 << 20} {
		b := fhRandomRecords(uint64(900+i), 1, size)[0]
		e.append(path, ct, b)
		written = append(written, b)
	}
	want := bytes.Join(written, nil)
	uploaded := e.proxy.Counts().BytesPut - before.BytesPut
	t.Logf("%d bytes appended, %d bytes uploaded", len(want), uploaded)
	// Once, plus WAL framing and the small append.
	if uploaded > int64(len(want))+64<<10 {
		t.Errorf("%d bytes uploaded for %d appended: large appends went to the bucket more than once", uploaded, len(want))
	}
	if blobs := e.mustList("blob/"); len(blobs) != 4 {
		t.Errorf("%d blobs, want 4 (one per append of 256 KiB or more): %v", len(blobs), blobs)
	}
	check := func(when string) {
		t.Helper()
		got, _, err := e.readBytes(path)
		if err != nil {
			t.Fatalf("%s: %v", when, err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("%s: %d bytes, want %d (equal prefix %d)", when, len(got), len(want), fhCommonPrefix(got, want))
		}
	}
	check("live read")

	// Replay: the WAL names the blobs.
	e.caddy.Kill()
	e.caddy.Restart()
	check("read after a restart, before compaction")

	// Now compaction, often.
	err := e.reload(e.caddy.Config(caddytest.Options{
		Storage:    testenv.StoreURL(e.proxy.URL(), e.bucket, caddytest.S3Prefix),
		Directives: []string{"compact_interval 1s"},
	}))
	if err != nil {
		t.Fatal(err)
	}
	err = e.waitGone("wal/")
	if err != nil {
		t.Fatal(err)
	}
	var markers int
	var dataBytes int64
	for _, o := range e.mustList("data/") {
		dataBytes += o.Size
		if strings.Count(o.Key[strings.LastIndexByte(o.Key, '/'):], ".") == 2 {
			markers++
		}
	}
	t.Logf("after compaction: %d markers, %d bytes in data objects", markers, dataBytes)
	if markers != 4 || dataBytes > 64<<10 {
		t.Errorf("after compaction: %d markers and %d bytes of data objects; want 4 markers and only the small append copied", markers, dataBytes)
	}
	e.caddy.Kill()
	e.caddy.Restart()
	check("cold read after compaction")

	e.must(fhReq{Method: "DELETE", Path: path})
	err = fhWaitFor(time.Minute, 200*time.Millisecond, func() error {
		if n := len(e.mustList("blob/")); n > 0 {
			return fmt.Errorf("%d blobs left after the delete", n)
		}
		return nil
	})
	if err != nil {
		t.Error(err)
	}
}
