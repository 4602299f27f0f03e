package integration

import (
	"bytes"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// fhCompactWait bounds each wait for background compaction or collection,
// many times the configured compact_interval of 1s.
const fhCompactWait = 30 * time.Second

// TestCompactionMovesWALIntoDataObjects writes several streams with a short
// compact_interval, waits for compaction, and checks in the bucket itself
// that the WAL objects are retired and the records live in data objects;
// after a crash and restart the streams read back byte-exact from data
// objects; a deleted stream's data leaves the bucket.
func TestCompactionMovesWALIntoDataObjects(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	// Without packs: their own test is TestPacksKeepManySlowStreamsCheap.
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s", "pack_below off"}})
	const ct = "application/octet-stream"
	const streams = 5
	const doomed = streams - 1 // the stream deleted at the end
	paths := make([]string, streams)
	records := make([][][]byte, streams)
	tails := make([]string, streams)
	payload := 0
	for s := range streams {
		paths[s] = fmt.Sprintf("/compact/s%d", s)
		e.create(paths[s], ct)
		// Sizes from 1 to 3 KiB, different per stream.
		records[s] = fhRandomRecords(uint64(100+s), 12, 1024*(1+s%3))
		for _, r := range records[s] {
			tails[s] = e.append(paths[s], ct, r)
			payload += len(r)
		}
	}

	// Compaction retires every WAL object that holds these records.
	wal := e.mustList("wal/")
	if len(wal) == 0 {
		t.Fatal("no WAL object in the bucket after the appends: nothing to compact")
	}
	t.Logf("%d WAL objects hold %d bytes of records in %d streams", len(wal), payload, streams)
	err := fhWaitFor(fhCompactWait, 200*time.Millisecond, func() error {
		now := map[string]bool{}
		for _, o := range e.mustList("wal/") {
			now[o.Key] = true
		}
		var left []string
		for _, o := range wal {
			if now[o.Key] {
				left = append(left, o.Key)
			}
		}
		if len(left) > 0 {
			return fmt.Errorf("%d of the %d WAL objects are still there, e.g. %s", len(left), len(wal), left[0])
		}
		return nil
	})
	if err != nil {
		t.Fatalf("WAL objects not retired by compaction (compact_interval 1s): %v", err)
	}

	// Every record now lives in a data object.
	dataObjs, dataBodies := fhReadAll(t, e, "data/")
	dataBytes := int64(0)
	for _, o := range dataObjs {
		dataBytes += o.Size
	}
	t.Logf("after compaction: %d data objects, %d bytes", len(dataObjs), dataBytes)
	if dataBytes < int64(payload) {
		t.Errorf("data objects hold %d bytes, less than the %d bytes of records", dataBytes, payload)
	}
	for s := range streams {
		for i, r := range records[s] {
			if !fhAnyContains(dataBodies, r) {
				t.Errorf("record %d of %s is in no data object", i, paths[s])
			}
		}
	}

	// A crash and a restart: the streams read back byte-exact, from data
	// objects, at unchanged offsets.
	e.caddy.Kill()
	e.caddy.Restart()
	before := e.proxy.Counts()
	for s := range streams {
		got, tail, err := e.readBytes(paths[s])
		if err != nil {
			t.Errorf("after restart: %v", err)
			continue
		}
		if want := bytes.Join(records[s], nil); !bytes.Equal(got, want) {
			t.Errorf("after restart %s reads %d bytes, want the %d written (equal prefix %d)",
				paths[s], len(got), len(want), fhCommonPrefix(got, want))
		}
		if tail != tails[s] {
			t.Errorf("after restart %s ends at %s; its last append answered %s", paths[s], tail, tails[s])
		}
	}
	after := e.proxy.Counts()
	dataGets := after.Containing("GET", "/data/") - before.Containing("GET", "/data/")
	walGets := after.Containing("GET", "/wal/") - before.Containing("GET", "/wal/")
	t.Logf("reads after restart: %d GETs of data objects, %d of WAL objects", dataGets, walGets)
	if dataGets == 0 {
		t.Errorf("the reads after restart fetched no data object")
	}

	// Deleting a stream takes its data out of the bucket.
	if resp := e.must(fhReq{Method: http.MethodDelete, Path: paths[doomed]}); resp.Status/100 != 2 {
		t.Fatalf("DELETE %s: %s", paths[doomed], resp)
	}
	if resp := e.must(fhReq{Method: http.MethodHead, Path: paths[doomed]}); resp.Status != http.StatusNotFound {
		t.Errorf("HEAD %s after DELETE: %d, want 404", paths[doomed], resp.Status)
	}
	err = fhWaitFor(fhCompactWait, 500*time.Millisecond, func() error {
		objs, bodies := fhReadAll(t, e, "")
		for i, b := range bodies {
			for j, r := range records[doomed] {
				if bytes.Contains(b, r) {
					return fmt.Errorf("record %d of the deleted stream is still in %s", j, objs[i].Key)
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Errorf("deleted stream's data stays in the bucket: %v", err)
	}
	// The others keep theirs.
	_, dataBodies = fhReadAll(t, e, "data/")
	for s := range doomed {
		for i, r := range records[s] {
			if !fhAnyContains(dataBodies, r) {
				t.Errorf("after deleting %s, record %d of %s is in no data object", paths[doomed], i, paths[s])
			}
		}
		got, _, err := e.readBytes(paths[s])
		if err != nil {
			t.Error(err)
		} else if !bytes.Equal(got, bytes.Join(records[s], nil)) {
			t.Errorf("after deleting %s, %s no longer reads back", paths[doomed], paths[s])
		}
	}
	var keys []string
	for _, o := range e.mustList("") {
		keys = append(keys, o.Key)
	}
	t.Logf("bucket at the end: %s", strings.Join(keys, " "))
}

// fhReadAll lists the objects under prefix and reads each.
func fhReadAll(t *testing.T, e *fhEnv, prefix string) ([]fhObject, [][]byte) {
	t.Helper()
	objs := e.mustList(prefix)
	bodies := make([][]byte, 0, len(objs))
	kept := objs[:0]
	for _, o := range objs {
		b, err := e.get(o.Key)
		if err != nil {
			// Deleted between the listing and the read.
			if strings.Contains(err.Error(), "NoSuchKey") {
				continue
			}
			t.Fatal(err)
		}
		kept = append(kept, o)
		bodies = append(bodies, b)
	}
	return kept, bodies
}

func fhAnyContains(bodies [][]byte, part []byte) bool {
	for _, b := range bodies {
		if bytes.Contains(b, part) {
			return true
		}
	}
	return false
}
