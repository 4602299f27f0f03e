package integration

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
	"github.com/picomq/caddy-picomq/segment"
)

// TestDamagedWALObjectIsConfinedToItsStream: a WAL object whose bytes rot
// in the bucket, where compaction must read them back (the 4 KiB cache
// lost them), costs only the stream whose entry is damaged. The other
// streams compact and read as before, the WAL before the object is
// retired, and a reader of the damaged stream gets a 500 that names the
// object, while its records after the damage still read. A restart then
// refuses to start, naming the object, and starts once it is restored,
// every acknowledged record there. Compaction used to fail as a whole on
// the object, at every pass: no stream compacted, no WAL retired, however
// long the node ran.
func TestDamagedWALObjectIsConfinedToItsStream(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	directives := []string{"cache_size 4KiB", "compact_interval 1h"}
	e := fhStart(t, fhOptions{Directives: directives})
	const ct = "text/plain"
	const bad, good, fill = "/damaged/bad", "/damaged/good", "/damaged/fill"
	for _, p := range []string{bad, good, fill} {
		e.create(p, ct)
	}
	e.append(good, ct, []byte("g0;"))
	e.append(bad, ct, []byte("b0;"))
	afterDamage := e.append(bad, ct, []byte("b1;"))
	e.append(good, ct, []byte("g1;"))
	e.append(bad, ct, []byte("b2;"))
	// Push every entry above out of the 4 KiB cache.
	for i := range 8 {
		e.append(fill, ct, bytes.Repeat([]byte{'a' + byte(i)}, 1<<10))
	}

	key, original := fhDamageAndCompact(t, e, bad, "b1;")
	metrics := func() (damaged, compacted float64) {
		t.Helper()
		m, err := mGet(e.caddy.AdminAddr())
		if err != nil {
			t.Fatal(err)
		}
		return m.sum("picomq_wal_damaged_entries_total"),
			m.sum("picomq_compaction_folds_total") + m.sum("picomq_compaction_packed_total")
	}
	damaged, compacted := metrics()
	if damaged != 1 {
		t.Errorf("picomq_wal_damaged_entries_total = %v, want 1", damaged)
	}

	for p, want := range map[string]string{good: "g0;g1;", fill: "abcdefgh"} {
		got, _, err := e.readBytes(p)
		if err != nil {
			t.Fatalf("read %s: %v", p, err)
		}
		if p == fill {
			got = fhRunsOf(got)
		}
		if string(got) != want {
			t.Fatalf("%s reads %q, want %q", p, got, want)
		}
	}
	// A reader gets the records before the damage, then a 500 that says
	// what is wrong.
	resp := e.must(fhReq{Method: http.MethodGet, Path: bad + "?offset=-1"})
	next := resp.Header.Get("Stream-Next-Offset")
	if resp.Status != http.StatusOK || string(resp.Body) != "b0;" || resp.Header.Get("Stream-Up-To-Date") == "true" {
		t.Fatalf("a read of %s from the start: %s; want the record before the damage", bad, resp)
	}
	resp = e.must(fhReq{Method: http.MethodGet, Path: bad + "?offset=" + url.QueryEscape(next)})
	if resp.Status != http.StatusInternalServerError || !strings.Contains(string(resp.Body), "damaged") ||
		!strings.Contains(string(resp.Body), key) {
		t.Fatalf("a read of %s from the damage: %s; want 500 naming the damage and %s", bad, resp, key)
	}
	t.Logf("a read of the damaged stream: %s", resp)
	chunks, _, err := e.readFrom(bad, afterDamage)
	if err != nil || string(bytes.Join(chunks, nil)) != "b2;" {
		t.Fatalf("%s after the damage reads %q (%v), want %q", bad, bytes.Join(chunks, nil), err, "b2;")
	}

	// Both streams take appends, and the others keep compacting.
	e.append(bad, ct, []byte("b3;"))
	e.append(good, ct, []byte("g2;"))
	err = fhWaitFor(fhCompactWait, 200*time.Millisecond, func() error {
		if _, now := metrics(); now <= compacted {
			return fmt.Errorf("compacted %v streams, as before the appends", now)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("no stream compacted after the damage: %v", err)
	}
	if got, _, err := e.readBytes(good); err != nil || string(got) != "g0;g1;g2;" {
		t.Fatalf("%s reads %q (%v)", good, got, err)
	}
	if n := strings.Count(e.caddy.Logs(), "WAL entry damaged"); n != 1 {
		t.Errorf("the damage was logged %d times, want once", n)
	}

	// A restart cannot tell what the damaged entry held: it refuses, and
	// says which object to restore.
	if err := e.caddy.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	err = e.caddy.TryRestart()
	if err == nil {
		t.Fatal("Caddy started with a damaged WAL object to replay")
	}
	if msg := err.Error() + e.caddy.Logs(); !strings.Contains(msg, "damaged") || !strings.Contains(msg, key) {
		t.Fatalf("the failed start does not name the damage and %s: %v", key, err)
	}
	fhPutRaw(t, e, key, original)
	if err := e.caddy.TryRestart(); err != nil {
		t.Fatalf("start with the object restored: %v", err)
	}
	if got, _, err := e.readBytes(bad); err != nil || string(got) != "b0;b1;b2;b3;" {
		t.Fatalf("%s with the object restored reads %q (%v)", bad, got, err)
	}
}

// fhWALEntry is a WAL object's body and the span of one entry in it.
type fhWALEntry struct {
	data []byte
	span segment.Span
}

// fhFindWALEntry returns the key of the WAL object holding the entry of
// stream path whose one record is body, and the object with the entry's
// span.
func fhFindWALEntry(t *testing.T, e *fhEnv, path, body string) (string, fhWALEntry) {
	t.Helper()
	for _, o := range e.mustList("wal/") {
		data, err := e.get(o.Key)
		if err != nil {
			t.Fatal(err)
		}
		obj, err := segment.DecodeWAL(data)
		if err != nil {
			t.Fatalf("%s: %v", o.Key, err)
		}
		for i, ent := range obj.Entries {
			if strings.HasSuffix(ent.Name, path) && len(ent.Records) == 1 && string(ent.Records[0].Body) == body {
				return o.Key, fhWALEntry{data: data, span: obj.Spans[i]}
			}
		}
	}
	t.Fatalf("no WAL object holds %q of %s", body, path)
	return "", fhWALEntry{}
}

// fhPutRaw writes data at key (relative to the module's prefix) straight
// into the bucket, past the proxy, as a fault of the storage would.
func fhPutRaw(t *testing.T, e *fhEnv, key string, data []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err := e.v.Client().PutObject(ctx, &s3.PutObjectInput{
		Bucket: aws.String(e.bucket), Key: aws.String(fhPrefix + key), Body: bytes.NewReader(data),
	})
	if err != nil {
		t.Fatalf("put %s: %v", key, err)
	}
}

// fhRunsOf collapses runs of one byte to one: "aaabb" is "ab".
func fhRunsOf(b []byte) []byte {
	var out []byte
	for i, c := range b {
		if i == 0 || c != b[i-1] {
			out = append(out, c)
		}
	}
	return out
}

// fhDamagedStreams starts Caddy with streams bad ("b0;b1;"), good
// ("g0;g1;") and fill (1 KiB of each of "a" to "h"), flips a byte of
// bad's entry "b1;" in its WAL object, out of the cache, and turns
// compaction on (every second); it returns once the WAL before the
// damaged object is retired, with the object's key and its bytes as
// they were.
func fhDamagedStreams(t *testing.T, bad, good, fill string) (e *fhEnv, key string, original []byte) {
	t.Helper()
	e = fhStart(t, fhOptions{Directives: []string{"cache_size 4KiB", "compact_interval 1h"}})
	const ct = "text/plain"
	for _, p := range []string{bad, good, fill} {
		e.create(p, ct)
	}
	e.append(good, ct, []byte("g0;"))
	e.append(bad, ct, []byte("b0;"))
	e.append(bad, ct, []byte("b1;"))
	e.append(good, ct, []byte("g1;"))
	for i := range 8 {
		e.append(fill, ct, bytes.Repeat([]byte{'a' + byte(i)}, 1<<10))
	}
	key, original = fhDamageAndCompact(t, e, bad, "b1;")
	return e, key, original
}

// fhDamageAndCompact flips a byte of stream's entry body in its WAL
// object, which must be out of the cache, and turns compaction on (every
// second, with a 4 KiB cache); it returns once the WAL before the damaged
// object is retired, with the object's key and its bytes as they were.
func fhDamageAndCompact(t *testing.T, e *fhEnv, stream, body string) (key string, original []byte) {
	t.Helper()
	key, obj := fhFindWALEntry(t, e, stream, body)
	original = bytes.Clone(obj.data)
	obj.data[obj.span.Off+obj.span.Len-2] ^= 0x40
	fhPutRaw(t, e, key, obj.data)

	opts := caddytest.Options{Storage: testenv.StoreURL(e.proxy.URL(), e.bucket, caddytest.S3Prefix),
		Directives: []string{"cache_size 4KiB", "compact_interval 1s"}}
	if err := e.reload(e.caddy.Config(opts)); err != nil {
		t.Fatalf("reload: %v", err)
	}
	err := fhWaitFor(fhCompactWait, 200*time.Millisecond, func() error {
		if wal := e.mustList("wal/"); len(wal) == 0 || wal[0].Key != key {
			return fmt.Errorf("WAL objects %v, want them to start at the damaged %s", wal, key)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("the WAL before the damaged object was not retired: %v", err)
	}
	return key, original
}

// fhWaitWALPast waits, a compaction interval at a time, until the WAL
// object key has been retired, and says what the WAL still holds if it
// is not within fhCompactWait.
func fhWaitWALPast(e *fhEnv, key string) error {
	return fhWaitFor(fhCompactWait, 200*time.Millisecond, func() error {
		if wal := e.mustList("wal/"); fhKeySet(wal)[key] {
			return fmt.Errorf("%s is still in the WAL (%d objects)", key, len(wal))
		}
		return nil
	})
}

// TestDeletingTheDamagedStreamReleasesTheWAL: the WAL kept from a damaged
// object on, for the one stream whose entry there is damaged, is retired
// past it once that stream is deleted (the delete takes the stream out of
// those a compaction holds the WAL for). The other streams keep every
// record, and a restart, with no damaged object left to replay, starts.
func TestDeletingTheDamagedStreamReleasesTheWAL(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const ct = "text/plain"
	const bad, good, fill = "/damaged/bad", "/damaged/good", "/damaged/fill"
	e, key, _ := fhDamagedStreams(t, bad, good, fill)

	if resp := e.must(fhReq{Method: http.MethodDelete, Path: bad}); resp.Status != http.StatusNoContent {
		t.Fatalf("DELETE %s: %s", bad, resp)
	}
	e.append(good, ct, []byte("g2;"))
	if err := fhWaitWALPast(e, key); err != nil {
		t.Fatalf("the WAL was not retired past the damage once its stream was deleted: %v", err)
	}
	if got, _, err := e.readBytes(good); err != nil || string(got) != "g0;g1;g2;" {
		t.Fatalf("%s reads %q (%v)", good, got, err)
	}

	if err := e.caddy.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if err := e.caddy.TryRestart(); err != nil {
		t.Fatalf("start after the damaged stream was deleted: %v", err)
	}
	if got, _, err := e.readBytes(good); err != nil || string(got) != "g0;g1;g2;" {
		t.Fatalf("%s after the restart reads %q (%v)", good, got, err)
	}
	if got, _, err := e.readBytes(fill); err != nil || string(fhRunsOf(got)) != "abcdefgh" {
		t.Fatalf("%s after the restart reads %q (%v)", fill, fhRunsOf(got), err)
	}
	if resp := e.must(fhReq{Method: http.MethodGet, Path: bad + "?offset=-1"}); resp.Status != http.StatusNotFound {
		t.Fatalf("%s after the restart: %s, want 404", bad, resp)
	}
}

// TestRestoredWALObjectIsPickedUpWithoutARestart: a damaged WAL object
// restored in place (from a versioned bucket or a backup) is found by a
// compaction, which reads the damaged entry again once a compaction
// interval: the stream is compacted past it, the WAL retired past it, and
// every record reads, with no restart. The damage used to hold the WAL,
// and fail reads of the stream from there, until a restart.
func TestRestoredWALObjectIsPickedUpWithoutARestart(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const ct = "text/plain"
	const bad, good, fill = "/damaged/bad", "/damaged/good", "/damaged/fill"
	e, key, original := fhDamagedStreams(t, bad, good, fill)
	e.append(bad, ct, []byte("b2;"))
	if resp := e.must(fhReq{Method: http.MethodGet, Path: bad + "?offset=-1"}); string(resp.Body) != "b0;" {
		t.Fatalf("a read of %s from the start with the object damaged: %s; want the record before the damage", bad, resp)
	}

	fhPutRaw(t, e, key, original)
	if err := fhWaitWALPast(e, key); err != nil {
		t.Fatalf("the WAL was not retired past the object once it was restored: %v", err)
	}
	if got, _, err := e.readBytes(bad); err != nil || string(got) != "b0;b1;b2;" {
		t.Fatalf("%s after the restore reads %q (%v)", bad, got, err)
	}
	if got, _, err := e.readBytes(good); err != nil || string(got) != "g0;g1;" {
		t.Fatalf("%s reads %q (%v)", good, got, err)
	}
	if !strings.Contains(e.caddy.Logs(), "reads back clean") {
		t.Errorf("the restore was not logged")
	}
	t.Logf("GETs of the damaged object through the test: %d", e.proxy.Counts().Containing(testenv.OpGet, key))
}
