package streamstore

import (
	"encoding/hex"
	"fmt"
	"strings"
)

// Stream names become metadata keys through an order-preserving, reversible
// encoding: the name's bytes in lowercase hex, cut into folders of
// keyChunk characters, ending in ".m". Hex keeps byte order; ".m" sorts
// before both "/" and every hex digit, so a name sorts before every longer
// name it prefixes, and no key is ever both an object and a folder. With the
// 256-byte name limit a key stays under 530 bytes and every component under
// 255.
const (
	metaPrefix = "streams/"
	metaSuffix = ".m"
	keyChunk   = 200
)

// metaKey is the metadata object key of a stream name.
func metaKey(name string) string {
	h := hex.EncodeToString([]byte(name))
	var b strings.Builder
	b.Grow(len(metaPrefix) + len(h) + len(h)/keyChunk + len(metaSuffix))
	b.WriteString(metaPrefix)
	for len(h) > keyChunk {
		b.WriteString(h[:keyChunk])
		b.WriteByte('/')
		h = h[keyChunk:]
	}
	b.WriteString(h)
	b.WriteString(metaSuffix)
	return b.String()
}

// nameFromMetaKey reverses metaKey.
func nameFromMetaKey(key string) (string, error) {
	rest, ok := strings.CutPrefix(key, metaPrefix)
	if !ok {
		return "", fmt.Errorf("not a metadata key: %q", key)
	}
	rest, ok = strings.CutSuffix(rest, metaSuffix)
	if !ok {
		return "", fmt.Errorf("not a metadata key: %q", key)
	}
	b, err := hex.DecodeString(strings.ReplaceAll(rest, "/", ""))
	if err != nil {
		return "", fmt.Errorf("metadata key %q: %w", key, err)
	}
	return string(b), nil
}

// metaListPrefix is the longest key prefix shared by the metadata keys of
// every name starting with namePrefix.
func metaListPrefix(namePrefix string) string {
	k := metaKey(namePrefix)
	return strings.TrimSuffix(k, metaSuffix)
}

// dataKey names a data object of stream id holding seqs [first, end). Keys
// sort by end, so the object holding seq n is the first key after
// dataKeyAfter(id, n).
func dataKey(id string, first, end uint64) string {
	return fmt.Sprintf("data/%s/%020d.%020d", id, end, first)
}

func dataPrefix(id string) string { return "data/" + id + "/" }

func dataKeyAfter(id string, seq uint64) string {
	// Every key for an object ending at or below seq sorts at or before
	// this one; "/" ends the end-seq digits with a byte below ".".
	return fmt.Sprintf("data/%s/%020d/", id, seq)
}

// parseDataKey returns the seq range of a data object key.
func parseDataKey(key string) (first, end uint64, ok bool) {
	i := strings.LastIndexByte(key, '/')
	if i < 0 {
		return 0, 0, false
	}
	if _, err := fmt.Sscanf(key[i+1:], "%020d.%020d", &end, &first); err != nil {
		return 0, 0, false
	}
	return first, end, true
}

func gcKey(id string) string { return "gc/" + id }
