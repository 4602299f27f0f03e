package picomq

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sort"
	"strings"
	"testing"
	"time"
)

// TestRefusedRequestChangesNothing: a claim, ack, callback, release, or
// change of a subscription's streams whose document cannot be written is
// answered 503 and leaves the subscription as it was, in memory, in the
// manager's index and in its due heap. Handlers used to change the state
// first and save after, and kept the change when the save failed: a claim
// answered 503 held the lease (other workers got ALREADY_CLAIMED), an ack
// answered 503 had moved the cursor (the next save of anything made it
// durable), and a done ack or a release whose save failed was even
// answered 200 or 204.
func TestRefusedRequestChangesNothing(t *testing.T) {
	lease := func() int64 { return time.Now().Add(time.Minute).UnixMilli() }
	at := func(seq uint64) string { return position{seq: seq}.String() }
	fiveRecords := func() map[string]*subLink {
		return map[string]*subLink{"events/a": {Glob: true, Acked: 1, Tail: 5, Stream: "x"}}
	}
	for _, tc := range []struct {
		name   string
		sub    func() *subState
		op     string
		body   string // %[1]q is the wake id, %[2]d the generation
		status int    // with saves failing
	}{
		{"claim opening a generation", func() *subState {
			return &subState{ID: "p", Config: subConfig{Type: "pull-wake"}, Links: fiveRecords()}
		}, "claim", `{"worker":"w2"}`, 503},
		{"claim of an announced wake", func() *subState {
			return &subState{ID: "p", Config: subConfig{Type: "pull-wake"}, Links: fiveRecords(),
				Generation: 2, WakeID: "w_2", Failures: 3, NextTry: lease()}
		}, "claim", `{"worker":"w2"}`, 503},
		{"heartbeat moving the cursor", func() *subState {
			return &subState{ID: "p", Config: subConfig{Type: "pull-wake"}, Links: fiveRecords(),
				Generation: 2, WakeID: "w_2", Holder: "w1", LeaseUntil: lease()}
		}, "ack", `{"wake_id":%[1]q,"generation":%[2]d,"acks":[{"stream":"events/a","offset":"` + at(3) + `"}]}`, 503},
		{"done ack of everything", func() *subState {
			return &subState{ID: "p", Config: subConfig{Type: "pull-wake"}, Links: fiveRecords(),
				Generation: 2, WakeID: "w_2", Holder: "w1", LeaseUntil: lease(),
				Snapshot: map[string]uint64{"events/a": 5}}
		}, "ack", `{"wake_id":%[1]q,"generation":%[2]d,"done":true,"acks":[{"stream":"events/a","offset":"` + at(5) + `"}]}`, 503},
		{"done ack leaving work (a new wake)", func() *subState {
			return &subState{ID: "p", Config: subConfig{Type: "pull-wake"}, Links: fiveRecords(),
				Generation: 2, WakeID: "w_2", Holder: "w1", LeaseUntil: lease()}
		}, "ack", `{"wake_id":%[1]q,"generation":%[2]d,"done":true,"acks":[{"stream":"events/a","offset":"` + at(3) + `"}]}`, 503},
		{"webhook callback done", func() *subState {
			return &subState{ID: "h", Config: subConfig{Type: "webhook"}, Links: fiveRecords(),
				Generation: 2, WakeID: "w_2", LeaseUntil: lease(), Failures: 1,
				Snapshot: map[string]uint64{"events/a": 5}}
		}, "callback", `{"wake_id":%[1]q,"generation":%[2]d,"done":true,"acks":[{"stream":"events/a","offset":"` + at(5) + `"}]}`, 503},
		{"release", func() *subState {
			return &subState{ID: "p", Config: subConfig{Type: "pull-wake"}, Links: fiveRecords(),
				Generation: 2, WakeID: "w_2", Holder: "w1", LeaseUntil: lease()}
		}, "release", `{"wake_id":%[1]q,"generation":%[2]d}`, 503},
		{"add streams", func() *subState {
			return &subState{ID: "p", Config: subConfig{Type: "pull-wake"}, Links: fiveRecords()}
		}, "streams", `{"streams":["other/x","events/a"]}`, 503},
		{"remove a stream", func() *subState {
			links := fiveRecords()
			links["other/x"] = &subLink{Explicit: true, Acked: 1, Tail: 4, Stream: "y"}
			return &subState{ID: "p", Config: subConfig{Type: "pull-wake"}, Links: links}
		}, "streams/other/x", ``, 503},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := newDueRig(t)
			s := g.add(t, tc.sub())
			before := refusedView(t, g, s)
			g.failSaves.Store(true)
			if st, body := g.serve(t, s, tc.op, tc.body); st != tc.status {
				t.Fatalf("%s with the document write failing: %d %s, want %d", tc.op, st, body, tc.status)
			}
			if after := refusedView(t, g, s); after != before {
				t.Fatalf("a refused %s changed the subscription:\nbefore %s\nafter  %s", tc.op, before, after)
			}
			// Saves work again: the same request is served as if the
			// refused one had never come.
			g.failSaves.Store(false)
			want := map[string]int{"claim": 200, "ack": 200, "callback": 200, "release": 204, "streams": 204, "streams/other/x": 204}[tc.op]
			if st, body := g.serve(t, s, tc.op, tc.body); st != want {
				t.Fatalf("%s once saves work: %d %s, want %d", tc.op, st, body, want)
			}
		})
	}
}

// serve sends s's worker's request op (claim, ack, callback, release,
// streams to add streams, streams/<path> to remove one) with body, in
// which %[1]q is s's wake id and %[2]d its generation, and returns the
// status and body of the answer.
func (g *dueRig) serve(t *testing.T, s *subState, op, body string) (int, string) {
	t.Helper()
	g.m.mu.Lock()
	tok := g.m.tokenLocked(s)
	if strings.Contains(body, "%[") {
		body = fmt.Sprintf(body, s.WakeID, s.Generation)
	}
	g.m.mu.Unlock()
	method := http.MethodPost
	if strings.HasPrefix(op, "streams/") {
		method = http.MethodDelete
	}
	req := httptest.NewRequest(method, dueRoot+"__ds/subscriptions/"+s.ID+"/"+op, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+tok)
	rec := httptest.NewRecorder()
	switch {
	case op == "claim":
		g.m.handleClaim(rec, req, dueRoot, s.ID)
	case op == "ack", op == "callback":
		g.m.handleAck(rec, req, dueRoot, s.ID, op == "callback")
	case op == "release":
		g.m.handleRelease(rec, req, dueRoot, s.ID)
	case op == "streams":
		g.m.handleAddStreams(rec, req, dueRoot, s.ID)
	case strings.HasPrefix(op, "streams/"):
		g.m.handleRemoveStream(rec, req, dueRoot, s.ID, strings.TrimPrefix(op, "streams/"))
	default:
		t.Fatalf("no such operation %q", op)
	}
	g.m.mu.Lock()
	checkDueLocked(t, g.m)
	g.m.mu.Unlock()
	return rec.Code, rec.Body.String()
}

// refusedView is what a request can change of s, as text: its document,
// the names the manager's index finds it under, and its time in the due
// heap (checkDueLocked, run after every request, checks that the heap
// agrees with the document).
func refusedView(t *testing.T, g *dueRig, s *subState) string {
	t.Helper()
	g.m.mu.Lock()
	defer g.m.mu.Unlock()
	doc, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for name, set := range g.m.index.explicit {
		if _, ok := set[s]; ok {
			names = append(names, "explicit:"+name)
		}
	}
	for prefix, set := range g.m.index.prefix {
		if _, ok := set[s]; ok {
			names = append(names, "prefix:"+prefix)
		}
	}
	sort.Strings(names)
	return fmt.Sprintf("%s index %v due %v at %d", doc, names, s.dueIdx > 0, s.dueAt)
}
