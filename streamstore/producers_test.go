package streamstore

import (
	"encoding/json"
	"fmt"
	"maps"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/picomq/caddy-picomq/segment"
)

// psStep is one step of a producerSet script: a change to a named copy
// (set), a copy made (copy: to = from), or a check of how the copies are
// held (sameLog, merged), besides the check of every copy after each step.
type psStep struct {
	op       string // "set", "copy", "fill", "sameLog", "ownLog", "merged"
	to, from string
	id       string
	epoch    uint64
	seq      uint64
	n        int // fill: how many new producers; merged: the least base
}

func psSet(to, id string, epoch, seq uint64) psStep {
	return psStep{op: "set", to: to, id: id, epoch: epoch, seq: seq}
}
func psCopy(to, from string) psStep { return psStep{op: "copy", to: to, from: from} }

// psFill gives copy to n new producers, p0000 to p(n-1), each at seq 0.
func psFill(to string, n int) psStep { return psStep{op: "fill", to: to, n: n} }

// psSameLog checks that copies to and from share their log: the one that
// followed the other did not copy it.
func psSameLog(to, from string) psStep { return psStep{op: "sameLog", to: to, from: from} }

// psOwnLog checks that copy to no longer shares from's log.
func psOwnLog(to, from string) psStep { return psStep{op: "ownLog", to: to, from: from} }

// psMerged checks that copy to has folded changes into its base, which
// holds n producers or more.
func psMerged(to string, n int) psStep { return psStep{op: "merged", to: to, n: n} }

// psRun plays steps on copies of a producerSet and, after each step,
// checks every copy against a plain map that is copied whole on every copy
// step: what each copy holds must be exactly what it was given, whatever
// the other copies did since.
func psRun(t *testing.T, steps []psStep) {
	t.Helper()
	sets := map[string]producerSet{}
	models := map[string]map[string]segment.ProducerState{}
	ids := map[string]bool{}
	for i, st := range steps {
		switch st.op {
		case "set":
			p := segment.ProducerState{ID: st.id, Epoch: st.epoch, Seq: st.seq}
			s := sets[st.to]
			s.set(p)
			sets[st.to] = s
			if models[st.to] == nil {
				models[st.to] = map[string]segment.ProducerState{}
			}
			models[st.to][st.id] = p
			ids[st.id] = true
		case "fill":
			s := sets[st.to]
			if models[st.to] == nil {
				models[st.to] = map[string]segment.ProducerState{}
			}
			for k := range st.n {
				p := segment.ProducerState{ID: fmt.Sprintf("p%04d", k)}
				s.set(p)
				models[st.to][p.ID] = p
				ids[p.ID] = true
			}
			sets[st.to] = s
		case "copy":
			sets[st.to] = sets[st.from]
			models[st.to] = maps.Clone(models[st.from])
		case "sameLog", "ownLog":
			a, b := sets[st.to], sets[st.from]
			if same := a.log != nil && a.log == b.log; same != (st.op == "sameLog") {
				t.Fatalf("step %d: %s and %s share a log: %v, want %v", i, st.to, st.from, same, st.op == "sameLog")
			}
		case "merged":
			if s := sets[st.to]; len(s.base) < st.n {
				t.Fatalf("step %d: %s has %d changes over a base of %d, want a base of %d or more", i, st.to, s.n, len(s.base), st.n)
			}
		default:
			t.Fatalf("step %d: unknown op %q", i, st.op)
		}
		psCheck(t, fmt.Sprintf("step %d (%s %s)", i, st.op, st.to), sets, models, ids)
	}
}

// psCheck compares every copy with its model, by lookups of every id ever
// used and by its whole contents.
func psCheck(t *testing.T, at string, sets map[string]producerSet, models map[string]map[string]segment.ProducerState, ids map[string]bool) {
	t.Helper()
	for name, s := range sets {
		want := models[name]
		for id := range ids {
			got, ok := s.get(id)
			w, wok := want[id]
			if ok != wok || got != w {
				t.Fatalf("%s: copy %s has %s = %+v (%v), want %+v (%v)", at, name, id, got, ok, w, wok)
			}
		}
		if snap := s.snapshot(); !maps.Equal(snap, want) {
			t.Fatalf("%s: copy %s holds %d producers, want %d: %v", at, name, len(snap), len(want), snap)
		}
		if s.IsZero() != (len(want) == 0) {
			t.Fatalf("%s: copy %s IsZero %v with %d producers", at, name, s.IsZero(), len(want))
		}
	}
}

// TestProducerSetCopies plays the ways the engine copies a writer state
// (the pending state ahead of the durable one, reset to it on an abort, a
// compaction's copy of a checkpoint) and checks that every copy sees
// exactly its own changes, the newest of each producer, and that copies
// following one another share their changes instead of copying them.
func TestProducerSetCopies(t *testing.T) {
	mergeAt := producerMergeMin + 1
	tests := []struct {
		name  string
		steps []psStep
	}{
		{"lookups see the newest change", []psStep{
			psSet("d", "a", 0, 0), psSet("d", "a", 0, 1), psSet("d", "b", 0, 0),
			psSet("d", "a", 1, 0), psSet("d", "b", 0, 1),
		}},
		{"the empty set", []psStep{
			psCopy("e", "d"), psSet("d", "a", 0, 0),
		}},
		{"a kept durable copy never sees the pending one's changes", []psStep{
			psSet("d", "a", 0, 0), psCopy("p", "d"),
			psSet("p", "a", 0, 1), psSet("p", "b", 0, 0), psSet("p", "a", 0, 2),
		}},
		{"the durable copy follows the pending one by sharing its changes", []psStep{
			psSet("d", "a", 0, 0), psCopy("p", "d"),
			psSet("p", "a", 0, 1), psSet("p", "b", 0, 0), psSet("p", "c", 3, 0),
			psSet("d", "a", 0, 1), psSameLog("d", "p"),
			psSet("d", "b", 0, 0), psSet("d", "c", 3, 0), psSameLog("d", "p"),
			// Caught up: the pending copy moves on, the durable one again
			// sees none of it.
			psSet("p", "c", 3, 1),
		}},
		{"a folded entry: the durable copy takes a producer's last change only", []psStep{
			psSet("d", "b", 0, 0), psCopy("p", "d"),
			psSet("p", "a", 0, 0), psSet("p", "a", 0, 1), psSet("p", "a", 0, 2), psSet("p", "b", 0, 1),
			psSet("d", "a", 0, 2), psSameLog("d", "p"),
			psSet("d", "b", 0, 1), psSameLog("d", "p"),
		}},
		{"a change the log does not hold next: the copy goes its own way", []psStep{
			psSet("d", "a", 0, 0), psCopy("p", "d"),
			psSet("p", "a", 0, 1), psSet("p", "b", 0, 0),
			// Not a's change first: the scan stops at another producer.
			psSet("d", "b", 0, 0), psOwnLog("d", "p"),
			psSet("d", "a", 0, 1), psSet("p", "c", 0, 0), psSet("d", "c", 0, 7),
		}},
		{"an aborted batch: the pending copy is reset and diverges", []psStep{
			psSet("d", "a", 0, 0), psCopy("p", "d"),
			psSet("p", "a", 0, 1), psSet("p", "b", 0, 0), psCopy("aborted", "p"),
			psCopy("p", "d"), psSet("p", "c", 0, 0), psOwnLog("p", "aborted"),
			psSet("p", "a", 0, 1), psSet("aborted", "a", 0, 2),
		}},
		{"an aborted batch retried as it was: the copies share it again", []psStep{
			psSet("d", "a", 0, 0), psCopy("p", "d"),
			psSet("p", "a", 0, 1), psCopy("aborted", "p"),
			psCopy("p", "d"), psSet("p", "a", 0, 1), psSameLog("p", "aborted"),
		}},
		{"two copies at one point make different changes", []psStep{
			psSet("d", "a", 0, 0), psCopy("x", "d"), psCopy("y", "d"),
			psSet("x", "a", 0, 5), psSet("y", "a", 0, 6), psSet("y", "b", 0, 0), psSet("x", "b", 1, 0),
		}},
		{"a merge keeps every producer and the newest of each", []psStep{
			psFill("d", 300), psSet("d", "p0007", 0, 1), psSet("d", "p0007", 2, 0),
			psCopy("kept", "d"),
			psFill("d", 20), psSet("d", "late", 0, 0), psSet("d", "p0299", 0, 1),
		}},
		{"a copy that merges leaves the kept copies as they were", []psStep{
			psFill("d", mergeAt-1), psCopy("kept", "d"),
			psSet("d", "x", 0, 0), psMerged("d", mergeAt),
			psSet("kept", "y", 0, 0), psSet("d", "x", 0, 1),
		}},
		{"a copy following another merges at the same length", []psStep{
			psSet("d", "a", 0, 0), psCopy("p", "d"),
			psFill("p", mergeAt), psMerged("p", mergeAt),
			psFill("d", mergeAt), psMerged("d", mergeAt),
			psCopy("p", "d"), psSet("p", "a", 0, 1),
		}},
		{"a merge past a fraction of a large base", []psStep{
			psFill("d", 1000), psMerged("d", 1000-1000/producerMergeFraction), psCopy("kept", "d"),
			psSet("d", "p0001", 0, 1),
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) { psRun(t, tt.steps) })
	}
}

// TestProducerSetRandomCopies plays random changes and copies among a few
// copies, with few producer ids so that the paths that share, copy and
// merge logs all come up, and checks every copy after every step.
func TestProducerSetRandomCopies(t *testing.T) {
	for seed := range uint64(20) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			r := rand.New(rand.NewPCG(seed, 1))
			names := []string{"d", "p", "c", "k"}
			var steps []psStep
			for range 600 {
				to := names[r.IntN(len(names))]
				switch r.IntN(10) {
				case 0:
					steps = append(steps, psCopy(to, names[r.IntN(len(names))]))
				default:
					steps = append(steps, psSet(to, fmt.Sprintf("id%d", r.IntN(12)), uint64(r.IntN(2)), uint64(r.IntN(4))))
				}
			}
			psRun(t, steps)
		})
	}
}

// TestProducerSetCopiesAcrossGoroutines changes copies that share a log
// from several goroutines at once, as a compaction's copy of a checkpoint
// is changed while appends change the stream's state: each must end with
// its own changes only (run with -race for the sharing).
func TestProducerSetCopiesAcrossGoroutines(t *testing.T) {
	var base producerSet
	for i := range 10 {
		base.set(segment.ProducerState{ID: fmt.Sprintf("p%d", i)})
	}
	const copies, changes = 4, 500
	got := make([]producerSet, copies)
	var wg sync.WaitGroup
	for c := range copies {
		wg.Go(func() {
			s := base
			for i := range changes {
				// The same changes in every copy for a while (shared), then
				// each its own (a copy of the log).
				id := fmt.Sprintf("p%d", i%10)
				if i >= changes/2 {
					id = fmt.Sprintf("c%d-%d", c, i%7)
				}
				s.set(segment.ProducerState{ID: id, Seq: uint64(i)})
				if p, ok := s.get(id); !ok || p.Seq != uint64(i) {
					t.Errorf("copy %d: %s = %+v, %v after setting seq %d", c, id, p, ok, i)
					return
				}
			}
			got[c] = s
		})
	}
	wg.Wait()
	for c, s := range got {
		snap := s.snapshot()
		if want := 10 + 7; len(snap) != want {
			t.Errorf("copy %d holds %d producers, want %d", c, len(snap), want)
		}
		for id, p := range snap {
			if id[0] == 'c' && id[1] != byte('0'+c) {
				t.Errorf("copy %d holds %s = %+v, another copy's", c, id, p)
			}
		}
	}
	if snap := base.snapshot(); len(snap) != 10 {
		t.Errorf("the copied set holds %d producers after its copies changed, want 10", len(snap))
	}
}

// oldWriterState is the writer state as earlier versions declare it: the
// format both versions must read.
type oldWriterState struct {
	NextSeq    uint64                           `json:"next_seq"`
	StartSeq   uint64                           `json:"start_seq,omitempty"`
	LastTS     int64                            `json:"last_ts,omitempty"`
	Closed     bool                             `json:"closed,omitempty"`
	ClosedBy   *segment.ProducerState           `json:"closed_by,omitempty"`
	StreamSeq  string                           `json:"stream_seq,omitempty"`
	AccessedAt int64                            `json:"accessed_at,omitempty"`
	Producers  map[string]segment.ProducerState `json:"producers,omitempty"`
}

// TestMetaProducersFormat loads metadata objects written by the previous
// version (copy-on-write map of producers), writes them back byte for
// byte, and writes states built by changes and merges in the form the
// previous version reads.
func TestMetaProducersFormat(t *testing.T) {
	tests := []struct {
		name string
		old  string // as the previous version wrote it
		want map[string]segment.ProducerState
	}{
		{"producers",
			`{"v":1,"name":"/old/producers","id":"0123abcd","content_type":"text/plain","created_at_ms":1764892800000,"upto":{"ns":3,"seq":17},` +
				`"state":{"next_seq":4,"last_ts":1764892800003,"stream_seq":"s1","producers":{"device-a":{"ID":"device-a","Epoch":2,"Seq":5},` +
				`"device-b":{"ID":"device-b","Epoch":0,"Seq":0}}}}`,
			map[string]segment.ProducerState{"device-a": {ID: "device-a", Epoch: 2, Seq: 5}, "device-b": {ID: "device-b"}}},
		{"no producers",
			`{"v":1,"name":"/old/none","id":"4567","content_type":"text/plain","created_at_ms":1,"upto":{"ns":0,"seq":0},"state":{"next_seq":1,"last_ts":2}}`,
			nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := decodeMeta([]byte(tt.old))
			if err != nil {
				t.Fatalf("decode: %v", err)
			}
			for id, w := range tt.want {
				if p, ok := m.State.Producers.get(id); !ok || p != w {
					t.Errorf("producer %s: %+v, %v; want %+v", id, p, ok, w)
				}
			}
			if _, ok := m.State.Producers.get("device-z"); ok {
				t.Errorf("producer device-z found in %s", tt.old)
			}
			if got := encodeMeta(m); string(got) != tt.old {
				t.Errorf("written back:\n%s\nwant as it was:\n%s", got, tt.old)
			}
			// Changed and copied past a merge, it is still what the
			// previous version reads.
			want := maps.Clone(tt.want)
			if want == nil {
				want = map[string]segment.ProducerState{}
			}
			kept := m.State
			for i := range producerMergeMin * 2 {
				p := segment.ProducerState{ID: fmt.Sprintf("new-%03d", i%(producerMergeMin+7)), Seq: uint64(i)}
				m.State.apply(change{First: m.State.NextSeq, End: m.State.NextSeq + 1, Producer: &p})
				want[p.ID] = p
			}
			var old struct {
				State oldWriterState `json:"state"`
			}
			if err := json.Unmarshal(encodeMeta(m), &old); err != nil {
				t.Fatalf("the previous version's decode: %v", err)
			}
			if !maps.Equal(old.State.Producers, want) {
				t.Errorf("the previous version reads %d producers, want %d: %v", len(old.State.Producers), len(want), old.State.Producers)
			}
			if got := encodeMeta(&metaObject{Version: 1, Name: m.Name, ID: m.ID, ContentType: m.ContentType, CreatedAt: m.CreatedAt,
				Upto: m.Upto, State: kept}); string(got) != tt.old {
				t.Errorf("a copy kept before the changes writes:\n%s\nwant:\n%s", got, tt.old)
			}
		})
	}
}

// exceeds counts the producers a copy sees: its base and the new ones in
// its changes, not those of a copy ahead of it on the same log (the
// pending state that a failed batch rolled back), nor twice a producer of
// the base that a change moved on.
func TestProducerSetExceeds(t *testing.T) {
	state := func(id string, seq uint64) segment.ProducerState {
		return segment.ProducerState{ID: id, Seq: seq}
	}
	var durable producerSet
	durable.set(state("a", 0))
	durable.set(state("b", 0))
	durable.merge() // a and b in the base
	durable.set(state("a", 1))
	ahead := durable // shares the log, then runs ahead on it
	for _, id := range []string{"c", "d", "e"} {
		ahead.set(state(id, 0))
	}
	for _, tc := range []struct {
		name string
		set  *producerSet
		k    int
		want bool
	}{
		{"durable, 2 producers, more than 1", &durable, 1, true},
		{"durable, 2 producers, more than 2", &durable, 2, false},
		{"ahead, 5 producers, more than 4", &ahead, 4, true},
		{"ahead, 5 producers, more than 5", &ahead, 5, false},
	} {
		if got := tc.set.exceeds(tc.k); got != tc.want {
			t.Errorf("%s: exceeds(%d) = %v, want %v", tc.name, tc.k, got, tc.want)
		}
	}
}
