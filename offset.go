package picomq

import (
	"errors"
	"fmt"
	"math"
	"math/big"
	"math/rand/v2"
	"strconv"
	"time"
)

// position is a Durable Streams offset decoded: a record seq and a byte
// position inside that record. The tail of a stream is (NextSeq, 0); a read
// that stops inside a large record resumes at (seq, bytes already sent).
type position struct {
	seq uint64
	off uint64
}

// offsetDigits is the width of each zero-padded half of an offset. Fixed
// width keeps offsets lexicographically sortable, as the protocol requires;
// 16 digits cover 10^16 records per stream and 10^16 bytes per record.
const offsetDigits = 16

// offsetLen is the length of an encoded offset: two halves and a '_'.
const offsetLen = 2*offsetDigits + 1

// before reports whether p comes before q in the stream.
func (p position) before(q position) bool {
	return p.seq < q.seq || (p.seq == q.seq && p.off < q.off)
}

// String encodes p as the opaque offset token clients see.
func (p position) String() string {
	// Every response and SSE control event carries one: no fmt.
	var buf [2*offsetDigits + 1]byte
	b := appendPadded(buf[:0], p.seq)
	b = append(b, '_')
	return string(appendPadded(b, p.off))
}

// appendPadded appends v in decimal, zero-padded to offsetDigits (wider
// when v needs more digits, as %0*d would print it).
func appendPadded(dst []byte, v uint64) []byte {
	var tmp [20]byte
	d := strconv.AppendUint(tmp[:0], v, 10)
	for i := len(d); i < offsetDigits; i++ {
		dst = append(dst, '0')
	}
	return append(dst, d...)
}

// offsetKind tells the sentinels apart from a real position.
type offsetKind int

const (
	offsetStart offsetKind = iota // "-1" or no offset: the stream's first retained byte
	offsetNow                     // "now": the current tail
	offsetAt                      // a position the server handed out
)

// readOffset is a parsed offset query parameter.
type readOffset struct {
	kind offsetKind
	pos  position // when kind == offsetAt
}

var errBadOffset = errors.New("malformed offset")

// parseOffset decodes an offset query value. Anything but the two sentinels
// and the exact shape String produces is rejected, so junk (spaces, commas,
// path segments, signs) never reaches the engine.
func parseOffset(s string) (readOffset, error) {
	switch s {
	case "-1":
		return readOffset{kind: offsetStart}, nil
	case "now":
		return readOffset{kind: offsetNow}, nil
	}
	if len(s) != offsetLen || s[offsetDigits] != '_' {
		return readOffset{}, errBadOffset
	}
	seq, ok := parseDigits(s[:offsetDigits])
	if !ok {
		return readOffset{}, errBadOffset
	}
	off, ok := parseDigits(s[offsetDigits+1:])
	if !ok {
		return readOffset{}, errBadOffset
	}
	return readOffset{kind: offsetAt, pos: position{seq: seq, off: off}}, nil
}

// parseDigits parses a run of ASCII digits; strconv alone would also take a
// sign or underscores.
func parseDigits(s string) (uint64, bool) {
	if s == "" || !allDigits(s) {
		return 0, false
	}
	n, err := strconv.ParseUint(s, 10, 64)
	return n, err == nil
}

// Cursors (protocol section 10.1): the number of 20-second intervals since
// 2024-10-09T00:00:00Z. They only exist so that CDN cache keys change over
// time; a client echoing a cursor that is not behind the clock gets a larger
// one, so a cached response can never be served to it again.
const (
	cursorEpochUnix = 1728432000 // 2024-10-09T00:00:00Z
	cursorInterval  = 20 * time.Second
	cursorMaxJitter = 3600 // seconds
)

// cursorAt returns the interval number at t.
func cursorAt(t time.Time) uint64 {
	d := t.Sub(time.Unix(cursorEpochUnix, 0))
	if d < 0 {
		return 0
	}
	return uint64(d / cursorInterval)
}

// maxCursorLength bounds the cursor a read may send back, in bytes. The
// cursors this server gives are interval numbers of a dozen digits, and a
// client that echoes them stays near that for centuries; one ahead of the
// clock is answered with a larger number, which past a uint64 is big.Int
// arithmetic, quadratic in the digits (16,000 took 3 ms of CPU, a
// megabyte, under a raised max_header_size, 2 s), and the answer carried
// them all back, in every SSE control event too.
const maxCursorLength = 64

// checkCursor refuses a cursor longer than maxCursorLength.
func checkCursor(c string) error {
	if len(c) > maxCursorLength {
		return fmt.Errorf("cursor is %d bytes; the limit is %d (send back the cursor the last response gave)", len(c), maxCursorLength)
	}
	return nil
}

// nextCursor returns the cursor for a live response at now. clientCursor is
// the client's cursor query parameter ("" when absent); jitterSeconds picks a
// value in [1, cursorMaxJitter] (randomJitter in production).
func nextCursor(now time.Time, clientCursor string, jitterSeconds func() int) string {
	cur := cursorAt(now)
	c, fits := parseDigits(clientCursor)
	// A cursor of digits too long for a uint64 is ahead of any clock.
	ahead := (fits && c >= cur) || (!fits && clientCursor != "" && allDigits(clientCursor))
	if !ahead {
		return strconv.FormatUint(cur, 10)
	}
	// Stay strictly ahead of the client so its next request has a new cache
	// key; the jitter spreads clients over several keys.
	step := max(uint64(jitterSeconds())/uint64(cursorInterval/time.Second), 1)
	if fits && c <= math.MaxUint64-step {
		return strconv.FormatUint(c+step, 10)
	}
	// Past what a uint64 holds the sum is still a larger decimal number,
	// which is all a cursor is (section 10.1 says it must never go back).
	n, _ := new(big.Int).SetString(clientCursor, 10)
	return n.Add(n, new(big.Int).SetUint64(step)).String()
}

func allDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// randomJitter is the production jitter source for nextCursor.
func randomJitter() int { return 1 + rand.IntN(cursorMaxJitter) }
