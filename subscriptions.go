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
// Durability: these files (subscriptions.go and the other sub*.go) know
// HTTP, not S3. Every subscription (config, generation, wake id, lease
// holder and expiry, retry schedule, links with their acked offsets) is one
// JSON document written with compare-and-swap through the engine's document
// store (streamstore.Engine.PutDoc, objects under subs/ in the bucket),
// after every change and before the change is answered or acted on. The
// Ed25519 webhook signing key and the HMAC key of callback tokens are
// generated once and kept in the document "key". So a restart (or another
// node taking the storage lease) finds every subscription, generation and
// cursor where it was, and a stale generation stays fenced. Stream tails
// learned from the engine's append hook are kept in the same documents,
// with the id of the stream they count in (see subLink).
//
// One subManager serves each engine; it runs one goroutine (the loop: append
// notifications, lease expiry, webhook retries) and short-lived delivery
// and document-writing goroutines, all of which end when the engine
// closes. Documents are written outside the manager's lock, one writer per
// subscription at a time (see subwriter.go).

import (
	"bytes"
	"cmp"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"iter"
	"maps"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

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
	webhookIdleConns   = 64 // idle webhook connections kept, over all hosts
	webhookIdleTimeout = 90 * time.Second
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
	// A request that is refused on its own (no such resource, a method it
	// does not take, a body that is not JSON) is answered before the
	// manager is waited for or the signing key written: a rejected
	// request writes nothing, and is its 4xx whatever storage does.
	// A create makes the key itself, once its body is judged (handlePut).
	prepare := func(withKey bool) bool {
		err := m.ready(r.Context())
		if err == nil && withKey {
			err = m.ensureKey(r.Context())
		}
		if err != nil {
			m.storeFailed(w, r, subWrite{}, err)
			return false
		}
		return true
	}
	if rest == "jwks.json" {
		if !methodAllowed(w, r, jwksMethods) || !prepare(true) {
			return true
		}
		w.Header().Set("Cache-Control", "public, max-age=300")
		writeJSONStatus(w, http.StatusOK, "application/jwk-set+json", m.jwks())
		return true
	}
	id, sub, found := strings.Cut(strings.TrimPrefix(rest, "subscriptions/"), "/")
	if !strings.HasPrefix(rest, "subscriptions/") || id == "" {
		subError(w, http.StatusNotFound, "NOT_FOUND", "no such control resource")
		return true
	}
	if len(id) > subMaxIDLen || len(root) > subMaxIDLen {
		if r.Method == http.MethodPut && !found {
			subError(w, http.StatusBadRequest, "INVALID_REQUEST",
				fmt.Sprintf("a subscription's id and its stream root are at most %d bytes each", subMaxIDLen))
			return true
		}
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
	if r.Method == http.MethodPut || r.Method == http.MethodPost {
		// Read whole here, so that JSON syntax is judged before any
		// storage work; the handler reads it again from memory.
		data, ok := readControlBody(w, r)
		if !ok {
			return true
		}
		if !json.Valid(data) {
			var v any
			err := json.Unmarshal(data, &v)
			subError(w, http.StatusBadRequest, "INVALID_REQUEST", "invalid JSON: "+err.Error())
			return true
		}
		r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(data)), int64(len(data))
	}
	if !prepare(found || r.Method != http.MethodPut) {
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

// streamGone applies the delete of the stream link p counts in. A glob
// link stays, Gone, only while a worker may ack it: one holds the wake, or
// the wake in flight was sent with it (a webhook's). Kept whenever a wake
// was in flight, the links of a wake nobody claims (a pull-wake with no
// worker up, a webhook failing for days) piled up without end, one per
// matching stream made and deleted, in a document rewritten whole at
// every change.
func (s *subState) streamGone(p string, l *subLink) {
	_, offered := s.Snapshot[p]
	s.startOver(p, l, "", 0)
	switch {
	case l.Explicit:
	case s.Holder == "" && (s.WakeID == "" || !offered):
		delete(s.Links, p)
		if s.WakeID != "" {
			// A webhook's worker may have seen the link in a GET of the
			// subscription: its ack of it moves nothing, and is no
			// reason to refuse the rest of the ack (or its done).
			s.noteRemoved(p)
		}
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
	if c.Type == "webhook" {
		// Stored by versions that kept it: the webhook's delivery
		// configuration is its URL (section 6.2).
		c.WakeStream = ""
	}
	b, _ := json.Marshal(c)
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// subState is the durable document of one subscription.
type subState struct {
	ID        string    `json:"id"`
	Root      string    `json:"root"`
	BaseURL   string    `json:"base_url"` // public URL of the stream root
	Config    subConfig `json:"config"`
	Hash      string    `json:"hash"`
	CreatedAt time.Time `json:"created_at"`
	// ListedFrom is when the create began to list the streams its pattern
	// matched (Unix ms): an append from then on to a stream it does not
	// link is one it was to hear of (relinkReplayed).
	ListedFrom int64               `json:"listed_from,omitempty"`
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
	// busy is set while a writer owns s (see subwriter.go)
	// and closed when it lets go; kept holds the append and delete notes
	// that came for s meanwhile, which the writer applies before it lets
	// go, so that busy is never clear with notes kept.
	busy    chan struct{}
	kept    []appendNote
	indexed subIndexed // where the manager's index has it
	dueAt   int64      // unix ms of its next tick case (nextTick), while dueIdx > 0
	dueIdx  int        // its place in the manager's due heap plus one; 0 when not in it
	// posting is the wake whose webhook POST is under way, "" when none.
	posting string
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
	// damaged holds, by key, the documents the load could not decode:
	// their subscriptions answer 500 naming the object, not 404, until a
	// create of the same id replaces the document or a delete removes it.
	damaged map[string]damagedDoc
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

	// replayed is what the engine's start replayed from the WAL, until a
	// load has used it (relinkReplayed).
	replayed []streamstore.ReplayedStream
	qmu      sync.Mutex
	queue    map[string]appendNote // by stream name, coalesced: bounded by the streams appended to
	kick     chan struct{}
	client   *http.Client
	ctx      context.Context // ends when the engine closes

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
	tick     time.Duration  // how often leases and retries are looked at; 0: subTickInterval (tests set it)
}

// tickInterval returns how often the engine's manager looks at leases and
// retries without being kicked.
func (sm *subManagers) tickInterval() time.Duration {
	if sm == nil || sm.tick <= 0 {
		return subTickInterval
	}
	return sm.tick
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
		// Idle connections are bounded and time out: a receiver that never
		// closes its own would otherwise keep a socket and two goroutines
		// of this process per webhook host ever called.
		Transport: &http.Transport{DialContext: webhookDial, MaxIdleConnsPerHost: 2,
			MaxIdleConns: webhookIdleConns, IdleConnTimeout: webhookIdleTimeout},
		CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse // a redirect could lead anywhere
		},
	}
	sm.cur.Store(m)
	m.replayed = eng.TakeReplayed()
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
		m.client.CloseIdleConnections() // the next engine has a client of its own
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
	t := time.NewTicker(m.owner.tickInterval())
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
	subs, damaged, err := m.loadDocs(keys)
	if err != nil {
		return err
	}
	replayed := m.replayedLinks(subs)
	// The links' own minute: a lookup it cuts short is checked again
	// later (recheckLinks), not lost.
	hctx, hcancel := context.WithTimeout(m.ctx, time.Minute)
	defer hcancel()
	heads := m.headLinks(hctx, subs)
	recheck := failedLinks(subs, heads)
	// Written before the manager serves, when nothing else can see them.
	for _, s := range subs {
		// Relinked once the links know their tails: which glob link is
		// idle, to make way, depends on them.
		changed := s.reconcile(heads)
		if m.relinkReplayed(s, replayed[s]) {
			changed = true
		}
		if changed {
			if err := m.putSub(s); err != nil {
				m.log.Error("saving subscription", zap.String("id", s.ID), zap.Error(err))
			}
		}
	}
	m.mu.Lock()
	m.replayed = nil // in the documents now, or in memory to be written with the next change
	m.subs, m.damaged = subs, damaged
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

// subLoadWorkers bounds the subscription documents read at once when
// loading: one at a time, a bucket 25 ms away read some 2,400 of them in
// the minute the whole load once had, and past that the load failed and
// started over for ever, no subscription served.
const subLoadWorkers = 16

// loadDocs reads and decodes the subscription documents keys,
// subLoadWorkers at a time, each read within subDocTimeout: the load takes
// as long as there are documents, not a fixed budget for all of them.
func (m *subManager) loadDocs(keys []string) (subs map[string]*subState, damaged map[string]damagedDoc, err error) {
	var mu sync.Mutex
	subs, damaged = map[string]*subState{}, map[string]damagedDoc{}
	eachAtOnce(slices.Values(keys), subLoadWorkers, func(k string) bool {
		if k == signatureKeyDocKey {
			return true
		}
		s, bad, lerr := m.loadDoc(k)
		mu.Lock()
		defer mu.Unlock()
		switch {
		case lerr != nil:
			err = cmp.Or(err, lerr)
			return false // the load starts over: read no more
		case s != nil:
			subs[k] = s
		case bad.why != "":
			damaged[k] = bad
		}
		return true
	})
	return subs, damaged, err
}

// eachAtOnce calls fn for each item of seq, on up to workers goroutines
// at once, and returns once every call has: after a call returns false,
// no more are started.
func eachAtOnce(seq iter.Seq[string], workers int, fn func(string) bool) {
	work := make(chan string)
	var (
		wg      sync.WaitGroup
		stopped atomic.Bool
	)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for item := range work {
				if !fn(item) {
					stopped.Store(true)
				}
			}
		}()
	}
	for item := range seq {
		if stopped.Load() {
			break
		}
		work <- item
	}
	close(work)
	wg.Wait()
}

// damagedDoc is a subscription document that does not decode: why, and
// the version a delete of it replaces.
type damagedDoc struct{ why, version string }

// loadDoc reads subscription document k: nil when it is gone, and bad
// when it cannot be decoded (logged and counted as damage).
func (m *subManager) loadDoc(k string) (s *subState, bad damagedDoc, err error) {
	ctx, cancel := context.WithTimeout(m.ctx, subDocTimeout)
	defer cancel()
	data, ver, err := m.eng.GetDoc(ctx, k)
	if errors.Is(err, streamstore.ErrNotFound) {
		return nil, damagedDoc{}, nil
	}
	if err != nil {
		return nil, damagedDoc{}, fmt.Errorf("read subscription %s: %w", k, err)
	}
	s = new(subState)
	if err := json.Unmarshal(data, s); err != nil {
		m.log.Error("subscription document damaged: the subscription answers 500 until the object is restored from a copy (and the node restarted), the subscription is created again, or it is deleted",
			zap.String("object", streamstore.DocObjectKey(k)), zap.Error(err))
		if m.owner != nil && m.owner.metrics != nil {
			m.owner.metrics.subDocsDamaged.Add(1)
		}
		why := fmt.Sprintf("subscription document %s is damaged (%v); restore it from a copy, create the subscription again, or delete it", streamstore.DocObjectKey(k), err)
		return nil, damagedDoc{why, ver}, nil
	}
	if s.Links == nil {
		s.Links = map[string]*subLink{}
	}
	s.key, s.version = k, ver
	return s, damagedDoc{}, nil
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
	var mu sync.Mutex
	heads := make(map[string]linkHead, len(names))
	eachAtOnce(maps.Keys(names), subHeadWorkers, func(name string) bool {
		info, err := m.eng.Head(ctx, name)
		mu.Lock()
		heads[name] = linkHead{info, err}
		mu.Unlock()
		return true
	})
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
