package streamstore

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

// metaOps counts the requests for one stream's metadata object once armed.
// Its hook goes into the store before an engine starts (the engine's own
// goroutines call it), and is armed when the counting should begin.
type metaOps struct {
	mu         sync.Mutex
	key        string
	armed      bool
	gets, puts int
}

func (c *metaOps) arm() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.armed = true
}

func (c *metaOps) hook(op, key string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.armed && key == c.key {
		switch op {
		case "GET":
			c.gets++
		case "PUT":
			c.puts++
		}
	}
	return nil
}

func (c *metaOps) counts() (gets, puts int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gets, c.puts
}

// TestCreateCostsOneRequestForANewName: a name not in memory is written
// with if-none-match straight away; the bucket is read only when it already
// holds the name (to tell a stream from a grave, and the stream read there
// is the one the create is then judged against), and the outcome is the
// one the read-first path gave. A grave costs a read and a second write.
func TestCreateCostsOneRequestForANewName(t *testing.T) {
	const name = "/c"
	plain := CreateRequest{ContentType: "text/plain"}
	tests := []struct {
		name        string
		existing    *CreateRequest // created by an earlier engine, so not in memory
		deleted     bool           // and deleted by it
		req         CreateRequest
		wantCreated bool
		wantErr     error
		gets, puts  int
	}{
		{name: "new name", req: plain, wantCreated: true, gets: 0, puts: 1},
		{name: "new name with records reads first", req: CreateRequest{ContentType: "text/plain", Records: recs("a")},
			wantCreated: true, gets: 1, puts: 1},
		{name: "new name with a TTL reads first", req: CreateRequest{ContentType: "text/plain", Expiry: Expiry{TTL: time.Hour}},
			wantCreated: true, gets: 1, puts: 1},
		{name: "same config again", existing: &plain, req: plain, gets: 1, puts: 1},
		{name: "other config", existing: &plain, req: CreateRequest{ContentType: "application/json"},
			wantErr: ErrConflict, gets: 1, puts: 1},
		{name: "over a grave", existing: &plain, deleted: true, req: plain, wantCreated: true, gets: 1, puts: 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			if tt.existing != nil {
				first := startEngine(t, st, Config{})
				if _, _, err := first.Create(ctx, name, *tt.existing); err != nil {
					t.Fatal(err)
				}
				if tt.deleted {
					if err := first.Delete(ctx, name); err != nil {
						t.Fatal(err)
					}
				}
				if err := first.Close(ctx); err != nil {
					t.Fatal(err)
				}
			}
			ops := &metaOps{key: metaKey(name)}
			st.SetFail(ops.hook)
			e := startEngine(t, st, Config{})
			ops.arm()
			_, created, err := e.Create(ctx, name, tt.req)
			if !errors.Is(err, tt.wantErr) || created != tt.wantCreated {
				t.Fatalf("create: created %v, err %v; want %v, %v", created, err, tt.wantCreated, tt.wantErr)
			}
			if gets, puts := ops.counts(); gets != tt.gets || puts != tt.puts {
				t.Errorf("metadata GETs %d, PUTs %d; want %d, %d", gets, puts, tt.gets, tt.puts)
			}
			if _, err := e.Head(ctx, name); err != nil {
				t.Errorf("head after create: %v", err)
			}
		})
	}
}

// TestCreateWithAnExpiryOfAnEvictedStreamWritesNothing: a create with a
// TTL or an expiry time of a stream not in memory reads the stream first,
// so that one refused (other settings, If-None-Match) or confirmed writes
// nothing, and one confirmed is so while storage refuses writes. It wrote
// its expiry marker first, as for a new stream, and deleted it again once
// the name was found taken; with writes refused it was 503.
func TestCreateWithAnExpiryOfAnEvictedStreamWritesNothing(t *testing.T) {
	const name = "/c"
	ttl := CreateRequest{ContentType: "text/plain", Expiry: Expiry{TTL: time.Hour}}
	for _, tc := range []struct {
		name        string
		req         CreateRequest
		refuseWrite bool
		wantErr     error
	}{
		{"other settings", CreateRequest{ContentType: "application/json", Expiry: Expiry{TTL: time.Hour}}, false, ErrConflict},
		{"other TTL", CreateRequest{ContentType: "text/plain", Expiry: Expiry{TTL: 2 * time.Hour}}, false, ErrConflict},
		{"new stream asked for", CreateRequest{ContentType: "text/plain", Expiry: Expiry{TTL: time.Hour}, Exclusive: true}, false, ErrExists},
		{"same settings", ttl, false, nil},
		{"same settings, writes refused", ttl, true, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			first := startEngine(t, st, Config{})
			if _, _, err := first.Create(ctx, name, ttl); err != nil {
				t.Fatal(err)
			}
			if err := first.Close(ctx); err != nil {
				t.Fatal(err)
			}
			var writes atomic.Int64
			var refuse atomic.Bool
			st.SetFail(func(op, key string) error {
				if strings.HasPrefix(key, "expiry/") && (op == "PUT" || op == "DELETE") {
					writes.Add(1)
					if refuse.Load() {
						return errors.New("writes refused")
					}
				}
				return nil
			})
			e := startEngine(t, st, Config{})
			refuse.Store(tc.refuseWrite)
			_, created, err := e.Create(ctx, name, tc.req)
			if !errors.Is(err, tc.wantErr) || created {
				t.Fatalf("create: created %v, %v; want %v", created, err, tc.wantErr)
			}
			if err := e.Close(ctx); err != nil {
				t.Fatal(err)
			}
			if n := writes.Load(); n != 0 {
				t.Errorf("%d writes under expiry/ for a create that made nothing", n)
			}
		})
	}
}

// TestLookupDuringRefusedCreateSeesTheStream: a lookup that waits on a
// create whose write finds the name taken must read what the bucket holds,
// not take the create's failure for "no such stream".
func TestLookupDuringRefusedCreateSeesTheStream(t *testing.T) {
	const name = "/taken"
	ctx := context.Background()
	st := memstore.New()
	first := startEngine(t, st, Config{})
	if _, _, err := first.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	if err := first.Close(ctx); err != nil {
		t.Fatal(err)
	}
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	st.SetFail(func(op, key string) error {
		if op == "PUT" && key == metaKey(name) {
			once.Do(func() { close(held) })
			<-release
		}
		return nil
	})
	e := startEngine(t, st, Config{})
	type result struct {
		created bool
		err     error
	}
	createDone := make(chan result, 1)
	go func() {
		_, created, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"})
		createDone <- result{created, err}
	}()
	select {
	case <-held:
	case <-time.After(5 * time.Second):
		close(release)
		t.Fatal("the create never wrote the metadata object")
	}
	headDone := make(chan error, 1)
	go func() {
		_, err := e.Head(ctx, name)
		headDone <- err
	}()
	// The lookup queues behind the create's claim on the name: wait until
	// it does, or a Head that ran after the create never waited on it.
	if err := waitUntil(5*time.Second, func() bool {
		return goroutineWaits("streamstore.awaitClaim(", "streamstore.(*Engine).Head(")
	}); err != nil {
		close(release)
		t.Fatal("the lookup never queued on the create's claim: nothing tested")
	}
	close(release)

	if r := <-createDone; r.err != nil || r.created {
		t.Fatalf("create of a taken name with the same config: created %v, err %v; want false, nil", r.created, r.err)
	}
	if err := <-headDone; err != nil {
		t.Fatalf("head while the create was refused: %v", err)
	}
}

// TestCreateDuringLoadKeepsTheLoadedStream: a create of an existing
// stream that is not in memory writes its metadata first and reads the
// bucket only when the name is taken. If a lookup's load of that stream
// was under way, the create waits for it and claims the name, but
// requests use the handle the load published meanwhile: an append was
// acknowledged on it. The create's refused write then put a second handle
// for the same metadata in its place, and the acknowledged record
// vanished from reads, its seq was given out again, and compaction and a
// restart kept one of the two.
func TestCreateDuringLoadKeepsTheLoadedStream(t *testing.T) {
	const name = "/x"
	ctx := context.Background()
	st := newHookedStore()
	first := startEngine(t, st, Config{PackBelow: -1})
	if _, _, err := first.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	if _, err := first.Append(ctx, name, AppendRequest{Records: recs("a")}); err != nil {
		t.Fatal(err)
	}
	if err := first.Close(ctx); err != nil {
		t.Fatal(err)
	}
	e := startEngine(t, st, Config{PackBelow: -1})
	if err := e.Compact(ctx); err != nil { // nothing left in the WAL: the stream can leave memory
		t.Fatal(err)
	}
	e.mu.Lock()
	if s, ok := e.streams[name]; ok {
		s.mu.Lock()
		s.evicted = true
		s.mu.Unlock()
		delete(e.streams, name) // as the idle sweep does
	}
	e.mu.Unlock()

	loading, loadGo := make(chan struct{}), make(chan struct{})
	writing, writeGo := make(chan struct{}), make(chan struct{})
	var getOnce, putOnce sync.Once
	st.setHook(func(op, key string) error {
		if key != metaKey(name) {
			return nil
		}
		switch op {
		case "GET":
			getOnce.Do(func() { close(loading); <-loadGo })
		case "PUT":
			putOnce.Do(func() { close(writing); <-writeGo })
		}
		return nil
	})
	appended := make(chan error, 1)
	go func() { // loads the stream, then appends to it
		_, err := e.Append(ctx, name, AppendRequest{Records: recs("b")})
		appended <- err
	}()
	<-loading
	created := make(chan error, 1)
	go func() {
		_, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain"})
		created <- err
	}()
	if err := waitUntil(5*time.Second, func() bool { return goroutineWaits("streamstore.(*Engine).claimName(") }); err != nil {
		t.Fatal("the create never waited for the load to claim the name")
	}
	close(loadGo)
	<-writing // the create's metadata PUT, which finds the name taken
	if err := <-appended; err != nil {
		t.Fatalf("append on the loaded stream: %v", err)
	}
	close(writeGo)
	if err := <-created; err != nil {
		t.Fatalf("create of the existing stream: %v", err)
	}
	st.setHook(nil)

	if got := readAll(t, e, name); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("after the create: %q, want the acknowledged records a b", got)
	}
	res, err := e.Append(ctx, name, AppendRequest{Records: recs("c")})
	if err != nil {
		t.Fatal(err)
	}
	if res.FirstSeq != 2 {
		t.Fatalf("the next append got seq %d, want 2 (seq 1 is b's)", res.FirstSeq)
	}
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	again := startEngine(t, st, Config{PackBelow: -1})
	if got := readAll(t, again, name); !slices.Equal(got, []string{"a", "b", "c"}) {
		t.Fatalf("after compaction and a restart: %q, want a b c", got)
	}
}

// heldWALPut parks the first WAL upload once armed, until release, and
// then fails it or lets it through.
type heldWALPut struct {
	mu      sync.Mutex
	armed   bool
	fail    bool
	held    chan struct{} // closed when the upload is parked
	release chan struct{}
}

func (h *heldWALPut) hook(op, key string) error {
	h.mu.Lock()
	park := h.armed && op == "PUT" && strings.HasPrefix(key, "wal/")
	h.armed = h.armed && !park
	h.mu.Unlock()
	if !park {
		return nil
	}
	close(h.held)
	<-h.release
	if h.fail {
		return errors.New("injected upload failure")
	}
	return nil
}

// TestCreateWaitsForAPendingClose: a create of an existing stream is
// judged on its closure (Stream-Closed must match), and a close that is
// not yet durable may still roll back. Judged against the pending close,
// a create with Stream-Closed was told the stream exists closed while the
// close then failed and the stream stayed open, and one without it was
// refused over a close that never happened. The create now waits for the
// close's fate.
func TestCreateWaitsForAPendingClose(t *testing.T) {
	for _, tc := range []struct {
		name      string
		closeFail bool
		closed    bool // the create's Stream-Closed
		want      error
	}{
		{"close rolls back, create closed", true, true, ErrConflict},
		{"close rolls back, create open", true, false, nil},
		{"close lands, create closed", false, true, nil},
		{"close lands, create open", false, false, ErrConflict},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			h := &heldWALPut{fail: tc.closeFail, held: make(chan struct{}), release: make(chan struct{})}
			st.SetFail(h.hook)
			e := startEngine(t, st, Config{AppendTimeout: 10 * time.Second})
			if _, _, err := e.Create(ctx, "/c", CreateRequest{ContentType: "text/plain"}); err != nil {
				t.Fatal(err)
			}
			h.mu.Lock()
			h.armed = true
			h.mu.Unlock()
			closed := make(chan error, 1)
			go func() {
				_, err := e.Append(ctx, "/c", AppendRequest{Close: true})
				closed <- err
			}()
			<-h.held
			created := make(chan error, 1)
			go func() {
				_, _, err := e.Create(ctx, "/c", CreateRequest{ContentType: "text/plain", Closed: tc.closed})
				created <- err
			}()
			// The close is released once the create has answered or waits
			// for the stream's next change.
			s, err := e.stream(ctx, "/c")
			if err != nil {
				t.Fatal(err)
			}
			var early error
			answered := false
			for deadline := time.Now().Add(10 * time.Second); !answered; {
				select {
				case early = <-created:
					answered = true
				default:
				}
				s.mu.Lock()
				waiting := s.changed != nil
				s.mu.Unlock()
				if waiting {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the create neither answered nor waited for the close")
				}
				time.Sleep(time.Millisecond)
			}
			if answered {
				created <- early
			}
			close(h.release)
			if err := <-closed; (err != nil) != tc.closeFail {
				t.Fatalf("close: %v (failure injected: %v)", err, tc.closeFail)
			}
			if err := <-created; !errors.Is(err, tc.want) {
				t.Fatalf("create with Closed %v: %v, want %v", tc.closed, err, tc.want)
			}
			info, err := e.Head(ctx, "/c")
			if err != nil {
				t.Fatal(err)
			}
			if info.Closed != !tc.closeFail {
				t.Fatalf("the stream's closure is %v after the close %s", info.Closed, map[bool]string{true: "failed", false: "landed"}[tc.closeFail])
			}
		})
	}
}

// A lookup of a stream whose create storage has not confirmed, and keeps
// failing, gives up after settlingWait with ErrUnavailable, rather than
// wait for as long as storage is down (holding its request, and a graceful
// stop, that long); once storage is back, the create settles and the
// stream reads.
func TestLookupOfAnUnsettledCreateGivesUp(t *testing.T) {
	ctx := context.Background()
	st := newHookedStore()
	e := startEngine(t, st, Config{})
	meta := metaKey("/c")
	// The metadata PUT fails, and so does every request for it after
	// that: the create cannot tell whether it landed.
	var down atomic.Bool
	st.setHook(func(op, key string) error {
		if key == meta && (op == "PUT" || down.Load()) {
			down.Store(true)
			return fmt.Errorf("injected: %s %s failed", op, key)
		}
		return nil
	})
	if _, _, err := e.Create(ctx, "/c", CreateRequest{ContentType: "text/plain", Records: recs("x")}); !errors.Is(err, ErrUnconfirmed) {
		t.Fatalf("create: %v; want it unconfirmed", err)
	}
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	begun := time.Now()
	_, err := e.Read(rctx, "/c", ReadRequest{})
	took := time.Since(begun)
	if !errors.Is(err, ErrUnavailable) || rctx.Err() != nil || took > 3*time.Second {
		t.Fatalf("a read while storage fails the create: %v after %v; want ErrUnavailable after about 2s", err, took.Round(time.Millisecond))
	}
	st.setHook(nil)
	if err := waitUntil(10*time.Second, func() bool {
		res, err := e.Read(ctx, "/c", ReadRequest{})
		return err == nil && len(res.Records) == 1
	}); err != nil {
		t.Fatalf("the stream once storage is back: %v", err)
	}
}

// TestCreateConfirmOnly: a create that may only confirm is judged against a
// stream under the name and writes nothing where there is none, nor where
// the one there has expired (which it leaves to the next access to delete).
func TestCreateConfirmOnly(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	if _, _, err := e.Create(ctx, "/s", CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	soon := Expiry{ExpiresAt: time.Now().Add(50 * time.Millisecond)}
	if _, _, err := e.Create(ctx, "/x", CreateRequest{ContentType: "text/plain", Expiry: soon}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	bucket := func() map[string]string {
		m := map[string]string{}
		for _, k := range st.Keys("") {
			b, _, err := st.Get(ctx, k, 0, -1)
			if err != nil {
				t.Fatal(err)
			}
			m[k] = string(b)
		}
		return m
	}
	before := bucket()
	for _, tc := range []struct {
		name string
		req  CreateRequest
		want error
	}{
		{"/s", CreateRequest{ContentType: "text/plain", ConfirmOnly: true}, nil},
		{"/s", CreateRequest{ContentType: "application/json", ConfirmOnly: true}, ErrConflict},
		{"/none", CreateRequest{ContentType: "text/plain", ConfirmOnly: true}, ErrNotFound},
		{"/x", CreateRequest{ContentType: "text/plain", Expiry: soon, ConfirmOnly: true}, ErrNotFound},
	} {
		_, created, err := e.Create(ctx, tc.name, tc.req)
		if created || (tc.want == nil && err != nil) || (tc.want != nil && !errors.Is(err, tc.want)) {
			t.Errorf("confirm-only create of %s (%s): created %v, %v; want %v", tc.name, tc.req.ContentType, created, err, tc.want)
		}
	}
	if after := bucket(); !maps.Equal(after, before) {
		t.Errorf("the confirm-only creates changed the bucket: %d objects, %d before", len(after), len(before))
	}
	if _, err := e.Head(ctx, "/none"); !errors.Is(err, ErrNotFound) {
		t.Errorf("head of /none: %v", err)
	}
}
