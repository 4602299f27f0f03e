package streamstore

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// packPuts calls before at each PUT of a pack, before it is made.
type packPuts struct {
	segment.Store
	mu     sync.Mutex
	before func()
}

func (p *packPuts) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	if strings.HasPrefix(key, segment.PackPrefix()) {
		p.mu.Lock()
		f := p.before
		p.mu.Unlock()
		if f != nil {
			f()
		}
	}
	return p.Store.Put(ctx, key, data, opts)
}

// A compaction holds a stream's gathered records only until its pack is
// written, not until its last pack is: what it holds shrinks with every
// pack PUT. Kept to the end, a compaction of 10,000 slow streams held
// every record it had read back for repacks at once (84 MiB of pack
// ranges in row 2-many, against packReadBatch per group).
func TestPackReleasesRecordsOnceWritten(t *testing.T) {
	ctx := context.Background()
	st := &packPuts{Store: memstore.New()}
	e := startEngine(t, st, Config{})
	setPackBelow(e, 4<<20)
	const streams, appends, size = 12, 5, 200 << 10 // under the blob size
	var names []string
	for i := range streams {
		name := fmt.Sprintf("/held/%02d", i)
		names = append(names, name)
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
		for range appends {
			mustAppend(t, e, name, AppendRequest{Records: []NewRecord{{Body: bytes.Repeat([]byte{'x'}, size)}}})
		}
	}
	// The compaction loop waits: this is the compaction.
	e.compactMu.Lock()
	defer e.compactMu.Unlock()
	e.mu.RLock()
	end := e.commitEnd
	e.mu.RUnlock()
	var jobs []*packJob
	for _, name := range names {
		e.mu.RLock()
		s := e.streams[name]
		e.mu.RUnlock()
		j := &packJob{}
		if d := decide(s, end, time.Now(), 0, 4<<20, j); d != decidePack {
			t.Fatalf("%s: decision %d, want it packed", name, d)
		}
		jobs = append(jobs, j)
	}
	held := func() (n int) {
		for _, j := range jobs {
			if j.ent != nil {
				for _, r := range j.ent.Records {
					n += len(r.Body)
				}
			}
		}
		return n
	}
	var at []int
	st.mu.Lock()
	st.before = func() { at = append(at, held()) }
	st.mu.Unlock()
	if err := e.pack(ctx, jobs, end, &readBack{recs: map[string][]Record{}}); err != nil {
		t.Fatal(err)
	}
	st.mu.Lock()
	st.before = nil
	st.mu.Unlock()
	if len(at) < 3 {
		t.Fatalf("%d pack PUTs; the test needs several", len(at))
	}
	for i := 1; i < len(at); i++ {
		if at[i] >= at[i-1] {
			t.Errorf("records held at each pack PUT: %v bytes; want fewer at each, as what the earlier packs hold is let go", at)
			break
		}
	}
	if n := held(); n != 0 {
		t.Errorf("%d bytes of records still held once every pack is written", n)
	}
	for _, name := range names {
		if got := readAll(t, e, name); len(got) != appends {
			t.Fatalf("%s reads back %d records, want %d", name, len(got), appends)
		}
	}
}

// A range read back from a pack that holds nothing but the runs wanted is
// not copied: its records stay in the buffer the GET returned, and the
// read allocates the range once rather than twice. (A range with other
// streams' entries between the runs is copied, so as not to keep them:
// TestPackedRecordsDoNotHoldTheRange.)
func TestPackedRangeOfOnlyTheRunsIsNotCopied(t *testing.T) {
	ctx := context.Background()
	const size = 100 << 10
	e, ranges, all := threeStreamsInOnePack(t, size)
	ranges.got = nil
	got, err := e.readPacked(ctx, all)
	if err != nil {
		t.Fatal(err)
	}
	if len(ranges.got) != 1 {
		t.Fatalf("the fold read %d ranges; the test needs one", len(ranges.got))
	}
	var n int
	for _, recs := range got {
		for _, r := range recs {
			n++
			if len(r.Body) != size {
				t.Fatalf("a record of %d bytes; want %d", len(r.Body), size)
			}
			if !overlaps(r.Body, ranges.got[0]) {
				t.Errorf("a record of %s was copied out of a range that holds nothing else (%d bytes)", r.Body[:1], len(ranges.got[0]))
			}
		}
	}
	if n != len(all) {
		t.Fatalf("read back %d records; want %d", n, len(all))
	}
}
