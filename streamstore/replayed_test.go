package streamstore

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

// TestTakeReplayed: a start keeps, for the append hook's user, the streams
// its replay found appends of that are still under their names (not one
// deleted, nor an earlier stream under a name, nor one whose appends
// compaction retired), with where their appends began. It gives them once.
func TestTakeReplayed(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	e := startEngine(t, st, Config{})
	create := func(name string, bodies ...string) {
		t.Helper()
		if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "text/plain", Records: recs(bodies...)}); err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
	}
	// Folded, and its WAL retired: nothing to replay.
	create("/folded", "x")
	if err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	create("/kept", "a", "b")
	if _, err := e.Append(ctx, "/kept", AppendRequest{Records: recs("c")}); err != nil {
		t.Fatal(err)
	}
	create("/deleted", "a")
	if err := e.Delete(ctx, "/deleted"); err != nil {
		t.Fatal(err)
	}
	create("/again", "old")
	if err := e.Delete(ctx, "/again"); err != nil {
		t.Fatal(err)
	}
	create("/again", "new 1", "new 2")
	create("/empty")
	ids := map[string]string{}
	for _, name := range []string{"/kept", "/again"} {
		in, err := e.Head(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		ids[name] = in.ID
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}

	e2 := startEngine(t, st, Config{})
	if p := e2.StartProgress(); p < 2 {
		t.Errorf("start progress %d after replaying the WAL, want 2 or more", p)
	}
	got := e2.TakeReplayed()
	slices.SortFunc(got, func(a, b ReplayedStream) int { return strings.Compare(a.Name, b.Name) })
	var names []string
	for _, r := range got {
		names = append(names, r.Name)
		if r.ID != ids[r.Name] {
			t.Errorf("%s replayed with id %s, want %s", r.Name, r.ID, ids[r.Name])
		}
		if len(r.Points) == 0 || r.Points[0].Seq != 0 || r.Points[0].Time == 0 {
			t.Errorf("%s replayed from %+v, want from seq 0 with its time", r.Name, r.Points)
		}
	}
	if want := []string{"/again", "/kept"}; !slices.Equal(names, want) {
		t.Fatalf("replayed %v, want %v", names, want)
	}
	if next := got[1].Next; next != 3 {
		t.Errorf("/kept replayed to %d, want 3", next)
	}
	if again := e2.TakeReplayed(); len(again) != 0 {
		t.Errorf("taken again: %v", again)
	}
}
