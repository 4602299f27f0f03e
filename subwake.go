package picomq

// Subscriptions: applying append notes, and waking subscriptions by webhook or wake stream.

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/streamstore"
)

// applyNoteLocked links and advances streams that got records, and starts
// over the links of streams deleted or created again, in the subscriptions
// the index finds for the stream. A subscription being written keeps the
// note for its writer to apply; the write of one that changes is started
// in the background (writeInBackgroundLocked): the loop waits for no PUT.
func (m *subManager) applyNoteLocked(n appendNote) {
	for _, cr := range m.creating {
		if strings.HasPrefix(n.name, cr.root) {
			cr.kept = keepNote(cr.kept, n)
		}
	}
	var adding map[*subState]bool
	for s, names := range m.adding {
		if names[n.name] {
			s.keep(n) // s's writer is linking the stream
			if adding == nil {
				adding = map[*subState]bool{}
			}
			adding[s] = true
		}
	}
	m.index.candidates(n.name, func(s *subState) {
		rel, ok := strings.CutPrefix(n.name, s.Root)
		if !ok || rel == "" || adding[s] {
			return
		}
		if s.busy != nil {
			// Kept whatever it is: s's writer may be linking the stream.
			s.keep(n)
			return
		}
		if s.Links[rel] == nil && (n.deleted || s.Config.Pattern == "" || !globMatch(s.Config.Pattern, rel)) {
			return // a stream s does not follow: no draft to copy
		}
		refused, makeWay := m.refusesLinkLocked(s, rel, n)
		if refused {
			return
		}
		if makeWay == "" && s.quietTail(rel, n) {
			// s has no writer: it changes in place, as its writer would.
			l := s.Links[rel]
			l.Tail = max(l.Tail, n.next)
			return
		}
		c := s.draft()
		if makeWay != "" {
			c.unlinkIdle(makeWay)
		}
		if changed, grew := c.applyNote(rel, n); changed || makeWay != "" {
			m.writeInBackgroundLocked(s, c, grew, nil)
		}
	})
}

// refusesLinkLocked reports whether note n would link stream rel to s by
// its pattern while s links the most streams it may (subMaxLinks). A
// pattern over streams that are never deleted (a room per chat) fills its
// links in time, so a glob link with nothing pending makes way (makeWay
// names it, for the caller to unlink): the next record of its stream
// links it again from there, as if it had never gone. With none, the note
// is refused, counted and logged: the subscription does not follow that
// stream until it has room again.
func (m *subManager) refusesLinkLocked(s *subState, rel string, n appendNote) (refused bool, makeWay string) {
	if n.deleted || s.Links[rel] != nil || s.Config.Pattern == "" || !globMatch(s.Config.Pattern, rel) {
		return false, ""
	}
	limit := m.owner.linkLimit()
	if s.liveLinks() < limit {
		return false, ""
	}
	if p := s.idleGlobLink(); p != "" {
		return false, p
	}
	if m.owner != nil && m.owner.metrics != nil {
		m.owner.metrics.subLinksRefused.Add(1)
	}
	m.refusedLog.warn(m.log, "a stream matches a subscription's pattern but is not linked: the subscription links the most streams it may, each with records pending",
		zap.String("subscription", s.ID), zap.String("root", s.Root), zap.String("stream", rel), zap.Int("max_links", limit))
	return true, ""
}

// idleGlobLink returns a link of s that its pattern made and that can go
// with nothing lost: every record acked, and no worker that may still ack
// it (one holding the lease, or a wake in flight that offered it). The
// first such by name, so that which one goes does not depend on map
// order; "" when there is none.
func (s *subState) idleGlobLink() string {
	best := ""
	for p, l := range s.Links {
		if !l.Glob || l.Explicit || l.Gone || l.Acked < l.Tail || (best != "" && p > best) {
			continue
		}
		if _, offered := s.Snapshot[p]; s.Holder != "" || offered {
			continue
		}
		best = p
	}
	return best
}

// unlinkIdle removes link p, which idleGlobLink chose. A webhook's worker
// may have seen it in a GET of the subscription: its ack of it moves
// nothing, and is no reason to refuse the rest of the ack.
func (s *subState) unlinkIdle(p string) {
	delete(s.Links, p)
	delete(s.Snapshot, p)
	if s.WakeID != "" {
		s.noteRemoved(p)
	}
}

// quietTail reports whether note n, for s's link of rel, can only move the
// link's tail (the link counts in n's stream already) while s has a wake
// in flight or a lease held, so that it starts no wake. Such a change is
// not written: the load reads every linked stream's tail from the stream
// (reconcile), and the next write of s carries it. Every append to a
// followed stream wrote the whole document again while a worker was at
// it.
func (s *subState) quietTail(rel string, n appendNote) bool {
	l := s.Links[rel]
	return (s.WakeID != "" || s.Holder != "") && !n.deleted && l != nil && l.Stream != "" && l.Stream == n.id
}

// applyNote applies n to s's link of rel (n.name relative to s.Root) and
// reports whether s changed, and whether it was by the link's tail growing.
func (s *subState) applyNote(rel string, n appendNote) (changed, grew bool) {
	l := s.Links[rel]
	if n.deleted {
		// A link that counts in another stream (a newer one) stays.
		if l == nil || (l.Stream != "" && l.Stream != n.id) || (l.Stream == "" && l.Tail == 0 && (l.Explicit || l.Gone)) {
			return false, false
		}
		s.streamGone(rel, l)
		return true, false
	}
	switch {
	case l == nil:
		if s.Config.Pattern == "" || !globMatch(s.Config.Pattern, rel) {
			return false, false
		}
		// Discovered by this append: linked before it.
		l = &subLink{Glob: true, Acked: n.first, Tail: n.first, Stream: n.id}
		s.Links[rel] = l
		changed = true
	case l.Stream == n.id:
	case l.Stream != "" || n.first < l.Tail:
		// Another stream under the name than the one the offsets count
		// in (one without an id is another when its records start below
		// the tail: a stream's appends come in order).
		s.startOver(rel, l, n.id, 0)
		changed = true
	default:
		// Linked when no stream was there, or stored without an id.
		l.Stream, l.Gone = n.id, false
		changed = true
	}
	if n.next <= l.Tail {
		return changed, false
	}
	l.Tail = n.next
	return true, true
}

// wakeOrSaveLocked commits c, a draft of s whose writer the caller is,
// starting a wake in it when it has pending work and none is in flight. On
// failure s is as it was and c as it was given, without the wake (not
// durable, so not issued: the tick tries again), and the error is
// returned, so that a request whose change it saves can answer 503.
func (m *subManager) wakeOrSaveLocked(s, c *subState) error {
	c.dropGone()
	if c.WakeID != "" || c.Holder != "" || !c.pending() || c.backingOff(time.Now()) {
		return m.commitLocked(s, c)
	}
	wc := c.draft()
	wc.Generation++
	wc.WakeID = newWakeID()
	wc.NextTry = 0
	if wc.Config.Type != "webhook" {
		// A webhook's failures count on until a delivery is answered,
		// so that its backoff grows across wakes (tickLeaseExpiry).
		wc.Failures = 0
	}
	if wc.Config.Type == "webhook" {
		wc.LeaseUntil = time.Now().Add(wc.lease()).UnixMilli()
	}
	if err := m.commitLocked(s, wc); err != nil {
		return fmt.Errorf("saving a new wake: %w", err)
	}
	if s.Config.Type == "webhook" {
		m.deliverLocked(s)
	} else {
		m.writeWakeEventLocked(s)
	}
	return nil
}

// tickLocked expires leases, runs due webhook retries and wake event
// rewrites, and wakes what has pending work and nothing in flight: for
// the subscriptions due by now, which the due heap holds first, and no
// others. Those taken from the heap are put back at their next case after
// it, so that one acted on again within the tick (a wake that could not
// be saved is due again at once) waits for the next tick. A subscription
// being written is left to the next tick too: the loop does not wait for
// its writer, and what is due may have changed when the writer is done.
// The writes the tick starts run in the background.
func (m *subManager) tickLocked(now time.Time) {
	ms := now.UnixMilli()
	for _, s := range m.popDueLocked(ms) {
		if m.subs[s.key] == s {
			if s.busy == nil {
				m.tickSubLocked(s, now)
			}
			m.scheduleLocked(s)
		}
	}
}

// tickSubLocked does what the tick does for s, which has no writer, at
// now, if anything.
func (m *subManager) tickSubLocked(s *subState, now time.Time) {
	kind, at := s.nextTick()
	if now.UnixMilli() < at {
		return
	}
	c := s.draft()
	switch kind {
	case tickWebhookRetry:
		c.NextTry = 0
		c.LeaseUntil = now.Add(c.lease()).UnixMilli()
		m.writeInBackgroundLocked(s, c, false, m.deliverLocked)
	case tickWakeEventRetry:
		// A pull-wake whose wake event could not be written. Nothing is
		// written to the bucket: s changes in place.
		s.NextTry = 0
		m.writeWakeEventLocked(s)
	case tickLeaseExpiry:
		// The lease ran out: clear holder and wake; wake again if needed.
		c.WakeID, c.Holder, c.LeaseUntil, c.Snapshot = "", "", 0, nil
		if s.Config.Type == "webhook" && s.posting != "" && s.posting == s.WakeID {
			// The wake's POST has had no answer for the whole lease: a
			// failed delivery. The next wake waits out the backoff, as a
			// retry does (wakeOrSaveLocked): issued at once, it went out
			// at every lease, with no backoff, for as long as the
			// receiver was slow.
			c.Failures++
			c.NextTry = now.Add(webhookBackoff(c.Failures)).UnixMilli()
			m.log.Warn("webhook delivery had no answer within the lease; the next wake waits its backoff",
				zap.String("id", s.ID), zap.Int("failures", c.Failures))
		}
		m.writeInBackgroundLocked(s, c, true, nil)
	case tickWake:
		// Pending work and nothing in flight (a restart, or a wake
		// whose state could not be saved): wake now.
		m.writeInBackgroundLocked(s, c, true, nil)
	}
}

// deliverLocked sends the wake in flight to the webhook in a goroutine that
// ends within webhookTimeout or when the engine closes. The caller is s's
// writer (it changes the snapshot in place). The goroutine becomes s's
// writer to record the outcome, waiting for the writer then.
func (m *subManager) deliverLocked(s *subState) {
	snap := map[string]uint64{}
	for p, l := range s.Links {
		if !l.Gone {
			snap[p] = l.Tail
		}
	}
	s.Snapshot = snap
	payload := map[string]any{
		"subscription_id": s.ID,
		"wake_id":         s.WakeID,
		"generation":      s.Generation,
		"streams":         s.streams(true),
		"callback_url":    strings.TrimSuffix(s.BaseURL, "/") + "/" + reservedSegment + "/subscriptions/" + url.PathEscape(s.ID) + "/callback",
		"callback_token":  m.tokenLocked(s),
	}
	body, _ := json.Marshal(payload)
	t := time.Now().Unix()
	sig := ed25519.Sign(m.priv, []byte(fmt.Sprintf("%d.%s", t, body)))
	header := fmt.Sprintf("t=%d,kid=%s,ed25519=%s", t, m.kid, base64.RawURLEncoding.EncodeToString(sig))
	key, gen, wake, target, loopback := s.key, s.Generation, s.WakeID, s.Config.WebhookURL, s.Loopback
	// A loopback target is reached only while the option still allows it.
	// Checked here, not at connect: a pooled connection to it needs none.
	refused := loopback && !m.owner.loopbackAllowed()
	s.posting = wake
	go func() {
		var done bool
		var err error
		if refused {
			err = errLoopbackOff
		} else {
			done, err = m.post(target, loopback, header, body)
		}
		m.mu.Lock()
		defer m.mu.Unlock()
		if cur := m.subs[key]; cur != nil && cur.posting == wake {
			cur.posting = ""
		}
		s := m.ownWakeLocked(key, gen, wake)
		if s == nil {
			return // deleted, or acked or fenced meanwhile
		}
		c := s.draft()
		if err != nil {
			c.Failures++
			c.NextTry = time.Now().Add(webhookBackoff(c.Failures)).UnixMilli()
			m.log.Warn("webhook delivery failed", zap.String("id", s.ID), zap.Int("failures", c.Failures), zap.Error(err))
			m.saveBackgroundLocked(s, c, false)
			m.releaseLocked(s)
			return
		}
		c.Failures = 0
		if !done {
			m.saveBackgroundLocked(s, c, false)
			m.releaseLocked(s)
			return
		}
		// {"done": true}: ack the snapshot and release.
		for p, tail := range c.Snapshot {
			if l := c.Links[p]; l != nil && tail > l.Acked {
				l.Acked = tail
			}
		}
		c.WakeID, c.Holder, c.LeaseUntil, c.Snapshot = "", "", 0, nil
		m.saveBackgroundLocked(s, c, true)
		m.releaseLocked(s)
	}()
}

// errLoopbackOff is a delivery to this machine after the option that
// allowed its subscription was turned off.
var errLoopbackOff = errors.New("webhook is on this machine and no handler allows loopback webhooks now (allow_loopback_webhooks)")

// webhookBackoff is exponential from 1s to 60s with 20% jitter. Pull-wake
// announcements that failed are retried on it too.
func webhookBackoff(failures int) time.Duration {
	d := webhookMinBackoff << min(failures-1, 6)
	d = min(d, webhookMaxBackoff)
	j := time.Duration(float64(d) * 0.2 * (2*mrand.Float64() - 1))
	return d + j
}

// post delivers one webhook request and reports whether it answered
// {"done": true}.
func (m *subManager) post(target string, loopback bool, sig string, body []byte) (bool, error) {
	ctx, cancel := context.WithTimeout(context.WithValue(m.ctx, loopbackKey{}, loopback), webhookTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, target, bytes.NewReader(body))
	if err != nil {
		return false, webhookError(nil, err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Webhook-Signature", sig)
	resp, err := m.client.Do(req)
	if err != nil {
		return false, webhookError(req.URL, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return false, fmt.Errorf("webhook answered %s", resp.Status)
	}
	var res struct {
		Done bool `json:"done"`
	}
	_ = json.Unmarshal(data, &res)
	return res.Done, nil
}

// webhookError is the error of a delivery to u that failed before an
// answer, as it is logged. The Go client's error (a *url.Error) quotes the
// whole URL, and a webhook URL's path or query is often where its receiver
// keeps a secret (?token=..., /services/T.../B.../XXXX), which is why a
// subscription's document is guarded like a write: only the scheme and
// host, which the reason (a refused connection, a DNS failure) needs, are
// kept. The subscription's id, logged beside it, leads whoever may read
// the subscription to the rest. u is nil when the URL did not parse.
func webhookError(u *url.URL, err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	if u == nil {
		return fmt.Errorf("webhook URL: %w", err)
	}
	return fmt.Errorf("POST to %s://%s: %w", u.Scheme, u.Host, err)
}

// ownWakeLocked returns subscription key with the caller its writer
// (waiting for the writer before, until the engine closes), if its wake in
// flight is still wake of generation gen; nil if not.
func (m *subManager) ownWakeLocked(key string, gen uint64, wake string) *subState {
	s, ok := m.subs[key]
	if !ok || s.Generation != gen || s.WakeID != wake {
		return nil
	}
	if m.acquireLocked(m.ctx, s) != nil {
		return nil
	}
	if s.Generation != gen || s.WakeID != wake { // moved on while waiting
		m.releaseLocked(s)
		return nil
	}
	return s
}

// writeWakeEventLocked appends the wake event to the pull-wake stream in a
// goroutine (an append waits for durability); it ends with the append, or
// with recording its failure as s's writer.
func (m *subManager) writeWakeEventLocked(s *subState) {
	stream := ""
	paths := make([]string, 0, len(s.Links))
	for p, l := range s.Links {
		if l.Tail > l.Acked {
			paths = append(paths, p)
		}
	}
	sort.Strings(paths)
	if len(paths) > 0 {
		stream = paths[0]
	}
	ev, _ := json.Marshal(map[string]any{
		"type": "wake", "subscription_id": s.ID, "stream": stream,
		"generation": s.Generation, "ts": time.Now().UnixMilli(),
	})
	name := s.Root + s.Config.WakeStream
	key, gen, wake := s.key, s.Generation, s.WakeID
	go func() {
		ctx, cancel := context.WithTimeout(m.ctx, 30*time.Second)
		defer cancel()
		_, err := m.eng.Append(ctx, name, streamstore.AppendRequest{Records: []streamstore.NewRecord{{Body: ev}}})
		if err == nil {
			return
		}
		m.mu.Lock()
		defer m.mu.Unlock()
		s := m.ownWakeLocked(key, gen, wake)
		if s == nil {
			return // deleted, or moved on meanwhile
		}
		defer m.releaseLocked(s)
		if s.Holder != "" {
			return // claimed meanwhile
		}
		// Nothing is written to the bucket (the retry time is kept in
		// memory only): s changes in place, as its writer.
		// A wake no worker heard of waits for a claim nobody makes, and
		// nothing else would wake the subscription again: announce it
		// again after a pause (the tick does), as a webhook is retried.
		s.Failures++
		s.NextTry = time.Now().Add(webhookBackoff(s.Failures)).UnixMilli()
		m.scheduleLocked(s)
		m.log.Warn("writing wake event failed", zap.String("id", s.ID), zap.String("stream", name),
			zap.Int("failures", s.Failures), zap.Error(err))
	}()
}

// replaySlack widens the time from which a replayed append is one a
// subscription was to hear of: the appends were stamped by the clock of
// the process that took them, which may be another node's.
const replaySlack = 5 * time.Second

// replayedLink is a stream the engine's start replayed appends of that a
// subscription's pattern matches but no link of it names.
type replayedLink struct {
	rel string
	r   *streamstore.ReplayedStream
}

// replayedLinks finds, for each subscription in subs as the load read
// them, the streams the engine's start replayed appends of that its
// pattern matches but that it does not link (see relinkReplayed).
func (m *subManager) replayedLinks(subs map[string]*subState) map[*subState][]replayedLink {
	if len(m.replayed) == 0 || len(subs) == 0 {
		return nil
	}
	var x subIndex
	for _, s := range subs {
		x.add(s)
	}
	found := map[*subState][]replayedLink{}
	for i := range m.replayed {
		r := &m.replayed[i]
		x.candidates(r.Name, func(s *subState) {
			rel, ok := strings.CutPrefix(r.Name, s.Root)
			if ok && rel != "" && s.Links[rel] == nil && s.Config.Pattern != "" && globMatch(s.Config.Pattern, rel) {
				found[s] = append(found[s], replayedLink{rel, r})
			}
		})
	}
	return found
}

// relinkReplayed links to s, whose links the load has reconciled with
// their streams, the streams of found that no link names yet, from the
// first of their replayed appends made since s began to list its streams.
// It reports whether it changed s.
//
// An append links its stream before it is acknowledged only in memory:
// the document that keeps the link is written after, and a process that
// ended before that write landed lost the link, and its next append would
// have linked the stream only from there, the records before never
// offered. The WAL still holds them, unless compaction retired it. A
// stream unlinked since (to make way) may be linked again from an append
// already offered: offered twice, as at-least-once allows. At the link
// limit, an idle glob link makes way as for an append (refusesLinkLocked).
func (m *subManager) relinkReplayed(s *subState, found []replayedLink) bool {
	from := s.ListedFrom
	if from == 0 {
		// Stored before the field: the create listed before it took its
		// time, for as long as its listing took.
		from = s.CreatedAt.Add(-time.Minute).UnixMilli()
	}
	from -= replaySlack.Milliseconds()
	changed := false
	for _, f := range found {
		if s.Links[f.rel] != nil {
			continue
		}
		i := slices.IndexFunc(f.r.Points, func(p streamstore.ReplayPoint) bool { return p.Time >= from })
		if i < 0 {
			continue
		}
		refused, makeWay := m.refusesLinkLocked(s, f.rel, appendNote{name: f.r.Name, id: f.r.ID, first: f.r.Points[i].Seq, next: f.r.Next})
		if refused {
			continue
		}
		if makeWay != "" {
			s.unlinkIdle(makeWay)
		}
		seq := f.r.Points[i].Seq
		s.Links[f.rel] = &subLink{Glob: true, Acked: seq, Tail: max(seq, f.r.Next), Stream: f.r.ID}
		changed = true
		m.log.Info("linked a stream again that the subscription's document had lost with the process that linked it",
			zap.String("subscription", s.ID), zap.String("stream", f.r.Name), zap.Uint64("from_seq", seq))
	}
	return changed
}
