package integration

import (
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestPicoRefusedReadsRenewNothing: a read the server refuses, at a seq
// past the tail (400), below the records a trim left (410), or at a
// Durable Streams offset past the end of its record (400), is no access
// to the stream. It makes no object-store write (design invariant 6), even
// when a quarter of a sliding TTL has passed, where a read that is served
// persists its renewal in the WAL (the control at the end, without which
// the test could not tell).
func TestPicoRefusedReadsRenewNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"compact_interval 1h"}, []string{"long_poll_timeout 1s"})
	const (
		path = "/pico/renew/s"
		ttl  = 12 * time.Second
	)
	picoWant(t, "create", picoDo(e, "PUT", path, []byte("r0"), "Content-Type", "text/plain", "Pico-TTL", "12"), 201)
	for _, body := range []string{"r1", "r2"} {
		picoWant(t, "append "+body, picoDo(e, "POST", path, []byte(body), "Content-Type", "text/plain"), 200)
	}
	picoWant(t, "trim", picoDo(e, "POST", path, nil, "Pico-Trim-Seq", "2"), 200, "Pico-Start-Seq", "2")
	lastAccess := time.Now()
	// A renewal is persisted once a quarter of the TTL has passed since
	// the last one (the trim's).
	time.Sleep(ttl/4 + 300*time.Millisecond)

	for _, c := range []struct {
		name, path string
		status     int
	}{
		{"a seq past the tail", path + "?seq=5", 400},
		{"a long-poll past the tail", path + "?seq=5&live=long-poll", 400},
		{"an SSE feed past the tail", path + "?seq=5&live=sse", 400},
		{"a seq below the first retained record", path + "?seq=1", 410},
		{"a Durable Streams read past the tail", "/ds/renew/s?offset=" + picoOffset(5, 0), 400},
		{"a Durable Streams read of trimmed records", "/ds/renew/s?offset=" + picoOffset(1, 0), 410},
		// Refusals the Durable Streams side makes only once it has the
		// stream's tail or the record in hand.
		{"a Durable Streams offset inside the tail", "/ds/renew/s?offset=" + picoOffset(3, 1), 400},
		{"a Durable Streams offset past the end of its record", "/ds/renew/s?offset=" + picoOffset(2, 5), 400},
		{"a Durable Streams long-poll past the end of its record", "/ds/renew/s?live=long-poll&offset=" + picoOffset(2, 5), 400},
		{"a Durable Streams SSE feed past the end of its record", "/ds/renew/s?live=sse&offset=" + picoOffset(2, 5), 400},
	} {
		resp, writes := fhExpectNoWrites(t, e, fhReq{Method: "GET", Path: c.path})
		if resp.Status != c.status {
			t.Errorf("%s: %d %s, want %d", c.name, resp.Status, resp.Body, c.status)
		}
		if len(writes) > 0 {
			t.Errorf("%s: the refused read wrote to the bucket: %s", c.name, fhSortedKeys(writes))
		}
	}
	if since := time.Since(lastAccess); since > ttl*3/4 {
		t.Fatalf("the refused reads took until %s after the last access; the control below needs the stream alive", since)
	}

	// The control: a read that is served renews the TTL and, a quarter of
	// it on, writes the renewal to the WAL.
	before := e.proxy.Counts()
	picoWant(t, "a served read", picoDo(e, "GET", path+"?seq=2&format=raw", nil), 200)
	err := fhWaitFor(5*time.Second, 50*time.Millisecond, func() error {
		for w := range fhWrites(before, e.proxy.Counts()) {
			if strings.Contains(w, "wal/") {
				return nil
			}
		}
		return errors.New("no WAL write")
	})
	if err != nil {
		t.Fatalf("a served read a quarter of the TTL on persisted no renewal, so the test cannot see one: %v", err)
	}
}

// TestRefusedWritesRenewNothing: an append or a trim the server refuses is
// no access to the stream either: a stream with a sliding TTL that gets
// nothing but refused writes expires when its TTL has passed since its
// last real access. Refused writes used to renew it, so a client sending
// nothing but bad appends (a fenced producer's, say) kept it alive.
func TestRefusedWritesRenewNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"compact_interval 1h"}, nil)
	const (
		path = "/pico/renew/w"
		ttl  = 4 * time.Second
	)
	text := []string{"Content-Type", "text/plain"}
	picoWant(t, "create", picoDo(e, "PUT", path, nil, append(text, "Pico-TTL", "4")...), 201)
	picoWant(t, "append", picoDo(e, "POST", path, []byte("r0"), append(text, "Pico-Producer-Id", "p",
		"Pico-Producer-Epoch", "1", "Pico-Producer-Seq", "0")...), 200)
	lastAccess := time.Now()
	time.Sleep(ttl / 4)
	for _, c := range []struct {
		name   string
		method string
		path   string
		header []string
		status int
	}{
		{"a match seq that is not the tail", "POST", path, append(text, "Pico-Match-Seq", "7"), 412},
		{"a producer seq past the next", "POST", path, append(text, "Pico-Producer-Id", "p",
			"Pico-Producer-Epoch", "1", "Pico-Producer-Seq", "5"), 409},
		{"a fenced producer epoch", "POST", path, append(text, "Pico-Producer-Id", "p",
			"Pico-Producer-Epoch", "0", "Pico-Producer-Seq", "0"), 403},
		{"a trim beyond the tail", "POST", path, []string{"Pico-Trim-Seq", "9"}, 400},
		{"a Durable Streams append of another content type", "POST", "/ds/renew/w", []string{"Content-Type", "image/png"}, 409},
		{"a Durable Streams create with If-None-Match: *", "PUT", "/ds/renew/w", append(text, "If-None-Match", "*", "Stream-TTL", "4"), 412},
		{"a Pico create whose body is not the first records", "PUT", path, append(text, "Pico-TTL", "4"), 409},
	} {
		if r := picoDo(e, c.method, c.path, []byte("x"), c.header...); r.Status != c.status {
			t.Errorf("%s: %s, want %d", c.name, r, c.status)
		}
	}
	// Past the TTL since the last access, and well before it since the
	// refused writes.
	time.Sleep(time.Until(lastAccess.Add(ttl + 600*time.Millisecond)))
	if r := picoDo(e, "HEAD", path, nil); r.Status != http.StatusNotFound {
		t.Fatalf("HEAD %v after the last access, with a TTL of %v: %d, want 404 (the refused writes renewed it)",
			time.Since(lastAccess).Round(time.Millisecond), ttl, r.Status)
	}
}
