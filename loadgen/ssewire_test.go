package loadgen

import (
	"bytes"
	"io"
	"strings"
	"testing"
	"time"
)

func TestBodyDecoder(t *testing.T) {
	tests := []struct {
		name    string
		dec     bodyDecoder
		wire    string
		body    string
		end     bool
		wantErr string
	}{
		{name: "chunked", dec: bodyDecoder{chunked: true},
			wire: "5\r\nhello\r\n1;ext=1\r\n \r\nC\r\nworld, again\r\n0\r\nTrailer: x\r\n\r\n", body: "hello world, again", end: true},
		{name: "chunked, bare LF", dec: bodyDecoder{chunked: true}, wire: "3\nabc\n0\n\n", body: "abc", end: true},
		{name: "chunked, not over yet", dec: bodyDecoder{chunked: true}, wire: "3\r\nabc\r\n4\r\nde", body: "abcde"},
		{name: "sized", dec: bodyDecoder{sized: true, remain: 4}, wire: "abcdef", body: "abcd", end: true},
		{name: "to EOF", wire: "anything at all", body: "anything at all"},
		{name: "bad size", dec: bodyDecoder{chunked: true}, wire: "zz\r\n", wantErr: "bad chunk size"},
		{name: "data past its size", dec: bodyDecoder{chunked: true}, wire: "2\r\nabc\r\n", wantErr: "longer than its chunk size"},
		{name: "endless size line", dec: bodyDecoder{chunked: true}, wire: strings.Repeat("1", 5000), wantErr: "line too long"},
	}
	for _, tt := range tests {
		// Every way of cutting the wire bytes in two reads decodes the same.
		for cut := 0; cut <= len(tt.wire); cut++ {
			d := tt.dec
			var got []byte
			out := func(p []byte) error { got = append(got, p...); return nil }
			end, err := d.decode([]byte(tt.wire[:cut]), out)
			if err == nil && !end {
				end, err = d.decode([]byte(tt.wire[cut:]), out)
			}
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("%s, cut at %d: error %v, want %q", tt.name, cut, err, tt.wantErr)
				}
				continue
			}
			if err != nil || end != tt.end || string(got) != tt.body {
				t.Fatalf("%s, cut at %d: body %q end %v err %v; want %q end %v", tt.name, cut, got, end, err, tt.body, tt.end)
			}
		}
	}
}

func TestBodyDecoderEOF(t *testing.T) {
	for _, tt := range []struct {
		dec     bodyDecoder
		wantErr bool
	}{
		{bodyDecoder{}, false},
		{bodyDecoder{chunked: true}, true},
		{bodyDecoder{sized: true, remain: 3}, true},
	} {
		if err := tt.dec.eof(io.EOF); (err != nil) != tt.wantErr {
			t.Errorf("%+v: eof gives %v", tt.dec, err)
		}
	}
	if err := (&bodyDecoder{}).eof(io.ErrUnexpectedEOF); err != io.ErrUnexpectedEOF {
		t.Errorf("a read error is kept: %v", err)
	}
}

// A feed's body arrives in arbitrary pieces; the lines and events come out
// whole whatever the cuts, CRLF or LF; in either protocol.
func TestRawFeedLines(t *testing.T) {
	tests := []struct {
		pico bool
		wire string
	}{
		{false, "event: data\r\ndata: #1# and #2#\r\n\r\nevent: control\ndata: {\"streamNextOffset\":\"42\"}\n\n"},
		{true, "event: data\r\nid: 42\r\ndata:[{\"seq\":40,\"body\":\"#1#\"},{\"seq\":41,\"body\":\"#2#\"}]\r\n\r\n" +
			"event: control\nid: 42\ndata:{\"next_seq\":42,\"up_to_date\":true}\n\n"},
	}
	for _, tt := range tests {
		for cut := 0; cut <= len(tt.wire); cut++ {
			s := &subscriber{base: time.Now(), maxSeq: 10, pico: tt.pico}
			f := &rawFeed{s: s}
			for _, part := range [][]byte{[]byte(tt.wire[:cut]), []byte(tt.wire[cut:])} {
				if err := f.lines(bytes.Clone(part)); err != nil {
					t.Fatalf("pico %v, cut at %d: %v", tt.pico, cut, err)
				}
			}
			if s.count.Load() != 2 || s.next != "42" || len(s.line) != 0 {
				t.Fatalf("pico %v, cut at %d: %d records, next %q, %q left over", tt.pico, cut, s.count.Load(), s.next, s.line)
			}
		}
	}
}
