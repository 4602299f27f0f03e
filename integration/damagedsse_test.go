package integration

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestSSEFeedEndsAtDamagedRecords: an SSE feed, of either protocol, that
// reaches records whose WAL entry is damaged in the bucket gets the records
// before them and then ends, with the reason in an SSE comment that names
// the object (neither protocol has an error event, and the 200 went out
// with the first event); its reconnect from there gets the 500. That holds
// for a feed catching up and for one parked at the tail, in the stream's
// hub, when the damaged records arrive. The feed does not hang, spin or
// skip them, and no feed logs a line of its own (the engine logs the
// damage once). A feed used to end silently, with a warning in the log
// per feed. A Pico read of the range gets the records before the damage,
// then the 500.
func TestSSEFeedEndsAtDamagedRecords(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	// Appends of 6 KiB are never cached in 4 KiB: every read of them goes
	// to the bucket.
	e := picoStart(t, []string{"cache_size 4KiB", "compact_interval 1h"}, nil)
	const ct = "application/octet-stream"
	big := func(c byte) []byte { return bytes.Repeat([]byte{c}, 6<<10) }

	type proto struct {
		name   string
		create func(path string)
		append func(path string, body []byte)
		sse    func(path string, fromStart bool) string // the URL of a feed
		caught string                                   // in the control event that says the feed is at the tail
	}
	protos := []proto{
		{
			name:   "durable streams",
			create: func(p string) { e.create("/ds"+p, ct) },
			append: func(p string, b []byte) { e.append("/ds"+p, ct, b) },
			sse: func(p string, fromStart bool) string {
				if fromStart {
					return "/ds" + p + "?offset=-1&live=sse"
				}
				return "/ds" + p + "?offset=now&live=sse"
			},
			caught: `"upToDate":true`,
		},
		{
			name: "pico",
			create: func(p string) {
				picoWant(t, "create", picoDo(e, http.MethodPut, "/pico"+p, nil, "Content-Type", ct), http.StatusCreated)
			},
			append: func(p string, b []byte) {
				picoWant(t, "append", picoDo(e, http.MethodPost, "/pico"+p, b, "Content-Type", ct), http.StatusOK)
			},
			sse: func(p string, fromStart bool) string {
				if fromStart {
					return "/pico" + p + "?seq=0&live=sse"
				}
				return "/pico" + p + "?seq=now&live=sse"
			},
			caught: `"up_to_date":true`,
		},
	}
	// corrupt flips a byte of the WAL entry of path whose one record is
	// body, straight in the bucket, and returns the object's key. The
	// object is restored when t ends, so that the next case finds its
	// own entry among readable objects.
	corrupt := func(t *testing.T, path string, body []byte) string {
		t.Helper()
		key, ent := fhFindWALEntry(t, e, path, string(body))
		original := bytes.Clone(ent.data)
		ent.data[ent.span.Off+ent.span.Len-2] ^= 0x40
		fhPutRaw(t, e, key, ent.data)
		t.Cleanup(func() { fhPutRaw(t, e, key, original) })
		return key
	}
	// rest reads the feed to its end, which must come.
	rest := func(t *testing.T, br io.Reader) string {
		t.Helper()
		got, err := io.ReadAll(br)
		if err != nil {
			t.Fatalf("the feed did not end at the damage: %v; read %q", err, fhClip(string(got), 600))
		}
		return string(got)
	}
	wantDamageComment := func(t *testing.T, feed, key string) {
		t.Helper()
		var comment string
		for _, line := range strings.Split(feed, "\n") {
			if strings.HasPrefix(line, ":") {
				comment = line
			}
		}
		if !strings.Contains(comment, "damaged") || !strings.Contains(comment, key) {
			t.Errorf("the feed ended without a comment naming the damage and %s; it read:\n%s", key, fhClip(feed, 600))
		}
		if strings.Contains(feed, "xxxx") || strings.Contains(feed, "eHh4") {
			t.Errorf("the feed served damaged bytes:\n%s", fhClip(feed, 600))
		}
	}

	for i, pr := range protos {
		t.Run(pr.name+"/catch-up", func(t *testing.T) {
			path := fmt.Sprintf("/dmgsse/catchup%d", i)
			pr.create(path)
			pr.append(path, []byte("b0;"))
			damaged := big('x')
			pr.append(path, damaged)
			pr.append(path, []byte("b2;"))
			key := corrupt(t, strings.TrimPrefix(path, "/"), damaged)

			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			feed := rest(t, openSSE(ctx, t, e, pr.sse(path, true)))
			if !strings.Contains(feed, "b0;") && !strings.Contains(feed, "YjA7") {
				t.Errorf("the feed did not serve the record before the damage:\n%s", fhClip(feed, 600))
			}
			wantDamageComment(t, feed, key)
		})

		t.Run(pr.name+"/at the tail", func(t *testing.T) {
			path := fmt.Sprintf("/dmgsse/tail%d", i)
			pr.create(path)
			pr.append(path, []byte("b0;"))
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			br := openSSE(ctx, t, e, pr.sse(path, false))
			for {
				ev, err := readSSEEvent(br)
				if err != nil {
					t.Fatalf("the feed ended before it was at the tail: %v", err)
				}
				if ev.event == "control" && strings.Contains(ev.data, pr.caught) {
					break
				}
			}
			// The feed's read of the new record goes to the bucket (it
			// is too large for the cache): hold it there until the
			// entry is damaged.
			release := e.proxy.Hold(testenv.Fault{Op: testenv.OpGet, KeyContains: "wal/"})
			defer release()
			damaged := big('x')
			pr.append(path, damaged)
			if err := e.proxy.WaitHeld(ctx, 1); err != nil {
				t.Fatalf("no read of the new record reached the bucket: %v", err)
			}
			key := corrupt(t, strings.TrimPrefix(path, "/"), damaged)
			release()
			wantDamageComment(t, rest(t, br), key)
		})
	}

	t.Run("pico reads", func(t *testing.T) {
		const path = "/dmgsse/read"
		protos[1].create(path)
		protos[1].append(path, []byte("b0;"))
		damaged := big('x')
		protos[1].append(path, damaged)
		protos[1].append(path, []byte("b2;"))
		key := corrupt(t, strings.TrimPrefix(path, "/"), damaged)
		for _, format := range []string{"", "&format=binary"} {
			r := picoDo(e, http.MethodGet, "/pico"+path+"?seq=0"+format, nil)
			picoWant(t, "a read "+format+" up to the damage", r, http.StatusOK, "Pico-Next-Seq", "1", "Pico-Up-To-Date", "")
			if !bytes.Contains(r.Body, []byte("b0;")) && !bytes.Contains(r.Body, []byte("YjA7")) {
				t.Errorf("a read %s up to the damage: %s", format, r)
			}
			r = picoDo(e, http.MethodGet, "/pico"+path+"?seq=1"+format, nil)
			body := picoWantError(t, "a read "+format+" of the damage", r, http.StatusInternalServerError, "internal")
			if msg, _ := body["message"].(string); !strings.Contains(msg, "damaged") || !strings.Contains(msg, key) {
				t.Errorf("a read %s of the damage: %s; want its message to name the damage and %s", format, r, key)
			}
			r = picoDo(e, http.MethodGet, "/pico"+path+"?seq=2"+format, nil)
			picoWant(t, "a read "+format+" after the damage", r, http.StatusOK, "Pico-Next-Seq", "3")
		}
	})

	logs := e.caddy.Logs()
	if n := strings.Count(logs, "SSE read failed"); n != 0 {
		t.Errorf("%d feeds logged their failed read; the engine logs the damage once", n)
	}
	if n := strings.Count(logs, "WAL entry damaged"); n != 5 {
		t.Errorf("the damage was logged %d times, want once per damaged entry (5)", n)
	}
}
