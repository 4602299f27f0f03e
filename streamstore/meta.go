package streamstore

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/picomq/caddy-picomq/segment"
)

// walPos is a position in the WAL across namespaces; it orders entries.
type walPos struct {
	NS  uint64 `json:"ns"`
	Seq uint64 `json:"seq"`
}

func (p walPos) after(q walPos) bool {
	return p.NS > q.NS || (p.NS == q.NS && p.Seq > q.Seq)
}

// next is the position just after p.
func (p walPos) next() walPos { return walPos{p.NS, p.Seq + 1} }

// writerState is what appends check and change: the tail, closure, the
// producers' progress and the last Stream-Seq.
type writerState struct {
	NextSeq    uint64                           `json:"next_seq"`
	StartSeq   uint64                           `json:"start_seq,omitempty"`
	LastTS     int64                            `json:"last_ts,omitempty"`
	Closed     bool                             `json:"closed,omitempty"`
	ClosedBy   *segment.ProducerState           `json:"closed_by,omitempty"`
	StreamSeq  string                           `json:"stream_seq,omitempty"`
	AccessedAt int64                            `json:"accessed_at,omitempty"`
	Producers  map[string]segment.ProducerState `json:"producers,omitempty"`
}

// change is what one WAL entry does to a stream's writer state; it is kept
// for committed entries until they are checkpointed, without their records.
type change struct {
	First, End uint64 // the seqs of the entry's records: [First, End)
	LastTS     int64
	Closed     bool
	Producer   *segment.ProducerState
	StreamSeq  string
	AccessedAt int64
	TrimTo     uint64
}

func changeOf(e *segment.Entry) change {
	c := change{
		First:      e.FirstSeq,
		End:        e.EndSeq(),
		Closed:     e.Closed,
		Producer:   e.Producer,
		StreamSeq:  e.StreamSeq,
		AccessedAt: e.AccessedAt,
		TrimTo:     e.TrimTo,
	}
	if n := len(e.Records); n > 0 {
		c.LastTS = e.Records[n-1].Timestamp
	}
	return c
}

// apply folds one change into the state. Producers is copied on write, so a
// state copy can be kept as the durable one while another is changed.
func (w *writerState) apply(c change) {
	w.NextSeq = c.End
	w.LastTS = max(w.LastTS, c.LastTS)
	if c.Closed && !w.Closed {
		w.Closed = true
		w.ClosedBy = c.Producer
	}
	if c.Producer != nil {
		m := make(map[string]segment.ProducerState, len(w.Producers)+1)
		for k, v := range w.Producers {
			m[k] = v
		}
		m[c.Producer.ID] = *c.Producer
		w.Producers = m
	}
	if c.StreamSeq != "" {
		w.StreamSeq = c.StreamSeq
	}
	w.AccessedAt = max(w.AccessedAt, c.AccessedAt)
	w.StartSeq = max(w.StartSeq, min(c.TrimTo, w.NextSeq))
}

// metaObject is a stream's metadata object: its fixed configuration, and a
// checkpoint of its writer state: entries before WAL position Upto are
// folded in; replay applies only the others.
type metaObject struct {
	Version     int    `json:"v"`
	Name        string `json:"name"`
	ID          string `json:"id"`
	ContentType string `json:"content_type"`
	TTLSeconds  int64  `json:"ttl_s,omitempty"`
	ExpiresAt   int64  `json:"expires_at_ms,omitempty"`
	CreatedAt   int64  `json:"created_at_ms"`
	Upto        walPos `json:"upto"`
	// Cleaned: data objects holding only seqs below it are deleted.
	Cleaned uint64 `json:"cleaned,omitempty"`
	// Fork, on a fork, references the source's data: by internal id (the
	// name only locates its state), never by object keys, so the source's
	// compaction stays free.
	Fork *forkRef `json:"fork,omitempty"`
	// Forks counts the live forks that reference this stream's data.
	Forks int `json:"forks,omitempty"`
	// Deleted marks a soft-deleted stream: gone for clients, kept for its
	// forks until the last one goes.
	Deleted bool        `json:"deleted,omitempty"`
	State   writerState `json:"state"`
}

// forkRef is a fork's inherited range: the source's records below Seq, and
// Bytes bytes of record Seq when Bytes > 0 (the fork's own records then
// start at Seq+1).
type forkRef struct {
	SourceName string `json:"source_name"`
	SourceID   string `json:"source_id"`
	Seq        uint64 `json:"seq"`
	Bytes      uint64 `json:"bytes,omitempty"`
}

// base is the first seq of the fork's own records.
func (f *forkRef) base() uint64 {
	if f.Bytes > 0 {
		return f.Seq + 1
	}
	return f.Seq
}

func (m *metaObject) expiry() Expiry {
	x := Expiry{TTL: time.Duration(m.TTLSeconds) * time.Second}
	if m.ExpiresAt != 0 {
		x.ExpiresAt = time.UnixMilli(m.ExpiresAt).UTC()
	}
	return x
}

func encodeMeta(m *metaObject) []byte {
	b, err := json.Marshal(m)
	if err != nil {
		panic(fmt.Sprintf("encode metadata: %v", err)) // only plain types: cannot fail
	}
	return b
}

func decodeMeta(data []byte) (*metaObject, error) {
	var m metaObject
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("%w: metadata: %v", segment.ErrCorrupt, err)
	}
	if m.Version != 1 {
		return nil, fmt.Errorf("%w: metadata version %d", segment.ErrCorrupt, m.Version)
	}
	return &m, nil
}
