package picomq

import "strings"

// subIndex finds the subscriptions an append or delete of a stream can
// concern without looking at the others: the manager used to try every
// subscription of the engine, every root, on every notification, which
// took 90 ms per appended stream with 100,000 subscriptions under the
// loop's lock (BenchmarkSubscriptionMatch).
//
// Every link of a subscription is explicit or matches its pattern (a glob
// link is made only where the pattern matches, and a pattern never
// changes: another configuration under the id is a 409), so a stream
// concerns the subscriptions that list it explicitly and those whose
// pattern's literal part (root + the segments before its first wildcard)
// is a prefix of its name at a segment boundary. Patterns are kept by that
// literal part, so a notification costs a map lookup per segment of the
// stream's name, plus the subscriptions it finds.
type subIndex struct {
	explicit map[string]map[*subState]struct{} // full stream name -> subscriptions listing it
	prefix   map[string]map[*subState]struct{} // root + literal prefix of the pattern -> subscriptions
	perRoot  map[string]int                    // root -> how many subscriptions it has
}

// subIndexed is where one subscription is in the index, to take it out.
type subIndexed struct {
	explicit []string
	prefix   string // "" when the subscription has no pattern
}

func addTo(m map[string]map[*subState]struct{}, k string, s *subState) map[string]map[*subState]struct{} {
	if m == nil {
		m = map[string]map[*subState]struct{}{}
	}
	set := m[k]
	if set == nil {
		set = map[*subState]struct{}{}
		m[k] = set
	}
	set[s] = struct{}{}
	return m
}

func removeFrom(m map[string]map[*subState]struct{}, k string, s *subState) {
	if set := m[k]; set != nil {
		delete(set, s)
		if len(set) == 0 {
			delete(m, k)
		}
	}
}

// add indexes s as it is now: its pattern and its explicit links.
func (x *subIndex) add(s *subState) {
	if x.perRoot == nil {
		x.perRoot = map[string]int{}
	}
	x.perRoot[s.Root]++
	s.indexed = subIndexed{}
	if s.Config.Pattern != "" {
		s.indexed.prefix = s.Root + globLiteralPrefix(s.Config.Pattern)
		x.prefix = addTo(x.prefix, s.indexed.prefix, s)
	}
	for p, l := range s.Links {
		if l.Explicit {
			s.indexed.explicit = append(s.indexed.explicit, s.Root+p)
			x.explicit = addTo(x.explicit, s.Root+p, s)
		}
	}
}

// remove takes s out of the index, as it was indexed.
func (x *subIndex) remove(s *subState) {
	if x.perRoot[s.Root]--; x.perRoot[s.Root] <= 0 {
		delete(x.perRoot, s.Root)
	}
	if s.indexed.prefix != "" {
		removeFrom(x.prefix, s.indexed.prefix, s)
	}
	for _, name := range s.indexed.explicit {
		removeFrom(x.explicit, name, s)
	}
	s.indexed = subIndexed{}
}

// update re-indexes s after its explicit links changed.
func (x *subIndex) update(s *subState) {
	x.remove(s)
	x.add(s)
}

// candidates calls f once for every subscription that stream name may
// concern: it may still not (a pattern's literal part matching is not the
// pattern matching), which applyNote decides.
func (x *subIndex) candidates(name string, f func(*subState)) {
	seen := map[*subState]struct{}{}
	visit := func(set map[*subState]struct{}) {
		for s := range set {
			if _, ok := seen[s]; !ok {
				seen[s] = struct{}{}
				f(s)
			}
		}
	}
	visit(x.explicit[name])
	if len(x.prefix) == 0 {
		return
	}
	// Every prefix of the name that ends at a "/" and leaves a non-empty
	// rest: a root, or a root and a pattern's literal segments.
	for i := strings.IndexByte(name, '/'); i >= 0 && i < len(name)-1; {
		visit(x.prefix[name[:i+1]])
		j := strings.IndexByte(name[i+1:], '/')
		if j < 0 {
			break
		}
		i += 1 + j
	}
}
