package streamstore

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

// The hooks name the stream's id, so that a stream deleted and created
// again under its name is told apart from the one before, and a delete is
// told after every append of that stream.
func TestHooksNameTheStreamID(t *testing.T) {
	ctx := context.Background()
	e := startEngine(t, memstore.New(), Config{})
	var mu sync.Mutex
	var got []string
	e.OnAppend(func(name, id string, first, next uint64) {
		mu.Lock()
		got = append(got, fmt.Sprintf("append %s %s %d-%d", name, id, first, next))
		mu.Unlock()
	})
	e.OnDelete(func(name, id string) {
		mu.Lock()
		got = append(got, fmt.Sprintf("delete %s %s", name, id))
		mu.Unlock()
	})
	old, _, err := e.Create(ctx, "/a", CreateRequest{ContentType: "text/plain", Records: recs("1", "2")})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Append(ctx, "/a", AppendRequest{Records: recs("3")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Delete(ctx, "/a"); err != nil {
		t.Fatal(err)
	}
	cur, _, err := e.Create(ctx, "/a", CreateRequest{ContentType: "text/plain"})
	if err != nil {
		t.Fatal(err)
	}
	if cur.ID == old.ID {
		t.Fatalf("the stream created again has the old id %s", old.ID)
	}
	if _, err := e.Append(ctx, "/a", AppendRequest{Records: recs("x")}); err != nil {
		t.Fatal(err)
	}
	want := []string{
		"append /a " + old.ID + " 0-2",
		"append /a " + old.ID + " 2-3",
		"delete /a " + old.ID,
		"append /a " + cur.ID + " 0-1",
	}
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(got, want) {
		t.Fatalf("hooks told\n%v\nwant\n%v", got, want)
	}
}
