package segment

import (
	"encoding/binary"
	"errors"
	"hash/crc32"
	"runtime"
	"slices"
	"testing"
)

func TestWALEntryRoundTrip(t *testing.T) {
	tests := []struct {
		name    string
		entry   Entry
		records int // records the decoded entry has
	}{
		{"records", Entry{StreamID: "id", Name: "/a", FirstSeq: 7, Records: []Record{
			{Timestamp: 5, Body: []byte("x"), Headers: []Header{{"k", "v"}}}, {Timestamp: 5, Body: []byte("yz")}}}, 2},
		{"blob", Entry{StreamID: "id", Name: "/a", FirstSeq: 9, Blob: "300-abc", Closed: true,
			Records: []Record{{Timestamp: 11, Body: make([]byte, 1000)}, {Timestamp: 11, Body: []byte("b")}}}, 2},
		{"state only", Entry{StreamID: "id", Name: "/a", FirstSeq: 3, TrimTo: 2}, 0},
		{"create", Entry{StreamID: "id", Name: "/a", Create: []byte(`{"v":1}`), Closed: true,
			Records: []Record{{Timestamp: 5, Body: []byte("x")}}}, 1},
		{"drop", Entry{StreamID: "id", Name: "/a", FirstSeq: 4, Drop: true}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			data, spans := EncodeWAL(1, 2, []*Entry{&tt.entry})
			if tt.entry.Blob != "" && len(data) > 100 {
				t.Fatalf("a blob entry encodes %d bytes: its records went into the WAL", len(data))
			}
			obj, err := DecodeWAL(data)
			if err != nil {
				t.Fatal(err)
			}
			if len(obj.Entries) != 1 || obj.Spans[0] != spans[0] {
				t.Fatalf("entries %d, spans %v vs %v", len(obj.Entries), obj.Spans, spans)
			}
			got := obj.Entries[0]
			if got.Blob != tt.entry.Blob || got.FirstSeq != tt.entry.FirstSeq || got.Closed != tt.entry.Closed ||
				got.TrimTo != tt.entry.TrimTo || len(got.Records) != tt.records || got.EndSeq() != tt.entry.EndSeq() ||
				string(got.Create) != string(tt.entry.Create) || (got.Create == nil) != (tt.entry.Create == nil) ||
				got.Drop != tt.entry.Drop {
				t.Fatalf("decoded %+v, want %+v", got, tt.entry)
			}
			for i, r := range got.Records {
				want := tt.entry.Records[i]
				if r.Seq != tt.entry.FirstSeq+uint64(i) || r.Timestamp != want.Timestamp {
					t.Fatalf("record %d: %+v", i, r)
				}
				// A blob entry's records are stand-ins: no bodies.
				if tt.entry.Blob == "" && string(r.Body) != string(want.Body) {
					t.Fatalf("record %d body %q, want %q", i, r.Body, want.Body)
				}
				if tt.entry.Blob != "" && r.Body != nil {
					t.Fatalf("record %d of a blob entry has a body", i)
				}
			}
		})
	}
}

// RecordsMemSize counts what records hold, each body's array once: the
// cases are how records come to the cache (one body per append, a batch
// decoded out of one request body, a decoded object).
func TestRecordsMemSize(t *testing.T) {
	shared := make([]byte, 100)
	batch := make([]Record, 10)
	for i := range batch {
		batch[i].Body = shared[10*i : 10*i+1] // each slice reaches to the end of shared
	}
	limited := make([]Record, 10)
	for i := range limited {
		limited[i].Body = shared[10*i : 10*i+1 : 10*i+1]
	}
	own := make([]Record, 3, 8)
	for i := range own {
		own[i].Body = make([]byte, 1, 64)
	}
	for _, tc := range []struct {
		name string
		recs []Record
		buf  int
		want int
	}{
		{"bodies of their own, by capacity", own, 0, 8*recordMem + 3*64},
		{"a batch sharing one buffer counts it once", batch, 0, 10*recordMem + 100},
		{"bodies sliced to their length count their length", limited, 0, 10*recordMem + 10},
		{"a decode buffer counts instead of the bodies", limited, 4096, 10*recordMem + 4096},
		{"headers", []Record{{Headers: []Header{{"ab", "cde"}, {"f", ""}}, Body: []byte{}}}, 0, recordMem + 2*headerMem + 6},
		{"empty bodies", make([]Record, 4), 0, 4 * recordMem},
		{"none", nil, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := RecordsMemSize(tc.recs, tc.buf); got != tc.want {
				t.Errorf("RecordsMemSize = %d, want %d", got, tc.want)
			}
		})
	}
}

// An entry whose record count its bytes cannot hold (every record takes at
// least 16 of them) is refused before the records are allocated: a count
// up to the entry's size used to pass, and a 1 MiB entry could make the
// decoder allocate about 64 MiB of records before it found out.
func TestDecodeEntryRefusesACountItsBytesCannotHold(t *testing.T) {
	body := make([]byte, 1<<20)
	e := &Entry{StreamID: "id", Name: "/s", Records: []Record{{Body: body}}}
	data := AppendEntry(nil, e)
	payload := data[8:]
	at := 1 + 4 + len(e.StreamID) + 4 + len(e.Name) + 16 // the record count
	if got := binary.BigEndian.Uint32(payload[at:]); got != 1 {
		t.Fatalf("the record count is not at %d: %d there", at, got)
	}
	binary.BigEndian.PutUint32(payload[at:], uint32(len(payload)/2))
	binary.BigEndian.PutUint32(data[4:], crc32.Checksum(payload, castagnoli))

	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, _, err := DecodeEntry(data)
	runtime.ReadMemStats(&after)
	if !errors.Is(err, ErrCorrupt) {
		t.Fatalf("decode: %v; want ErrCorrupt", err)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 1<<20 {
		t.Fatalf("decoding an entry of %d bytes that claims %d records allocated %d MiB", len(data), len(payload)/2, alloc>>20)
	}
}

// A damaged entry length (the frame header is outside the checksum) is
// ErrCorrupt whatever its value: on 32-bit platforms, a length of 2^31 or
// more turned negative, passed the bounds check and panicked in the slice.
func TestDecodeEntryRefusesAnyLengthPastItsBytes(t *testing.T) {
	data := AppendEntry(nil, &Entry{StreamID: "id", Name: "/s", Records: []Record{{Body: []byte("x")}}})
	for _, size := range []uint32{uint32(len(data) - 7), 1 << 31, 0xFFFFFFF8, 0xFFFFFFFF} {
		bad := slices.Clone(data)
		binary.BigEndian.PutUint32(bad, size)
		if _, _, err := DecodeEntry(bad); !errors.Is(err, ErrCorrupt) {
			t.Errorf("length %#x: %v, want ErrCorrupt", size, err)
		}
	}
}
