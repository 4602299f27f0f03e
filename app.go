package picomq

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/segment"
	"github.com/picomq/caddy-picomq/streamstore"
)

func init() {
	caddy.RegisterModule(new(App))
}

// engines holds one engine per storage location across config reloads. Caddy
// provisions a new config before it cleans up the old one, so the new config's
// reference keeps the engine (its in-flight appends and subscribers) alive.
var engines = caddy.NewUsagePool()

// App is the "picomq" app. It has no configuration of its own: handlers
// obtain it with ctx.App("picomq") and register the storage they use. It
// exists to give the engines a start-up hook, because provisioning must not
// touch the network (caddy adapt --validate provisions every module) while a
// storage that cannot be opened (lease held by another node, bucket missing,
// access denied, unknown format version) should fail "caddy run" or a reload
// with a clear error rather than surface later as 503s. A store that cannot
// be reached at all is another matter: an outage must not keep Caddy and its
// other sites down, so that start goes on in the background and requests are
// answered 503 until it succeeds. Start runs once the whole config is
// provisioned; requests that arrive before it finished wait for it (apps
// start in no fixed order).
type App struct {
	mu    sync.Mutex
	refs  map[string]*appEngine // by storage key, the engines this config uses
	stops []func()              // end this config's live responses
	log   *zap.Logger

	registry *prometheus.Registry // this config's metrics registry (metrics.go)
}

// appEngine is one storage used by this config and the engine settings its
// handlers asked for.
type appEngine struct {
	ref      *engineRef
	settings engineSettings
	// loopback counts this config's Durable Streams handlers of the
	// storage that allow loopback webhooks; loopbackOn says they are
	// counted in the engine's subManagers (from Start to Cleanup).
	loopback   int64
	loopbackOn bool
}

// CaddyModule returns the Caddy module information.
func (*App) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "picomq",
		New: func() caddy.Module { return new(App) },
	}
}

// Provision sets up the app.
func (a *App) Provision(ctx caddy.Context) error {
	a.log = ctx.Logger()
	a.refs = make(map[string]*appEngine)
	a.registry = ctx.GetMetricsRegistry()
	return nil
}

// Start opens every storage this config uses that is not already running
// from an earlier config, then gives the shared ones this config's
// settings.
func (a *App) Start() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	// At boot (or at the first config with PicoMQ, loaded through the
	// admin API) a store that cannot be reached must not keep Caddy down,
	// so its start goes on in the background. A reload has the running config
	// to fall back on: it fails instead, as for any other reason, rather
	// than swap a working storage for one that answers 503.
	background := !configRunning()
	for key, e := range a.refs {
		if err := e.ref.start(background); err != nil {
			if errors.Is(err, segment.ErrLeaseHeldHere) {
				// Name the URLs it is open under, so the operator can
				// find the other spelling.
				err = fmt.Errorf("%w; open here as %s", err, strings.Join(openStorages(key), ", "))
			}
			return fmt.Errorf("starting storage %s: %w", storageLabel(key), err)
		}
	}
	// Only now, with every storage open, do this config's settings reach a
	// shared engine: a config that failed to provision never gets here,
	// nor does one whose storage failed to open (which may take 5 ×
	// s3_timeout, all that while the running config serves the shared
	// storage as it did), and one that fails later, another app's start,
	// hands them back in Cleanup. A storage this config opened runs its
	// settings already.
	for _, e := range a.refs {
		e.ref.activate(a)
		if e.loopback > 0 && !e.loopbackOn {
			// With the settings: a config's allow_loopback_webhooks
			// reaches the storage's subscriptions only once it starts.
			e.ref.subs.loopbackHandlers.Add(e.loopback)
			e.loopbackOn = true
		}
	}
	return nil
}

// configRunning reports whether Caddy runs a config with PicoMQ in it while
// this one starts: a reload of PicoMQ. Caddy swaps its active context only
// once the new config has started. A running config without the app (the
// empty one of a Caddy started without a config, whose first real config
// comes through the admin API) is no reload of it: a start there is a
// boot, as a standby's or on a store not yet reachable. A variable, so
// that tests can play a reload.
var configRunning = func() bool {
	_, err := caddy.ActiveContext().AppIfConfigured("picomq")
	return err == nil
}

// Stop ends the live responses (SSE, long-poll) of this config's handlers.
// The HTTP server's shutdown hook does that too, but only for HTTP/1 and
// HTTP/2; this covers HTTP/3 whenever Caddy stops this app first. Engines
// outlive a config across a reload: the last config to release one closes
// it in Cleanup.
func (a *App) Stop() error {
	a.mu.Lock()
	stops := a.stops
	a.mu.Unlock()
	for _, f := range stops {
		f()
	}
	return nil
}

// allowLoopback records that one of this config's Durable Streams handlers
// of ref's storage allows loopback webhooks. It takes effect when the
// config starts (Start) and ends at its Cleanup: not at provisioning, as
// Caddy provisions a reload while the running config serves and drops it
// if the load fails, which may take as long as a new storage's start.
func (a *App) allowLoopback(ref *engineRef) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if e, ok := a.refs[ref.key]; ok && e.ref == ref {
		e.loopback++
	}
}

// onStop registers f to run when this config stops.
func (a *App) onStop(f func()) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.stops = append(a.stops, f)
}

// Cleanup releases this config's references; an engine no config uses any
// more is flushed and closed.
func (a *App) Cleanup() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	var errs []error
	for key, e := range a.refs {
		if e.loopbackOn {
			e.ref.subs.loopbackHandlers.Add(-e.loopback)
			e.loopbackOn = false
		}
		e.ref.release(a)
		if _, err := engines.Delete(key); err != nil {
			errs = append(errs, fmt.Errorf("closing storage %s: %w", storageLabel(key), err))
		}
	}
	a.refs = nil
	a.stops = nil
	return errors.Join(errs...)
}

// openStorages returns the labels of the storages this process has open,
// but for the one whose key is except.
func openStorages(except string) []string {
	var out []string
	engines.Range(func(k, v any) bool {
		if ref, ok := v.(*engineRef); ok && k != except && ref.eng.Load() != nil {
			out = append(out, storageLabel(ref.key))
		}
		return true
	})
	slices.Sort(out)
	return out
}

// engineSettings are the engine-wide settings of a storage. Handlers of one
// config that share a storage must agree on them.
type engineSettings struct {
	FlushInterval   time.Duration
	FlushSize       int64
	FlushQuiet      time.Duration
	MaxPending      int64
	CacheBytes      int64
	CompactInterval time.Duration
	PackBelow       int64
	MergeBelow      int64
	S3Timeout       time.Duration
	ExpirySweep     time.Duration
	GraveTime       time.Duration
	// LeaseTTL is the storage lease's lifetime, fixed when the engine
	// takes the lease: a reload's takes effect at the next start.
	LeaseTTL time.Duration
}

// acquire returns the engine for the storage at rawURL (placeholders already
// replaced), building it on first use. It does no I/O beyond opening the
// store object, which segment.Open promises is offline.
func (a *App) acquire(rawURL string, s engineSettings) (*engineRef, error) {
	key, err := storageKey(rawURL)
	if err != nil {
		return nil, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.refs == nil {
		return nil, errors.New("picomq app is not provisioned")
	}
	label := storageLabel(key)
	for k := range a.refs {
		// Keys that differ only in credentials name one storage. Left to
		// the metrics registry, they would fail with a duplicate-collector
		// error that says nothing of why.
		if k != key && storageLabel(k) == label {
			return nil, fmt.Errorf("storage %s: %w; two handlers' URLs differ only in credentials",
				label, segment.ErrLeaseHeldHere)
		}
	}
	if e, ok := a.refs[key]; ok {
		if e.settings != s {
			return nil, fmt.Errorf("handlers using storage %s disagree on %s; "+
				"engine settings (flush_interval, flush_size, flush_quiet, max_pending, cache_size, compact_interval, "+
				"pack_below, merge_below, s3_timeout, expiry_sweep_interval, grave_time, lease_ttl) must be the same in every handler of a storage",
				label, settingsDiff(e.settings, s))
		}
		return e.ref, nil
	}
	val, loaded, err := engines.LoadOrNew(key, func() (caddy.Destructor, error) {
		m := new(engineMetrics)
		logs := newLogFollower(a.log)
		store, err := openStore(rawURL, s.S3Timeout, &m.requests,
			logs.logger().Named(sdkLoggerName).With(zap.String("storage", label)))
		if err != nil {
			return nil, err
		}
		ref := newEngineRef(key, store, s, logs)
		ref.metrics = m
		ref.subs.metrics = m
		return ref, nil
	})
	if err != nil {
		return nil, err
	}
	ref := val.(*engineRef)
	if !loaded {
		// A reload that changes grave_time warns when it applies it
		// (reconfigureLocked).
		warnShortGrave(a.log.With(zap.String("storage", label)), key, s.GraveTime)
	}
	ref.hold(a, s, !loaded)
	a.refs[key] = &appEngine{ref: ref, settings: s}
	if err := a.registerMetrics(ref); err != nil {
		return nil, err
	}
	return ref, nil
}

// warnShortGrave warns, for an S3 storage, of a grave_time shorter than
// S3 accepts a signed request for.
func warnShortGrave(log *zap.Logger, key string, grave time.Duration) {
	if strings.HasPrefix(key, "s3://") && grave < s3SigningWindow {
		log.Warn("grave_time is shorter than the time S3 accepts a signed request; "+
			"a create still on its way when its stream is deleted can land after the grave is gone and bring the stream back, "+
			"and a fork create whose write lands that late can find its source's records gone",
			zap.Duration("grave_time", grave), zap.Duration("s3_signing_window", s3SigningWindow))
	}
}

// settingsDiff names the engine settings on which a and b differ, with
// both values, as the Caddyfile spells them.
func settingsDiff(a, b engineSettings) string {
	return diffSettings(a, b, "%s (%v in one, %v in another)")
}

// diffSettings names the engine settings on which a and b differ, each
// written with format from its name, a's value and b's.
func diffSettings(a, b engineSettings, format string) string {
	var out []string
	add := func(name string, x, y any) {
		if x != y {
			out = append(out, fmt.Sprintf(format, name, x, y))
		}
	}
	add("flush_interval", a.FlushInterval, b.FlushInterval)
	add("flush_size", a.FlushSize, b.FlushSize)
	add("flush_quiet", a.FlushQuiet, b.FlushQuiet)
	add("max_pending", a.MaxPending, b.MaxPending)
	add("cache_size", a.CacheBytes, b.CacheBytes)
	add("compact_interval", a.CompactInterval, b.CompactInterval)
	add("pack_below", a.PackBelow, b.PackBelow)
	add("merge_below", a.MergeBelow, b.MergeBelow)
	add("s3_timeout", a.S3Timeout, b.S3Timeout)
	add("expiry_sweep_interval", a.ExpirySweep, b.ExpirySweep)
	add("grave_time", a.GraveTime, b.GraveTime)
	add("lease_ttl", a.LeaseTTL, b.LeaseTTL)
	return strings.Join(out, ", ")
}

// engineRef is a shared engine and its start-up state.
type engineRef struct {
	key   string
	store segment.Store
	// log writes through the logger of the config started last (logs),
	// so that a reload's log settings apply to the engine it shares.
	logs *logFollower
	log  *zap.Logger

	startOnce sync.Once
	ready     chan struct{} // closed when the engine started, or its start failed for good
	startErr  error

	// A store that cannot be reached when the engine first starts is
	// retried in the background (retryStart) until it opens or the last
	// config lets go; requests meanwhile are answered 503 with the reason.
	openCtx    context.Context       // ends in Destruct
	openCancel context.CancelFunc    //
	retrying   chan struct{}         // closed when the first start failed and retries began
	retryDone  chan struct{}         // closed when retryStart has returned
	openErr    atomic.Pointer[error] // the latest failed attempt's error, while retrying

	eng     atomic.Pointer[streamstore.Engine] // set once started
	metrics *engineMetrics                     // store requests and live reads (metrics.go)
	fanout  fanout                             // live feeds writing at once (sse.go)
	subs    subManagers                        // the engine's subscriptions (subscriptions.go)
	failLog *sampledLog                        // requests' store failures, logged sparsely (logsample.go)

	mu       sync.Mutex
	nodeID   string
	settings engineSettings // the settings the engine runs with
	holders  []holder       // the configs using the engine, the latest started last
}

// holder is one config's use of a shared engine and the settings its
// handlers asked for.
type holder struct {
	app      *App
	settings engineSettings
	started  bool
}

// newEngineRef makes the engine reference of storage key. Its logs (the
// engine's and the SDK's among them) go through logs, which each config's
// start points at its own logger.
func newEngineRef(key string, store segment.Store, s engineSettings, logs *logFollower) *engineRef {
	openCtx, openCancel := context.WithCancel(context.Background())
	r := &engineRef{
		key:        key,
		store:      store,
		logs:       logs,
		log:        logs.logger().With(zap.String("storage", storageLabel(key))),
		ready:      make(chan struct{}),
		openCtx:    openCtx,
		openCancel: openCancel,
		retrying:   make(chan struct{}),
		retryDone:  make(chan struct{}),
		settings:   s,
		fanout:     newFanout(),
		failLog:    newSampledLog(storeFailureLogEvery),
	}
	r.subs.failLog = r.failLog
	return r
}

// engineStartStall bounds how long a start (taking the lease, replaying
// the log) may go without progress, so a wedged store fails the config
// load instead of hanging it. A long replay that keeps going is not cut
// short: its length is the WAL compaction left, which a stalled compaction
// can let grow past any fixed bound.
// A variable, for tests.
var engineStartStall = 5 * time.Minute

// start starts the engine once; later calls return the first result. With
// background (at boot), a start that fails because the store cannot be
// reached (a network error, a timeout, a 5xx: segment.Transient) or because
// another node holds its lease does not fail: Caddy and this config start,
// requests are answered 503 until the store opens, and the start is
// retried in the background (waitable). Any other failure (access denied,
// no such bucket, an unknown format), and any failure without background,
// is returned and fails the config load: it needs the operator, who is
// watching now.
func (r *engineRef) start(background bool) error {
	r.startOnce.Do(func() {
		err := r.doStart(r.openCtx)
		if err != nil && background && waitable(err) {
			r.openErr.Store(&err)
			close(r.retrying)
			if errors.Is(err, segment.ErrLeaseHeld) {
				r.log.Warn("storage in use by another node; requests are answered 503, and the start is retried "+
					"in the background until that node lets go of it or its lease lapses", zap.Error(err))
			} else {
				r.log.Warn("storage unreachable; requests are answered 503 until it opens, and the start is retried in the background",
					zap.Error(err))
			}
			go r.retryStart()
			return
		}
		close(r.retryDone)
		r.startErr = err
		close(r.ready)
	})
	return r.startErr
}

// waitable reports whether a failed start is worth retrying in the
// background: the store could not be reached, or another node holds its
// lease, which it gives back when it stops and which lapses when it dies
// (a node started on the same storage is then a standby that takes over).
func waitable(err error) bool {
	return segment.Transient(err) || errors.Is(err, segment.ErrLeaseHeld)
}

// Retries of a start that could not reach the store: a second apart at
// first, doubling up to half a minute.
const (
	openRetryMin = time.Second
	openRetryMax = 30 * time.Second
	// openRetryLogEvery spaces the warnings of a store that stays
	// unreachable; every attempt is logged at debug level.
	openRetryLogEvery = 5 * time.Minute
	// standbyPoll bounds the wait of a start that found the lease held by
	// another node: a holder that stops gives the lease back at once, and
	// a standby that looked again only when the lease would lapse would
	// notice that late.
	standbyPoll = 2 * time.Second
	// leaseLapseMargin is how soon after a held lease's expiry a standby
	// tries again (plus as much again at random).
	leaseLapseMargin = 100 * time.Millisecond
)

// retryWait is how long to wait before the next start attempt after err,
// delay being the backoff of a store that cannot be reached. A lease held
// by another node is looked at again just after it would lapse (its
// holder's renewals push that on) and at least every standbyPoll: with the
// backoff, doubling up to openRetryMax, a standby took the storage over up
// to half a minute after the lease had lapsed.
func retryWait(err error, delay time.Duration, now time.Time) time.Duration {
	backoff := delay/2 + rand.N(delay/2+1)
	var held *segment.LeaseHeldError
	switch {
	case errors.As(err, &held):
		wait := held.Until.Sub(now) + leaseLapseMargin + rand.N(leaseLapseMargin)
		return min(max(wait, leaseLapseMargin), standbyPoll)
	case errors.Is(err, segment.ErrLeaseHeld):
		return min(backoff, standbyPoll)
	}
	return backoff
}

// nextRetryDelay is the backoff after a start attempt that failed with
// err, delay being the one before it. It doubles (up to openRetryMax)
// while the store cannot be reached. An attempt that found the lease held
// reached the store, and its wait is bounded by standbyPoll whatever the
// backoff: the backoff starts over, so that a standby whose next look
// meets a blip of the store tries again within a second or two, not the
// 15 to 30 s its many looks at a held lease had doubled it to, while the
// holder may die and its lease lapse.
func nextRetryDelay(err error, delay time.Duration) time.Duration {
	if errors.Is(err, segment.ErrLeaseHeld) {
		return openRetryMin
	}
	return min(2*delay, openRetryMax)
}

// retryStart starts the engine again until it starts or Destruct ends
// openCtx.
func (r *engineRef) retryStart() {
	defer close(r.retryDone)
	began := time.Now()
	logged := began
	delay := openRetryMin
	for attempt := 2; ; attempt++ {
		t := time.NewTimer(retryWait(*r.openErr.Load(), delay, time.Now()))
		select {
		case <-r.openCtx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		last := *r.openErr.Load()
		err := r.doStart(r.openCtx)
		if err == nil {
			r.openErr.Store(nil)
			close(r.ready)
			msg, waited := openedAfter(last, time.Since(began).Round(time.Millisecond))
			r.log.Info(msg, zap.Int("attempts", attempt), waited)
			return
		}
		if r.openCtx.Err() != nil {
			return
		}
		r.openErr.Store(&err)
		delay = nextRetryDelay(err, delay)
		switch {
		case !waitable(err):
			// Reached now, but refused: still retried, as only the
			// operator can fix it and nothing else would pick that up.
			r.log.Error("storage refused the start; retrying", zap.Int("attempt", attempt), zap.Error(err))
		case time.Since(logged) >= openRetryLogEvery:
			logged = time.Now()
			msg, waited := stillNotOpen(err, time.Since(began).Round(time.Second))
			r.log.Warn(msg, zap.Int("attempt", attempt), waited, zap.Error(err))
		default:
			r.log.Debug("storage still not open; retrying", zap.Int("attempt", attempt), zap.Error(err))
		}
	}
}

// openedAfter is the line that ends a retried start whose last failure
// was last, and how long it waited, named as the periodic warnings named
// it (stillNotOpen): a standby waited for another node's lease; any other
// start waited for a store it could not reach.
func openedAfter(last error, waited time.Duration) (string, zap.Field) {
	if errors.Is(last, segment.ErrLeaseHeld) {
		return "storage opened after another node let go of it", zap.Duration("waited_for", waited)
	}
	return "storage opened after being unreachable", zap.Duration("unreachable_for", waited)
}

// stillNotOpen is the periodic warning of a start still retried after
// failing with err, and how long it has waited. A standby's store is
// reachable: calling its wait "unreachable" would send the operator
// after the network instead of the node that holds the lease.
func stillNotOpen(err error, waited time.Duration) (string, zap.Field) {
	if errors.Is(err, segment.ErrLeaseHeld) {
		return "storage still in use by another node; waiting for its lease", zap.Duration("waited_for", waited)
	}
	return "storage still not open; retrying", zap.Duration("unreachable_for", waited)
}

// doStart makes one attempt to start the engine, bounded by ctx.
func (r *engineRef) doStart(ctx context.Context) error {
	nodeID, err := loadNodeID(nodeIDPath())
	if err != nil {
		return err
	}
	// A file:// directory on a file system without hard links could
	// never take a write: say so now, not at every append.
	if lc, ok := r.store.(interface{ CheckLinks() error }); ok {
		if err := lc.CheckLinks(); err != nil {
			return err
		}
	}
	r.mu.Lock()
	r.nodeID = nodeID
	eng := streamstore.New(r.store, r.engineConfig(), r.log)
	r.mu.Unlock()
	// Start's context bounds the start only; the engine's background work
	// lives until Close.
	ctx, cancel := newStallContext(ctx, engineStartStall, eng.StartProgress)
	defer cancel()
	if err := eng.Start(ctx); err != nil {
		// Never started, it holds no lease and writes nothing: Close
		// only ends its worker pool.
		_ = eng.Close(context.Background())
		return err // the engine names itself ("start engine: ...")
	}
	r.subs.managerFor(eng, r.log) // subscriptions wake on appends from the start, whatever the protocol (subscriptions.go)
	r.mu.Lock()
	r.eng.Store(eng)
	// A reload may have changed the settings while the engine started.
	eng.Reconfigure(r.engineConfig())
	r.mu.Unlock()
	r.log.Debug("engine started", zap.String("node_id", nodeID))
	return nil
}

// engineConfig is the engine's Config for the current settings; r.mu held.
func (r *engineRef) engineConfig() streamstore.Config {
	return streamstore.Config{
		FlushInterval:   r.settings.FlushInterval,
		FlushSize:       int(r.settings.FlushSize),
		FlushQuiet:      r.settings.FlushQuiet,
		MaxPending:      int(r.settings.MaxPending),
		CacheBytes:      r.settings.CacheBytes,
		CompactInterval: r.settings.CompactInterval,
		PackBelow:       r.settings.PackBelow,
		MergeBelow:      r.settings.MergeBelow,
		ExpirySweep:     r.settings.ExpirySweep,
		GraveTime:       r.settings.GraveTime,
		AppendTimeout:   appendTimeout(r.settings),
		NodeID:          r.nodeID,
		LeaseTTL:        r.settings.LeaseTTL,
		// Two storage URLs of one bucket and prefix are two pool keys:
		// the second engine must not take the lease from the first.
		OneEnginePerProcess: true,
	}
}

// Object-store retries, as the module configures segment.Open: each request
// is tried s3Attempts times, each attempt bounded by s3_timeout, with at most
// s3BackoffTotal of backoff between them in all.
const (
	s3Attempts     = 5
	s3MinBackoff   = 50 * time.Millisecond
	s3MaxBackoff   = 400 * time.Millisecond
	s3BackoffTotal = time.Second // 50+100+200+400ms, rounded up
)

// s3SigningWindow is how long after signing S3 still accepts a request: a
// request held up on its way can land that late, so a grave must outlast it.
const s3SigningWindow = 15 * time.Minute

// appendTimeout is how long an append may wait to become durable before it
// is answered 503: its batch's flush interval, then the WAL upload and, when
// that fails, the seal that settles its fate, each a full retried request.
// Deriving it from s3_timeout makes a faulty store visible to clients within
// a bound the operator controls.
func appendTimeout(s engineSettings) time.Duration {
	request := s3Attempts*s.S3Timeout + s3BackoffTotal
	return s.FlushInterval + 2*request
}

// hold records that config a uses the engine with settings s. They are not
// applied yet: Caddy provisions a new config while the old one serves and
// drops it if anything else in it fails, so a config's settings take effect
// when it starts (activate). first says a's acquire built the engine, whose
// settings are then a's already.
func (r *engineRef) hold(a *App, s engineSettings, first bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.holders = append(r.holders, holder{app: a, settings: s, started: first})
}

// activate applies the settings of config a, which is starting: across a
// reload the new config's settings win.
func (r *engineRef) activate(a *App) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, h := range r.holders {
		if h.app == a {
			h.started = true
			r.holders = append(append(r.holders[:i:i], r.holders[i+1:]...), h)
			r.logs.follow(a.log) // first, so that the reload's own line goes there
			r.reconfigureLocked(h.settings, true)
			return
		}
	}
}

// release forgets config a. When a was the newest started config (a reload
// that failed after a's start), the engine goes back to the settings of
// the newest one still running.
func (r *engineRef) release(a *App) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.holders = slices.DeleteFunc(r.holders, func(h holder) bool { return h.app == a })
	for i := len(r.holders) - 1; i >= 0; i-- {
		if r.holders[i].started {
			// Its activation warned of an s3_timeout it could not
			// apply; the old config's cleanup after every reload
			// comes here and would warn a second time.
			r.logs.follow(r.holders[i].app.log)
			r.reconfigureLocked(r.holders[i].settings, false)
			return
		}
	}
}

// reconfigureLocked makes s the engine's settings; r.mu held. The
// object-store timeout belongs to the store opened with the first config
// and stays until a restart, as does the lease's lifetime; warnS3 says to
// warn when s asks for another.
func (r *engineRef) reconfigureLocked(s engineSettings, warnS3 bool) {
	if s == r.settings {
		return
	}
	// Two settings belong to the storage as it was opened: the timeout of
	// its object-store client, and the lease's lifetime (taken with it, and
	// kept by a standby's retried start). They stay until a restart.
	for _, f := range []struct {
		name                string
		running, configured *time.Duration
	}{
		{"s3_timeout", &r.settings.S3Timeout, &s.S3Timeout},
		{"lease_ttl", &r.settings.LeaseTTL, &s.LeaseTTL},
	} {
		if *f.configured != *f.running {
			if warnS3 {
				r.log.Warn(f.name+" changed; it takes effect when Caddy restarts",
					zap.Duration("running", *f.running), zap.Duration("configured", *f.configured))
			}
			*f.configured = *f.running
		}
	}
	if s == r.settings {
		return // nothing else changed: the engine runs as it did
	}
	if s.GraveTime != r.settings.GraveTime {
		warnShortGrave(r.log, r.key, s.GraveTime)
	}
	// Named first, so that the line says what the reload changed, not
	// only what the settings are now.
	changed := diffSettings(r.settings, s, "%s from %v to %v")
	r.settings = s
	if eng := r.eng.Load(); eng != nil {
		eng.Reconfigure(r.engineConfig())
	}
	r.log.Info("engine settings changed by a config reload", zap.String("changed", changed),
		zap.Duration("flush_interval", s.FlushInterval), zap.Int64("flush_size", s.FlushSize), zap.Duration("flush_quiet", s.FlushQuiet),
		zap.Int64("max_pending", s.MaxPending),
		zap.Int64("cache_size", s.CacheBytes), zap.Duration("compact_interval", s.CompactInterval), zap.Int64("pack_below", s.PackBelow),
		zap.Int64("merge_below", s.MergeBelow),
		zap.Duration("expiry_sweep_interval", s.ExpirySweep), zap.Duration("grave_time", s.GraveTime))
}

// engine returns the started engine, waiting for the first start attempt
// if it is still running. While the start is being retried it answers at
// once with the latest attempt's error. It gives up when ctx ends or stop
// is closed.
func (r *engineRef) engine(ctx context.Context, stop <-chan struct{}) (*streamstore.Engine, error) {
	select {
	case <-r.ready:
	default:
		select {
		case <-r.ready:
		case <-r.retrying:
			select {
			case <-r.ready: // the retry that just succeeded
			default:
				if p := r.openErr.Load(); p != nil {
					return nil, &storageStartError{err: *p, retrying: true}
				}
				<-r.ready // opened between the two loads
			}
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-stop:
			return nil, streamstore.ErrShuttingDown
		}
	}
	if r.startErr != nil {
		return nil, &storageStartError{err: r.startErr}
	}
	return r.eng.Load(), nil
}

// storageStartError is why a storage could not be opened. Requests can see
// it in the moment between the http app starting and the config load failing
// (apps start in no fixed order), or while a start that could not reach the
// store is retried, so its reason (see reason) goes to the client too: "in
// use by another node" is something an operator must read.
type storageStartError struct {
	err      error
	retrying bool // the start is being retried in the background
}

func (e *storageStartError) Error() string {
	if e.retrying {
		return "storage is not open yet (retrying): " + e.err.Error()
	}
	return "storage could not be opened: " + e.err.Error()
}

// unreachableReason is what a client is told while the start is retried
// because the store cannot be reached.
const unreachableReason = "storage is not open yet (retrying): the object store cannot be reached; the server log has the error"

// reason is the error as a client is told it. The transport's error of a
// store that cannot be reached names its address, bucket and prefix, and
// an outage can last: like every other store failure it goes to the log
// only (the start's warning). A store that answers and refuses says
// something the operator must read ("in use by another node"), and so
// does a start that failed for good.
func (e *storageStartError) reason() string {
	if e.retrying && segment.Transient(e.err) {
		return unreachableReason
	}
	return e.Error()
}

// Unwrap makes the error match streamstore.ErrUnavailable: nothing was done
// and a retry is safe.
func (e *storageStartError) Unwrap() []error { return []error{streamstore.ErrUnavailable, e.err} }

// busyMessage answers a write refused with streamstore.ErrBusy, in either
// protocol: the appends waiting for storage already hold max_pending bytes.
const busyMessage = "too many appends are waiting for storage; nothing was applied, retry"

// unconfirmedMessage answers a write that was handed to storage and not
// acknowledged (streamstore.ErrUnconfirmed), in either protocol: it may
// still be stored. It says why: the storage refused the write, the
// server stopped before storage answered, or storage was slow. Then what
// makes a repeat safe: a create (PUT), a delete, a trim (trimWrite) and a
// close (closingWrite) are confirmed by repeating them, an append that
// closes its stream cannot be stored twice, and only producer headers make
// any other append's retry safe.
func unconfirmedMessage(method string, err error) string {
	reason, refused := streamstore.StorageRefusal(err)
	stopped := errors.Is(err, streamstore.ErrClosedUnconfirmed)
	// happened says what befell the write, called what, and what may
	// become of it (fate).
	happened := func(what, fate string) string {
		switch {
		case refused:
			return "storage refuses writes: " + reason + "; the " + what + " was not acknowledged" + fate +
				"; once storage takes writes again, "
		case stopped:
			return "the server stopped before storage confirmed the " + what + ": it was not acknowledged" + fate + "; "
		}
		return "storage did not confirm the " + what + " in time: it was not acknowledged" + fate + "; "
	}
	const (
		maybe  = ", and it may or may not take effect"
		stored = " but may still be stored"
	)
	var closing *closingWrite
	var trim *trimWrite
	switch {
	case method == http.MethodPut:
		return happened("create", maybe) + "repeat it: an identical create confirms the stream if it was made"
	case method == http.MethodDelete:
		return happened("delete", maybe) + "repeat it: a repeat of a delete that took effect answers 404"
	case errors.As(err, &trim):
		return happened("trim", maybe) + "repeat it: a trim to a seq already trimmed to changes nothing"
	case errors.As(err, &closing) && !closing.records:
		return happened("close", maybe) + "repeat it as it was: a repeat of a close that took effect succeeds"
	case closing != nil:
		return happened("write", stored) + "repeat it as it was: as it closes the stream it cannot be stored twice; " +
			"if it was, the repeat succeeds with the same producer headers, and without them is refused as the stream is closed"
	}
	return happened("write", stored) + "retry with producer headers to avoid a duplicate"
}

// trimWrite is the error of a Pico trim, for unconfirmedMessage: a trim
// repeated changes nothing more, so it needs no producer headers (and
// takes none).
type trimWrite struct{ err error }

func (t *trimWrite) Error() string { return t.err.Error() }
func (t *trimWrite) Unwrap() error { return t.err }

// closingWrite is the error of an append that closes its stream, a close
// alone or records with the close, for unconfirmedMessage: closing a
// closed stream succeeds, and records that close it cannot be stored
// twice, so neither needs producer headers to be repeated safely.
type closingWrite struct {
	err     error
	records bool // records go with the close
}

func (c *closingWrite) Error() string { return c.err.Error() }
func (c *closingWrite) Unwrap() error { return c.err }

// closingError returns err, the failure of an append of req, marked as a
// closingWrite's when req closes the stream.
func closingError(req streamstore.AppendRequest, err error) error {
	if !req.Close {
		return err
	}
	return &closingWrite{err: err, records: len(req.Records) > 0}
}

// takenOverMessage answers a write that failed with
// streamstore.ErrTakenOver, in either protocol.
const takenOverMessage = "another server took this storage over, and this one writes no more: " +
	"the write was not stored; a retry is safe once it reaches the server that holds the storage now"

// takenOverReadMessage answers a read that failed with
// streamstore.ErrTakenOver: this process no longer sees the stream's
// changes, so what it holds may be behind the stream.
const takenOverReadMessage = "another server took this storage over, and this one serves it no more: " +
	"read from the server that holds the storage now"

// isRead says whether method only reads: GET or HEAD.
func isRead(method string) bool { return method == http.MethodGet || method == http.MethodHead }

// takenOverMessageFor is the answer to a request of method that failed
// with streamstore.ErrTakenOver.
func takenOverMessageFor(method string) string {
	if isRead(method) {
		return takenOverReadMessage
	}
	return takenOverMessage
}

// failWarning names the warning logged for a request that failed with
// streamstore.ErrUnavailable: kind (what the failure is otherwise), or
// what happened when that is known: the storage refused the write for
// good, which needs the operator rather than patience, or the server
// stopped before storage answered. Warnings are sampled by name, so
// these are not held back behind a slow store's.
func failWarning(kind string, err error) string {
	if _, refused := streamstore.StorageRefusal(err); refused {
		return "storage refuses writes"
	}
	if errors.Is(err, streamstore.ErrClosedUnconfirmed) {
		return "write not confirmed before the server stopped"
	}
	return kind
}

// engineCloseTimeout bounds the final flush when the last config lets go.
const engineCloseTimeout = time.Minute

// Destruct is called by the usage pool when no config uses the engine any
// more: it flushes pending appends, waits for their uploads and releases the
// lease.
func (r *engineRef) Destruct() error {
	var errs []error
	// Mark the ref as finished so a start that never ran cannot begin now.
	r.startOnce.Do(func() {
		r.startErr = errors.New("storage closed before it was started")
		close(r.retryDone)
		close(r.ready)
	})
	// A start still being retried ends here; an engine it started just
	// before is closed below like any other.
	r.openCancel()
	<-r.retryDone
	if eng := r.eng.Load(); eng != nil {
		ctx, cancel := context.WithTimeout(context.Background(), engineCloseTimeout)
		defer cancel()
		if err := eng.Close(ctx); err != nil {
			errs = append(errs, fmt.Errorf("closing engine: %w", err))
		} else {
			r.log.Info("storage closed")
		}
	}
	if c, ok := r.store.(io.Closer); ok {
		if err := c.Close(); err != nil {
			errs = append(errs, fmt.Errorf("closing store: %w", err))
		}
	}
	return errors.Join(errs...)
}

// Interface guards.
var (
	_ caddy.App          = (*App)(nil)
	_ caddy.Provisioner  = (*App)(nil)
	_ caddy.CleanerUpper = (*App)(nil)
	_ caddy.Destructor   = (*engineRef)(nil)
)
