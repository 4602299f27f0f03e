package streamstore

import (
	"strings"
	"time"

	"github.com/picomq/caddy-picomq/segment"
)

// The append hook is told of appends once they are durable, and what its
// user keeps of them (the subscriptions' documents: a stream a pattern
// finds by its first append) is written after, on its own. A process that
// ends in between has acknowledged an append whose effect on the hook's
// user is lost. The WAL still has the append until compaction retires it,
// so a start keeps what its replay found, for the hook's user to take.

// ReplayedStream is a stream the start's replay found appends of, still
// the stream under its name when the start ended.
type ReplayedStream struct {
	Name, ID string
	// Points are where its replayed appends began, in order: an append's
	// first seq and its records' timestamp (Unix ms). Appends that follow
	// within a second of a point are not points of their own.
	Points []ReplayPoint
	// Next is the seq after its last replayed append.
	Next uint64
}

// ReplayPoint is where one of a stream's replayed appends began.
type ReplayPoint struct {
	Seq  uint64
	Time int64 // Unix ms
}

// replayedPointGap is how far apart in time a stream's replayed appends
// must be to be points of their own: fewer points, and a point earlier
// than needed only offers more.
const replayedPointGap = time.Second

// noteReplayed records that the replay found ent, an entry of the stream
// under its name.
func (e *Engine) noteReplayed(ent *segment.Entry) {
	if len(ent.Records) == 0 {
		return
	}
	if e.replayed == nil {
		e.replayed = map[string]*ReplayedStream{}
	}
	r := e.replayed[ent.Name]
	if r == nil || r.ID != ent.StreamID {
		// Cloned: the entry's strings may alias its WAL object.
		r = &ReplayedStream{Name: strings.Clone(ent.Name), ID: strings.Clone(ent.StreamID)}
		e.replayed[r.Name] = r
	}
	ts := ent.Records[0].Timestamp
	if n := len(r.Points); n == 0 || ts-r.Points[n-1].Time >= replayedPointGap.Milliseconds() {
		r.Points = append(r.Points, ReplayPoint{Seq: ent.FirstSeq, Time: ts})
	}
	r.Next = max(r.Next, ent.EndSeq())
}

// keepReplayed drops, at the end of a replay, the streams that are no
// longer under their name (deleted, or another stream since).
func (e *Engine) keepReplayed() {
	for name, r := range e.replayed {
		s := e.streams[name]
		if s == nil || s.gone || s.meta.Deleted || s.meta.ID != r.ID {
			delete(e.replayed, name)
		}
	}
}

// TakeReplayed returns, once, the streams the start's replay found appends
// of (see ReplayedStream); later calls return nothing.
func (e *Engine) TakeReplayed() []ReplayedStream {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]ReplayedStream, 0, len(e.replayed))
	for _, r := range e.replayed {
		out = append(out, *r)
	}
	e.replayed = nil
	return out
}
