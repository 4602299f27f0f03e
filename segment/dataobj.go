package segment

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
)

const dataMagic = "PMQD"

// EncodeData encodes a run of one stream's consecutive records, starting at
// records[0].Seq, as a data object: magic, version, first seq, count, the
// records, and a CRC-32C of everything before it.
func EncodeData(records []Record) []byte {
	size := 4 + 1 + 8 + 4 + 4
	for i := range records {
		size += RecordSize(&records[i])
	}
	b := make([]byte, 0, size)
	b = append(b, dataMagic...)
	b = append(b, walVersion)
	var first uint64
	if len(records) > 0 {
		first = records[0].Seq
	}
	b = binary.BigEndian.AppendUint64(b, first)
	b = binary.BigEndian.AppendUint32(b, uint32(len(records)))
	for i := range records {
		b = AppendRecord(b, &records[i])
	}
	return binary.BigEndian.AppendUint32(b, crc32.Checksum(b, castagnoli))
}

// DecodeData decodes a data object. Record bodies alias data.
func DecodeData(data []byte) ([]Record, error) {
	if len(data) < 21 || string(data[:4]) != dataMagic {
		return nil, fmt.Errorf("%w: not a data object", ErrCorrupt)
	}
	body, sum := data[:len(data)-4], binary.BigEndian.Uint32(data[len(data)-4:])
	if crc32.Checksum(body, castagnoli) != sum {
		return nil, fmt.Errorf("%w: data object checksum mismatch", ErrCorrupt)
	}
	if body[4] != walVersion {
		return nil, fmt.Errorf("%w: data object version %d", ErrCorrupt, body[4])
	}
	d := decoder{b: body[5:]}
	first := d.u64()
	n := d.u32()
	if d.err == nil && uint64(n)*minRecordBytes > uint64(len(d.b)) {
		return nil, fmt.Errorf("%w: record count %d too large", ErrCorrupt, n)
	}
	recs := make([]Record, n)
	for i := range recs {
		d.record(&recs[i])
		recs[i].Seq = first + uint64(i)
	}
	if d.err == nil && len(d.b) != 0 {
		d.err = fmt.Errorf("%d trailing bytes", len(d.b))
	}
	if d.err != nil {
		return nil, fmt.Errorf("%w: %v", ErrCorrupt, d.err)
	}
	return recs, nil
}
