package segment

import (
	"context"
	"fmt"
	"hash/crc32"
	"strings"
)

// A pack holds the small backlogs of many streams in one object, so that
// retiring the WAL does not cost a data object and a checkpoint for every
// stream that gained a few records. It is the entries, framed as in a WAL
// object (so a reader decodes one by its span, as it would a WAL entry),
// followed by an index that the caller defines. The manifest lists the
// live packs with where their index is, so a replay reads the index alone.
const packMagic = "PMQK"

// packPrefix starts every pack key.
const packPrefix = "pack/"

// PackPrefix is the key prefix of every pack.
func PackPrefix() string { return packPrefix }

// PackKey names a pack written by a compaction that cut the WAL at
// (ns, seq); tag keeps two packs of one cut apart.
func PackKey(ns, seq uint64, tag string) string {
	return fmt.Sprintf("%s%016x-%016x-%s", packPrefix, ns, seq, tag)
}

// IsPackKey reports whether key names a pack.
func IsPackKey(key string) bool { return strings.HasPrefix(key, packPrefix) }

// PackRef is a live pack as the manifest lists it.
type PackRef struct {
	Key      string `json:"key"`
	IndexOff int64  `json:"index_off"`
	IndexLen int64  `json:"index_len"`
	IndexCRC uint32 `json:"index_crc"`
}

// EncodePack lays out entries and their index as one pack object; index
// is handed the span of every entry. It returns the object and the
// reference the manifest keeps (its Key left for the caller). indexHint is
// the caller's guess at the index's length: the object is allocated once
// with room for it, where an index that did not fit would copy the whole
// pack (megabytes) into a buffer twice its size.
func EncodePack(entries []*Entry, indexHint int, index func([]Span) []byte) ([]byte, PackRef) {
	size := len(packMagic) + 1 + max(indexHint, 0)
	for _, e := range entries {
		size += entrySize(e)
	}
	b := make([]byte, 0, size)
	b = append(b, packMagic...)
	b = append(b, walVersion)
	spans := make([]Span, len(entries))
	for i, e := range entries {
		start := len(b)
		b = AppendEntry(b, e)
		spans[i] = Span{int64(start), int64(len(b) - start)}
	}
	idx := index(spans)
	ref := PackRef{IndexOff: int64(len(b)), IndexLen: int64(len(idx)), IndexCRC: crc32.Checksum(idx, castagnoli)}
	return append(b, idx...), ref
}

// ReadPackIndex fetches the index of a listed pack with one ranged GET and
// checks it against the checksum the manifest keeps.
func ReadPackIndex(ctx context.Context, store Store, ref PackRef) ([]byte, error) {
	data, _, err := store.Get(ctx, ref.Key, ref.IndexOff, ref.IndexLen)
	if err != nil {
		return nil, fmt.Errorf("read index of %s: %w", ref.Key, err)
	}
	if int64(len(data)) != ref.IndexLen || crc32.Checksum(data, castagnoli) != ref.IndexCRC {
		return nil, fmt.Errorf("read index of %s: %w: index does not match its checksum", ref.Key, ErrCorrupt)
	}
	return data, nil
}
