package streamstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

// heldGet parks the first GET of a key with prefix, once armed, until
// release: a reader that looked its records up and is slow to fetch them.
type heldGet struct {
	mu      sync.Mutex
	prefix  string
	held    chan struct{} // closed when the GET is parked
	release chan struct{}
}

func (h *heldGet) arm(prefix string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.prefix, h.held, h.release = prefix, make(chan struct{}), make(chan struct{})
}

func (h *heldGet) hook(op, key string) error {
	h.mu.Lock()
	park := h.prefix != "" && op == "GET" && strings.HasPrefix(key, h.prefix)
	held, release := h.held, h.release
	if park {
		h.prefix = ""
	}
	h.mu.Unlock()
	if park {
		close(held)
		<-release
	}
	return nil
}

// TestReadRacingATrimmingCompaction: a reader finds where its records are,
// and before its GET a compaction that applies a trim rewrites or removes
// the object they were in. A reader of a record still retained must get it
// (a large append's blob that the trim cut into is rewritten as a data
// object without the trimmed records, and the blob deleted at once; the
// read of the blob used to fail with a 500); a reader of a record the trim
// took must be told it is gone (410), not that the bucket lost data.
func TestReadRacingATrimmingCompaction(t *testing.T) {
	big := func(c byte) string { return string(bytes.Repeat([]byte{c}, 100<<10)) }
	for _, tc := range []struct {
		name    string
		records []string // one append: three of 100 KiB make a blob
		trimTo  uint64
		early   bool   // trimmed before the read begins, not while it waits
		from    uint64 // where the read starts
		held    string // the key prefix whose GET the reader waits on
		want    []string
		wantErr error
	}{
		{"retained records of a blob the trim cut into", []string{big('a'), big('b'), big('c')}, 1, true, 1, "blob/", []string{big('b'), big('c')}, nil},
		{"records trimmed while the reader waits", []string{"a", "b", "c"}, 2, false, 0, "wal/", nil, ErrGone},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			h := &heldGet{}
			st.SetFail(h.hook)
			e := startEngine(t, st, Config{})
			if _, _, err := e.Create(ctx, "/r", CreateRequest{ContentType: "text/plain"}); err != nil {
				t.Fatal(err)
			}
			mustAppend(t, e, "/r", AppendRequest{Records: recs(tc.records...)})
			if tc.early {
				if _, err := e.Trim(ctx, "/r", tc.trimTo); err != nil {
					t.Fatal(err)
				}
			}
			// A restart: nothing cached, so the reader fetches.
			if err := e.Close(ctx); err != nil {
				t.Fatal(err)
			}
			e = startEngine(t, st, Config{})

			h.arm(tc.held)
			type result struct {
				res ReadResult
				err error
			}
			done := make(chan result, 1)
			go func() {
				res, err := e.Read(ctx, "/r", ReadRequest{Seq: tc.from})
				done <- result{res, err}
			}()
			<-h.held
			if !tc.early {
				if _, err := e.Trim(ctx, "/r", tc.trimTo); err != nil {
					t.Fatal(err)
				}
			}
			mustCompact(t, e)
			close(h.release)
			r := <-done
			defer r.res.Release()
			if tc.wantErr != nil {
				if !errors.Is(r.err, tc.wantErr) {
					t.Fatalf("read from %d: %v, want %v", tc.from, r.err, tc.wantErr)
				}
				return
			}
			if r.err != nil {
				t.Fatalf("read from %d: %v", tc.from, r.err)
			}
			var got []string
			for _, rec := range r.res.Records {
				got = append(got, string(rec.Body))
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("read from %d got %d records, want %d", tc.from, len(got), len(tc.want))
			}
		})
	}
}
