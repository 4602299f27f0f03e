package segment_test

import (
	"bytes"
	"fmt"
	"hash/crc32"
	"testing"

	"github.com/picomq/caddy-picomq/segment"
)

// A pack holds its entries where their spans say and its index where the
// reference says; with an index no longer than the hint, the object is
// laid out in the one buffer EncodePack allocates (a pack is up to 4 MiB,
// and an index appended past its capacity copied all of it).
func TestEncodePack(t *testing.T) {
	var entries []*segment.Entry
	for i := range 50 {
		entries = append(entries, &segment.Entry{
			StreamID: fmt.Sprintf("id-%d", i),
			Name:     fmt.Sprintf("stream-%d", i),
			FirstSeq: uint64(i),
			Records:  []segment.Record{{Body: bytes.Repeat([]byte{byte(i)}, 1024)}},
		})
	}
	for _, tc := range []struct {
		name      string
		index     int // bytes the index func returns
		hint      int
		wantSlack bool // the buffer must not have been regrown
	}{
		{name: "index within the hint", index: 4000, hint: 5000, wantSlack: true},
		{name: "index past the hint", index: 9000, hint: 100},
		{name: "no hint", index: 700, hint: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			idx := bytes.Repeat([]byte("x"), tc.index)
			var spans []segment.Span
			data, ref := segment.EncodePack(entries, tc.hint, func(sp []segment.Span) []byte {
				spans = sp
				return idx
			})
			if len(spans) != len(entries) {
				t.Fatalf("index func got %d spans, want %d", len(spans), len(entries))
			}
			for i, sp := range spans {
				got, n, err := segment.DecodeEntry(data[sp.Off : sp.Off+sp.Len])
				if err != nil || int64(n) != sp.Len {
					t.Fatalf("entry %d: decoded %d of %d bytes: %v", i, n, sp.Len, err)
				}
				if got.Name != entries[i].Name || !bytes.Equal(got.Records[0].Body, entries[i].Records[0].Body) {
					t.Fatalf("entry %d: got %q, want %q", i, got.Name, entries[i].Name)
				}
			}
			if ref.IndexOff+ref.IndexLen != int64(len(data)) || !bytes.Equal(data[ref.IndexOff:], idx) {
				t.Fatalf("index at %d+%d of %d bytes does not hold what index returned", ref.IndexOff, ref.IndexLen, len(data))
			}
			if ref.IndexCRC != crc32.Checksum(idx, crc32.MakeTable(crc32.Castagnoli)) {
				t.Fatal("index checksum does not match the index")
			}
			if tc.wantSlack && cap(data) > len(data)+tc.hint {
				t.Fatalf("pack of %d bytes sits in a buffer of %d: it was regrown", len(data), cap(data))
			}
		})
	}
}
