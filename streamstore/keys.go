package streamstore

import (
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"time"
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

// Expiry markers index the streams that can expire: an empty object under
// expiry/<second>/, the second (since the Unix epoch) the stream's expiry
// falls in, then the name in hex as in its metadata key, then the stream's
// internal id, so that a create never writes over, or takes back, the
// marker of another stream of the same name. Listing sorts them by time,
// so a sweep reads only the markers that are due.
const (
	expiryPrefix = "expiry/"
	expirySecond = 1000 // milliseconds
)

// expiryKey is the marker of stream name (internal id) expiring at unix
// milliseconds at.
func expiryKey(at int64, name, id string) string {
	hexName := strings.TrimSuffix(strings.TrimPrefix(metaKey(name), metaPrefix), metaSuffix)
	return fmt.Sprintf("%s%012d/%s.%s", expiryPrefix, at/expirySecond, hexName, id)
}

// parseExpiryKey reverses expiryKey: the marker's second and stream name.
func parseExpiryKey(key string) (second int64, name string, err error) {
	rest, ok := strings.CutPrefix(key, expiryPrefix)
	slash := strings.IndexByte(rest, '/')
	dot := strings.LastIndexByte(rest, '.')
	if !ok || slash < 0 || dot < slash {
		return 0, "", fmt.Errorf("not an expiry marker: %q", key)
	}
	second, err = strconv.ParseInt(rest[:slash], 10, 64)
	if err != nil {
		return 0, "", fmt.Errorf("expiry marker %q: %w", key, err)
	}
	name, err = nameFromMetaKey(metaPrefix + rest[slash+1:dot] + metaSuffix)
	if err != nil {
		return 0, "", fmt.Errorf("expiry marker %q: %w", key, err)
	}
	return second, name, nil
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

// parseDataKey returns the seq range of a data object key, and the blob
// name when the key is a blob's marker (see markerKey).
func parseDataKey(key string) (first, end uint64, blob string, ok bool) {
	i := strings.LastIndexByte(key, '/')
	if i < 0 {
		return 0, 0, "", false
	}
	rest := key[i+1:]
	if len(rest) < 41 || rest[20] != '.' {
		return 0, 0, "", false
	}
	end, err1 := strconv.ParseUint(rest[:20], 10, 64)
	first, err2 := strconv.ParseUint(rest[21:41], 10, 64)
	if err1 != nil || err2 != nil || first > end {
		return 0, 0, "", false
	}
	switch {
	case len(rest) == 41:
	case rest[41] == '.' && validBlobName(rest[42:]):
		blob = rest[42:]
	default:
		return 0, 0, "", false
	}
	return first, end, blob, true
}

// A large append is written once, as its own data object (a blob) under
// blob/<id>/, before the WAL entry that refers to it; compaction then
// lists it among the stream's data objects with an empty marker object
// whose key names the blob, instead of copying its bytes. A blob whose
// entry never made it into the WAL (a failed upload, a crash) is never
// listed as data: only compaction of a committed entry writes markers.

// blobKey is the key of blob name of stream id.
func blobKey(id, name string) string { return "blob/" + id + "/" + name }

func blobPrefix(id string) string { return "blob/" + id + "/" }

// markerKey lists blob name, holding seqs [first, end) of stream id, among
// the stream's data objects.
func markerKey(id string, first, end uint64, name string) string {
	return dataKey(id, first, end) + "." + name
}

// newBlobName names a blob of size bytes written by the writer of WAL
// namespace ns: random, so that a blob of an append that failed can never
// be mistaken for a later one; carrying its size, which the marker's
// listing cannot tell (read-ahead is sized by bytes); and carrying ns, so
// that a later process can tell the blobs of appends a crash cut short
// from those of its own appends in flight (sweepOrphanBlobs). Builds before
// the namespace wrote "<size>-<random>", which they still read.
func newBlobName(size int, ns uint64) string {
	return strconv.FormatInt(int64(size), 10) + "-" + strconv.FormatUint(ns, 16) + "-" + newID()
}

// blobNamespace is the WAL namespace a blob name carries; ok is false for
// names from before blobs carried one.
func blobNamespace(name string) (ns uint64, ok bool) {
	_, rest, _ := strings.Cut(name, "-")
	nsHex, _, found := strings.Cut(rest, "-")
	if !found {
		return 0, false
	}
	ns, err := strconv.ParseUint(nsHex, 16, 64)
	return ns, err == nil
}

// parseBlobKey splits a key under blob/ into its stream id and blob name.
func parseBlobKey(key string) (id, name string, ok bool) {
	rest, found := strings.CutPrefix(key, "blob/")
	if !found {
		return "", "", false
	}
	id, name, found = strings.Cut(rest, "/")
	if !found || id == "" || !validBlobName(name) {
		return "", "", false
	}
	return id, name, true
}

// blobSize is the size a blob name carries.
func blobSize(name string) int64 {
	n, _, _ := strings.Cut(name, "-")
	v, _ := strconv.ParseInt(n, 10, 64)
	return v
}

func validBlobName(name string) bool {
	n, r, ok := strings.Cut(name, "-")
	if !ok || n == "" || r == "" || strings.ContainsAny(name, "/.") {
		return false
	}
	_, err := strconv.ParseUint(n, 10, 63)
	return err == nil
}

func gcKey(id string) string { return "gc/" + id }

// gravesPrefix starts the grave index: an entry per grave still to remove,
// keyed by when it is due, so a listing from the start finds the due ones
// first and stops at the first that is not.
const gravesPrefix = "graves/"

// graveIndexKey is the index entry of stream id's grave, due at due; its
// body is the stream's name.
func graveIndexKey(due time.Time, id string) string {
	return fmt.Sprintf("%s%013d-%s", gravesPrefix, due.UnixMilli(), id)
}

// parseGraveIndexKey reverses graveIndexKey.
func parseGraveIndexKey(key string) (time.Time, string, error) {
	rest, ok := strings.CutPrefix(key, gravesPrefix)
	ms, id, dash := strings.Cut(rest, "-")
	if !ok || !dash || id == "" {
		return time.Time{}, "", fmt.Errorf("not a grave index entry: %q", key)
	}
	n, err := strconv.ParseInt(ms, 10, 64)
	if err != nil {
		return time.Time{}, "", fmt.Errorf("grave index entry %q: %w", key, err)
	}
	return time.UnixMilli(n), id, nil
}
