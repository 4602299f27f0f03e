package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestCrashLeavesNoOrphanedBlob: a large append is written as a blob
// before its WAL entry. When Caddy dies between the two, the append was
// never acknowledged and no entry will ever name the blob; the next process
// must delete it (once it has compacted what it replayed) instead of
// leaving it in the bucket for the life of the stream, and must keep every
// blob that holds acknowledged records.
func TestCrashLeavesNoOrphanedBlob(t *testing.T) {
	if testing.Short() {
		t.Skip("kills and restarts Caddy")
	}
	const (
		octet = "application/octet-stream"
		path  = "/orphan/blob"
	)
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s"}})
	e.create(path, octet)
	kept := bytes.Repeat([]byte("K"), 300<<10)
	e.append(path, octet, kept)
	before := e.mustList("blob/")
	if len(before) != 1 {
		t.Fatalf("blobs after one acknowledged large append: %v", before)
	}

	// The next WAL upload parks at the proxy: the blob is in the bucket,
	// its entry is not, when the process dies.
	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Times: 1})
	defer release()
	answered := make(chan fhResp, 1)
	go func() {
		r, _ := e.send(fhReq{Method: http.MethodPost, Path: path, Header: map[string]string{"Content-Type": octet},
			Body: bytes.Repeat([]byte("L"), 300<<10)})
		answered <- r
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := e.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("the large append's WAL upload never reached the proxy: %v", err)
	}
	if got := e.mustList("blob/"); len(got) != 2 {
		t.Fatalf("blobs while the second append's WAL upload is held: %v, want 2", got)
	}
	e.caddy.Kill()
	if r := <-answered; r.Status/100 == 2 {
		t.Fatalf("the append cut short by the kill was acknowledged: %s", r)
	}
	e.caddy.Restart()
	// A read is served once the new process has replayed the WAL, which
	// sealed the held upload's place: let the upload go now, too late.
	if got, _, err := e.readBytes(path); err != nil || !bytes.Equal(got, kept) {
		t.Fatalf("after the restart the stream reads %d bytes (%v), want the acknowledged %d", len(got), err, len(kept))
	}
	release()

	began := time.Now()
	err := fhWaitFor(30*time.Second, 100*time.Millisecond, func() error {
		if got := e.mustList("blob/"); len(got) != 1 {
			return fmt.Errorf("blobs %d", len(got))
		}
		return nil
	})
	if err != nil {
		t.Fatalf("30 s after the restart the orphaned blob is still in the bucket: %v", e.mustList("blob/"))
	}
	t.Logf("the orphaned blob left the bucket %v after the restart's first read", time.Since(began).Round(time.Millisecond))
	if got := e.mustList("blob/"); got[0].Key != before[0].Key {
		t.Fatalf("the sweep kept %s and deleted the acknowledged append's blob %s", got[0].Key, before[0].Key)
	}
	// The sweep counts what it deleted once it has recorded its progress
	// in the manifest, a write after the last delete, and then logs the
	// line: the counter is read after the line, not after the delete.
	if err := fhWaitFor(10*time.Second, 50*time.Millisecond, func() error {
		if !strings.Contains(e.caddy.Logs(), "swept orphaned blobs") {
			return errors.New("no log line for the sweep")
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
	m, err := mGet(e.caddy.AdminAddr())
	if err != nil {
		t.Fatal(err)
	}
	if n := m.sum("picomq_orphan_blobs_deleted_total"); n != 1 {
		t.Errorf("picomq_orphan_blobs_deleted_total = %v, want 1", n)
	}

	// The restarted process writes blobs of its own, which stay.
	more := bytes.Repeat([]byte("M"), 300<<10)
	passes := func() int { return e.proxy.Counts().Containing(testenv.OpPut, fhManifestKey) }
	appended := passes()
	e.append(path, octet, more)
	// A compaction pass that began after the append's answer: the one
	// that folds it may have begun before (its sweep of stray blobs too),
	// and an idle pass writes nothing to be seen by, so the pass after
	// it is given work of its own. Each ends with a manifest write; a
	// fixed pause could end before any ran.
	waitPasses := func(want int) {
		t.Helper()
		if err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
			if n := passes() - appended; n < want {
				return fmt.Errorf("%d compaction passes since the append", n)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	waitPasses(1)
	e.create("/orphan/tick", octet)
	e.append("/orphan/tick", octet, []byte("t"))
	waitPasses(2)
	if got := e.mustList("blob/"); len(got) != 2 {
		t.Errorf("blobs after another acknowledged large append: %v, want 2", got)
	}
	if got, _, err := e.readBytes(path); err != nil || !bytes.Equal(got, append(append([]byte(nil), kept...), more...)) {
		t.Errorf("the stream reads %d bytes (%v), want the two acknowledged appends' %d", len(got), err, 2*len(kept))
	}
}
