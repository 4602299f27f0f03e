package segment

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"unsafe"
)

// Header is one record header: a name and value carried with a record.
type Header struct {
	Name  string
	Value string
}

// Record is one record of a stream. Seq is implied by its position in an
// entry or data object and is filled in on decode.
type Record struct {
	Seq       uint64
	Timestamp int64 // milliseconds since the Unix epoch
	Headers   []Header
	Body      []byte
}

// ProducerState is an idempotent producer's last accepted (epoch, seq).
type ProducerState struct {
	ID    string
	Epoch uint64
	Seq   uint64
}

// Entry is one change to one stream: records appended at FirstSeq and the
// writer state the stream has after them. State rides with data, so a
// close, a producer's progress or a trim is atomic with its records.
type Entry struct {
	StreamID string
	Name     string
	FirstSeq uint64
	Records  []Record

	Closed     bool           // the stream is closed after this entry
	Producer   *ProducerState // the producer this entry advanced, if any
	StreamSeq  string         // last accepted Stream-Seq, if it changed
	AccessedAt int64          // TTL renewal, ms; 0 when not renewed
	TrimTo     uint64         // records below this seq are gone for good; 0 when unchanged

	// Blob, when set, names an object written before the entry that holds
	// its records as a data object (EncodeData). The WAL then carries only
	// their count and timestamp, so a large append's bytes go to the bucket
	// once. Its records must all share one timestamp. An entry decoded
	// from the WAL has stand-in records: Seq and Timestamp, no headers or
	// bodies; the records are read from the blob.
	Blob string

	// Create, on the entry of a create with records, is the stream's
	// metadata object as the create writes it after the entry is durable.
	// A replay that finds the entry but no metadata writes it itself
	// (create-only), so a create that dies between the two, or whose
	// metadata write lands only after a restart, never leaves a stream
	// without the records it was created with.
	Create []byte
	// Drop marks the stream's create as undone: the stream was deleted, or
	// its create lost the name to another. A replay drops a create it has
	// not found metadata for once it meets this. Such an entry has no
	// records.
	Drop bool

	// Ref is the caller's own handle for the entry; it is not stored.
	Ref any
	// Merged counts the appends folded into this entry after its first
	// (Writer.Extend); it is not stored.
	Merged int
}

// EndSeq is the seq after the entry's last record.
func (e *Entry) EndSeq() uint64 { return e.FirstSeq + uint64(len(e.Records)) }

// ErrCorrupt reports a WAL or data object whose checksum or framing is wrong.
// Such an object is never served.
var ErrCorrupt = errors.New("corrupt object")

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

const (
	walMagic   = "PMQW"
	sealMagic  = "PMQS"
	walVersion = 1
	flagClosed = 1 << 1
	flagProd   = 1 << 2
	flagSSeq   = 1 << 3
	flagTrim   = 1 << 4
	flagBlob   = 1 << 5
	flagCreate = 1 << 6
	flagDrop   = 1 << 7
)

// WALObject is the decoded form of one WAL object.
type WALObject struct {
	Namespace uint64
	Seq       uint64
	Sealed    bool   // a seal marker, not a batch
	SealToken string // who wrote the seal
	Entries   []*Entry
	// Spans[i] is the byte range of Entries[i] in the object, so that one
	// entry can be read back with a ranged GET.
	Spans []Span
}

// Span is a byte range in an object.
type Span struct{ Off, Len int64 }

// EncodeSeal returns the body of a seal marker for (ns, seq), written by
// the holder of token, so that a writer can tell its own seal from one of
// another process that replayed its namespace.
func EncodeSeal(ns, seq uint64, token string) []byte {
	b := append([]byte(sealMagic), walVersion)
	b = binary.BigEndian.AppendUint64(b, ns)
	b = binary.BigEndian.AppendUint64(b, seq)
	return append(b, token...)
}

// EncodeWAL encodes a batch of entries as one WAL object and returns the
// span of every entry in it.
func EncodeWAL(ns, seq uint64, entries []*Entry) ([]byte, []Span) {
	size := 32
	for _, e := range entries {
		size += entrySize(e)
	}
	b := make([]byte, 0, size)
	b = append(b, walMagic...)
	b = append(b, walVersion)
	b = binary.BigEndian.AppendUint64(b, ns)
	b = binary.BigEndian.AppendUint64(b, seq)
	b = binary.BigEndian.AppendUint32(b, uint32(len(entries)))
	spans := make([]Span, len(entries))
	for i, e := range entries {
		start := len(b)
		b = AppendEntry(b, e)
		spans[i] = Span{int64(start), int64(len(b) - start)}
	}
	return b, spans
}

// AppendEntry appends one framed entry: u32 payload length, u32 CRC-32C of
// the payload, payload.
func AppendEntry(b []byte, e *Entry) []byte {
	hdr := len(b)
	b = append(b, 0, 0, 0, 0, 0, 0, 0, 0)
	var flags byte
	if e.Closed {
		flags |= flagClosed
	}
	if e.Producer != nil {
		flags |= flagProd
	}
	if e.StreamSeq != "" {
		flags |= flagSSeq
	}
	if e.TrimTo != 0 {
		flags |= flagTrim
	}
	if e.Blob != "" {
		flags |= flagBlob
	}
	if e.Create != nil {
		flags |= flagCreate
	}
	if e.Drop {
		flags |= flagDrop
	}
	b = append(b, flags)
	b = appendString(b, e.StreamID)
	b = appendString(b, e.Name)
	b = binary.BigEndian.AppendUint64(b, e.FirstSeq)
	b = binary.BigEndian.AppendUint64(b, uint64(e.AccessedAt))
	if e.Producer != nil {
		b = appendString(b, e.Producer.ID)
		b = binary.BigEndian.AppendUint64(b, e.Producer.Epoch)
		b = binary.BigEndian.AppendUint64(b, e.Producer.Seq)
	}
	if e.StreamSeq != "" {
		b = appendString(b, e.StreamSeq)
	}
	if e.TrimTo != 0 {
		b = binary.BigEndian.AppendUint64(b, e.TrimTo)
	}
	if e.Create != nil {
		b = binary.BigEndian.AppendUint32(b, uint32(len(e.Create)))
		b = append(b, e.Create...)
	}
	b = binary.BigEndian.AppendUint32(b, uint32(len(e.Records)))
	if e.Blob != "" {
		b = appendString(b, e.Blob)
		var ts int64
		if len(e.Records) > 0 {
			ts = e.Records[0].Timestamp
		}
		b = binary.BigEndian.AppendUint64(b, uint64(ts))
	} else {
		for i := range e.Records {
			b = AppendRecord(b, &e.Records[i])
		}
	}
	payload := b[hdr+8:]
	binary.BigEndian.PutUint32(b[hdr:], uint32(len(payload)))
	binary.BigEndian.PutUint32(b[hdr+4:], crc32.Checksum(payload, castagnoli))
	return b
}

// AppendRecord appends a record's timestamp, headers and body.
func AppendRecord(b []byte, r *Record) []byte {
	b = binary.BigEndian.AppendUint64(b, uint64(r.Timestamp))
	b = binary.BigEndian.AppendUint32(b, uint32(len(r.Headers)))
	for _, h := range r.Headers {
		b = appendString(b, h.Name)
		b = appendString(b, h.Value)
	}
	b = binary.BigEndian.AppendUint32(b, uint32(len(r.Body)))
	return append(b, r.Body...)
}

func entrySize(e *Entry) int {
	n := 8 + 1 + 8 + len(e.StreamID) + len(e.Name) + 16 + 4 + 16 + 8
	if e.Producer != nil {
		n += 20 + len(e.Producer.ID)
	}
	n += 4 + len(e.StreamSeq) + 4 + len(e.Create)
	if e.Blob != "" {
		return n + 12 + len(e.Blob)
	}
	for i := range e.Records {
		n += RecordSize(&e.Records[i])
	}
	return n
}

// RecordSize is the encoded size of a record.
func RecordSize(r *Record) int {
	n := 16 + len(r.Body)
	for _, h := range r.Headers {
		n += 8 + len(h.Name) + len(h.Value)
	}
	return n
}

// pendingSize is what e holds in memory while it waits for storage: its
// fields as encoded, and its records as RecordsMemSize counts them. A
// blob entry's records are counted by the reservation of its upload
// (Writer.Reserve), as its encoding leaves them out.
func pendingSize(e *Entry) int {
	n := entrySize(e)
	if e.Blob != "" {
		return n
	}
	for i := range e.Records {
		n -= RecordSize(&e.Records[i])
	}
	return n + RecordsMemSize(e.Records, 0)
}

// recordMem and headerMem are what a Record and a Header take as elements
// of their slices.
const (
	recordMem = int(unsafe.Sizeof(Record{}))
	headerMem = int(unsafe.Sizeof(Header{}))
)

// RecordsMemSize is what recs hold in memory, where RecordSize is what a
// record takes encoded: the slice's array (64 bytes a record, to its
// capacity), each record's header slice and strings, and the bodies. A
// record of a few bytes costs several times its RecordSize in memory, so
// a bound on memory counts this, and RecordSize only bounds objects.
//
// buf, when not 0, is the size of the one buffer the bodies were decoded
// from and alias (a data object, a ranged read of a WAL object): it is
// what they hold, framing and all, and is counted instead of them. With
// buf 0, each backing array is counted once, by its capacity: a body
// allocated by itself holds all of its array (a JSON message's is at least
// 64 bytes), and the bodies of a batch decoded from one request body
// share it, each slice reaching to its end.
func RecordsMemSize(recs []Record, buf int) int {
	n := cap(recs) * recordMem
	for i := range recs {
		r := &recs[i]
		n += cap(r.Headers) * headerMem
		for _, h := range r.Headers {
			n += len(h.Name) + len(h.Value)
		}
	}
	if buf > 0 {
		return n + buf
	}
	return n + bodiesMem(recs)
}

// bodiesMem is the bytes of the arrays behind the bodies of recs, each
// counted once. Bodies that share an array come one after another in it,
// so a body that starts inside the array counted last adds only what it
// reaches beyond it. Only addresses are compared: nothing is dereferenced.
func bodiesMem(recs []Record) int {
	n := 0
	var lo, hi uintptr // the array counted last
	for i := range recs {
		b := recs[i].Body
		if cap(b) == 0 {
			continue
		}
		p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
		end := p + uintptr(cap(b))
		if p >= lo && p < hi {
			if end > hi {
				n += int(end - hi)
				hi = end
			}
			continue
		}
		n += cap(b)
		lo, hi = p, end
	}
	return n
}

// maxSealToken bounds a seal's token: processes write 24 hex digits.
const maxSealToken = 128

// validSealToken reports whether tok can be a seal's token: at most
// maxSealToken bytes of printable ASCII.
func validSealToken(tok []byte) bool {
	if len(tok) > maxSealToken {
		return false
	}
	for _, c := range tok {
		if c < 0x20 || c > 0x7e {
			return false
		}
	}
	return true
}

func appendString(b []byte, s string) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(len(s)))
	return append(b, s...)
}

// DecodeWAL decodes a WAL object or seal marker. Record bodies alias data.
func DecodeWAL(data []byte) (*WALObject, error) {
	if len(data) >= 21 && string(data[:4]) == sealMagic {
		if data[4] != walVersion {
			return nil, fmt.Errorf("%w: seal version %d", ErrCorrupt, data[4])
		}
		// No checksum covers the header, and one flipped bit turns a
		// WAL object's magic into a seal's, which replay would take for
		// the end of the log and stop at, silently. A seal's token is a
		// short word of printable ASCII; the rest of a WAL object is not.
		if !validSealToken(data[21:]) {
			return nil, fmt.Errorf("%w: a seal whose token is %d bytes, not a short printable word (a damaged WAL object?)", ErrCorrupt, len(data)-21)
		}
		return &WALObject{
			Namespace: binary.BigEndian.Uint64(data[5:]),
			Seq:       binary.BigEndian.Uint64(data[13:]),
			Sealed:    true,
			SealToken: string(data[21:]),
		}, nil
	}
	if len(data) < 25 || string(data[:4]) != walMagic {
		return nil, fmt.Errorf("%w: not a WAL object", ErrCorrupt)
	}
	if data[4] != walVersion {
		return nil, fmt.Errorf("%w: WAL version %d", ErrCorrupt, data[4])
	}
	obj := &WALObject{
		Namespace: binary.BigEndian.Uint64(data[5:]),
		Seq:       binary.BigEndian.Uint64(data[13:]),
	}
	n := binary.BigEndian.Uint32(data[21:])
	off := 25
	for i := uint32(0); i < n; i++ {
		e, used, err := DecodeEntry(data[off:])
		if err != nil {
			return nil, fmt.Errorf("entry %d: %w", i, err)
		}
		obj.Entries = append(obj.Entries, e)
		obj.Spans = append(obj.Spans, Span{int64(off), int64(used)})
		off += used
	}
	if off != len(data) {
		return nil, fmt.Errorf("%w: %d trailing bytes", ErrCorrupt, len(data)-off)
	}
	return obj, nil
}

// DecodeEntry decodes one framed entry from the start of data and returns
// the bytes it used. Record bodies alias data.
func DecodeEntry(data []byte) (*Entry, int, error) {
	if len(data) < 8 {
		return nil, 0, fmt.Errorf("%w: truncated entry header", ErrCorrupt)
	}
	size32 := binary.BigEndian.Uint32(data)
	sum := binary.BigEndian.Uint32(data[4:])
	// Compared unsigned: on 32-bit platforms int(size32) can be negative.
	if uint64(size32) > uint64(len(data)-8) {
		return nil, 0, fmt.Errorf("%w: truncated entry", ErrCorrupt)
	}
	size := int(size32)
	payload := data[8 : 8+size]
	if crc32.Checksum(payload, castagnoli) != sum {
		return nil, 0, fmt.Errorf("%w: entry checksum mismatch", ErrCorrupt)
	}
	d := decoder{b: payload}
	flags := d.u8()
	e := &Entry{Closed: flags&flagClosed != 0, Drop: flags&flagDrop != 0}
	e.StreamID = d.str()
	e.Name = d.str()
	e.FirstSeq = d.u64()
	e.AccessedAt = int64(d.u64())
	if flags&flagProd != 0 {
		e.Producer = &ProducerState{ID: d.str(), Epoch: d.u64(), Seq: d.u64()}
	}
	if flags&flagSSeq != 0 {
		e.StreamSeq = d.str()
	}
	if flags&flagTrim != 0 {
		e.TrimTo = d.u64()
	}
	if flags&flagCreate != 0 {
		// Copied: the entry outlives the object it came in (record bodies
		// do not, and alias it).
		e.Create = append([]byte{}, d.bytes()...)
	}
	n := d.u32()
	if flags&flagBlob != 0 {
		e.Blob = d.str()
		ts := int64(d.u64())
		// The count is not bounded by the entry's size here: cap it by
		// what one append can hold instead.
		if d.err == nil && (e.Blob == "" || n > maxBlobRecords) {
			d.err = fmt.Errorf("blob entry %q of %d records", e.Blob, n)
		}
		if d.err == nil {
			e.Records = make([]Record, n)
			for i := range e.Records {
				e.Records[i] = Record{Seq: e.FirstSeq + uint64(i), Timestamp: ts}
			}
		}
	} else if d.err == nil && uint64(n)*minRecordBytes > uint64(len(d.b)) {
		// Checked before the records are allocated, each far larger in
		// memory than its smallest encoding.
		d.err = errTruncated
	}
	if d.err == nil && e.Blob == "" {
		e.Records = make([]Record, n)
		for i := range e.Records {
			d.record(&e.Records[i])
			e.Records[i].Seq = e.FirstSeq + uint64(i)
		}
	}
	if d.err == nil && len(d.b) != 0 {
		d.err = fmt.Errorf("%d bytes left in entry", len(d.b))
	}
	if d.err != nil {
		return nil, 0, fmt.Errorf("%w: %v", ErrCorrupt, d.err)
	}
	return e, 8 + size, nil
}

var errTruncated = errors.New("truncated")

// minRecordBytes is the smallest encoded record: a timestamp and the
// header count and body length.
const minRecordBytes = 16

// maxBlobRecords bounds the record count of a blob entry read from the WAL;
// every record of a blob costs at least 16 bytes of it, and no append is
// near 1 GiB.
const maxBlobRecords = 1 << 26

// decoder reads big-endian fields; the first error sticks and later reads
// return zero values.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) take(n int) []byte {
	if d.err != nil || n < 0 || n > len(d.b) {
		d.err = errTruncated
		return nil
	}
	v := d.b[:n:n]
	d.b = d.b[n:]
	return v
}

func (d *decoder) u8() byte {
	if v := d.take(1); v != nil {
		return v[0]
	}
	return 0
}

func (d *decoder) u32() uint32 {
	if v := d.take(4); v != nil {
		return binary.BigEndian.Uint32(v)
	}
	return 0
}

func (d *decoder) u64() uint64 {
	if v := d.take(8); v != nil {
		return binary.BigEndian.Uint64(v)
	}
	return 0
}

func (d *decoder) bytes() []byte { return d.take(int(d.u32())) }

func (d *decoder) str() string { return string(d.bytes()) }

func (d *decoder) record(r *Record) {
	r.Timestamp = int64(d.u64())
	nh := d.u32()
	if d.err == nil && uint64(nh)*8 > uint64(len(d.b)) {
		d.err = errTruncated
		return
	}
	if nh > 0 {
		r.Headers = make([]Header, nh)
		for i := range r.Headers {
			r.Headers[i] = Header{Name: d.str(), Value: d.str()}
		}
	}
	r.Body = d.bytes()
}
