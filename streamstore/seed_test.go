package streamstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// restart closes e, as a crash would leave the bucket for these tests (no
// compaction runs at close), and starts another engine on st.
func restart(t *testing.T, e *Engine, st segment.Store) *Engine {
	t.Helper()
	if err := e.Close(context.Background()); err != nil {
		t.Fatalf("close: %v", err)
	}
	return startEngine(t, st, Config{})
}

// TestReplayCompletesCreate stops the node while the metadata PUT of a
// create with records is on its way: the next start finds the create's WAL
// entry without metadata. It must write the metadata from the entry, so the
// stream exists with its records, whether the PUT never lands, lands as the
// replay writes it (which then finds it there, the same bytes) or lands
// after the restart (it then finds the name taken and changes nothing).
// Before, the replay dropped the entry: a PUT landing late left the stream
// empty, and a create repeated was answered 200 without its records.
func TestReplayCompletesCreate(t *testing.T) {
	tests := []struct {
		name            string
		duringReplay    bool
		afterTheRestart bool
	}{
		{name: "never lands"},
		{name: "lands during the replay", duringReplay: true},
		{name: "lands after the restart", afterTheRestart: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := &delayedPut{Store: memstore.New(), key: metaKey("/c")}
			e := startEngine(t, st, Config{})
			req := CreateRequest{ContentType: "text/plain", Records: recs("x", "y")}
			if _, _, err := e.Create(ctx, "/c", req); !errors.Is(err, ErrUnconfirmed) {
				t.Fatalf("create: %v; want it unconfirmed", err)
			}
			st.mu.Lock()
			st.landFirst = tc.duringReplay
			st.mu.Unlock()
			e2 := restart(t, e, st)
			if tc.afterTheRestart && st.land(t) {
				t.Fatal("the late PUT found the name free: the replay did not write the metadata")
			}
			if got := fmt.Sprint(readAll(t, e2, "/c")); got != "[x y]" {
				t.Fatalf("after the restart the stream reads %s", got)
			}
			_, created, err := e2.Create(ctx, "/c", req)
			if err != nil || created {
				t.Fatalf("the create repeated: created %v, err %v; want the stream found", created, err)
			}
			if err := e2.Compact(ctx); err != nil {
				t.Fatal(err)
			}
			e3 := restart(t, e2, st)
			if got := fmt.Sprint(readAll(t, e3, "/c")); got != "[x y]" {
				t.Fatalf("after a compaction and a restart the stream reads %s", got)
			}
		})
	}
}

// TestDropUndoesReplayedCreate deletes streams created with records before
// any compaction, so the next start replays their creates' entries with no
// metadata in the bucket: a deleted stream must stay deleted, and a name
// created again must be the last stream's.
func TestDropUndoesReplayedCreate(t *testing.T) {
	tests := []struct {
		name  string
		again []string // records of a create after the delete; nil for none
		want  string   // what the name reads after the restart; "" for not found
	}{
		{name: "deleted", want: ""},
		{name: "deleted and created again", again: []string{"new"}, want: "[new]"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			e := startEngine(t, st, Config{})
			if _, _, err := e.Create(ctx, "/d", CreateRequest{ContentType: "text/plain", Records: recs("old")}); err != nil {
				t.Fatal(err)
			}
			if err := e.Delete(ctx, "/d"); err != nil {
				t.Fatal(err)
			}
			if tc.again != nil {
				if _, _, err := e.Create(ctx, "/d", CreateRequest{ContentType: "text/plain", Records: recs(tc.again...)}); err != nil {
					t.Fatal(err)
				}
			}
			e2 := restart(t, e, st)
			if tc.want == "" {
				if _, err := e2.Head(ctx, "/d"); !errors.Is(err, ErrNotFound) {
					t.Fatalf("after the restart the deleted stream answers %v; want not found", err)
				}
				if len(streamKeys(t, st, metaKey("/d"))) != 0 {
					t.Fatal("the replay wrote the deleted stream's metadata back")
				}
				return
			}
			if got := fmt.Sprint(readAll(t, e2, "/d")); got != tc.want {
				t.Fatalf("after the restart the stream reads %s, want %s", got, tc.want)
			}
		})
	}
}

// plantedName answers the first create-only metadata PUT of key as if
// another create had just written the name: it writes other's metadata
// there first.
type plantedName struct {
	*memstore.Store
	key   string
	other []byte
	once  sync.Once
}

func (p *plantedName) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	if key == p.key && opts.IfNoneMatch {
		p.once.Do(func() {
			if _, err := p.Store.Put(ctx, key, p.other, segment.PutOptions{IfNoneMatch: true}); err != nil {
				panic(err)
			}
		})
	}
	return p.Store.Put(ctx, key, data, opts)
}

// TestCreateLosingNameIsUndone lets a create with records find its name
// taken, its entry already in the WAL: at its metadata PUT (refused), or
// while it rolls forward after that PUT failed unconfirmed (it then
// settles as the other stream). Once the stream that holds the name is
// deleted, a restart must not complete the create from its entry.
func TestCreateLosingNameIsUndone(t *testing.T) {
	other := encodeMeta(&metaObject{Version: 1, Name: "/n", ID: "other", ContentType: "text/plain", CreatedAt: 1})
	tests := []struct {
		name  string
		store func() segment.Store
		// plant writes the other stream's metadata, if the store did not.
		plant   func(t *testing.T, st segment.Store)
		refused error
	}{
		{
			name:    "at its PUT",
			store:   func() segment.Store { return &plantedName{Store: memstore.New(), key: metaKey("/n"), other: other} },
			plant:   func(*testing.T, segment.Store) {},
			refused: ErrConflict,
		},
		{
			name:  "while it rolls forward",
			store: func() segment.Store { return &delayedPut{Store: memstore.New(), key: metaKey("/n")} },
			plant: func(t *testing.T, st segment.Store) {
				if _, err := st.(*delayedPut).Store.Put(context.Background(), metaKey("/n"), other, segment.PutOptions{}); err != nil {
					t.Fatal(err)
				}
			},
			refused: ErrUnconfirmed,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := tc.store()
			e := startEngine(t, st, Config{})
			_, _, err := e.Create(ctx, "/n", CreateRequest{ContentType: "text/plain", Records: recs("refused")})
			if !errors.Is(err, tc.refused) {
				t.Fatalf("create: %v; want %v", err, tc.refused)
			}
			tc.plant(t, st)
			// A lookup waits for a create rolling forward to settle.
			wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			info, err := e.Head(wctx, "/n")
			cancel()
			if err != nil || info.ID != "other" {
				t.Fatalf("the name holds %+v, %v; want the other stream", info, err)
			}
			if err := e.Delete(ctx, "/n"); err != nil {
				t.Fatalf("delete the stream that holds the name: %v", err)
			}
			e2 := restart(t, e, st)
			if info, err := e2.Head(ctx, "/n"); !errors.Is(err, ErrNotFound) {
				t.Fatalf("after the restart the name answers %+v, %v; want not found", info, err)
			}
		})
	}
}

// slowFirstWAL holds the first WAL upload back for a while before it
// lands: long enough that an append or create waiting on it is answered
// "unconfirmed", and then it commits all the same.
type slowFirstWAL struct {
	*memstore.Store
	delay time.Duration
	once  sync.Once
}

func (s *slowFirstWAL) Put(ctx context.Context, key string, data []byte, opts segment.PutOptions) (string, error) {
	if strings.HasPrefix(key, "wal/") {
		s.once.Do(func() { time.Sleep(s.delay) })
	}
	return s.Store.Put(ctx, key, data, opts)
}

// TestUnconfirmedCreateSupersededStaysGone: a create whose WAL entry
// commits only after its caller was told "unconfirmed" writes no metadata.
// The client creates the name again, which succeeds, and deletes it. The
// next start finds the first create's entry without metadata: it must not
// complete it. It did, when the replay kept every create without metadata
// and the second create's drop handed the name back to the first, or when
// the second create had no records and so no entry at all. The first
// create's own drop, added when it failed, and a later create superseding
// an earlier one each close it.
func TestUnconfirmedCreateSupersededStaysGone(t *testing.T) {
	for _, second := range [][]string{{"second"}, nil} {
		t.Run(fmt.Sprintf("second create with records %v", second != nil), func(t *testing.T) {
			ctx := context.Background()
			st := &slowFirstWAL{Store: memstore.New(), delay: 300 * time.Millisecond}
			e := startEngine(t, st, Config{AppendTimeout: 50 * time.Millisecond})
			req := CreateRequest{ContentType: "text/plain", Records: recs("first")}
			if _, _, err := e.Create(ctx, "/u", req); !errors.Is(err, ErrUnconfirmed) {
				t.Fatalf("create: %v; want it unconfirmed", err)
			}
			req.Records = recs(second...)
			var err error
			for range 50 { // the first upload is still on its way
				if _, _, err = e.Create(ctx, "/u", req); !errors.Is(err, ErrUnconfirmed) {
					break
				}
			}
			if err != nil {
				t.Fatalf("create again: %v", err)
			}
			if got, want := fmt.Sprint(readAll(t, e, "/u")), fmt.Sprint(second); got != want {
				t.Fatalf("the name reads %s, want %s", got, want)
			}
			if err := e.Delete(ctx, "/u"); err != nil {
				t.Fatal(err)
			}
			e2 := restart(t, e, st)
			if info, err := e2.Head(ctx, "/u"); !errors.Is(err, ErrNotFound) {
				t.Fatalf("after a restart the name answers %+v, %v; want not found", info, err)
			}
		})
	}
}
