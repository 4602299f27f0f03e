package integration

import (
	"bytes"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestStorageOverTLS: the module on a bucket reached over HTTPS, as S3 in
// the cloud always is, with the server's private authority in
// AWS_CA_BUNDLE. Over TLS the SDK leaves the body out of every signature
// (UNSIGNED-PAYLOAD, where plain HTTP signs its SHA-256), so the WAL's
// conditional PUTs, blobs, compaction's deletes and a restart's replay
// each go over a wire the plain-HTTP tests never use.
func TestStorageOverTLS(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{TLS: true, Directives: []string{"compact_interval 1s", "pack_below off"}})
	const ct = "application/octet-stream"
	paths := []string{"/tls/kept", "/tls/doomed"}
	records := make([][][]byte, len(paths))
	for s, path := range paths {
		e.create(path, ct)
		records[s] = fhRandomRecords(uint64(700+s), 10, 2048)
	}
	// A large append goes to the bucket as a blob of its own.
	records[0] = append(records[0], fhRandomRecords(777, 1, 300<<10)[0])
	for s, path := range paths {
		for _, r := range records[s] {
			e.append(path, ct, r)
		}
	}
	if blobs := e.mustList("blob/"); len(blobs) != 1 {
		t.Errorf("%d blobs, want 1 for the 300 KiB append: %v", len(blobs), blobs)
	}
	wal := e.mustList("wal/")
	if len(wal) == 0 {
		t.Fatal("no WAL object in the bucket after the appends")
	}
	readBack := func(when string) {
		t.Helper()
		got, _, err := e.readBytes(paths[0])
		if err != nil {
			t.Fatalf("%s: %v", when, err)
		}
		if want := bytes.Join(records[0], nil); !bytes.Equal(got, want) {
			t.Fatalf("%s: %s reads %d bytes, want %d (equal prefix %d)", when, paths[0], len(got), len(want), fhCommonPrefix(got, want))
		}
	}
	readBack("live read")

	// Compaction retires the WAL with DeleteObjects.
	err := fhWaitFor(fhCompactWait, 200*time.Millisecond, func() error {
		now := map[string]bool{}
		for _, o := range e.mustList("wal/") {
			now[o.Key] = true
		}
		for _, o := range wal {
			if now[o.Key] {
				return fmt.Errorf("WAL object %s is still there", o.Key)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("compaction over TLS: %v", err)
	}

	// A deleted stream's data leaves the bucket.
	if resp := e.must(fhReq{Method: http.MethodDelete, Path: paths[1]}); resp.Status/100 != 2 {
		t.Fatalf("DELETE %s: %s", paths[1], resp)
	}
	err = fhWaitFor(fhCompactWait, 500*time.Millisecond, func() error {
		objs, bodies := fhReadAll(t, e, "")
		for i, b := range bodies {
			if bytes.Contains(b, records[1][0]) {
				return fmt.Errorf("a record of the deleted stream is still in %s", objs[i].Key)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("delete over TLS: %v", err)
	}

	// A crash and a restart: the replay reads the bucket over TLS too.
	e.caddy.Kill()
	e.caddy.Restart()
	readBack("after a restart")
	if resp := e.must(fhReq{Method: http.MethodHead, Path: paths[1]}); resp.Status != http.StatusNotFound {
		t.Errorf("HEAD %s after its delete and a restart: %d, want 404", paths[1], resp.Status)
	}
	var keys []string
	for _, o := range e.mustList("") {
		keys = append(keys, o.Key)
	}
	t.Logf("bucket at the end: %s", strings.Join(keys, " "))
}
