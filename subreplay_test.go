package picomq

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/streamstore"
)

// linkedAt is the acked offset at which subscription view v links stream
// path, and whether it does.
func linkedAt(v map[string]any, path string) (string, bool) {
	streams, _ := v["streams"].([]any)
	for _, x := range streams {
		l, _ := x.(map[string]any)
		if l["path"] == path {
			acked, _ := l["acked_offset"].(string)
			return acked, true
		}
	}
	return "", false
}

// linkLostWithTheProcess creates stream events/<name> with a record on n,
// whose subscription p1 under /v1/stream/ (sub) has a pattern matching
// it, waits until sub links it, stops n and puts p1's document back as it
// was before the create: the link's write lost with the process. It
// returns the document's path.
func linkLostWithTheProcess(t *testing.T, n *subNode, dir, sub, stream string) string {
	t.Helper()
	doc := filepath.Join(dir, filepath.FromSlash(streamstore.DocObjectKey(subDocKey("/v1/stream/", "p1"))))
	before, err := os.ReadFile(doc)
	if err != nil {
		t.Fatal(err)
	}
	if st, v := n.call(t, "PUT", "/v1/stream/"+stream, `[{"n":1}]`); st != 201 {
		t.Fatalf("create %s: %d %v", stream, st, v)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, v := n.call(t, "GET", sub, "")
		if _, ok := linkedAt(v, stream); ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not linked: %v", stream, v)
		}
		time.Sleep(10 * time.Millisecond)
	}
	n.stop(t)
	// A new inode, as the module never writes it.
	if err := os.Remove(doc); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(doc, before, 0o644); err != nil {
		t.Fatal(err)
	}
	return doc
}

// TestPatternLinkLostWithItsProcess: an append to a new stream links it to
// the subscriptions whose pattern matches before it is acknowledged, but in
// memory: the document that keeps the link is written after. When that
// write is lost with the process (here: the document put back as it was
// before), the start links the stream again from the appends its replay
// found, so record 0 is offered. It was not linked until its next append,
// and then from there: record 0 was never offered.
func TestPatternLinkLostWithItsProcess(t *testing.T) {
	dir := t.TempDir()
	n := startSubNode(t, dir)
	const sub = "/v1/stream/__ds/subscriptions/p1"
	n.pullSubscribe(t, sub)
	doc := linkLostWithTheProcess(t, n, dir, sub, "events/new")

	n = startSubNode(t, dir)
	st, v := n.call(t, "GET", sub, "")
	if st != 200 {
		t.Fatalf("GET after the restart: %d %v", st, v)
	}
	if acked, ok := linkedAt(v, "events/new"); !ok || acked != (position{}).String() {
		t.Fatalf("events/new after the restart: linked %v at %q, want at %q", ok, acked, position{}.String())
	}
	// Written to the document at the load.
	if after, err := os.ReadFile(doc); err != nil || !strings.Contains(string(after), `"events/new"`) {
		t.Fatalf("the document after the restart: %v, link to events/new %v", err, strings.Contains(string(after), `"events/new"`))
	}
}

// TestPatternLinkLostAtTheLinkLimit: a subscription at its link limit
// links a new stream's first append by unlinking an idle glob link to make
// way; when that write is lost with the process, the start makes way the
// same, and links the new stream from record 0. It was skipped as if the
// subscription had no room.
func TestPatternLinkLostAtTheLinkLimit(t *testing.T) {
	dir := t.TempDir()
	oneLink := func(d *durableStreams) { d.subs.maxLinks = 1 }
	n := startSubNode(t, dir, oneLink)
	if st, v := n.call(t, "PUT", "/v1/stream/events/a", `[{"n":1}]`); st != 201 {
		t.Fatalf("create events/a: %d %v", st, v)
	}
	const sub = "/v1/stream/__ds/subscriptions/p1"
	n.pullSubscribe(t, sub) // links events/a at its tail: idle
	linkLostWithTheProcess(t, n, dir, sub, "events/b")

	n = startSubNode(t, dir, oneLink)
	_, v := n.call(t, "GET", sub, "")
	if acked, ok := linkedAt(v, "events/b"); !ok || acked != (position{}).String() {
		t.Fatalf("events/b after the restart: linked %v at %q, want at %q (%v)", ok, acked, position{}.String(), v)
	}
	if _, ok := linkedAt(v, "events/a"); ok {
		t.Errorf("events/a still linked past the limit of 1: %v", v)
	}
}
