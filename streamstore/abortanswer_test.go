package streamstore

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// discardHooks takes batch outcomes and does nothing with them.
type discardHooks struct{}

func (discardHooks) Committed(*segment.Batch)      {}
func (discardHooks) Aborted(*segment.Batch, error) {}

// TestAbortedBatchAnswers: an append whose batch the WAL writer aborted
// with its fate unknown to the writer is told what happened, not that the
// storage "did not confirm the write in time". Aborted because the writer
// closed while the store did not answer, it may still be stored: the
// error says the engine closed, with ErrUnconfirmed. Aborted because
// another process took the storage over and sealed this node's WAL where
// the batch was to go, it was not stored: ErrTakenOver, without
// ErrUnconfirmed.
func TestAbortedBatchAnswers(t *testing.T) {
	tests := []struct {
		name string
		// setup readies the store and returns once the writer may be
		// closed with the batch still unsettled.
		setup         func(t *testing.T, st *memstore.Store) (wait func())
		want, notWant []error
	}{
		{
			name: "the writer closed while the store did not answer",
			setup: func(t *testing.T, st *memstore.Store) func() {
				var puts atomic.Int32
				st.SetFail(func(op, key string) error {
					if op == "PUT" && strings.HasPrefix(key, "wal/") {
						puts.Add(1)
						return errors.New("connection reset by peer")
					}
					return nil
				})
				return func() {
					// The upload failed and its seal is being retried.
					for deadline := time.Now().Add(10 * time.Second); puts.Load() < 2; {
						if time.Now().After(deadline) {
							t.Fatal("the writer never tried the upload and the seal")
						}
						time.Sleep(time.Millisecond)
					}
				}
			},
			want:    []error{ErrUnavailable, ErrUnconfirmed, ErrClosedUnconfirmed},
			notWant: []error{ErrTakenOver},
		},
		{
			name: "another process sealed the WAL where the batch was to go",
			setup: func(t *testing.T, st *memstore.Store) func() {
				seal := segment.EncodeSeal(1, 0, "another process")
				if _, err := st.Put(context.Background(), segment.WALKey(1, 0), seal, segment.PutOptions{}); err != nil {
					t.Fatal(err)
				}
				return nil
			},
			want:    []error{ErrUnavailable, ErrTakenOver},
			notWant: []error{ErrUnconfirmed, ErrClosedUnconfirmed},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := startEngine(t, memstore.New(), Config{})
			st := memstore.New()
			wait := tt.setup(t, st)
			w := segment.NewWriter(st, 1, 0, segment.WriterConfig{FlushInterval: time.Millisecond}, segment.WriterDeps{
				Hooks:        discardHooks{},
				Token:        "this process",
				NewNamespace: func(context.Context) (uint64, error) { return 2, nil },
			})
			b, err := w.Add(&segment.Entry{StreamID: "s", Name: "s", Records: []segment.Record{{Body: []byte("x")}}})
			if err != nil {
				t.Fatal(err)
			}
			if wait != nil {
				wait()
				ctx, cancel := context.WithCancel(context.Background())
				cancel()
				_ = w.Close(ctx)
			} else {
				t.Cleanup(func() { _ = w.Close(context.Background()) })
			}
			select {
			case <-b.Done():
			case <-time.After(10 * time.Second):
				t.Fatal("the batch was never settled")
			}
			err = e.awaitBatch(context.Background(), b)
			t.Logf("append's error: %v", err)
			for _, want := range tt.want {
				if !errors.Is(err, want) {
					t.Errorf("append's error %q does not match %q", err, want)
				}
			}
			for _, wrong := range tt.notWant {
				if errors.Is(err, wrong) {
					t.Errorf("append's error %q matches %q", err, wrong)
				}
			}
		})
	}
}
