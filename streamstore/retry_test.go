package streamstore

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// heldUpload is a store that can hold the next WAL upload until told how
// it ends.
type heldUpload struct {
	*memstore.Store
	mu    sync.Mutex
	armed bool
	held  chan struct{}
	fail  chan bool // true: the held upload fails; false: it lands
}

func (h *heldUpload) holdNext() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.armed = true
}

func (h *heldUpload) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	h.mu.Lock()
	hold := h.armed && strings.HasPrefix(key, "wal/")
	h.armed = h.armed && !hold
	h.mu.Unlock()
	if hold {
		close(h.held)
		if <-h.fail {
			return "", errors.New("held upload failed")
		}
	}
	return h.Store.Put(ctx, key, data, opts)
}

// A change whose first attempt was not confirmed in time is still on its
// way, and can be rolled back: a repeat of it must not be answered from
// that pending state. A repeated trim and a repeated close were answered
// success at once, and when the first attempt's upload then failed, the
// stream was neither trimmed nor closed after all.
func TestRepeatOfUnconfirmedChangeWaitsForIt(t *testing.T) {
	tests := []struct {
		name string
		do   func(e *Engine) error
		// check reports what of the change is visible.
		check func(t *testing.T, e *Engine) bool
	}{
		{"trim", func(e *Engine) error {
			_, err := e.Trim(context.Background(), "/s", 1)
			return err
		}, func(t *testing.T, e *Engine) bool {
			info, err := e.Head(context.Background(), "/s")
			if err != nil {
				t.Fatal(err)
			}
			return info.StartSeq > 0
		}},
		{"close", func(e *Engine) error {
			_, err := e.Append(context.Background(), "/s", AppendRequest{Close: true})
			return err
		}, func(t *testing.T, e *Engine) bool {
			info, err := e.Head(context.Background(), "/s")
			if err != nil {
				t.Fatal(err)
			}
			return info.Closed
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := &heldUpload{Store: memstore.New(), held: make(chan struct{}), fail: make(chan bool, 1)}
			e := startEngine(t, st, Config{AppendTimeout: 50 * time.Millisecond})
			// A test that stops early lets the held upload end, or the
			// engine's close would wait for it.
			t.Cleanup(func() {
				select {
				case st.fail <- true:
				default:
				}
			})
			if _, _, err := e.Create(ctx, "/s", CreateRequest{Records: recs("a", "b")}); err != nil {
				t.Fatal(err)
			}
			st.holdNext()
			if err := tc.do(e); !errors.Is(err, ErrUnconfirmed) {
				t.Fatalf("first attempt: %v, want it unconfirmed", err)
			}
			<-st.held
			// The repeat cannot be confirmed before the held upload's
			// fate is known, so it too runs out of its 50 ms.
			if err := tc.do(e); err == nil {
				t.Fatal("the repeat was answered success while the first attempt was still on its way")
			}
			st.fail <- true
			if tc.check(t, e) {
				t.Fatal("the change shows although its only upload failed")
			}
			// Asked again with the bucket answering, it is done (once
			// the writer has recovered from the failed upload).
			deadline := time.Now().Add(10 * time.Second)
			for err := tc.do(e); err != nil; err = tc.do(e) {
				if time.Now().After(deadline) {
					t.Fatalf("later attempts: %v", err)
				}
				time.Sleep(20 * time.Millisecond)
			}
			if !tc.check(t, e) {
				t.Fatal("the change does not show after it was acknowledged")
			}
			if err := e.Close(ctx); err != nil {
				t.Fatal(err)
			}
			e2 := startEngine(t, st.Store, Config{})
			if !tc.check(t, e2) {
				t.Fatal("the acknowledged change is gone after a restart")
			}
			want, from := []string{"a", "b"}, uint64(0)
			if tc.name == "trim" {
				want, from = want[1:], 1
			}
			res, err := e2.Read(ctx, "/s", ReadRequest{Seq: from})
			if err != nil {
				t.Fatalf("read after a restart: %v", err)
			}
			var got []string
			for _, r := range res.Records {
				got = append(got, string(r.Body))
			}
			if !slices.Equal(got, want) {
				t.Fatalf("after a restart /s reads %q from seq %d, want %q", got, from, want)
			}
		})
	}
}
