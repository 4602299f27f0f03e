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
		settle := holdAhead(st, func() error {
			_, err := e.Append(ctx, "/s", AppendRequest{Records: recs("b")})
			return err
		})
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
		matched := appendBehind(t, "MatchSeq 1", func() (AppendResult, error) { return match(1) })
		settle(t, lands)
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
		wantRecords(t, e, lands, "c")
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
		settle := holdAhead(st, func() error {
			_, err := seqd("b", "002")
			return err
		})
		if _, err := seqd("x", "001"); !errors.Is(err, ErrStreamSeq) || !strings.Contains(err.Error(), `not after "001"`) {
			t.Fatalf("Stream-Seq 001 with 001 durable and 002 pending: %v, want a refusal naming 001", err)
		}
		second := appendBehind(t, "Stream-Seq 002", func() (AppendResult, error) { return seqd("c", "002") })
		settle(t, lands)
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
		wantRecords(t, e, lands, "c")
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
		settle := holdAhead(st, func() error {
			_, err := produce("b", 2, 0)
			return err
		})

		var fe *FencedError
		if _, err := produce("x", 0, 0); !errors.As(err, &fe) || fe.CurrentEpoch != 1 {
			t.Fatalf("epoch 0 with epoch 1 durable and 2 pending: %v, want fenced by epoch 1", err)
		}
		gap := appendBehind(t, "epoch 2 seq 5", func() (AppendResult, error) { return produce("y", 2, 5) })
		stale := appendBehind(t, "epoch 1 seq 1", func() (AppendResult, error) { return produce("z", 1, 1) })
		settle(t, lands)

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
		wantRecords(t, e, lands, "z")
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

// holdAhead holds the next WAL upload and starts send, the append whose
// upload it is, returning once the upload is held. settle then lets the
// upload land or fail and checks that the append's answer says which.
func holdAhead(st *heldUpload, send func() error) (settle func(t *testing.T, lands bool)) {
	st.holdNext()
	ahead := make(chan error, 1)
	go func() { ahead <- send() }()
	<-st.held
	return func(t *testing.T, lands bool) {
		t.Helper()
		st.fail <- !lands
		if err := <-ahead; (err == nil) != lands {
			t.Fatalf("the append ahead: %v", err)
		}
	}
}

// appendOutcome is what an append answered.
type appendOutcome struct {
	res AppendResult
	err error
}

// appendBehind starts send, an append behind the held one, and fails the
// test if it is answered within 200 ms, while the append ahead is not
// durable.
func appendBehind(t *testing.T, what string, send func() (AppendResult, error)) <-chan appendOutcome {
	t.Helper()
	ch := make(chan appendOutcome, 1)
	go func() {
		res, err := send()
		ch <- appendOutcome{res, err}
	}()
	select {
	case r := <-ch:
		t.Fatalf("%s answered (%+v, %v) while the append ahead is not durable", what, r.res, r.err)
	case <-time.After(200 * time.Millisecond):
	}
	return ch
}

// wantRecords checks that the stream /s holds "a", then "b" if the append
// ahead landed, else the one sent behind it.
func wantRecords(t *testing.T, e *Engine, lands bool, behind string) {
	t.Helper()
	want := []string{"a", "b"}
	if !lands {
		want[1] = behind
	}
	if got := readAll(t, e, "/s"); len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("records %q, want %q", got, want)
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
