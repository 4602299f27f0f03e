package integration

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"sort"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestCollectorPassesOverADeleteTheStoreRefuses: through Caddy on
// versitygw, two deleted streams' data wait for the collector, and the
// store refuses to delete the data of the one whose tombstone is listed
// first (a legal hold, say: 403 on every try). The other's data is
// collected all the same. The refused tombstone used to end every pass,
// so every stream deleted after it kept its data in the bucket for good.
func TestCollectorPassesOverADeleteTheStoreRefuses(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"pack_below off", "compact_interval 200ms"}})
	const ct = "text/plain"
	paths := []string{"/gciso/one", "/gciso/two"}
	ids := map[string]string{}
	for _, p := range paths {
		e.create(p, ct)
		e.append(p, ct, []byte("r;"))
		ids[p] = e.streamID(p)
	}
	if err := e.waitGone("wal/"); err != nil {
		t.Fatalf("not compacted: %v", err)
	}
	for _, p := range paths {
		if len(e.mustList("data/"+ids[p]+"/")) == 0 {
			t.Fatalf("no data object of %s: the test checks nothing", p)
		}
	}
	// Tombstones are gc/<id>: the first listed is refused.
	order := []string{ids[paths[0]], ids[paths[1]]}
	sort.Strings(order)
	held, free := order[0], order[1]
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpDelete, KeyContains: "data/" + held + "/", Status: http.StatusForbidden})
	defer remove()
	// The collector's listing waits for the last delete, so that one pass
	// meets the refused tombstone first and the other after it.
	releaseList := e.proxy.Hold(testenv.Fault{Op: testenv.OpList, KeyContains: "gc/", Times: 1})
	defer releaseList()
	for _, p := range paths {
		if r := e.must(fhReq{Method: http.MethodDelete, Path: p}); r.Status/100 != 2 {
			t.Fatalf("DELETE %s: %s", p, r)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := e.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("the collector never listed its tombstones: %v", err)
	}
	releaseList()
	err := fhWaitFor(30*time.Second, 100*time.Millisecond, func() error {
		if objs := e.mustList("data/" + free + "/"); len(objs) > 0 {
			return fmt.Errorf("data objects %v left", objs)
		}
		if e.proxy.Counts().Faults == 0 {
			return fmt.Errorf("the refused stream's data delete not tried yet")
		}
		return nil
	})
	refused := e.proxy.Counts().Faults
	if err != nil {
		t.Fatalf("the data of the stream deleted beside the refused one was not collected (%d refusals): %v", refused, err)
	}
	if refused == 0 || len(e.mustList("data/"+held+"/")) == 0 {
		t.Fatalf("the store refused %d deletes and the held data is %v: the test checks nothing", refused, e.mustList("data/"+held+"/"))
	}
}

// TestCollectorWorksOffDeletedStreamsInParallel: through Caddy on
// versitygw, the data deletes of several deleted streams, held at the
// proxy, are at the bucket together: the collector works off their
// tombstones several at a time. One at a time, at some seven requests
// each, a bucket 25 ms away collected a few deleted streams a second.
func TestCollectorWorksOffDeletedStreamsInParallel(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	// A held delete is not given up (and retried) within the wait below.
	e := fhStart(t, fhOptions{Directives: []string{"pack_below off", "compact_interval 200ms", "s3_timeout 1m"}})
	const ct, streams = "text/plain", 4
	var ids []string
	for i := range streams {
		p := fmt.Sprintf("/gcpar/%d", i)
		e.create(p, ct)
		e.append(p, ct, []byte("r;"))
		ids = append(ids, e.streamID(p))
	}
	if err := e.waitGone("wal/"); err != nil {
		t.Fatalf("not compacted: %v", err)
	}
	// The first data delete of each stream is held: a retry of one (the
	// store's timeout) is not, so two held are two streams at once.
	var releases []func()
	for _, id := range ids {
		releases = append(releases, e.proxy.Hold(testenv.Fault{Op: testenv.OpDelete, KeyContains: "data/" + id + "/", Times: 1}))
	}
	release := func() {
		for _, r := range releases {
			r()
		}
	}
	defer release()
	// The collector's listing waits for the last delete, so that one pass
	// has every tombstone.
	releaseList := e.proxy.Hold(testenv.Fault{Op: testenv.OpList, KeyContains: "gc/", Times: 1})
	defer releaseList()
	for i := range streams {
		if r := e.must(fhReq{Method: http.MethodDelete, Path: fmt.Sprintf("/gcpar/%d", i)}); r.Status/100 != 2 {
			t.Fatalf("DELETE: %s", r)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := e.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("the collector never listed its tombstones: %v", err)
	}
	releaseList()
	if err := e.proxy.WaitHeld(ctx, 2); err != nil {
		t.Fatalf("two deleted streams' data deletes were never at the bucket together: %v", err)
	}
	release()
	if err := fhWaitFor(30*time.Second, 100*time.Millisecond, func() error {
		if objs := e.mustList("data/"); len(objs) > 0 {
			return fmt.Errorf("data objects %v left", objs)
		}
		return nil
	}); err != nil {
		t.Fatalf("the deleted streams' data was not collected: %v", err)
	}
}

// streamID is the internal id of the stream at path, from its metadata
// object in the bucket.
func (e *fhEnv) streamID(path string) string {
	e.t.Helper()
	m, err := e.get("streams/" + hex.EncodeToString([]byte(path)) + ".m")
	if err != nil {
		e.t.Fatalf("metadata of %s: %v", path, err)
	}
	var doc struct{ ID string }
	if err := json.Unmarshal(m, &doc); err != nil || doc.ID == "" {
		e.t.Fatalf("metadata of %s: %q (%v)", path, m, err)
	}
	return doc.ID
}
