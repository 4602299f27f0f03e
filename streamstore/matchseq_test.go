package streamstore

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

// An append with MatchSeq is judged against the durable tail, the one
// reads show, not against appends still on their way: one of those may
// roll back, and then a refusal naming its tail named one that never was.
// A MatchSeq between the durable tail and the pending one waits for the
// appends ahead; one the durable tail has passed, or beyond every pending
// append, is refused at once, naming the durable tail.
func TestMatchSeqJudgedOnDurableTail(t *testing.T) {
	aheadLandsOrFails(t, func(t *testing.T, lands bool, e *Engine, st *heldUpload) {
		ctx := context.Background()
		if _, _, err := e.Create(ctx, "/s", CreateRequest{Records: recs("a")}); err != nil {
			t.Fatal(err)
		}
		st.holdNext()
		ahead := make(chan error, 1)
		go func() {
			_, err := e.Append(ctx, "/s", AppendRequest{Records: recs("b")})
			ahead <- err
		}()
		<-st.held
		match := func(seq uint64) (AppendResult, error) {
			return e.Append(ctx, "/s", AppendRequest{Records: recs("c"), MatchSeq: &seq})
		}
		// Certain refusals are answered at once, with the durable tail.
		for _, seq := range []uint64{0, 5} {
			var me *MatchError
			if _, err := match(seq); !errors.As(err, &me) || me.NextSeq != 1 {
				t.Fatalf("MatchSeq %d with tail 1 durable and 2 pending: %v, want a MatchError naming 1", seq, err)
			}
		}
		type result struct {
			res AppendResult
			err error
		}
		matched := make(chan result, 1)
		go func() {
			res, err := match(1)
			matched <- result{res, err}
		}()
		select {
		case r := <-matched:
			t.Fatalf("MatchSeq 1 answered (%+v, %v) while the append that would move the tail is not durable", r.res, r.err)
		case <-time.After(200 * time.Millisecond):
		}
		st.fail <- !lands
		if err := <-ahead; (err == nil) != lands {
			t.Fatalf("the append ahead: %v", err)
		}
		r := <-matched
		var me *MatchError
		switch {
		case lands && (!errors.As(r.err, &me) || me.NextSeq != 2):
			t.Fatalf("MatchSeq 1 once seq 1 is durable: %+v, %v, want a MatchError naming 2", r.res, r.err)
		case !lands && errors.As(r.err, &me):
			t.Fatalf("MatchSeq 1 refused (%v) although the append ahead rolled back", r.err)
		case !lands:
			// Landed now, or refused while the writer recovers from
			// the failed upload: then again it lands at seq 1.
			deadline := time.Now().Add(10 * time.Second)
			for r.err != nil {
				if errors.As(r.err, &me) || time.Now().After(deadline) {
					t.Fatalf("MatchSeq 1 after the append ahead rolled back: %v", r.err)
				}
				time.Sleep(20 * time.Millisecond)
				r.res, r.err = match(1)
			}
			if r.res.FirstSeq != 1 || r.res.NextSeq != 2 {
				t.Fatalf("MatchSeq 1 landed at %d..%d", r.res.FirstSeq, r.res.NextSeq)
			}
		}
		want := []string{"a", "b"}
		if !lands {
			want = []string{"a", "c"}
		}
		if got := readAll(t, e, "/s"); len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
			t.Fatalf("records %q, want %q", got, want)
		}
	})
}

// Stream-Seq is judged the same way: a value only a pending append has
// passed waits for it, and a refusal names the durable value.
func TestStreamSeqJudgedOnDurableValue(t *testing.T) {
	aheadLandsOrFails(t, func(t *testing.T, lands bool, e *Engine, st *heldUpload) {
		ctx := context.Background()
		if _, _, err := e.Create(ctx, "/s", CreateRequest{}); err != nil {
			t.Fatal(err)
		}
		seqd := func(rec, seq string) (AppendResult, error) {
			return e.Append(ctx, "/s", AppendRequest{Records: recs(rec), StreamSeq: seq})
		}
		if _, err := seqd("a", "001"); err != nil {
			t.Fatal(err)
		}
		st.holdNext()
		ahead := make(chan error, 1)
		go func() {
			_, err := seqd("b", "002")
			ahead <- err
		}()
		<-st.held
		if _, err := seqd("x", "001"); !errors.Is(err, ErrStreamSeq) || !strings.Contains(err.Error(), `not after "001"`) {
			t.Fatalf("Stream-Seq 001 with 001 durable and 002 pending: %v, want a refusal naming 001", err)
		}
		type result struct {
			res AppendResult
			err error
		}
		second := make(chan result, 1)
		go func() {
			res, err := seqd("c", "002")
			second <- result{res, err}
		}()
		select {
		case r := <-second:
			t.Fatalf("Stream-Seq 002 answered (%+v, %v) while the append that holds 002 is not durable", r.res, r.err)
		case <-time.After(200 * time.Millisecond):
		}
		st.fail <- !lands
		if err := <-ahead; (err == nil) != lands {
			t.Fatalf("the append ahead: %v", err)
		}
		r := <-second
		switch {
		case lands && (!errors.Is(r.err, ErrStreamSeq) || !strings.Contains(r.err.Error(), `not after "002"`)):
			t.Fatalf("Stream-Seq 002 once 002 is durable: %+v, %v, want a refusal naming 002", r.res, r.err)
		case !lands && errors.Is(r.err, ErrStreamSeq):
			t.Fatalf("Stream-Seq 002 refused (%v) although the append ahead rolled back", r.err)
		case !lands:
			// Landed, or refused while the writer recovers from the
			// failed upload: then again it lands.
			deadline := time.Now().Add(10 * time.Second)
			for r.err != nil {
				if errors.Is(r.err, ErrStreamSeq) || time.Now().After(deadline) {
					t.Fatalf("Stream-Seq 002 after the append ahead rolled back: %v", r.err)
				}
				time.Sleep(20 * time.Millisecond)
				r.res, r.err = seqd("c", "002")
			}
		}
		want := []string{"a", "b"}
		if !lands {
			want = []string{"a", "c"}
		}
		if got := readAll(t, e, "/s"); len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
			t.Fatalf("records %q, want %q", got, want)
		}
	})
}

// aheadLandsOrFails runs test twice, on an engine whose next WAL upload
// the test holds (st.holdNext) and then lets land or fail (st.fail).
func aheadLandsOrFails(t *testing.T, test func(t *testing.T, lands bool, e *Engine, st *heldUpload)) {
	t.Helper()
	for _, lands := range []bool{true, false} {
		name := "the append ahead fails"
		if lands {
			name = "the append ahead lands"
		}
		t.Run(name, func(t *testing.T) {
			st := &heldUpload{Store: memstore.New(), held: make(chan struct{}), fail: make(chan bool, 1)}
			e := startEngine(t, st, Config{})
			t.Cleanup(func() {
				select {
				case st.fail <- true:
				default:
				}
			})
			test(t, lands, e, st)
		})
	}
}
