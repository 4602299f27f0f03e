package picomq

// Subscriptions: writing a subscription's document, one writer at a time.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/streamstore"
)

// A subscription's document is written with m.mu released, so that one
// subscription's PUT (25 ms or more to a cloud bucket) holds up no other
// subscription's claims, acks or append notes. Each subscription has one
// writer at a time: whoever changes it first makes itself the writer
// (acquireLocked: it waits, m.mu released, while another is), and lets go
// with releaseLocked. The lock order is busy before m.mu: the writer keeps
// the busy mark across the PUT, and takes m.mu back after it.
//
// The writer changes a copy (draft), writes the copy, and only once it is
// in the bucket makes it the subscription's state (commitLocked). So
// everything else that reads a subscription under m.mu (GET, the claim of
// the next worker, the tick, a token check) sees saved state and never a
// claim, cursor or wake that the bucket may refuse: a request whose write
// fails is answered 503 and has changed nothing here, whatever others did
// meanwhile (a write storage did not confirm may still have landed in the
// bucket, which the answer says: storeFailed). Changes made in the
// background (append notes, the tick, webhook outcomes) are kept in
// memory when their write fails, as before, for the next write to carry.
//
// The loop never waits for a writer: the notes that concern a subscription
// being written are kept on it (subState.kept) and applied by its writer
// before it lets go, and the tick leaves a subscription being written to
// its next round. The document's version is touched by the writer alone,
// so a conditional PUT's If-Match is always the version this node wrote
// last.

// errSubGone is a subscription deleted while its next writer waited.
var errSubGone = errors.New("the subscription was deleted")

// acquireLocked makes the caller s's writer, waiting with m.mu released
// while another is. It fails when ctx ends first, or when s was deleted
// meanwhile (errSubGone).
func (m *subManager) acquireLocked(ctx context.Context, s *subState) error {
	for s.busy != nil {
		ch := s.busy
		m.mu.Unlock()
		select {
		case <-ch:
			m.mu.Lock()
		case <-ctx.Done():
			m.mu.Lock()
			return fmt.Errorf("waiting for the subscription's write: %w", ctx.Err())
		}
	}
	if m.subs[s.key] != s {
		return errSubGone
	}
	s.busy = make(chan struct{})
	return nil
}

// releaseLocked ends the caller's turn as s's writer. Notes kept while it
// wrote are applied and written first, in a goroutine that stays s's
// writer until none are left (a request's answer does not wait for them).
func (m *subManager) releaseLocked(s *subState) {
	if len(s.kept) > 0 && m.subs[s.key] == s {
		go func() {
			m.mu.Lock()
			defer m.mu.Unlock()
			m.drainLocked(s)
		}()
		return
	}
	s.kept = nil
	close(s.busy)
	s.busy = nil
}

// keep adds n to the notes kept for s's writer. Appends to one stream
// merge into its latest note, as the loop's queue merges them (note): a
// write held up for the length of its timeout while a followed stream
// takes appends would otherwise keep a note per loop round, for every
// subscription that follows the stream. Notes of different streams touch
// different links, so merging into an earlier place changes nothing.
func (s *subState) keep(n appendNote) { s.kept = keepNote(s.kept, n) }

// keepNote adds n to kept, merged as keep says, and returns kept.
func keepNote(kept []appendNote, n appendNote) []appendNote {
	for i := len(kept) - 1; i >= 0; i-- {
		k := &kept[i]
		if k.name != n.name {
			continue
		}
		if k.id == n.id && !k.deleted && !n.deleted {
			k.first, k.next = min(k.first, n.first), max(k.next, n.next)
			return kept
		}
		break
	}
	return append(kept, n)
}

// drainLocked applies and writes the notes kept on s, whose writer the
// caller is, until none are left, then lets s go.
func (m *subManager) drainLocked(s *subState) {
	for len(s.kept) > 0 && m.subs[s.key] == s {
		notes := s.kept
		s.kept = nil
		c := s.draft()
		changed, grew, quiet := false, false, true
		for _, n := range notes {
			rel, ok := strings.CutPrefix(n.name, s.Root)
			if !ok || rel == "" {
				continue
			}
			refused, makeWay := m.refusesLinkLocked(c, rel, n)
			if refused {
				continue
			}
			if makeWay != "" {
				c.unlinkIdle(makeWay)
				changed, quiet = true, false
			}
			quiet = quiet && c.quietTail(rel, n)
			ch, gr := c.applyNote(rel, n)
			changed, grew = changed || ch, grew || gr
		}
		switch {
		case changed && quiet:
			m.installLocked(s, c)
		case changed:
			m.saveBackgroundLocked(s, c, grew)
		}
	}
	s.kept = nil
	close(s.busy)
	s.busy = nil
}

// ownLocked looks up subscription id under root and makes the caller its
// writer; it answers 404 (no such subscription) or 503 (the request ended
// while waiting) and returns nil when it cannot.
func (m *subManager) ownLocked(ctx context.Context, w http.ResponseWriter, root, id string) *subState {
	for {
		s := m.lookupLocked(w, root, id)
		if s == nil {
			return nil
		}
		err := m.acquireLocked(ctx, s)
		switch {
		case err == nil:
			return s
		case errors.Is(err, errSubGone):
			continue // deleted meanwhile: look again (404, or a new one)
		}
		subError(w, http.StatusServiceUnavailable, "UNAVAILABLE", err.Error())
		return nil
	}
}

// draft returns a copy of s for its writer to change and commit: it shares
// nothing a change touches (the links and the snapshot are copied too).
func (s *subState) draft() *subState {
	c := *s
	c.Links = make(map[string]*subLink, len(s.Links))
	for p, l := range s.Links {
		lc := *l
		c.Links[p] = &lc
	}
	c.Snapshot = maps.Clone(s.Snapshot)
	c.Removed = slices.Clone(s.Removed)
	return &c
}

// commitLocked writes c, a draft of s whose writer the caller is, with
// m.mu released during the write, and makes it s's state once it is in
// the bucket. When the write fails s is left as it was.
func (m *subManager) commitLocked(s, c *subState) error {
	b, err := json.Marshal(c)
	if err != nil {
		return fmt.Errorf("encoding subscription %s: %w", s.ID, err)
	}
	key, ver := s.key, s.version
	m.mu.Unlock()
	ver, err = m.putDoc(key, b, ver)
	m.mu.Lock()
	if err != nil {
		return fmt.Errorf("saving subscription %s: %w", s.ID, err)
	}
	c.version = ver
	m.installLocked(s, c)
	return nil
}

// installLocked makes c s's state, in the manager's index and due heap
// too. What the manager keeps of s for itself (its place in the index and
// the heap, its writer and the notes kept for it) is s's, not the draft's.
func (m *subManager) installLocked(s, c *subState) {
	c.key, c.indexed, c.dueAt, c.dueIdx, c.busy, c.kept, c.posting = s.key, s.indexed, s.dueAt, s.dueIdx, s.busy, s.kept, s.posting
	reindex := !sameExplicit(s, c)
	*s = *c
	if reindex {
		m.index.update(s)
	}
	m.scheduleLocked(s)
}

// sameExplicit reports whether a and b link the same streams explicitly,
// which is what the index keeps of a subscription's links.
func sameExplicit(a, b *subState) bool {
	n := 0
	for p, l := range a.Links {
		if l.Explicit {
			if bl := b.Links[p]; bl == nil || !bl.Explicit {
				return false
			}
			n++
		}
	}
	for _, l := range b.Links {
		if l.Explicit {
			n--
		}
	}
	return n == 0
}

// saveBackgroundLocked commits c, a change made in the background to s
// (whose writer the caller is), starting a wake in it with wake set, as
// wakeOrSaveLocked does. A change that cannot be written is kept in memory
// all the same (without a wake it would have started: not durable, so not
// issued) and logged: the next write of s carries it.
func (m *subManager) saveBackgroundLocked(s, c *subState, wake bool) {
	var err error
	if wake {
		err = m.wakeOrSaveLocked(s, c)
	} else {
		err = m.commitLocked(s, c)
	}
	if err != nil {
		m.log.Error("saving subscription", zap.String("id", s.ID), zap.Error(err))
		m.installLocked(s, c)
	}
}

// subBackgroundWrites bounds the writes the loop starts that are under way
// at once: one append to a stream that many subscriptions follow starts a
// write for each of them, which would otherwise all go to the bucket
// together.
const subBackgroundWrites = 16

// writeInBackgroundLocked makes the loop's change c of s, which has no
// writer, in a goroutine that is s's writer until it is written (and
// then runs after, if any): the loop does not wait for the bucket. The
// goroutine waits for one of subBackgroundWrites places first (or for the
// engine to close, when the write fails at once).
func (m *subManager) writeInBackgroundLocked(s, c *subState, wake bool, after func(*subState)) {
	s.busy = make(chan struct{})
	if m.bgWrites == nil {
		m.bgWrites = make(chan struct{}, subBackgroundWrites)
	}
	places := m.bgWrites
	go func() {
		select {
		case places <- struct{}{}:
			defer func() { <-places }()
		case <-m.ctx.Done():
		}
		m.mu.Lock()
		defer m.mu.Unlock()
		m.saveBackgroundLocked(s, c, wake)
		if after != nil {
			after(s)
		}
		m.drainLocked(s)
	}()
}

// putSub writes s, which no one else can see yet (a create, or a load
// before the manager serves), and records its version.
func (m *subManager) putSub(s *subState) error {
	b, err := json.Marshal(s)
	if err != nil {
		return fmt.Errorf("encoding subscription %s: %w", s.ID, err)
	}
	ver, err := m.putDoc(s.key, b, s.version)
	if err != nil {
		return fmt.Errorf("saving subscription %s: %w", s.ID, err)
	}
	s.version = ver
	return nil
}

// subDocTimeout bounds one write of a subscription's document, its
// retries included. The writes run under the manager's context, not a
// request's: a client that leaves does not cut a write short, whose
// outcome would then be unknown.
const subDocTimeout = 30 * time.Second

// putDoc writes document key with compare-and-swap on version ver (""
// for a create) and returns its new version. The caller is the
// document's only writer on this node (its subscription's writer).
func (m *subManager) putDoc(key string, b []byte, ver string) (string, error) {
	ctx, cancel := context.WithTimeout(m.ctx, subDocTimeout)
	defer cancel()
	nv, err := m.eng.PutDoc(ctx, key, b, ver)
	if !errors.Is(err, streamstore.ErrDocConflict) {
		return nv, err
	}
	// This node has one writer per document, so while it holds the
	// storage the only other writer was an earlier attempt of ours whose
	// response was lost but which landed: take the stored version and
	// write again. Another process of the same node id takes the storage
	// over at once, and its writes would be overwritten just the same, so
	// the lease object is read first.
	if cerr := m.eng.ConfirmOwner(ctx); cerr != nil {
		return "", cerr
	}
	cur, etag, gerr := m.eng.GetDoc(ctx, key)
	switch {
	case gerr == nil && bytes.Equal(cur, b):
		return etag, nil
	case gerr == nil:
		return m.eng.PutDoc(ctx, key, b, etag)
	case errors.Is(gerr, streamstore.ErrNotFound):
		return m.eng.PutDoc(ctx, key, b, "")
	}
	return "", gerr
}
