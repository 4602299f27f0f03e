package segment

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// FormatVersion is the bucket layout this build reads and writes. Version 2
// added packs to the manifest, version 3 repack entries to packs (one that
// replaces the runs of older packs), version 4 a create's metadata and drop
// marks to WAL entries: a build that knows an older version would lose
// records that only the new layout holds, or take the WAL for corrupt, so
// it must refuse the bucket.
const FormatVersion = 4

// upgradableFormat reports whether version v is an older layout this build
// reads and moves on to FormatVersion: everything in it means the same in
// the new one.
func upgradableFormat(v int) bool { return v >= 1 && v <= 3 }

const (
	formatKey   = "format"
	manifestKey = "manifest"
	leaseKey    = "lease"
)

// CheckFormat creates the format version object in an empty bucket, or
// verifies that an existing one names a version this build knows, moving
// an older one it can read on to FormatVersion. The caller holds the lease.
func CheckFormat(ctx context.Context, store Store) error {
	want := []byte(fmt.Sprintf(`{"picomq_format":%d}`, FormatVersion))
	data, etag, err := store.Get(ctx, formatKey, 0, -1)
	if errors.Is(err, ErrNotFound) {
		// Every build since the first writes the format object before
		// anything else: storage with a manifest and none lost it, and
		// this build cannot tell which layout the rest is in.
		switch _, _, merr := store.Get(ctx, manifestKey, 0, 0); {
		case merr == nil:
			return errors.New("storage has a manifest but no format object (lost, or left out of a copy); restore it from a copy of the same storage")
		case !errors.Is(merr, ErrNotFound):
			return fmt.Errorf("read manifest: %w", merr)
		}
		_, err = store.Put(ctx, formatKey, want, PutOptions{IfNoneMatch: true})
		if err == nil {
			return nil
		}
		if !errors.Is(err, ErrPreconditionFailed) {
			return fmt.Errorf("create format object: %w", err)
		}
		data, etag, err = store.Get(ctx, formatKey, 0, -1)
	}
	if err != nil {
		return fmt.Errorf("read format object: %w", err)
	}
	var f struct {
		Format int `json:"picomq_format"`
	}
	if err := json.Unmarshal(data, &f); err != nil {
		return fmt.Errorf("format object is not PicoMQ's: %w", err)
	}
	if f.Format == FormatVersion {
		return nil
	}
	if upgradableFormat(f.Format) {
		// Before anything is written in the new layout, so an older build
		// started later refuses the bucket instead of misreading it.
		if _, err := store.Put(ctx, formatKey, want, PutOptions{IfMatch: etag}); err != nil {
			return fmt.Errorf("move format object from version %d to %d: %w", f.Format, FormatVersion, err)
		}
		return nil
	}
	return fmt.Errorf("storage has PicoMQ format version %d; this build reads versions 1 to %d only", f.Format, FormatVersion)
}

// Manifest says where replay starts: which WAL namespaces may still hold
// data that is not compacted, and where each was sealed.
type Manifest struct {
	Version       int         `json:"version"`
	NextNamespace uint64      `json:"next_namespace"`
	Namespaces    []Namespace `json:"namespaces"`
	// Packs are the live packs, oldest first: replay reads their indexes
	// before the WAL, since everything in them was cut from it earlier.
	Packs []PackRef `json:"packs,omitempty"`
	// BlobsSweptTo: the blobs of namespaces below it that no entry names
	// were deleted by an earlier start, so a start sweeps only the blobs
	// of later namespaces (zero: none swept yet, blobs without a
	// namespace in their name included).
	BlobsSweptTo uint64 `json:"blobs_swept_to,omitempty"`
	// RetiredWAL lists namespaces no longer replayed whose WAL objects
	// may still be in the bucket: a compaction takes a namespace out of
	// Namespaces and deletes its objects after that write, so a failed
	// delete, or a crash in between, would otherwise leave them for good.
	// A compaction deletes what is listed here and takes out, at its next
	// manifest write, the namespaces it found empty.
	RetiredWAL []uint64 `json:"retired_wal,omitempty"`
}

// Namespace is one writer namespace (one process start) in the manifest.
type Namespace struct {
	ID uint64 `json:"id"`
	// ReplayFrom: WAL objects below this sequence are compacted.
	ReplayFrom uint64 `json:"replay_from"`
	// SealedAt, once set, is the first sequence that was never committed;
	// objects at or above it are ignored for good.
	SealedAt *uint64 `json:"sealed_at,omitempty"`
	// Owner is the token of the process that registered the namespace:
	// the manifest's newest namespace names the process that owns the
	// storage (see Manifests.Update).
	Owner string `json:"owner,omitempty"`
}

// Manifests loads and updates the manifest with compare-and-swap.
type Manifests struct {
	store Store

	mu    sync.Mutex
	owner string // this process's token, once Replay registered its namespace
}

// fenced reports ErrFenced when this process has registered a namespace
// and cur's newest namespace is not one of its own: another process
// (perhaps of the same node id, which takes the lease at once) started on
// the storage since. The lease alone cannot stop a manifest write of the
// process it replaced: that process checks the lease and then writes, and
// the takeover can fall in between. The manifest is written with
// compare-and-swap, so this check and the write are one step.
func (m *Manifests) fenced(cur *Manifest) error {
	m.mu.Lock()
	owner := m.owner
	m.mu.Unlock()
	if owner == "" || cur.NextNamespace == 0 {
		return nil
	}
	newest := cur.NextNamespace - 1
	for _, n := range cur.Namespaces {
		if n.ID == newest && n.Owner == owner {
			return nil
		}
	}
	return fmt.Errorf("%w: namespace %d of the manifest was registered by another process", ErrFenced, newest)
}

// NewManifests returns the manifest accessor of store.
func NewManifests(store Store) *Manifests { return &Manifests{store: store} }

// Update applies fn to the current manifest and writes it back with
// if-match (or if-none-match when there is none yet), retrying on a lost race.
// Once this process has registered its namespace (Replay), Update refuses
// with ErrFenced a manifest whose newest namespace is another process's.
func (m *Manifests) Update(ctx context.Context, fn func(*Manifest) error) (Manifest, error) {
	for attempt := 0; ; attempt++ {
		cur, etag, err := m.Load(ctx)
		if err != nil {
			return Manifest{}, err
		}
		if err := m.fenced(&cur); err != nil {
			return Manifest{}, err
		}
		if err := fn(&cur); err != nil {
			return Manifest{}, err
		}
		data, err := json.Marshal(cur)
		if err != nil {
			return Manifest{}, fmt.Errorf("encode manifest: %w", err)
		}
		opts := PutOptions{IfMatch: etag, IfNoneMatch: etag == ""}
		if _, err = m.store.Put(ctx, manifestKey, data, opts); err == nil {
			return cur, nil
		}
		if !errors.Is(err, ErrPreconditionFailed) || attempt >= 8 {
			return Manifest{}, fmt.Errorf("write manifest: %w", err)
		}
	}
}

// Load returns the manifest and its ETag ("" when there is none yet).
func (m *Manifests) Load(ctx context.Context) (Manifest, string, error) {
	data, etag, err := m.store.Get(ctx, manifestKey, 0, -1)
	if errors.Is(err, ErrNotFound) {
		return Manifest{Version: 1}, "", nil
	}
	if err != nil {
		return Manifest{}, "", fmt.Errorf("read manifest: %w", err)
	}
	var man Manifest
	if err := json.Unmarshal(data, &man); err != nil {
		return Manifest{}, "", fmt.Errorf("%w: manifest: %v", ErrCorrupt, err)
	}
	return man, etag, nil
}

// takeNamespace takes cur's next namespace number. One the manifest
// still lists, or whose WAL is in the bucket, is refused: a manifest that
// went back (restored from an older copy, edited) would have the writer's
// uploads meet the old objects at their keys, and an old batch could be
// taken for the new one. The listing costs one LIST per start.
func (m *Manifests) takeNamespace(ctx context.Context, cur *Manifest) (uint64, error) {
	id := cur.NextNamespace
	used := make([]uint64, 0, len(cur.Namespaces)+len(cur.RetiredWAL))
	for _, n := range cur.Namespaces {
		used = append(used, n.ID)
	}
	for _, u := range append(used, cur.RetiredWAL...) {
		if u >= id {
			return 0, fmt.Errorf("%w: manifest: next namespace %d, but namespace %d is listed; was the manifest restored from an older copy?", ErrCorrupt, id, u)
		}
	}
	objs, _, err := m.store.List(ctx, WALPrefix(id), "", 1)
	if err != nil {
		return 0, fmt.Errorf("list %s: %w", WALPrefix(id), err)
	}
	if len(objs) > 0 {
		return 0, fmt.Errorf("%w: manifest: next namespace %d, but %s is in the bucket; was the manifest restored from an older copy?", ErrCorrupt, id, objs[0].Key)
	}
	cur.NextNamespace++
	return id, nil
}

// RegisterNamespace adds a fresh namespace to the manifest and returns it.
func (m *Manifests) RegisterNamespace(ctx context.Context) (uint64, error) {
	var id uint64
	_, err := m.Update(ctx, func(man *Manifest) error {
		var err error
		if id, err = m.takeNamespace(ctx, man); err != nil {
			return err
		}
		// A namespace being replaced is sealed by whoever replaces it; the
		// live one of this process is the only unsealed entry it adds.
		man.Namespaces = append(man.Namespaces, Namespace{ID: id, Owner: m.token()})
		return nil
	})
	return id, err
}

func (m *Manifests) token() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.owner
}

// Lease is the single-writer lock on a storage: an object naming its holder
// that expires unless renewed. The holder counts it valid for four fifths
// of its lifetime from the moment a write of it began, so it stops writing
// well before another node may take over, even with some clock skew.
//
// A write of the lease can land while its answer is lost (a connection
// reset after the request went out); the object's ETag then is no longer
// the one the holder knows, and a conditional write or a check by ETag
// alone would take the holder's own write for another node's takeover and
// stop it for good. Each body therefore carries a token of this process:
// when the ETag differs, the body tells whether the write was ours.
type Lease struct {
	store Store
	node  string
	token string // this process's: tells its own writes from any other's
	ttl   time.Duration

	mu         sync.Mutex
	etag       string
	validUntil time.Time
}

type leaseBody struct {
	Node      string `json:"node"`
	Token     string `json:"token,omitempty"`
	ExpiresAt int64  `json:"expires_at_ms"`
}

// ErrLeaseHeld is returned when another node holds the storage lease.
var ErrLeaseHeld = errors.New("storage is in use by another PicoMQ node")

// LeaseHeldError is ErrLeaseHeld with what the lease object said: a node
// waiting to take the storage over tries again when Until passes, the
// moment the lease lapses unless its holder renews it.
type LeaseHeldError struct {
	Node  string
	Until time.Time
}

func (e *LeaseHeldError) Error() string {
	return fmt.Sprintf("%v: node %s holds it until %s", ErrLeaseHeld, e.Node, e.Until.UTC().Format(time.RFC3339))
}

// Is makes errors.Is(err, ErrLeaseHeld) hold.
func (e *LeaseHeldError) Is(target error) bool { return target == ErrLeaseHeld }

// ErrLeaseHeldHere is returned by AcquireLeaseWith, with
// LeaseOptions.NotFromThisProcess, when the storage's lease is held by a
// live Lease of this very process.
var ErrLeaseHeldHere = errors.New("storage is already open in this process under another storage URL " +
	"that names the same bucket and prefix (write it the same way in every handler; " +
	"changing it in a reload takes a restart)")

// heldHere holds the tokens of the leases this process holds (from their
// acquisition until Release or Abandon).
var heldHere sync.Map

// LeaseOptions tune AcquireLeaseWith.
type LeaseOptions struct {
	// NotFromThisProcess refuses, with ErrLeaseHeldHere, a lease that a
	// live Lease of this process holds, instead of taking it over as a
	// restart of the node does. Two engines of one process on one storage
	// (named by two URLs) would otherwise take it from each other, each
	// fencing the other: a config reload that failed after taking it left
	// the running engine unable to write until a restart.
	NotFromThisProcess bool
}

// AcquireLease takes the storage lease for node. The same node takes it back
// at once (a restart); another node only after it expires.
func AcquireLease(ctx context.Context, store Store, node string, ttl time.Duration) (*Lease, error) {
	return AcquireLeaseWith(ctx, store, node, ttl, LeaseOptions{})
}

// AcquireLeaseWith is AcquireLease with options.
func AcquireLeaseWith(ctx context.Context, store Store, node string, ttl time.Duration, o LeaseOptions) (*Lease, error) {
	var tok [8]byte
	rand.Read(tok[:])
	l := &Lease{store: store, node: node, token: hex.EncodeToString(tok[:]), ttl: ttl}
	for attempt := 0; attempt < 8; attempt++ {
		data, etag, err := store.Get(ctx, leaseKey, 0, -1)
		var opts PutOptions
		switch {
		case errors.Is(err, ErrNotFound):
			opts.IfNoneMatch = true
		case err != nil:
			return nil, fmt.Errorf("read lease: %w", err)
		default:
			var cur leaseBody
			jerr := json.Unmarshal(data, &cur)
			live := jerr == nil && time.Now().UnixMilli() < cur.ExpiresAt
			if live && cur.Node != node {
				return nil, &LeaseHeldError{Node: cur.Node, Until: time.UnixMilli(cur.ExpiresAt)}
			}
			if _, here := heldHere.Load(cur.Token); live && o.NotFromThisProcess && here {
				return nil, ErrLeaseHeldHere
			}
			opts.IfMatch = etag
		}
		if err := l.put(ctx, opts); err == nil {
			heldHere.Store(l.token, struct{}{})
			return l, nil
		} else if !errors.Is(err, ErrPreconditionFailed) {
			return nil, err
		}
	}
	return nil, fmt.Errorf("%w: lost the race for it", ErrLeaseHeld)
}

func (l *Lease) put(ctx context.Context, opts PutOptions) error {
	began := time.Now()
	data, _ := json.Marshal(leaseBody{Node: l.node, Token: l.token, ExpiresAt: began.Add(l.ttl).UnixMilli()})
	etag, err := l.store.Put(ctx, leaseKey, data, opts)
	if err != nil {
		return fmt.Errorf("write lease: %w", err)
	}
	l.mu.Lock()
	l.etag, l.validUntil = etag, began.Add(l.ttl-l.ttl/5)
	l.mu.Unlock()
	return nil
}

// Renew extends the lease. ErrFenced means another node took it.
func (l *Lease) Renew(ctx context.Context) error {
	for attempt := 0; ; attempt++ {
		l.mu.Lock()
		etag := l.etag
		l.mu.Unlock()
		err := l.put(ctx, PutOptions{IfMatch: etag})
		if !errors.Is(err, ErrPreconditionFailed) {
			return err
		}
		// Someone wrote the lease since our last known write: perhaps we
		// did, in a write whose answer was lost.
		mine, rerr := l.reconcile(ctx)
		switch {
		case rerr != nil:
			return rerr
		case !mine:
			return fmt.Errorf("%w: %v", ErrFenced, err)
		case attempt > 0:
			// Ours each time and still refused: give up for now, without
			// claiming a takeover that did not happen.
			return err
		}
	}
}

// reconcile reads the lease object after its ETag moved away from the one
// this holder knows. If the body is this process's own write (one whose
// answer was lost), the holder adopts it: its ETag, and the validity that
// write gives. It reports whether the lease is still this process's.
func (l *Lease) reconcile(ctx context.Context) (bool, error) {
	data, etag, err := l.store.Get(ctx, leaseKey, 0, -1)
	if errors.Is(err, ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read lease: %w", err)
	}
	var cur leaseBody
	if json.Unmarshal(data, &cur) != nil || cur.Node != l.node || cur.Token != l.token {
		return false, nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.etag = etag
	// The write that landed began ttl before its expiry: it is good for
	// four fifths of that, as put counts it.
	l.validUntil = time.UnixMilli(cur.ExpiresAt).Add(-l.ttl / 5)
	return true, nil
}

// Valid reports whether the lease is certainly still this node's by its
// own clock. Nothing may be written or acknowledged when it is not.
func (l *Lease) Valid() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return time.Now().Before(l.validUntil)
}

// Confirm reads the lease object and checks that it is still this
// process's (used before a new WAL namespace is registered).
func (l *Lease) Confirm(ctx context.Context) error {
	mine, err := l.reconcile(ctx)
	if err != nil {
		return err
	}
	if !mine {
		return ErrFenced
	}
	return nil
}

// Abandon stops counting the lease as this process's, without writing
// it (a start that failed after taking it): a later acquisition by this
// process takes it over.
func (l *Lease) Abandon() {
	heldHere.Delete(l.token)
	l.mu.Lock()
	l.validUntil = time.Time{}
	l.mu.Unlock()
}

// Release gives the lease up so another node may take it at once.
// ErrFenced means another process holds it already (this one was replaced):
// there was nothing to give up.
func (l *Lease) Release(ctx context.Context) error {
	heldHere.Delete(l.token)
	l.mu.Lock()
	l.validUntil = time.Time{}
	l.mu.Unlock()
	data, _ := json.Marshal(leaseBody{Node: l.node, Token: l.token, ExpiresAt: 0})
	for attempt := 0; ; attempt++ {
		l.mu.Lock()
		etag := l.etag
		l.mu.Unlock()
		_, err := l.store.Put(ctx, leaseKey, data, PutOptions{IfMatch: etag})
		if !errors.Is(err, ErrPreconditionFailed) || attempt > 0 {
			return err
		}
		// As in Renew: the lease may hold our own unanswered write.
		mine, rerr := l.reconcile(ctx)
		l.mu.Lock()
		l.validUntil = time.Time{}
		l.mu.Unlock()
		if rerr != nil {
			return rerr
		}
		if !mine {
			// Another process's now (this one was replaced): nothing of
			// ours to give up, and the caller should say so, not fail.
			return fmt.Errorf("%w: %v", ErrFenced, err)
		}
	}
}

// TTL is the lease's lifetime without renewal.
func (l *Lease) TTL() time.Duration { return l.ttl }

// parseWALKey splits "wal/<ns>/<seq>" (relative to the namespace prefix).
func parseWALSeq(key, prefix string) (uint64, bool) {
	rest, ok := strings.CutPrefix(key, prefix)
	if !ok || len(rest) != 16 {
		return 0, false
	}
	v, err := strconv.ParseUint(rest, 16, 64)
	return v, err == nil
}

// ReplayFuncs receive the WAL during Replay.
type ReplayFuncs struct {
	// Fetched, when set, sees each WAL object as soon as it has been read,
	// ahead of Apply and from several goroutines at once: the place to
	// start work that Apply will wait for.
	Fetched func(obj *WALObject)
	// Packs, when set, is handed the manifest's live packs before any WAL
	// object is applied.
	Packs func(packs []PackRef) error
	// Apply is handed every committed object, in WAL order.
	Apply func(key string, obj *WALObject) error
	// Listed, when set, is told of each page of WAL keys listed: a long
	// WAL takes a while to list before anything is applied.
	Listed func()
}

// Replay reads the WAL after a restart. It first registers a fresh
// namespace for this process (returned), owned by token: from then on a
// process that held the storage before can no longer write the manifest
// (see Manifests.Update), so the manifest replayed is the last one it
// wrote. For every earlier namespace in the manifest it seals the first
// missing sequence (if the seal loses, that object landed: it is replayed
// and the next missing one is sealed), then hands every committed object
// below the seal to fn.Apply, in WAL order. Finally it records the seals.
// token also identifies this process in the seals it writes.
//
// Registering first matters when the storage is taken over from a running
// process, as a process of the same node id does at once: a namespace that
// process registered, or a WAL retirement it recorded, after the manifest
// was read here would otherwise go unseen, and what it acknowledged in
// that namespace, or compacted into packs, would be missing here.
func Replay(ctx context.Context, store Store, m *Manifests, token string, fn ReplayFuncs) (ns uint64, err error) {
	// The lease is this process's now: a namespace registered by an
	// earlier attempt of this process's start is no claim to check.
	m.mu.Lock()
	m.owner = ""
	m.mu.Unlock()
	man, err := m.Update(ctx, func(cur *Manifest) error {
		var err error
		if ns, err = m.takeNamespace(ctx, cur); err != nil {
			return err
		}
		cur.Namespaces = append(cur.Namespaces, Namespace{ID: ns, Owner: token})
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("register a namespace: %w", err)
	}
	m.mu.Lock()
	m.owner = token
	m.mu.Unlock()
	sort.Slice(man.Namespaces, func(i, j int) bool { return man.Namespaces[i].ID < man.Namespaces[j].ID })
	if fn.Packs != nil && len(man.Packs) > 0 {
		if err := fn.Packs(man.Packs); err != nil {
			return 0, err
		}
	}
	seals := map[uint64]uint64{}
	for _, n := range man.Namespaces {
		if n.ID == ns {
			continue
		}
		end, err := replayNamespace(ctx, store, n, token, fn)
		if err != nil {
			return 0, err
		}
		seals[n.ID] = end
	}
	if len(seals) == 0 {
		return ns, nil
	}
	_, err = m.Update(ctx, func(cur *Manifest) error {
		for i := range cur.Namespaces {
			if end, ok := seals[cur.Namespaces[i].ID]; ok && cur.Namespaces[i].SealedAt == nil {
				cur.Namespaces[i].SealedAt = &end
			}
		}
		return nil
	})
	return ns, err
}

// replayFetchAhead is how many WAL objects replay reads ahead of the one
// it applies (half of them at once).
const replayFetchAhead = 32

func replayNamespace(ctx context.Context, store Store, n Namespace, token string, fn ReplayFuncs) (uint64, error) {
	if n.SealedAt != nil && n.ReplayFrom >= *n.SealedAt {
		// Sealed with nothing left to replay, awaiting the compaction
		// that retires it: no request. A process that restarts faster
		// than it compacts (a crash loop) leaves one per start.
		return *n.SealedAt, nil
	}
	prefix := WALPrefix(n.ID)
	present := map[uint64]bool{}
	after := ""
	if n.ReplayFrom > 0 {
		after = WALKey(n.ID, n.ReplayFrom-1)
	}
	for {
		objs, more, err := store.List(ctx, prefix, after, 1000)
		if err != nil {
			return 0, fmt.Errorf("list %s: %w", prefix, err)
		}
		for _, o := range objs {
			if seq, ok := parseWALSeq(o.Key, prefix); ok {
				present[seq] = true
			}
			after = o.Key
		}
		if fn.Listed != nil {
			fn.Listed()
		}
		if !more || len(objs) == 0 {
			break
		}
	}
	// WAL objects are small and many: fetch ahead, apply in order.
	fctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	type fetch struct {
		done chan struct{}
		obj  *WALObject
		err  error
	}
	fetches := map[uint64]*fetch{}
	sem := make(chan struct{}, replayFetchAhead/2)
	get := func(seq uint64) *fetch {
		if f, ok := fetches[seq]; ok {
			return f
		}
		f := &fetch{done: make(chan struct{})}
		fetches[seq] = f
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer close(f.done)
			select {
			case sem <- struct{}{}:
				defer func() { <-sem }()
			case <-fctx.Done():
				f.err = fctx.Err()
				return
			}
			key := WALKey(n.ID, seq)
			data, _, err := store.Get(fctx, key, 0, -1)
			if err != nil {
				f.err = fmt.Errorf("get %s: %w", key, err)
				return
			}
			if f.obj, err = DecodeWAL(data); err != nil {
				f.err = fmt.Errorf("decode %s: %w", key, err)
				return
			}
			if fn.Fetched != nil && !f.obj.Sealed {
				fn.Fetched(f.obj)
			}
		}()
		return f
	}
	for seq := n.ReplayFrom; ; seq++ {
		if n.SealedAt != nil && seq >= *n.SealedAt {
			return *n.SealedAt, nil
		}
		key := WALKey(n.ID, seq)
		if !present[seq] && n.SealedAt != nil {
			// An earlier replay found every object up to the seal, and
			// compaction moves ReplayFrom before it deletes any: this one
			// was lost (an operator, a lifecycle rule). Sealing the gap
			// would drop the acknowledged objects after it unseen.
			return 0, fmt.Errorf("replay %s: %w: missing, below its namespace's seal at %d; restore it from a copy", key, ErrCorrupt, *n.SealedAt)
		}
		if !present[seq] {
			outcome, err := seal(ctx, store, n.ID, seq, token, 6, false)
			if err != nil {
				return 0, err
			}
			if outcome != sealLanded { // ours, or an earlier replay's
				return seq, nil
			}
		}
		for ahead := seq + 1; ahead < seq+replayFetchAhead && present[ahead]; ahead++ {
			get(ahead)
		}
		f := get(seq)
		<-f.done
		delete(fetches, seq)
		if f.err != nil {
			return 0, f.err
		}
		// The header is not under the entries' checksums: an object
		// that names another place in the log is damaged, and its
		// entries would be applied at the wrong position.
		if f.obj.Namespace != n.ID || f.obj.Seq != seq {
			return 0, fmt.Errorf("replay %s: %w: it says namespace %d, sequence %d", key, ErrCorrupt, f.obj.Namespace, f.obj.Seq)
		}
		if f.obj.Sealed {
			return seq, nil
		}
		if err := fn.Apply(key, f.obj); err != nil {
			return 0, err
		}
	}
}

// ErrFenced means another process took this storage over: it holds the
// lease, or sealed this writer's namespace. A fenced writer never writes
// again.
var ErrFenced = errors.New("storage was taken over by another node")

// sealOutcome is what a seal attempt found.
type sealOutcome int

const (
	sealWon     sealOutcome = iota // our seal is in place: the upload can never land
	sealLanded                     // the key holds a WAL object: the upload landed
	sealForeign                    // another process's seal is in place
)

// seal writes a seal marker at (ns, seq) with if-none-match. An answer
// that leaves the outcome open (a lost response, or a write the store
// could not confirm) is settled by reading the key back. It tries at most
// attempts times (0: until ctx ends), with backoff.
//
// An object at the key that does not decode (a checksum or framing error)
// fails the seal, unless replaceCorrupt: the writer that owns the
// namespace passes it, as the key can then only hold its own batch, whose
// upload failed and was never acknowledged, or a seal. The seal takes the
// corrupt object's place (if-match on its ETag), so replay stops there as
// at any seal; failing instead left the writer broken for good, every
// later append refused, over one object nothing can ever read.
func seal(ctx context.Context, store Store, ns, seq uint64, token string, attempts int, replaceCorrupt bool) (sealOutcome, error) {
	key := WALKey(ns, seq)
	body := EncodeSeal(ns, seq, token)
	for attempt := 0; ; attempt++ {
		_, err := store.Put(ctx, key, body, PutOptions{IfNoneMatch: true})
		if err == nil {
			return sealWon, nil
		}
		if data, etag, gerr := store.Get(ctx, key, 0, -1); gerr == nil {
			obj, derr := DecodeWAL(data)
			switch {
			case derr != nil && replaceCorrupt && etag != "":
				// A failed swap (the object changed, or the answer was
				// lost) is judged by the next attempt's read.
				if _, err = store.Put(ctx, key, body, PutOptions{IfMatch: etag}); err == nil {
					return sealWon, nil
				}
				err = fmt.Errorf("replace corrupt object: %w (it did not decode: %v)", err, derr)
			case derr != nil:
				return 0, fmt.Errorf("seal %s: %w", key, derr)
			case !obj.Sealed:
				return sealLanded, nil
			case obj.SealToken == token:
				return sealWon, nil
			default:
				return sealForeign, nil
			}
		}
		if attempts > 0 && attempt+1 >= attempts {
			return 0, fmt.Errorf("seal %s: %w", key, err)
		}
		if werr := sleepBackoff(ctx, attempt); werr != nil {
			return 0, fmt.Errorf("seal %s: %w", key, err)
		}
	}
}
