package picomq

// Subscriptions: the HTTP handlers of the control API.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/streamstore"
)

type putBody struct {
	Type    string   `json:"type"`
	Pattern string   `json:"pattern"`
	Streams []string `json:"streams"`
	Webhook *struct {
		URL string `json:"url"`
	} `json:"webhook"`
	WakeStream  string `json:"wake_stream"`
	LeaseTTLms  *int64 `json:"lease_ttl_ms"`
	Description string `json:"description"`
}

// handlePut creates or re-confirms a subscription. A create past maxSubs
// subscriptions under the root (0: no limit) is refused: each costs memory
// and a document in the bucket read at every start, and any client may PUT
// them.
func (m *subManager) handlePut(w http.ResponseWriter, r *http.Request, root, id, base string, allowLoopback bool, maxSubs int) {
	if err := validSubRoute(root, id); err != nil {
		subError(w, http.StatusBadRequest, "INVALID_REQUEST", err.Error())
		return
	}
	var body putBody
	if !readJSONBody(w, r, &body) {
		return
	}
	// The pattern is normalized as the stream paths are (section 6.2 hashes
	// the normalized configuration): "/events/*/" matches what "events/*"
	// does, so it re-confirms it.
	cfg := subConfig{Type: body.Type, Pattern: strings.Trim(body.Pattern, "/"), WakeStream: body.WakeStream, Description: body.Description}
	cfg.LeaseTTLms = subDefaultLease.Milliseconds()
	if body.LeaseTTLms != nil {
		cfg.LeaseTTLms = *body.LeaseTTLms
	}
	if cfg.LeaseTTLms < subMinLease.Milliseconds() || cfg.LeaseTTLms > subMaxLease.Milliseconds() {
		subError(w, http.StatusBadRequest, "INVALID_REQUEST", "lease_ttl_ms must be between 1000 and 600000")
		return
	}
	if len(body.Streams) > subMaxStreams {
		subError(w, http.StatusBadRequest, "INVALID_REQUEST", fmt.Sprintf("a subscription has at most %d streams, got %d", subMaxStreams, len(body.Streams)))
		return
	}
	seen := map[string]bool{}
	for _, p := range body.Streams {
		p = strings.Trim(p, "/")
		if !validRelPath(root, p) {
			subError(w, http.StatusBadRequest, "INVALID_REQUEST", "invalid stream path "+p)
			return
		}
		if !seen[p] {
			seen[p] = true
			cfg.Streams = append(cfg.Streams, p)
		}
	}
	sort.Strings(cfg.Streams)
	if err := validPattern(cfg.Pattern); err != nil {
		subError(w, http.StatusBadRequest, "INVALID_REQUEST", err.Error())
		return
	}
	if cfg.Pattern == "" && len(cfg.Streams) == 0 {
		subError(w, http.StatusBadRequest, "INVALID_REQUEST", "pattern or streams is required")
		return
	}
	switch cfg.Type {
	case "webhook":
		if body.Webhook == nil || body.Webhook.URL == "" {
			subError(w, http.StatusBadRequest, "INVALID_REQUEST", "webhook.url is required")
			return
		}
		if err := validateWebhookURL(body.Webhook.URL, allowLoopback); err != nil {
			subError(w, http.StatusBadRequest, "WEBHOOK_URL_REJECTED", err.Error())
			return
		}
		cfg.WebhookURL = body.Webhook.URL
		// A pull-wake setting: not kept, nor hashed, where nothing reads
		// it (its checks and limit are pull-wake's).
		cfg.WakeStream = ""
	case "pull-wake":
		cfg.WakeStream = strings.Trim(cfg.WakeStream, "/")
		if msg := wakeStreamProblem(root, cfg.WakeStream); msg != "" {
			subError(w, http.StatusBadRequest, "INVALID_REQUEST", msg)
			return
		}
	default:
		subError(w, http.StatusBadRequest, "INVALID_REQUEST", "type must be webhook or pull-wake")
		return
	}
	hash := cfg.hash()
	if err := m.ensureKey(r.Context()); err != nil {
		m.storeFailed(w, r, subWrite{}, err)
		return
	}

	key := subDocKey(root, id)
	m.mu.Lock()
	if m.existingLocked(w, r, key, hash) {
		m.mu.Unlock()
		return
	}
	// Checked for a create only: a subscription stored before the limit
	// is re-confirmed by the PUT that made it.
	if len(cfg.WebhookURL) > subMaxWebhookURL {
		m.mu.Unlock()
		subError(w, http.StatusBadRequest, "INVALID_REQUEST", fmt.Sprintf("webhook.url is at most %d bytes, got %d", subMaxWebhookURL, len(cfg.WebhookURL)))
		return
	}
	if len(cfg.Description) > subMaxDescription {
		m.mu.Unlock()
		subError(w, http.StatusBadRequest, "INVALID_REQUEST", fmt.Sprintf("description is at most %d bytes, got %d", subMaxDescription, len(cfg.Description)))
		return
	}
	if m.rootFullLocked(w, root, maxSubs) {
		m.mu.Unlock()
		return
	}
	// From here the create is under way: a PUT of the same id waits for
	// it (existingLocked), it counts against max_subscriptions, and the
	// notes of streams under root are kept for it, so that an append
	// after a stream was looked up below is not lost. Nothing else sees
	// the subscription before its document is written.
	if m.creating == nil {
		m.creating = map[string]*subCreate{}
	}
	cr := &subCreate{root: root, done: make(chan struct{})}
	m.creating[key] = cr
	m.mu.Unlock()
	s, err := m.newSub(r.Context(), root, id, base, key, hash, cfg, m.owner.linkLimit())
	if err == nil {
		err = m.putSub(s)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.creating, key)
	close(cr.done)
	switch {
	case errors.Is(err, errTooManyLinks):
		subError(w, http.StatusBadRequest, "INVALID_REQUEST", err.Error())
		return
	case err != nil:
		if errors.Is(err, streamstore.ErrUnconfirmed) {
			// The document may have landed, and this server does not
			// have the subscription: undone, as a delete is finished,
			// or a restart would bring back a subscription that no one
			// was told exists (nor a DELETE of its id removed, which
			// found nothing here to delete). A PUT or DELETE of the id
			// waits for it.
			m.finishDeleteLocked(root, key, "")
		}
		m.storeFailed(w, r, subWriteCreate, err)
		return
	}
	m.addSubLocked(s)
	if len(cr.kept) > 0 {
		// Applied and written by s's writer, as notes that come while
		// s is written are (releaseLocked).
		s.busy, s.kept = make(chan struct{}), cr.kept
		m.releaseLocked(s)
	}
	writeJSONStatus(w, http.StatusCreated, "application/json", m.viewLocked(s, r))
}

// newSub makes the subscription a create stores, its streams linked at
// their tails: those matching cfg's pattern (the backfill) and those it
// names. More than limit of them is errTooManyLinks, found before the
// listing goes further or any named stream is looked up.
func (m *subManager) newSub(ctx context.Context, root, id, base, key, hash string, cfg subConfig, limit int) (*subState, error) {
	listedFrom := time.Now().UnixMilli()
	links := map[string]*subLink{}
	if cfg.Pattern != "" {
		prefix := root + globLiteralPrefix(cfg.Pattern)
		after := ""
		for {
			// Judged by name before any stream is looked up: a pattern
			// whose literal prefix is short (**/x at the root) lists
			// every stream, and each it does not match cost a GET.
			matches := func(name string) bool { return globMatch(cfg.Pattern, strings.TrimPrefix(name, root)) }
			infos, more, err := m.eng.ListMatching(ctx, prefix, after, 1000, matches)
			if err != nil {
				return nil, fmt.Errorf("listing the streams the pattern matches: %w", err)
			}
			for _, in := range infos { // each matches: the listing judged it
				rel := strings.TrimPrefix(in.Name, root)
				links[rel] = &subLink{Glob: true, Acked: in.NextSeq, Tail: in.NextSeq, Stream: in.ID}
				after = in.Name
				if len(links) > limit {
					return nil, fmt.Errorf("%w: the pattern matches more than %d streams, and a subscription links at most %d (explicit and matched by its pattern together)", errTooManyLinks, limit, limit)
				}
			}
			if !more || len(infos) == 0 {
				break
			}
		}
	}
	n := len(links)
	for _, p := range cfg.Streams {
		if links[p] == nil {
			n++
		}
	}
	if n > limit {
		return nil, fmt.Errorf("%w: these streams and pattern would link %d streams, and a subscription links at most %d (explicit and matched by its pattern together)", errTooManyLinks, n, limit)
	}
	for _, p := range cfg.Streams {
		l := links[p]
		if l == nil {
			tail, sid, err := m.tailOf(ctx, root+p)
			if err != nil {
				return nil, err
			}
			l = &subLink{Acked: tail, Tail: tail, Stream: sid}
			links[p] = l
		}
		l.Explicit = true
	}
	s := &subState{ID: id, Root: root, BaseURL: base, Config: cfg, Hash: hash, CreatedAt: time.Now().UTC(), ListedFrom: listedFrom, Links: links, key: key}
	if cfg.WebhookURL != "" {
		u, _ := url.Parse(cfg.WebhookURL)
		s.Loopback = isLoopbackDevHost(u.Hostname())
	}
	return s, nil
}

// existingLocked answers a PUT of key when the subscription exists (200,
// or 409 when its configuration hash is not hash) and reports whether it
// did. A create of key being written is waited for first, with m.mu
// released, and a delete of key being finished too, for a while
// (awaitDeleteLocked); a PUT whose request ends meanwhile, or that
// finds the delete still not confirmed, is answered 503.
func (m *subManager) existingLocked(w http.ResponseWriter, r *http.Request, key, hash string) bool {
	for {
		if d := m.deleting[key]; d != nil {
			// Created anew only once the delete before is confirmed:
			// finishing it would delete the new document.
			if !m.awaitDeleteLocked(r.Context(), d) {
				subDeletePending(w)
				return true
			}
			continue
		}
		cr, ok := m.creating[key]
		if !ok {
			break
		}
		m.mu.Unlock()
		select {
		case <-cr.done:
			m.mu.Lock()
		case <-r.Context().Done():
			m.mu.Lock()
			subError(w, http.StatusServiceUnavailable, "UNAVAILABLE", "waiting for a concurrent create: "+r.Context().Err().Error())
			return true
		}
	}
	s, ok := m.subs[key]
	if !ok {
		return false
	}
	if s.Config.hash() != hash {
		subError(w, http.StatusConflict, "SUBSCRIPTION_ALREADY_EXISTS", "a subscription with this id has a different configuration")
		return true
	}
	writeJSONStatus(w, http.StatusOK, "application/json", m.viewLocked(s, r))
	return true
}

// tailOf returns the tail and id of stream name, 0 and "" when there is
// none. A stream that cannot be looked up is an error, not an absent
// stream: linked at 0, its whole history would be offered as new work.
func (m *subManager) tailOf(ctx context.Context, name string) (uint64, string, error) {
	in, err := m.eng.Head(ctx, name)
	switch {
	case errors.Is(err, streamstore.ErrNotFound) || errors.Is(err, streamstore.ErrGone):
		return 0, "", nil
	case err != nil:
		return 0, "", fmt.Errorf("looking up stream %s: %w", name, err)
	}
	return in.NextSeq, in.ID, nil
}

func (m *subManager) viewLocked(s *subState, r *http.Request) map[string]any {
	v := map[string]any{
		"id":              s.ID,
		"subscription_id": s.ID,
		"type":            s.Config.Type,
		"streams":         s.streams(false),
		"lease_ttl_ms":    s.Config.LeaseTTLms,
		"created_at":      s.CreatedAt.Format("2006-01-02T15:04:05.000Z"),
		"status":          "active",
		"generation":      s.Generation,
		"wake_stream":     nil,
		"pattern":         nil,
	}
	if s.Config.Pattern != "" {
		v["pattern"] = s.Config.Pattern
	}
	if s.Config.Description != "" {
		v["description"] = s.Config.Description
	}
	if s.NextTry > 0 && s.Failures > 0 {
		v["status"] = "failed"
		v["next_attempt_at"] = time.UnixMilli(s.NextTry).UTC().Format("2006-01-02T15:04:05.000Z")
	}
	if s.Config.Type == "webhook" {
		v["webhook"] = map[string]any{
			"url": s.Config.WebhookURL,
			"signing": map[string]string{
				"alg":      "ed25519",
				"kid":      m.kid,
				"jwks_url": publicURL(r, s.Root+reservedSegment+"/jwks.json"),
			},
		}
	} else {
		v["wake_stream"] = s.Config.WakeStream
	}
	return v
}

// rootFullLocked answers 403 and reports true when root has maxSubs
// subscriptions already (maxSubs 0: no limit).
func (m *subManager) rootFullLocked(w http.ResponseWriter, root string, maxSubs int) bool {
	if maxSubs <= 0 {
		return false
	}
	n := m.index.perRoot[root]
	for _, cr := range m.creating { // creates being written count too
		if cr.root == root {
			n++
		}
	}
	for _, d := range m.deleting { // and deletes not confirmed: their documents may be there
		if d.root == root {
			n++
		}
	}
	if n < maxSubs {
		return false
	}
	subError(w, http.StatusForbidden, "SUBSCRIPTION_LIMIT_EXCEEDED", fmt.Sprintf(
		"this stream root has %d subscriptions, the server's limit (max_subscriptions); delete one to create another", n))
	return true
}

// addSubLocked makes s one of the manager's subscriptions.
func (m *subManager) addSubLocked(s *subState) {
	delete(m.damaged, s.key) // replaced by this create's document
	m.subs[s.key] = s
	m.index.add(s)
	m.scheduleLocked(s)
}

// removeSubLocked makes s none of the manager's subscriptions.
func (m *subManager) removeSubLocked(s *subState) {
	delete(m.subs, s.key)
	m.index.remove(s)
	m.unscheduleLocked(s)
}

func (m *subManager) lookupLocked(w http.ResponseWriter, root, id string) *subState {
	s, ok := m.subs[subDocKey(root, id)]
	if bad, damaged := m.damaged[subDocKey(root, id)]; !ok && damaged {
		subError(w, http.StatusInternalServerError, "SUBSCRIPTION_DAMAGED", bad.why)
		return nil
	}
	if !ok {
		subError(w, http.StatusNotFound, "SUBSCRIPTION_NOT_FOUND", "no such subscription")
		return nil
	}
	return s
}

func (m *subManager) handleGet(w http.ResponseWriter, r *http.Request, root, id string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if s := m.lookupLocked(w, root, id); s != nil {
		writeJSONStatus(w, http.StatusOK, "application/json", m.viewLocked(s, r))
	}
}

// handleDelete deletes a subscription. Once its write may have landed, the
// delete is the server's to finish, whatever its client does: the write
// runs under the manager's context, not the request's, and one that
// storage did not confirm takes the subscription out of service at once
// (no wakes, deliveries or writes of it: a write of its document would
// bring it back over the grave) and is repeated until storage confirms it
// (finishDelete). A delete that wrote nothing changes nothing. A DELETE of
// the id meanwhile waits for that, a while, and answers 204 once it is
// confirmed, or 503 as the first did.
func (m *subManager) handleDelete(w http.ResponseWriter, r *http.Request, root, id string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	key := subDocKey(root, id)
	for {
		if d := m.deleting[key]; d != nil {
			if !m.awaitDeleteLocked(r.Context(), d) {
				subDeletePending(w)
				return
			}
			continue
		}
		if cr := m.creating[key]; cr != nil {
			// Judged once the create is done: a damaged document it
			// replaces is its own then, not for this delete to take.
			m.mu.Unlock()
			select {
			case <-cr.done:
				m.mu.Lock()
				continue
			case <-r.Context().Done():
				m.mu.Lock()
				subError(w, http.StatusServiceUnavailable, "UNAVAILABLE", "waiting for a concurrent create: "+r.Context().Err().Error())
				return
			}
		}
		s, ok := m.subs[key]
		if !ok {
			if bad, damaged := m.damaged[key]; damaged && !m.deleteDamagedLocked(w, r, root, key, bad) {
				return
			}
			break
		}
		// As its writer: no write of s is under way, and none starts,
		// while its document is deleted.
		err := m.acquireLocked(r.Context(), s)
		if errors.Is(err, errSubGone) {
			continue // deleted meanwhile, or being deleted: look again
		}
		if err != nil {
			w.Header().Set("Retry-After", "1")
			subError(w, http.StatusServiceUnavailable, "UNAVAILABLE", err.Error()+"; nothing was changed, retry")
			return
		}
		ver := s.version
		m.mu.Unlock()
		err = m.deleteDoc(key, ver)
		m.mu.Lock()
		if err != nil && !errors.Is(err, streamstore.ErrUnconfirmed) {
			m.releaseLocked(s)
			m.storeFailed(w, r, subWriteDelete, err)
			return
		}
		// In-flight callbacks, acks and releases, deliveries, and whoever
		// waits to write s, find no subscription now; the notes kept for
		// its writer are dropped with it.
		m.removeSubLocked(s)
		m.releaseLocked(s)
		if err != nil {
			m.finishDeleteLocked(root, key, ver)
			m.storeFailed(w, r, subWriteDelete, err)
			return
		}
		break
	}
	w.Header().Set("Cache-Control", cacheControlNoStore)
	w.WriteHeader(http.StatusNoContent)
}

// deleteDamagedLocked deletes the damaged document key (section 6.3: the
// subscription is there, though it cannot be read), with m.mu released
// meanwhile, and reports whether it did; if not, it has answered. A create
// or delete of key meanwhile waits for it, as for a delete being finished.
// A delete storage did not confirm is finished as a subscription's is.
func (m *subManager) deleteDamagedLocked(w http.ResponseWriter, r *http.Request, root, key string, bad damagedDoc) bool {
	if m.deleting == nil {
		m.deleting = map[string]*subDelete{}
	}
	d := &subDelete{root: root, done: make(chan struct{}), kick: make(chan struct{}, 1)}
	m.deleting[key] = d
	m.mu.Unlock()
	err := m.deleteDoc(key, bad.version)
	m.mu.Lock()
	delete(m.deleting, key)
	close(d.done)
	if err != nil && !errors.Is(err, streamstore.ErrUnconfirmed) {
		m.storeFailed(w, r, subWriteDelete, err)
		return false
	}
	delete(m.damaged, key)
	if err != nil {
		m.finishDeleteLocked(root, key, bad.version)
		m.storeFailed(w, r, subWriteDelete, err)
		return false
	}
	return true
}

// subDeleteWait is how long a request for a subscription whose delete is
// being finished waits for it before it is answered 503.
const subDeleteWait = 5 * time.Second

// awaitDeleteLocked asks d for an attempt now and waits, with m.mu
// released, until it ended, ctx ended or subDeleteWait passed; it reports
// whether it ended.
func (m *subManager) awaitDeleteLocked(ctx context.Context, d *subDelete) bool {
	select {
	case d.kick <- struct{}{}:
	default:
	}
	t := time.NewTimer(subDeleteWait)
	defer t.Stop()
	m.mu.Unlock()
	defer m.mu.Lock()
	select {
	case <-d.done:
		return true
	case <-ctx.Done():
	case <-t.C:
	}
	return false
}

// subDeletePendingMessage answers a request for a subscription whose
// delete storage has not confirmed yet.
const subDeletePendingMessage = "the subscription is being deleted, and storage has not confirmed the delete yet; " +
	"the server goes on deleting it: retry (a DELETE answers 204, and a PUT creates the subscription anew, once it is confirmed)"

// subDeletePending answers 503 with Retry-After to a request that found
// the subscription's delete being finished.
func subDeletePending(w http.ResponseWriter) {
	w.Header().Set("Retry-After", "1")
	subError(w, http.StatusServiceUnavailable, "UNAVAILABLE", subDeletePendingMessage)
}

// finishDeleteLocked starts finishing the delete of document key, in
// version ver when last written, whose write may have landed; ver ""
// (a create that may have landed) deletes whatever version is there.
func (m *subManager) finishDeleteLocked(root, key, ver string) {
	if m.deleting == nil {
		m.deleting = map[string]*subDelete{}
	}
	d := &subDelete{root: root, done: make(chan struct{}), kick: make(chan struct{}, 1)}
	m.deleting[key] = d
	go m.finishDelete(key, ver, d)
}

// finishDelete repeats the delete of document key, with backoff (as a
// webhook's delivery), until storage confirms it, another server took the
// storage over (which reads the subscription from storage), or the
// engine closes (a restart reads storage as it is then).
func (m *subManager) finishDelete(key, ver string, d *subDelete) {
	defer func() {
		m.mu.Lock()
		if m.deleting[key] == d {
			delete(m.deleting, key)
		}
		close(d.done)
		m.mu.Unlock()
	}()
	for failures := 1; ; failures++ {
		t := time.NewTimer(webhookBackoff(failures))
		select {
		case <-m.ctx.Done():
			t.Stop()
			m.log.Warn("a subscription's delete was not confirmed before the storage closed; storage decides whether it exists",
				zap.String("key", key))
			return
		case <-d.kick:
			t.Stop()
		case <-t.C:
		}
		err := m.deleteDoc(key, ver)
		switch {
		case err == nil:
			return
		case errors.Is(err, streamstore.ErrTakenOver):
			m.log.Warn("storage was taken over before a subscription's delete was confirmed; the server that took it decides from storage",
				zap.String("key", key), zap.Error(err))
			return
		}
		m.log.Warn("a subscription's delete is not confirmed yet; trying again", zap.String("key", key),
			zap.Int("failures", failures), zap.Error(err))
	}
}

// deleteDoc removes document key in version ver, the one this node wrote
// last, under the manager's context (a request's end does not cut it
// short). A conflict is, as in putDoc, an earlier write of ours whose
// answer was lost but which landed: that version goes instead, and a
// document gone already (our grave landed) is done.
func (m *subManager) deleteDoc(key, ver string) error {
	ctx, cancel := context.WithTimeout(m.ctx, subDocTimeout)
	defer cancel()
	err := m.eng.DeleteDoc(ctx, key, ver)
	if !errors.Is(err, streamstore.ErrDocConflict) {
		return err
	}
	// As in putDoc, the other version is ours only while this process
	// holds the storage: one that took it over (the same node started
	// again) may have written it, and a grave over it would delete the
	// subscription that process serves. The lease object says which.
	if cerr := m.eng.ConfirmOwner(ctx); cerr != nil {
		return cerr
	}
	_, etag, gerr := m.eng.GetDoc(ctx, key)
	switch {
	case errors.Is(gerr, streamstore.ErrNotFound):
		return nil
	case gerr != nil:
		return fmt.Errorf("%w (reading it back: %v)", err, gerr)
	}
	return m.eng.DeleteDoc(ctx, key, etag)
}

func (m *subManager) handleAddStreams(w http.ResponseWriter, r *http.Request, root, id string) {
	var body struct {
		Streams []string `json:"streams"`
	}
	if !readJSONBody(w, r, &body) {
		return
	}
	if len(body.Streams) > subMaxStreams {
		subError(w, http.StatusBadRequest, "INVALID_REQUEST", fmt.Sprintf("a subscription has at most %d streams, got %d", subMaxStreams, len(body.Streams)))
		return
	}
	adding := make(map[string]bool, len(body.Streams))
	paths := make([]string, 0, len(body.Streams))
	for _, p := range body.Streams {
		p = strings.Trim(p, "/")
		if !validRelPath(root, p) {
			subError(w, http.StatusBadRequest, "INVALID_REQUEST", "invalid stream path "+p)
			return
		}
		if !adding[p] {
			adding[p] = true
			paths = append(paths, p)
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.ownLocked(r.Context(), w, root, id)
	if s == nil {
		return
	}
	defer m.releaseLocked(s)
	linked := s.liveLinks()
	for _, p := range paths {
		if l := s.Links[p]; l == nil || l.Gone {
			linked++
		}
	}
	if limit := m.owner.linkLimit(); linked > limit {
		subError(w, http.StatusBadRequest, "INVALID_REQUEST", fmt.Sprintf(
			"a subscription links at most %d streams (explicit and matched by its pattern together); these would make %d", limit, linked))
		return
	}
	// The streams are looked up as s's writer, and the notes of their
	// appends and deletes are kept for s from before the first lookup
	// until the links are stored, then applied (releaseLocked). An
	// append that came between a lookup and the link found no link to
	// move and was dropped: the link was stored at a tail the stream
	// had already passed, and the record was neither pending nor acked
	// until the stream's next append.
	names := make(map[string]bool, len(paths))
	for _, p := range paths {
		names[root+p] = true
	}
	if m.adding == nil {
		m.adding = map[*subState]map[string]bool{}
	}
	m.adding[s] = names
	defer delete(m.adding, s)
	m.mu.Unlock()
	tails, err := m.tailsOf(r.Context(), root, paths)
	m.mu.Lock()
	if err != nil {
		m.storeFailed(w, r, subWrite{}, err)
		return
	}
	c := s.draft()
	for p, t := range tails {
		l := c.Links[p]
		if l == nil || l.Gone {
			l = &subLink{Acked: t.tail, Tail: t.tail, Stream: t.id}
			if c.WakeID != "" {
				// The wake in flight did not offer this link: what its
				// worker acks under the name (a link removed or gone
				// during the wake, perhaps in another stream) moves
				// nothing here, as after startOver, and a claim of the
				// wake gets a new generation.
				l.ResetGen = c.Generation
			}
			c.Links[p] = l
		}
		l.Explicit = true
	}
	if err := m.commitLocked(s, c); err != nil {
		m.storeFailed(w, r, subWriteAdd, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// streamTail is a stream's tail and id, as tailOf returns them.
type streamTail struct {
	tail uint64
	id   string
}

// tailsOf looks up the streams paths under root (tailOf).
func (m *subManager) tailsOf(ctx context.Context, root string, paths []string) (map[string]streamTail, error) {
	tails := make(map[string]streamTail, len(paths))
	for _, p := range paths {
		tail, sid, err := m.tailOf(ctx, root+p)
		if err != nil {
			return nil, err
		}
		tails[p] = streamTail{tail, sid}
	}
	return tails, nil
}

func (m *subManager) handleRemoveStream(w http.ResponseWriter, r *http.Request, root, id, p string) {
	p = strings.Trim(p, "/")
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.ownLocked(r.Context(), w, root, id)
	if s == nil {
		return
	}
	defer m.releaseLocked(s)
	if l := s.Links[p]; l != nil && l.Explicit {
		c := s.draft()
		c.Links[p].Explicit = false
		if c.Config.Pattern == "" || !globMatch(c.Config.Pattern, p) {
			delete(c.Links, p)
			// A webhook's done acks the wake's snapshot: the tail it
			// offered here must not move a link added again later,
			// maybe in another stream under the name and behind it.
			delete(c.Snapshot, p)
			if c.WakeID != "" || c.Holder != "" {
				c.noteRemoved(p)
			}
		}
		if err := m.commitLocked(s, c); err != nil {
			m.storeFailed(w, r, subWriteRemove, err)
			return
		}
	}
	w.WriteHeader(http.StatusNoContent)
}

// noteRemoved records that the link of p went while a wake is in flight
// (see Removed). The list is bounded as the links are: past that, the
// oldest name goes, and an ack of it is refused as before.
func (s *subState) noteRemoved(p string) {
	if slices.Contains(s.Removed, p) {
		return
	}
	s.Removed = append(s.Removed, p)
	if len(s.Removed) > subMaxStreams {
		s.Removed = slices.Delete(s.Removed, 0, len(s.Removed)-subMaxStreams)
	}
}

type ackBody struct {
	WakeID     string     `json:"wake_id"`
	Generation uint64     `json:"generation"`
	Acks       []ackEntry `json:"acks"`
	Done       bool       `json:"done"`
}

// ackEntry is one ack of an ack request or webhook callback. Its fields are
// pointers so that an entry without one, a malformed body (400), is told
// apart from one that names nothing the subscription has, such as an
// empty stream or offset (409 INVALID_OFFSET).
type ackEntry struct {
	Stream *string `json:"stream"`
	Offset *string `json:"offset"`
}

// handleAck serves the webhook callback and the pull-wake ack.
func (m *subManager) handleAck(w http.ResponseWriter, r *http.Request, root, id string, webhook bool) {
	var body ackBody
	if !readJSONBody(w, r, &body) {
		return
	}
	// The body's shape is checked with its syntax, before anything else:
	// an ack entry without its stream or offset is not an ack at all.
	for i, a := range body.Acks {
		if a.Stream == nil || a.Offset == nil {
			subError(w, http.StatusBadRequest, "INVALID_REQUEST", fmt.Sprintf("ack %d: stream and offset are required (strings)", i))
			return
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	// Tails as of now: an ack of records appended since the wake (the
	// worker may read on) moves the cursor, where a tail still waiting in
	// the queue refused it in silence.
	m.applyQueuedLocked()
	s := m.checkWakeLocked(w, r, root, id, body.WakeID, body.Generation, !webhook)
	if s == nil {
		return
	}
	defer m.releaseLocked(s)
	// Every ack is checked before any applies: a request refused (400,
	// 409) moves no cursor, renews no lease and ends no wake (bad input
	// changes nothing; a worker whose acks are refused must not hold the
	// lease on them, nor have its done end the wake).
	c := s.draft()
	links := make([]*subLink, len(body.Acks))
	acked := make([]uint64, len(body.Acks))
	for i, a := range body.Acks {
		var msg string
		links[i], acked[i], msg = c.ackProblem(*a.Stream, *a.Offset)
		if msg != "" {
			subError(w, http.StatusConflict, "INVALID_OFFSET", fmt.Sprintf("ack for stream %q: %s", *a.Stream, msg))
			return
		}
	}
	for i, l := range links {
		if l == nil {
			continue // removed during this wake: nothing to move
		}
		if l.ResetGen == c.Generation {
			// The link started over during this wake: the worker acks
			// the offsets of a stream that is no more.
			continue
		}
		if acked[i] > l.Acked { // an ack at the cursor is a retry: nothing to move
			l.Acked = acked[i]
		}
	}
	var err error
	if body.Done {
		c.WakeID, c.Holder, c.LeaseUntil, c.Snapshot, c.NextTry, c.Failures = "", "", 0, nil, 0, 0
		err = m.wakeOrSaveLocked(s, c)
	} else {
		c.LeaseUntil = time.Now().Add(c.lease()).UnixMilli()
		err = m.commitLocked(s, c)
	}
	if err != nil {
		m.storeFailed(w, r, ackWrite(webhook, body.Done), err)
		return
	}
	// next_wake tells whether another wake follows this one: only a done
	// can start one. A heartbeat keeps the wake it names.
	writeJSONStatus(w, http.StatusOK, "application/json", map[string]bool{"ok": true, "next_wake": body.Done && s.WakeID != ""})
}

// ackProblem judges an ack of stream at offset: it returns the link the ack
// moves and the seq it moves it to, or why the ack is refused with 409
// INVALID_OFFSET, as the reference server refuses it.
//
// The reference server answers 409 INVALID_OFFSET, not 400, for every ack
// whose stream and offset are strings but name nothing the subscription
// can be at: a stream it does not link (or an empty one), offset -1 (by a
// rule of its own), and, since it compares offsets as strings, "now", an
// empty offset or any other string that is no offset (each sorts behind
// the cursor or beyond the tail). The body is well formed; what it names is
// not a position, which is what INVALID_OFFSET says.
//
// A stream whose link was removed while this wake was out (Removed) was
// offered by it: its ack is taken and moves nothing (a nil link), so
// that the worker's acks of the other streams and its done are applied.
func (s *subState) ackProblem(stream, offset string) (*subLink, uint64, string) {
	p := strings.Trim(stream, "/")
	l := s.Links[p]
	if l == nil && !slices.Contains(s.Removed, p) {
		return nil, 0, "the subscription does not link this stream"
	}
	off, err := parseOffset(offset)
	if err != nil || off.kind != offsetAt {
		return nil, 0, fmt.Sprintf("offset %q is not a position in the stream: an ack names the offset after the last record processed, as a claim's tail_offset does", offset)
	}
	if l == nil || (slices.Contains(s.Removed, p) && off.pos.before(position{seq: l.Acked})) {
		// Removed, or removed and added again since at a later tail:
		// what the wake offered of it is behind the new link.
		return nil, 0, ""
	}
	return l, off.pos.seq, s.ackOffsetProblem(l, off.pos)
}

// ackOffsetProblem says why an ack of link l at pos is refused with 409
// INVALID_OFFSET, as the reference server refuses it, or "" when it is
// not. An ack beyond the tail names records not written yet: moving the
// cursor there would skip them when they come, so it is a client's bug,
// not a retry. An ack behind the cursor would take back an ack: refusing
// it loses nothing (the records behind the cursor were acked) and tells a
// worker that acks from a stale view that it has one. An ack at the cursor
// is accepted, so that a worker resending an ack whose answer it lost
// gets 200. A link that started over during this wake is not judged: the
// worker acks the old stream's offsets, which move nothing (handleAck).
//
// Offsets are compared in both parts, so the tail's seq with a byte part is
// beyond the tail. Between the cursor and the tail an offset inside a
// record (a read of a record larger than a response stops inside it) is
// taken as the record's start: a cursor counts whole records, and holding
// it before the record the worker is still in redelivers that record,
// which at-least-once allows, where refusing the ack would leave a worker
// that acks the Stream-Next-Offset it read unable to renew its lease. A
// made-up byte part is taken the same way; it can only keep records.
func (s *subState) ackOffsetProblem(l *subLink, pos position) string {
	acked, tail := position{seq: l.Acked}, position{seq: l.Tail}
	switch {
	case l.ResetGen == s.Generation:
		return ""
	case pos.before(acked):
		return fmt.Sprintf("offset %s is behind the acknowledged offset %s", pos, acked)
	case tail.before(pos):
		return fmt.Sprintf("offset %s is beyond the stream's tail %s", pos, tail)
	}
	return ""
}

func (m *subManager) handleClaim(w http.ResponseWriter, r *http.Request, root, id string) {
	var body struct {
		Worker string `json:"worker"`
	}
	if !readJSONBody(w, r, &body) {
		return
	}
	switch {
	case body.Worker == "":
		subError(w, http.StatusBadRequest, "INVALID_REQUEST", "worker is required")
		return
	case len(body.Worker) > subMaxWorker:
		subError(w, http.StatusBadRequest, "INVALID_REQUEST", fmt.Sprintf("worker is at most %d bytes, got %d", subMaxWorker, len(body.Worker)))
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.applyQueuedLocked() // pending work as of now
	s := m.ownLocked(r.Context(), w, root, id)
	if s == nil {
		return
	}
	defer m.releaseLocked(s)
	if !pullWakeOnly(w, s) {
		return
	}
	now := time.Now()
	if s.Holder != "" && now.UnixMilli() < s.LeaseUntil {
		writeJSONStatus(w, http.StatusConflict, "application/json", map[string]any{"error": map[string]any{
			"code": "ALREADY_CLAIMED", "current_holder": s.Holder, "generation": s.Generation,
		}})
		return
	}
	if s.WakeID == "" && !s.pending() {
		// Nothing to wake for (a worker read an old wake event, say): a
		// claim would open a generation and a lease on no work, and
		// write the subscription for it. The reference server answers
		// 409 NO_PENDING_WORK too. A wake in flight is still taken (its
		// work may have gone with a deleted stream: the claim ends it).
		subError(w, http.StatusConflict, "NO_PENDING_WORK", "the subscription has no pending work")
		return
	}
	c := s.draft()
	if c.Holder != "" || c.WakeID == "" || c.resetInWake() {
		// No wake to take over (or its lease ran out, or what it was
		// about is of a stream deleted since): a new generation.
		c.Generation++
		c.WakeID = newWakeID()
		c.Removed = nil // of the wake before
	}
	c.Holder = body.Worker
	c.LeaseUntil = now.Add(c.lease()).UnixMilli()
	c.NextTry, c.Failures = 0, 0 // claimed: no more announcing the wake
	if err := m.commitLocked(s, c); err != nil {
		m.storeFailed(w, r, subWriteClaim, err)
		return
	}
	writeJSONStatus(w, http.StatusOK, "application/json", map[string]any{
		"wake_id":      s.WakeID,
		"generation":   s.Generation,
		"token":        m.tokenLocked(s),
		"streams":      s.streams(true),
		"lease_ttl_ms": s.Config.LeaseTTLms,
	})
}

func (m *subManager) handleRelease(w http.ResponseWriter, r *http.Request, root, id string) {
	var body ackBody
	if !readJSONBody(w, r, &body) {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.checkWakeLocked(w, r, root, id, body.WakeID, body.Generation, true)
	if s == nil {
		return
	}
	defer m.releaseLocked(s)
	c := s.draft()
	c.WakeID, c.Holder, c.LeaseUntil, c.Snapshot = "", "", 0, nil
	if err := m.wakeOrSaveLocked(s, c); err != nil {
		m.storeFailed(w, r, subWriteRelease, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// pullWakeOnly refuses a claim, ack or release (section 7.2, pull-wake's
// endpoints) of a webhook subscription with 400, as the reference server
// does, and reports whether s is pull-wake. Taken on a webhook
// subscription, a claim would hold a lease of its own that keeps every
// webhook delivery off until it runs out, and a release would end the
// wake in flight without an ack.
func pullWakeOnly(w http.ResponseWriter, s *subState) bool {
	if s.Config.Type == "pull-wake" {
		return true
	}
	subError(w, http.StatusBadRequest, "INVALID_REQUEST", "subscription is not pull-wake: claim, ack and release are for pull-wake subscriptions")
	return false
}

// checkWakeLocked applies section 7.3: the token is valid for this
// subscription and its current generation and wake, and so is the request.
// With pullOnly (the ack and release endpoints) s must be pull-wake. It
// returns s with the caller its writer (ownLocked), judged as it is once
// the writer before has let go.
//
// The token is checked before the subscription is looked up, so that a
// request without a valid token gets 401 whether or not the subscription
// exists, and whatever its type: these endpoints take the module's own
// token in Authorization, so a site that guards its control API with its
// own credentials must leave them open, and answering 404 (or 400 for a
// webhook subscription) first told anyone there which subscription ids
// exist. The token names its subscription, so it is checked without it;
// a holder of a valid one knows the id, and a 404 after it (the
// subscription was deleted since) tells nothing new. A token past its
// expiry is taken while the lease of the wake it names runs (heartbeats
// keep a lease for longer than any expiry), and is 401 TOKEN_EXPIRED
// otherwise.
func (m *subManager) checkWakeLocked(w http.ResponseWriter, r *http.Request, root, id, wakeID string, gen uint64, pullOnly bool) *subState {
	key := subDocKey(root, id)
	// The scheme is case-insensitive (RFC 9110 section 11.1), and
	// whitespace may be more than one space.
	scheme, tok, ok := strings.Cut(strings.TrimSpace(r.Header.Get("Authorization")), " ")
	ok = ok && strings.EqualFold(scheme, "Bearer")
	// The codes are the reference server's (TOKEN_INVALID, TOKEN_EXPIRED),
	// which its client's error type lists; the protocol names none.
	if !ok {
		subError(w, http.StatusUnauthorized, "TOKEN_INVALID", "a bearer token is required")
		return nil
	}
	claims, err := m.verifyTokenLocked(strings.TrimSpace(tok))
	// A genuine token past its expiry is judged against the subscription:
	// a worker that heartbeats holds its lease for as long as it works,
	// and no answer gives it a new token (section 7.2).
	tokExpired := errors.Is(err, errTokenExpired) && claims.Sub == key
	switch {
	case tokExpired && m.subs[key] == nil:
		subError(w, http.StatusUnauthorized, "TOKEN_EXPIRED", "token expired")
		return nil
	case !tokExpired && (err != nil || claims.Sub != key):
		subError(w, http.StatusUnauthorized, "TOKEN_INVALID", "invalid token")
		return nil
	}
	s := m.ownLocked(r.Context(), w, root, id)
	if s == nil {
		return nil
	}
	// A lease past its time is over (section 7.3) whether or not the
	// manager's tick has cleared it yet: no heartbeat revives it.
	now := time.Now().UnixMilli()
	expired := s.LeaseUntil > 0 && now >= s.LeaseUntil
	if tokExpired && (claims.Gen != s.Generation || claims.Wake != s.WakeID || s.WakeID == "" || s.LeaseUntil == 0 || expired) {
		// Not for the wake whose lease runs now: it expired with its wake.
		subError(w, http.StatusUnauthorized, "TOKEN_EXPIRED", "token expired")
		m.releaseLocked(s)
		return nil
	}
	if pullOnly && !pullWakeOnly(w, s) {
		m.releaseLocked(s)
		return nil
	}
	if expired || claims.Gen != s.Generation || gen != s.Generation || s.WakeID == "" || wakeID != s.WakeID || claims.Wake != s.WakeID {
		writeJSONStatus(w, http.StatusConflict, "application/json", map[string]any{"error": map[string]any{"code": "FENCED", "generation": s.Generation}})
		m.releaseLocked(s)
		return nil
	}
	return s
}
