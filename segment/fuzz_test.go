package segment

import (
	"encoding/binary"
	"errors"
	"hash/crc32"
	"reflect"
	"testing"
)

// The decoders read objects from a bucket that anything with its keys can
// write, and bit rot or a torn upload can damage: whatever the bytes, they
// must answer an error wrapping ErrCorrupt or a value that encodes back to
// itself, never panic. The fuzz targets below frame their input with a valid
// checksum, since random bytes would otherwise stop at the CRC.
//
//	go test ./segment -run '^$' -fuzz FuzzDecodeEntry -fuzztime 60s
//
// Without -fuzz, `go test` runs each target on its seeds only.

func fuzzEntries() []*Entry {
	return []*Entry{
		{StreamID: "s1", Name: "/a", FirstSeq: 7, Records: []Record{
			{Seq: 7, Timestamp: 1700000000000, Body: []byte("hello")},
			{Seq: 8, Timestamp: 1700000000001, Headers: []Header{{Name: "k", Value: "v"}}, Body: []byte{}},
		}},
		{StreamID: "s2", Name: "/b", FirstSeq: 1, Closed: true, AccessedAt: 99,
			Producer: &ProducerState{ID: "p", Epoch: 2, Seq: 3}, StreamSeq: "0009", TrimTo: 1},
		{StreamID: "s3", Name: "/c", FirstSeq: 0, Blob: "blob/x",
			Records: []Record{{Seq: 0, Timestamp: 5}, {Seq: 1, Timestamp: 5}}},
		{StreamID: "s4", Name: "/d", Create: []byte(`{"content_type":"text/plain"}`),
			Records: []Record{{Timestamp: 1, Body: []byte("x")}}},
		{StreamID: "s5", Name: "/e", Drop: true},
	}
}

// decodedEqual compares two decoded entries, leaving out the fields that are
// not stored.
func decodedEqual(a, b *Entry) bool {
	a2, b2 := *a, *b
	a2.Ref, b2.Ref, a2.Merged, b2.Merged = nil, nil, 0, 0
	return reflect.DeepEqual(a2, b2)
}

func FuzzDecodeEntry(f *testing.F) {
	for _, e := range fuzzEntries() {
		f.Add(AppendEntry(nil, e)[8:])
	}
	f.Add([]byte{})
	f.Add([]byte{flagBlob})
	f.Fuzz(func(t *testing.T, payload []byte) {
		if n, ok := blobCount(payload); ok && n > 1<<16 {
			t.Skip("a blob entry of many records")
		}
		frame := binary.BigEndian.AppendUint32(nil, uint32(len(payload)))
		frame = binary.BigEndian.AppendUint32(frame, crc32.Checksum(payload, castagnoli))
		frame = append(frame, payload...)
		e, used, err := DecodeEntry(frame)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		if used != len(frame) {
			t.Fatalf("used %d of a %d-byte frame", used, len(frame))
		}
		again := AppendEntry(nil, e)
		e2, used2, err := DecodeEntry(again)
		if err != nil {
			t.Fatalf("the entry's own encoding does not decode: %v (entry %+v)", err, e)
		}
		if used2 != len(again) || !decodedEqual(e, e2) {
			t.Fatalf("re-encoded entry decodes differently:\n%+v\n%+v", e, e2)
		}
		if third := AppendEntry(nil, e2); string(third) != string(again) {
			t.Fatalf("the encoding of a decoded entry is not a fixed point")
		}
	})
}

// blobCount walks a blob entry's payload to its record count. Its stand-in
// records cost memory in proportion to that count, which is within bounds up
// to maxBlobRecords (a 64 MiB append of tiny JSON messages has millions):
// counts the fuzzer makes up would only time the allocator.
func blobCount(payload []byte) (uint32, bool) {
	d := decoder{b: payload}
	flags := d.u8()
	if flags&flagBlob == 0 {
		return 0, false
	}
	d.str()
	d.str()
	d.u64()
	d.u64()
	if flags&flagProd != 0 {
		d.str()
		d.u64()
		d.u64()
	}
	if flags&flagSSeq != 0 {
		d.str()
	}
	if flags&flagTrim != 0 {
		d.u64()
	}
	if flags&flagCreate != 0 {
		d.bytes()
	}
	n := d.u32()
	return n, d.err == nil
}

func FuzzDecodeWAL(f *testing.F) {
	b, _ := EncodeWAL(3, 4, fuzzEntries())
	f.Add(b)
	f.Add(EncodeSeal(3, 5, "node-a"))
	f.Add([]byte(walMagic))
	f.Fuzz(func(t *testing.T, data []byte) {
		obj, err := DecodeWAL(data)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		if obj.Sealed {
			again, err := DecodeWAL(EncodeSeal(obj.Namespace, obj.Seq, obj.SealToken))
			if err != nil || !reflect.DeepEqual(again, obj) {
				t.Fatalf("seal %+v re-encodes to %+v, %v", obj, again, err)
			}
			return
		}
		if len(obj.Spans) != len(obj.Entries) {
			t.Fatalf("%d spans for %d entries", len(obj.Spans), len(obj.Entries))
		}
		for i, s := range obj.Spans {
			if s.Off < 25 || s.Len < 8 || s.Off+s.Len > int64(len(data)) {
				t.Fatalf("span %d %+v outside a %d-byte object", i, s, len(data))
			}
			e, _, err := DecodeEntry(data[s.Off : s.Off+s.Len])
			if err != nil || !decodedEqual(e, obj.Entries[i]) {
				t.Fatalf("entry %d read alone through its span: %v", i, err)
			}
		}
		b, _ := EncodeWAL(obj.Namespace, obj.Seq, obj.Entries)
		again, err := DecodeWAL(b)
		if err != nil {
			t.Fatalf("the object's own encoding does not decode: %v", err)
		}
		if again.Namespace != obj.Namespace || again.Seq != obj.Seq || len(again.Entries) != len(obj.Entries) {
			t.Fatalf("re-encoded object decodes as %d/%d with %d entries, want %d/%d with %d",
				again.Namespace, again.Seq, len(again.Entries), obj.Namespace, obj.Seq, len(obj.Entries))
		}
		for i := range obj.Entries {
			if !decodedEqual(again.Entries[i], obj.Entries[i]) {
				t.Fatalf("entry %d decodes differently after a re-encode", i)
			}
		}
	})
}

func FuzzDecodeData(f *testing.F) {
	for _, e := range fuzzEntries() {
		d := EncodeData(e.Records)
		f.Add(d[:len(d)-4])
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		data := binary.BigEndian.AppendUint32(append([]byte{}, body...), crc32.Checksum(body, castagnoli))
		recs, err := DecodeData(data)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		for i := 1; i < len(recs); i++ {
			if recs[i].Seq != recs[i-1].Seq+1 {
				t.Fatalf("records %d and %d are seqs %d and %d", i-1, i, recs[i-1].Seq, recs[i].Seq)
			}
		}
		again, err := DecodeData(EncodeData(recs))
		if err != nil {
			t.Fatalf("the records' own encoding does not decode: %v", err)
		}
		if len(again) != len(recs) || (len(recs) > 0 && !reflect.DeepEqual(again, recs)) {
			t.Fatalf("re-encoded records decode differently")
		}
	})
}
