package streamstore

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"runtime/debug"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/internal/workers"
	"github.com/picomq/caddy-picomq/segment"
)

// Config holds the engine settings. Zero values take the defaults.
type Config struct {
	FlushInterval   time.Duration // least time between the starts of two WAL uploads (default 20ms)
	FlushSize       int           // bytes that start an upload at once (default 1 MiB)
	FlushQuiet      time.Duration // hold an upload until appends pause this long (0: off, the default)
	MaxInFlight     int           // WAL uploads in flight at once (default 4)
	MaxPending      int           // memory held by appends waiting for storage past which appends get ErrBusy (default 64 MiB)
	CacheBytes      int64         // block cache budget (default 64 MiB)
	NodeID          string        // identity of this node for the storage lease
	AppendTimeout   time.Duration // longest an append waits for durability before 503 (default 30s)
	CompactInterval time.Duration // how often WAL data is compacted (default 30s)
	PackBelow       int64         // backlog bytes up to which a busy stream's compaction goes into a shared pack (default 256 KiB; negative: never)
	MergeBelow      int64         // a stream's last data object smaller than this is written again with the next fold's records (default 64 KiB; negative: never)
	LeaseTTL        time.Duration // storage lease lifetime without renewal (default 30s)
	// OneEnginePerProcess refuses to start on a storage whose lease another
	// engine of this process holds (segment.LeaseOptions.NotFromThisProcess):
	// a process runs one engine per storage, and two URLs naming the same
	// bucket and prefix must not make two that fence each other. Tests that
	// play a restart with a second engine in one process leave it unset.
	OneEnginePerProcess bool
	MaxStreams          int           // idle streams kept in memory (default 10,000)
	IdleAfter           time.Duration // a stream untouched this long leaves memory, cache included (default 30s)
	ExpirySweep         time.Duration // how often streams past their expiry that nobody accessed are deleted (default 5m)
	GraveTime           time.Duration // how long a deleted stream's grave holds its name against creates still on their way (default 20m)
}

// writerConfig is the WAL writer's share of c.
func (c Config) writerConfig() segment.WriterConfig {
	return segment.WriterConfig{FlushInterval: c.FlushInterval, FlushSize: c.FlushSize, MaxInFlight: c.MaxInFlight, MaxPending: c.MaxPending,
		FlushQuiet: c.FlushQuiet}
}

func (c Config) withDefaults() Config {
	if c.FlushInterval <= 0 {
		c.FlushInterval = 20 * time.Millisecond
	}
	if c.FlushSize <= 0 {
		c.FlushSize = 1 << 20
	}
	if c.MaxInFlight <= 0 {
		c.MaxInFlight = 4
	}
	if c.MaxPending <= 0 {
		c.MaxPending = segment.DefaultMaxPending
	}
	if c.CacheBytes <= 0 {
		c.CacheBytes = 64 << 20
	}
	if c.AppendTimeout <= 0 {
		c.AppendTimeout = 30 * time.Second
	}
	if c.CompactInterval <= 0 {
		c.CompactInterval = 30 * time.Second
	}
	if c.LeaseTTL <= 0 {
		c.LeaseTTL = 30 * time.Second
	}
	if c.MaxStreams <= 0 {
		c.MaxStreams = 10000
	}
	if c.IdleAfter <= 0 {
		c.IdleAfter = 30 * time.Second
	}
	if c.ExpirySweep <= 0 {
		c.ExpirySweep = 5 * time.Minute
	}
	if c.PackBelow == 0 {
		c.PackBelow = DefaultPackBelow
	}
	if c.MergeBelow == 0 {
		c.MergeBelow = DefaultMergeBelow
	}
	c.MergeBelow = min(c.MergeBelow, MaxMergeBelow)
	if c.GraveTime <= 0 {
		c.GraveTime = defaultGraveTime
	}
	return c
}

// Engine owns the streams of one storage location. It knows nothing of HTTP.
type Engine struct {
	store segment.Store
	log   *zap.Logger

	appendHook atomic.Pointer[AppendHook] // told of durable appends (notify.go)
	replayed   map[string]*ReplayedStream // what the start's replay found, by name (replayed.go)
	// startProgress counts what the start has done (WAL pages listed,
	// objects applied, metadata objects read): a start that is slow but moving is told
	// from a stuck one (StartProgress).
	startProgress atomic.Int64
	deleteHook    atomic.Pointer[DeleteHook] // told of deleted streams (notify.go)
	deadlines     deadlines                  // appends' waits for their batches
	man           *segment.Manifests
	cache         *blockCache

	cfgMu sync.RWMutex
	cfg   Config

	startMu sync.Mutex
	started bool
	// startFailed: a start failed after taking the lease, with the
	// replay's state half loaded; the engine takes no other start.
	startFailed bool
	w           *segment.Writer
	// statsW is w for Stats, which must not wait on startMu: Start holds
	// it through the lease and the replay, and a metrics scrape would hang.
	// Eviction, under e.mu, writes renewals through it too (nil before
	// Start has made the writer).
	statsW atomic.Pointer[segment.Writer]
	// lease is set by Start, while requests may already ask holding.
	lease atomic.Pointer[segment.Lease]
	// stopRenewal ends the lease renewal, which runs from before the
	// replay until Close has flushed the last batch.
	stopRenewal context.CancelFunc

	// ownNS is one more than the WAL namespace this process registered at
	// start (0 before): metadata a process wrote from earlier namespaces
	// is a replaced process's (writeMeta).
	ownNS atomic.Uint64

	fenceMu  sync.Mutex
	fencedBy error           // the lease was taken by another node
	fenceW   *segment.Writer // the writer to fence, once there is one
	// fencedC is closed when fencedBy is first set: live reads waiting
	// for a change this process will never see end then.
	fencedC chan struct{}

	mu        sync.RWMutex // lookups of streams take it shared
	streams   map[string]*stream
	loading   map[string]*loadCall
	nameLocks map[string]*nameLock
	creating  map[*stream]struct{} // creates whose metadata is not written yet
	commitEnd walPos               // just after the last committed WAL position; zero before any

	compactMu sync.Mutex        // one compaction at a time
	damage    damageLog         // WAL entries found damaged (damaged.go)
	packs     []segment.PackRef // packs written or replayed, oldest first, until they die (compactMu)
	// deadPacks are packs out of the manifest whose delete failed: the
	// next compaction tries again (compactMu).
	deadPacks []string
	// merged are data objects a fold wrote again within a larger one,
	// deleted with the compaction's dead packs (mergedMu: folds run in
	// parallel).
	mergedMu sync.Mutex
	merged   []string
	// retired is where the last compaction that finished retired the WAL
	// to (compactMu); a pass that would retire to the same point with
	// nothing to fold and no pack to drop has nothing to write.
	retired    walPos
	hasRetired bool
	// walSwept holds the retired namespaces (Manifest.RetiredWAL) whose
	// WAL objects the last compaction deleted, for the next manifest
	// write to take out of the list (compactMu).
	walSwept    map[uint64]bool
	compactKick chan struct{}
	// compactBegan is when the last compaction began (Unix ns): it folded
	// the streams already idle then (sweepIdle).
	compactBegan atomic.Int64
	// compactReset re-arms the compaction timer: a reload that shortens
	// compact_interval must not wait out the old one.
	compactReset chan struct{}
	walBacklog   int   // WAL objects committed since the last compaction began
	walBytes     int64 // memory the records committed since the last compaction began hold in the cache
	walWire      int64 // their encoded bytes
	walEntries   int   // entries with records committed since then
	compactFull  bool  // the backlog has outgrown the cache: a compaction was asked for
	gcKick       chan struct{}
	nextGrave    atomic.Int64 // when the next indexed grave is due (Unix ms), 0 for none
	gcMu         sync.Mutex   // held by the collector (collectGarbage)
	closing      chan struct{}
	// bg counts the goroutines the engine starts (goBG); Close waits for
	// them. bgMu orders every bg.Add before that Wait: once bgShut is set,
	// goBG starts nothing.
	bg       sync.WaitGroup
	bgMu     sync.Mutex
	bgShut   bool
	bgCtx    context.Context // ends at Close: for work nobody waits on
	bgCancel context.CancelFunc
	// lostForks counts the waits of settleLostFork under way, which
	// maxLostForkWaits bounds.
	lostForks atomic.Int32

	// expiryReset re-arms the expiry sweep's timer, as compactReset does
	// the compaction's: a reload from expiry_sweep_interval 1h to 1m
	// sweeps within a minute, not within the hour.
	expiryReset chan struct{}

	fetchMu  sync.Mutex
	fetching map[string]*fetchCall // data object GETs in flight, by key
	// aheadBytes is what read-ahead GETs in flight hold, across streams,
	// up to aheadLimit (readAheadInFlight).
	aheadBytes, aheadLimit int64
	bufs                   bufPool // buffers of cold data objects, recycled
	// ioPool runs read-ahead GETs and compaction's S3 calls on goroutines
	// that stay for the next, so each call does not grow a fresh stack
	// through the S3 client.
	ioPool *workers.Pool

	lastUse atomic.Int64 // last stream lookup by a request (Unix ns)
	// quietReturned: the heap went back to the OS since requests stopped
	// (or since the last compaction that folded anything).
	quietReturned atomic.Bool
	returnMemory  func() // debug.FreeOSMemory; a counter in tests

	stats Stats // running totals for metrics (stats.go)

	orphans orphanSweep // this start's sweep of orphaned blobs (orphans.go)
	strays  strayBlobs  // unused blobs whose delete failed, tried again by compaction (orphans.go)
}

// ioLinger is how long an idle goroutine of the engine's pool waits for
// the next call before it ends: long enough to stay from one object of a
// reader to the next and through a compaction's calls, short enough that
// an idle node soon holds none.
const ioLinger = 2 * time.Second

// New builds an engine over store. It does no I/O; Start opens the storage.
func New(store segment.Store, cfg Config, log *zap.Logger) *Engine {
	cfg = cfg.withDefaults()
	if log == nil {
		log = zap.NewNop()
	}
	bgCtx, bgCancel := context.WithCancel(context.Background())
	e := &Engine{
		bgCtx:        bgCtx,
		bgCancel:     bgCancel,
		store:        store,
		log:          log,
		man:          segment.NewManifests(store),
		cache:        newBlockCache(cfg.CacheBytes),
		aheadLimit:   readAheadInFlight,
		cfg:          cfg,
		streams:      map[string]*stream{},
		loading:      map[string]*loadCall{},
		nameLocks:    map[string]*nameLock{},
		creating:     map[*stream]struct{}{},
		gcKick:       make(chan struct{}, 1),
		compactKick:  make(chan struct{}, 1),
		compactReset: make(chan struct{}, 1),
		expiryReset:  make(chan struct{}, 1),
		closing:      make(chan struct{}),
		fencedC:      make(chan struct{}),
		returnMemory: debug.FreeOSMemory,
		ioPool:       workers.New(ioLinger),
	}
	return e
}

func (e *Engine) config() Config {
	e.cfgMu.RLock()
	defer e.cfgMu.RUnlock()
	return e.cfg
}

// Reconfigure applies new settings to a running engine (a config reload).
func (e *Engine) Reconfigure(cfg Config) {
	cfg = cfg.withDefaults()
	e.cfgMu.Lock()
	cfg.NodeID = e.cfg.NodeID
	interval, sweep := e.cfg.CompactInterval, e.cfg.ExpirySweep
	e.cfg = cfg
	e.cfgMu.Unlock()
	if cfg.CompactInterval != interval {
		select {
		case e.compactReset <- struct{}{}:
		default:
		}
	}
	if cfg.ExpirySweep != sweep {
		select {
		case e.expiryReset <- struct{}{}:
		default:
		}
	}
	e.cache.setBudget(cfg.CacheBytes)
	e.startMu.Lock()
	if e.w != nil {
		e.w.SetConfig(cfg.writerConfig())
	}
	e.startMu.Unlock()
}

// Start takes the storage lease, checks the format version and replays the
// write-ahead log. Calling it again after success does nothing. A start
// that failed before it took the lease may be tried again; one that failed
// later (its replay half done) leaves the engine unusable: try again with
// a new one.
func (e *Engine) Start(ctx context.Context) error {
	e.startMu.Lock()
	defer e.startMu.Unlock()
	if e.started {
		return nil
	}
	if e.startFailed {
		// What the failed replay loaded would pass for the bucket's
		// state: a create only the WAL holds would be taken for one
		// with metadata, which then nobody writes.
		return errors.New("start engine: an earlier start of this engine failed after taking the lease; start a new engine")
	}
	select {
	case <-e.closing:
		// Close has run: goroutines started now would outlive it.
		return fmt.Errorf("start engine: %w", ErrShuttingDown)
	default:
	}
	cfg := e.config()
	if cfg.NodeID == "" {
		return errors.New("start engine: no node id configured")
	}
	lease, err := segment.AcquireLeaseWith(ctx, e.store, cfg.NodeID, cfg.LeaseTTL,
		segment.LeaseOptions{NotFromThisProcess: cfg.OneEnginePerProcess})
	if err != nil {
		return fmt.Errorf("start engine: %w", err)
	}
	// Renewal starts now, not after the replay: replaying a long WAL
	// through a slow store can outlast the lease, and the node would then
	// come up unable to write.
	e.lease.Store(lease)
	// Not under bgCtx, which Close cancels first: the lease is renewed
	// until Close has flushed the last batch (stopRenewal).
	renewCtx, stopRenewal := context.WithCancel(context.WithoutCancel(e.bgCtx))
	renewed := make(chan struct{})
	// startMu is held and closing was open: Close, which marks bg shut
	// under startMu, has not begun, so goBG cannot refuse here.
	e.goBG(func() {
		defer close(renewed)
		e.renewLease(renewCtx, lease)
	})
	fail := func(err error) error {
		e.startFailed = true
		// A retry takes the lease again; this attempt's renewal must not
		// race it (a renewal that lost that race would fence the node),
		// nor a release below.
		stopRenewal()
		<-renewed
		if errors.Is(ctx.Err(), context.Canceled) {
			e.releaseGivenUp(ctx, lease)
		} else {
			lease.Abandon()
		}
		return fmt.Errorf("start engine: %w", err)
	}
	if err := segment.CheckFormat(ctx, e.store); err != nil {
		return fail(err)
	}
	began := time.Now()
	var objects, entries int
	token := newID()
	metas := e.newMetaLoader(ctx)
	ns, err := segment.Replay(ctx, e.store, e.man, token, segment.ReplayFuncs{
		Fetched: metas.start,
		Packs: func(refs []segment.PackRef) error {
			return e.replayPacks(ctx, metas, refs)
		},
		Listed: func() { e.startProgress.Add(1) },
		Apply: func(key string, obj *segment.WALObject) error {
			e.startProgress.Add(1)
			objects++
			entries += len(obj.Entries)
			return e.replayObject(metas, key, obj)
		},
	})
	metas.close()
	if err == nil {
		e.ownNS.Store(ns + 1)
		err = e.settleSeeds(ctx, metas)
	}
	if err == nil {
		e.keepReplayed()
	}
	if err != nil && isDamage(err) {
		// An object to replay fails its checksum or framing. Which
		// streams its damaged entries changed, and how, cannot be told,
		// so starting without them would drop acknowledged changes
		// unseen: the start fails, naming the object, until it is
		// restored. Deleting it would be worse: a replay stops at the
		// first missing WAL object and drops everything after it.
		if errors.Is(err, ErrDamaged) {
			// A stream's metadata, which says so already.
			return fail(fmt.Errorf("replay (restore the object from a copy; do not delete it): %w", err))
		}
		return fail(fmt.Errorf("replay: %w (restore the object from a copy; do not delete it): %w", ErrDamaged, err))
	}
	if err != nil {
		return fail(fmt.Errorf("replay: %w", err))
	}
	e.orphans.mu.Lock()
	e.orphans.startNS = ns
	e.orphans.mu.Unlock()
	e.log.Info("storage opened", zap.Int("wal_objects", objects), zap.Int("wal_entries", entries),
		zap.Int("active_streams", len(e.streams)), zap.String("namespace", segment.WALNamespace(ns)), zap.Duration("took", time.Since(began)))
	w := segment.NewWriter(e.store, ns, 0,
		cfg.writerConfig(),
		segment.WriterDeps{
			Hooks:        hooks{e},
			NewNamespace: e.registerNamespace,
			Token:        token,
			Check:        e.checkLease,
		})
	e.fenceMu.Lock()
	e.fenceW = w
	if e.fencedBy != nil {
		w.Fence(e.fencedBy)
	}
	e.fenceMu.Unlock()
	e.w = w
	e.statsW.Store(w)
	e.stopRenewal = stopRenewal
	e.started = true
	for _, loop := range []func(){e.compactLoop, e.gcLoop, e.idleLoop, e.expiryLoop} {
		e.goBG(loop)
	}
	e.kickGC()
	return nil
}

// StartProgress counts the steps a start has taken so far: pages of WAL
// keys listed, WAL objects replayed and metadata objects read. It moves while a long replay goes
// on, so a caller bounding the start can tell it from a stuck one.
func (e *Engine) StartProgress() int64 { return e.startProgress.Load() }

// goBG runs f on a goroutine that Close waits for. Once Close has begun
// it starts nothing and reports false: a goroutine counted after Close's
// Wait could start would outlive it (and sync.WaitGroup forbids an Add
// from zero concurrent with a Wait). The caller then does without, or does
// the work's closing part itself.
func (e *Engine) goBG(f func()) bool {
	e.bgMu.Lock()
	defer e.bgMu.Unlock()
	if e.bgShut {
		return false
	}
	e.bg.Add(1)
	go func() {
		defer e.bg.Done()
		f()
	}()
	return true
}

// Close flushes pending batches, waits for their uploads and releases the
// lease. Live waits end with ErrShuttingDown.
func (e *Engine) Close(ctx context.Context) error {
	e.startMu.Lock()
	select {
	case <-e.closing:
		e.startMu.Unlock()
		return nil
	default:
	}
	e.mu.Lock()
	close(e.closing)
	e.mu.Unlock()
	// From here goBG starts nothing: every goroutine bg.Wait below waits
	// for was counted before it.
	e.bgMu.Lock()
	e.bgShut = true
	e.bgMu.Unlock()
	e.bgCancel()
	started, stopRenewal := e.started, e.stopRenewal
	// Not held while background work winds down: a compaction that was
	// starting asks for the writer (under startMu) before it sees closing.
	e.startMu.Unlock()
	// Read-ahead GETs end with bgCtx; this waits for them and for any
	// compaction call still on the pool.
	defer e.ioPool.Close()
	if !started {
		return nil
	}
	e.saveRenewals()
	// The lease is renewed while the last batches go out: an upload
	// retried past its validity would fail, and the writer could not
	// confirm it still owns the storage.
	err := e.w.Close(ctx)
	stopRenewal()
	e.bg.Wait()
	rerr := e.lease.Load().Release(ctx)
	switch {
	case errors.Is(rerr, segment.ErrFenced):
		// Another process holds the lease: this one was replaced (its
		// node started again, or another node took the lease after it
		// lapsed). The lease is the new owner's and stays so; that is
		// how a replaced process ends, not a failed close.
		e.log.Warn("storage lease not released: another process took the storage over and this one was replaced; "+
			"the lease is left to the new owner", zap.String("node_id", e.config().NodeID))
	case rerr != nil && err == nil:
		err = fmt.Errorf("release lease: %w", rerr)
	}
	return err
}

// saveRenewals writes to the WAL, with the last batches Close flushes, the
// renewals of sliding TTLs that only memory holds: reads save theirs at
// most every quarter of the TTL, and a create confirmed with 200 or a
// producer's duplicate renew in memory alone, until the stream leaves
// memory. After a graceful stop the next start would otherwise expire
// such a stream up to that much early. A crash still loses them.
func (e *Engine) saveRenewals() {
	w := e.statsW.Load()
	if w == nil {
		return
	}
	now := time.Now().UnixMilli()
	e.mu.RLock()
	defer e.mu.RUnlock()
	for _, s := range e.streams {
		s.mu.Lock()
		if !s.evicted && s.renewalUnsavedLocked(now) {
			e.addRenewalLocked(w, s) // refused: lost, as a crash loses it
		}
		s.mu.Unlock()
	}
}

// givenUpReleaseTimeout bounds giving back the lease of a start whose
// caller gave it up; a store that does not answer by then leaves the lease
// to lapse.
const givenUpReleaseTimeout = 5 * time.Second

// releaseGivenUp gives back the lease of a start that its caller gave up
// (ctx was cancelled: the config that wanted the storage is gone, at a
// stop or a reload). Left to lapse, it would keep another node out for
// its whole lifetime after a graceful stop. What the start wrote under it
// is what a crash leaves, which the next owner's replay settles.
func (e *Engine) releaseGivenUp(ctx context.Context, lease *segment.Lease) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), givenUpReleaseTimeout)
	defer cancel()
	err := lease.Release(rctx)
	switch {
	case err == nil:
		e.log.Info("storage lease released: its start was given up")
	case errors.Is(err, segment.ErrFenced):
		// Another process holds it already: nothing to give back.
	default:
		e.log.Warn("storage lease of a start that was given up not released; it lapses by itself",
			zap.Duration("lease_ttl", e.config().LeaseTTL), zap.Error(err))
	}
}

func (e *Engine) writer() (*segment.Writer, error) {
	e.startMu.Lock()
	defer e.startMu.Unlock()
	if !e.started {
		return nil, fmt.Errorf("%w: storage is not open yet", ErrUnavailable)
	}
	return e.w, nil
}

// ErrLeaseLapsed (with ErrUnavailable) answers a request to a node whose
// lease could not be renewed in time: it may no longer be the only writer,
// so it answers nothing until a renewal goes through.
var ErrLeaseLapsed = errors.New("the storage lease could not be renewed in time")

func (e *Engine) checkLease() error {
	if !e.lease.Load().Valid() {
		return ErrLeaseLapsed
	}
	return nil
}

// confirmOwner reads the lease object and checks that it is still this
// process's, before a change that no WAL entry carries (a delete, a
// fork's count): the seal that fences a replaced process's appends does
// not fence those, and a process of the same node id takes the lease at
// once, while the one it replaced counts it valid until its next renewal.
// Such a change acknowledged by the replaced process, over a stream the
// new owner had loaded, went unseen by it: it acknowledged appends to a
// stream that was deleted. One GET per such change.
func (e *Engine) confirmOwner(ctx context.Context) error {
	if err := e.checkLease(); err != nil {
		return err
	}
	if err := e.lease.Load().Confirm(ctx); err != nil {
		if errors.Is(err, segment.ErrFenced) {
			e.fence(err)
		}
		return err
	}
	return nil
}

// registerNamespace gives the writer a fresh namespace, but only while the
// lease is certainly ours: a node that lost the storage must not add to
// the manifest another node replays.
func (e *Engine) registerNamespace(ctx context.Context) (uint64, error) {
	// A lease another process holds fences the engine, not just this
	// writer: it must stop serving what its memory says, too.
	if err := e.confirmOwner(ctx); err != nil {
		return 0, err
	}
	ns, err := e.man.RegisterNamespace(ctx)
	if errors.Is(err, segment.ErrFenced) {
		// Another process registered a namespace after the lease check:
		// it took the storage over (the manifest says so first).
		e.fence(err)
	}
	return ns, err
}

// renewLease renews l at a third of its lifetime, and retries every second
// (or every third of the lifetime, when that is shorter) while the store
// does not answer, until ctx ends (after Close's last flush). Past the lease's
// certain validity the writer refuses work; if another node took the
// lease, the writer is fenced for good.
func (e *Engine) renewLease(ctx context.Context, l *segment.Lease) {
	ttl := l.TTL()
	wait := ttl / 3
	retry := min(time.Second, ttl/3)
	var failures int
	var failingSince time.Time
	for {
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, ttl/3)
		err := l.Renew(rctx)
		cancel()
		switch {
		case ctx.Err() != nil:
			return
		case err == nil:
			wait = ttl / 3
			if failures > 0 {
				e.log.Info("storage lease renewed again", zap.Int("failures", failures),
					zap.Duration("failing_for", time.Since(failingSince)))
				failures = 0
			}
		case errors.Is(err, segment.ErrFenced):
			e.log.Error("storage lease taken by another node; this node writes no more", zap.Error(err))
			e.fence(err)
			return
		default:
			if failures == 0 {
				failingSince = time.Now()
			}
			failures++
			if leaseFailureLogged(failures) {
				e.log.Warn("renew storage lease", zap.Int("failures", failures),
					zap.Duration("failing_for", time.Since(failingSince)), zap.Error(err))
			}
			wait = retry
		}
	}
}

// leaseFailureLogged says whether the nth failure in a row to renew the
// lease is logged: the first ones, then ever more sparsely (powers of two,
// and every 60th: a renewal retried a second after the last one failed
// fails at most once a second, so these are a minute or more apart). An
// outage of the store retries every second, and a warning each time
// buried the log in identical lines.
func leaseFailureLogged(n int) bool {
	return n&(n-1) == 0 || n%60 == 0
}

// fenced returns why this node writes no more (another node took the
// storage over), or nil.
func (e *Engine) fenced() error {
	e.fenceMu.Lock()
	defer e.fenceMu.Unlock()
	return e.fencedBy
}

// takenOver is the error of a read on a process that another took the
// storage over from, nil while it was not. Such a process sees none of
// the new owner's appends, closes or deletes: answering reads from its
// memory would tell readers they are up to date at a tail the stream has
// moved past, and a live read would wait for records that never come.
func (e *Engine) takenOver() error {
	select {
	case <-e.fencedC:
	default:
		return nil // the common case, without the lock: every read asks
	}
	return fmt.Errorf("%w: %w: %v", ErrUnavailable, ErrTakenOver, e.fenced())
}

// holding is the error of a request to a process that cannot answer for
// the storage, nil while it can: another process took the storage over
// (takenOver), or this one's lease could not be renewed in time, so that
// another may have taken it (a node cut off from the store: the standby
// takes over once the lease lapses, and this one learns of it only when
// the store answers again). Either way its memory may be behind the
// streams: a read at an offset the new holder handed out is "beyond the
// tail" here, a HEAD gives the old tail, a producer's append that the new
// holder took makes the next one a "sequence gap" here, and a create
// without records (its metadata object alone, which no WAL seal fences)
// would write a stream into storage another node holds. Every request
// asks, before it looks at a stream.
func (e *Engine) holding() error {
	if err := e.takenOver(); err != nil {
		return err
	}
	if l := e.lease.Load(); l != nil && !l.Valid() {
		select {
		case <-e.closing:
			// Close gave the lease back: the request's own path
			// answers ErrShuttingDown, as a client should hear.
			return nil
		default:
		}
		return fmt.Errorf("%w: %w", ErrUnavailable, ErrLeaseLapsed)
	}
	return nil
}

// fence stops the writer for good. Before the writer exists (the lease
// was lost during the replay), Start fences it as it creates it.
func (e *Engine) fence(err error) {
	e.fenceMu.Lock()
	defer e.fenceMu.Unlock()
	if e.fencedBy == nil {
		close(e.fencedC)
	}
	e.fencedBy = err
	if e.fenceW != nil {
		e.fenceW.Fence(err)
	}
}

// metaLock is a mutex whose waiters may give up when their context ends:
// a request must not wait past its answer-by time for a compaction's
// checkpoint, which takes as long as the bucket does. Its zero value is
// unlocked.
type metaLock struct {
	once sync.Once
	ch   chan struct{}
}

func (l *metaLock) slot() chan struct{} {
	l.once.Do(func() { l.ch = make(chan struct{}, 1) })
	return l.ch
}

// Lock locks l.
func (l *metaLock) Lock() { l.slot() <- struct{}{} }

// LockContext locks l, or returns ctx.Err() if ctx ends first.
func (l *metaLock) LockContext(ctx context.Context) error {
	select {
	case l.slot() <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// TryLock locks l if it is unlocked, and reports whether it did.
func (l *metaLock) TryLock() bool {
	select {
	case l.slot() <- struct{}{}:
		return true
	default:
		return false
	}
}

// Unlock unlocks l.
func (l *metaLock) Unlock() { <-l.slot() }

// stream is the in-memory state of one stream. durable is what readers see
// and what is in the bucket; pend runs ahead of it by the appends whose
// batches are not committed yet.
type stream struct {
	mu     sync.Mutex
	metaMu metaLock // serialises metadata object writes
	// unsure holds, under metaMu, the bodies of metadata writes that
	// failed without saying whether they landed (see writeMeta).
	unsure [][]byte
	// metaUnsure is len(unsure) > 0, for decide, which holds mu only: a
	// stream whose checkpoint may have landed unseen is folded, whose
	// writeMeta settles that, not packed against the checkpoint it knows.
	// A replay sets it too (markReplayed), for the replaced process's.
	metaUnsure atomic.Bool
	name       string
	meta       *metaObject // last written metadata object (config + checkpoint)
	etag       string
	durable    writerState
	pend       writerState
	pending    int           // entries in flight
	runs       []walRun      // committed entries not yet in data objects, by seq
	changed    chan struct{} // closed at the next change; nil until someone waits
	gone       bool          // deleted or expired: the handle is dead
	evicted    bool          // dropped from memory: look the stream up again
	// deleteUnsure: a delete's grave may have landed, unconfirmed (the
	// PUT's answer lost, and the bucket not read back). Lookups settle it
	// from the bucket first (settleDelete), so that nothing is acknowledged
	// on a stream the bucket may already say is deleted.
	deleteUnsure bool
	// tailReadFails counts the folds in a row whose read of the tail to
	// merge failed (mergeTail; under metaMu).
	tailReadFails int
	// leftovers are the data objects and markers folds wrote before they
	// failed (under metaMu): nothing names them, and the next fold that
	// checkpoints deletes those it did not write again (compactStream).
	leftovers []string
	waiters   atomic.Int32 // live readers waiting in Wait
	touched   int64        // last access (ms), for a sliding TTL
	used      atomic.Int64 // last lookup (Unix ns), for eviction
	// forksChecked is when settleForks last looked the forks of this
	// soft-deleted stream up (Unix ms), to do so at most every
	// forkCheckEvery while its 410s are read.
	forksChecked atomic.Int64
	// settleFailed says settleForks last failed on a storage fault: a
	// create of the name then looks again at once, rather than be told
	// for up to a minute that forks still read the stream.
	settleFailed atomic.Bool
	// forksSeen holds, under mu, the internal ids of forks settleForks
	// found to exist: it need not look them up again, as a fork deleted
	// later is released by this process (retried until it closes).
	forksSeen map[string]struct{}

	uploading chan struct{} // closed when a large append's blob upload ends
	// uploadingBy is the producer of that large append, if any: a retry
	// of it waits for the upload as a repeat.
	uploadingBy *segment.ProducerState

	// damagedAt, once set, is the first of runs that a compaction found
	// damaged (damaged.go): compactions stop before it, and read back
	// nothing from it on but the run itself, now and then, to see whether
	// it was restored.
	damagedAt *walRun
	// damageChecked is when damagedAt was last found damaged: a
	// compaction reads it again a compaction interval later at the
	// earliest (retryDamaged).
	damageChecked time.Time

	dataIdx *dataIndex      // where the data objects are, once a read looked
	ra      *readAheadState // once a read went to data objects

	// The stream's latest WAL entry and its batch, when later appends may
	// be folded into it (an append entry without close or trim); nil
	// otherwise. joined sets or clears it at every Add.
	tailEnt   *segment.Entry
	tailBatch *segment.Batch
}

// joined records that ent, of this stream, went into batch b: one more
// entry in flight, the pending state moved on, and ent is where later
// appends may fold while b is open (foldable) or nothing is (a fold must
// never jump an entry of the stream). Called with s.mu held, after every
// Add of an entry of s.
func (s *stream) joined(ent *segment.Entry, b *segment.Batch, foldable bool) {
	s.pending++
	s.pend.apply(changeOf(ent))
	s.tailEnt, s.tailBatch = nil, nil
	if foldable {
		s.tailEnt, s.tailBatch = ent, b
	}
}

// walRun is a committed entry: where its records are in the WAL, and what
// it changed, for the next checkpoint.
type walRun struct {
	pos  walPos
	key  string
	span segment.Span
	ch   change
	blob string // the entry's records are in this blob, not in the WAL
	// snap is set when the run is in a pack (pack.go), not the WAL: it
	// stands for one or more entries, and is the stream's state after
	// them. packed is when it went there (Unix ms).
	snap   *writerState
	packed int64
}

// memSize is about what r's records hold once read back: its bytes as
// stored and a Record per record. A bound on the records a compaction
// holds at once counts this, not the stored bytes alone, which for
// records of a few bytes are a fifth of it.
func (r *walRun) memSize() int64 {
	return r.span.Len + int64(r.ch.End-r.ch.First)*int64(recordMem)
}

// applyTo moves st on past the run.
func (r *walRun) applyTo(st *writerState) {
	if r.snap != nil {
		*st = *r.snap
		return
	}
	st.apply(r.ch)
}

func (s *stream) info() Info {
	return Info{
		Name:        s.name,
		ID:          s.meta.ID,
		ContentType: s.meta.ContentType,
		Expiry:      s.meta.expiry(),
		StartSeq:    s.startSeq(&s.durable),
		NextSeq:     s.durable.NextSeq,
		Closed:      s.durable.Closed,
		CreatedAt:   time.UnixMilli(s.meta.CreatedAt).UTC(),
		ForkBase:    s.forkBase(),
		Fork:        s.forkOrigin(),
	}
}

func (s *stream) forkOrigin() ForkOrigin {
	f := s.meta.Fork
	if f == nil {
		return ForkOrigin{}
	}
	return ForkOrigin{Source: f.SourceName, Seq: f.Seq, Bytes: f.Bytes, Start: f.Start, Tail: f.Tail}
}

// startSeq is the first readable seq in st, one of s's states: above the
// stream's trims and, on a fork, above what its source had trimmed when
// the fork was made. Called with s.mu held.
func (s *stream) startSeq(st *writerState) uint64 {
	if f := s.meta.Fork; f != nil {
		return max(st.StartSeq, f.Start)
	}
	return st.StartSeq
}

func (s *stream) forkBase() uint64 {
	if s.meta.Fork != nil {
		return s.meta.Fork.base()
	}
	return 0
}

// notifyLocked wakes every waiter of the stream. The next channel is made
// only when a waiter asks for it (changedLocked): most commits have none,
// and this runs for every stream in every batch.
func (s *stream) notifyLocked() {
	if s.changed != nil {
		close(s.changed)
		s.changed = nil
	}
}

// changedLocked returns a channel closed at the stream's next change.
func (s *stream) changedLocked() <-chan struct{} {
	if s.changed == nil {
		s.changed = make(chan struct{})
	}
	return s.changed
}

// expiredLocked reports whether the stream's TTL or deadline has passed.
func (s *stream) expiredLocked(now time.Time) bool {
	at := s.expiresAtLocked()
	return at != 0 && now.UnixMilli() >= at
}

// touchLocked records an access at now (unix milliseconds) for a sliding
// TTL, and refuses, touching nothing, once the stream has expired. The
// check and the touch sit under s.mu with the expiry sweep's own look at
// the expiry, so an append either renews the stream before the sweep looks
// or finds it expired: none joins the WAL of a stream the sweep is already
// deleting, and an access after the expiry does not bring a stream back.
func (s *stream) touchLocked(now int64) bool {
	if at := s.expiresAtLocked(); at != 0 && now >= at {
		return false
	}
	s.touched = max(s.touched, now)
	return true
}

// expiresAtLocked is when the stream expires unless it is accessed before
// (unix milliseconds; the earlier of its deadline and its TTL past the
// last access), or 0 if it never does.
func (s *stream) expiresAtLocked() int64 {
	return expiresAt(s.meta, max(s.touched, s.durable.AccessedAt))
}

// expiresAt is when a stream with metadata m, last accessed at unix
// milliseconds accessed, expires; 0 if never.
func expiresAt(m *metaObject, accessed int64) int64 {
	at := m.ExpiresAt
	if m.TTLSeconds > 0 {
		ttl := max(accessed, m.CreatedAt) + m.TTLSeconds*1000
		if at == 0 || ttl < at {
			at = ttl
		}
	}
	return at
}

func newStream(name string, m *metaObject, etag string) *stream {
	s := &stream{
		name:    name,
		meta:    m,
		etag:    etag,
		durable: m.State,
		pend:    m.State,
		touched: max(m.State.AccessedAt, m.CreatedAt),
	}
	s.used.Store(time.Now().UnixNano())
	return s
}

type loadCall struct {
	done chan struct{}
	// settling, for a create's claim, is closed when the create hands its
	// metadata write to settleCreate, which retries it for as long as
	// storage fails it: lookups stop waiting then (nil for a load).
	settling chan struct{}
	s        *stream
	err      error
}

// settlingWait is how long a lookup waits for a create being settled:
// long enough for settleCreate's first retries, which end a blip of the
// store, and short enough that a store down for longer answers 503 rather
// than holding the request (and a graceful stop) for as long as it is.
const settlingWait = 2 * time.Second

// awaitClaim waits for c, a load or a claim of name, until wctx ends, and
// for a create's claim being settled at most settlingWait more. It returns
// nil once c is done, wctx's error when that ends first, or the
// ErrUnavailable saying the create is not yet confirmed.
func awaitClaim(wctx context.Context, c *loadCall, name string) error {
	settling := c.settling
	var giveUp <-chan time.Time
	for {
		select {
		case <-c.done:
			return nil
		case <-settling:
			settling = nil
			t := time.NewTimer(settlingWait)
			defer t.Stop()
			giveUp = t.C
		case <-giveUp:
			return fmt.Errorf("%w: storage has not yet confirmed the create of %s; retry", ErrUnavailable, name)
		case <-wctx.Done():
			return wctx.Err()
		}
	}
}

// markSettling wakes the lookups waiting on the claim of name, which the
// caller's create holds, to answer that its create is not yet confirmed.
func (e *Engine) markSettling(name string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if c := e.loading[name]; c != nil && c.settling != nil {
		close(c.settling) // once: one create holds the claim, and hands it over once
	}
}

// stream returns the live handle of name, loading its metadata object when
// it is not in memory. Streams not in memory have no uncompacted WAL data,
// so the metadata object alone describes them.
func (e *Engine) stream(ctx context.Context, name string) (*stream, error) {
	if _, err := e.writer(); err != nil {
		return nil, err
	}
	now := time.Now().UnixNano()
	e.lastUse.Store(now)
	// Every request looks its stream up: shared, so a thousand readers of
	// one stream woken at once do not queue here.
	e.mu.RLock()
	s, ok := e.streams[name]
	e.mu.RUnlock()
	if ok {
		s.used.Store(now)
		return s, nil
	}
	e.mu.Lock()
	if s, ok := e.streams[name]; ok {
		s.used.Store(now)
		e.mu.Unlock()
		return s, nil
	}
	c, ok := e.loading[name]
	if !ok {
		c = &loadCall{done: make(chan struct{})}
		// Refused once Close has begun: a load started then would
		// outlive it.
		if !e.goBG(func() { e.load(ctx, name, c) }) {
			e.mu.Unlock()
			return nil, ErrShuttingDown
		}
		e.loading[name] = c
	}
	e.mu.Unlock()
	// Every request waiting for the load, the one that started it too,
	// stops waiting when it must be answered, and the load goes on for
	// the others: a write (WithAnswerBy) still here has handed nothing to
	// storage, so it is told nothing was stored.
	wctx, cancel := withAnswerByDeadline(ctx)
	defer cancel()
	if err := awaitClaim(wctx, c, name); err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if wctx.Err() == nil {
			return nil, err // a create being settled
		}
		return nil, fmt.Errorf("%w: the metadata of %s was not read in time: %w", ErrUnavailable, name, ErrTooLate)
	}
	if errors.Is(c.err, errLookAgain) {
		return e.stream(ctx, name)
	}
	return c.s, c.err
}

// load reads name's metadata object for the lookups that wait on c, and
// publishes it. It runs on its own, not cancelled by the request that
// started it, as others may be waiting for it too; the engine's close
// ends it, and waits for it (bg).
func (e *Engine) load(ctx context.Context, name string, c *loadCall) {
	lctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(e.bgCtx, cancel)
	c.s, c.err = e.loadMeta(lctx, name)
	stop()
	cancel()
	e.mu.Lock()
	delete(e.loading, name)
	if c.err == nil {
		if s, ok := e.streams[name]; ok { // created meanwhile
			c.s = s
		} else {
			e.streams[name] = c.s
			e.evictLocked()
		}
	}
	e.mu.Unlock()
	close(c.done)
}

// claimName makes lookups of name wait while a create or a delete changes
// what the bucket says about it, so that no lookup loads a metadata object
// that is about to change and keeps it in memory beside the real stream.
// The caller holds the name lock. done publishes the outcome: the stream
// that now exists, or nil and the error lookups should see.
func (e *Engine) claimName(ctx context.Context, name string) (done func(*stream, error), err error) {
	// A write waits for a load or another change of the name until it
	// must be answered: it has stored nothing yet.
	wctx, cancel := withAnswerByDeadline(ctx)
	defer cancel()
	e.mu.Lock()
	for {
		c, ok := e.loading[name]
		if !ok {
			break
		}
		e.mu.Unlock()
		if err := awaitClaim(wctx, c, name); err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if wctx.Err() == nil {
				return nil, err // a create being settled
			}
			return nil, fmt.Errorf("%w: %s was being loaded or changed until the answer was due: %w", ErrUnavailable, name, ErrTooLate)
		}
		e.mu.Lock()
	}
	c := &loadCall{done: make(chan struct{}), settling: make(chan struct{})}
	e.loading[name] = c
	e.mu.Unlock()
	return func(s *stream, err error) {
		e.mu.Lock()
		delete(e.loading, name)
		if s != nil {
			if cur, ok := e.streams[name]; ok && cur != s {
				// A load the claim waited for published the stream, and
				// requests have used that handle since: appends were
				// acknowledged on it, and compaction folds its runs. A
				// create that found the name taken and read the same
				// metadata must not put a second handle in its place
				// (the first one's records would vanish from reads, their
				// seqs be given out again, and compaction forget them).
				s = cur
			} else {
				e.streams[name] = s
				e.evictLocked()
			}
		}
		c.s, c.err = s, err
		e.mu.Unlock()
		close(c.done)
	}, nil
}

func (e *Engine) loadMeta(ctx context.Context, name string) (*stream, error) {
	data, etag, err := e.store.Get(ctx, metaKey(name), 0, -1)
	if errors.Is(err, segment.ErrNotFound) {
		return nil, ErrNotFound
	}
	if err != nil {
		return nil, fmt.Errorf("%w: read metadata of %s: %v", ErrUnavailable, name, err)
	}
	if isGrave(data) {
		return nil, ErrNotFound
	}
	m, err := decodeMeta(data)
	if err != nil {
		return nil, e.damagedObject(name, metaKey(name), err)
	}
	return newStream(name, m, etag), nil
}

// evictLocked drops idle streams past the configured count, oldest use
// first: memory is bounded by configuration, not by how many streams exist.
func (e *Engine) evictLocked() {
	limit := e.config().MaxStreams
	if len(e.streams) <= limit {
		return
	}
	type cand struct {
		name string
		used int64
	}
	var cands []cand
	// A stream looked up in the last moments is probably held by a request
	// about to use it; evicting it would only send that request to load it
	// again (and, under pressure, keep doing so).
	recent := time.Now().Add(-evictGrace).UnixNano()
	for name, s := range e.streams {
		used := s.used.Load()
		if used > recent {
			continue
		}
		if s.mu.TryLock() {
			if s.evictableLocked(e) {
				cands = append(cands, cand{name, used})
			}
			s.mu.Unlock()
		}
	}
	sort.Slice(cands, func(i, j int) bool { return cands[i].used < cands[j].used })
	// Evict a tenth beyond the limit at once so the scan is not paid on
	// every load.
	n := len(e.streams) - limit + limit/10
	for i := 0; i < n && i < len(cands); i++ {
		s := e.streams[cands[i].name]
		if !s.mu.TryLock() {
			continue
		}
		// Re-check: a request may have added work since the scan. A
		// request still holding the handle sees evicted and looks again.
		if s.evictableLocked(e) && !e.keepForRenewalLocked(s, time.Now().UnixMilli()) {
			s.evicted = true
			delete(e.streams, cands[i].name)
		}
		s.mu.Unlock()
	}
}

// compactBacklog is the number of WAL objects that starts a compaction
// before its interval is up.
const compactBacklog = 1000

// compactMinEntries is how many entries a backlog that outgrows the cache
// must hold before it starts a compaction early, unless its entries are
// large (compactLargeEntry on average): reading those back costs their
// bytes again, which is more than a compaction's few PUTs.
const (
	compactMinEntries = 4096
	compactLargeEntry = 16 << 10
)

// evictGrace is how long a looked-up stream is safe from eviction.
const evictGrace = 2 * time.Second

type nameLock struct {
	mu   sync.Mutex
	refs int
}

// pinnedLocked reports whether s must stay in memory whatever its age:
// work in flight, a reader following the tail, or a holder of its name
// lock, whose deletes and metadata writes go through the handle they
// looked up and must not act on one a lookup has since replaced. The
// caller holds e.mu and s.mu.
func (s *stream) pinnedLocked(e *Engine) bool {
	_, locked := e.nameLocks[s.name]
	return s.pending > 0 || s.waiters.Load() > 0 || locked
}

// evictableLocked reports whether s may leave memory: not pinned, and no
// uncompacted WAL runs. The caller holds e.mu and s.mu.
func (s *stream) evictableLocked(e *Engine) bool {
	return !s.pinnedLocked(e) && len(s.runs) == 0
}

// lockName serialises creates and deletes of one name.
func (e *Engine) lockName(name string) func() {
	e.mu.Lock()
	l, ok := e.nameLocks[name]
	if !ok {
		l = &nameLock{}
		e.nameLocks[name] = l
	}
	l.refs++
	e.mu.Unlock()
	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		e.mu.Lock()
		if l.refs--; l.refs == 0 {
			delete(e.nameLocks, name)
		}
		e.mu.Unlock()
	}
}

func newID() string {
	var b [12]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err) // crypto/rand does not fail on supported platforms
	}
	return hex.EncodeToString(b[:])
}

// hooks receives WAL batch outcomes, in WAL order.
type hooks struct{ e *Engine }

func (h hooks) Committed(b *segment.Batch) {
	e := h.e
	pos := walPos{b.Namespace, b.Seq}
	var bytes, wire int64
	entries := 0
	for i, ent := range b.Entries {
		s := ent.Ref.(*stream)
		key := runCacheKey(b.Key, b.Spans[i])
		if len(ent.Records) > 0 {
			mem, encoded := e.cache.put(key, ent.Records, 0)
			// A blob's records never need reading back for compaction;
			// the others weigh on the cache's budget as the cache weighs them.
			if ent.Blob == "" {
				entries++
				bytes += mem
				wire += encoded
			}
		}
		ch := changeOf(ent)
		s.mu.Lock()
		if s.tailEnt == ent {
			s.tailEnt, s.tailBatch = nil, nil
		}
		s.durable.apply(ch)
		s.pending--
		if s.pending == 0 {
			// Nothing is in flight: the pending view is the durable one.
			s.pend = s.durable
		}
		s.runs = append(s.runs, walRun{pos: pos, key: b.Key, span: b.Spans[i], ch: ch, blob: ent.Blob})
		s.notifyLocked()
		e.appended(s, ent)
		s.mu.Unlock()
	}
	e.stats.committed(b)
	e.mu.Lock()
	e.commitEnd = pos.next()
	e.walBacklog++
	// Compaction reads the records it folds from the cache; once what
	// waits for it outgrows most of the cache, the oldest records would
	// have to come back from the bucket (a GET per WAL object, see
	// lostWindows). So a busy node compacts
	// when the backlog reaches three quarters of the cache, not only at
	// the interval. Only when the entries are many, though, or large: a
	// few small entries cost a few small GETs to read back, less than
	// compacting again and again (every compaction writes a metadata
	// object per stream), but megabyte entries read back cost as much as
	// writing them did.
	// The backlog is weighed against the cache in the cache's measure
	// (memory), the size of its entries in what reading them back costs
	// (their encoded bytes).
	e.walBytes += bytes
	e.walWire += wire
	e.walEntries += entries
	limit := e.cache.budgetBytes() * 3 / 4
	full := e.walBytes >= limit && e.walEntries > 0 &&
		(e.walEntries >= compactMinEntries || e.walWire >= int64(e.walEntries)*compactLargeEntry)
	kick := e.walBacklog == compactBacklog || (full && !e.compactFull)
	e.compactFull = e.compactFull || full
	e.mu.Unlock()
	if kick {
		// Replay time is bounded by the WAL left to replay, and compaction
		// by what the cache holds: a busy node compacts early rather than
		// wait for the interval.
		e.kickCompaction()
	}
}

// kickCompaction starts a compaction now rather than at the interval.
func (e *Engine) kickCompaction() {
	select {
	case e.compactKick <- struct{}{}:
	default:
	}
}

func (h hooks) Aborted(b *segment.Batch, err error) {
	h.e.stats.aborted(b)
	if errors.Is(err, segment.ErrFenced) && h.e.takenOver() == nil {
		// The writer found another process's seal in its namespace: that
		// process owns the storage, and this one's memory is stale for
		// reads too (until now only its next lease renewal said so).
		h.e.fence(err)
	}
	var blobs []string
	for _, ent := range b.Entries {
		if ent.Blob != "" && b.Lost() {
			blobs = append(blobs, blobKey(ent.StreamID, ent.Blob))
		}
		s := ent.Ref.(*stream)
		s.mu.Lock()
		if s.tailEnt == ent {
			s.tailEnt, s.tailBatch = nil, nil
		}
		s.pending--
		// Every later entry of this stream is aborted too (acks are in
		// order), so the tail rolls back to the durable one.
		s.pend = s.durable
		// A producer's retry waits for the entry it repeats to settle;
		// rolled back, it may now be applied.
		s.notifyLocked()
		s.mu.Unlock()
	}
	h.e.log.Warn("WAL batch aborted; its appends were not acknowledged",
		zap.String("key", b.Key), zap.Int("entries", len(b.Entries)), zap.Error(err))
	if len(blobs) > 0 {
		// Not here: the writer's releases wait for this hook, and the
		// store has just failed an upload.
		if !h.e.goBG(func() { h.e.dropBlobs(blobs) }) {
			h.e.log.Warn("the blobs of a lost WAL batch are kept: the engine is closing; the next start's orphan sweep deletes them",
				zap.Strings("keys", blobs))
		}
	}
}

// walCachePrefix starts the cache key of every WAL entry (WAL object keys
// start with "wal/"), which tells them from data objects in the cache.
const walCachePrefix = "wal/"

// runCacheKeys is the cache keys of runs.
func runCacheKeys(runs []walRun) []string {
	keys := make([]string, len(runs))
	for i, r := range runs {
		keys[i] = runCacheKey(r.key, r.span)
	}
	return keys
}

// runCacheKey names the run of key at sp in the cache: key@offset. Built
// for every entry an append commits and again when compaction takes it,
// so with one allocation, not Sprintf's three.
func runCacheKey(key string, sp segment.Span) string {
	var b [96]byte
	n := append(b[:0], key...)
	n = append(n, '@')
	n = strconv.AppendInt(n, sp.Off, 10)
	return string(n)
}

// replayMetaLoads is how many metadata objects a replay reads at once. One
// at a time, a restart after a busy minute on a bucket 25 ms away spent a
// minute loading the metadata of 2,000 streams.
const replayMetaLoads = 32

// metaLoader loads, during a replay, the metadata of every stream the WAL
// names, once each, on replayMetaLoads workers, starting as soon as a WAL
// object has been fetched (ahead of its turn to be applied). Names wait in
// a queue, not in a goroutine each: a WAL may name a hundred thousand
// streams.
type metaLoader struct {
	e      *Engine
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	more   *sync.Cond // signalled when a name is queued or the loader closes
	loads  map[string]*metaLoad
	queue  []*metaLoad
	done   bool

	// seeds holds, by name, the last create with records the WAL holds
	// for a name without a metadata object, unless a drop entry undid it:
	// the replay's stream for the name until settleSeeds writes its
	// metadata. Only the replaying goroutine uses it.
	seeds map[string]seed
}

// seed is a create the replay found in the WAL but not in the bucket.
type seed struct {
	s    *stream
	body []byte // its metadata object, as the create meant to write it
}

type metaLoad struct {
	name  string
	ready chan struct{}
	s     *stream // nil when the stream is gone (deleted, or a crashed create)
	err   error
}

func (e *Engine) newMetaLoader(ctx context.Context) *metaLoader {
	ctx, cancel := context.WithCancel(ctx)
	m := &metaLoader{e: e, ctx: ctx, cancel: cancel, loads: map[string]*metaLoad{}, seeds: map[string]seed{}}
	m.more = sync.NewCond(&m.mu)
	for range replayMetaLoads {
		m.wg.Go(m.work)
	}
	return m
}

func (m *metaLoader) work() {
	for {
		m.mu.Lock()
		for len(m.queue) == 0 && !m.done {
			m.more.Wait()
		}
		if len(m.queue) == 0 {
			m.mu.Unlock()
			return
		}
		l := m.queue[0]
		m.queue[0] = nil
		m.queue = m.queue[1:]
		m.mu.Unlock()
		l.s, l.err = m.e.loadMeta(m.ctx, l.name)
		m.e.startProgress.Add(1)
		if errors.Is(l.err, ErrNotFound) {
			l.s, l.err = nil, nil
		}
		close(l.ready)
	}
}

// start queues the streams obj names.
func (m *metaLoader) start(obj *segment.WALObject) {
	for _, ent := range obj.Entries {
		m.load(ent.Name)
	}
}

// load returns name's load, queueing it if it is not yet.
func (m *metaLoader) load(name string) *metaLoad {
	m.mu.Lock()
	defer m.mu.Unlock()
	if l, ok := m.loads[name]; ok {
		return l
	}
	l := &metaLoad{name: name, ready: make(chan struct{})}
	m.loads[name] = l
	m.queue = append(m.queue, l)
	m.more.Signal()
	return l
}

// stream waits for name's metadata.
func (m *metaLoader) stream(name string) (*stream, error) {
	l := m.load(name)
	<-l.ready
	return l.s, l.err
}

// close ends the workers and waits for them. Loads still queued are not
// wanted: after a successful replay there are none, and after a failed one
// (or objects read ahead past a seal) they fail at once.
func (m *metaLoader) close() {
	m.cancel()
	m.mu.Lock()
	m.done = true
	m.more.Broadcast()
	m.mu.Unlock()
	m.wg.Wait()
}

// replayStream returns the stream called name during a replay: the one in
// memory, or the one its metadata describes, now kept in memory; nil when
// it does not exist.
func (e *Engine) replayStream(metas *metaLoader, name string) (*stream, error) {
	if s, ok := e.streams[name]; ok {
		return s, nil
	}
	s, err := metas.stream(name)
	if s != nil {
		s.markReplayed()
		e.streams[name] = s
	}
	return s, err
}

// markReplayed marks a stream the replay brings back as one whose
// checkpoint may be overtaken: the process this one replaced may still
// have a checkpoint of it on its way, conditional on the version loaded
// here, that lands later and moves the stream's tail in the bucket past
// records this process replayed from the WAL. A pack entry of those
// records would then start below the tail, and the next start would
// ignore it and every later entry of the stream, losing what was
// acknowledged since. So the stream is folded before it is packed (decide
// treats it as metaUnsure): the fold's checkpoint writes over a late one
// that landed (writeMeta, replacedWrote) and shuts out one still on its
// way, whose condition no longer holds. Called before s is shared.
func (s *stream) markReplayed() { s.metaUnsure.Store(true) }

// seeded reports whether s is a create the replay found only in the WAL.
func (m *metaLoader) seeded(s *stream) bool {
	sd, ok := m.seeds[s.name]
	return ok && sd.s == s
}

// replaySeed handles an entry that creates a stream with records, or undoes
// such a create, under a name the bucket has no metadata object for (or
// only one a create in the WAL made): it returns the stream a create
// makes, now the name's, or nil for a drop.
//
// A create supersedes any earlier one of the name still without metadata:
// the process made it because it found the name free, so the earlier one
// never took the name. (It may have stayed unconfirmed, its WAL entry
// committing after its caller was told so: nothing dropped it, and a
// replay that kept it behind the later one brought it back once the later
// one was deleted.)
func (e *Engine) replaySeed(metas *metaLoader, key string, ent *segment.Entry) *stream {
	if ent.Drop {
		if sd, ok := metas.seeds[ent.Name]; ok && sd.s.meta.ID == ent.StreamID {
			delete(metas.seeds, ent.Name)
			delete(e.streams, ent.Name)
		}
		return nil
	}
	m, err := decodeMeta(ent.Create)
	if err == nil && (m.ID != ent.StreamID || m.Name != ent.Name) {
		err = fmt.Errorf("metadata of %s (%s) in an entry of %s (%s)", m.Name, m.ID, ent.Name, ent.StreamID)
	}
	if err != nil {
		e.log.Error("create entry with unreadable metadata; ignored", zap.String("key", key),
			zap.String("stream", ent.Name), zap.Error(err))
		return e.streams[ent.Name]
	}
	s := newStream(ent.Name, m, "")
	s.markReplayed() // settleSeeds writes the body the replaced process's own write had
	metas.seeds[ent.Name] = seed{s: s, body: ent.Create}
	e.streams[ent.Name] = s
	return s
}

// settleSeeds ends a replay by writing the metadata of the creates it found
// only in the WAL, create-only, as the creates themselves would have: one
// whose process died before its write, or whose write is still on its way,
// exists from now on with its records. A write that finds the name taken
// reads it back: the create's own write got there first (late, from its
// process), or another stream holds the name and the create lost it.
func (e *Engine) settleSeeds(ctx context.Context, metas *metaLoader) error {
	names := make([]string, 0, len(metas.seeds))
	for name := range metas.seeds {
		names = append(names, name)
	}
	won := make([]*stream, len(names))
	err := e.inParallel(len(names), replayMetaLoads, func(i int) error {
		sd := metas.seeds[names[i]]
		etag, err := e.putNew(ctx, names[i], sd.body)
		if err == nil {
			sd.s.etag = etag
			won[i] = sd.s
			return nil
		}
		if !errors.Is(err, segment.ErrPreconditionFailed) {
			// Landed or not, the name stays the WAL's to settle: the next
			// start tries again.
			return fmt.Errorf("write metadata of %s, created in the WAL: %w", names[i], err)
		}
		cur, etag, err := e.readMeta(ctx, names[i])
		if err != nil && !errors.Is(err, segment.ErrNotFound) {
			return fmt.Errorf("read metadata of %s back: %w", names[i], err)
		}
		if bytes.Equal(cur, sd.body) {
			sd.s.etag = etag
			won[i] = sd.s
		}
		return nil
	})
	if err != nil {
		// A start tried again replays from scratch; these must not look
		// like streams the bucket holds.
		for _, name := range names {
			delete(e.streams, name)
		}
		return err
	}
	for i, name := range names {
		if won[i] == nil {
			// Another stream's now, or gone: a lookup reads the bucket.
			delete(e.streams, name)
			continue
		}
		e.streams[name] = won[i]
		e.log.Info("completed a create found in the WAL", zap.String("stream", name), zap.String("id", won[i].meta.ID))
	}
	metas.seeds = nil
	return nil
}

// replayObject applies one replayed WAL object to the streams it touches.
func (e *Engine) replayObject(metas *metaLoader, key string, obj *segment.WALObject) error {
	pos := walPos{obj.Namespace, obj.Seq}
	for i, ent := range obj.Entries {
		s, err := e.replayStream(metas, ent.Name)
		if err != nil {
			return err
		}
		if (ent.Create != nil || ent.Drop) && (s == nil || metas.seeded(s)) {
			s = e.replaySeed(metas, key, ent)
		}
		if s == nil || s.meta.ID != ent.StreamID {
			continue // orphaned by a crashed create, or deleted
		}
		if s.meta.Upto.after(pos) {
			e.noteReplayed(ent) // checkpointed already, but still the hook's to hear of
			continue
		}
		ch := changeOf(ent)
		if ch.First != s.durable.NextSeq {
			// Entries of one stream follow each other exactly; one that
			// does not can only come from a writer that had lost the
			// storage. It must never move the tail.
			e.log.Error("WAL entry does not continue its stream; ignored",
				zap.String("key", key), zap.String("stream", ent.Name),
				zap.Uint64("first", ch.First), zap.Uint64("tail", s.durable.NextSeq))
			continue
		}
		s.durable.apply(ch)
		s.pend = s.durable
		s.runs = append(s.runs, walRun{pos: pos, key: key, span: obj.Spans[i], ch: ch, blob: ent.Blob})
		e.commitEnd = pos.next()
		e.noteReplayed(ent)
	}
	return nil
}
