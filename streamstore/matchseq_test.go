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
			r.res = untilLanded(t, r.res, r.err, func() (AppendResult, error) { return match(1) },
				func(err error) bool { return errors.As(err, &me) })
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
			untilLanded(t, r.res, r.err, func() (AppendResult, error) { return seqd("c", "002") },
				func(err error) bool { return errors.Is(err, ErrStreamSeq) })
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

// A producer's refusals are judged the same way. An epoch bump still on
// its way fences nobody yet, and a seq gap against pending state names a
// seq, or even a kind of refusal, that a rollback takes back: both wait
// for the producer's appends ahead. A refusal the durable state already
// makes certain is answered at once and names that state.
func TestProducerRefusalsJudgedOnDurableState(t *testing.T) {
	aheadLandsOrFails(t, func(t *testing.T, lands bool, e *Engine, st *heldUpload) {
		ctx := context.Background()
		if _, _, err := e.Create(ctx, "/s", CreateRequest{}); err != nil {
			t.Fatal(err)
		}
		produce := func(rec string, epoch, seq uint64) (AppendResult, error) {
			return e.Append(ctx, "/s", AppendRequest{Records: recs(rec), Producer: &Producer{ID: "p", Epoch: epoch, Seq: seq}})
		}
		if _, err := produce("a", 1, 0); err != nil {
			t.Fatal(err)
		}
		st.holdNext()
		ahead := make(chan error, 1)
		go func() {
			_, err := produce("b", 2, 0)
			ahead <- err
		}()
		<-st.held

		var fe *FencedError
		if _, err := produce("x", 0, 0); !errors.As(err, &fe) || fe.CurrentEpoch != 1 {
			t.Fatalf("epoch 0 with epoch 1 durable and 2 pending: %v, want fenced by epoch 1", err)
		}
		type result struct {
			res AppendResult
			err error
		}
		gap, stale := make(chan result, 1), make(chan result, 1)
		go func() {
			res, err := produce("y", 2, 5)
			gap <- result{res, err}
		}()
		go func() {
			res, err := produce("z", 1, 1)
			stale <- result{res, err}
		}()
		select {
		case r := <-gap:
			t.Fatalf("epoch 2 seq 5 answered (%+v, %v) while epoch 2 is not durable", r.res, r.err)
		case r := <-stale:
			t.Fatalf("epoch 1 seq 1 answered (%+v, %v) while epoch 2 is not durable", r.res, r.err)
		case <-time.After(200 * time.Millisecond):
		}
		st.fail <- !lands
		if err := <-ahead; (err == nil) != lands {
			t.Fatalf("the append ahead: %v", err)
		}

		g := <-gap
		var ge *SequenceGapError
		var es *EpochStartError
		switch {
		case lands && (!errors.As(g.err, &ge) || ge.Expected != 1 || ge.Received != 5):
			t.Fatalf("epoch 2 seq 5 once epoch 2 seq 0 is durable: %v, want a gap expecting 1", g.err)
		case !lands:
			// Judged again once the writer has recovered from the
			// failed upload, if it was still recovering.
			for deadline := time.Now().Add(10 * time.Second); errors.Is(g.err, ErrUnavailable) && time.Now().Before(deadline); {
				time.Sleep(20 * time.Millisecond)
				g.res, g.err = produce("y", 2, 5)
			}
			if !errors.As(g.err, &es) {
				t.Fatalf("epoch 2 seq 5 after epoch 2 rolled back: %v, want an epoch that must start at 0", g.err)
			}
		}

		r := <-stale
		switch {
		case lands && (!errors.As(r.err, &fe) || fe.CurrentEpoch != 2):
			t.Fatalf("epoch 1 seq 1 once epoch 2 is durable: %+v, %v, want fenced by epoch 2", r.res, r.err)
		case !lands && errors.As(r.err, &fe):
			t.Fatalf("epoch 1 seq 1 fenced (%v) although epoch 2 rolled back", r.err)
		case !lands:
			r.res = untilLanded(t, r.res, r.err, func() (AppendResult, error) { return produce("z", 1, 1) },
				func(err error) bool { return errors.As(err, &fe) })
			if r.res.FirstSeq != 1 {
				t.Fatalf("epoch 1 seq 1 landed at %d", r.res.FirstSeq)
			}
		}
		want := []string{"a", "b"}
		if !lands {
			want = []string{"a", "z"}
		}
		if got := readAll(t, e, "/s"); len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
			t.Fatalf("records %q, want %q", got, want)
		}
	})
}

// A trim beyond every pending append is refused whatever becomes of them,
// naming the durable tail, the one reads show.
func TestTrimBeyondTailNamesDurableTail(t *testing.T) {
	st := &heldUpload{Store: memstore.New(), held: make(chan struct{}), fail: make(chan bool, 1)}
	e := startEngine(t, st, Config{})
	t.Cleanup(func() {
		select {
		case st.fail <- false:
		default:
		}
	})
	ctx := context.Background()
	if _, _, err := e.Create(ctx, "/s", CreateRequest{Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	st.holdNext()
	go func() { _, _ = e.Append(ctx, "/s", AppendRequest{Records: recs("b", "c")}) }()
	<-st.held
	_, err := e.Trim(ctx, "/s", 5)
	if !errors.Is(err, ErrBadRequest) || !strings.Contains(err.Error(), "beyond the tail 1") {
		t.Fatalf("trim to 5 with tail 1 durable and 3 pending: %v, want a refusal naming tail 1", err)
	}
}

// untilLanded retries an append that answered (res, err), while the
// writer recovers from a failed upload, until it lands; refused says which
// error means the append was judged and turned away, which fails the test.
func untilLanded(t *testing.T, res AppendResult, err error, try func() (AppendResult, error), refused func(error) bool) AppendResult {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for err != nil {
		if refused(err) || time.Now().After(deadline) {
			t.Fatalf("after the append ahead rolled back: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
		res, err = try()
	}
	return res
}
