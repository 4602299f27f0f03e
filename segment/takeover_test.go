package segment_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// A process that took the storage over (a process of the same node id
// takes the lease at once) must fence the manifest writes of the one it
// replaced from the moment its replay reads the manifest: the old process
// checks the lease and then writes, and a namespace it registered, or a
// WAL retirement it recorded, after the replay read the manifest went
// unseen by the new owner, along with what it acknowledged there.
func TestReplayFencesTheProcessItReplaced(t *testing.T) {
	retire := func(m *segment.Manifest) error {
		for i := range m.Namespaces {
			m.Namespaces[i].ReplayFrom++
		}
		return nil
	}
	cases := []struct {
		name  string
		write func(ctx context.Context, old *segment.Manifests) error
	}{
		{"register a namespace", func(ctx context.Context, old *segment.Manifests) error {
			_, err := old.RegisterNamespace(ctx)
			return err
		}},
		{"retire WAL objects", func(ctx context.Context, old *segment.Manifests) error {
			_, err := old.Update(ctx, retire)
			return err
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			old := segment.NewManifests(st)
			nsOld, err := segment.Replay(ctx, st, old, "old", segment.ReplayFuncs{Apply: func(string, *segment.WALObject) error { return nil }})
			if err != nil {
				t.Fatalf("first replay: %v", err)
			}
			data, _ := segment.EncodeWAL(nsOld, 0, nil)
			if _, err := st.Put(ctx, segment.WALKey(nsOld, 0), data, segment.PutOptions{IfNoneMatch: true}); err != nil {
				t.Fatal(err)
			}

			// The old process writes the manifest while the new one replays.
			var during error
			applied := 0
			cur := segment.NewManifests(st)
			nsNew, err := segment.Replay(ctx, st, cur, "new", segment.ReplayFuncs{Apply: func(string, *segment.WALObject) error {
				applied++
				during = tc.write(ctx, old)
				return nil
			}})
			if err != nil {
				t.Fatalf("replay of the process taking over: %v", err)
			}
			if applied != 1 {
				t.Fatalf("the new process replayed %d WAL objects, want 1", applied)
			}
			if !errors.Is(during, segment.ErrFenced) {
				t.Errorf("the old process's manifest write during the new one's replay: %v, want ErrFenced", during)
			}
			if after := tc.write(ctx, old); !errors.Is(after, segment.ErrFenced) {
				t.Errorf("the old process's manifest write after the new one's replay: %v, want ErrFenced", after)
			}

			man, _, err := cur.Load(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if man.NextNamespace != nsNew+1 {
				t.Errorf("next namespace %d, want %d: a namespace was registered after the new process's", man.NextNamespace, nsNew+1)
			}
			for _, n := range man.Namespaces {
				if n.ID == nsOld && (n.ReplayFrom != 0 || n.SealedAt == nil || *n.SealedAt != 1) {
					t.Errorf("old namespace in the manifest: %+v, want replay from 0 sealed at 1", n)
				}
			}
			// The new owner writes on, and takes itself over again (a
			// start that failed after its replay and is tried once more).
			if _, err := cur.RegisterNamespace(ctx); err != nil {
				t.Errorf("the new owner registering a namespace: %v", err)
			}
			if _, err := segment.Replay(ctx, st, cur, "new-again", segment.ReplayFuncs{Apply: func(string, *segment.WALObject) error { return nil }}); err != nil {
				t.Errorf("the new owner's start tried again: %v", err)
			}
		})
	}
}

// TestReplayRefusesDamagedHeaders: a WAL object's header (its magic, its
// namespace and sequence) is not under the entries' checksums. One flipped
// bit turned a WAL object's magic into a seal's, and replay took it for
// the end of the log and stopped there without a word, dropping it and
// every acknowledged batch after it; a header naming another sequence had
// its entries applied at that position. Replay now stops the start with
// ErrCorrupt for both, as for any damaged object.
func TestReplayRefusesDamagedHeaders(t *testing.T) {
	entry := &segment.Entry{StreamID: "id", Name: "/s", FirstSeq: 0, Records: []segment.Record{{Seq: 0, Body: []byte("acknowledged")}}}
	for _, tc := range []struct {
		name   string
		damage func(ns uint64) []byte // the object at WALKey(ns, 0)
	}{
		{"a magic one bit from a seal's", func(ns uint64) []byte {
			data, _ := segment.EncodeWAL(ns, 0, []*segment.Entry{entry})
			data[3] ^= 'W' ^ 'S' // PMQW becomes PMQS
			return data
		}},
		{"another sequence in the header", func(ns uint64) []byte {
			data, _ := segment.EncodeWAL(ns, 7, []*segment.Entry{entry})
			return data
		}},
		{"another namespace in the header", func(ns uint64) []byte {
			data, _ := segment.EncodeWAL(ns+1, 0, []*segment.Entry{entry})
			return data
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			ns, err := segment.Replay(ctx, st, segment.NewManifests(st), "first", segment.ReplayFuncs{Apply: func(string, *segment.WALObject) error { return nil }})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := st.Put(ctx, segment.WALKey(ns, 0), tc.damage(ns), segment.PutOptions{IfNoneMatch: true}); err != nil {
				t.Fatal(err)
			}
			_, err = segment.Replay(ctx, st, segment.NewManifests(st), "second", segment.ReplayFuncs{Apply: func(string, *segment.WALObject) error { return nil }})
			if !errors.Is(err, segment.ErrCorrupt) {
				t.Fatalf("replay over the damaged object: %v, want ErrCorrupt", err)
			}
		})
	}
	// A seal as processes write it still decodes as one.
	obj, err := segment.DecodeWAL(segment.EncodeSeal(3, 4, "0123456789abcdef01234567"))
	if err != nil || !obj.Sealed || obj.Namespace != 3 || obj.Seq != 4 || obj.SealToken != "0123456789abcdef01234567" {
		t.Fatalf("a seal decodes as %+v, %v", obj, err)
	}
}

// A WAL object missing below its namespace's seal was lost: an earlier
// replay applied every object up to the seal, and compaction moves the
// namespace's start before it deletes any. Replay refuses to start over
// it, naming the key, where it used to seal the gap without a word and
// drop the acknowledged objects after it. A gap in a namespace no replay
// has sealed yet is where its writer stopped, and is sealed as before.
func TestReplayRefusesAGapBelowTheSeal(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	apply := segment.ReplayFuncs{Apply: func(string, *segment.WALObject) error { return nil }}
	ns, err := segment.Replay(ctx, st, segment.NewManifests(st), "first", apply)
	if err != nil {
		t.Fatal(err)
	}
	for seq := range uint64(3) {
		entry := &segment.Entry{StreamID: "id", Name: "/s", FirstSeq: seq, Records: []segment.Record{{Seq: seq, Body: []byte("acknowledged")}}}
		data, _ := segment.EncodeWAL(ns, seq, []*segment.Entry{entry})
		if _, err := st.Put(ctx, segment.WALKey(ns, seq), data, segment.PutOptions{IfNoneMatch: true}); err != nil {
			t.Fatal(err)
		}
	}
	// The second process seals the first's namespace at 3.
	var applied []string
	count := segment.ReplayFuncs{Apply: func(key string, _ *segment.WALObject) error { applied = append(applied, key); return nil }}
	if _, err := segment.Replay(ctx, st, segment.NewManifests(st), "second", count); err != nil {
		t.Fatal(err)
	}
	if len(applied) != 3 {
		t.Fatalf("the first replay applied %v; want the 3 objects", applied)
	}
	lost := segment.WALKey(ns, 1)
	if err := st.Delete(ctx, []string{lost}); err != nil {
		t.Fatal(err)
	}
	applied = nil
	_, err = segment.Replay(ctx, st, segment.NewManifests(st), "third", count)
	if !errors.Is(err, segment.ErrCorrupt) || !strings.Contains(err.Error(), lost) {
		t.Fatalf("replay over %s missing below the seal: %v (applied %v); want ErrCorrupt naming it", lost, err, applied)
	}
	if seal, _, err := st.Get(ctx, lost, 0, -1); err == nil {
		t.Fatalf("the replay wrote %d bytes at the lost object's key; want it left for a restore", len(seal))
	}
}

// A manifest whose next namespace number went back (restored from an
// older copy, edited) is refused when a process registers its namespace:
// its writer's uploads would meet the old objects at their keys, and an
// old batch could be taken for its own. It used to take the number.
func TestRegisteringANamespaceRefusesOneInUse(t *testing.T) {
	apply := segment.ReplayFuncs{Apply: func(string, *segment.WALObject) error { return nil }}
	for _, tc := range []struct {
		name string
		bend func(m *segment.Manifest)
	}{
		{"a listed namespace", func(m *segment.Manifest) { m.NextNamespace = m.Namespaces[len(m.Namespaces)-1].ID }},
		{"a retired namespace", func(m *segment.Manifest) {
			m.RetiredWAL = append(m.RetiredWAL, m.NextNamespace+2)
		}},
		{"an unlisted namespace with objects in the bucket", func(m *segment.Manifest) {
			// The copy from before the first process registered.
			m.NextNamespace, m.Namespaces = m.Namespaces[0].ID, nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			mans := segment.NewManifests(st)
			first, err := segment.Replay(ctx, st, mans, "first", apply)
			if err != nil {
				t.Fatal(err)
			}
			entry := &segment.Entry{StreamID: "id", Name: "/s", Records: []segment.Record{{Body: []byte("acknowledged")}}}
			data, _ := segment.EncodeWAL(first, 0, []*segment.Entry{entry})
			if _, err := st.Put(ctx, segment.WALKey(first, 0), data, segment.PutOptions{IfNoneMatch: true}); err != nil {
				t.Fatal(err)
			}
			if _, err := mans.Update(ctx, func(m *segment.Manifest) error { tc.bend(m); return nil }); err != nil {
				t.Fatal(err)
			}
			before, _, err := segment.NewManifests(st).Load(ctx)
			if err != nil {
				t.Fatal(err)
			}
			ns, err := segment.Replay(ctx, st, segment.NewManifests(st), "second", apply)
			if !errors.Is(err, segment.ErrCorrupt) || !strings.Contains(err.Error(), "namespace") {
				t.Fatalf("replay registered namespace %d (%v) over a manifest whose next number is in use; want ErrCorrupt", ns, err)
			}
			if _, err := segment.NewManifests(st).RegisterNamespace(ctx); !errors.Is(err, segment.ErrCorrupt) {
				t.Fatalf("RegisterNamespace over it: %v; want ErrCorrupt", err)
			}
			after, _, err := segment.NewManifests(st).Load(ctx)
			if err != nil || after.NextNamespace != before.NextNamespace || len(after.Namespaces) != len(before.Namespaces) {
				t.Fatalf("the refused registrations changed the manifest: %+v, was %+v (%v)", after, before, err)
			}
		})
	}
}

// A namespace an earlier replay sealed with nothing left to replay costs a
// start no request: a process restarting faster than it compacts (a crash
// loop) leaves one per start, and each used to be listed at every start.
func TestReplaySkipsSealedEmptyNamespaces(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	apply := segment.ReplayFuncs{Apply: func(string, *segment.WALObject) error { return nil }}
	const starts = 5
	for i := range starts {
		if _, err := segment.Replay(ctx, st, segment.NewManifests(st), fmt.Sprint("p", i), apply); err != nil {
			t.Fatal(err)
		}
	}
	m, _, err := segment.NewManifests(st).Load(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sealed := 0
	for _, n := range m.Namespaces {
		if n.SealedAt != nil && n.ReplayFrom >= *n.SealedAt {
			sealed++
		}
	}
	if sealed != starts-1 {
		t.Fatalf("%d namespaces sealed with nothing to replay in %+v; want %d", sealed, m.Namespaces, starts-1)
	}
	lists := &countingLists{Store: st}
	if _, err := segment.Replay(ctx, lists, segment.NewManifests(lists), "last", apply); err != nil {
		t.Fatal(err)
	}
	// The namespace of the previous start, not sealed yet, is listed, and
	// the new one's prefix is checked free.
	if got := lists.n.Load(); got != 2 {
		t.Fatalf("a start over %d sealed empty namespaces made %d LISTs; want 2", sealed, got)
	}
}

// countingLists counts the LISTs made through it.
type countingLists struct {
	*memstore.Store
	n atomic.Int64
}

func (c *countingLists) List(ctx context.Context, prefix, after string, limit int) ([]segment.ObjectInfo, bool, error) {
	c.n.Add(1)
	return c.Store.List(ctx, prefix, after, limit)
}

// A replay tells of each page of WAL keys it lists (ReplayFuncs.Listed):
// a WAL long enough takes minutes to list before anything is applied, and
// a start bounded by its progress must see it moving.
func TestReplayTellsOfEachListedPage(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	apply := segment.ReplayFuncs{Apply: func(string, *segment.WALObject) error { return nil }}
	ns, err := segment.Replay(ctx, st, segment.NewManifests(st), "first", apply)
	if err != nil {
		t.Fatal(err)
	}
	const objects = 2100 // three pages of 1,000 keys
	for seq := range uint64(objects) {
		entry := &segment.Entry{StreamID: "id", Name: "/s", FirstSeq: seq, Records: []segment.Record{{Seq: seq, Body: []byte("x")}}}
		data, _ := segment.EncodeWAL(ns, seq, []*segment.Entry{entry})
		if _, err := st.Put(ctx, segment.WALKey(ns, seq), data, segment.PutOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	pages, applied := 0, 0
	fn := segment.ReplayFuncs{
		Listed: func() { pages++ },
		Apply:  func(string, *segment.WALObject) error { applied++; return nil },
	}
	if _, err := segment.Replay(ctx, st, segment.NewManifests(st), "second", fn); err != nil {
		t.Fatal(err)
	}
	if pages < 3 || applied != objects {
		t.Fatalf("told of %d listed pages and %d objects, want 3 or more and %d", pages, applied, objects)
	}
}
