package streamstore

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

// TestAnswerByEndsDurabilityWaits: a write whose WAL upload is held waits
// for it until the append timeout, unless the caller's WithAnswerBy time
// comes first: then it ends at that time with ErrUnconfirmed, as at the
// timeout, and the write goes on, landing once the upload does.
func TestAnswerByEndsDurabilityWaits(t *testing.T) {
	const answerIn = 200 * time.Millisecond
	tests := []struct {
		name string
		do   func(ctx context.Context, e *Engine) error
		// landed reports whether the write shows once its upload landed.
		landed func(t *testing.T, e *Engine) bool
	}{
		{"append", func(ctx context.Context, e *Engine) error {
			_, err := e.Append(ctx, "/s", AppendRequest{Records: recs("c")})
			return err
		}, func(t *testing.T, e *Engine) bool {
			return len(readAll(t, e, "/s")) == 3
		}},
		{"close", func(ctx context.Context, e *Engine) error {
			_, err := e.Append(ctx, "/s", AppendRequest{Close: true})
			return err
		}, func(t *testing.T, e *Engine) bool {
			info, err := e.Head(context.Background(), "/s")
			return err == nil && info.Closed
		}},
		{"trim", func(ctx context.Context, e *Engine) error {
			_, err := e.Trim(ctx, "/s", 1)
			return err
		}, func(t *testing.T, e *Engine) bool {
			info, err := e.Head(context.Background(), "/s")
			return err == nil && info.StartSeq == 1
		}},
		{"create with records", func(ctx context.Context, e *Engine) error {
			_, _, err := e.Create(ctx, "/new", CreateRequest{Records: recs("x")})
			return err
		}, nil}, // an unconfirmed create is abandoned: its caller creates again
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			st := &heldUpload{Store: memstore.New(), held: make(chan struct{}), fail: make(chan bool, 1)}
			e := startEngine(t, st, Config{AppendTimeout: time.Minute})
			t.Cleanup(func() {
				select {
				case st.fail <- false:
				default:
				}
			})
			if _, _, err := e.Create(context.Background(), "/s", CreateRequest{Records: recs("a", "b")}); err != nil {
				t.Fatal(err)
			}
			st.holdNext()
			start := time.Now()
			err := tc.do(WithAnswerBy(context.Background(), start.Add(answerIn)), e)
			took := time.Since(start)
			if !errors.Is(err, ErrUnconfirmed) || !errors.Is(err, ErrUnavailable) {
				t.Fatalf("with its upload held: %v, want ErrUnconfirmed", err)
			}
			// Deadlines fire at most a grain (an eighth of the wait) late.
			if took < answerIn || took > 10*time.Second {
				t.Fatalf("answered after %v, want at the answer-by time, %v", took, answerIn)
			}
			<-st.held
			st.fail <- false
			if tc.landed == nil {
				return
			}
			deadline := time.Now().Add(10 * time.Second)
			for !tc.landed(t, e) {
				if time.Now().After(deadline) {
					t.Fatal("the write does not show after its held upload landed")
				}
				time.Sleep(10 * time.Millisecond)
			}
		})
	}
	t.Run("a later time leaves the append timeout", func(t *testing.T) {
		st := &heldUpload{Store: memstore.New(), held: make(chan struct{}), fail: make(chan bool, 1)}
		e := startEngine(t, st, Config{AppendTimeout: answerIn})
		t.Cleanup(func() {
			select {
			case st.fail <- false:
			default:
			}
		})
		if _, _, err := e.Create(context.Background(), "/s", CreateRequest{Records: recs("a")}); err != nil {
			t.Fatal(err)
		}
		st.holdNext()
		start := time.Now()
		_, err := e.Append(WithAnswerBy(context.Background(), start.Add(time.Hour)), "/s", AppendRequest{Records: recs("b")})
		if took := time.Since(start); !errors.Is(err, ErrUnconfirmed) || took > 10*time.Second {
			t.Fatalf("with its upload held: %v after %v, want ErrUnconfirmed at the append timeout %v", err, took, answerIn)
		}
	})
}

// TestAnswerByPassedWritesNothing: a write whose WithAnswerBy time has
// passed before it reaches the WAL hands it nothing and fails with
// ErrTooLate, a refusal a retry may repeat safely. Handed over, it would
// have been answered "may still be stored" at once and stored all the
// same.
func TestAnswerByPassedWritesNothing(t *testing.T) {
	big := string(make([]byte, blobMinBytes))
	tests := []struct {
		name string
		do   func(ctx context.Context, e *Engine) error
	}{
		{"append", func(ctx context.Context, e *Engine) error {
			_, err := e.Append(ctx, "/s", AppendRequest{Records: recs("c")})
			return err
		}},
		{"large append", func(ctx context.Context, e *Engine) error {
			_, err := e.Append(ctx, "/s", AppendRequest{Records: recs(big)})
			return err
		}},
		{"close", func(ctx context.Context, e *Engine) error {
			_, err := e.Append(ctx, "/s", AppendRequest{Close: true})
			return err
		}},
		{"trim", func(ctx context.Context, e *Engine) error {
			_, err := e.Trim(ctx, "/s", 1)
			return err
		}},
		{"create with records", func(ctx context.Context, e *Engine) error {
			_, _, err := e.Create(ctx, "/new", CreateRequest{Records: recs("x")})
			return err
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := startEngine(t, memstore.New(), Config{AppendTimeout: time.Minute})
			if _, _, err := e.Create(context.Background(), "/s", CreateRequest{Records: recs("a", "b")}); err != nil {
				t.Fatal(err)
			}
			err := tc.do(WithAnswerBy(context.Background(), time.Now().Add(-time.Millisecond)), e)
			if !errors.Is(err, ErrTooLate) || !errors.Is(err, ErrUnavailable) || errors.Is(err, ErrUnconfirmed) {
				t.Fatalf("answer-by passed: %v, want ErrTooLate", err)
			}
			// A later write confirmed settles every earlier entry.
			if _, err := e.Append(context.Background(), "/s", AppendRequest{Records: recs("d")}); err != nil {
				t.Fatal(err)
			}
			info, err := e.Head(context.Background(), "/s")
			if err != nil || info.NextSeq != 3 || info.Closed || info.StartSeq != 0 {
				t.Errorf("after the refused write /s is %+v (%v), want records a, b, d only, open, untrimmed", info, err)
			}
			if _, err := e.Head(context.Background(), "/new"); !errors.Is(err, ErrNotFound) {
				t.Errorf("after the refused create /new: %v, want ErrNotFound", err)
			}
		})
	}
}
