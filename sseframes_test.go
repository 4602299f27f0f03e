package picomq

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/streamstore"
)

// The hand-written control event must carry the JSON encoding/json gives.
func TestAppendSSEControlMatchesJSON(t *testing.T) {
	tests := []sseControl{
		{StreamNextOffset: "0000000000000000_0000000000000000"},
		{StreamNextOffset: "12_3", StreamCursor: "1790000000", UpToDate: true},
		{StreamNextOffset: "12_3", UpToDate: true, StreamClosed: true},
		{StreamNextOffset: `we"ird\` + "\x01\n", StreamCursor: "ünï"},
	}
	for _, c := range tests {
		got := appendSSEControl(nil, c)
		payload, err := json.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		want := appendSSEEvent(nil, "control", payload)
		// encoding/json may escape differently (\u000a for \n); compare
		// what a client decodes.
		gotPayload := strings.TrimSuffix(strings.TrimPrefix(string(got), "event: control\ndata:"), "\n\n")
		var back sseControl
		if err := json.Unmarshal([]byte(gotPayload), &back); err != nil {
			t.Fatalf("%+v: control event %q is not JSON: %v", c, got, err)
		}
		if back != c {
			t.Errorf("control event %q decodes to %+v, want %+v", got, back, c)
		}
		if !strings.ContainsAny(c.StreamNextOffset+c.StreamCursor, "\"\\\x01\n") && string(got) != string(want) {
			t.Errorf("control event %q, encoding/json gives %q", got, want)
		}
	}
}

// A base64 data event splits into decodable lines and carries the bytes.
func TestAppendSSEBase64Lines(t *testing.T) {
	data := bytes.Repeat([]byte{0, 1, 2, 0xff, '\n'}, 2000) // 10,000 bytes: 3 lines
	ev := appendSSEBase64([]byte("prefix"), data)
	if !bytes.HasPrefix(ev, []byte("prefixevent: data\n")) || !bytes.HasSuffix(ev, []byte("\n\n")) {
		t.Fatalf("event framing wrong: %q...%q", ev[:30], ev[len(ev)-10:])
	}
	sc := bufio.NewScanner(bytes.NewReader(ev[len("prefixevent: data\n"):]))
	sc.Buffer(nil, 1<<20)
	var joined string
	lines := 0
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data:")
		if !ok {
			continue
		}
		if len(line) > base64LineLen {
			t.Errorf("line of %d characters", len(line))
		}
		joined += line
		lines++
	}
	if lines != 4 { // 13,336 characters in lines of 4,096
		t.Errorf("%d data lines, want 4", lines)
	}
	got, err := base64.StdEncoding.DecodeString(joined)
	if err != nil || !bytes.Equal(got, data) {
		t.Errorf("decoded bytes differ (%v)", err)
	}
}

func TestFrameCache(t *testing.T) {
	now := time.Now()
	key := frameKey{id: "s1", start: position{seq: 5}}
	frame := func(next, tail uint64, upToDate bool, made time.Time) *sseFrame {
		return &sseFrame{id: "s1", start: position{seq: 5}, next: position{seq: next}, tail: tail, upToDate: upToDate, data: []byte("event: data\ndata:x\n\n"), made: made}
	}
	tests := []struct {
		name  string
		put   *sseFrame
		key   frameKey
		tail  uint64 // what the asking feed knows
		at    time.Time
		found bool
	}{
		{"same tail", frame(7, 7, true, now), key, 7, now, true},
		{"frame reaches further", frame(9, 9, true, now), key, 7, now, true},
		{"feed knows a later tail", frame(7, 7, true, now), key, 8, now, false},
		{"cut by the chunk limit", frame(6, 9, false, now), key, 12, now, true},
		{"too old", frame(7, 7, true, now), key, 7, now.Add(frameMaxAge + time.Millisecond), false},
		{"other position", frame(7, 7, true, now), frameKey{id: "s1", start: position{seq: 6}}, 7, now, false},
		{"other stream", frame(7, 7, true, now), frameKey{id: "s2", start: position{seq: 5}}, 7, now, false},
		{"other encoding", frame(7, 7, true, now), frameKey{id: "s1", start: position{seq: 5}, enc: sseBase64}, 7, now, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var fc frameCache
			fc.put(key, tt.put)
			got := fc.get(tt.key, tt.tail, tt.at)
			if (got != nil) != tt.found {
				t.Fatalf("found %v, want %v", got != nil, tt.found)
			}
			if got != nil && got != tt.put {
				t.Fatal("got another frame than the one put")
			}
		})
	}
}

func TestFrameCacheBounds(t *testing.T) {
	var fc frameCache
	now := time.Now()
	big := bytes.Repeat([]byte("x"), frameMaxBytes/8)
	for i := 0; i < 20; i++ {
		fc.put(frameKey{id: "s", start: position{seq: uint64(i)}}, &sseFrame{data: big, made: now})
	}
	if fc.bytes > frameMaxBytes || len(fc.m) != 8 || len(fc.order) != 8 {
		t.Fatalf("bytes %d, %d frames, %d in order; want at most %d bytes in 8", fc.bytes, len(fc.m), len(fc.order), frameMaxBytes)
	}
	if fc.get(frameKey{id: "s", start: position{seq: 19}}, 0, now) == nil || fc.get(frameKey{id: "s", start: position{seq: 11}}, 0, now) != nil {
		t.Fatal("eviction is not oldest first")
	}
	for i := 0; i < 3*frameMaxCount; i++ {
		fc.put(frameKey{id: "t", start: position{seq: uint64(i)}}, &sseFrame{data: []byte("d"), made: now})
	}
	if len(fc.m) > frameMaxCount || len(fc.order) != len(fc.m) {
		t.Fatalf("%d frames, %d in order; want at most %d", len(fc.m), len(fc.order), frameMaxCount)
	}
	// A frame from over a second ago leaves when a new one comes.
	fc.put(frameKey{id: "u"}, &sseFrame{data: []byte("d"), made: now.Add(2 * frameMaxAge)})
	if len(fc.m) != 1 {
		t.Fatalf("%d frames after the old ones expired, want 1", len(fc.m))
	}
	// Frames with nothing to share are not kept.
	fc.put(frameKey{id: "v"}, &sseFrame{made: now.Add(2 * frameMaxAge)})
	if fc.get(frameKey{id: "v"}, 0, now.Add(2*frameMaxAge)) != nil {
		t.Fatal("an empty frame was kept")
	}
}

// frameFromChunk encodes each kind of stream the way a feed writes it.
func TestFrameFromChunk(t *testing.T) {
	info := streamstore.Info{ID: "s1", NextSeq: 3}
	tests := []struct {
		name string
		enc  sseEncoding
		c    chunk
		want string
	}{
		{"text", sseText, chunk{info: info, next: position{seq: 3}, parts: [][]byte{[]byte("a\n"), []byte("b")}, size: 3, upToDate: true}, "event: data\ndata:a\ndata:b\n\n"},
		{"json", sseJSON, chunk{info: info, next: position{seq: 2}, json: true, msgs: [][]byte{[]byte(`1`), []byte(`{"a":2}`)}}, "event: data\ndata:[1,{\"a\":2}]\n\n"},
		{"base64", sseBase64, chunk{info: info, next: position{seq: 1}, parts: [][]byte{{0, 1, 2}}, size: 3}, "event: data\ndata:AAEC\n\n"},
		{"nothing new", sseText, chunk{info: info, upToDate: true}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := frameFromChunk(tt.c, tt.enc, time.Now())
			if string(f.data) != tt.want {
				t.Errorf("data %q, want %q", f.data, tt.want)
			}
			if f.id != "s1" || f.tail != 3 || f.next != tt.c.next || f.upToDate != tt.c.upToDate {
				t.Errorf("frame %+v does not describe the chunk", f)
			}
		})
	}
}

// Frames leave once they are too old to share even when no frame comes
// after them: eviction ran only when a frame was added, so after a burst
// of fan-out the cache held up to its 8 MiB of frames, of streams perhaps
// deleted since, for as long as the handler saw no other SSE feed.
func TestFrameCacheEmptiesWhenIdle(t *testing.T) {
	var fc frameCache
	fc.put(frameKey{id: "s"}, &sseFrame{data: bytes.Repeat([]byte("x"), 1<<20), made: time.Now()})
	deadline := time.Now().Add(10 * frameMaxAge)
	for {
		fc.mu.Lock()
		n, b, order := len(fc.m), fc.bytes, fc.order
		fc.mu.Unlock()
		if n == 0 && b == 0 && order == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d frames (%d bytes) still cached %v after the last was made", n, b, 10*frameMaxAge)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
