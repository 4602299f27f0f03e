package streamstore

import (
	"encoding/json"
	"maps"
	"sync"

	"github.com/picomq/caddy-picomq/segment"
)

// producerSet is a stream's idempotent producers' progress, by producer id.
// It is a value: a copy of a writerState can be kept (the durable state, a
// checkpoint) while another copy moves on, and no copy ever sees another's
// changes. A stream keeps every producer it has seen for as long as it
// exists (the protocol's producer state cleanup), and a public stream can
// have thousands, so a change must not copy them all, as copy on write of
// one map did on every producer append (and on every entry a replay
// applied).
//
// So a set is an immutable base map, shared by every copy, and a log of the
// changes since it, shared too: a copy sees the log's first n entries. A
// copy at the log's end appends to it in place, which no other copy sees,
// as each stops at its own n. A copy behind the end that makes the change
// the log already holds next (the durable state following the pending one,
// a compaction applying the runs the durable state applied) moves its n
// on, sharing the entries. Only a copy whose change differs from the one
// the log holds at its n (the pending state after an aborted batch) copies
// the log, up to its n, before appending. Once a copy's log passes a
// fraction of the base, that copy merges it into a new base of its own.
// Each change then costs O(1) amortized: a merge, O(base + log), comes
// after at least base/producerMergeFraction changes.
//
// The zero value is an empty set. It encodes in JSON as the map of producer
// id to segment.ProducerState that earlier versions wrote, and decodes
// from it.
type producerSet struct {
	base map[string]segment.ProducerState // never changed once set
	log  *producerLog                     // changes over base; nil if none yet
	n    int                              // this copy sees log.entries[:n]
}

// producerLog is the changes to a base that copies of a producerSet share.
// Its entries below any copy's n never change. Copies in different
// goroutines share it (a compaction folds a copy of the checkpointed state
// while appends change the stream's), so it has a lock of its own.
type producerLog struct {
	mu      sync.Mutex
	entries []producerChange
	// last is the index in entries of the latest change of each producer:
	// a copy at n walks back from it along prev to the first below n.
	last map[string]int
}

// producerChange is one producer's new state, and the index of the change
// of the same producer before it in the log (-1 if none).
type producerChange struct {
	state segment.ProducerState
	prev  int
}

// producerMergeFraction: a copy merges its log into a new base once the log
// is longer than the base divided by it (and than producerMergeMin).
// Larger merges less often but keeps more entries.
const producerMergeFraction = 4

// producerMergeMin is the log length below which a copy never merges, so a
// stream with few producers does not rebuild its base every few appends.
const producerMergeMin = 64

// get returns the state of producer id, and whether the set has it.
func (s *producerSet) get(id string) (segment.ProducerState, bool) {
	if l := s.log; l != nil {
		l.mu.Lock()
		i, ok := l.last[id]
		for ok && i >= s.n {
			i = l.entries[i].prev
			ok = i >= 0
		}
		var p segment.ProducerState
		if ok {
			p = l.entries[i].state
		}
		l.mu.Unlock()
		if ok {
			return p, true
		}
	}
	p, ok := s.base[id]
	return p, ok
}

// set records p as its producer's state, in this copy only.
func (s *producerSet) set(p segment.ProducerState) {
	if s.log == nil {
		s.log = &producerLog{last: map[string]int{}}
		s.n = 0
	}
	s.record(p)
	// Whichever way it went: a copy that only follows another (the durable
	// state following the pending one) merges as well, or the copies
	// made of it later would all find the log long and merge it again.
	if s.n > max(producerMergeMin, len(s.base)/producerMergeFraction) {
		s.merge()
	}
}

// record adds p to the changes this copy sees.
func (s *producerSet) record(p segment.ProducerState) {
	l := s.log
	l.mu.Lock()
	if s.n == len(l.entries) {
		l.add(p)
		s.n = len(l.entries)
		l.mu.Unlock()
		return
	}
	// Behind the end: a copy that ran ahead put changes after ours. Where
	// the next ones are of p's producer and lead to p, this copy's state
	// after them is the one it would have after p alone (a producer's
	// later change replaces its earlier ones): share them. Changes of one
	// producer run like this where the appends the pending state applied
	// one by one were folded into one WAL entry, which the durable state
	// applies once.
	for k := s.n; k < len(l.entries) && l.entries[k].state.ID == p.ID; k++ {
		if l.entries[k].state == p {
			s.n = k + 1
			l.mu.Unlock()
			return
		}
	}
	// Another change there: this copy goes its own way, on a log of its
	// own, which no other copy holds until this one is copied.
	fork := newProducerLog(l.entries[:s.n])
	l.mu.Unlock()
	fork.add(p)
	s.log, s.n = fork, len(fork.entries)
}

// add appends p to the log. The caller holds l.mu, or l is its own.
func (l *producerLog) add(p segment.ProducerState) {
	prev, ok := l.last[p.ID]
	if !ok {
		prev = -1
	}
	l.entries = append(l.entries, producerChange{state: p, prev: prev})
	l.last[p.ID] = len(l.entries) - 1
}

// newProducerLog returns a log holding a copy of entries, which must be a
// whole log's first entries (their prev links stay valid).
func newProducerLog(entries []producerChange) *producerLog {
	l := &producerLog{entries: make([]producerChange, len(entries), len(entries)+1), last: make(map[string]int, len(entries))}
	copy(l.entries, entries)
	for i, c := range l.entries {
		l.last[c.state.ID] = i
	}
	return l
}

// merge folds the changes this copy sees into a new base of its own.
func (s *producerSet) merge() {
	s.base = s.snapshot()
	s.log, s.n = nil, 0
}

// snapshot returns the set as a new map, which the caller may keep.
func (s *producerSet) snapshot() map[string]segment.ProducerState {
	l := s.log
	if l == nil {
		return maps.Clone(s.base)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	m := make(map[string]segment.ProducerState, len(s.base)+len(l.last))
	maps.Copy(m, s.base)
	for _, c := range l.entries[:s.n] {
		m[c.state.ID] = c.state
	}
	return m
}

// exceeds reports whether the set has more than k producers: those of
// its base, and those new in the changes it sees (not in the changes of
// copies ahead of it, such as appends a failed batch rolled back).
func (s *producerSet) exceeds(k int) bool {
	n := len(s.base)
	l := s.log
	if n > k || l == nil {
		return n > k
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for id, i := range l.last {
		if _, ok := s.base[id]; ok {
			continue
		}
		for i >= s.n {
			i = l.entries[i].prev
			if i < 0 {
				break
			}
		}
		if i >= 0 {
			if n++; n > k {
				return true
			}
		}
	}
	return false
}

// IsZero reports whether the set has no producer, for omitzero: a set
// never loses one, so one with any base entry or any change has some.
func (s producerSet) IsZero() bool {
	return len(s.base) == 0 && s.n == 0
}

// MarshalJSON encodes the set as the map earlier versions wrote.
func (s producerSet) MarshalJSON() ([]byte, error) {
	if s.log == nil {
		return json.Marshal(s.base) // never changed: no copy needed
	}
	return json.Marshal(s.snapshot())
}

// UnmarshalJSON decodes the map MarshalJSON and earlier versions write.
func (s *producerSet) UnmarshalJSON(data []byte) error {
	var m map[string]segment.ProducerState
	if err := json.Unmarshal(data, &m); err != nil {
		return err
	}
	*s = producerSet{base: m}
	return nil
}
