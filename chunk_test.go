package picomq

import (
	"bytes"
	"errors"
	"net/http"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/picomq/caddy-picomq/streamstore"
)

// readResult fakes an engine read of bodies starting at seq first, on a
// stream whose tail is tail.
func readResult(ct string, first, tail uint64, closed bool, bodies ...string) streamstore.ReadResult {
	res := streamstore.ReadResult{Info: streamstore.Info{ID: "id1", ContentType: ct, NextSeq: tail, Closed: closed}}
	for i, b := range bodies {
		res.Records = append(res.Records, streamstore.Record{Seq: first + uint64(i), Body: []byte(b)})
	}
	res.NextSeq = first + uint64(len(bodies))
	res.UpToDate = res.NextSeq == tail
	return res
}

func TestAssembleWholeRecords(t *testing.T) {
	c, err := assemble(readResult("text/plain", 0, 3, false, "ab", "cd", "ef"), position{}, 100)
	if err != nil {
		t.Fatal(err)
	}
	if string(c.bytes()) != "abcdef" || c.next != (position{3, 0}) || !c.upToDate || c.closed || !c.hasData() {
		t.Errorf("%+v", c)
	}
	// Up to date: "u" (a revalidation must be able to replace the flag).
	want := `"id1:` + position{}.String() + ":" + position{3, 0}.String() + `:u"`
	if c.etag() != want {
		t.Errorf("etag %s", c.etag())
	}
}

func TestAssembleClosedAtTail(t *testing.T) {
	c, err := assemble(readResult("text/plain", 2, 3, true, "ef"), position{2, 0}, 100)
	if err != nil || !c.closed || !c.upToDate || !strings.HasSuffix(c.etag(), `:c"`) {
		t.Errorf("%+v %v", c, err)
	}
	// The same bytes as a partial read carry no EOF signal.
	c, err = assemble(readResult("text/plain", 1, 3, true, "cd", "ef"), position{1, 0}, 2)
	if err != nil || c.closed || c.upToDate || string(c.bytes()) != "cd" || c.next != (position{2, 0}) {
		t.Errorf("partial: %+v %v", c, err)
	}
	// An empty read at the tail of a closed stream is the EOF answer.
	c, err = assemble(readResult("text/plain", 3, 3, true), position{3, 0}, 10)
	if err != nil || !c.closed || !c.upToDate || c.hasData() || c.next != (position{3, 0}) {
		t.Errorf("eof: %+v %v", c, err)
	}
}

func TestAssembleStopsBeforeARecordThatDoesNotFit(t *testing.T) {
	c, err := assemble(readResult("application/octet-stream", 0, 3, false, "aaaa", "bbbb", "cc"), position{}, 6)
	if err != nil || string(c.bytes()) != "aaaa" || c.next != (position{1, 0}) || c.upToDate {
		t.Errorf("%+v %v", c, err)
	}
}

func TestAssembleSplitsALargeRecord(t *testing.T) {
	big := strings.Repeat("x", 25)
	var got []byte
	pos := position{}
	for i := 0; i < 10; i++ {
		var res streamstore.ReadResult
		if pos.seq == 0 {
			res = readResult("application/octet-stream", 0, 2, false, big, "tail")
		} else {
			res = readResult("application/octet-stream", pos.seq, 2, false, "tail"[:4])
		}
		c, err := assemble(res, pos, 10)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, c.bytes()...)
		if !c.hasData() {
			t.Fatalf("no progress at %v", pos)
		}
		pos = c.next
		if c.upToDate {
			break
		}
	}
	if string(got) != big+"tail" || pos != (position{2, 0}) {
		t.Errorf("got %q ending at %v", got, pos)
	}
}

func TestAssembleTextSplitsAtRuneBoundary(t *testing.T) {
	text := strings.Repeat("é€😀", 50) // 2-, 3- and 4-byte runes
	var got []byte
	pos := position{}
	for i := 0; i < 100 && !(pos.seq == 1); i++ {
		c, err := assemble(readResult("text/plain; charset=utf-8", 0, 1, false, text), pos, 7)
		if err != nil {
			t.Fatal(err)
		}
		if !utf8.Valid(c.bytes()) {
			t.Fatalf("chunk %q at %v is not valid UTF-8", c.bytes(), pos)
		}
		got = append(got, c.bytes()...)
		pos = c.next
	}
	if string(got) != text {
		t.Errorf("reassembled text differs")
	}
}

func TestRuneCutNeverReturnsZero(t *testing.T) {
	junk := bytes.Repeat([]byte{0x80}, 10) // continuation bytes only
	if got := runeCut(junk, 5); got != 5 {
		t.Errorf("runeCut on junk = %d", got)
	}
	if got := runeCut([]byte("a€"), 2); got != 1 {
		t.Errorf("runeCut inside € = %d", got)
	}
}

func TestAssembleJSON(t *testing.T) {
	c, err := assemble(readResult("application/json", 0, 3, false, `{"a":1}`, `[1,2]`, `"s"`), position{}, 100)
	if err != nil || string(c.payload()) != `[{"a":1},[1,2],"s"]` || !c.upToDate {
		t.Errorf("%s %+v %v", c.payload(), c, err)
	}
	// Never split: a message larger than the limit comes whole, alone.
	c, err = assemble(readResult("application/json", 0, 2, false, `"`+strings.Repeat("x", 50)+`"`, `1`), position{}, 10)
	if err != nil || len(c.msgs) != 1 || c.next != (position{1, 0}) || c.upToDate {
		t.Errorf("large: %+v %v", c, err)
	}
	c, err = assemble(readResult("application/json", 2, 2, false), position{2, 0}, 10)
	if err != nil || string(c.payload()) != `[]` || !c.upToDate || c.hasData() {
		t.Errorf("empty: %s %+v %v", c.payload(), c, err)
	}
	if _, err := assemble(readResult("application/json", 0, 2, false, `1`, `2`), position{0, 1}, 10); err == nil {
		t.Error("an offset inside a JSON message was accepted")
	}
}

func TestAssembleRejectsOffsetsPastTheData(t *testing.T) {
	var oe *offsetError
	for _, tc := range []struct {
		res  streamstore.ReadResult
		from position
	}{
		{readResult("text/plain", 3, 3, false), position{4, 0}},
		{readResult("text/plain", 3, 3, false), position{3, 1}},
		{readResult("text/plain", 1, 2, false, "abc"), position{1, 99}},
	} {
		if _, err := assemble(tc.res, tc.from, 10); !errors.As(err, &oe) {
			t.Errorf("from %v: err = %v", tc.from, err)
		}
	}
	// The end of a record reads on from the next one (a fork cut inside a
	// source record ends that record there).
	c, err := assemble(readResult("text/plain", 1, 3, false, "abc", "de"), position{1, 3}, 10)
	if err != nil || string(c.bytes()) != "de" || c.start != (position{2, 0}) || c.next != (position{3, 0}) {
		t.Errorf("end of record: %+v %v", c, err)
	}
	c, err = assemble(readResult("text/plain", 1, 2, false, "abc"), position{1, 3}, 10)
	if err != nil || c.hasData() || !c.upToDate || c.next != (position{2, 0}) {
		t.Errorf("end of the last record: %+v %v", c, err)
	}
	// A byte offset inside a record resumes there.
	c, err = assemble(readResult("text/plain", 1, 2, false, "abc"), position{1, 2}, 10)
	if err != nil || string(c.bytes()) != "c" || c.next != (position{2, 0}) {
		t.Errorf("mid-record: %+v %v", c, err)
	}
}

func TestETagMatches(t *testing.T) {
	tag := `"id:1:2"`
	for h, want := range map[string]bool{
		"": false, tag: true, `W/` + tag: true, `"x", ` + tag: true, "*": true, `"id:1:2:c"`: false, `"wrong-etag"`: false,
	} {
		if etagMatches(h, tag) != want {
			t.Errorf("If-None-Match %q: want %v", h, want)
		}
	}
	// Over several lines, as one list (RFC 9110 section 5.3).
	for _, tc := range []struct {
		lines []string
		want  bool
	}{
		{nil, false},
		{[]string{`"x"`, tag}, true},
		{[]string{`"x"`, `"y", W/` + tag}, true},
		{[]string{`"x"`, "*"}, true},
		{[]string{`"x"`, `"id:1:2:c"`}, false},
	} {
		h := http.Header{}
		for _, v := range tc.lines {
			h.Add("If-None-Match", v)
		}
		if got := etagMatches(ifNoneMatch(h), tag); got != tc.want {
			t.Errorf("If-None-Match lines %q: match %v, want %v", tc.lines, got, tc.want)
		}
	}
}

// countingWriter records the size of every write.
type countingWriter struct {
	bytes.Buffer
	writes []int
}

func (w *countingWriter) Write(p []byte) (int, error) {
	w.writes = append(w.writes, len(p))
	return w.Buffer.Write(p)
}

// writeBody writes the parts in order, gathering small ones so that a
// chunk of many small records is a few large writes.
func TestChunkWriteBody(t *testing.T) {
	small := func(n, size int) [][]byte {
		var ps [][]byte
		for i := 0; i < n; i++ {
			ps = append(ps, bytes.Repeat([]byte{byte('a' + i%26)}, size))
		}
		return ps
	}
	big := bytes.Repeat([]byte("B"), 100<<10)
	tests := []struct {
		name      string
		parts     [][]byte
		maxWrites int
	}{
		{"nothing", nil, 0},
		{"one small", small(1, 10), 1},
		{"1,024 records of 1 KiB", small(1024, 1<<10), 17},
		{"one large", [][]byte{big}, 1},
		{"small, large, small", append(append(small(3, 100), big), small(3, 100)...), 3},
		{"just under the gathering size", small(10, joinBelow-1), 10},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := chunk{}
			var want []byte
			for _, p := range tt.parts {
				c.add(p)
				want = append(want, p...)
			}
			var w countingWriter
			if err := c.writeBody(&w); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(w.Bytes(), want) || c.size != len(want) {
				t.Fatalf("wrote %d bytes (size %d), want %d, same order", w.Len(), c.size, len(want))
			}
			if len(w.writes) > tt.maxWrites {
				t.Errorf("%d writes %v, want at most %d", len(w.writes), w.writes, tt.maxWrites)
			}
			if !bytes.Equal(c.bytes(), want) {
				t.Error("bytes() differs from what was written")
			}
		})
	}
}
