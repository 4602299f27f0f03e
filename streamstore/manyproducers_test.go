package streamstore

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

// TestManyProducersSurviveRestart gives a stream hundreds of producers
// (enough that a structure keeping recent changes apart from the rest
// must have merged them several times), then brings it back in a new
// engine from the WAL, from a pack and from a checkpoint: an early
// producer's retry is still a duplicate, a stale epoch still fenced, and
// a new seq of an early producer still follows on.
func TestManyProducersSurviveRestart(t *testing.T) {
	tests := []struct {
		name      string
		cfg       Config
		compact   string // compact before the restart, into objects under this prefix
		producers int
	}{
		{"replayed from the WAL", Config{}, "", 300},
		// A stream with more is folded, not packed.
		{"from a pack", Config{}, "pack/", packMaxProducers},
		{"from the metadata checkpoint", Config{PackBelow: -1}, "data/", 300},
	}
	for _, tt := range tests {
		producers := tt.producers
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			e := startEngine(t, st, tt.cfg)
			if _, _, err := e.Create(ctx, "/p", CreateRequest{ContentType: "text/plain"}); err != nil {
				t.Fatal(err)
			}
			app := func(e *Engine, id string, epoch, seq uint64) (AppendResult, error) {
				return e.Append(ctx, "/p", AppendRequest{Records: recs(fmt.Sprintf("%s/%d/%d", id, epoch, seq)),
					Producer: &Producer{ID: id, Epoch: epoch, Seq: seq}})
			}
			// Concurrent, so that some batches hold many producers.
			var wg sync.WaitGroup
			errs := make(chan error, producers)
			for i := range producers {
				wg.Go(func() {
					if _, err := app(e, fmt.Sprintf("p%04d", i), 0, 0); err != nil {
						errs <- err
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}
			if _, err := app(e, "p0001", 1, 0); err != nil {
				t.Fatalf("p0001 epoch 1: %v", err)
			}
			if tt.compact != "" {
				if err := e.Compact(ctx); err != nil {
					t.Fatalf("compact: %v", err)
				}
				if keys := st.Keys(tt.compact); len(keys) == 0 {
					t.Fatalf("no %s objects after compaction: %v", tt.compact, st.Keys(""))
				}
			}
			e2 := startEngine(t, st, tt.cfg)
			if r, err := app(e2, "p0000", 0, 0); err != nil || !r.Duplicate {
				t.Fatalf("retry of p0000 seq 0 after the restart: %+v, %v; want a duplicate", r, err)
			}
			var fenced *FencedError
			if _, err := app(e2, "p0001", 0, 1); !errors.As(err, &fenced) || fenced.CurrentEpoch != 1 {
				t.Fatalf("p0001 at its old epoch after the restart: %v; want fenced at epoch 1", err)
			}
			var gap *SequenceGapError
			if _, err := app(e2, fmt.Sprintf("p%04d", producers-1), 0, 2); !errors.As(err, &gap) || gap.Expected != 1 {
				t.Fatalf("the last producer's seq 2 after the restart: %v; want a gap from 1", err)
			}
			if r, err := app(e2, "p0002", 0, 1); err != nil || r.Duplicate {
				t.Fatalf("p0002 seq 1 after the restart: %+v, %v", r, err)
			}
			if got := len(readAll(t, e2, "/p")); got != producers+2 {
				t.Fatalf("%d records after the restart, want %d", got, producers+2)
			}
		})
	}
}
