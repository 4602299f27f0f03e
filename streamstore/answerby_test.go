package streamstore

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
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

// heldPuts holds, once armed, every PUT of a key starting with prefix
// until released is closed; held is closed when the first one arrives.
type heldPuts struct {
	*memstore.Store
	prefix   string
	armed    atomic.Bool
	once     sync.Once
	held     chan struct{}
	released chan struct{}
}

func (h *heldPuts) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	if h.armed.Load() && strings.HasPrefix(key, h.prefix) {
		h.once.Do(func() { close(h.held) })
		select {
		case <-h.released:
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
	return h.Store.Put(ctx, key, data, opts)
}

// TestAnswerQueuedWriteWroteNothing: a write queued behind an entry still
// in flight (a close, a large append's blob upload) and cut before that
// entry settles was never handed to the WAL. It is answered so (ErrTooLate
// at its answer-by time, plain ErrUnavailable at the append timeout),
// not ErrUnconfirmed, which tells a client it may still be stored and
// that only producer headers make its retry safe. A producer's retry of
// the entry waited for may be stored, and keeps ErrUnconfirmed.
func TestAnswerQueuedWriteWroteNothing(t *testing.T) {
	const answerIn = 200 * time.Millisecond
	big := recs(string(make([]byte, blobMinBytes)))
	prod := &Producer{ID: "p"}
	tests := []struct {
		name   string
		prefix string        // the uploads held
		ahead  AppendRequest // the write in flight
		queued func(ctx context.Context, e *Engine) error
		// answerBy says the queued write has an answer-by time; without
		// one it waits out the append timeout.
		answerBy bool
		want     error
	}{
		{"append behind a close", "wal/", AppendRequest{Records: recs("last"), Close: true, Producer: prod},
			func(ctx context.Context, e *Engine) error {
				_, err := e.Append(ctx, "/s", AppendRequest{Records: recs("c")})
				return err
			}, true, ErrTooLate},
		{"append behind a close at the append timeout", "wal/", AppendRequest{Close: true},
			func(ctx context.Context, e *Engine) error {
				_, err := e.Append(ctx, "/s", AppendRequest{Records: recs("c")})
				return err
			}, false, nil},
		{"create behind a close", "wal/", AppendRequest{Close: true},
			func(ctx context.Context, e *Engine) error {
				_, _, err := e.Create(ctx, "/s", CreateRequest{Closed: true})
				return err
			}, true, ErrTooLate},
		{"producer retry of the close", "wal/", AppendRequest{Records: recs("last"), Close: true, Producer: prod},
			func(ctx context.Context, e *Engine) error {
				_, err := e.Append(ctx, "/s", AppendRequest{Records: recs("last"), Close: true, Producer: prod})
				return err
			}, true, ErrUnconfirmed},
		{"append behind a large append", "blob/", AppendRequest{Records: big, Producer: prod},
			func(ctx context.Context, e *Engine) error {
				_, err := e.Append(ctx, "/s", AppendRequest{Records: recs("c")})
				return err
			}, true, ErrTooLate},
		{"producer retry of the large append", "blob/", AppendRequest{Records: big, Producer: prod},
			func(ctx context.Context, e *Engine) error {
				_, err := e.Append(ctx, "/s", AppendRequest{Records: big, Producer: prod})
				return err
			}, true, ErrUnconfirmed},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			st := &heldPuts{Store: memstore.New(), prefix: tc.prefix, held: make(chan struct{}), released: make(chan struct{})}
			timeout := time.Minute
			if !tc.answerBy {
				timeout = answerIn
			}
			e := startEngine(t, st, Config{AppendTimeout: timeout})
			if _, _, err := e.Create(context.Background(), "/s", CreateRequest{Records: recs("a")}); err != nil {
				t.Fatal(err)
			}
			st.armed.Store(true)
			ahead := make(chan error, 1)
			go func() {
				_, err := e.Append(context.Background(), "/s", tc.ahead)
				ahead <- err
			}()
			t.Cleanup(func() {
				select {
				case <-st.released:
				default:
					close(st.released)
				}
				<-ahead
			})
			<-st.held
			ctx := context.Background()
			if tc.answerBy {
				ctx = WithAnswerBy(ctx, time.Now().Add(answerIn))
			}
			err := tc.queued(ctx, e)
			switch {
			case !errors.Is(err, ErrUnavailable):
				t.Fatalf("queued behind a held upload: %v, want ErrUnavailable", err)
			case tc.want == nil && (errors.Is(err, ErrTooLate) || errors.Is(err, ErrUnconfirmed)):
				t.Fatalf("queued behind a held upload: %v, want ErrUnavailable alone", err)
			case tc.want != nil && !errors.Is(err, tc.want):
				t.Fatalf("queued behind a held upload: %v, want %v", err, tc.want)
			case errors.Is(tc.want, ErrTooLate) && errors.Is(err, ErrUnconfirmed):
				t.Fatalf("queued behind a held upload: %v, want ErrTooLate without ErrUnconfirmed", err)
			}
		})
	}
}

// TestAnswerByForkReleaseInBackground: a fork create that fails before it
// wrote the fork (here its expiry marker refused) gives its source's count
// back. A caller with an answer-by time is answered without waiting for
// that metadata write, which goes on in the background: it waited for it,
// so a slow bucket held its answer past the time it had to be given.
func TestAnswerByForkReleaseInBackground(t *testing.T) {
	st := newHookedStore()
	e := startEngine(t, st, Config{AppendTimeout: time.Minute})
	ctx := context.Background()
	if _, _, err := e.Create(ctx, "/src", CreateRequest{Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	released := make(chan struct{})
	var srcPuts atomic.Int32
	st.setHook(func(op, key string) error {
		switch {
		case op == "PUT" && strings.HasPrefix(key, expiryPrefix):
			return errors.New("injected: expiry marker refused")
		case op == "PUT" && key == metaKey("/src") && srcPuts.Add(1) > 1:
			<-released // the count's release, held
		}
		return nil
	})
	answered := make(chan error, 1)
	go func() {
		_, _, err := e.Create(WithAnswerBy(ctx, time.Now().Add(time.Second)), "/fork",
			CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1}, Expiry: Expiry{TTL: time.Hour}})
		answered <- err
	}()
	select {
	case err := <-answered:
		close(released)
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("fork create with its expiry marker refused: %v, want ErrUnavailable", err)
		}
	case <-time.After(5 * time.Second):
		close(released)
		<-answered
		t.Fatal("fork create with its expiry marker refused: not answered within 5s of its answer-by time, the count's release held")
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		m := storedMeta(t, st, "/src")
		if m.Forks == 0 && len(m.ForkList) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the source still counts %d forks (%v) after the failed fork create", m.Forks, m.ForkList)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestAnswerByForkPointRead: a fork inside a record reads the source's
// records to place its point before it writes anything. That read held
// (the source not in memory, its records only in the bucket) ends at the
// caller's answer-by time with ErrTooLate: nothing was written, and the
// fork is not made.
func TestAnswerByForkPointRead(t *testing.T) {
	const answerIn = 300 * time.Millisecond
	st := newHookedStore()
	ctx := context.Background()
	first := startEngine(t, st, Config{AppendTimeout: time.Minute})
	if _, _, err := first.Create(ctx, "/src", CreateRequest{Records: recs("aaaa", "bbbb")}); err != nil {
		t.Fatal(err)
	}
	if err := first.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if err := first.Close(ctx); err != nil {
		t.Fatal(err)
	}
	hr := &heldReads{Store: st.Store, released: make(chan struct{})}
	e := startEngine(t, hr, Config{AppendTimeout: time.Minute})
	released := hr.released
	held := &hr.held
	hr.armed.Store(true)
	answered := make(chan error, 1)
	go func() {
		_, _, err := e.Create(WithAnswerBy(ctx, time.Now().Add(answerIn)), "/fork",
			CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 0, Bytes: 2}})
		answered <- err
	}()
	var err error
	select {
	case err = <-answered:
		close(released)
	case <-time.After(5 * time.Second):
		close(released)
		err = <-answered
		t.Fatalf("fork create inside a record, the source's records held: not answered within 5s (then: %v)", err)
	}
	if held.Load() == 0 {
		t.Fatal("no read of the source's records was held")
	}
	if !errors.Is(err, ErrTooLate) || !errors.Is(err, ErrUnavailable) {
		t.Fatalf("fork create inside a record, the source's records held: %v, want ErrTooLate", err)
	}
	hr.armed.Store(false)
	if _, err := e.Head(ctx, "/fork"); !errors.Is(err, ErrNotFound) {
		t.Errorf("after the refused fork create /fork: %v, want ErrNotFound", err)
	}
	if _, _, err := e.Create(ctx, "/fork", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 0, Bytes: 2}}); err != nil {
		t.Errorf("the fork create again: %v", err)
	}
}

// heldReads holds, once armed, reads of stored records (GETs and
// listings of data objects and packs) until released is closed or their
// context ends, as a request to a slow bucket is cut.
type heldReads struct {
	*memstore.Store
	armed    atomic.Bool
	held     atomic.Int32
	released chan struct{}
}

func (h *heldReads) hold(ctx context.Context, key string) error {
	if !h.armed.Load() || !(strings.HasPrefix(key, "data/") || strings.HasPrefix(key, "pack")) {
		return nil
	}
	h.held.Add(1)
	select {
	case <-h.released:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (h *heldReads) Get(ctx context.Context, key string, offset, length int64) ([]byte, string, error) {
	if err := h.hold(ctx, key); err != nil {
		return nil, "", err
	}
	return h.Store.Get(ctx, key, offset, length)
}

func (h *heldReads) List(ctx context.Context, prefix, startAfter string, max int) ([]segment.ObjectInfo, bool, error) {
	if err := h.hold(ctx, prefix); err != nil {
		return nil, false, err
	}
	return h.Store.List(ctx, prefix, startAfter, max)
}

// TestAnswerByForkWaitsForACheckpoint: a fork's count raise waits for a
// metadata write of its source already under way (a compaction's
// checkpoint, after the data objects it writes first). That wait ends at
// the caller's answer-by time with ErrTooLate too, the fork unmade: it
// lasted as long as the bucket took, past Caddy's `write` timeout.
func TestAnswerByForkWaitsForACheckpoint(t *testing.T) {
	const answerIn = 300 * time.Millisecond
	st := &heldPuts{Store: memstore.New(), prefix: "data/", held: make(chan struct{}), released: make(chan struct{})}
	e := startEngine(t, st, Config{AppendTimeout: time.Minute, PackBelow: -1})
	ctx := context.Background()
	if _, _, err := e.Create(ctx, "/src", CreateRequest{Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	st.armed.Store(true)
	compacted := make(chan error, 1)
	go func() { compacted <- e.Compact(ctx) }()
	t.Cleanup(func() {
		select {
		case <-st.released:
		default:
			close(st.released)
		}
		<-compacted
	})
	<-st.held
	answered := make(chan error, 1)
	go func() {
		_, _, err := e.Create(WithAnswerBy(ctx, time.Now().Add(answerIn)), "/fork", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1}})
		answered <- err
	}()
	var err error
	select {
	case err = <-answered:
	case <-time.After(5 * time.Second):
		close(st.released)
		err = <-answered
		t.Fatalf("fork create behind a held checkpoint of its source: not answered within 5s (then: %v)", err)
	}
	if !errors.Is(err, ErrTooLate) || !errors.Is(err, ErrUnavailable) {
		t.Fatalf("fork create behind a held checkpoint of its source: %v, want ErrTooLate", err)
	}
	close(st.released)
	if err := <-compacted; err != nil {
		t.Fatalf("compaction: %v", err)
	}
	compacted <- nil
	if _, err := e.Head(ctx, "/fork"); !errors.Is(err, ErrNotFound) {
		t.Errorf("after the refused fork create /fork: %v, want ErrNotFound", err)
	}
	if _, _, err := e.Create(ctx, "/fork", CreateRequest{Fork: &ForkFrom{Source: "/src", Seq: 1}}); err != nil {
		t.Errorf("the fork create again: %v", err)
	}
}
