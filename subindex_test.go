package picomq

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// indexedIDs is the ids of the subscriptions the index offers for name.
func indexedIDs(x *subIndex, name string) []string {
	var ids []string
	x.candidates(name, func(s *subState) { ids = append(ids, s.ID) })
	slices.Sort(ids)
	return ids
}

// TestSubIndexCandidates: a stream is offered to the subscriptions that
// list it and to those whose pattern's literal part is a prefix of it at
// a segment boundary, in their root, and to no other; re-indexing after
// explicit streams are added or removed follows them.
func TestSubIndexCandidates(t *testing.T) {
	sub := func(id, root, pattern string, explicit ...string) *subState {
		s := &subState{ID: id, Root: root, Config: subConfig{Pattern: pattern}, Links: map[string]*subLink{}}
		for _, p := range explicit {
			s.Links[p] = &subLink{Explicit: true}
		}
		return s
	}
	var x subIndex
	subs := []*subState{
		sub("all", "/app/", "**"),
		sub("orders", "/app/", "orders/*"),
		sub("deep", "/app/", "orders/eu/*/items"),
		sub("list", "/app/", "", "orders/7", "users/1"),
		sub("other-root", "/other/", "**", "orders/7"),
		sub("nested-root", "/app/orders/", "*"),
		sub("top", "/", "x/*"),
	}
	for _, s := range subs {
		x.add(s)
	}
	for _, tc := range []struct {
		name string
		want []string
	}{
		{"/app/orders/7", []string{"all", "list", "nested-root", "orders"}},
		{"/app/orders/eu/3/items", []string{"all", "deep", "nested-root", "orders"}},
		{"/app/users/1", []string{"all", "list"}},
		{"/app/users/2", []string{"all"}},
		{"/app/ordersX/1", []string{"all"}},
		{"/other/orders/7", []string{"other-root"}},
		{"/x/y", []string{"top"}},
		{"/x", nil},
		{"/elsewhere/a", nil},
	} {
		if got := indexedIDs(&x, tc.name); !slices.Equal(got, tc.want) {
			t.Errorf("%s: offered to %v, want %v", tc.name, got, tc.want)
		}
	}

	list := subs[3]
	delete(list.Links, "users/1")
	list.Links["users/2"] = &subLink{Explicit: true}
	x.update(list)
	if got := indexedIDs(&x, "/app/users/1"); !slices.Equal(got, []string{"all"}) {
		t.Errorf("after users/1 left the list: offered to %v", got)
	}
	if got := indexedIDs(&x, "/app/users/2"); !slices.Equal(got, []string{"all", "list"}) {
		t.Errorf("after users/2 joined the list: offered to %v", got)
	}
	for _, s := range subs {
		x.remove(s)
	}
	if len(x.explicit) != 0 || len(x.prefix) != 0 {
		t.Errorf("the index keeps %d explicit and %d prefix entries after every subscription left", len(x.explicit), len(x.prefix))
	}
}

// TestSubIndexMissesNoLink: for random subscriptions and streams, every
// subscription with a link of the stream or a pattern matching it, which
// are those applyNote acts on, is offered the stream.
func TestSubIndexMissesNoLink(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	segs := []string{"a", "b", "c"}
	randPath := func(n int) string {
		p := segs[rng.IntN(len(segs))]
		for range rng.IntN(n) {
			p += "/" + segs[rng.IntN(len(segs))]
		}
		return p
	}
	roots := []string{"/", "/a/", "/a/b/", "/c/"}
	var x subIndex
	var subs []*subState
	for i := range 300 {
		s := &subState{ID: fmt.Sprint(i), Root: roots[rng.IntN(len(roots))], Links: map[string]*subLink{}}
		if rng.IntN(2) == 0 {
			pat := []string{"*", "**", "a", "b"}
			s.Config.Pattern = pat[rng.IntN(len(pat))]
			for range rng.IntN(3) {
				s.Config.Pattern += "/" + pat[rng.IntN(len(pat))]
			}
		}
		for range rng.IntN(3) {
			s.Links[randPath(3)] = &subLink{Explicit: true}
		}
		subs = append(subs, s)
		x.add(s)
	}
	for range 2000 {
		name := "/" + randPath(5)
		offered := map[string]bool{}
		x.candidates(name, func(s *subState) { offered[s.ID] = true })
		for _, s := range subs {
			rel := name[min(len(s.Root), len(name)):]
			if name[:min(len(s.Root), len(name))] != s.Root || rel == "" {
				continue
			}
			if (s.Links[rel] != nil || (s.Config.Pattern != "" && globMatch(s.Config.Pattern, rel))) && !offered[s.ID] {
				t.Fatalf("%s is not offered to subscription %s (root %s, pattern %q, links %v)",
					name, s.ID, s.Root, s.Config.Pattern, s.Links)
			}
		}
	}
}
