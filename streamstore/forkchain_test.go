package streamstore

import (
	"context"
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
