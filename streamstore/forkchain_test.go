package streamstore

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

// TestForkChainReadCopiesOnce: a read of a fork at the end of a chain of
// forks allocates about what a read of its records from the first source
// does, whatever the chain's length. Each level used to gather its
// source's records and copy them into a slice of its own, so a read 100
// forks deep allocated a hundred times as much (2 GiB for 65,536 records)
// and took seconds; 100 creates were enough to make every such read cost
// that.
func TestForkChainReadCopiesOnce(t *testing.T) {
	e := startEngine(t, memstore.New(), Config{})
	ctx := context.Background()
	const records, depth = 20_000, 100
	in := make([]NewRecord, records)
	for i := range in {
		in[i] = NewRecord{Body: []byte{byte('a' + i%26)}}
	}
	if _, _, err := e.Create(ctx, "/chain/0", CreateRequest{ContentType: "application/octet-stream", Records: in}); err != nil {
		t.Fatal(err)
	}
	for d := 1; d <= depth; d++ {
		// Each fork adds a record of its own, at its point, for the next
		// to inherit; the last record of every other is cut in two.
		from := ForkFrom{Source: fmt.Sprintf("/chain/%d", d-1), Seq: uint64(records + d - 1)}
		if d%2 == 0 {
			from.Seq, from.Bytes = uint64(records+d-2), 1
		}
		name := fmt.Sprintf("/chain/%d", d)
		if _, _, err := e.Create(ctx, name, CreateRequest{Fork: &from}); err != nil {
			t.Fatalf("fork %d: %v", d, err)
		}
		if _, err := e.Append(ctx, name, AppendRequest{Records: []NewRecord{{Body: []byte(fmt.Sprintf("<%d>", d))}}}); err != nil {
			t.Fatalf("append to fork %d: %v", d, err)
		}
	}
	read := func(name string) ([]Record, uint64) {
		t.Helper()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		res, err := e.Read(ctx, name, ReadRequest{Seq: 0, MaxRecords: 1 << 20})
		runtime.ReadMemStats(&after)
		if err != nil {
			t.Fatalf("read %s: %v", name, err)
		}
		defer res.Release()
		return res.Records, after.TotalAlloc - before.TotalAlloc
	}
	read("/chain/0") // warm: every stream's records in the cache
	read(fmt.Sprintf("/chain/%d", depth))
	_, first := read("/chain/0")
	recs, deep := read(fmt.Sprintf("/chain/%d", depth))
	t.Logf("a read of %d records allocated %d KiB from the first source, %d KiB %d forks down", len(recs), first>>10, deep>>10, depth)
	if deep > 2*first+(1<<20) {
		t.Errorf("a read %d forks down allocated %d KiB, against %d KiB for the first source's records", depth, deep>>10, first>>10)
	}
	// The records are the chain's: the first source's, then one of each
	// fork's, those of every even fork cut to their first byte.
	if len(recs) != records+depth {
		t.Fatalf("%d records %d forks down, want %d", len(recs), depth, records+depth)
	}
	for i, r := range recs {
		want := string([]byte{byte('a' + i%26)})
		if i >= records {
			d := i - records + 1
			want = fmt.Sprintf("<%d>", d)
			if d%2 == 1 && d < depth {
				want = want[:1]
			}
		}
		if r.Seq != uint64(i) || string(r.Body) != want {
			t.Fatalf("record %d: seq %d, body %q, want %q", i, r.Seq, r.Body, want)
		}
	}
}

// TestForkDepthIsBounded: a fork may be at most MaxForkDepth forks deep. A
// create past it is a bad request that writes nothing (no fork, no count
// on its source), while a fork higher up the chain is still made, and a
// read of the deepest fork gets every record up the chain. Unbounded, a
// client could build a chain one create at a time whose every read
// loaded millions of streams.
func TestForkDepthIsBounded(t *testing.T) {
	st := memstore.New()
	e := startEngine(t, st, Config{})
	ctx := context.Background()
	if _, _, err := e.Create(ctx, "/d/0", CreateRequest{ContentType: "text/plain", Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	name := func(d int) string { return fmt.Sprintf("/d/%d", d) }
	for d := 1; d <= MaxForkDepth; d++ {
		if _, _, err := e.Create(ctx, name(d), CreateRequest{Fork: &ForkFrom{Source: name(d - 1), Seq: 1}}); err != nil {
			t.Fatalf("fork %d deep: %v", d, err)
		}
	}
	deepest, err := e.stream(ctx, name(MaxForkDepth))
	if err != nil {
		t.Fatal(err)
	}
	deepest.mu.Lock()
	forks := deepest.meta.Forks
	deepest.mu.Unlock()
	keys := len(st.Keys(""))
	_, _, err = e.Create(ctx, "/d/past", CreateRequest{Fork: &ForkFrom{Source: name(MaxForkDepth), Seq: 1}})
	if !errors.Is(err, ErrBadRequest) {
		t.Fatalf("a fork %d deep: %v, want ErrBadRequest", MaxForkDepth+1, err)
	}
	if n := len(st.Keys("")); n != keys {
		t.Errorf("the refused fork wrote %d objects", n-keys)
	}
	deepest.mu.Lock()
	after := deepest.meta.Forks
	deepest.mu.Unlock()
	if after != forks {
		t.Errorf("the refused fork left its source counting %d forks, want %d", after, forks)
	}
	if _, err := e.Head(ctx, "/d/past"); !errors.Is(err, ErrNotFound) {
		t.Errorf("head of the refused fork: %v, want ErrNotFound", err)
	}
	if _, _, err := e.Create(ctx, "/d/side", CreateRequest{Fork: &ForkFrom{Source: name(MaxForkDepth - 1), Seq: 1}}); err != nil {
		t.Errorf("a fork %d deep: %v", MaxForkDepth, err)
	}
	if got := fmt.Sprint(readAll(t, e, name(MaxForkDepth))); got != "[a]" {
		t.Errorf("the deepest fork reads %s", got)
	}
}

// TestForkDepthOfAnOlderBuildsFork: a fork an older build made, which kept
// no depth, counts as one deep, so forks of it are made, one deeper.
func TestForkDepthOfAnOlderBuildsFork(t *testing.T) {
	e := startEngine(t, memstore.New(), Config{})
	ctx := context.Background()
	if _, _, err := e.Create(ctx, "/o/src", CreateRequest{ContentType: "text/plain", Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"/o/f", "/o/g"} {
		if _, _, err := e.Create(ctx, n, CreateRequest{Fork: &ForkFrom{Source: "/o/src", Seq: 1}}); err != nil {
			t.Fatal(err)
		}
	}
	f, err := e.stream(ctx, "/o/f")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.updateMeta(ctx, f, func(m *metaObject) {
		ref := *m.Fork
		ref.Depth = 0
		m.Fork = &ref
	}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ source, fork string }{{"/o/f", "/o/ff"}, {"/o/g", "/o/gg"}} {
		if _, _, err := e.Create(ctx, tc.fork, CreateRequest{Fork: &ForkFrom{Source: tc.source, Seq: 1}}); err != nil {
			t.Fatal(err)
		}
		s, err := e.stream(ctx, tc.fork)
		if err != nil {
			t.Fatal(err)
		}
		s.mu.Lock()
		depth := s.meta.forkDepth()
		s.mu.Unlock()
		if depth != 2 {
			t.Errorf("%s, a fork of %s, is %d deep, want 2", tc.fork, tc.source, depth)
		}
	}
}
