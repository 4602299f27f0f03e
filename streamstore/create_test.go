package streamstore

import (
	"context"
	"errors"
	"sync"
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
			st.Fail = ops.hook
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
	st.Fail = func(op, key string) error {
		if op == "PUT" && key == metaKey(name) {
			once.Do(func() { close(held) })
			<-release
		}
		return nil
	}
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
	// The lookup queues behind the create's claim on the name.
	time.Sleep(20 * time.Millisecond)
	close(release)

	if r := <-createDone; r.err != nil || r.created {
		t.Fatalf("create of a taken name with the same config: created %v, err %v; want false, nil", r.created, r.err)
	}
	if err := <-headDone; err != nil {
		t.Fatalf("head while the create was refused: %v", err)
	}
}
