package integration

import (
	"bytes"
	"context"
	encjson "encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestSameNodeTakeoverDuringNamespaceSwitch: a second process of the same
// node id (same data directory) takes the storage over at once, while the
// first is moving its WAL writer to a fresh namespace after a failed
// upload, its manifest write held up on its way. The first process's lease
// is still valid by its own clock (its renewal is held too), so only the
// manifest can tell it that it lost the storage. Whatever the first process
// acknowledges afterwards must be readable from the second; before the
// manifest fenced writers, the first registered a namespace the second
// never replays and acknowledged appends written there.
func TestSameNodeTakeoverDuringNamespaceSwitch(t *testing.T) {
	const (
		name = "/takeover/s"
		text = "text/plain"
	)
	a := fhStart(t, fhOptions{Optional: []string{"compact_interval 1h"}})
	a.create(name, text)
	want := []byte("before\n")
	a.append(name, text, want)

	// The first process's next namespace registration waits in the proxy.
	releaseMan := a.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "manifest"})
	defer releaseMan()
	// 403 is not retried: the upload fails at once, the writer's own seal
	// wins, and it asks for a new namespace.
	removeFault := a.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Status: http.StatusForbidden, Times: 1})
	defer removeFault()
	if r := a.must(fhReq{Method: http.MethodPost, Path: name, Header: map[string]string{"Content-Type": text}, Body: []byte("refused\n")}); r.Status != http.StatusServiceUnavailable {
		t.Fatalf("append whose WAL upload was refused: %s, want 503", r)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := a.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("the first process's namespace registration never reached the store: %v", err)
	}
	// From here on the first process's renewals do not land either, so its
	// lease stays valid by its clock for a while yet: only the storage can
	// tell it another process took over.
	releaseLease := a.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "lease"})
	defer releaseLease()

	// The second process: the same data directory, so the same node id,
	// straight to versitygw.
	bEnv := launchSameNode(t, a)

	// The first process's registration lands now, after the takeover.
	releaseMan()
	if err := a.proxy.WaitLanded(ctx); err != nil {
		t.Fatalf("held manifest write: %v", err)
	}
	var acked [][]byte
	deadline := time.Now().Add(5 * time.Second)
	for i := 0; time.Now().Before(deadline); i++ {
		body := []byte("late-" + string(rune('a'+i%26)) + "\n")
		r := a.must(fhReq{Method: http.MethodPost, Path: name, Header: map[string]string{"Content-Type": text}, Body: body})
		if r.Status/100 == 2 {
			acked = append(acked, body)
			t.Logf("the first process acknowledged %q after the takeover: %s", body, r)
			break
		}
		time.Sleep(100 * time.Millisecond)
	}

	got, _, err := bEnv.readBytes(name)
	if err != nil {
		t.Fatalf("read from the second process: %v", err)
	}
	if !bytes.HasPrefix(got, want) {
		t.Fatalf("the second process reads %q, want it to begin with %q", got, want)
	}
	for _, body := range acked {
		if !bytes.Contains(got, body) {
			t.Errorf("the first process acknowledged %q after the second took the storage over, "+
				"and the second does not have it: it reads %q", body, got)
		}
	}
}

// TestCheckpointOfReplacedProcessLandsLate: the process a takeover
// replaced was checkpointing a stream (its metadata write held up on its
// way) when the new owner loaded that stream, and the write lands after.
// The new owner's checkpoints of the stream are compare-and-swaps on the
// version it loaded: it must get past the stale process's version, or its
// compactions fail for good and the WAL is never retired.
func TestCheckpointOfReplacedProcessLandsLate(t *testing.T) {
	const (
		name = "/takeover/meta"
		text = "text/plain"
	)
	a := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s"}})
	// A large append is folded by the next compaction (a small one may
	// be packed, which writes no checkpoint).
	want := bytes.Repeat([]byte("B"), 300<<10)
	// The stale checkpoint lands over the version the new owner loaded.
	bEnv, _ := lateCheckpoint(t, a, name, text, want)
	more := []byte("after\n")
	bEnv.append(name, text, more)

	// The new owner compacts the first process's WAL away.
	oldWAL := "wal/" + strings.Repeat("0", 16) + "/"
	if err := fhWaitFor(20*time.Second, 200*time.Millisecond, func() error {
		if left := bEnv.mustList(oldWAL); len(left) > 0 {
			return fmt.Errorf("%d WAL objects of the first process still in the bucket", len(left))
		}
		return nil
	}); err != nil {
		t.Errorf("the new owner does not compact: %v\n%s", err, compactionLine(bEnv.caddy.Logs()))
	}
	got, _, err := bEnv.readBytes(name)
	if err != nil {
		t.Fatalf("read from the second process: %v", err)
	}
	if w := append(append([]byte(nil), want...), more...); !bytes.Equal(got, w) {
		t.Errorf("the second process reads %q, want %q", got, w)
	}
}

// TestLateCheckpointThenPacks: the replaced process's checkpoint of a
// stream lands late, as above, and the new owner packs the stream's small
// backlog (the records it replayed from the WAL and one appended since)
// instead of folding it. That pack entry began below the late checkpoint's
// tail, so the next start ignored it, and with it every later entry of
// the stream: the append the new owner acknowledged was lost, and its seq
// handed out again. The new owner now checkpoints a stream it replayed
// before it packs it.
func TestLateCheckpointThenPacks(t *testing.T) {
	const (
		name = "/takeover/packed"
		text = "text/plain"
	)
	// The first process folds every backlog: its compaction checkpoints.
	a := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s", "pack_below off"}})
	first := []byte("first\n")
	// The new owner packs small backlogs (the default).
	b, metaKey := lateCheckpoint(t, a, name, text, first)
	body, err := b.get(metaKey)
	if err != nil {
		t.Fatal(err)
	}
	var late struct {
		State struct {
			NextSeq uint64 `json:"next_seq"`
		} `json:"state"`
	}
	if err := encjson.Unmarshal(body, &late); err != nil || late.State.NextSeq != 1 {
		t.Fatalf("the late checkpoint: tail %d (%v) in %s; want 1: the test provokes nothing", late.State.NextSeq, err, body)
	}

	more := []byte("more\n")
	b.append(name, text, more)
	// The new owner compacts both namespaces' entries away.
	if err := b.waitGone("wal/"); err != nil {
		t.Fatalf("the new owner does not compact: %v\n%s", err, compactionLine(b.caddy.Logs()))
	}
	want := append(append([]byte(nil), first...), more...)
	if got, _, err := b.readBytes(name); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("the new owner reads %q (%v), want %q", got, err, want)
	}

	// A restart replays what the new owner left.
	if err := b.caddy.Stop(); err != nil {
		t.Fatalf("stopping the new owner: %v", err)
	}
	c := launchSameNode(t, b)
	if got, _, err := c.readBytes(name); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("after a restart: %q (%v), want %q\n%s", got, err, want, truncateTail(c.caddy.Logs(), 3000))
	}
}

// lateCheckpoint creates name on a, holds a's next metadata PUT at the
// proxy, appends body (whose compaction checkpoints the stream), starts a
// second process of a's node with compact_interval 1s, and lets the held
// checkpoint land once that one has loaded the stream. It returns the
// second process and the stream's metadata key.
func lateCheckpoint(t *testing.T, a *fhEnv, name, contentType string, body []byte) (*fhEnv, string) {
	t.Helper()
	a.create(name, contentType)
	var metaKey string
	if err := fhWaitFor(10*time.Second, 50*time.Millisecond, func() error {
		objs := a.mustList("streams/")
		if len(objs) == 0 {
			return errors.New("no metadata object yet")
		}
		metaKey = objs[0].Key
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	releaseMeta := a.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "/streams/", Times: 1})
	defer releaseMeta()
	a.append(name, contentType, body)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := a.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("the first process's checkpoint never reached the store: %v", err)
	}
	b := launchSameNode(t, a, "compact_interval 1s")
	releaseMeta()
	if err := a.proxy.WaitLanded(ctx); err != nil {
		t.Fatalf("held checkpoint: %v", err)
	}
	return b, metaKey
}

// compactionLine picks the last log line of s about a failed compaction.
func compactionLine(s string) string {
	lines := strings.Split(s, "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.Contains(lines[i], "compaction failed") {
			return truncate(strings.TrimSpace(lines[i]), 600)
		}
	}
	return ""
}

// TestDeleteByReplacedProcess: the process a takeover replaced (its lease
// still valid by its own clock, its renewals held up) is asked to delete a
// stream the new owner has loaded. A delete writes no WAL entry, so the
// seal that fences the old process's appends does not fence it: it
// swapped the stream's metadata for a grave and acknowledged the delete,
// and the new owner went on acknowledging appends to the stream, which
// its next compaction found deleted and collected.
func TestDeleteByReplacedProcess(t *testing.T) {
	const (
		name = "/takeover/delete"
		text = "text/plain"
	)
	a := fhStart(t, fhOptions{Optional: []string{"compact_interval 1h"}})
	a.create(name, text)
	a.append(name, text, []byte("before\n"))
	releaseLease := a.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "lease"})
	defer releaseLease()

	bEnv := launchSameNode(t, a)
	if got, _, err := bEnv.readBytes(name); err != nil || string(got) != "before\n" {
		t.Fatalf("the new owner reads %q (%v), want %q", got, err, "before\n")
	}

	del := a.must(fhReq{Method: http.MethodDelete, Path: name})
	t.Logf("the replaced process answered the delete: %s", del)
	app := bEnv.must(fhReq{Method: http.MethodPost, Path: name, Header: map[string]string{"Content-Type": text}, Body: []byte("after\n")})
	t.Logf("the new owner answered an append after it: %s", app)
	if del.Status/100 == 2 && app.Status/100 == 2 {
		t.Errorf("the replaced process acknowledged the delete of %s (%d), and the new owner then acknowledged an "+
			"append to it (%d): the append is lost with the stream", name, del.Status, app.Status)
	}
}

// TestSubscriptionWriteByReplacedProcess: the process a takeover replaced
// (its lease valid by its own clock, its renewals held up) saves a change
// of a subscription whose document the new owner has written since. It
// took the other version for a write of its own whose answer was lost and
// wrote over it, undoing the ack the new owner had acknowledged.
func TestSubscriptionWriteByReplacedProcess(t *testing.T) {
	const (
		sub  = "/v1/stream/__ds/subscriptions/p1"
		json = "application/json"
	)
	a := fhStart(t, fhOptions{Optional: []string{"compact_interval 1h"}, Directives: []string{"allow_loopback_webhooks"}})
	call := func(e *fhEnv, method, path, body string, hdr ...string) (int, map[string]any) {
		t.Helper()
		h := map[string]string{"Content-Type": json}
		for i := 0; i+1 < len(hdr); i += 2 {
			h[hdr[i]] = hdr[i+1]
		}
		r := e.must(fhReq{Method: method, Path: path, Header: h, Body: []byte(body)})
		var v map[string]any
		_ = encjson.Unmarshal(r.Body, &v)
		return r.Status, v
	}
	if st, v := call(a, "PUT", "/v1/stream/wake/pool", "[]"); st != 201 {
		t.Fatalf("create wake stream: %d %v", st, v)
	}
	if st, v := call(a, "PUT", sub, `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake/pool","lease_ttl_ms":600000}`); st != 201 {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	if st, v := call(a, "PUT", "/v1/stream/events/a", `{"n":1}`); st != 201 {
		t.Fatalf("create stream: %d %v", st, v)
	}
	var claim map[string]any
	if err := fhWaitFor(10*time.Second, 50*time.Millisecond, func() error {
		st, v := call(a, "POST", sub+"/claim", `{"worker":"w1"}`)
		if st != 200 {
			return fmt.Errorf("claim: %d %v", st, v)
		}
		claim = v
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	gen := strconv.Itoa(int(claim["generation"].(float64)))
	token, wake := claim["token"].(string), claim["wake_id"].(string)
	tail := claim["streams"].([]any)[0].(map[string]any)["tail_offset"].(string)

	releaseLease := a.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "lease"})
	defer releaseLease()
	bEnv := launchSameNode(t, a, "allow_loopback_webhooks")
	ack := `{"wake_id":"` + wake + `","generation":` + gen + `,"acks":[{"stream":"events/a","offset":"` + tail + `"}],"done":true}`
	if st, v := call(bEnv, "POST", sub+"/ack", ack, "Authorization", "Bearer "+token); st != 200 {
		t.Fatalf("ack on the new owner: %d %v", st, v)
	}
	st, _ := call(a, "POST", sub+"/release", `{"wake_id":"`+wake+`","generation":`+gen+`}`, "Authorization", "Bearer "+token)
	t.Logf("release on the replaced process: %d", st)

	// What the bucket holds: the new owner, started again, reads it.
	a.caddy.Kill()
	bEnv.caddy.Restart()
	if err := waitServing(bEnv.caddy, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	st, v := call(bEnv, "GET", sub, "")
	if st != 200 {
		t.Fatalf("get: %d %v", st, v)
	}
	if link := v["streams"].([]any)[0].(map[string]any); link["acked_offset"] != tail {
		t.Errorf("after the replaced process's release the subscription has acked %v, want %s (the new owner's ack)",
			link["acked_offset"], tail)
	}
}

// launchSameNode starts a second Caddy on a's storage and data directory,
// so with a's node id, straight to versitygw (not through a's proxy), as a
// restart of the node would while the first process still runs.
func launchSameNode(t *testing.T, a *fhEnv, directives ...string) *fhEnv {
	t.Helper()
	b, err := caddytest.Launch(t, caddytest.Options{
		Storage:    testenv.StoreURL(a.v.Endpoint, a.bucket, caddytest.S3Prefix),
		DataDir:    a.caddy.DataDir(),
		Env:        caddytest.S3Env(a.v),
		Directives: directives,
	})
	if err == nil {
		err = waitServing(b, 30*time.Second)
	}
	if err != nil {
		t.Fatalf("second process of the same node: %v", err)
	}
	return &fhEnv{t: t, v: a.v, bucket: a.bucket, caddy: b, client: a.client}
}

// TestStopOfReplacedProcess stops (SIGTERM) a process that another of the
// same node replaced. Its lease is the new owner's, so it has nothing to
// release: its log must say plainly that it was replaced, as a warning,
// not report a cleanup error with a bare "precondition failed"; it must
// exit cleanly and leave the new owner serving.
func TestStopOfReplacedProcess(t *testing.T) {
	const (
		name = "/takeover/stop"
		text = "text/plain"
	)
	a := fhStart(t, fhOptions{})
	a.create(name, text)
	a.append(name, text, []byte("before\n"))
	b := launchSameNode(t, a)

	if err := a.caddy.Stop(); err != nil {
		t.Errorf("stopping the replaced process: %v", err)
	}
	var said bool
	for _, line := range strings.Split(a.caddy.Logs(), "\n") {
		if strings.Contains(line, "precondition failed") {
			t.Errorf("the replaced process's log reports the lease release as a bare failure:\n%s", line)
		}
		if strings.Contains(line, "this one was replaced") {
			said = true
			if !strings.Contains(line, `"level":"warn"`) {
				t.Errorf("the replacement is not logged as a warning:\n%s", line)
			}
		}
	}
	if !said {
		t.Error("the replaced process's log does not say it was replaced")
	}
	b.append(name, text, []byte("after\n"))
	if got, _, err := b.readBytes(name); err != nil || string(got) != "before\nafter\n" {
		t.Errorf("the new owner reads %q (%v), want %q", got, err, "before\nafter\n")
	}
}
