package integration

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
	"github.com/picomq/caddy-picomq/streamstore"
)

// TestTrimDropsWhatNoForkReadsThroughCaddy: a trim of a source that forks
// read deletes, at the next compaction, the trimmed records no fork reads,
// and keeps the ones each fork reads until that fork is deleted. Before,
// one fork kept every record trimmed while it lived: a stream trimmed for
// retention grew in the bucket without bound once it had a fork.
func TestTrimDropsWhatNoForkReadsThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"compact_interval 1s", "pack_below off", "merge_below off"}, nil)
	const src = "/forkthin/src"
	records := fhRandomRecords(93, 14, 1024)
	appendTo := fhPicoSource(t, e, src, records)
	trim := func(seq int) {
		t.Helper()
		picoWant(t, "trim", picoDo(e, "POST", "/pico"+src, nil, "Pico-Trim-Seq", strconv.Itoa(seq)), 200,
			"Pico-Start-Seq", strconv.Itoa(seq))
	}
	fork := func(name string) {
		t.Helper()
		e.must(fhReq{Method: http.MethodPut, Path: "/ds" + name, Header: map[string]string{"Stream-Forked-From": "/ds" + src}})
	}
	waitHeld := func(step string, n int, want ...int) {
		t.Helper()
		fhWaitHeld(t, e, step, records[:n], want...)
	}
	readsWhole := func(name string, from, to int) {
		t.Helper()
		got, _, err := e.readBytes("/ds" + name)
		if want := bytes.Join(records[from:to], nil); err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s reads %d bytes (%v), want records [%d,%d) whole", name, len(got), err, from, to)
		}
	}

	appendTo(0, 4)
	waitHeld("the first fold", 4, 0, 1, 2, 3)
	fork("/forkthin/f") // reads [0,4)
	appendTo(4, 8)
	waitHeld("the second fold", 8, 0, 1, 2, 3, 4, 5, 6, 7)
	appendTo(8, 10)
	trim(8)
	waitHeld("after a trim to 8, /f reading [0,4)", 10, 0, 1, 2, 3, 8, 9)

	fork("/forkthin/g") // reads [8,10)
	appendTo(10, 12)
	waitHeld("the fold after /g", 12, 0, 1, 2, 3, 8, 9, 10, 11)
	appendTo(12, 14)
	trim(12)
	waitHeld("after a trim to 12, /g reading [8,10)", 14, 0, 1, 2, 3, 8, 9, 12, 13)
	readsWhole("/forkthin/f", 0, 4)
	readsWhole("/forkthin/g", 8, 10)

	e.must(fhReq{Method: http.MethodDelete, Path: "/ds/forkthin/f"})
	waitHeld("after /f went", 14, 8, 9, 12, 13)
	readsWhole("/forkthin/g", 8, 10)
	e.must(fhReq{Method: http.MethodDelete, Path: "/ds/forkthin/g"})
	waitHeld("after /g went", 14, 12, 13)
	readsWhole(src, 12, 14)
}

// TestDeleteKeepsWhatForksReadThroughCaddy: deleting a source that a fork
// reads keeps, in the bucket, only the data objects with records the fork
// reads; those appended after the fork's point go, the ones still in the
// WAL at the delete included. Before, a deleted source kept every record
// for as long as its last fork lived, though no client could read them.
func TestDeleteKeepsWhatForksReadThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"compact_interval 1s", "pack_below off", "merge_below off"}, nil)
	const src = "/delthin/src"
	records := fhRandomRecords(94, 10, 1024)
	appendTo := fhPicoSource(t, e, src, records)
	waitHeld := func(step string, want ...int) {
		t.Helper()
		fhWaitHeld(t, e, step, records, want...)
	}

	appendTo(0, 4)
	waitHeld("the first fold", 0, 1, 2, 3)
	e.must(fhReq{Method: http.MethodPut, Path: "/ds/delthin/f", Header: map[string]string{"Stream-Forked-From": "/ds" + src}}) // reads [0,4)
	appendTo(4, 8)
	waitHeld("the second fold", 0, 1, 2, 3, 4, 5, 6, 7)
	appendTo(8, 10) // in the WAL at the delete, or just folded
	e.must(fhReq{Method: http.MethodDelete, Path: "/ds" + src})
	waitHeld("after the source's delete, /f reading [0,4)", 0, 1, 2, 3)
	got, _, err := e.readBytes("/ds/delthin/f")
	if want := bytes.Join(records[:4], nil); err != nil || !bytes.Equal(got, want) {
		t.Errorf("/f reads %d bytes (%v), want records [0,4) whole", len(got), err)
	}
	if resp := e.must(fhReq{Method: http.MethodGet, Path: "/ds" + src}); resp.Status != http.StatusGone {
		t.Errorf("the deleted source answers a read with %s, want 410", resp)
	}
}

// fhWaitHeld waits for the data objects in the bucket to hold exactly the
// records in want (indexes into records), and fails the test at step if
// they do not within fhCompactWait.
func fhWaitHeld(t *testing.T, e *fhEnv, step string, records [][]byte, want ...int) {
	t.Helper()
	err := fhWaitFor(fhCompactWait, 250*time.Millisecond, func() error {
		objs, bodies := fhReadAll(t, e, "data/")
		var held []int
		for i, r := range records {
			for j, b := range bodies {
				if strings.HasPrefix(objs[j].Key, "data/") && bytes.Contains(b, r) {
					held = append(held, i)
					break
				}
			}
		}
		if fmt.Sprint(held) != fmt.Sprint(want) {
			return fmt.Errorf("data objects hold records %v, want %v", held, want)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("%s: %v", step, err)
	}
}

// TestForkDepthIsBoundedThroughCaddy: a chain of forks is at most
// streamstore.MaxForkDepth deep. A fork of its last is 400 naming the
// limit and writes nothing; a fork higher up is made, and the deepest
// reads its inherited records. Unbounded, a client could build a chain one
// create at a time whose every read loads every stream up it.
func TestForkDepthIsBoundedThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, nil, nil)
	name := func(d int) string { return "/ds/depth/" + strconv.Itoa(d) }
	e.create(name(0), textPlain)
	e.append(name(0), textPlain, []byte("root"))
	fork := func(path, source string) fhReq {
		return fhReq{Method: http.MethodPut, Path: path, Header: map[string]string{"Stream-Forked-From": source}}
	}
	for d := 1; d <= streamstore.MaxForkDepth; d++ {
		if r := e.must(fork(name(d), name(d-1))); r.Status != http.StatusCreated {
			t.Fatalf("fork %d deep: %s", d, r)
		}
	}
	r, writes := fhExpectNoWrites(t, e, fork("/ds/depth/past", name(streamstore.MaxForkDepth)))
	if r.Status != http.StatusBadRequest || !fhContainsAny(string(r.Body), "at most "+strconv.Itoa(streamstore.MaxForkDepth)) {
		t.Errorf("a fork %d deep: %s, want 400 naming the limit", streamstore.MaxForkDepth+1, r)
	}
	if len(writes) > 0 {
		t.Errorf("the refused fork wrote to the object store:%s", fhSortedKeys(writes))
	}
	if r := e.must(fhReq{Method: http.MethodHead, Path: "/ds/depth/past"}); r.Status != http.StatusNotFound {
		t.Errorf("HEAD of the refused fork: %s, want 404", r)
	}
	if r := e.must(fork("/ds/depth/side", name(streamstore.MaxForkDepth-1))); r.Status != http.StatusCreated {
		t.Errorf("a fork %d deep: %s", streamstore.MaxForkDepth, r)
	}
	if got, _, err := e.readBytes(name(streamstore.MaxForkDepth)); err != nil || string(got) != "root" {
		t.Errorf("the deepest fork reads %q (%v), want %q", got, err, "root")
	}
}

// TestTrimmedForkedSourceIsPackedAgainThroughCaddy: after the fold that
// applies a trim to a source a fork reads, the source's new records go to
// the packs again, with no data PUT or checkpoint of its own; it used to
// be folded at every compaction for as long as it had a fork.
func TestTrimmedForkedSourceIsPackedAgainThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"compact_interval 1s", "merge_below off"}, nil)
	const src = "/packagain/src"
	picoWant(t, "create", picoDo(e, "PUT", "/pico"+src, nil, "Content-Type", "application/octet-stream"), 201)
	appendOne := func() {
		t.Helper()
		picoWant(t, "append", picoDo(e, "POST", "/pico"+src, []byte("record"), "Content-Type", "application/octet-stream"), 200)
	}
	for range 4 {
		appendOne()
	}
	if r := e.must(fhReq{Method: http.MethodPut, Path: "/ds/packagain/f", Header: map[string]string{"Stream-Forked-From": "/ds" + src}}); r.Status != http.StatusCreated {
		t.Fatalf("fork: %s", r)
	}
	picoWant(t, "trim", picoDo(e, "POST", "/pico"+src, nil, "Pico-Trim-Seq", "3"), 200)
	metaKey := "streams/" + hex.EncodeToString([]byte(src)) + ".m"
	if err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
		m, err := e.get(metaKey)
		if err != nil {
			return err
		}
		var doc struct{ Thinned uint64 }
		if err := json.Unmarshal(m, &doc); err != nil || doc.Thinned != 3 {
			return fmt.Errorf("the source's metadata says it is thinned to %d (%v), want 3", doc.Thinned, err)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	id := e.streamID(src)
	before := e.proxy.Counts()
	for range 8 {
		appendOne()
		time.Sleep(750 * time.Millisecond)
	}
	time.Sleep(1500 * time.Millisecond) // a compaction after the last append
	after := e.proxy.Counts()
	puts := func(under string) int {
		under = caddytest.S3Prefix + "/" + under
		return after.PutsUnder(under) - before.PutsUnder(under)
	}
	data, meta, packs := puts("data/"+id+"/"), puts(metaKey), puts("pack/")
	if data != 0 || meta != 0 || packs == 0 {
		t.Errorf("over 8 appends and as many compactions the source took %d data PUTs and %d checkpoints, the packs %d PUTs; "+
			"want none of its own, its records in the packs", data, meta, packs)
	}
	got, _, err := e.readBytes("/ds/packagain/f")
	if err != nil || string(got) != "recordrecordrecordrecord" {
		t.Errorf("the fork reads %q (%v)", got, err)
	}
}

// TestLostForkCreateOfALiveSourceIsSettledThroughCaddy: a fork create
// whose metadata PUT the bucket keeps failing is 503, and keeps its
// source's count (the PUT might still land); grave_time later the count
// is given back with nobody touching the source, so a trim deletes the
// records only that fork would have read. Before, a live source kept the
// count, and those records, for as long as it lived.
func TestLostForkCreateOfALiveSourceIsSettledThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"compact_interval 1s", "pack_below off", "merge_below off", "grave_time 1s"}, nil)
	const src = "/lostfork/src"
	records := fhRandomRecords(95, 2, 1024)
	fhPicoSource(t, e, src, records)(0, len(records))
	fhWaitHeld(t, e, "the fold", records, 0, 1)
	lost := hex.EncodeToString([]byte("/lostfork/lost"))
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: lost, Status: http.StatusInternalServerError})
	r := e.must(fhReq{Method: http.MethodPut, Path: "/ds/lostfork/lost", Header: map[string]string{"Stream-Forked-From": "/ds" + src}})
	remove()
	if r.Status != http.StatusServiceUnavailable {
		t.Fatalf("fork create with its metadata PUT failing: %s, want 503", r)
	}
	metaKey := "streams/" + hex.EncodeToString([]byte(src)) + ".m"
	forks := func() int {
		m, err := e.get(metaKey)
		if err != nil {
			t.Fatalf("metadata of the source: %v", err)
		}
		var doc struct{ Forks int }
		if err := json.Unmarshal(m, &doc); err != nil {
			t.Fatalf("metadata of the source: %v", err)
		}
		return doc.Forks
	}
	if n := forks(); n != 1 {
		t.Fatalf("the source counts %d forks after the failed create, want 1", n)
	}
	if err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
		if n := forks(); n != 0 {
			return fmt.Errorf("the source counts %d forks", n)
		}
		return nil
	}); err != nil {
		t.Fatalf("grave_time after the failed fork create: %v, want 0", err)
	}
	picoWant(t, "trim", picoDo(e, "POST", "/pico"+src, nil, "Pico-Trim-Seq", "2"), 200)
	fhWaitHeld(t, e, "after the trim", records)
}

// TestLostForkCountRaiseIsSettledThroughCaddy: the write that raises the
// source's fork count lands, but the bucket's answer is lost and Caddy
// cannot read the object back, so the fork create answers 503 and makes
// no fork. The bucket's source then counted that fork for as long as it
// lived, once its handle left memory; grave_time after the create, the
// count goes back.
func TestLostForkCountRaiseIsSettledThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"compact_interval 1s", "pack_below off", "grave_time 1s"}, nil)
	const src = "/lostraise/src"
	records := fhRandomRecords(96, 2, 1024)
	fhPicoSource(t, e, src, records)(0, len(records))
	fhWaitHeld(t, e, "the fold", records, 0, 1)
	metaKey := "streams/" + hex.EncodeToString([]byte(src)) + ".m"
	removePut := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: metaKey, Status: http.StatusInternalServerError, AfterForward: true, Times: 1})
	removeGet := e.proxy.AddFault(testenv.Fault{Op: testenv.OpGet, KeyContains: metaKey, Status: http.StatusInternalServerError})
	r := e.must(fhReq{Method: http.MethodPut, Path: "/ds/lostraise/fork", Header: map[string]string{"Stream-Forked-From": "/ds" + src}})
	removeGet()
	removePut()
	if r.Status != http.StatusServiceUnavailable {
		t.Fatalf("fork create with the raise's answer lost: %s, want 503", r)
	}
	forks := func() (int, int) {
		m, err := e.get(metaKey)
		if err != nil {
			t.Fatalf("metadata of the source: %v", err)
		}
		var doc struct {
			Forks    int
			ForkList []json.RawMessage `json:"fork_list"`
		}
		if err := json.Unmarshal(m, &doc); err != nil {
			t.Fatalf("metadata of the source: %v", err)
		}
		return doc.Forks, len(doc.ForkList)
	}
	if n, listed := forks(); n != 1 || listed != 1 {
		t.Fatalf("the bucket's source counts %d forks and lists %d after the failed create: the test needs the raise landed", n, listed)
	}
	if err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
		if n, listed := forks(); n != 0 || listed != 0 {
			return fmt.Errorf("the source counts %d forks and lists %d", n, listed)
		}
		return nil
	}); err != nil {
		t.Fatalf("grave_time after the failed fork create: %v, want none", err)
	}
	if r := e.must(fhReq{Method: http.MethodHead, Path: "/ds/lostraise/fork"}); r.Status != http.StatusNotFound {
		t.Fatalf("HEAD of the fork that was never made: %s, want 404", r)
	}
}

// fhPicoSource creates the stream src through Pico, and returns a function
// that appends records [from, to) to it, each checked to land at its
// index.
func fhPicoSource(t *testing.T, e *fhEnv, src string, records [][]byte) func(from, to int) {
	t.Helper()
	picoWant(t, "create", picoDo(e, "PUT", "/pico"+src, nil, "Content-Type", "application/octet-stream"), 201)
	return func(from, to int) {
		t.Helper()
		for i := from; i < to; i++ {
			picoWant(t, "append", picoDo(e, "POST", "/pico"+src, records[i], "Content-Type", "application/octet-stream"), 200,
				"Pico-Start-Seq", strconv.Itoa(i))
		}
	}
}

// TestForksPastTheListAreThinnedAroundThroughCaddy: a source lists at most
// 1,000 forks; a fork made past that is counted, and what it reads kept
// as one span with the others past the list, so a trim of the source
// still deletes the records no fork reads. It used to delete nothing
// while any fork past the list lived.
func TestForksPastTheListAreThinnedAroundThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"compact_interval 1s", "pack_below off", "merge_below off"}, nil)
	const src = "/pastlist/src"
	records := fhRandomRecords(97, 8, 1024)
	appendTo := fhPicoSource(t, e, src, records)
	appendTo(0, 2)
	fhWaitHeld(t, e, "the first fold", records, 0, 1)

	// 1,000 forks at 2, listed, each reading [0,2).
	work := make(chan int)
	errs := make(chan error, 8)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				r, err := fhSend(e.client, e.caddy.URL(), fhReq{Method: http.MethodPut, Path: fmt.Sprintf("/ds/pastlist/f%04d", i),
					Header: map[string]string{"Stream-Forked-From": "/ds" + src}})
				if err == nil && r.Status != http.StatusCreated {
					err = fmt.Errorf("fork %d: %s", i, r)
				}
				if err != nil {
					select {
					case errs <- err:
					default:
					}
					return
				}
			}
		}()
	}
	for i := range 1000 {
		work <- i
	}
	close(work)
	wg.Wait()
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}

	appendTo(2, 4)
	fhWaitHeld(t, e, "the second fold", records, 0, 1, 2, 3)
	// Past the list: it reads [0,4).
	if r := e.must(fhReq{Method: http.MethodPut, Path: "/ds/pastlist/past", Header: map[string]string{"Stream-Forked-From": "/ds" + src}}); r.Status != http.StatusCreated {
		t.Fatalf("the fork past the list: %s", r)
	}
	appendTo(4, 6)
	fhWaitHeld(t, e, "the third fold", records, 0, 1, 2, 3, 4, 5)
	appendTo(6, 8)
	picoWant(t, "trim", picoDo(e, "POST", "/pico"+src, nil, "Pico-Trim-Seq", "6"), 200, "Pico-Start-Seq", "6")
	fhWaitHeld(t, e, "after a trim to 6, the fork past the list reading [0,4)", records, 0, 1, 2, 3, 6, 7)
	if got, _, err := e.readBytes("/ds/pastlist/past"); err != nil || !bytes.Equal(got, bytes.Join(records[:4], nil)) {
		t.Fatalf("the fork past the list reads %d bytes (%v), want records [0,4)", len(got), err)
	}
	e.must(fhReq{Method: http.MethodDelete, Path: "/ds/pastlist/past"})
	fhWaitHeld(t, e, "after the fork past the list went", records, 0, 1, 6, 7)
	if got, _, err := e.readBytes("/ds/pastlist/f0500"); err != nil || !bytes.Equal(got, bytes.Join(records[:2], nil)) {
		t.Fatalf("a listed fork reads %d bytes (%v), want records [0,2)", len(got), err)
	}
}
