package integration

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// TestReadForkFromItsOffsetInsideALargeRecord: through Caddy on versitygw,
// a 10 MiB record is read in 4 MiB chunks and forked at the offset the
// second chunk handed out (8 MiB into the record). Read from that fork
// offset, the fork is at the end of its cut record and reads on with its
// own records, in catch-up, long-poll and SSE. The cut part filled the
// engine's read by itself, so the read came back empty and short of the
// tail: catch-up answered an empty 200 that was not up to date, a
// long-poll 500, and an SSE feed ended without an event (a client
// reconnecting at its offset looped for ever).
func TestReadForkFromItsOffsetInsideALargeRecord(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	const src, fork = "/forkoffset/src", "/forkoffset/fork"
	e.create(src, textPlain)
	e.append(src, textPlain, bytes.Repeat([]byte("s"), 10<<20))
	off := "-1"
	for range 2 {
		resp := e.must(fhReq{Method: http.MethodGet, Path: src + "?offset=" + off})
		if resp.Status != http.StatusOK {
			t.Fatalf("GET %s at %s: %s", src, off, resp)
		}
		off = resp.Header.Get("Stream-Next-Offset")
	}
	if want := fmt.Sprintf("%016d_%016d", 0, 8<<20); off != want {
		t.Fatalf("the source's second chunk ends at %s, want %s", off, want)
	}
	resp := e.must(fhReq{Method: http.MethodPut, Path: fork, Header: map[string]string{
		"Content-Type": textPlain, "Stream-Forked-From": src, "Stream-Fork-Offset": off}})
	if resp.Status != http.StatusCreated {
		t.Fatalf("fork at %s: %s, want 201", off, resp)
	}
	e.append(fork, textPlain, []byte("own"))
	tail := fmt.Sprintf("%016d_%016d", 2, 0)

	for _, query := range []string{"", "&live=long-poll"} {
		resp := e.must(fhReq{Method: http.MethodGet, Path: fork + "?offset=" + off + query})
		if resp.Status != http.StatusOK || string(resp.Body) != "own" || resp.Header.Get("Stream-Next-Offset") != tail {
			t.Errorf("GET %s at %s%s: %s to %q; want 200 %q to %s", fork, off, query, resp,
				resp.Header.Get("Stream-Next-Offset"), "own", tail)
		}
	}

	br := openSSE(context.Background(), t, e, fork+"?live=sse&offset="+off)
	var got []string
	for len(got) < 2 {
		ev, err := readSSEEvent(br)
		if err != nil {
			t.Fatalf("SSE from %s: after events %q: %v", off, got, err)
		}
		got = append(got, ev.event+": "+ev.data)
	}
	if got[0] != "data: own" || !strings.Contains(got[1], `"streamNextOffset":"`+tail+`"`) {
		t.Errorf("SSE from %s: events %q, want the fork's own record, then a control event at %s", off, got, tail)
	}
}
