package integration

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestLostWALObjectBelowASealStopsTheStart: through Caddy on versitygw, a
// WAL object of an earlier process's namespace that a replay already
// sealed goes missing from the bucket (an operator, a lifecycle rule).
// The next start refuses, naming the object, instead of sealing the gap
// and dropping the acknowledged appends after it: before, Caddy started
// and the stream read back without them.
func TestLostWALObjectBelowASealStopsTheStart(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1h"}})
	const path, ct = "/walgap/s", "text/plain"
	e.create(path, ct)
	for _, body := range []string{"a;", "b;", "c;"} {
		e.append(path, ct, []byte(body))
	}
	first := e.mustList("wal/")
	// A restart: the second process's replay seals the first's namespace.
	if err := e.caddy.TryRestart(); err != nil {
		t.Fatalf("restart: %v", err)
	}
	if got, _, err := e.readBytes(path); err != nil || string(got) != "a;b;c;" {
		t.Fatalf("after the first restart %s reads %q (%v); want a;b;c;", path, got, err)
	}
	if err := e.caddy.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	// The first namespace's objects, in order; the middle one is lost.
	var keys []string
	ns := ""
	for _, o := range first {
		k := strings.TrimPrefix(o.Key, fhPrefix)
		if parts := strings.Split(k, "/"); ns == "" || parts[1] == ns {
			ns = parts[1]
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	if len(keys) < 3 {
		t.Fatalf("WAL objects %v of the first process; want one per append at least", keys)
	}
	lost := keys[len(keys)/2]
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := e.v.Client().DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(fhPrefix + lost)}); err != nil {
		t.Fatalf("delete %s: %v", lost, err)
	}

	err := e.caddy.TryRestart()
	if err == nil {
		got, _, rerr := e.readBytes(path)
		t.Fatalf("Caddy started with %s lost below its namespace's seal; %s reads %q (%v)", lost, path, got, rerr)
	}
	logs := e.caddy.Logs()
	if !strings.Contains(logs, lost) || !strings.Contains(logs, "missing") {
		t.Fatalf("the refused start (%v) does not name the missing %s: %s", err, lost, logs)
	}
	t.Logf("the refused start: %v", fmt.Sprint(err))
}

// TestRestoredOldManifestStopsTheStart: through Caddy on versitygw, the
// manifest is put back to a copy from before the last start (an operator
// restoring a backup), so its next namespace number is the one the last
// process wrote its WAL under. The start refuses, naming the object found
// there, rather than writing a new WAL over the old one's keys, where an
// upload meeting an old object could be taken for landed.
func TestRestoredOldManifestStopsTheStart(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1h"}})
	const path, ct = "/walgap/restored", "text/plain"
	e.create(path, ct)
	e.append(path, ct, []byte("a;"))
	if err := e.caddy.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	old, err := e.get("manifest")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.caddy.TryRestart(); err != nil {
		t.Fatalf("restart: %v", err)
	}
	e.append(path, ct, []byte("b;"))
	if err := e.caddy.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	fhPutRaw(t, e, "manifest", old)

	err = e.caddy.TryRestart()
	if err == nil {
		resp := e.must(fhReq{Method: "POST", Path: path, Header: map[string]string{"Content-Type": ct}, Body: []byte("c;")})
		got, _, rerr := e.readBytes(path)
		t.Fatalf("Caddy started on the restored manifest; an append answered %s, and %s reads %q (%v)", resp, path, got, rerr)
	}
	logs := e.caddy.Logs()
	if !strings.Contains(logs, "older copy") || !strings.Contains(logs, "wal/") {
		t.Fatalf("the refused start (%v) does not say why: %s", err, logs)
	}
}

// TestLostFormatObjectStopsTheStart: through Caddy on versitygw, storage
// whose format object is gone (lost, or left out of a copy) but whose
// manifest is there is refused with the reason. The format object used to
// be written afresh as this build's version, over storage a newer build
// may have laid out differently.
func TestLostFormatObjectStopsTheStart(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	const path, ct = "/format/s", "text/plain"
	e.create(path, ct)
	e.append(path, ct, []byte("a;"))
	if err := e.caddy.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := e.v.Client().DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(fhPrefix + "format")}); err != nil {
		t.Fatalf("delete the format object: %v", err)
	}
	err := e.caddy.TryRestart()
	if err == nil {
		t.Fatal("Caddy started on storage that lost its format object")
	}
	if logs := e.caddy.Logs(); !strings.Contains(logs, "no format object") {
		t.Fatalf("the refused start (%v) does not say why: %s", err, logs)
	}
	if _, gerr := e.get("format"); gerr == nil {
		t.Fatal("the refused start wrote a format object")
	}
}

// TestRestartsDoNotListSealedEmptyNamespaces: through Caddy on versitygw,
// restarts faster than the first compaction (a crash loop) leave a
// namespace each in the manifest, sealed with nothing to replay. A start
// lists none of them; each used to be listed at every start, so a start
// cost a LIST per restart that came before it.
func TestRestartsDoNotListSealedEmptyNamespaces(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1h"}})
	const restarts = 5
	for range restarts {
		e.caddy.Kill()
		if err := e.caddy.TryRestart(); err != nil {
			t.Fatalf("restart: %v", err)
		}
	}
	e.caddy.Kill()
	before := e.proxy.Counts().Containing(testenv.OpList, "/wal/")
	if err := e.caddy.TryRestart(); err != nil {
		t.Fatalf("restart: %v", err)
	}
	e.create("/crashloop/s", "text/plain") // the start is done
	lists := e.proxy.Counts().Containing(testenv.OpList, "/wal/") - before
	t.Logf("the start after %d restarts listed wal/ %d times", restarts, lists)
	// The previous start's namespace, not sealed yet, and the new one's,
	// checked free.
	if lists > 2 {
		t.Fatalf("the start after %d restarts listed wal/ %d times; want at most 2", restarts, lists)
	}
}
