package integration

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"path"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

const (
	forkMiB      = 1 << 20
	forkRecords  = 100 // 1 MiB appends in the source
	forkAtRecord = 73  // the fork divides this record of the source
	forkSubBytes = 12345
)

// forkSrcByte is the source's byte at position pos: printable, and not
// periodic at any record boundary, so a byte served from the wrong place
// shows.
func forkSrcByte(pos int64) byte {
	x := uint64(pos) * 0x9e3779b97f4a7c15
	x ^= x >> 29
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 32
	return 'a' + byte(x%26)
}

// forkSrc returns the source's bytes [from, to).
func forkSrc(from, to int64) []byte {
	b := make([]byte, to-from)
	for i := range b {
		b[i] = forkSrcByte(from + int64(i))
	}
	return b
}

// forkDataIDs returns the internal ids that have data objects or blobs
// (appends of 256 KiB and more), with the bytes each holds.
func forkDataIDs(objs []fhObject) map[string]int64 {
	ids := map[string]int64{}
	for _, o := range objs {
		rest, ok := strings.CutPrefix(o.Key, "data/")
		if !ok {
			rest, ok = strings.CutPrefix(o.Key, "blob/")
		}
		if !ok {
			continue
		}
		id, _, _ := strings.Cut(rest, "/")
		ids[id] += o.Size
	}
	return ids
}

// forkObjectSpans maps each of objs, data objects, blob markers and blobs
// of one stream, to the records [first, end) it holds; a blob has its
// marker's, and one with none yet (its WAL entry not folded) is an error.
func forkObjectSpans(objs []fhObject) (map[string][2]uint64, error) {
	spans := make(map[string][2]uint64, len(objs))
	byBlob := make(map[string][2]uint64)
	for _, o := range objs {
		if !strings.HasPrefix(o.Key, "data/") {
			continue
		}
		parts := strings.SplitN(path.Base(o.Key), ".", 3)
		end, err1 := strconv.ParseUint(parts[0], 10, 64)
		first, err2 := strconv.ParseUint(parts[min(1, len(parts)-1)], 10, 64)
		if len(parts) < 2 || err1 != nil || err2 != nil {
			return nil, fmt.Errorf("data key %s does not parse", o.Key)
		}
		spans[o.Key] = [2]uint64{first, end}
		if len(parts) == 3 {
			byBlob[parts[2]] = spans[o.Key]
		}
	}
	for _, o := range objs {
		if strings.HasPrefix(o.Key, "blob/") {
			sp, ok := byBlob[path.Base(o.Key)]
			if !ok {
				return nil, fmt.Errorf("blob %s has no marker yet", o.Key)
			}
			spans[o.Key] = sp
		}
	}
	return spans, nil
}

func forkSum(objs []fhObject) int64 {
	var n int64
	for _, o := range objs {
		n += o.Size
	}
	return n
}

// TestForkLargeStream forks a stream holding 100 MiB in the middle of one
// of its records. The fork request must upload at most 64 KiB: the fork
// references the source's data instead of copying it. The fork then reads
// the source's bytes up to the fork point followed by its own appends,
// also after a crash and restart and after the source was deleted (which
// answers 410 on the source, and deletes the source's records past the
// fork's point), and deleting the fork at last removes the source's data
// from the bucket.
func TestForkLargeStream(t *testing.T) {
	if testing.Short() {
		t.Skip("writes 100 MiB through Caddy")
	}
	began := time.Now()
	// grave_time 1s: the collector finishes with the deleted streams,
	// graves and tombstones, inside the test's wait.
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 2s", "grave_time 1s"}})
	cl := newClient(t, e.caddy.URL(), true)
	const src, fork = "/fork-large/src", "/fork-large/fork"
	e.create(src, textPlain)

	// offs[i] is the Stream-Next-Offset of append i: where record i+1
	// starts.
	offs := make([]string, forkRecords)
	for i := range offs {
		body := forkSrc(int64(i)*forkMiB, int64(i+1)*forkMiB)
		offs[i] = e.append(src, textPlain, body)
		if i > 0 && offs[i] <= offs[i-1] {
			t.Fatalf("append %d: Stream-Next-Offset %s not after %s", i, offs[i], offs[i-1])
		}
	}
	wrote := time.Since(began)

	// Let compaction fold the source into data objects and retire its WAL,
	// so the source's data has a home the test can watch.
	var srcID string
	if err := fhWaitFor(90*time.Second, 500*time.Millisecond, func() error {
		data, err := e.list("data/")
		if err != nil {
			return err
		}
		blobs, err := e.list("blob/")
		if err != nil {
			return err
		}
		data = append(data, blobs...)
		wal, err := e.list("wal/")
		if err != nil {
			return err
		}
		ids := forkDataIDs(data)
		if len(ids) != 1 {
			return fmt.Errorf("data objects of %d streams, want the source's only: %v", len(ids), ids)
		}
		for id, n := range ids {
			srcID = id
			if n < forkRecords*forkMiB {
				return fmt.Errorf("data objects hold %d bytes, want at least %d", n, forkRecords*forkMiB)
			}
		}
		if w := forkSum(wal); w >= forkMiB {
			return fmt.Errorf("WAL objects still hold %d bytes", w)
		}
		return nil
	}); err != nil {
		t.Fatalf("compaction of the source: %v", err)
	}
	srcData := append(e.mustList("data/"+srcID+"/"), e.mustList("blob/"+srcID+"/")...)
	compacted := time.Since(began)

	// The fork: at record forkAtRecord's start plus forkSubBytes.
	forkLen := int64(forkAtRecord)*forkMiB + forkSubBytes
	before := e.proxy.Counts()
	resp := e.must(fhReq{Method: http.MethodPut, Path: fork, Header: map[string]string{
		"Content-Type":           textPlain,
		"Stream-Forked-From":     src,
		"Stream-Fork-Offset":     offs[forkAtRecord-1],
		"Stream-Fork-Sub-Offset": strconv.Itoa(forkSubBytes),
	}})
	after := e.proxy.Counts()
	if resp.Status != http.StatusCreated {
		t.Fatalf("PUT %s forked from %s at %s+%d: %s, want 201", fork, src, offs[forkAtRecord-1], forkSubBytes, resp)
	}
	forkPut := after.BytesPut - before.BytesPut
	t.Logf("fork request: %s, %d PUTs, %d bytes PUT:%s", resp.Took.Round(time.Millisecond),
		after.Put-before.Put, forkPut, fhSortedKeys(fhWrites(before, after)))
	if forkPut > 64<<10 {
		t.Errorf("forking a %d MiB stream uploaded %d bytes, want at most 64 KiB", forkRecords, forkPut)
	}

	own := []byte("fork append 0\nfork append 1\nfork append 2\n")
	for _, line := range bytes.SplitAfter(own, []byte("\n")) {
		if len(line) > 0 {
			e.append(fork, textPlain, line)
		}
	}
	// want returns the fork's bytes [from, to).
	want := func(from, to int64) []byte {
		var b []byte
		if from < forkLen {
			b = forkSrc(from, min(to, forkLen))
		}
		if to > forkLen {
			b = append(b, own[max(from, forkLen)-forkLen:to-forkLen]...)
		}
		return b
	}
	forkTotal := forkLen + int64(len(own))

	// spotCheck reads the fork from the start of source record rec (0:
	// the beginning) for at least limit bytes (-1: to the tail) and
	// compares what arrives.
	spotCheck := func(when string, rec int, limit int) {
		t.Helper()
		off := "-1"
		if rec > 0 {
			off = offs[rec-1]
		}
		got, next, err := cl.readRange(fork, off, limit, time.Minute)
		if err != nil {
			t.Fatalf("%s: reading the fork from record %d: %v", when, rec, err)
		}
		from := int64(rec) * forkMiB
		to := min(from+int64(len(got)), forkTotal)
		exp := want(from, to)
		if !bytes.Equal(got, exp) {
			i := firstDiff(got, exp)
			t.Errorf("%s: fork from record %d: %d bytes, want %d; first difference at +%d: got %s, want %s",
				when, rec, len(got), len(exp), i, around(got, i), around(exp, i))
		}
		if limit < 0 && int64(len(got)) != forkTotal-from {
			t.Errorf("%s: fork read from record %d to its tail %s gave %d bytes, want %d", when, rec, next, len(got), forkTotal-from)
		}
	}
	checks := func(when string) {
		spotCheck(when, 0, 256<<10)
		spotCheck(when, 37, forkMiB+1)
		spotCheck(when, forkAtRecord-2, -1)
	}
	checks("after the fork")
	// The source itself is untouched by the fork.
	if got, _, err := cl.readRange(src, offs[forkAtRecord-1], forkMiB, time.Minute); err != nil {
		t.Errorf("reading the source after the fork: %v", err)
	} else if exp := forkSrc(forkAtRecord*forkMiB, forkAtRecord*forkMiB+int64(len(got))); !bytes.Equal(got, exp) {
		t.Errorf("source record %d after the fork: differs at +%d", forkAtRecord, firstDiff(got, exp))
	}

	// A crash and restart: the fork is in the bucket.
	e.caddy.Kill()
	e.caddy.Restart()
	checks("after a restart")
	forkTail, err := cl.tail(fork, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	full, tail, err := cl.readAll(fork, 2*time.Minute)
	if err != nil {
		t.Fatalf("reading the whole fork after the restart: %v", err)
	}
	if exp := want(0, forkTotal); !bytes.Equal(full, exp) {
		i := firstDiff(full, exp)
		t.Errorf("whole fork after the restart: %d bytes, want %d; first difference at %d", len(full), len(exp), i)
	}
	if tail != forkTail {
		t.Errorf("fork: read ended at %s, HEAD says %s", tail, forkTail)
	}

	// Deleting the source while the fork exists. Its objects are listed
	// now that every blob has its marker (srcData was listed once the
	// bytes were in, blobs before their markers).
	var srcObjs []fhObject
	var spans map[string][2]uint64
	if err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
		var err error
		srcObjs = append(e.mustList("data/"+srcID+"/"), e.mustList("blob/"+srcID+"/")...)
		spans, err = forkObjectSpans(srcObjs)
		return err
	}); err != nil {
		t.Fatalf("before deleting the source: %v", err)
	}
	beforeDelete := e.proxy.Counts()
	resp = e.must(fhReq{Method: http.MethodDelete, Path: src})
	if resp.Status/100 != 2 {
		t.Fatalf("DELETE %s: %s", src, resp)
	}
	for _, q := range []string{"?offset=-1", "?offset=" + offs[10]} {
		if r := e.must(fhReq{Method: http.MethodGet, Path: src + q}); r.Status != http.StatusGone {
			t.Errorf("GET %s%s after deleting it while a fork exists: %s, want 410", src, q, r)
		}
	}
	if r := e.must(fhReq{Method: http.MethodHead, Path: src}); r.Status != http.StatusGone {
		t.Errorf("HEAD %s after deleting it while a fork exists: %d, want 410", src, r.Status)
	}
	// Compaction passes and the collector run after the delete: the
	// source's data must stay while the fork references it. Waited for,
	// not slept for: a fixed pause could end before either ran. Each
	// compaction pass given work ends with a manifest write (an idle one
	// writes nothing), so each is given an append of its own. The
	// source's delete is soft (its fork reads it) and need not kick the
	// collector: the delete of a stream of its own does, and the pass
	// lists the tombstones.
	e.create("/fork-gc-ticks", "text/plain")
	manifestPuts := func() int {
		return e.proxy.Counts().Containing(testenv.OpPut, fhManifestKey) - beforeDelete.Containing(testenv.OpPut, fhManifestKey)
	}
	for pass := 1; pass <= 2; pass++ {
		e.append("/fork-gc-ticks", "text/plain", []byte("tick"))
		if err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
			if n := manifestPuts(); n < pass {
				return fmt.Errorf("%d compaction passes since the delete, want %d", n, pass)
			}
			return nil
		}); err != nil {
			t.Fatalf("after deleting the source: %v: nothing tested", err)
		}
	}
	e.create("/fork-gc-kick", "text/plain")
	if r := e.must(fhReq{Method: http.MethodDelete, Path: "/fork-gc-kick"}); r.Status/100 != 2 {
		t.Fatalf("DELETE /fork-gc-kick: %s", r)
	}
	if err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
		if n := e.proxy.Counts().Containing(testenv.OpList, "gc/") - beforeDelete.Containing(testenv.OpList, "gc/"); n < 1 {
			return fmt.Errorf("no collector pass since the delete")
		}
		return nil
	}); err != nil {
		t.Fatalf("after deleting the source: %v: nothing tested", err)
	}
	// What the fork reads, records [0, forkAtRecord], stays; the records
	// past its point go, in the background after the delete.
	var kept map[string]bool
	if err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
		kept = fhKeySet(append(e.mustList("data/"+srcID+"/"), e.mustList("blob/"+srcID+"/")...))
		for _, o := range srcObjs {
			if spans[o.Key][0] > forkAtRecord && kept[o.Key] {
				return fmt.Errorf("source object %s, records %v past the fork's point, is still there", o.Key, spans[o.Key])
			}
		}
		return nil
	}); err != nil {
		t.Errorf("after deleting the source: %v", err)
	}
	for _, o := range srcObjs {
		if spans[o.Key][0] <= forkAtRecord && !kept[o.Key] {
			t.Errorf("source data object %s, records %v, removed while the fork still reads it", o.Key, spans[o.Key])
		}
	}
	checks("after deleting the source")

	// Deleting the fork releases the source's data.
	resp = e.must(fhReq{Method: http.MethodDelete, Path: fork})
	if resp.Status/100 != 2 {
		t.Fatalf("DELETE %s: %s", fork, resp)
	}
	if r := e.must(fhReq{Method: http.MethodGet, Path: fork + "?offset=-1"}); r.Status == http.StatusOK {
		t.Errorf("GET %s after deleting it: %s", fork, r)
	}
	var left []fhObject
	if err := fhWaitFor(60*time.Second, 500*time.Millisecond, func() error {
		all, err := e.list("")
		if err != nil {
			return err
		}
		left = left[:0]
		for _, o := range all {
			if strings.HasPrefix(o.Key, "data/"+srcID+"/") || strings.HasPrefix(o.Key, "blob/"+srcID+"/") || strings.HasPrefix(o.Key, "gc/") {
				left = append(left, o)
			}
		}
		if len(left) > 0 {
			return fmt.Errorf("%d objects of the deleted streams left (%d bytes), e.g. %s", len(left), forkSum(left), left[0].Key)
		}
		if n := forkSum(all); n >= forkMiB {
			sort.Slice(all, func(i, j int) bool { return all[i].Size > all[j].Size })
			return fmt.Errorf("the bucket still holds %d bytes, largest %s (%d)", n, all[0].Key, all[0].Size)
		}
		return nil
	}); err != nil {
		t.Errorf("after deleting the fork: %v", err)
	}
	t.Logf("fork of %d MiB: source written in %s, compacted by %s into %d data objects; fork PUT %d bytes; whole test %s",
		forkRecords, wrote.Round(time.Millisecond), compacted.Round(time.Millisecond), len(srcData), forkPut,
		time.Since(began).Round(time.Millisecond))
}

// TestForkReleaseDropsKeptTrims: records a trim dropped while a fork read
// them stay in the bucket for the fork, and leave it once the last fork is
// deleted, though the source is never written again. (Compaction drops
// trimmed bytes when it folds a stream, and an idle source was never
// folded again: they stayed for as long as the source lived.)
func TestForkReleaseDropsKeptTrims(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"compact_interval 1s", "pack_below off"}, nil)
	const src, fork = "/kepttrim/src", "/kepttrim/fork"
	const n, trimTo = 8, 6
	records := fhRandomRecords(91, n, 1024)
	picoWant(t, "create", picoDo(e, "PUT", "/pico"+src, nil, "Content-Type", "application/octet-stream"), 201)
	for i, r := range records {
		picoWant(t, "append", picoDo(e, "POST", "/pico"+src, r, "Content-Type", "application/octet-stream"), 200,
			"Pico-Start-Seq", strconv.Itoa(i))
	}
	e.must(fhReq{Method: http.MethodPut, Path: "/ds" + fork, Header: map[string]string{"Stream-Forked-From": "/ds" + src}})
	picoWant(t, "trim", picoDo(e, "POST", "/pico"+src, nil, "Pico-Trim-Seq", strconv.Itoa(trimTo)), 200,
		"Pico-Start-Seq", strconv.Itoa(trimTo))

	// held says which records some object in the bucket holds.
	held := func() []bool {
		objs, bodies := fhReadAll(t, e, "")
		out := make([]bool, n)
		for i, r := range records {
			for j, b := range bodies {
				if !strings.HasPrefix(objs[j].Key, "wal/") && bytes.Contains(b, r) {
					out[i] = true
				}
			}
		}
		return out
	}
	// Compaction folds the trim while the fork exists: every record is in
	// a data object, none left only in the WAL.
	if err := fhWaitFor(fhCompactWait, 250*time.Millisecond, func() error {
		if wal := e.mustList("wal/"); forkSum(wal) > 0 {
			return fmt.Errorf("WAL objects still hold %d bytes", forkSum(wal))
		}
		for i, ok := range held() {
			if !ok {
				return fmt.Errorf("record %d is in no data object", i)
			}
		}
		return nil
	}); err != nil {
		t.Fatalf("compaction with the fork present: %v", err)
	}
	if got, _, err := e.readBytes("/ds" + fork); err != nil || !bytes.Equal(got, bytes.Join(records, nil)) {
		t.Fatalf("the fork reads %d bytes (%v), want its source's %d records whole", len(got), err, n)
	}

	e.must(fhReq{Method: http.MethodDelete, Path: "/ds" + fork})
	if err := fhWaitFor(fhCompactWait, 250*time.Millisecond, func() error {
		h := held()
		for i := range trimTo {
			if h[i] {
				return fmt.Errorf("trimmed record %d is still in the bucket", i)
			}
		}
		return nil
	}); err != nil {
		t.Errorf("after the last fork went: %v", err)
	}
	h := held()
	for i := trimTo; i < n; i++ {
		if !h[i] {
			t.Errorf("kept record %d is in no object", i)
		}
	}
	got, _, err := e.readBytes("/ds" + src)
	if err != nil || !bytes.Equal(got, bytes.Join(records[trimTo:], nil)) {
		t.Errorf("the source reads %d bytes (%v), want its records from %d", len(got), err, trimTo)
	}
}

// TestForkCreateRepeatedAfterSourceChanged: a fork create repeated, as a
// client repeats a PUT whose answer it lost, is 200 whatever became of
// the source meanwhile (section 4.2): grown past the tail the omitted
// offset meant, trimmed past the fork point, deleted while the fork reads
// it. It was 409 or 410, telling the client the name held something else
// or its fork could not be made.
func TestForkCreateRepeatedAfterSourceChanged(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, nil, nil)
	const src = "/repeatfork/src"
	e.create("/ds"+src, textPlain)
	e.append("/ds"+src, textPlain, []byte("hello"))
	at := e.append("/ds"+src, textPlain, []byte(" world"))
	forks := []struct {
		name string
		hdr  map[string]string
		body string
	}{
		{"/ds/repeatfork/tail", map[string]string{"Stream-Forked-From": "/ds" + src}, "hello world"},
		{"/ds/repeatfork/at", map[string]string{"Stream-Forked-From": "/ds" + src, "Stream-Fork-Offset": at}, "hello world"},
		// Sub-offsets that reach the end of the anchor's record, or past
		// it: the fork keeps the point they resolve to, not the request's
		// numbers, so a repeat is resolved again, through trimmed records.
		{"/ds/repeatfork/sub-end", map[string]string{"Stream-Forked-From": "/ds" + src,
			"Stream-Fork-Offset": fmt.Sprintf("%016d_%016d", 0, 0), "Stream-Fork-Sub-Offset": "5"}, "hello"},
		{"/ds/repeatfork/sub-past", map[string]string{"Stream-Forked-From": "/ds" + src,
			"Stream-Fork-Offset": fmt.Sprintf("%016d_%016d", 0, 0), "Stream-Fork-Sub-Offset": "8"}, "hello wo"},
	}
	for _, f := range forks {
		if r := e.must(fhReq{Method: http.MethodPut, Path: f.name, Header: f.hdr}); r.Status != http.StatusCreated {
			t.Fatalf("PUT %s: %s", f.name, r)
		}
	}
	for _, step := range []struct {
		name string
		req  fhReq
		want int
	}{
		{"the source grew", fhReq{Method: http.MethodPost, Path: "/ds" + src, Body: []byte("!"), Header: map[string]string{"Content-Type": textPlain}}, 204},
		{"the source was trimmed past the points", fhReq{Method: http.MethodPost, Path: "/pico" + src, Header: map[string]string{"Pico-Trim-Seq": "3"}}, 200},
		{"the source was deleted", fhReq{Method: http.MethodDelete, Path: "/ds" + src}, 204},
	} {
		if r := e.must(step.req); r.Status != step.want {
			t.Fatalf("%s: %s", step.name, r)
		}
		for _, f := range forks {
			if r := e.must(fhReq{Method: http.MethodPut, Path: f.name, Header: f.hdr}); r.Status != http.StatusOK {
				t.Errorf("%s: PUT %s repeated: %s, want 200", step.name, f.name, r)
			}
			if got, _, err := e.readBytes(f.name); err != nil || string(got) != f.body {
				t.Errorf("%s: %s reads %q (%v), want %q", step.name, f.name, got, err, f.body)
			}
		}
	}
}

// TestFailedForkCreateFreesTheSource: a fork create the bucket fails
// before anything of the fork is written (its expiry marker's PUT refused)
// answers 503 and leaves its source's fork count as it was: the source's
// DELETE is then a hard one, its name free at once. The count used to
// stay raised for good, the deleted source answering 410 and its name
// 409 for as long as the bucket lived, its data never collected.
func TestFailedForkCreateFreesTheSource(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	const src, fork = "/failedfork/src", "/failedfork/fork"
	if r := e.must(fhReq{Method: http.MethodPut, Path: src, Body: []byte("hello"), Header: map[string]string{
		"Content-Type": textPlain, "Stream-TTL": "3600"}}); r.Status != http.StatusCreated {
		t.Fatalf("PUT %s: %s", src, r)
	}
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "expiry/", Status: http.StatusInternalServerError})
	r := e.must(fhReq{Method: http.MethodPut, Path: fork, Header: map[string]string{"Stream-Forked-From": src}})
	remove()
	if r.Status != http.StatusServiceUnavailable {
		t.Fatalf("fork create with its marker refused: %s, want 503", r)
	}
	if r := e.must(fhReq{Method: http.MethodHead, Path: fork}); r.Status != http.StatusNotFound {
		t.Fatalf("HEAD of the failed fork: %s", r)
	}
	if r := e.must(fhReq{Method: http.MethodDelete, Path: src}); r.Status != http.StatusNoContent {
		t.Fatalf("DELETE %s: %s", src, r)
	}
	if r := e.must(fhReq{Method: http.MethodHead, Path: src}); r.Status != http.StatusNotFound {
		t.Errorf("HEAD of the deleted source: %s, want 404 (nothing reads it)", r)
	}
	if r := e.must(fhReq{Method: http.MethodPut, Path: src, Header: map[string]string{"Content-Type": textPlain}}); r.Status != http.StatusCreated {
		t.Errorf("PUT of the deleted source's name: %s, want 201", r)
	}
}

// fhSourceWithFork creates src with the record hello, and fork forked
// from it.
func fhSourceWithFork(e *fhEnv, src, fork string) {
	e.t.Helper()
	e.create(src, textPlain)
	e.append(src, textPlain, []byte("hello"))
	e.must(fhReq{Method: http.MethodPut, Path: fork, Header: map[string]string{"Stream-Forked-From": src}})
}

// fhLoseForkRelease deletes fork with the proxy refusing every PUT whose
// key contains refuse, then kills Caddy while it retries the release and
// restarts it: whatever the release had left to do is lost with the
// process.
func fhLoseForkRelease(t *testing.T, e *fhEnv, fork, refuse string) {
	t.Helper()
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: refuse, Status: http.StatusInternalServerError})
	r := e.must(fhReq{Method: http.MethodDelete, Path: fork})
	if r.Status != http.StatusNoContent {
		remove()
		t.Fatalf("DELETE %s: %s", fork, r)
	}
	// The release failed and is being retried: the process dies with it.
	e.caddy.Kill()
	remove()
	e.caddy.Restart()
}

// fhWaitNotFound polls HEAD of path, for up to 30s, until it answers 404,
// and says what it answered last if it never does.
func fhWaitNotFound(e *fhEnv, path string) error {
	return fhWaitFor(30*time.Second, 100*time.Millisecond, func() error {
		if r := e.must(fhReq{Method: http.MethodHead, Path: path}); r.Status != http.StatusNotFound {
			return fmt.Errorf("HEAD %s: %s", path, r)
		}
		return nil
	})
}

// TestFailedForkReleaseIsRetried: a fork's DELETE during which the bucket
// refuses the lowering of its source's fork count still answers 204 (the
// fork is gone), and the count comes down in the background once the
// bucket answers: the source's DELETE then removes it. The count stayed
// raised for good, the deleted source answering 410 and its name taken
// for as long as the bucket lived.
func TestFailedForkReleaseIsRetried(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	const src, fork = "/failedrelease/src", "/failedrelease/fork"
	fhSourceWithFork(e, src, fork)
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: hex.EncodeToString([]byte(src)) + ".m", Status: http.StatusInternalServerError})
	r := e.must(fhReq{Method: http.MethodDelete, Path: fork})
	remove()
	if r.Status != http.StatusNoContent {
		t.Fatalf("DELETE %s: %s", fork, r)
	}
	if r := e.must(fhReq{Method: http.MethodDelete, Path: src}); r.Status != http.StatusNoContent {
		t.Fatalf("DELETE %s: %s", src, r)
	}
	if err := fhWaitNotFound(e, src); err != nil {
		t.Errorf("the deleted source, no fork reading it: %v, want 404", err)
	}
}

// TestLostForkCountIsSettled: a source's fork count that no release will
// ever bring down is settled once grave_time has passed. Either a fork
// create's metadata PUT failed and never landed (its 503 keeps the count,
// as the PUT might still land), or Caddy was killed while it retried the
// release of a deleted fork (the bucket refusing the source's metadata
// PUT), and restarted. The source, deleted while its fork read it, is
// 410; once that fork is deleted, touches of the source find the forks
// it counts gone: it answers 404 and its name can be created again. It
// used to stay 410, its name taken, for good.
func TestLostForkCountIsSettled(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	metaOf := func(name string) string { return hex.EncodeToString([]byte(name)) + ".m" }
	for _, tc := range []struct {
		name string
		// lose runs after the fork is made and before the source's
		// DELETE; deleteFork deletes the fork.
		lose       func(t *testing.T, e *fhEnv, src, fork string)
		deleteFork func(t *testing.T, e *fhEnv, src, fork string)
	}{
		{
			name: "fork create lost",
			lose: func(t *testing.T, e *fhEnv, src, fork string) {
				lost := fork + "-lost"
				remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: metaOf(lost), Status: http.StatusInternalServerError})
				r := e.must(fhReq{Method: http.MethodPut, Path: lost, Header: map[string]string{"Stream-Forked-From": src}})
				remove()
				if r.Status != http.StatusServiceUnavailable {
					t.Fatalf("fork create with its metadata PUT lost: %s, want 503", r)
				}
				if r := e.must(fhReq{Method: http.MethodHead, Path: lost}); r.Status != http.StatusNotFound {
					t.Fatalf("HEAD of the lost fork: %s", r)
				}
			},
			deleteFork: func(t *testing.T, e *fhEnv, src, fork string) {
				if r := e.must(fhReq{Method: http.MethodDelete, Path: fork}); r.Status != http.StatusNoContent {
					t.Fatalf("DELETE %s: %s", fork, r)
				}
			},
		},
		{
			name: "release lost to a crash",
			lose: func(t *testing.T, e *fhEnv, src, fork string) {},
			deleteFork: func(t *testing.T, e *fhEnv, src, fork string) {
				fhLoseForkRelease(t, e, fork, metaOf(src))
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := fhStart(t, fhOptions{Directives: []string{"grave_time 1s"}})
			const src, fork = "/lostcount/src", "/lostcount/fork"
			fhSourceWithFork(e, src, fork)
			tc.lose(t, e, src, fork)
			if r := e.must(fhReq{Method: http.MethodDelete, Path: src}); r.Status != http.StatusNoContent {
				t.Fatalf("DELETE %s: %s", src, r)
			}
			if r := e.must(fhReq{Method: http.MethodHead, Path: src}); r.Status != http.StatusGone {
				t.Fatalf("HEAD of the source its fork reads: %s, want 410", r)
			}
			if got, _, err := e.readBytes(fork); err != nil || string(got) != "hello" {
				t.Fatalf("read of the fork: %q, %v; want its source's hello", got, err)
			}
			tc.deleteFork(t, e, src, fork)
			if err := fhWaitNotFound(e, src); err != nil {
				t.Fatalf("the deleted source, no fork reading it: %v, want 404", err)
			}
			if r := e.must(fhReq{Method: http.MethodPut, Path: src, Header: map[string]string{"Content-Type": textPlain}}); r.Status != http.StatusCreated {
				t.Errorf("PUT of the deleted source's name: %s, want 201", r)
			}
		})
	}
}

// TestUntouchedLostForkCountLeavesBucket: a deleted source whose fork's
// release Caddy was killed retrying, and which nobody touches afterwards,
// leaves the bucket all the same: its soft delete marked it for the
// expiry sweep, which settles its count and removes it. The release is
// lost before the count went down (the source's metadata PUT refused),
// or after, when the source's removal failed (its tombstone PUT
// refused). Checked in versitygw's bucket, past the proxy, so that no
// request touches the source: its metadata (a grave at most
// grave_time), its expiry markers, its data and its tombstone all go.
// Before, it kept its metadata and data in the bucket for good.
func TestUntouchedLostForkCountLeavesBucket(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	for _, tc := range []struct {
		name string
		// refuse is what the proxy refuses while the fork's release is
		// under way, given the source's name in hex and its internal id.
		refuse func(srcHex, id string) string
	}{
		{"count not lowered", func(srcHex, id string) string { return srcHex + ".m" }},
		{"source not removed", func(srcHex, id string) string { return "gc/" + id }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := fhStart(t, fhOptions{Directives: []string{"grave_time 1s", "expiry_sweep_interval 300ms"}})
			const src, fork = "/untouched/src", "/untouched/fork"
			srcHex := hex.EncodeToString([]byte(src))
			fhSourceWithFork(e, src, fork)
			meta, err := e.get("streams/" + srcHex + ".m")
			if err != nil {
				t.Fatal(err)
			}
			var m struct {
				ID string `json:"id"`
			}
			if err := json.Unmarshal(meta, &m); err != nil || m.ID == "" {
				t.Fatalf("the source's metadata %s: %v", meta, err)
			}
			if r := e.must(fhReq{Method: http.MethodDelete, Path: src}); r.Status != http.StatusNoContent {
				t.Fatalf("DELETE %s: %s", src, r)
			}
			fhLoseForkRelease(t, e, fork, tc.refuse(srcHex, m.ID))
			left := func() []string {
				var keys []string
				for _, o := range e.mustList("") {
					if strings.Contains(o.Key, srcHex) || strings.Contains(o.Key, m.ID) {
						keys = append(keys, o.Key)
					}
				}
				return keys
			}
			if err := fhWaitFor(60*time.Second, 200*time.Millisecond, func() error {
				if keys := left(); len(keys) > 0 {
					return fmt.Errorf("the source's keys in the bucket: %q", keys)
				}
				return nil
			}); err != nil {
				t.Fatalf("a deleted source no fork reads, nobody touching it: %v; want none", err)
			}
		})
	}
}

// TestCreateOverASourceStorageCannotRemove: through Caddy on versitygw, a
// source deleted while its fork read it, then left by that fork, is
// removed with the fork's delete; while the bucket fails that removal
// (its gc record's PUT), a create of the source's name is a 503, not a
// 409 saying forks still read it, and once the bucket is back the create
// goes ahead without waiting out the minute between fork look-ups.
func TestCreateOverASourceStorageCannotRemove(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	const src, fork = "/unremoved/src", "/unremoved/fork"
	fhSourceWithFork(e, src, fork)
	if r := e.must(fhReq{Method: http.MethodDelete, Path: src}); r.Status != http.StatusNoContent {
		t.Fatalf("DELETE %s: %s", src, r)
	}
	meta, err := e.get("streams/" + hex.EncodeToString([]byte(src)) + ".m")
	if err != nil {
		t.Fatal(err)
	}
	var m struct{ ID string }
	if err := json.Unmarshal(meta, &m); err != nil || m.ID == "" {
		t.Fatalf("the source's metadata %s: %v", meta, err)
	}
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/gc/" + m.ID, Status: http.StatusInternalServerError})
	defer remove()
	if r := e.must(fhReq{Method: http.MethodDelete, Path: fork}); r.Status != http.StatusNoContent {
		t.Fatalf("DELETE %s: %s", fork, r)
	}
	create := fhReq{Method: http.MethodPut, Path: src, Header: map[string]string{"Content-Type": "text/plain"}}
	r := e.must(create)
	t.Logf("create while the source's removal fails: %s", r)
	if r.Status != http.StatusServiceUnavailable {
		t.Errorf("create while the source's removal fails: %s; want 503", r)
	}
	remove()
	if r := e.must(create); r.Status != http.StatusCreated {
		t.Fatalf("create once the bucket takes the removal: %s; want 201", r)
	}
}
