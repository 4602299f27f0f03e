package picomq

// Reserved subscription APIs (Durable Streams protocol sections 6 and 7,
// security in 12.8-12.10).
//
// Routing: any request path with a "__ds" segment is a control request; the
// part of the path before that segment is the stream root, so
// /v1/stream/__ds/subscriptions/s1 manages subscription s1 of the streams
// named /v1/stream/...; paths inside subscription bodies are relative to
// that root.
//
// Durability: this file knows HTTP, not S3. Every subscription (config,
// generation, wake id, lease holder and expiry, retry schedule, links with
// their acked offsets) is one JSON document written with compare-and-swap
// through the engine's document store (streamstore.Engine.PutDoc, objects
// under subs/ in the bucket), after every change and before the change is
// answered or acted on. The Ed25519 webhook signing key and the HMAC key of
// callback tokens are generated once and kept in the document "key". So a
// restart (or another node taking the storage lease) finds every
// subscription, generation and cursor where it was, and a stale generation
// stays fenced. Stream tails learned from the engine's append hook are kept
// in the same documents, with the id of the stream they count in (see
// subLink).
//
// One subManager serves each engine; it runs one goroutine (the loop: append
// notifications, lease expiry, webhook retries) and short-lived delivery
// and document-writing goroutines, all of which end when the engine
// closes. Documents are written outside the manager's lock, one writer per
// subscription at a time (see "writing subscriptions").

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unicode"
	"unicode/utf8"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/streamstore"
)

const (
	reservedSegment    = "__ds"
	subDefaultLease    = 30 * time.Second
	subMinLease        = time.Second
	subMaxLease        = 10 * time.Minute
	subMaxIDLen        = 120
	subMaxBody         = 1 << 20
	webhookTimeout     = 10 * time.Second
	webhookMinBackoff  = time.Second
	webhookMaxBackoff  = 60 * time.Second
	subTickInterval    = 100 * time.Millisecond
	signatureKeyDocKey = "key"
)

// subMaxStreams bounds a subscription's explicit streams: each is looked
// up in the bucket when it is added, and every one is in the
// subscription's document, which is written again at every change of its
// state. 90,000 of them fit in one body: 90,000 HEADs for one request, and
// a 5 MB document to write at every claim and ack.
const subMaxStreams = 1000

// subMaxLinks bounds the streams a subscription links, explicit and
// matched by its pattern together: every link is in the subscription's
// document, written whole at every claim, ack and wake, and a pattern
// such as "**" over a large root linked every stream under it, making
// that document many megabytes. A create or add past it is refused; a
// stream the pattern matches later is not linked while the subscription
// is full (logged, and counted in picomq_subscription_links_refused_total).
const subMaxLinks = 1000

// errTooManyLinks is a create that would link more than a subscription's
// limit of streams.
var errTooManyLinks = errors.New("too many streams")

// Bounds, in bytes, of what a client sets that goes into a subscription's
// document, written again whole at every claim, ack and append note: the
// body's limit let one field make it a megabyte. The worker is also in
// every ALREADY_CLAIMED answer.
const (
	subMaxWebhookURL  = 2 << 10
	subMaxWorker      = 256
	subMaxDescription = 4 << 10
)

// serveReserved handles a request under a "__ds" segment and reports
// whether it did. For other requests it only makes sure the engine's
// subscription manager runs, so appends wake subscriptions after a restart.
func (d *durableStreams) serveReserved(w http.ResponseWriter, r *http.Request) bool {
	path := r.URL.Path
	i := strings.Index(path, "/"+reservedSegment+"/")
	if i < 0 && strings.HasSuffix(path, "/"+reservedSegment) {
		i = len(path) - len(reservedSegment) - 1
	}
	if i < 0 {
		if eng, err := d.engine(r.Context()); err == nil {
			d.subs.managerFor(eng, d.log)
		}
		return false
	}
	root := path[:i+1]
	rest := strings.TrimPrefix(path[i+1+len(reservedSegment):], "/")
	eng, ok := d.engineFor(w, r)
	if !ok {
		return true
	}
	m := d.subs.managerFor(eng, d.log)
	err := m.ready(r.Context())
	if err == nil {
		err = m.ensureKey(r.Context())
	}
	if err != nil {
		m.storeFailed(w, r, subWrite{}, err)
		return true
	}
	if rest == "jwks.json" {
		if !methodAllowed(w, r, jwksMethods) {
			return true
		}
		w.Header().Set("Cache-Control", "public, max-age=300")
		writeJSONStatus(w, http.StatusOK, "application/jwk-set+json", m.jwks())
		return true
	}
	id, sub, found := strings.Cut(strings.TrimPrefix(rest, "subscriptions/"), "/")
	if !strings.HasPrefix(rest, "subscriptions/") || id == "" || len(id) > subMaxIDLen || len(root) > subMaxIDLen {
		subError(w, http.StatusNotFound, "NOT_FOUND", "no such control resource")
		return true
	}
	allow, known := subRouteMethods(sub, found)
	if !known {
		subError(w, http.StatusNotFound, "NOT_FOUND", "no such control resource")
		return true
	}
	if !methodAllowed(w, r, allow) {
		return true
	}
	base := publicURL(r, root)
	// The handlers answer holding the manager's lock; what they write is
	// kept until they have let go of it, so a client slow to read its
	// answer holds up no other request of the engine's subscriptions.
	held := &heldResponse{w: w}
	defer held.send()
	w = held
	switch {
	case !found && r.Method == http.MethodPut:
		m.handlePut(w, r, root, id, base, d.allowLoopback, d.maxSubs)
	case !found && (r.Method == http.MethodGet || r.Method == http.MethodHead):
		m.handleGet(w, r, root, id)
	case !found && r.Method == http.MethodDelete:
		m.handleDelete(w, r, root, id)
	case sub == "streams" && r.Method == http.MethodPost:
		m.handleAddStreams(w, r, root, id)
	case strings.HasPrefix(sub, "streams/") && r.Method == http.MethodDelete:
		m.handleRemoveStream(w, r, root, id, strings.TrimPrefix(sub, "streams/"))
	case sub == "callback" && r.Method == http.MethodPost:
		m.handleAck(w, r, root, id, true)
	case sub == "ack" && r.Method == http.MethodPost:
		m.handleAck(w, r, root, id, false)
	case sub == "claim" && r.Method == http.MethodPost:
		m.handleClaim(w, r, root, id)
	case sub == "release" && r.Method == http.MethodPost:
		m.handleRelease(w, r, root, id)
	default:
		subError(w, http.StatusNotFound, "NOT_FOUND", "no such control resource")
	}
	return true
}

// Methods of the control resources, as their 405 answers list them in
// Allow (OPTIONS is answered for every path before routing, module.go).
const (
	jwksMethods        = "GET, HEAD, OPTIONS"
	subMethods         = "GET, HEAD, PUT, DELETE, OPTIONS"
	subPostMethods     = "POST, OPTIONS"
	subLinkMethods     = "DELETE, OPTIONS"
	methodNotAllowedAt = "method %s is not allowed here; allowed: %s"
)

// hasReservedSegment reports whether one of name's segments is the one
// Durable Streams serves its control resources under.
func hasReservedSegment(name string) bool {
	for seg := range strings.SplitSeq(name, "/") {
		if seg == reservedSegment {
			return true
		}
	}
	return false
}

// subRouteMethods returns the methods of the control resource sub below a
// subscription (the subscription itself when hasSub is false), and false
// for a path that names no resource.
func subRouteMethods(sub string, hasSub bool) (string, bool) {
	switch {
	case !hasSub:
		return subMethods, true
	case sub == "streams", sub == "callback", sub == "ack", sub == "claim", sub == "release":
		return subPostMethods, true
	case strings.HasPrefix(sub, "streams/"):
		return subLinkMethods, true
	}
	return "", false
}

// methodAllowed reports whether r's method is in allow (a list as Allow
// writes it); if not, it answers 405 with that Allow header, which RFC 9110
// section 15.5.6 requires of a 405.
func methodAllowed(w http.ResponseWriter, r *http.Request, allow string) bool {
	for _, m := range strings.Split(allow, ", ") {
		if r.Method == m {
			return true
		}
	}
	w.Header().Set("Allow", allow)
	subError(w, http.StatusMethodNotAllowed, "METHOD_NOT_ALLOWED", fmt.Sprintf(methodNotAllowedAt, r.Method, allow))
	return false
}

// subLink is one stream linked to a subscription. Offsets are stream seqs:
// the position after the last acknowledged (or existing) record.
//
// A link follows a name, but its offsets count in one stream: the one whose
// engine id is Stream. When that stream is deleted the offsets mean nothing
// any more (a stream created again under the name starts at seq 0), so the
// link starts over: a glob link goes (the pattern links the name again when
// a stream under it gets records), an explicit one stays at 0 with no
// stream, and a link that meets another stream under its name is at 0 in
// that one (every record of it is new to the subscriber).
type subLink struct {
	Glob     bool   `json:"glob,omitempty"`
	Explicit bool   `json:"explicit,omitempty"`
	Acked    uint64 `json:"acked"`
	Tail     uint64 `json:"tail"`
	// Stream is the id of the stream the offsets count in; "" when no
	// stream existed under the name when it was linked (or since its
	// delete), and in documents written before ids were kept.
	Stream string `json:"stream_id,omitempty"`
	// ResetGen is the generation that was current when the offsets last
	// started over: a worker acking in that generation was offered the
	// old stream's offsets, so its acks for this link move nothing.
	ResetGen uint64 `json:"reset_gen,omitempty"`
	// Gone is a glob link whose stream was deleted while a wake was in
	// flight: it stays, unseen and not pending, so that the worker's acks
	// for it are not refused, and goes when the wake ends.
	Gone bool `json:"gone,omitempty"`
}

// startOver makes l count in stream id from acked on (id "" when there
// is no stream under the name), and forgets what the wake in flight was
// offered for it: acks and a snapshot of the old stream's offsets must
// not move the new stream's.
func (s *subState) startOver(p string, l *subLink, id string, acked uint64) {
	l.Acked, l.Tail, l.Stream, l.ResetGen, l.Gone = acked, acked, id, s.Generation, false
	delete(s.Snapshot, p)
}

// streamGone applies the delete of the stream link p counts in.
func (s *subState) streamGone(p string, l *subLink) {
	s.startOver(p, l, "", 0)
	switch {
	case l.Explicit:
	case s.WakeID == "" && s.Holder == "":
		delete(s.Links, p)
	default:
		l.Gone = true
	}
}

// dropGone removes the links of deleted streams, and the names of removed
// ones, kept for a wake that has ended.
func (s *subState) dropGone() {
	if s.WakeID != "" || s.Holder != "" {
		return
	}
	s.Removed = nil
	for p, l := range s.Links {
		if l.Gone {
			delete(s.Links, p)
		}
	}
}

// resetInWake reports whether a link started over during the wake in
// flight: what that wake offered for it is of the old stream.
func (s *subState) resetInWake() bool {
	if s.WakeID == "" {
		return false
	}
	for _, l := range s.Links {
		if l.ResetGen == s.Generation {
			return true
		}
	}
	return false
}

// subConfig is what a PUT sets; its hash decides 200 against 409.
type subConfig struct {
	Type        string   `json:"type"`
	Pattern     string   `json:"pattern,omitempty"`
	Streams     []string `json:"streams,omitempty"`
	WebhookURL  string   `json:"webhook_url,omitempty"`
	WakeStream  string   `json:"wake_stream,omitempty"`
	LeaseTTLms  int64    `json:"lease_ttl_ms"`
	Description string   `json:"description,omitempty"`
}

// hash is what decides 200 against 409 for a PUT (section 6.2: a hash of
// the normalized configuration). It is computed from the stored
// configuration, not taken from the stored hash, and normalizes the
// pattern itself, so that a subscription stored before patterns were
// normalized is re-confirmed by the PUT that created it.
func (c subConfig) hash() string {
	c.Pattern = strings.Trim(c.Pattern, "/")
	b, _ := json.Marshal(c)
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// subState is the durable document of one subscription.
type subState struct {
	ID         string              `json:"id"`
	Root       string              `json:"root"`
	BaseURL    string              `json:"base_url"` // public URL of the stream root
	Config     subConfig           `json:"config"`
	Hash       string              `json:"hash"`
	CreatedAt  time.Time           `json:"created_at"`
	Links      map[string]*subLink `json:"links"`
	Generation uint64              `json:"generation"`
	WakeID     string              `json:"wake_id,omitempty"`     // the wake in flight, if any
	Holder     string              `json:"holder,omitempty"`      // pull-wake worker holding the lease
	LeaseUntil int64               `json:"lease_until,omitempty"` // unix ms; 0 means no lease running
	Failures   int                 `json:"failures,omitempty"`
	NextTry    int64               `json:"next_attempt_at,omitempty"` // unix ms of the next webhook retry
	Snapshot   map[string]uint64   `json:"snapshot,omitempty"`        // tails sent with the wake in flight
	// Removed holds the streams whose link was removed while the wake in
	// flight was out (handleRemoveStream): that wake offered them, so its
	// worker's acks of them are taken, moving nothing, rather than
	// refused with the rest of their request and its done. Emptied when
	// the wake ends (dropGone) or gives way to another generation.
	Removed []string `json:"removed,omitempty"`
	// Loopback: the webhook URL was accepted under the localhost exception,
	// so deliveries may connect to loopback addresses (and only then).
	Loopback bool `json:"loopback,omitempty"`

	key     string // document key
	version string // document version (ETag); only s's writer uses it
	// busy is set while a writer owns s (see writing subscriptions below)
	// and closed when it lets go; kept holds the append and delete notes
	// that came for s meanwhile, which the writer applies before it lets
	// go, so that busy is never clear with notes kept.
	busy    chan struct{}
	kept    []appendNote
	indexed subIndexed // where the manager's index has it
	dueAt   int64      // unix ms of its next tick case (nextTick), while dueIdx > 0
	dueIdx  int        // its place in the manager's due heap plus one; 0 when not in it
}

func (s *subState) lease() time.Duration {
	return time.Duration(s.Config.LeaseTTLms) * time.Millisecond
}

// liveLinks counts s's links, less those of deleted streams kept for the
// wake in flight (Gone), which go when it ends.
func (s *subState) liveLinks() int {
	n := 0
	for _, l := range s.Links {
		if !l.Gone {
			n++
		}
	}
	return n
}

func (s *subState) pending() bool {
	for _, l := range s.Links {
		if l.Tail > l.Acked {
			return true
		}
	}
	return false
}

type subStreamView struct {
	Path       string  `json:"path"`
	LinkType   string  `json:"link_type"`
	Acked      string  `json:"acked_offset"`
	Tail       *string `json:"tail_offset,omitempty"`
	HasPending *bool   `json:"has_pending,omitempty"`
}

func (s *subState) streams(withTail bool) []subStreamView {
	paths := make([]string, 0, len(s.Links))
	for p := range s.Links {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	out := make([]subStreamView, 0, len(paths))
	for _, p := range paths {
		l := s.Links[p]
		if l.Gone {
			continue
		}
		v := subStreamView{Path: p, LinkType: "glob", Acked: position{seq: l.Acked}.String()}
		if l.Explicit {
			v.LinkType = "explicit"
		}
		if withTail {
			t := position{seq: l.Tail}.String()
			pend := l.Tail > l.Acked
			v.Tail, v.HasPending = &t, &pend
		}
		out = append(out, v)
	}
	return out
}

// subManager owns the subscriptions of one engine.
type subManager struct {
	owner *subManagers // whose handlers say whether loopback webhooks are allowed
	eng   *streamstore.Engine
	log   *zap.Logger

	loaded  chan struct{}
	loadErr error

	keyMu sync.Mutex // serialises ensureKey
	mu    sync.Mutex
	subs  map[string]*subState // by document key
	// creating holds the creates whose document is being written, by
	// key: a PUT of the same id waits for it, and they count against
	// max_subscriptions.
	creating map[string]*subCreate
	// deleting holds, by key, the deletes that may have landed and that
	// the server is finishing (finishDelete): the subscription is no
	// longer in subs, and a PUT or DELETE of the id waits for its end.
	deleting map[string]*subDelete
	// adding holds, for a subscription whose writer is adding explicit
	// streams, the full names of those streams: their notes are kept for
	// it until the links are stored (handleAddStreams).
	adding map[*subState]map[string]bool
	// bgWrites bounds the loop's writes under way (writeInBackgroundLocked);
	// made on first use.
	bgWrites chan struct{}
	index    subIndex   // subs by the streams they may concern
	due      subDueHeap // subs by the time the tick acts on them (subdue.go)
	priv     ed25519.PrivateKey
	kid      string
	mac      []byte

	qmu    sync.Mutex
	queue  map[string]appendNote // by stream name, coalesced: bounded by the streams appended to
	kick   chan struct{}
	client *http.Client
	ctx    context.Context // ends when the engine closes

	refusedLog *sampledLog // links refused at the limit, logged sparsely
}

// subCreate is a subscription whose create is being made: its streams
// looked up and its document written.
type subCreate struct {
	root string
	done chan struct{} // closed when the write ended
	// kept holds the notes of streams under root that came meanwhile, for
	// the subscription to apply once it is stored: a stream looked up
	// before an append was linked at the tail before it.
	kept []appendNote
}

// subDelete is a subscription's delete whose write may have landed, which
// the server repeats until storage confirms it (finishDelete).
type subDelete struct {
	root string
	done chan struct{} // closed when it ended: confirmed, or the server gave up
	kick chan struct{} // a waiting request asks for an attempt now
}

// appendNote is what the engine's hooks said about a stream: records
// appended to stream id (first to next), or, with deleted, its delete.
type appendNote struct {
	name, id    string
	first, next uint64
	deleted     bool
}

// subManagers holds the subscription manager of an engine, started on
// first use; it lives with the engine's handle (engineRef) and the
// handlers that serve it, not in a package map.
type subManagers struct {
	cur atomic.Pointer[subManager] // the running one: every request looks
	mu  sync.Mutex                 // serialises starts

	// loopbackHandlers counts the Durable Streams handlers of the engine
	// that allow loopback webhooks, in configs that have started and are
	// not cleaned up yet (App.Start, App.Cleanup). A subscription accepted under the option
	// keeps its loopback target in its document; it is delivered there
	// only while some handler still allows it, so turning the option off
	// (a reload) stops those deliveries rather than leaving them for good.
	loopbackHandlers atomic.Int64

	metrics  *engineMetrics // where refused links are counted; nil in some tests
	maxLinks int            // the most streams a subscription links; 0: subMaxLinks
	failLog  *sampledLog    // the storage's warnings of failed requests, shared with its streams'; nil logs each
}

// storeFailLog returns the sampled log of the storage's failed requests.
func (sm *subManagers) storeFailLog() *sampledLog {
	if sm == nil {
		return nil
	}
	return sm.failLog
}

// linkLimit returns the most streams a subscription of the engine links.
func (sm *subManagers) linkLimit() int {
	if sm == nil || sm.maxLinks <= 0 {
		return subMaxLinks
	}
	return sm.maxLinks
}

// loopbackAllowed reports whether a handler of the engine allows loopback
// webhooks now.
func (sm *subManagers) loopbackAllowed() bool { return sm != nil && sm.loopbackHandlers.Load() > 0 }

// managerFor returns eng's subscription manager, starting it once.
func (sm *subManagers) managerFor(eng *streamstore.Engine, log *zap.Logger) *subManager {
	if m := sm.cur.Load(); m != nil && m.eng == eng {
		return m
	}
	sm.mu.Lock()
	defer sm.mu.Unlock()
	if m := sm.cur.Load(); m != nil && m.eng == eng {
		return m
	}
	ctx, cancel := context.WithCancel(context.Background())
	m := &subManager{
		owner:  sm,
		eng:    eng,
		log:    log,
		loaded: make(chan struct{}),
		subs:   map[string]*subState{},
		kick:   make(chan struct{}, 1),
		ctx:    ctx,

		refusedLog: newSampledLog(time.Minute),
	}
	m.client = &http.Client{
		Timeout: webhookTimeout,
		// No proxy: the address check must see the real target. Connections
		// are not shared between loopback and public targets, since a pooled
		// connection is keyed by host and a loopback host is never public.
		Transport: &http.Transport{DialContext: webhookDial, MaxIdleConnsPerHost: 2},
		CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse // a redirect could lead anywhere
		},
	}
	sm.cur.Store(m)
	eng.OnAppend(m.noteAppend)
	eng.OnDelete(m.noteDelete)
	go func() {
		defer cancel()
		m.run()
	}()
	go func() {
		<-eng.Done()
		cancel()
		sm.cur.CompareAndSwap(m, nil)
	}()
	return m
}

// noteAppend is the engine's append hook: it queues and never blocks.
func (m *subManager) noteAppend(name, id string, first, next uint64) {
	m.note(appendNote{name: name, id: id, first: first, next: next})
}

// noteDelete is the engine's delete hook: it queues and never blocks.
func (m *subManager) noteDelete(name, id string) {
	m.note(appendNote{name: name, id: id, deleted: true})
}

// note queues n, coalesced with the note queued for its name. The engine
// announces a stream's appends before its delete, and both before any of
// a stream created after it under the name, so a later note of another
// stream replaces the queued one: that stream is gone, and the newer
// note alone makes a link start over (see applyNoteLocked).
func (m *subManager) note(n appendNote) {
	m.qmu.Lock()
	if m.queue == nil {
		m.queue = map[string]appendNote{}
	}
	if q, ok := m.queue[n.name]; ok && q.id == n.id && !n.deleted && !q.deleted {
		n.first, n.next = min(n.first, q.first), max(n.next, q.next)
	}
	m.queue[n.name] = n
	m.qmu.Unlock()
	select {
	case m.kick <- struct{}{}:
	default:
	}
}

func (m *subManager) ready(ctx context.Context) error {
	select {
	case <-m.loaded:
		return m.loadErr
	case <-ctx.Done():
		return ctx.Err()
	}
}

// run loads the state, then serves append notes, leases and retries until
// the engine closes.
func (m *subManager) run() {
	for {
		err := m.load()
		if err == nil {
			break
		}
		m.log.Warn("loading subscriptions", zap.Error(err))
		select {
		case <-m.ctx.Done():
			m.loadErr = err
			close(m.loaded)
			return
		case <-time.After(time.Second):
		}
	}
	close(m.loaded)
	t := time.NewTicker(subTickInterval)
	defer t.Stop()
	for {
		select {
		case <-m.ctx.Done():
			return
		case <-m.kick:
		case <-t.C:
		}
		m.mu.Lock()
		m.applyQueuedLocked()
		m.tickLocked(time.Now())
		m.mu.Unlock()
	}
}

// applyQueuedLocked applies the queued append and delete notes. The queue
// is only taken with m.mu held, and applied without letting go of it, so
// whoever holds m.mu sees every append the engine announced so far:
// applied, queued, or in the hands of the subscription's writer (being
// written, or kept for it), which the next writer waits for. So a
// worker's ack of a record it read (announced before it could be read) is
// never judged against a tail that does not have it yet.
func (m *subManager) applyQueuedLocked() {
	m.qmu.Lock()
	notes := m.queue
	m.queue = nil
	m.qmu.Unlock()
	names := make([]string, 0, len(notes))
	for name := range notes {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		m.applyNoteLocked(notes[name])
	}
}

// keyDoc is the durable signing material.
type keyDoc struct {
	Seed []byte `json:"ed25519_seed"`
	MAC  []byte `json:"hmac_key"`
}

// loadKey reads the signing key document into m, creating it first when
// create is set and there is none. Without create, a missing key is no error
// (a node that never served a subscription request writes nothing).
func (m *subManager) loadKey(ctx context.Context, create bool) error {
	for {
		data, _, err := m.eng.GetDoc(ctx, signatureKeyDocKey)
		switch {
		case err == nil:
			var kd keyDoc
			if err := json.Unmarshal(data, &kd); err != nil || len(kd.Seed) != ed25519.SeedSize || len(kd.MAC) < 32 {
				return fmt.Errorf("signing key document is corrupt")
			}
			priv := ed25519.NewKeyFromSeed(kd.Seed)
			m.mu.Lock()
			m.priv, m.kid, m.mac = priv, jwkThumbprintKID(priv.Public().(ed25519.PublicKey)), kd.MAC
			m.mu.Unlock()
			return nil
		case errors.Is(err, streamstore.ErrNotFound):
			if !create {
				return nil
			}
			nk := keyDoc{Seed: randBytes(ed25519.SeedSize), MAC: randBytes(32)}
			b, _ := json.Marshal(nk)
			if _, err := m.eng.PutDoc(ctx, signatureKeyDocKey, b, ""); err != nil && !errors.Is(err, streamstore.ErrDocConflict) {
				return err
			}
			// Read it back: if another node won the race, its key is the key.
		default:
			return err
		}
	}
}

// ensureKey makes sure the signing key exists before a control request.
func (m *subManager) ensureKey(ctx context.Context) error {
	m.keyMu.Lock()
	defer m.keyMu.Unlock()
	m.mu.Lock()
	have := m.priv != nil
	m.mu.Unlock()
	if have {
		return nil
	}
	return m.loadKey(ctx, true)
}

func (m *subManager) load() error {
	ctx, cancel := context.WithTimeout(m.ctx, time.Minute)
	defer cancel()
	if err := m.loadKey(ctx, false); err != nil {
		return err
	}
	keys, err := m.eng.ListDocs(ctx, "")
	if err != nil {
		return err
	}
	subs := map[string]*subState{}
	for _, k := range keys {
		if k == signatureKeyDocKey {
			continue
		}
		data, ver, err := m.eng.GetDoc(ctx, k)
		if errors.Is(err, streamstore.ErrNotFound) {
			continue
		}
		if err != nil {
			return err
		}
		var s subState
		if err := json.Unmarshal(data, &s); err != nil {
			m.log.Warn("skipping corrupt subscription document", zap.String("key", k), zap.Error(err))
			continue
		}
		if s.Links == nil {
			s.Links = map[string]*subLink{}
		}
		s.key, s.version = k, ver
		subs[k] = &s
	}
	heads := m.headLinks(ctx, subs)
	recheck := failedLinks(subs, heads)
	// Written before the manager serves, when nothing else can see them.
	for _, s := range subs {
		if s.reconcile(heads) {
			if err := m.putSub(s); err != nil {
				m.log.Error("saving subscription", zap.String("id", s.ID), zap.Error(err))
			}
		}
	}
	m.mu.Lock()
	m.subs = subs
	m.index = subIndex{}
	for _, s := range subs {
		m.index.add(s)
	}
	// Wakes in flight before a restart are delivered again (same
	// generation), and so are the wake events of pull-wakes no worker has
	// claimed: the node may have stopped between saving the wake and
	// appending its event (or with the event's retry, which is kept in
	// memory only, still to come), and an unclaimed pull-wake has no lease
	// to run out. A worker that heard the first event finds the same wake.
	// What the documents say is due (leases, retries, pending work not
	// woken) is the tick's from now on.
	m.due = nil
	for _, s := range subs {
		if s.WakeID != "" && s.NextTry == 0 && (s.Config.Type == "webhook" || s.Holder == "") {
			s.NextTry = time.Now().UnixMilli()
		}
		m.scheduleLocked(s)
	}
	m.mu.Unlock()
	if len(recheck) > 0 {
		go m.recheckLinks(recheck)
	}
	return nil
}

// linkHead is what the engine said of a linked stream at load.
type linkHead struct {
	info streamstore.Info
	err  error
}

// subHeadWorkers bounds the streams looked up at once when loading.
const subHeadWorkers = 8

// headLinks looks up every stream the subscriptions link, by full name.
// The documents may be older than the streams: the node died between a
// stream's delete (or create, or append) and the write of a subscription
// that learned of it, or another node served the streams meanwhile. So
// what they say is compared with the engine at load (reconcile); one
// HEAD per linked stream, once per start.
func (m *subManager) headLinks(ctx context.Context, subs map[string]*subState) map[string]linkHead {
	names := map[string]bool{}
	for _, s := range subs {
		for p := range s.Links {
			names[s.Root+p] = true
		}
	}
	return m.headNames(ctx, names)
}

// headNames looks up the streams names, subHeadWorkers at a time.
func (m *subManager) headNames(ctx context.Context, names map[string]bool) map[string]linkHead {
	work := make(chan string)
	var mu sync.Mutex
	heads := make(map[string]linkHead, len(names))
	var wg sync.WaitGroup
	for i := 0; i < min(subHeadWorkers, len(names)); i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for name := range work {
				info, err := m.eng.Head(ctx, name)
				mu.Lock()
				heads[name] = linkHead{info, err}
				mu.Unlock()
			}
		}()
	}
	for name := range names {
		work <- name
	}
	close(work)
	wg.Wait()
	return heads
}

// linkRecheck is a link whose stream could not be looked up at load, and
// what the link was then.
type linkRecheck struct {
	sub        *subState
	path, name string
	stream     string
	tail       uint64
}

// failedLinks returns the links of subs whose stream's lookup failed for
// another reason than its absence: reconcile leaves them as stored, and
// the stored tail misses the records appended while a wake was in flight,
// which are not written (quietTail).
func failedLinks(subs map[string]*subState, heads map[string]linkHead) []linkRecheck {
	var out []linkRecheck
	for _, s := range subs {
		for p, l := range s.Links {
			h, ok := heads[s.Root+p]
			if ok && h.err != nil && !errors.Is(h.err, streamstore.ErrNotFound) && !errors.Is(h.err, streamstore.ErrGone) {
				out = append(out, linkRecheck{sub: s, path: p, name: s.Root + p, stream: l.Stream, tail: l.Tail})
			}
		}
	}
	return out
}

// recheckLinks looks the streams of rs up again, on the webhooks'
// backoff, until each has been answered or the engine closes, and
// applies each answer as the load would have (recheckLinkLocked). Without
// it such a link kept its stored tail until the stream's next append: a
// worker's ack of the records it read was refused as beyond the tail,
// and they were not pending.
func (m *subManager) recheckLinks(rs []linkRecheck) {
	for failures := 1; len(rs) > 0; failures++ {
		t := time.NewTimer(webhookBackoff(failures))
		select {
		case <-m.ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		names := map[string]bool{}
		for _, r := range rs {
			names[r.name] = true
		}
		ctx, cancel := context.WithTimeout(m.ctx, time.Minute)
		heads := m.headNames(ctx, names)
		cancel()
		m.mu.Lock()
		left := rs[:0]
		for _, r := range rs {
			if !m.recheckLinkLocked(r, heads[r.name]) {
				left = append(left, r)
			}
		}
		rs = left
		m.mu.Unlock()
	}
}

// recheckLinkLocked applies h, a lookup of r's stream, to r's link, and
// reports whether r is settled (false: look it up again). A link that a
// note changed since the load is left alone, since the note is newer than
// what the load knew, unless h only brings its tail on in the same
// stream, which is right whatever came since.
func (m *subManager) recheckLinkLocked(r linkRecheck, h linkHead) bool {
	if h.err != nil && !errors.Is(h.err, streamstore.ErrNotFound) && !errors.Is(h.err, streamstore.ErrGone) {
		return false
	}
	s := r.sub
	l := s.Links[r.path]
	if m.subs[s.key] != s || l == nil {
		return true // the subscription or the link went since
	}
	same := h.err == nil && l.Stream != "" && l.Stream == h.info.ID
	if !same && (l.Stream != r.stream || l.Tail != r.tail) {
		return true
	}
	if s.busy != nil {
		return false // its writer's for now
	}
	c := s.draft()
	if !c.reconcile(map[string]linkHead{r.name: h}) {
		return true
	}
	if same && (c.WakeID != "" || c.Holder != "") {
		// Only the tail moved, during a wake: not written, as a note's
		// tail then is not (quietTail).
		m.installLocked(s, c)
		return true
	}
	m.writeInBackgroundLocked(s, c, true, nil)
	return true
}

// reconcile brings s's links in line with the streams under their names
// (see headLinks) and reports whether it changed any.
func (s *subState) reconcile(heads map[string]linkHead) bool {
	changed := false
	for p, l := range s.Links {
		h, ok := heads[s.Root+p]
		switch {
		case !ok:
			continue
		case errors.Is(h.err, streamstore.ErrNotFound) || errors.Is(h.err, streamstore.ErrGone):
			if l.Stream == "" && l.Tail == 0 && (l.Explicit || l.Gone) {
				continue // already without a stream
			}
			s.streamGone(p, l)
		case h.err != nil:
			// Left as stored: a note about the stream corrects it.
			continue
		case l.Stream == h.info.ID:
			if h.info.NextSeq <= l.Tail {
				continue
			}
			// Records whose note was not saved before the node stopped.
			l.Tail = h.info.NextSeq
		case l.Stream != "" || h.info.NextSeq < l.Tail:
			// Another stream than the one the offsets count in (one
			// stored without an id is another when it is shorter).
			s.startOver(p, l, h.info.ID, h.info.StartSeq)
			l.Tail = h.info.NextSeq
		default:
			// Stored without an id (or linked before the stream existed):
			// the stream under the name is taken to be the linked one.
			l.Stream, l.Gone = h.info.ID, false
			l.Tail = max(l.Tail, h.info.NextSeq)
		}
		changed = true
	}
	return changed
}

func randBytes(n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return b
}

// jwkThumbprintKID is "ds_" and the RFC 7638 thumbprint of the public key.
func jwkThumbprintKID(pub ed25519.PublicKey) string {
	canon := `{"crv":"Ed25519","kty":"OKP","x":"` + base64.RawURLEncoding.EncodeToString(pub) + `"}`
	sum := sha256.Sum256([]byte(canon))
	return "ds_" + base64.RawURLEncoding.EncodeToString(sum[:])
}

func (m *subManager) jwks() any {
	m.mu.Lock()
	defer m.mu.Unlock()
	return map[string]any{"keys": []map[string]string{{
		"kty": "OKP", "crv": "Ed25519", "kid": m.kid, "use": "sig", "alg": "EdDSA",
		"x": base64.RawURLEncoding.EncodeToString(m.priv.Public().(ed25519.PublicKey)),
	}}}
}

func subDocKey(root, id string) string {
	return hex.EncodeToString([]byte(root)) + "/" + hex.EncodeToString([]byte(id))
}

// --- writing subscriptions -------------------------------------------------
//
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
			if m.refusesLinkLocked(c, rel, n) {
				continue
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
	c.key, c.indexed, c.dueAt, c.dueIdx, c.busy, c.kept = s.key, s.indexed, s.dueAt, s.dueIdx, s.busy, s.kept
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

// --- HTTP handlers ---------------------------------------------------------

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
	links := map[string]*subLink{}
	if cfg.Pattern != "" {
		prefix := root + globLiteralPrefix(cfg.Pattern)
		after := ""
		for {
			infos, more, err := m.eng.List(ctx, prefix, after, 1000)
			if err != nil {
				return nil, fmt.Errorf("listing the streams the pattern matches: %w", err)
			}
			for _, in := range infos {
				rel := strings.TrimPrefix(in.Name, root)
				if globMatch(cfg.Pattern, rel) {
					links[rel] = &subLink{Glob: true, Acked: in.NextSeq, Tail: in.NextSeq, Stream: in.ID}
				}
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
	s := &subState{ID: id, Root: root, BaseURL: base, Config: cfg, Hash: hash, CreatedAt: time.Now().UTC(), Links: links, key: key}
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
		s, ok := m.subs[key]
		if !ok {
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
	writeJSONStatus(w, http.StatusOK, "application/json", map[string]bool{"ok": true, "next_wake": s.WakeID != ""})
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
	auth := r.Header.Get("Authorization")
	tok, ok := strings.CutPrefix(auth, "Bearer ")
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

// --- tokens ----------------------------------------------------------------

// errTokenExpired is a token that was valid, and is past its expiry.
var errTokenExpired = errors.New("token expired")

type tokenClaims struct {
	Sub  string `json:"sub"` // subscription document key
	Gen  uint64 `json:"gen"`
	Wake string `json:"wake"`
	Exp  int64  `json:"exp"` // unix seconds
}

// tokenLocked is an HMAC-SHA256 signed token: base64url(claims) "." base64url(mac).
func (m *subManager) tokenLocked(s *subState) string {
	exp := time.Now().Add(s.lease() + time.Hour).Unix()
	b, _ := json.Marshal(tokenClaims{Sub: s.key, Gen: s.Generation, Wake: s.WakeID, Exp: exp})
	p := base64.RawURLEncoding.EncodeToString(b)
	h := hmac.New(sha256.New, m.mac)
	h.Write([]byte(p))
	return p + "." + base64.RawURLEncoding.EncodeToString(h.Sum(nil))
}

func (m *subManager) verifyTokenLocked(tok string) (tokenClaims, error) {
	var c tokenClaims
	p, sig, ok := strings.Cut(tok, ".")
	if !ok {
		return c, errors.New("malformed token")
	}
	got, err := base64.RawURLEncoding.DecodeString(sig)
	if err != nil {
		return c, err
	}
	h := hmac.New(sha256.New, m.mac)
	h.Write([]byte(p))
	if !hmac.Equal(got, h.Sum(nil)) {
		return c, errors.New("bad token signature")
	}
	b, err := base64.RawURLEncoding.DecodeString(p)
	if err != nil {
		return c, err
	}
	if err := json.Unmarshal(b, &c); err != nil {
		return c, err
	}
	if time.Now().Unix() > c.Exp {
		return c, errTokenExpired
	}
	return c, nil
}

func newWakeID() string { return "w_" + hex.EncodeToString(randBytes(12)) }

// --- wakes -----------------------------------------------------------------

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
		if m.refusesLinkLocked(s, rel, n) {
			return
		}
		if s.quietTail(rel, n) {
			// s has no writer: it changes in place, as its writer would.
			l := s.Links[rel]
			l.Tail = max(l.Tail, n.next)
			return
		}
		c := s.draft()
		if changed, grew := c.applyNote(rel, n); changed {
			m.writeInBackgroundLocked(s, c, grew, nil)
		}
	})
}

// refusesLinkLocked reports whether note n would link stream rel to s by
// its pattern while s links the most streams it may (subMaxLinks), and if
// so counts and logs that it is not linked: the subscription does not
// follow that stream until it has room again.
func (m *subManager) refusesLinkLocked(s *subState, rel string, n appendNote) bool {
	if n.deleted || s.Links[rel] != nil || s.Config.Pattern == "" || !globMatch(s.Config.Pattern, rel) {
		return false
	}
	limit := m.owner.linkLimit()
	if s.liveLinks() < limit {
		return false
	}
	if m.owner != nil && m.owner.metrics != nil {
		m.owner.metrics.subLinksRefused.Add(1)
	}
	m.refusedLog.warn(m.log, "a stream matches a subscription's pattern but is not linked: the subscription links the most streams it may",
		zap.String("subscription", s.ID), zap.String("root", s.Root), zap.String("stream", rel), zap.Int("max_links", limit))
	return true
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
	if c.WakeID != "" || c.Holder != "" || !c.pending() {
		return m.commitLocked(s, c)
	}
	wc := c.draft()
	wc.Generation++
	wc.WakeID = newWakeID()
	wc.Failures, wc.NextTry = 0, 0
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

// --- helpers ---------------------------------------------------------------

// globMatch: "*" matches one path segment, "**" zero or more.
func globMatch(pattern, path string) bool {
	return globSegs(strings.Split(strings.Trim(pattern, "/"), "/"), strings.Split(path, "/"))
}

// globSegs matches path segments s against pattern segments p in
// O(len(p)·len(s)) steps. The pattern comes from a client: a backtracking
// match would take exponential time on one with many "**" segments that
// fails at its end (each "**" trying every split of the path), spinning a
// core for good on every append to a stream under the subscription's root.
// reach[j] says whether the pattern segments seen so far match s[:j].
func globSegs(p, s []string) bool {
	reach := make([]bool, len(s)+1)
	reach[0] = true
	for _, seg := range p {
		if seg == "**" {
			// Zero or more segments: whatever was reached, and every
			// position after it.
			for j := 1; j <= len(s); j++ {
				reach[j] = reach[j] || reach[j-1]
			}
			continue
		}
		// Exactly one segment: shift by one where it matches.
		for j := len(s); j >= 1; j-- {
			reach[j] = reach[j-1] && (seg == "*" || seg == s[j-1])
		}
		reach[0] = false
	}
	return reach[len(s)]
}

// globLiteralPrefix is the pattern's segments before its first wildcard, for
// a listing prefix: every path the pattern matches starts with it. When
// what follows can match no segment at all (nothing, or only "**"), the
// last literal segment is left out: "events/a" and "events/a/**" match the
// stream "events/a" itself, of which "events/a/" is no prefix.
func globLiteralPrefix(pattern string) string {
	segs := strings.Split(strings.Trim(pattern, "/"), "/")
	k := 0
	for k < len(segs) && !strings.Contains(segs[k], "*") {
		k++
	}
	more := false // the path has a segment after the literal ones
	for _, seg := range segs[k:] {
		more = more || seg != "**"
	}
	if !more && k > 0 {
		k--
	}
	var b strings.Builder
	for _, seg := range segs[:k] {
		b.WriteString(seg + "/")
	}
	return b.String()
}

// validPattern bounds a subscription's glob pattern by the longest stream
// name: every append to a stream under the subscription's root is matched
// against it, so a pattern as large as the body allows would cost every
// append that much work.
func validPattern(pattern string) error {
	if len(pattern) > streamstore.MaxNameLength {
		return fmt.Errorf("pattern is %d bytes; the limit is %d", len(pattern), streamstore.MaxNameLength)
	}
	return nil
}

func validRelPath(root, p string) bool {
	if p == "" || p == reservedSegment || strings.HasPrefix(p, reservedSegment+"/") {
		return false
	}
	return streamstore.ValidateName(root+p) == nil
}

// wakeStreamProblem says what is wrong with the wake_stream of a pull-wake
// subscription under root, or "" when nothing is. A stream no create can
// make (a __ds segment is Durable Streams' own) would take the wake events
// of the subscription for ever, each retried on the webhook backoff.
func wakeStreamProblem(root, wake string) string {
	switch {
	case wake == "":
		return "wake_stream is required"
	case !validRelPath(root, wake):
		return fmt.Sprintf("wake_stream %q is no stream path under %s", wake, root)
	case hasReservedSegment(wake):
		return fmt.Sprintf("wake_stream %q has a %s segment, under which no stream can be created", wake, reservedSegment)
	}
	return ""
}

// validSubRoute checks the stream root and id of a subscription to create.
// Both go into its document and answers as JSON strings, and the id into
// the callback_url of its webhooks: an id that is not UTF-8 would come back
// as U+FFFD, naming another subscription; "." and ".." are dot segments
// that clients remove from a URL; a control byte has no place in one. A
// root that no stream name starts with (a dot or empty segment, NUL, not
// UTF-8) would make a subscription that matches nothing. Only creates are
// checked, so a subscription made before this rule can still be deleted.
func validSubRoute(root, id string) error {
	if root != "/" {
		if err := streamstore.ValidateName(strings.TrimSuffix(root, "/")); err != nil {
			return fmt.Errorf("the stream root %q is no stream path: %s", root, badRequestReason(err))
		}
	}
	switch {
	case !utf8.ValidString(id):
		return errors.New("the subscription id is not valid UTF-8")
	case id == "." || id == "..":
		return fmt.Errorf("the subscription id may not be %q", id)
	case strings.ContainsFunc(id, unicode.IsControl):
		return errors.New("the subscription id contains a control character")
	}
	return nil
}

// validateWebhookURL applies sections 6.2 and 12.8: https to a public
// address, or, when allowLoopback (the allow_loopback_webhooks option), the
// development exception http://localhost / http://127.0.0.x. Addresses are
// checked again at connect time (webhookDialControl), so DNS cannot point an
// accepted name at a private or loopback address.
func validateWebhookURL(raw string, allowLoopback bool) error {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" || u.User != nil {
		return errors.New("webhook.url must be an absolute URL without credentials")
	}
	host := u.Hostname()
	if isLoopbackDevHost(host) {
		if !allowLoopback {
			return errors.New("webhook.url is on localhost, which this server does not allow (allow_loopback_webhooks)")
		}
		if u.Scheme != "http" && u.Scheme != "https" {
			return errors.New("webhook.url must be http or https")
		}
		return nil
	}
	if u.Scheme != "https" {
		return errors.New("webhook.url must use https (http only for localhost)")
	}
	if ip, err := netip.ParseAddr(host); err == nil && !publicAddr(ip) {
		return errors.New("webhook.url points at a private, loopback or link-local address")
	}
	if strings.EqualFold(host, "metadata.google.internal") || strings.HasSuffix(strings.ToLower(host), ".internal") {
		return errors.New("webhook.url points at an internal host")
	}
	return nil
}

// isLoopbackDevHost is the development exception: localhost and 127.0.0.x.
func isLoopbackDevHost(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip, err := netip.ParseAddr(host)
	return err == nil && ip.Is4() && ip.As4()[0] == 127 && ip.As4()[1] == 0 && ip.As4()[2] == 0
}

// publicAddr reports whether ip is an address a webhook may be delivered
// to: one that is globally reachable and stands for itself. IPv4 excludes
// the special-purpose ranges (RFC 6890 and its updates) besides RFC 1918's;
// IPv6 is taken only in global unicast (2000::/3), so NAT64 prefixes
// (64:ff9b::/96, 64:ff9b:1::/48), IPv4-compatible addresses, ULAs,
// link-local and multicast are out, and within it the blocks that embed or
// tunnel to an IPv4 address a NAT64, 6to4 or Teredo relay would reach
// (64:ff9b::a00:5 is 10.0.0.5 behind a NAT64 gateway), and documentation
// blocks.
func publicAddr(ip netip.Addr) bool {
	ip = ip.Unmap()
	if !ip.IsValid() || ip.Zone() != "" {
		return false
	}
	nonPublic := nonPublicV6
	if ip.Is4() {
		nonPublic = nonPublicV4
	} else if !globalUnicastV6.Contains(ip) {
		return false
	}
	for _, p := range nonPublic {
		if p.Contains(ip) {
			return false
		}
	}
	return true
}

// globalUnicastV6 is the only IPv6 block webhooks may reach (RFC 4291).
var globalUnicastV6 = netip.MustParsePrefix("2000::/3")

// nonPublicV4 are the IPv4 blocks that are not globally reachable, or not
// unicast (IANA's special-purpose registry).
var nonPublicV4 = mustPrefixes(
	"0.0.0.0/8",       // this network
	"10.0.0.0/8",      // private
	"100.64.0.0/10",   // shared address space (CGNAT)
	"127.0.0.0/8",     // loopback
	"169.254.0.0/16",  // link-local, cloud metadata
	"172.16.0.0/12",   // private
	"192.0.0.0/24",    // IETF protocol assignments
	"192.0.2.0/24",    // documentation
	"192.88.99.0/24",  // 6to4 relay anycast
	"192.168.0.0/16",  // private
	"198.18.0.0/15",   // benchmarking
	"198.51.100.0/24", // documentation
	"203.0.113.0/24",  // documentation
	"224.0.0.0/4",     // multicast
	"240.0.0.0/4",     // reserved, and the limited broadcast address
)

// nonPublicV6 are the blocks of 2000::/3 that are not globally reachable
// or that lead to another address than their own.
var nonPublicV6 = mustPrefixes(
	"2001::/23",     // IETF protocol assignments, Teredo (2001::/32) among them
	"2001:db8::/32", // documentation
	"2002::/16",     // 6to4: embeds an IPv4 address
	"3fff::/20",     // documentation
)

func mustPrefixes(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}

// webhookDialControl refuses connections to non-public addresses; with
// loopback, it also allows loopback ones (the development exception).
func webhookDialControl(loopback bool) func(string, string, syscall.RawConn) error {
	return func(_, address string, _ syscall.RawConn) error {
		ap, err := netip.ParseAddrPort(address)
		if err != nil {
			return err
		}
		ip := ap.Addr().Unmap()
		if publicAddr(ip) || (loopback && ip.IsLoopback()) {
			return nil
		}
		return fmt.Errorf("webhook address %s is not public", ip)
	}
}

// loopbackKey marks a delivery whose subscription may reach loopback.
type loopbackKey struct{}

// webhookDial connects with the address check for the delivery's
// subscription (see subState.Loopback).
func webhookDial(ctx context.Context, network, addr string) (net.Conn, error) {
	loopback, _ := ctx.Value(loopbackKey{}).(bool)
	d := net.Dialer{Timeout: 5 * time.Second, Control: webhookDialControl(loopback)}
	return d.DialContext(ctx, network, addr)
}

// readJSONBody decodes a control request's JSON body into v, answering
// itself when it cannot: 413 naming the limit for a body over subMaxBody or
// over Caddy's request_body max_size (a 400 would tell the client that its
// request is malformed), 415 for one with a content coding, 408 for one
// that stopped arriving, 400 for anything else.
func readJSONBody(w http.ResponseWriter, r *http.Request, v any) bool {
	data, err := readBody(r, subMaxBody, limitSubscription)
	switch {
	case errors.Is(err, errBodyTooLarge):
		subError(w, http.StatusRequestEntityTooLarge, "PAYLOAD_TOO_LARGE", err.Error())
		return false
	case errors.Is(err, errBodyEncoded):
		w.Header().Set("Accept-Encoding", "identity")
		subError(w, http.StatusUnsupportedMediaType, "INVALID_REQUEST", err.Error())
		return false
	case errors.Is(err, errBodyTimeout):
		subError(w, http.StatusRequestTimeout, "INVALID_REQUEST", err.Error())
		return false
	case err != nil:
		subError(w, http.StatusBadRequest, "INVALID_REQUEST", "unreadable body: "+err.Error())
		return false
	}
	if len(bytes.TrimSpace(data)) == 0 {
		data = []byte("{}")
	}
	if err := json.Unmarshal(data, v); err != nil {
		subError(w, http.StatusBadRequest, "INVALID_REQUEST", "invalid JSON: "+err.Error())
		return false
	}
	return true
}

// heldResponse keeps a handler's status and body in memory until send;
// its headers are the response's own.
type heldResponse struct {
	w      http.ResponseWriter
	status int
	body   bytes.Buffer
}

func (h *heldResponse) Header() http.Header { return h.w.Header() }

func (h *heldResponse) WriteHeader(status int) {
	if h.status == 0 {
		h.status = status
	}
}

func (h *heldResponse) Write(b []byte) (int, error) {
	h.WriteHeader(http.StatusOK)
	return h.body.Write(b)
}

// send writes what was kept to the client; nothing when nothing was
// written (net/http then answers 200 itself, as it would have).
func (h *heldResponse) send() {
	if h.status == 0 {
		return
	}
	h.w.WriteHeader(h.status)
	if h.body.Len() > 0 {
		h.w.Write(h.body.Bytes())
	}
}

func writeJSONStatus(w http.ResponseWriter, status int, ctype string, v any) {
	b, _ := json.Marshal(v)
	w.Header().Set("Content-Type", ctype)
	if w.Header().Get("Cache-Control") == "" {
		w.Header().Set("Cache-Control", cacheControlNoStore)
	}
	w.WriteHeader(status)
	w.Write(b)
}

// subWrite is the change a subscription request writes to its document,
// for the answer to a write that storage did not confirm, which may still
// have landed: what the change is called, and what a repeat of the request
// does, which makes the repeat safe. The zero subWrite is a request that
// failed before writing anything of its own.
type subWrite struct {
	what   string
	repeat string
	// outcome, when set, says what became of the change instead of
	// subMaybeTaken (a delete: the server finishes it).
	outcome string
}

// subMaybeTaken is what became of a change storage did not confirm.
const subMaybeTaken = "it was not acknowledged, and it may or may not take effect"

// The changes of the subscription requests. Each repeat is what
// TestUnconfirmedSubscriptionWritesAreRepeated and, where the change took
// effect, ...AfterARestart check (a callback is an ack's handler). While
// this server keeps the storage, a change whose write was not confirmed is
// not its state (commitLocked), so a repeat does it again; a server that
// reads the document anew (another that takes the storage over, a restart)
// finds it if it landed, and a repeat then meets it done. A delete is the
// exception, and so is a create: this server takes the subscription out
// of service and finishes the delete itself (handleDelete), and undoes
// the create the same way (handlePut).
var (
	subWriteCreate = subWrite{what: "create",
		repeat: "repeat it: an identical PUT creates the subscription once storage has confirmed the undo (it waits for that a few seconds)",
		outcome: "it was not acknowledged, and the server undoes it until storage confirms that: " +
			"the subscription does not exist on this server"}
	subWriteDelete = subWrite{what: "delete",
		repeat: "repeat it: a repeat answers 204 once storage has confirmed the delete (it waits for that a few seconds)",
		outcome: "it was not acknowledged, and the server goes on deleting it until storage confirms it: " +
			"the subscription is gone from this server, which wakes no worker and calls no webhook for it"}
	subWriteAdd = subWrite{what: "change of the subscription's streams",
		repeat: "repeat it: it links each stream once, and leaves a stream linked already at its offsets"}
	subWriteRemove = subWrite{what: "change of the subscription's streams",
		repeat: "repeat it: a removal of a stream the subscription does not link succeeds"}
	subWriteClaim = subWrite{what: "claim",
		repeat: "repeat it with the same worker: it is granted, or, where the claim took effect, answered " +
			"409 ALREADY_CLAIMED naming this worker until that lease runs out"}
	subWriteAck = subWrite{what: "ack",
		repeat: ackRepeat}
	subWriteCallback = subWrite{what: "callback",
		repeat: ackRepeat}
	subWriteAckDone = subWrite{what: "ack",
		repeat: ackDoneRepeat}
	subWriteCallbackDone = subWrite{what: "callback",
		repeat: ackDoneRepeat}
	subWriteRelease = subWrite{what: "release",
		repeat: "repeat it: it is taken, or, where it took effect and ended the wake, answered 409 FENCED"}
)

// What a repeat of an ack (or a webhook's callback) does, one that ends
// the wake (done) or not.
const (
	ackRepeat     = "repeat it as it was: an ack at the offsets it acknowledged is taken again"
	ackDoneRepeat = "repeat it as it was: it is taken, or, where it took effect and ended the wake, answered 409 FENCED"
)

// ackWrite is the change of an ack, or of a webhook's callback, that ends
// the wake or not (done).
func ackWrite(callback, done bool) subWrite {
	switch {
	case callback && done:
		return subWriteCallbackDone
	case callback:
		return subWriteCallback
	case done:
		return subWriteAckDone
	}
	return subWriteAck
}

// subUnavailableMessage answers a subscription request that failed on
// storage without writing anything.
const subUnavailableMessage = "storage unavailable; nothing was changed, retry"

// storeFailed answers 503 UNAVAILABLE with Retry-After to a subscription
// request that failed on storage, op being the change it writes, as a
// stream's write is answered in the same case: a write storage did not
// confirm may or may not take effect, and the answer says what a repeat
// does (op); a refusal of the storage's for good is named, and so is
// another server's takeover; anything else changed nothing. No answer
// names an object key or the store's error, which the warning logged
// (sampled with the storage's stream failures) has.
func (m *subManager) storeFailed(w http.ResponseWriter, r *http.Request, op subWrite, err error) {
	reason, refused := streamstore.StorageRefusal(err)
	var warning, msg string
	switch {
	case op.what != "" && errors.Is(err, streamstore.ErrUnconfirmed):
		warning = failWarning("write not confirmed in time", err)
		outcome := op.outcome
		if outcome == "" {
			outcome = subMaybeTaken
		}
		if refused {
			msg = "storage refuses writes: " + reason + "; the " + op.what + " " +
				strings.TrimPrefix(outcome, "it ") + "; once storage takes writes again, " + op.repeat
		} else {
			msg = "storage did not confirm the " + op.what + ": " + outcome + "; " + op.repeat
		}
	case errors.Is(err, streamstore.ErrTakenOver):
		warning, msg = "storage taken over by another server", takenOverMessage
	case refused:
		warning, msg = failWarning("storage unavailable", err),
			"storage refuses writes: "+reason+"; nothing was written, retry once storage takes writes again"
	default:
		warning, msg = failWarning("storage unavailable", err), subUnavailableMessage
	}
	m.owner.storeFailLog().warn(m.log, warning, zap.String("method", r.Method), zap.String("subscription", r.URL.Path), zap.Error(err))
	w.Header().Set("Retry-After", "1")
	subError(w, http.StatusServiceUnavailable, "UNAVAILABLE", msg)
}

func subError(w http.ResponseWriter, status int, code, msg string) {
	writeJSONStatus(w, status, "application/json", map[string]any{"error": map[string]string{"code": code, "message": msg}})
}
