package integration

import (
	"encoding/hex"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"
)

// TestDamagedObjectsAnswer500NamingThem: a compacted data object whose
// bytes rot in the bucket, one holding another object's records (a sound
// copy restored under the wrong name), and a stream's metadata object cut
// short, are
// answered as a damaged WAL entry is: a 500 whose reason names the object,
// one error log line and one count in
// picomq_damaged_objects_total however many reads meet it, and the
// records before the damage still read. Before, each was a bare
// "internal error" 500 with an error log line per request; the misnamed
// object had a read of it spin on the records it was given for ever.
func TestDamagedObjectsAnswer500NamingThem(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"pack_below off", "merge_below off", "compact_interval 200ms"}})
	const ct = "text/plain"
	const data, moved, meta = "/dmgobj/data", "/dmgobj/moved", "/dmgobj/meta"
	e.create(data, ct)
	e.create(moved, ct)
	e.create(meta, ct)
	e.append(meta, ct, []byte("m0;"))
	// Two compactions: a data object for each record.
	for _, body := range []string{"d0;", "d1;"} {
		e.append(data, ct, []byte(body))
		e.append(moved, ct, []byte(body))
		if err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
			if wal := e.mustList("wal/"); len(wal) > 0 {
				return fmt.Errorf("WAL objects %v", wal)
			}
			return nil
		}); err != nil {
			t.Fatalf("the WAL was not retired: %v", err)
		}
	}
	// The WAL is retired: a restart replays nothing, and the records are
	// in the data objects only.
	if err := e.caddy.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	// The data objects of d0; and d1; of each stream with two (a
	// stream's keys sort by their records' seqs).
	byStream := map[string][]string{}
	for _, o := range e.mustList("data/") {
		id := strings.Split(o.Key, "/")[1]
		byStream[id] = append(byStream[id], o.Key)
	}
	objectsOf := func(name string) []string {
		t.Helper()
		id := e.streamID(name)
		if keys := byStream[id]; len(keys) == 2 {
			return keys
		}
		t.Fatalf("data objects %v; want two of %s (id %s), one per compacted append", byStream, name, id)
		return nil
	}
	dataKey := objectsOf(data)[1]
	obj, err := e.get(dataKey)
	if err != nil {
		t.Fatal(err)
	}
	obj[len(obj)-2] ^= 0x40
	fhPutRaw(t, e, dataKey, obj)
	movedKeys := objectsOf(moved)
	first, err := e.get(movedKeys[0])
	if err != nil {
		t.Fatal(err)
	}
	movedKey := movedKeys[1]
	fhPutRaw(t, e, movedKey, first)
	metaKey := "streams/" + hex.EncodeToString([]byte(meta)) + ".m"
	m, err := e.get(metaKey)
	if err != nil {
		t.Fatal(err)
	}
	fhPutRaw(t, e, metaKey, m[:len(m)/2])
	// A restart: nothing of either is in memory any more.
	if err := e.caddy.TryRestart(); err != nil {
		t.Fatalf("restart: %v", err)
	}

	var next string
	for _, name := range []string{data, moved} {
		resp := e.must(fhReq{Method: http.MethodGet, Path: name + "?offset=-1"})
		next = resp.Header.Get("Stream-Next-Offset")
		if resp.Status != http.StatusOK || string(resp.Body) != "d0;" || resp.Header.Get("Stream-Up-To-Date") == "true" {
			t.Fatalf("a read of %s from the start: %s; want the record before the damage", name, resp)
		}
	}
	for _, tt := range []struct {
		name, path, key string
	}{
		{"data object, Durable Streams", data + "?offset=" + url.QueryEscape(next), dataKey},
		{"data object, again", data + "?offset=" + url.QueryEscape(next), dataKey},
		{"misnamed data object", moved + "?offset=" + url.QueryEscape(next), movedKey},
		{"misnamed data object, again", moved + "?offset=" + url.QueryEscape(next), movedKey},
		{"metadata, Durable Streams", meta + "?offset=-1", metaKey},
		{"metadata, again", meta + "?offset=-1", metaKey},
	} {
		resp := e.must(fhReq{Method: http.MethodGet, Path: tt.path})
		if resp.Status != http.StatusInternalServerError || !strings.Contains(string(resp.Body), "damaged") ||
			!strings.Contains(string(resp.Body), tt.key) {
			t.Errorf("%s: %s; want 500 naming the damage and %s", tt.name, resp, tt.key)
		}
	}
	t.Logf("a read of the damaged data object: %s", e.must(fhReq{Method: http.MethodGet, Path: data + "?offset=" + url.QueryEscape(next)}))

	logs := e.caddy.Logs()
	if n := strings.Count(logs, "stored object damaged"); n != 3 {
		t.Errorf("%d log lines of damaged objects; want 3 (one per object)", n)
	}
	if n := strings.Count(logs, "request failed"); n != 0 {
		t.Errorf("%d \"request failed\" log lines; want none", n)
	}
	metrics, err := mGet(e.caddy.AdminAddr())
	if err != nil {
		t.Fatal(err)
	}
	if got := metrics.sum("picomq_damaged_objects_total"); got != 3 {
		t.Errorf("picomq_damaged_objects_total = %v, want 3", got)
	}
}
