package picomq

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestOffsetRoundTrip(t *testing.T) {
	for _, p := range []position{
		{0, 0}, {1, 0}, {0, 7}, {42, 1 << 20}, {9999999999999999, 9999999999999999},
	} {
		s := p.String()
		if len(s) != offsetLen {
			t.Errorf("%v encodes to %q (%d bytes), want %d", p, s, len(s), offsetLen)
		}
		if strings.ContainsAny(s, ",&=?/") {
			t.Errorf("%q holds a character the protocol forbids", s)
		}
		got, err := parseOffset(s)
		if err != nil || got.kind != offsetAt || got.pos != p {
			t.Errorf("parseOffset(%q) = %+v, %v; want %v", s, got, err, p)
		}
	}
}

// The hand-rolled encoding is the printf one, also past 16 digits.
func TestPositionStringIsPadded(t *testing.T) {
	for _, p := range []position{{0, 0}, {7, 123}, {1 << 40, 1}, {^uint64(0), 12345678901234567}} {
		if got, want := p.String(), fmt.Sprintf("%0*d_%0*d", offsetDigits, p.seq, offsetDigits, p.off); got != want {
			t.Errorf("%v.String() = %q, want %q", p, got, want)
		}
	}
	// Every append's response carries one: the string itself is the only
	// allocation.
	if n := testing.AllocsPerRun(100, func() { _ = position{7, 123}.String() }); n > 1 {
		t.Errorf("position.String allocates %v times; want 1", n)
	}
}

func TestOffsetsSortLikePositions(t *testing.T) {
	ps := []position{{10, 0}, {2, 5}, {2, 0}, {0, 0}, {1, 100}, {1, 99}, {100, 0}}
	strs := make([]string, len(ps))
	for i, p := range ps {
		strs[i] = p.String()
	}
	sort.Slice(ps, func(i, j int) bool {
		return ps[i].seq < ps[j].seq || (ps[i].seq == ps[j].seq && ps[i].off < ps[j].off)
	})
	sort.Strings(strs)
	for i := range ps {
		if ps[i].String() != strs[i] {
			t.Fatalf("string order differs from position order at %d: %s vs %s", i, strs[i], ps[i])
		}
	}
}

func TestParseOffsetSentinels(t *testing.T) {
	if o, err := parseOffset("-1"); err != nil || o.kind != offsetStart {
		t.Errorf("-1: %+v %v", o, err)
	}
	if o, err := parseOffset("now"); err != nil || o.kind != offsetNow {
		t.Errorf("now: %+v %v", o, err)
	}
}

func TestParseOffsetRejects(t *testing.T) {
	good := position{3, 4}.String()
	for _, s := range []string{
		"", " ", "0", "-2", "NOW", "Now", "now ", "0 1", "0,1", "../x", "x/..", "a\x00", "a\n", "a\r\n",
		good + "0", good[1:], strings.Replace(good, "_", "-", 1), strings.Replace(good, "0", " ", 1),
		strings.Replace(good, "0", "+", 1), strings.Replace(good, "0", "a", 1),
		"+000000000000003_0000000000000004", "0000000000000003_000000000000000x",
	} {
		if o, err := parseOffset(s); err == nil {
			t.Errorf("parseOffset(%q) = %+v, want an error", s, o)
		}
	}
}

func TestCursorAt(t *testing.T) {
	epoch := time.Date(2024, 10, 9, 0, 0, 0, 0, time.UTC)
	if got := cursorAt(epoch); got != 0 {
		t.Errorf("at the epoch: %d", got)
	}
	if got := cursorAt(epoch.Add(19 * time.Second)); got != 0 {
		t.Errorf("19s in: %d", got)
	}
	if got := cursorAt(epoch.Add(20 * time.Second)); got != 1 {
		t.Errorf("20s in: %d", got)
	}
	if got := cursorAt(epoch.Add(-time.Hour)); got != 0 {
		t.Errorf("before the epoch: %d", got)
	}
}

func TestNextCursor(t *testing.T) {
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	cur := cursorAt(now)
	curS := itoa(cur)
	noJitter := func() int { t.Fatal("jitter used"); return 0 }

	if got := nextCursor(now, "", noJitter); got != curS {
		t.Errorf("no client cursor: %s, want %s", got, curS)
	}
	if got := nextCursor(now, itoa(cur-5), noJitter); got != curS {
		t.Errorf("old client cursor: %s, want %s", got, curS)
	}
	if got := nextCursor(now, "garbage", noJitter); got != curS {
		t.Errorf("junk client cursor: %s, want %s", got, curS)
	}
	// A client at or ahead of the clock gets a strictly larger cursor.
	for _, jitter := range []int{1, 19, 20, 59, 3600} {
		j := jitter
		for _, client := range []uint64{cur, cur + 100} {
			got := nextCursor(now, itoa(client), func() int { return j })
			want := client + max(uint64(j/20), 1)
			if got != itoa(want) {
				t.Errorf("client %d, jitter %d: %s, want %d", client, j, got, want)
			}
		}
	}
	// Section 10.1: never a cursor below the client's, however large.
	for _, tc := range []struct{ client, want string }{
		{"18446744073709551615", "18446744073709551620"},        // the largest uint64
		{"18446744073709551610", "18446744073709551615"},        // lands on it
		{"18446744073709551611", "18446744073709551616"},        // one past it
		{"99999999999999999999999", "100000000000000000000004"}, // no uint64 at all
		{"000000000000000000000000000000000001", curS},          // long, but behind the clock
	} {
		if got := nextCursor(now, tc.client, func() int { return 100 }); got != tc.want {
			t.Errorf("client %s: %s, want %s", tc.client, got, tc.want)
		}
	}
	for range 1000 {
		if j := randomJitter(); j < 1 || j > cursorMaxJitter {
			t.Fatalf("jitter %d out of range", j)
		}
	}
}

func itoa(n uint64) string { return strconv.FormatUint(n, 10) }

// TestCheckCursor: cursors up to maxCursorLength bytes are taken, longer
// ones refused naming the limit, whatever they hold.
func TestCheckCursor(t *testing.T) {
	for _, tc := range []struct {
		cursor string
		ok     bool
	}{
		{"", true},
		{"12345", true},
		{strings.Repeat("9", maxCursorLength), true},
		{strings.Repeat("x", maxCursorLength), true},
		{strings.Repeat("9", maxCursorLength+1), false},
		{strings.Repeat("x", maxCursorLength+1), false},
		{strings.Repeat("9", 1<<20), false},
	} {
		err := checkCursor(tc.cursor)
		if (err == nil) != tc.ok {
			t.Errorf("checkCursor(%d bytes): %v, want ok %v", len(tc.cursor), err, tc.ok)
		}
		if err != nil && !strings.Contains(err.Error(), "limit is 64") {
			t.Errorf("checkCursor(%d bytes): %v, want the limit named", len(tc.cursor), err)
		}
	}
}
