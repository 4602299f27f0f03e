package integration

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestTrimmedBlobGoesAfterAFailedDelete: a trim past a large record drops
// its blob when compaction folds the trim. When the store refuses the
// blob's DELETE, a later pass must delete it: the start-up sweep of
// orphaned blobs passes only the namespaces of earlier processes, so a
// blob the trim no longer finds would stay for the life of the stream.
// The records the trim kept stay readable throughout.
func TestTrimmedBlobGoesAfterAFailedDelete(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const (
		octet  = "application/octet-stream"
		path   = "/trimblob/s"
		trimTo = 2
	)
	e := picoStart(t, []string{"compact_interval 1s", "pack_below off"}, nil)
	records := [][]byte{bytes.Repeat([]byte("B"), 300<<10), []byte("small 1"), []byte("small 2")}
	picoWant(t, "create", picoDo(e, "PUT", "/pico"+path, nil, "Content-Type", octet), 201)
	for i, r := range records {
		picoWant(t, "append", picoDo(e, "POST", "/pico"+path, r, "Content-Type", octet), 200,
			"Pico-Start-Seq", strconv.Itoa(i))
	}
	marker := func() error {
		for _, o := range e.mustList("data/") {
			if strings.Count(o.Key[strings.LastIndexByte(o.Key, '/')+1:], ".") == 2 {
				return nil
			}
		}
		return fmt.Errorf("no blob marker among the data objects")
	}
	if err := fhWaitFor(fhCompactWait, 100*time.Millisecond, marker); err != nil {
		t.Fatalf("compaction of the large append: %v", err)
	}
	if blobs := e.mustList("blob/"); len(blobs) != 1 {
		t.Fatalf("blobs after one large append: %v, want 1", blobs)
	}

	// 403 is not retried: each pass's DELETE of the blob fails at once.
	before := e.proxy.Counts().Faults
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpDelete, KeyContains: "blob/", Status: http.StatusForbidden})
	defer remove()
	picoWant(t, "trim", picoDo(e, "POST", "/pico"+path, nil, "Pico-Trim-Seq", strconv.Itoa(trimTo)), 200,
		"Pico-Start-Seq", strconv.Itoa(trimTo))
	if !waitFor(fhCompactWait, func() bool { return e.proxy.Counts().Faults > before }) {
		t.Fatal("compaction never tried to delete the trimmed blob")
	}
	// Let one more pass run into the fault, as a store that is down for a
	// while would have it (a build that lost track of the blob never
	// tries again).
	refused := e.proxy.Counts().Faults
	if !waitFor(5*time.Second, func() bool { return e.proxy.Counts().Faults > refused }) {
		t.Log("no second pass met the fault")
	}
	if got, _, err := e.readBytes("/ds" + path); err != nil || !bytes.Equal(got, bytes.Join(records[trimTo:], nil)) {
		t.Errorf("while the blob DELETE is refused the stream reads %d bytes (%v), want its records from %d", len(got), err, trimTo)
	}
	remove()
	t.Logf("the store refused %d DELETEs of the blob", e.proxy.Counts().Faults-before)

	began := time.Now()
	if err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
		if blobs := e.mustList("blob/"); len(blobs) > 0 {
			return fmt.Errorf("the trimmed blob is still in the bucket: %v", blobs)
		}
		if marker() == nil {
			return fmt.Errorf("a blob marker is still among the data objects: %v", e.mustList("data/"))
		}
		return nil
	}); err != nil {
		t.Fatalf("%v after the fault was lifted: %v", fhCompactWait, err)
	}
	t.Logf("the trimmed blob left the bucket %v after the fault was lifted", time.Since(began).Round(time.Millisecond))
	if got, _, err := e.readBytes("/ds" + path); err != nil || !bytes.Equal(got, bytes.Join(records[trimTo:], nil)) {
		t.Errorf("the stream reads %d bytes (%v), want its records from %d", len(got), err, trimTo)
	}
}

// TestTrimIntoABlobWhoseCheckpointFailedThroughCaddy: the fold that
// applies a trim into a large append's blob rewrites the blob from the
// trim on and deletes it, and its checkpoint then fails; the next fold
// writes the blob's marker again with the stream's runs, and its trim
// found the blob gone (here after a crash, so that no cache holds it):
// every compaction failed from then on, and no stream's WAL was retired
// again. It now finds the rewrite and goes on.
func TestTrimIntoABlobWhoseCheckpointFailedThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const (
		octet = "application/octet-stream"
		path  = "/trimblob/failed"
	)
	e := picoStart(t, []string{"compact_interval 1s", "pack_below off", "s3_timeout 1s"}, nil)
	picoWant(t, "create", picoDo(e, "PUT", "/pico"+path, nil, "Content-Type", octet), 201)
	picoWant(t, "append", picoDo(e, "POST", "/pico"+path, []byte("a"), "Content-Type", octet), 200, "Pico-Start-Seq", "0")
	if err := e.waitGone("wal/"); err != nil {
		t.Fatalf("the first record not folded: %v", err)
	}
	metaKey := "streams/" + hex.EncodeToString([]byte(path)) + ".m"
	faults := e.proxy.Counts().Faults
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: metaKey, Status: http.StatusInternalServerError})
	defer remove()
	// One append of two records, together big enough for a blob (seqs 1
	// and 2), and a trim to the second.
	big := bytes.Repeat([]byte("B"), 300<<10)
	batch := picoEncodeBinary([]picoNewRecord{{body: big}, {body: []byte("kept")}})
	picoWant(t, "large append", picoDo(e, "POST", "/pico"+path, batch, "Content-Type", picoBinaryBatch), 200, "Pico-Start-Seq", "1")
	picoWant(t, "trim", picoDo(e, "POST", "/pico"+path, nil, "Pico-Trim-Seq", "2"), 200, "Pico-Start-Seq", "2")
	if !waitFor(fhCompactWait, func() bool { return e.proxy.Counts().Faults > faults }) {
		t.Fatal("no fold of the trim met the refused checkpoint")
	}
	if blobs := e.mustList("blob/"); len(blobs) != 0 {
		t.Fatalf("the failed fold left the blob: %v; the test needs it rewritten and deleted", blobs)
	}
	// A restart, so that the blob is in no cache: the first fold of the
	// new process reads it from the bucket.
	e.caddy.Kill()
	remove()
	e.caddy.Restart()
	if err := e.waitGone("wal/"); err != nil {
		t.Fatalf("compaction did not get going again once the checkpoint went through: %v", err)
	}
	if got, _, err := e.readBytes("/ds" + path); err != nil || string(got) != "kept" {
		t.Fatalf("read after the trim: %q (%v), want %q", got, err, "kept")
	}
}
