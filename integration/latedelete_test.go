package integration

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestLateDeleteSparesTheNextStream: the first attempt of a stream delete's
// metadata write (its swap for a grave) is held up on its way to the
// bucket. Caddy's retry buries the stream, the client gets its 204 and
// creates the stream again with a record. Then the held attempt lands. It
// must change nothing: an unconditional DELETE removed the new stream's
// metadata, and after a restart the new stream and its acknowledged record
// were gone.
func TestLateDeleteSparesTheNextStream(t *testing.T) {
	e := fhStart(t, fhOptions{Directives: []string{"s3_timeout 1s"}, Optional: []string{"compact_interval 1h"}})
	const path = "/late-delete"
	key := "streams/" + hex.EncodeToString([]byte(path)) + ".m"
	e.create(path, "text/plain")
	e.append(path, "text/plain", []byte("old"))

	// No checkpoint runs (compact_interval): the next write of the key is
	// the delete's.
	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: key, Times: 1})
	defer release()
	if resp := e.must(fhReq{Method: http.MethodDelete, Path: path}); resp.Status != http.StatusNoContent {
		t.Fatalf("DELETE %s: %s, want 204", path, resp)
	}
	if held := e.proxy.Held(); held != 1 {
		t.Fatalf("%d requests held, want the delete's first attempt", held)
	}
	if resp := e.must(fhReq{Method: http.MethodGet, Path: path + "?offset=-1"}); resp.Status != http.StatusNotFound {
		t.Fatalf("GET after the delete: %s, want 404", resp)
	}
	e.create(path, "text/plain")
	e.append(path, "text/plain", []byte("new"))

	release()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := e.proxy.WaitLanded(ctx); err != nil {
		t.Fatalf("the held delete did not land: %v", err)
	}
	if _, err := e.get(key); err != nil {
		t.Errorf("the new stream's metadata after the late delete landed: %v", err)
	}
	e.caddy.Kill()
	e.caddy.Restart()
	got, _, err := e.readBytes(path)
	if err != nil {
		t.Fatalf("after a restart: %v", err)
	}
	if string(got) != "new" {
		t.Fatalf("after a restart %s reads %q, want %q", path, got, "new")
	}
}

// TestLateCreateSparesTheDeletedStream: the first attempt of a create's
// metadata write is held up on its way to the bucket; Caddy's retry
// creates the stream (201), and the client deletes it (204). Then the held
// attempt lands. It must find the deleted stream's grave and change
// nothing: create-only, it used to find the key free and bring the deleted
// stream back, before and after a restart.
func TestLateCreateSparesTheDeletedStream(t *testing.T) {
	e := fhStart(t, fhOptions{Directives: []string{"s3_timeout 1s"}})
	const path = "/late-create"
	key := "streams/" + hex.EncodeToString([]byte(path)) + ".m"

	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: key, Times: 1})
	defer release()
	e.create(path, "text/plain")
	if held := e.proxy.Held(); held != 1 {
		t.Fatalf("%d requests held, want the create's first attempt", held)
	}
	if resp := e.must(fhReq{Method: http.MethodDelete, Path: path}); resp.Status != http.StatusNoContent {
		t.Fatalf("DELETE %s: %s, want 204", path, resp)
	}

	release()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := e.proxy.WaitLanded(ctx); err != nil {
		t.Fatalf("the held create did not land: %v", err)
	}
	if resp := e.must(fhReq{Method: http.MethodGet, Path: path + "?offset=-1"}); resp.Status != http.StatusNotFound {
		t.Fatalf("GET after the late create landed: %s, want 404", resp)
	}
	e.caddy.Kill()
	e.caddy.Restart()
	if resp := e.must(fhReq{Method: http.MethodGet, Path: path + "?offset=-1"}); resp.Status != http.StatusNotFound {
		t.Fatalf("after a restart GET %s: %s, want 404", path, resp)
	}
	e.create(path, "text/plain") // the name is free for a new stream
}

// TestLateSubscriptionDeleteSparesTheNext: the same as above for a
// subscription's document. A subscription deleted and created again under
// its id must survive the first delete's held attempt (its write of a
// grave) landing late.
func TestLateSubscriptionDeleteSparesTheNext(t *testing.T) {
	e := fhStart(t, fhOptions{Directives: []string{"s3_timeout 1s"}})
	const sub = "/r/__ds/subscriptions/pull"
	hdr := map[string]string{"Content-Type": "application/json"}
	subscribe := func(pattern string) {
		t.Helper()
		body := `{"type":"pull-wake","pattern":"` + pattern + `","wake_stream":"wake","lease_ttl_ms":600000}`
		if resp := e.must(fhReq{Method: http.MethodPut, Path: sub, Header: hdr, Body: []byte(body)}); resp.Status != http.StatusCreated {
			t.Fatalf("PUT %s (%s): %s, want 201", sub, pattern, resp)
		}
	}
	e.create("/r/wake", "application/json")
	subscribe("events/*")

	doc := "subs/" + hex.EncodeToString([]byte("/r/")) + "/" + hex.EncodeToString([]byte("pull"))
	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: doc, Times: 1})
	defer release()
	if resp := e.must(fhReq{Method: http.MethodDelete, Path: sub}); resp.Status != http.StatusNoContent {
		t.Fatalf("DELETE %s: %s, want 204", sub, resp)
	}
	if held := e.proxy.Held(); held != 1 {
		t.Fatalf("%d requests held, want the delete's first attempt", held)
	}
	subscribe("other/*")

	release()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := e.proxy.WaitLanded(ctx); err != nil {
		t.Fatalf("the held delete did not land: %v", err)
	}
	e.caddy.Kill()
	e.caddy.Restart()
	resp := e.must(fhReq{Method: http.MethodGet, Path: sub})
	if resp.Status != http.StatusOK {
		t.Fatalf("after a restart GET %s: %s, want 200", sub, resp)
	}
	var got struct {
		Pattern string `json:"pattern"`
	}
	if err := json.Unmarshal(resp.Body, &got); err != nil || got.Pattern != "other/*" {
		t.Fatalf("after a restart the subscription is %q (%v), want the second one, other/*", resp.Body, err)
	}
}

// TestLateSubscriptionCreateSparesTheDeleted: the first attempt of a
// subscription create's document write is held up on its way to the
// bucket; Caddy's retry creates it (201) and the client deletes it (204).
// Then the held attempt lands. It must find the subscription's grave and
// change nothing: create-only, it used to find the key free and bring the
// deleted subscription back, as a restart showed.
func TestLateSubscriptionCreateSparesTheDeleted(t *testing.T) {
	e := fhStart(t, fhOptions{Directives: []string{"s3_timeout 1s"}})
	const sub = "/r/__ds/subscriptions/late"
	e.create("/r/wake", "application/json")

	// The subscription's own document (subs/<hex root>/<hex id>), not the
	// signing key its first use writes.
	doc := "subs/" + hex.EncodeToString([]byte("/r/")) + "/" + hex.EncodeToString([]byte("late"))
	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: doc, Times: 1})
	defer release()
	body := `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake","lease_ttl_ms":600000}`
	hdr := map[string]string{"Content-Type": "application/json"}
	if resp := e.must(fhReq{Method: http.MethodPut, Path: sub, Header: hdr, Body: []byte(body)}); resp.Status != http.StatusCreated {
		t.Fatalf("PUT %s: %s, want 201", sub, resp)
	}
	if held := e.proxy.Held(); held != 1 {
		t.Fatalf("%d requests held, want the create's first attempt", held)
	}
	if resp := e.must(fhReq{Method: http.MethodDelete, Path: sub}); resp.Status != http.StatusNoContent {
		t.Fatalf("DELETE %s: %s, want 204", sub, resp)
	}

	release()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := e.proxy.WaitLanded(ctx); err != nil {
		t.Fatalf("the held create did not land: %v", err)
	}
	e.caddy.Kill()
	e.caddy.Restart()
	if resp := e.must(fhReq{Method: http.MethodGet, Path: sub}); resp.Status != http.StatusNotFound {
		t.Fatalf("after a restart GET %s: %s, want 404", sub, resp)
	}
}

// TestLateDataPUTOfADeletedStreamIsCollected: a compaction's PUT of a
// stream's data object is held up on its way (every attempt, each given up
// by its client after s3_timeout), so the fold fails; the stream is
// deleted, and the collector removes its data. Then the held PUTs land.
// S3 takes a request up to 15 minutes after it was signed, so this is a
// write the bucket can see; nothing listed the dead id's data again, and
// the object stayed for good. The collector now sweeps the id's data once
// more when it removes the grave (grave_time later).
func TestLateDataPUTOfADeletedStreamIsCollected(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"s3_timeout 1s", "compact_interval 1s", "pack_below off", "grave_time 2s"}})
	const path = "/late-data"
	e.create(path, "text/plain")
	e.append(path, "text/plain", []byte("records"))

	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "/data/"})
	defer release()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := e.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("no compaction PUT of a data object within a minute (compact_interval 1s): %v", err)
	}
	// The delete waits for the fold to give up (it holds the stream's
	// metadata), then buries the stream.
	if resp := e.must(fhReq{Method: http.MethodDelete, Path: path}); resp.Status != http.StatusNoContent {
		t.Fatalf("DELETE %s: %s, want 204", path, resp)
	}
	err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
		if left := e.mustList("gc/"); len(left) > 0 {
			return fmt.Errorf("tombstones %v", left)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("the collector did not work off the delete: %v", err)
	}
	release()
	if err := e.proxy.WaitLanded(ctx); err != nil {
		t.Fatalf("the held PUTs did not land: %v", err)
	}
	landed := e.mustList("data/")
	if len(landed) == 0 {
		t.Fatal("no data object landed late: this tests nothing")
	}
	t.Logf("landed after the delete: %v", landed)
	err = fhWaitFor(fhCompactWait, 200*time.Millisecond, func() error {
		if left := append(e.mustList("data/"), e.mustList("graves/")...); len(left) > 0 {
			return fmt.Errorf("left in the bucket: %v", left)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("a deleted stream's data that landed late stayed: %v", err)
	}
	// A grave_time this short is for tests: Caddy says what it risks.
	if !strings.Contains(e.caddy.Logs(), "grave_time is shorter than the time S3 accepts a signed request") {
		t.Error("grave_time 2s on S3 started without a warning")
	}
}
