package integration

import (
	"bytes"
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestReadRacingATrimmingCompaction: a reader has looked up where its
// records are and its GET is slow; meanwhile a trim and the compaction
// that applies it rewrite or delete the object. Through Caddy on
// versitygw, with the reader's GET parked at the proxy and the compaction
// started by a reload that shortens compact_interval.
//
// A reader of retained records in a large append's blob that the trim cut
// into used to get 500 (the blob was deleted, its records rewritten into a
// data object the reader never looked for); it now gets them. A reader of
// records the trim took, whose WAL object was retired under it, used to
// get 500 ("no data object holds seq"); it is now told they are gone (410).
func TestReadRacingATrimmingCompaction(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	big := func(c byte) []byte { return bytes.Repeat([]byte{c}, 100<<10) }
	for _, tc := range []struct {
		name    string
		records [][]byte // one append: three of 100 KiB make a blob
		trimTo  int
		early   bool   // trimmed before the read, not while it waits
		from    int    // where the read starts
		held    string // key prefix of the reader's parked GET
		gone    string // prefix the compaction empties
		status  int
		want    []byte
	}{
		{"retained records of a trimmed blob", [][]byte{big('a'), big('b'), big('c')}, 1, true, 1, "blob/", "blob/", 200, append(big('b'), big('c')...)},
		{"records trimmed while the reader waits", [][]byte{[]byte("a"), []byte("b"), []byte("c")}, 2, false, 1, "wal/", "wal/", 410, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := picoStart(t, []string{"compact_interval 1h"}, nil)
			const path = "/pico/race/r"
			picoWant(t, "create", picoDo(e, "PUT", path, nil), 201)
			var batch []picoNewRecord
			for _, r := range tc.records {
				batch = append(batch, picoNewRecord{body: r})
			}
			picoWant(t, "append", picoDo(e, "POST", path, picoEncodeBinary(batch), "Content-Type", picoBinaryBatch), 200)
			trim := func() {
				picoWant(t, "trim", picoDo(e, "POST", path, nil, "Pico-Trim-Seq", strconv.Itoa(tc.trimTo)), 200)
			}
			if tc.early {
				trim()
			}
			// Restarted, nothing is cached: the reader fetches.
			e.caddy.Restart()

			release := e.proxy.Hold(testenv.Fault{Op: testenv.OpGet, KeyContains: tc.held, Times: 1})
			defer release()
			read := make(chan fhResp, 1)
			go func() {
				resp, err := e.send(fhReq{Method: "GET", Path: fmt.Sprintf("%s?seq=%d&format=raw", path, tc.from)})
				if err != nil {
					t.Errorf("read: %v", err)
				}
				read <- resp
			}()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := e.proxy.WaitHeld(ctx, 1); err != nil {
				t.Fatalf("the reader's GET never reached the proxy: %v", err)
			}
			if !tc.early {
				trim()
			}
			cf := e.caddy.Caddyfile()
			if err := e.reload(strings.ReplaceAll(cf, "compact_interval 1h", "compact_interval 200ms")); err != nil {
				t.Fatal(err)
			}
			err := e.waitGone(tc.gone)
			if err != nil {
				t.Fatalf("the compaction did not apply the trim: %v", err)
			}
			release()
			resp := <-read
			if resp.Status != tc.status {
				t.Fatalf("read from %d after the compaction removed what it had looked up: %s, want %d", tc.from, resp, tc.status)
			}
			if tc.status == 200 && !bytes.Equal(resp.Body, tc.want) {
				t.Fatalf("read %d bytes, want the %d retained", len(resp.Body), len(tc.want))
			}
		})
	}
}
