package streamstore

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// benchProducers is how many producers the stream of the producer
// benchmarks has already seen: a public stream written by one producer id
// per device or per serverless instance.
const benchProducers = 10_000

// BenchmarkProducerAppendEngine measures an append by one producer on a
// stream that has seen benchProducers producers, through the engine over
// an in-memory store that uploads the WAL at once: what it costs beyond
// the WAL is the stream's producer state.
func BenchmarkProducerAppendEngine(b *testing.B) {
	ctx := context.Background()
	e := New(memstore.New(), Config{NodeID: "bench", FlushInterval: time.Nanosecond, CompactInterval: time.Hour}, nil)
	if err := e.Start(ctx); err != nil {
		b.Fatal(err)
	}
	defer e.Close(ctx)
	const name = "/bench/producers"
	if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
		b.Fatal(err)
	}
	// Concurrent, so that group commit batches them: the set-up is not
	// what is measured.
	const workers = 32
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			for i := w; i < benchProducers; i += workers {
				req := AppendRequest{Records: recs("x"), Producer: &Producer{ID: fmt.Sprintf("device-%05d", i)}}
				if _, err := e.Append(ctx, name, req); err != nil {
					errs <- fmt.Errorf("producer %d: %w", i, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		b.Fatal(err)
	}
	b.ReportAllocs()
	seq := uint64(0)
	for b.Loop() {
		req := AppendRequest{Records: recs("y"), Producer: &Producer{ID: "device-00000", Seq: seq + 1}}
		if _, err := e.Append(ctx, name, req); err != nil {
			b.Fatalf("append seq %d: %v", seq+1, err)
		}
		seq++
	}
}

// BenchmarkProducerApplyState measures what one producer append does to
// the writer state of a stream that has seen benchProducers producers: the
// pending state applies it, then the durable one, as a commit does; a
// replay applies each entry once in the same way.
func BenchmarkProducerApplyState(b *testing.B) {
	var durable writerState
	for i := range benchProducers {
		durable.apply(change{First: uint64(i), End: uint64(i + 1),
			Producer: &segment.ProducerState{ID: fmt.Sprintf("device-%05d", i)}})
	}
	b.ReportAllocs()
	seq := uint64(0)
	for b.Loop() {
		seq++
		c := change{First: durable.NextSeq, End: durable.NextSeq + 1,
			Producer: &segment.ProducerState{ID: "device-00000", Seq: seq}}
		pend := durable
		pend.apply(c)
		durable.apply(c)
	}
}
