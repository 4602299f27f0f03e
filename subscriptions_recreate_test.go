package picomq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/streamstore"
)

// A link follows the stream its offsets count in: the engine's notes of
// appends and deletes (carrying the stream's id) start it over when the
// stream under its name is another one, and never let one stream's
// offsets stand for another's.
func TestSubLinkApplyNote(t *testing.T) {
	const gen = 7
	for _, c := range []struct {
		name    string
		link    *subLink // nil: not linked
		inWake  bool     // a wake is in flight
		note    appendNote
		want    *subLink // nil: not linked after
		changed bool
		grew    bool
		over    bool // the link starts over: the wake's snapshot of it goes
	}{
		{
			name: "append to the linked stream advances the tail",
			link: &subLink{Glob: true, Stream: "X", Acked: 3, Tail: 3},
			note: appendNote{id: "X", first: 3, next: 5},
			want: &subLink{Glob: true, Stream: "X", Acked: 3, Tail: 5}, changed: true, grew: true,
		},
		{
			name: "a stream discovered by the pattern is linked before the append",
			note: appendNote{id: "X", first: 4, next: 6},
			want: &subLink{Glob: true, Stream: "X", Acked: 4, Tail: 6}, changed: true, grew: true,
		},
		{
			name: "a stream created again under a glob link is new from seq 0",
			link: &subLink{Glob: true, Stream: "X", Acked: 3, Tail: 3},
			note: appendNote{id: "Y", first: 0, next: 2},
			want: &subLink{Glob: true, Stream: "Y", Acked: 0, Tail: 2, ResetGen: gen}, changed: true, grew: true, over: true,
		},
		{
			name: "a stream created again under an explicit link, its delete missed",
			link: &subLink{Explicit: true, Stream: "X", Acked: 3, Tail: 3},
			note: appendNote{id: "Y", first: 5, next: 6},
			want: &subLink{Explicit: true, Stream: "Y", Acked: 0, Tail: 6, ResetGen: gen}, changed: true, grew: true, over: true,
		},
		{
			name: "a delete drops an idle glob link",
			link: &subLink{Glob: true, Stream: "X", Acked: 3, Tail: 5},
			note: appendNote{id: "X", deleted: true},
			want: nil, changed: true, over: true,
		},
		{
			name: "a delete during a wake keeps the glob link, hidden, until the wake ends",
			link: &subLink{Glob: true, Stream: "X", Acked: 3, Tail: 5}, inWake: true,
			note: appendNote{id: "X", deleted: true},
			want: &subLink{Glob: true, Gone: true, ResetGen: gen}, changed: true, over: true,
		},
		{
			name: "a delete keeps an explicit link, at 0 and without a stream",
			link: &subLink{Explicit: true, Glob: true, Stream: "X", Acked: 3, Tail: 5},
			note: appendNote{id: "X", deleted: true},
			want: &subLink{Explicit: true, Glob: true, ResetGen: gen}, changed: true, over: true,
		},
		{
			name: "the delete of an older stream leaves the link of the newer one",
			link: &subLink{Glob: true, Stream: "Y", Acked: 1, Tail: 2},
			note: appendNote{id: "X", deleted: true},
			want: &subLink{Glob: true, Stream: "Y", Acked: 1, Tail: 2},
		},
		{
			name: "a link stored without an id takes the id of the stream that goes on",
			link: &subLink{Glob: true, Acked: 3, Tail: 3},
			note: appendNote{id: "X", first: 3, next: 4},
			want: &subLink{Glob: true, Stream: "X", Acked: 3, Tail: 4}, changed: true, grew: true,
		},
		{
			name: "a link stored without an id meets a stream that starts below its tail",
			link: &subLink{Glob: true, Acked: 3, Tail: 3},
			note: appendNote{id: "X", first: 0, next: 2},
			want: &subLink{Glob: true, Stream: "X", Acked: 0, Tail: 2, ResetGen: gen}, changed: true, grew: true, over: true,
		},
		{
			name: "an explicit link made before its stream existed",
			link: &subLink{Explicit: true},
			note: appendNote{id: "X", first: 0, next: 2},
			want: &subLink{Explicit: true, Stream: "X", Acked: 0, Tail: 2}, changed: true, grew: true,
		},
		{
			name: "a glob link kept for a wake meets the stream created again",
			link: &subLink{Glob: true, Gone: true, ResetGen: gen}, inWake: true,
			note: appendNote{id: "Y", first: 0, next: 1},
			want: &subLink{Glob: true, Stream: "Y", Acked: 0, Tail: 1, ResetGen: gen}, changed: true, grew: true,
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := &subState{Root: "/r/", Config: subConfig{Pattern: "events/*"}, Generation: gen, Links: map[string]*subLink{}}
			if c.link != nil {
				l := *c.link
				s.Links["events/a"] = &l
			}
			s.Snapshot = map[string]uint64{"events/a": 3, "events/b": 9}
			if c.inWake {
				s.WakeID = "w_1"
			}
			c.note.name = "/r/events/a"
			changed, grew := s.applyNote("events/a", c.note)
			if changed != c.changed || grew != c.grew {
				t.Errorf("changed, grew = %v, %v; want %v, %v", changed, grew, c.changed, c.grew)
			}
			checkLink(t, s.Links["events/a"], c.want)
			// What the wake in flight was offered of the old stream is
			// not acked into the new one when the webhook says done.
			if _, kept := s.Snapshot["events/a"]; kept == c.over {
				t.Errorf("snapshot of events/a kept: %v; want %v", kept, !c.over)
			}
			if s.Snapshot["events/b"] != 9 {
				t.Errorf("snapshot of another stream changed: %v", s.Snapshot)
			}
		})
	}
}

// At load, the stored links are compared with the streams the engine has
// under their names: the documents may be older than the streams.
func TestSubLinkReconcile(t *testing.T) {
	const gen = 4
	info := func(id string, start, next uint64) linkHead {
		return linkHead{info: streamstore.Info{ID: id, StartSeq: start, NextSeq: next}}
	}
	for _, c := range []struct {
		name    string
		link    subLink
		head    linkHead
		want    *subLink
		changed bool
	}{
		{"the same stream, as stored", subLink{Glob: true, Stream: "X", Acked: 1, Tail: 3}, info("X", 0, 3),
			&subLink{Glob: true, Stream: "X", Acked: 1, Tail: 3}, false},
		{"the same stream, with records whose note was not saved", subLink{Glob: true, Stream: "X", Acked: 1, Tail: 3}, info("X", 0, 5),
			&subLink{Glob: true, Stream: "X", Acked: 1, Tail: 5}, true},
		{"another stream under the name", subLink{Glob: true, Stream: "X", Acked: 3, Tail: 3}, info("Y", 0, 2),
			&subLink{Glob: true, Stream: "Y", Acked: 0, Tail: 2, ResetGen: gen}, true},
		{"another stream, trimmed", subLink{Explicit: true, Stream: "X", Acked: 3, Tail: 3}, info("Y", 4, 9),
			&subLink{Explicit: true, Stream: "Y", Acked: 4, Tail: 9, ResetGen: gen}, true},
		{"a glob link's stream was deleted", subLink{Glob: true, Stream: "X", Acked: 3, Tail: 3}, linkHead{err: streamstore.ErrNotFound},
			nil, true},
		{"an explicit link's stream was deleted", subLink{Explicit: true, Stream: "X", Acked: 3, Tail: 3}, linkHead{err: streamstore.ErrNotFound},
			&subLink{Explicit: true, ResetGen: gen}, true},
		{"an explicit link to a stream never created", subLink{Explicit: true}, linkHead{err: streamstore.ErrNotFound},
			&subLink{Explicit: true}, false},
		{"stored without an id: the stream is taken to be the one", subLink{Glob: true, Acked: 2, Tail: 3}, info("X", 0, 3),
			&subLink{Glob: true, Stream: "X", Acked: 2, Tail: 3}, true},
		{"stored without an id: a shorter stream is another", subLink{Glob: true, Acked: 3, Tail: 3}, info("X", 0, 1),
			&subLink{Glob: true, Stream: "X", Acked: 0, Tail: 1, ResetGen: gen}, true},
		{"stored without an id, and deleted", subLink{Glob: true, Acked: 3, Tail: 3}, linkHead{err: streamstore.ErrNotFound},
			nil, true},
		{"the engine could not say", subLink{Glob: true, Stream: "X", Acked: 3, Tail: 3}, linkHead{err: streamstore.ErrUnavailable},
			&subLink{Glob: true, Stream: "X", Acked: 3, Tail: 3}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			l := c.link
			s := &subState{Root: "/r/", Generation: gen, Links: map[string]*subLink{"events/a": &l}}
			changed := s.reconcile(map[string]linkHead{"/r/events/a": c.head})
			if changed != c.changed {
				t.Errorf("changed = %v, want %v", changed, c.changed)
			}
			checkLink(t, s.Links["events/a"], c.want)
		})
	}
}

// claimLinks claims subscription sub for worker w and returns the claim
// and its streams by path.
func (n *subNode) claimLinks(t *testing.T, sub, w string) (map[string]any, map[string]map[string]any) {
	t.Helper()
	st, claim := n.call(t, "POST", sub+"/claim", `{"worker":"`+w+`"}`)
	if st != 200 {
		t.Fatalf("claim: %d %v", st, claim)
	}
	links := map[string]map[string]any{}
	for _, s := range claim["streams"].([]any) {
		l := s.(map[string]any)
		links[l["path"].(string)] = l
	}
	return claim, links
}

// ack acks stream p at offset off for the claim, with done.
func (n *subNode) ack(t *testing.T, sub string, claim map[string]any, p, off string) map[string]any {
	t.Helper()
	body := `{"wake_id":"` + claim["wake_id"].(string) + `","generation":` + strconv.Itoa(int(claim["generation"].(float64))) +
		`,"acks":[{"stream":"` + p + `","offset":"` + off + `"}],"done":true}`
	st, v := n.call(t, "POST", sub+"/ack", body, "Authorization", "Bearer "+claim["token"].(string))
	if st != 200 {
		t.Fatalf("ack %s at %s: %d %v", p, off, st, v)
	}
	return v
}

// A worker holds a wake for a stream that is deleted and created again
// before it acks: its ack names offsets of the old stream, which must not
// move the cursor in the new one (before, acking the old tail, 2, skipped
// the new stream's first two records). The new records are offered again.
func TestAckOfDeletedStreamMovesNothing(t *testing.T) {
	n := startSubNode(t, t.TempDir())
	const sub = "/v1/stream/__ds/subscriptions/p1"
	n.pullSubscribe(t, sub)
	if st, _ := n.call(t, "PUT", "/v1/stream/events/a", `[{"n":1},{"n":2}]`); st != 201 {
		t.Fatalf("create stream: %d", st)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(n.wakeEvents(t, "/v1/stream/wake/pool"), `"subscription_id":"p1"`) {
		if time.Now().After(deadline) {
			t.Fatal("no wake event")
		}
		time.Sleep(20 * time.Millisecond)
	}
	claim, links := n.claimLinks(t, sub, "w1")
	old := links["events/a"]["tail_offset"].(string)
	if old != (position{seq: 2}).String() {
		t.Fatalf("claim offered events/a up to %s; want %s", old, position{seq: 2})
	}
	if st, _ := n.call(t, "DELETE", "/v1/stream/events/a", ""); st != 204 {
		t.Fatalf("delete stream: %d", st)
	}
	if st, _ := n.call(t, "PUT", "/v1/stream/events/a", `[{"n":10},{"n":11},{"n":12}]`); st != 201 {
		t.Fatalf("create stream again: %d", st)
	}
	// The create's records are noted by the manager's loop: wait until the
	// subscription shows the new stream's tail to a claimer.
	deadline = time.Now().Add(5 * time.Second)
	for {
		_, v := n.call(t, "GET", sub, "")
		if b, _ := json.Marshal(v["streams"]); strings.Contains(string(b), `"events/a"`) || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	n.ack(t, sub, claim, "events/a", old)
	_, links = n.claimLinks(t, sub, "w2")
	got := links["events/a"]
	if got == nil || got["acked_offset"] != (position{}).String() || got["tail_offset"] != (position{seq: 3}).String() {
		t.Fatalf("after the old stream's ack, events/a is offered as %v; want acked %s, tail %s", got, position{}, position{seq: 3})
	}
}

// The node was down while streams changed: the subscription document,
// written before stream ids were kept, names links whose streams were
// deleted, deleted and created again, or left alone. At load each follows
// what is there now.
func TestSubscriptionLoadFollowsStreamsChangedWhileDown(t *testing.T) {
	dir := t.TempDir()
	n := startSubNode(t, dir)
	const sub = "/v1/stream/__ds/subscriptions/p1"
	if st, _ := n.call(t, "PUT", "/v1/stream/wake/pool", "[]"); st != 201 {
		t.Fatal("wake stream")
	}
	for _, p := range []string{"a", "b", "c"} {
		if st, _ := n.call(t, "PUT", "/v1/stream/events/"+p, `[{"n":1},{"n":2},{"n":3}]`); st != 201 {
			t.Fatalf("create events/%s: %d", p, st)
		}
	}
	if st, v := n.call(t, "PUT", sub, `{"type":"pull-wake","pattern":"events/*","streams":["other/d"],"wake_stream":"wake/pool","lease_ttl_ms":600000}`); st != 201 {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	if st, _ := n.call(t, "PUT", "/v1/stream/other/d", `[{"n":1},{"n":2}]`); st != 201 {
		t.Fatal("other/d")
	}
	// Consume other/d's two records, so that every link is acked at its tail.
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(n.wakeEvents(t, "/v1/stream/wake/pool"), `"subscription_id":"p1"`) {
		if time.Now().After(deadline) {
			t.Fatal("no wake event")
		}
		time.Sleep(20 * time.Millisecond)
	}
	claim, _ := n.claimLinks(t, sub, "w1")
	if v := n.ack(t, sub, claim, "other/d", (position{seq: 2}).String()); v["next_wake"] != false {
		t.Fatalf("ack: %v", v)
	}
	n.stop(t)

	// Down: strip the stream ids from the document, as one written before
	// they were kept, and change the streams behind the subscriptions'
	// back (the node's manager starts with its first request).
	ctx := context.Background()
	n = startSubNode(t, dir)
	key := subDocKey("/v1/stream/", "p1")
	data, ver, err := n.eng.GetDoc(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(data, &doc); err != nil {
		t.Fatal(err)
	}
	for _, l := range doc["links"].(map[string]any) {
		delete(l.(map[string]any), "stream_id")
	}
	data, _ = json.Marshal(doc)
	if _, err := n.eng.PutDoc(ctx, key, data, ver); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"/v1/stream/events/a", "/v1/stream/events/c", "/v1/stream/other/d"} {
		if err := n.eng.Delete(ctx, name); err != nil {
			t.Fatalf("delete %s: %v", name, err)
		}
	}
	rec := []streamstore.NewRecord{{Body: []byte(`{"n":10}`)}}
	if _, _, err := n.eng.Create(ctx, "/v1/stream/events/a", streamstore.CreateRequest{ContentType: "application/json", Records: rec}); err != nil {
		t.Fatal(err)
	}

	// Up: events/a is the new stream from its start, events/b as it was,
	// events/c no longer linked, other/d still linked, at 0.
	deadline = time.Now().Add(5 * time.Second)
	for strings.Count(n.wakeEvents(t, "/v1/stream/wake/pool"), `"subscription_id":"p1"`) < 2 {
		if time.Now().After(deadline) {
			_, v := n.call(t, "GET", sub, "")
			t.Fatalf("no wake for the stream created again while down; links %v", v["streams"])
		}
		time.Sleep(20 * time.Millisecond)
	}
	_, links := n.claimLinks(t, sub, "w2")
	got := map[string]string{}
	for p, l := range links {
		got[p] = fmt.Sprintf("%s..%s", l["acked_offset"], l["tail_offset"])
	}
	at := func(acked, tail uint64) string {
		return fmt.Sprintf("%s..%s", position{seq: acked}, position{seq: tail})
	}
	want := map[string]string{"events/a": at(0, 1), "events/b": at(3, 3), "other/d": at(0, 0)}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("links after the restart:\n got %v\nwant %v", got, want)
	}
	// The document says so too, with the ids now.
	data, _, err = n.eng.GetDoc(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	var s subState
	if err := json.Unmarshal(data, &s); err != nil {
		t.Fatal(err)
	}
	info, err := n.eng.Head(ctx, "/v1/stream/events/a")
	if err != nil && !errors.Is(err, streamstore.ErrNotFound) {
		t.Fatal(err)
	}
	if l := s.Links["events/a"]; l == nil || l.Stream != info.ID {
		t.Fatalf("stored link of events/a: %+v; want stream %s", l, info.ID)
	}
}

// checkLink fails t unless got is want (both nil: no link).
func checkLink(t *testing.T, got, want *subLink) {
	t.Helper()
	switch {
	case want == nil && got != nil:
		t.Errorf("link %+v; want none", *got)
	case want != nil && got == nil:
		t.Errorf("no link; want %+v", *want)
	case want != nil && *got != *want:
		t.Errorf("link %+v; want %+v", *got, *want)
	}
}
