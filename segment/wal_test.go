package segment

import "testing"

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
