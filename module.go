// Package picomq is PicoMQ for Caddy: an HTTP handler that serves durable
// streams, with S3-compatible object storage as its only durable state.
package picomq

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/streamstore"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// Protocol names accepted by the protocol option.
const (
	protocolDurableStreams = "durable-streams"
	protocolPico           = "pico"
)

// Values of the cache_reads option.
const (
	cacheReadsPublic  = "public"
	cacheReadsPrivate = "private"
)

// Defaults of the Handler options.
const (
	defaultFlushInterval        = 20 * time.Millisecond
	defaultFlushSize            = 1 << 20
	defaultMaxPending           = 64 << 20
	defaultLongPollTimeout      = 30 * time.Second
	defaultSSEReconnectInterval = 60 * time.Second
	defaultMaxAppendSize        = 16 << 20
	defaultCacheSize            = 64 << 20
	defaultS3Timeout            = 10 * time.Second
	defaultCompactInterval      = 30 * time.Second
	defaultExpirySweepInterval  = 5 * time.Minute
	defaultGraveTime            = 20 * time.Minute
	defaultLeaseTTL             = 30 * time.Second
	defaultMaxSubscriptions     = 1000
	// The engine's own default, applied here so that a handler that
	// leaves pack_below out and one that spells the default out give one
	// storage the same settings.
	defaultPackBelow  = streamstore.DefaultPackBelow
	defaultMergeBelow = streamstore.DefaultMergeBelow
)

// Upper bounds of size options, checked by Validate (and by the Caddyfile
// parser, to name the line).
const (
	maxFlushSize       = 1 << 30
	maxAppendSizeLimit = 1 << 30 // the whole body is held in memory until it is durable
	maxPackBelow       = 16 << 20
	maxMergeBelow      = streamstore.MaxMergeBelow
	// maxSubscriptionsLimit bounds max_subscriptions (parseCount's bound).
	maxSubscriptionsLimit = 1 << 30
)

// minLoopDuration is the least value of the durations in loopDurations.
// Each paces a loop or bounds a response, so one far too short makes a
// server that spins or answers at once, over and over: compactions and
// expiry LISTs back to back, long-polls answered 204 and SSE feeds closed
// as they arrive, every store request timed out. The usual way to one is
// a JSON integer, which is nanoseconds ("long_poll_timeout": 30 is 30ns).
// flush_interval and flush_quiet have no floor: short ones trade PUTs for
// latency, bounded by the appends that come.
const minLoopDuration = 100 * time.Millisecond

// minLeaseTTL is the least lease_ttl: the holder renews the lease every
// third of it and counts it valid for four fifths, so a shorter one would
// leave a store's ordinary latency (and one retried renewal) no room
// before the holder stops writing.
const minLeaseTTL = 3 * time.Second

// loopDurations are the options minLoopDuration applies to.
var loopDurations = map[string]bool{
	"long_poll_timeout": true, "sse_reconnect_interval": true, "sse_keepalive": true, "compact_interval": true,
	"s3_timeout": true, "expiry_sweep_interval": true, "grave_time": true,
}

// Handler serves durable streams: every request path below the handler is a
// stream. Streams are stored in S3-compatible object storage (or a local
// directory); the process holds caches only.
//
// Caddyfile syntax (all subdirectives optional):
//
//	picomq [<matcher>] {
//	    protocol               durable-streams|pico
//	    storage                <url>
//	    flush_interval         <duration>
//	    flush_size             <size>
//	    flush_quiet            <duration>
//	    max_pending            <size>
//	    long_poll_timeout      <duration>
//	    sse_reconnect_interval <duration>
//	    sse_keepalive          <duration>
//	    max_append_size        <size>
//	    cache_size             <size>
//	    compact_interval       <duration>
//	    pack_below             <size>|off
//	    merge_below            <size>|off
//	    s3_timeout             <duration>
//	    expiry_sweep_interval  <duration>
//	    grave_time             <duration>
//	    lease_ttl              <duration>
//	    max_subscriptions      <count>
//	    cache_reads            public|private
//	    allow_loopback_webhooks
//	}
//
// Sizes take units (64KiB, 1MiB, 16MB); a bare number is bytes and, under
// 1024, refused as a likely slip (512B is taken). Durations but flush_interval and
// flush_quiet are at least 100ms (minLoopDuration), and lease_ttl at least
// 3s (minLeaseTTL). The directive is
// ordered before respond; inside handle_path the stream name is the path
// after the stripped prefix, and URLs written back to clients keep the
// prefix.
type Handler struct {
	// Wire protocol: "durable-streams" (default) or "pico", PicoMQ's native
	// record protocol. Handlers of both protocols on one storage serve the
	// same streams.
	Protocol string `json:"protocol,omitempty"`

	// Where streams are stored: s3://BUCKET/PREFIX?region=R&endpoint=URL&path_style=true
	// or file:///dir. Placeholders such as {env.BUCKET} are replaced when the
	// config is loaded. Default: the "picomq/data" directory under Caddy's
	// data directory. Handlers (and configs, across reloads) with the same
	// storage share one engine.
	Storage string `json:"storage,omitempty"`

	// Least time between the starts of two WAL uploads, which bounds the
	// PUT rate under load (batches grow instead; one that reaches
	// flush_size goes at once). An append that finds no upload started
	// within the interval goes out at once. Default 20ms.
	FlushInterval caddy.Duration `json:"flush_interval,omitempty"`

	// Batch size in bytes that starts an upload at once. Default 1 MiB.
	FlushSize int64 `json:"flush_size,omitempty"`

	// When set, an upload that could start waits until no append has
	// arrived for this long (and at most flush_interval after its first
	// append). Writers that append again as soon as they are acknowledged
	// come back as a burst; this lets the burst share one upload instead of
	// its first append taking an upload alone. Costs an isolated append this
	// much latency. Must be below flush_interval. Default 0: off.
	FlushQuiet caddy.Duration `json:"flush_quiet,omitempty"`

	// Memory held by appends waiting for storage (WAL entries in the open batch,
	// uploading or waiting for an earlier upload's outcome, large appends
	// in their own uploads, and appends queued behind a large append or a
	// close of their stream) past which appends get
	// 503 with Retry-After at once instead of joining: a store that falls
	// behind must not make the process grow without bound. Default 64 MiB.
	MaxPending int64 `json:"max_pending,omitempty"`

	// Longest a long-poll read waits for data before answering 204.
	// Default 30s.
	LongPollTimeout caddy.Duration `json:"long_poll_timeout,omitempty"`

	// How long an SSE response lasts before the server closes it so the
	// client reconnects (which lets CDNs collapse readers). Default 60s.
	SSEReconnectInterval caddy.Duration `json:"sse_reconnect_interval,omitempty"`

	// How long an SSE response at a quiet stream's tail goes without a
	// write before the server writes it the tail's control event again,
	// so that proxies that close idle connections keep it. Default 20s.
	SSEKeepAlive caddy.Duration `json:"sse_keepalive,omitempty"`

	// Largest append body in bytes; larger bodies get 413. Default 16 MiB.
	MaxAppendSize int64 `json:"max_append_size,omitempty"`

	// Memory budget in bytes for the engine's record and block caches.
	// Default 64 MiB.
	CacheSize int64 `json:"cache_size,omitempty"`

	// How often the write-ahead log is compacted into data objects.
	// Default 30s.
	CompactInterval caddy.Duration `json:"compact_interval,omitempty"`

	// A compaction puts the new records of a stream whose records not yet
	// in data objects of its own are at most this many bytes into a pack
	// shared with other streams (one PUT for many streams), and gives the
	// stream data objects of its own only once it has more, goes idle, or
	// has more than half as many bytes when its packed records are due for a
	// repack (5 to 10 minutes in packs, or 10 to 16 runs; with fewer they
	// are repacked into one run and stay). Many slow streams then cost
	// a fraction of the requests. -1 (Caddyfile: off) never packs: every
	// compaction writes a data object and a checkpoint per stream with new
	// records. Default 256 KiB; at most 16 MiB.
	PackBelow int64 `json:"pack_below,omitempty"`

	// A compaction that gives a stream a data object of its own writes
	// the stream's last data object again with the new records, as one
	// object, while that object is smaller than this: a stream written a
	// little at a time grows one object to this size instead of making one
	// per compaction (each a GET for a reader catching up), for a GET of
	// the old object and up to this many bytes written again per
	// compaction. -1 (Caddyfile: off) never merges. Default 64 KiB; at
	// most 4 MiB, the size of a data object.
	MergeBelow int64 `json:"merge_below,omitempty"`

	// Timeout of each object-store request attempt (a request is tried up
	// to 5 times). An append that cannot be made durable is answered 503
	// within about 10 times this. Default 10s.
	S3Timeout caddy.Duration `json:"s3_timeout,omitempty"`

	// How often the storage is swept for streams past their TTL or
	// Stream-Expires-At that nobody has accessed since (an access deletes
	// an expired stream at once). A sweep lists only the markers that are
	// due, so an idle storage costs one LIST per interval. Default 5m.
	ExpirySweepInterval caddy.Duration `json:"expiry_sweep_interval,omitempty"`

	// How long a deleted stream's name keeps a grave in the bucket, which
	// a create's write still on its way (its first attempt held up, its
	// retry answered, the stream deleted since) fails against instead of
	// bringing the stream back. It must outlast the longest a request can
	// take to reach the store: S3 refuses one signed more than 15 minutes
	// earlier. A create over a grave costs a read and a second write.
	// Default 20m.
	GraveTime caddy.Duration `json:"grave_time,omitempty"`

	// How long the storage lease lasts without renewal: the node renews
	// it every third of that, and another node (a standby) takes the
	// storage over once it lapses, so this bounds the wait after the
	// holder dies or is cut off from the store. Shorter means a faster
	// takeover and a renewal PUT more often; the store must answer a
	// renewal within a third of it. At least 3s. Takes effect when the
	// storage is opened (a restart), not at a reload. Default 30s.
	LeaseTTL caddy.Duration `json:"lease_ttl,omitempty"`

	// Accept webhook subscriptions whose URL is on this machine
	// (http://localhost, http://127.0.0.x): the development exception of
	// protocol section 6.2. Off by default: webhook URLs must be https to a
	// public address (section 12.8). Durable Streams handlers only: a Pico
	// handler ignores it, with a warning.
	AllowLoopbackWebhooks bool `json:"allow_loopback_webhooks,omitempty"`

	// Most subscriptions (Durable Streams section 6) under one stream
	// root; a create past it gets 403 SUBSCRIPTION_LIMIT_EXCEEDED. Any
	// client may create them, and each costs memory and a document in the
	// bucket that every start reads (the lease tick looks only at those
	// with something due). Subscriptions already there are kept when it is
	// lowered. Handlers of one storage share
	// its subscriptions, each applying its own limit. Default 1000.
	// Durable Streams handlers only: a Pico handler ignores it, with a
	// warning.
	MaxSubscriptions int `json:"max_subscriptions,omitempty"`

	// Whether read answers that may be cached (catch-up reads, long-polls
	// that return data, a closed stream's EOF) say "public" (default), so
	// a CDN may serve them to everyone who asks for the same URL, or
	// "private", so only the reader's own browser keeps them, with the
	// same max-age; a Durable Streams SSE feed then says "private,
	// no-cache". A request with Authorization or a Cookie, or one that
	// Caddy's authentication handler (basic_auth) let through, is answered
	// "private" either way; a site that checks credentials the module
	// cannot see as such (a query parameter such as ?token=, a header such
	// as X-Api-Key) needs "private".
	CacheReads string `json:"cache_reads,omitempty"`

	log   *zap.Logger
	ref   *engineRef
	proto http.Handler

	// shutdown ends when this handler's server begins to shut down (a reload
	// or exit), so that long-poll and SSE responses end promptly instead of
	// holding the server's graceful shutdown open.
	shutdown       context.Context
	cancelShutdown context.CancelFunc
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.picomq",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision applies defaults, resolves the storage and registers the shutdown
// hook. It does no network I/O: the storage is opened when the picomq app
// starts.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.log = ctx.Logger()
	h.shutdown, h.cancelShutdown = context.WithCancel(context.Background())
	// Before the defaults, which set max_subscriptions whatever the
	// protocol. A warning, not a refusal: a snippet shared by the
	// handlers of both protocols is a fair way to write a config.
	if ignored := h.ignoredDSOnly(); len(ignored) > 0 {
		h.log.Warn("options that only Durable Streams handlers use are ignored: Pico has no subscriptions",
			zap.Strings("options", ignored))
	}
	h.applyDefaults()

	storage := h.Storage
	if storage == "" {
		storage = defaultStorageURL()
	}
	storage, err := caddy.NewReplacer().ReplaceOrErr(storage, true, true)
	if err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	if err := h.Validate(); err != nil {
		return err
	}

	appIface, err := ctx.App("picomq")
	if err != nil {
		return fmt.Errorf("getting picomq app: %w", err)
	}
	app := appIface.(*App)
	h.ref, err = app.acquire(storage, engineSettings{
		FlushInterval:   time.Duration(h.FlushInterval),
		FlushSize:       h.FlushSize,
		FlushQuiet:      time.Duration(h.FlushQuiet),
		MaxPending:      h.MaxPending,
		CacheBytes:      h.CacheSize,
		CompactInterval: time.Duration(h.CompactInterval),
		PackBelow:       h.PackBelow,
		MergeBelow:      h.MergeBelow,
		S3Timeout:       time.Duration(h.S3Timeout),
		ExpirySweep:     time.Duration(h.ExpirySweepInterval),
		GraveTime:       time.Duration(h.GraveTime),
		LeaseTTL:        time.Duration(h.LeaseTTL),
	})
	if err != nil {
		return fmt.Errorf("storage: %w", err)
	}

	// Handlers are provisioned with their server in the context. Its
	// shutdown hooks run as soon as http.Server.Shutdown begins, while
	// Cleanup would only run after every connection has ended, which a
	// live reader never does by itself.
	if srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); ok && srv != nil {
		srv.RegisterOnShutdown(h.cancelShutdown)
	}
	app.onStop(h.cancelShutdown)

	if h.AllowLoopbackWebhooks && h.Protocol == protocolDurableStreams {
		// Counted from when this config starts until its cleanup, as its
		// engine settings are: a reload that fails leaves loopback
		// deliveries as the running config has them, and one that turns
		// the option off stops them (subscriptions.go).
		app.allowLoopback(h.ref)
	}

	switch h.Protocol {
	case protocolDurableStreams:
		h.proto = &durableStreams{
			engine:          h.engine,
			shutdown:        h.shutdown,
			log:             h.log,
			failLog:         h.ref.failLog,
			longPollTimeout: time.Duration(h.LongPollTimeout),
			sseInterval:     time.Duration(h.SSEReconnectInterval),
			sseKeepAlive:    time.Duration(h.SSEKeepAlive),
			maxAppend:       h.MaxAppendSize,
			chunkBytes:      dsChunkBytes,
			jitter:          randomJitter,
			allowLoopback:   h.AllowLoopbackWebhooks,
			maxSubs:         h.MaxSubscriptions,
			privateReads:    h.CacheReads == cacheReadsPrivate,
			live:            h.ref.metrics.liveFor(h.Protocol),
			fanout:          h.ref.fanout,
			hubs:            &sseHubs{keepAlive: time.Duration(h.SSEKeepAlive)},
			subs:            &h.ref.subs,
		}
	case protocolPico:
		h.proto = &picoProtocol{
			engine:          h.engine,
			shutdown:        h.shutdown,
			log:             h.log,
			failLog:         h.ref.failLog,
			longPollTimeout: time.Duration(h.LongPollTimeout),
			sseInterval:     time.Duration(h.SSEReconnectInterval),
			sseKeepAlive:    time.Duration(h.SSEKeepAlive),
			maxAppend:       h.MaxAppendSize,
			chunkBytes:      picoDefaultReadBytes,
			jitter:          randomJitter,
			privateReads:    h.CacheReads == cacheReadsPrivate,
			live:            h.ref.metrics.liveFor(h.Protocol),
			fanout:          h.ref.fanout,
			hubs:            &sseHubs{keepAlive: time.Duration(h.SSEKeepAlive)},
		}
	}
	return nil
}

// ignoredDSOnly names the options a Pico handler was given that only the
// Durable Streams protocol uses (subscriptions): on it they do nothing.
func (h *Handler) ignoredDSOnly() []string {
	if h.Protocol != protocolPico {
		return nil
	}
	var ignored []string
	if h.MaxSubscriptions != 0 {
		ignored = append(ignored, "max_subscriptions")
	}
	if h.AllowLoopbackWebhooks {
		ignored = append(ignored, "allow_loopback_webhooks")
	}
	return ignored
}

func (h *Handler) applyDefaults() {
	if h.Protocol == "" {
		h.Protocol = protocolDurableStreams
	}
	if h.FlushInterval == 0 {
		h.FlushInterval = caddy.Duration(defaultFlushInterval)
	}
	if h.FlushSize == 0 {
		h.FlushSize = defaultFlushSize
	}
	if h.MaxPending == 0 {
		h.MaxPending = defaultMaxPending
	}
	if h.LongPollTimeout == 0 {
		h.LongPollTimeout = caddy.Duration(defaultLongPollTimeout)
	}
	if h.SSEReconnectInterval == 0 {
		h.SSEReconnectInterval = caddy.Duration(defaultSSEReconnectInterval)
	}
	if h.SSEKeepAlive == 0 {
		h.SSEKeepAlive = caddy.Duration(hubKeepAlive)
	}
	if h.MaxAppendSize == 0 {
		h.MaxAppendSize = defaultMaxAppendSize
	}
	if h.CacheSize == 0 {
		h.CacheSize = defaultCacheSize
	}
	if h.S3Timeout == 0 {
		h.S3Timeout = caddy.Duration(defaultS3Timeout)
	}
	if h.CompactInterval == 0 {
		h.CompactInterval = caddy.Duration(defaultCompactInterval)
	}
	if h.ExpirySweepInterval == 0 {
		h.ExpirySweepInterval = caddy.Duration(defaultExpirySweepInterval)
	}
	if h.GraveTime == 0 {
		h.GraveTime = caddy.Duration(defaultGraveTime)
	}
	if h.LeaseTTL == 0 {
		h.LeaseTTL = caddy.Duration(defaultLeaseTTL)
	}
	if h.PackBelow == 0 {
		h.PackBelow = defaultPackBelow
	}
	if h.MergeBelow == 0 {
		h.MergeBelow = defaultMergeBelow
	}
	if h.MaxSubscriptions == 0 {
		h.MaxSubscriptions = defaultMaxSubscriptions
	}
	if h.CacheReads == "" {
		h.CacheReads = cacheReadsPublic
	}
}

// Validate checks the options after defaults are applied.
func (h *Handler) Validate() error {
	switch h.Protocol {
	case protocolDurableStreams, protocolPico:
	default:
		return fmt.Errorf("protocol: unknown protocol %q (use durable-streams or pico)", h.Protocol)
	}
	if err := checkCacheReads(h.CacheReads); err != nil {
		return err
	}
	if h.Storage != "" && !strings.Contains(h.Storage, "{") {
		// As the Caddyfile checks it; one with placeholders is checked
		// once they are replaced, when the storage is acquired.
		if err := checkStorageURL(h.Storage); err != nil {
			return fmt.Errorf("storage: %w", err)
		}
	}
	for _, d := range []struct {
		name string
		v    caddy.Duration
	}{
		{"flush_interval", h.FlushInterval},
		{"flush_quiet", h.FlushQuiet},
		{"long_poll_timeout", h.LongPollTimeout},
		{"sse_reconnect_interval", h.SSEReconnectInterval},
		{"sse_keepalive", h.SSEKeepAlive},
		{"s3_timeout", h.S3Timeout},
		{"compact_interval", h.CompactInterval},
		{"expiry_sweep_interval", h.ExpirySweepInterval},
		{"grave_time", h.GraveTime},
		{"lease_ttl", h.LeaseTTL},
	} {
		if d.v < 0 {
			return fmt.Errorf("%s must not be negative", d.name)
		}
		if loopDurations[d.name] && time.Duration(d.v) < minLoopDuration {
			hint := ""
			if time.Duration(d.v) < time.Millisecond {
				hint = ` (an integer in JSON is nanoseconds: write a string such as "30s")`
			}
			return fmt.Errorf("%s must be at least %s, got %s%s", d.name, minLoopDuration, time.Duration(d.v), hint)
		}
	}
	if time.Duration(h.LeaseTTL) < minLeaseTTL {
		return fmt.Errorf("lease_ttl must be at least %s, got %s", minLeaseTTL, time.Duration(h.LeaseTTL))
	}
	for _, s := range []struct {
		name string
		v    int64
	}{
		{"flush_size", h.FlushSize},
		{"max_pending", h.MaxPending},
		{"max_append_size", h.MaxAppendSize},
		{"cache_size", h.CacheSize},
	} {
		if s.v < 0 {
			return fmt.Errorf("%s must not be negative", s.name)
		}
	}
	if h.MaxSubscriptions < 0 {
		return errors.New("max_subscriptions must not be negative")
	}
	if h.MaxSubscriptions > maxSubscriptionsLimit {
		// As the Caddyfile refuses it.
		return fmt.Errorf("max_subscriptions must be at most %d", maxSubscriptionsLimit)
	}
	if h.PackBelow < -1 || h.PackBelow > maxPackBelow {
		return fmt.Errorf("pack_below must be -1 (off) or at most 16MiB, got %d", h.PackBelow)
	}
	if h.MergeBelow < -1 || h.MergeBelow > maxMergeBelow {
		return fmt.Errorf("merge_below must be -1 (off) or at most 4MiB, got %d", h.MergeBelow)
	}
	if h.FlushQuiet >= h.FlushInterval {
		return fmt.Errorf("flush_quiet (%s) must be below flush_interval (%s)",
			time.Duration(h.FlushQuiet), time.Duration(h.FlushInterval))
	}
	if h.FlushSize > maxFlushSize {
		return errors.New("flush_size must be at most 1GiB")
	}
	if h.MaxPending > 1<<40 {
		return errors.New("max_pending must be at most 1TiB")
	}
	if h.CacheSize > 1<<40 {
		// As the Caddyfile refuses it.
		return errors.New("cache_size must be at most 1TiB")
	}
	if h.MaxAppendSize > maxAppendSizeLimit {
		// The whole body is held in memory until it is durable.
		return errors.New("max_append_size must be at most 1GiB")
	}
	return nil
}

// checkCacheReads refuses a cache_reads value other than public or
// private: a misspelt "privat" taken as the default would hand protected
// streams to shared caches without a word.
func checkCacheReads(v string) error {
	switch v {
	case cacheReadsPublic, cacheReadsPrivate:
		return nil
	}
	return fmt.Errorf("cache_reads: unknown value %q (use %s or %s)", v, cacheReadsPublic, cacheReadsPrivate)
}

// Cleanup ends any live responses still open. The engine itself, and the
// handler's allow_loopback_webhooks, are released by the picomq app.
func (h *Handler) Cleanup() error {
	if h.cancelShutdown != nil {
		h.cancelShutdown()
	}
	return nil
}

// engine returns the handler's engine once the storage is open.
func (h *Handler) engine(ctx context.Context) (*streamstore.Engine, error) {
	return h.ref.engine(ctx, h.shutdown.Done())
}

// ServeHTTP serves a stream request. The handler is terminal: it answers
// every request it gets and never calls next.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	setCommonHeaders(w.Header())
	if r.Method == http.MethodOptions {
		expose, allow := exposedHeaders, allowedRequestHeaders
		if _, pico := h.proto.(*picoProtocol); pico {
			// A Pico handler's clients send and read Pico-* headers, not
			// Durable Streams' ones.
			expose, allow = picoExposedHeaders, picoAllowedRequestHeaders
		}
		writePreflight(w, r, expose, allow)
		return nil
	}
	h.proto.ServeHTTP(w, r)
	return nil
}

// exposedHeaders are the response headers browser code may read.
const exposedHeaders = "Stream-Next-Offset, Stream-Up-To-Date, Stream-Cursor, Stream-Closed, " +
	"Stream-TTL, Stream-Expires-At, Stream-SSE-Data-Encoding, " +
	"Producer-Epoch, Producer-Seq, Producer-Expected-Seq, Producer-Received-Seq, " +
	"ETag, Content-Type, Location, Retry-After"

// allowedRequestHeaders are the request headers a preflight allows when the
// browser does not list the ones it wants.
const allowedRequestHeaders = "Content-Type, If-None-Match, Authorization, " +
	"Stream-TTL, Stream-Expires-At, Stream-Closed, Stream-Seq, " +
	"Producer-Id, Producer-Epoch, Producer-Seq, " +
	"Stream-Forked-From, Stream-Fork-Offset, Stream-Fork-Sub-Offset"

const allowedMethods = "GET, HEAD, PUT, POST, DELETE, OPTIONS"

// contentSecurityPolicy sandboxes any document a response becomes. A
// stream's Content-Type is its writer's choice (text/html, image/svg+xml),
// and a browser that navigates to the stream renders it: without this its
// scripts ran in the stream origin, with the visitor's cookies and cached
// credentials for every same-origin fetch. Clients that fetch streams or
// follow them with EventSource are not documents and are not affected.
const contentSecurityPolicy = "default-src 'none'; sandbox"

// setCommonHeaders sets the browser-safety and CORS headers every response
// carries (protocol section 12.7).
func setCommonHeaders(h http.Header) {
	// One backing array for the five values rather than one each (Set's
	// way): every append's response carries them. Each value gets a
	// capacity of one, so an Add by a later handler copies, not overwrites.
	v := [...]string{"nosniff", "cross-origin", "*", exposedHeaders, contentSecurityPolicy}
	vals := v[:]
	h["X-Content-Type-Options"] = vals[0:1:1]
	h["Cross-Origin-Resource-Policy"] = vals[1:2:2]
	h["Access-Control-Allow-Origin"] = vals[2:3:3]
	h["Access-Control-Expose-Headers"] = vals[3:4:4]
	h["Content-Security-Policy"] = vals[4:5:5]
}

// writePreflight answers an OPTIONS request (a CORS preflight or not) with
// the protocol's exposed response headers and its default allowed request
// headers.
func writePreflight(w http.ResponseWriter, r *http.Request, expose, allow string) {
	h := w.Header()
	h.Set("Access-Control-Expose-Headers", expose)
	h.Set("Allow", allowedMethods)
	h.Set("Access-Control-Allow-Methods", allowedMethods)
	if req := r.Header.Get("Access-Control-Request-Headers"); req != "" {
		h.Set("Access-Control-Allow-Headers", req)
	} else {
		h.Set("Access-Control-Allow-Headers", allow)
	}
	h.Set("Access-Control-Max-Age", "86400")
	h.Set("Cache-Control", cacheControlNoStore)
	w.WriteHeader(http.StatusNoContent)
}

// Interface guards.
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
