package picomq

import (
	"fmt"
	"net/url"
	"sort"
	"strings"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/picomq/caddy-picomq/segment"
	"github.com/picomq/caddy-picomq/streamstore"
)

// Metrics. The engine and the store keep running totals with atomic adds
// (streamstore.Stats, segment.RequestStats) and the handlers count their
// live reads (liveReaders); all of them belong to the shared engine, so they
// outlive config reloads. Caddy gives every config load a fresh Prometheus
// registry, served by the admin endpoint's /metrics; each config registers
// one collector per storage it uses, which reads the totals at scrape time.
// So a reload registers nothing twice and counters never go back.

// Live read modes, as the "live" query parameter names them and as the
// open subscribers gauge labels them.
const (
	liveSSE      = "sse"
	liveLongPoll = "long-poll"
)

// liveReaders counts the live reads one protocol's handlers have open on one
// storage. A nil *liveReaders counts nothing.
type liveReaders struct {
	sse, longPoll atomic.Int64
}

func (l *liveReaders) counter(mode string) *atomic.Int64 {
	if l == nil {
		return nil
	}
	switch mode {
	case liveSSE:
		return &l.sse
	case liveLongPoll:
		return &l.longPoll
	}
	return nil
}

// begin counts a live read of mode ("sse" or "long-poll"; anything else,
// such as the "" of a catch-up read, is not counted) as open.
func (l *liveReaders) begin(mode string) {
	if c := l.counter(mode); c != nil {
		c.Add(1)
	}
}

// end counts a live read begun with the same mode as closed.
func (l *liveReaders) end(mode string) {
	if c := l.counter(mode); c != nil {
		c.Add(-1)
	}
}

// metricProtocols are the protocols live reads are counted for, in the
// order of engineMetrics.live.
var metricProtocols = [...]string{protocolDurableStreams, protocolPico}

// engineMetrics is what a shared engine counts beside the engine itself:
// the requests of its store, the live reads of its handlers, and the
// streams its subscriptions could not link.
type engineMetrics struct {
	requests segment.RequestStats
	live     [len(metricProtocols)]liveReaders
	// subLinksRefused counts the appends to a stream a subscription's
	// pattern matches that did not link it: the subscription links the
	// most streams it may (subscriptions.go).
	subLinksRefused atomic.Uint64
	// subDocsDamaged counts the subscription documents a load could not
	// decode, in picomq_damaged_objects_total with the engine's own.
	subDocsDamaged atomic.Uint64
}

// liveFor returns the live read counters of protocol.
func (m *engineMetrics) liveFor(protocol string) *liveReaders {
	if m == nil {
		return nil
	}
	for i, p := range metricProtocols {
		if p == protocol {
			return &m.live[i]
		}
	}
	return nil
}

// storageLabel is the storage label of a storage key: the key without any
// user information (in the URL or in an endpoint parameter) and with its
// query parameters readable.
func storageLabel(key string) string {
	u, err := url.Parse(key)
	if err != nil {
		return "unparsable storage URL"
	}
	u.User = nil
	q := u.Query()
	u.RawQuery = ""
	label := u.String()
	if len(q) == 0 {
		return label
	}
	names := make([]string, 0, len(q))
	for k := range q {
		names = append(names, k)
	}
	sort.Strings(names)
	parts := make([]string, 0, len(names))
	for _, k := range names {
		for _, v := range q[k] {
			// Only endpoint takes a URL, but a mistyped parameter
			// may hold one too.
			parts = append(parts, k+"="+segment.RedactEndpoint(v))
		}
	}
	return label + "?" + strings.Join(parts, "&")
}

// storageCollector exposes one storage's totals to a config's registry.
type storageCollector struct {
	// engine returns the engine's totals, and false while the engine is
	// not started.
	engine  func() (streamstore.StatsSnapshot, bool)
	metrics *engineMetrics

	appends, records, bytes, flushes, aborted *prometheus.Desc
	cacheHits, cacheMisses, expired           *prometheus.Desc
	buffersReused                             *prometheus.Desc
	requests, uploads, subscribers            *prometheus.Desc
	busy, pending                             *prometheus.Desc
	folds, merges, packed, repacked           *prometheus.Desc
	packsWritten, packsLive                   *prometheus.Desc
	streamsInMemory, orphanBlobs              *prometheus.Desc
	damagedWAL, damagedObjects, open          *prometheus.Desc
	subLinksRefused                           *prometheus.Desc
}

// newStorageCollector builds the collector of the storage labelled label.
func newStorageCollector(label string, engine func() (streamstore.StatsSnapshot, bool), m *engineMetrics) *storageCollector {
	if m == nil {
		m = new(engineMetrics)
	}
	constLabels := prometheus.Labels{"storage": label}
	desc := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc("picomq_"+name, help, labels, constLabels)
	}
	return &storageCollector{
		engine:  engine,
		metrics: m,
		appends: desc("appends_total",
			"Appends made durable: one per acknowledged append request (a Pico batch counts once), whatever the protocol."),
		records: desc("appended_records_total",
			"Records in the appends made durable."),
		bytes: desc("appended_bytes_total",
			"Body bytes of the records made durable."),
		flushes: desc("wal_flushes_total",
			"WAL objects (group-commit batches) committed."),
		aborted: desc("wal_aborted_batches_total",
			"WAL batches aborted after an upload failed; their appends were answered with an error."),
		cacheHits: desc("cache_hits_total",
			"Reads of committed records served from the block cache."),
		cacheMisses: desc("cache_misses_total",
			"Reads of committed records that had to go to the storage."),
		buffersReused: desc("read_buffers_reused_total",
			"Data objects read by cold readers into a recycled buffer rather than fresh memory."),
		expired: desc("streams_expired_total",
			"Streams deleted for having passed their TTL or Stream-Expires-At: found by an access or by the expiry sweep."),
		requests: desc("storage_requests_total",
			"Object-store request attempts (each retry counts; file:// counts its calls) by operation and outcome.",
			"op", "outcome"),
		uploads: desc("upload_duration_seconds",
			"Duration of object-store PUT attempts, WAL uploads (object=\"wal\") apart from other objects.",
			"object"),
		busy: desc("appends_refused_busy_total",
			"Writes answered 503 at once because the appends waiting for storage already held max_pending bytes: the store is slower than the appends."),
		pending: desc("wal_pending_bytes",
			"Memory held by appends waiting for storage now: WAL entries in the open batch, uploading or waiting for an earlier upload's outcome, large appends in their own uploads, and appends queued behind a large append or a close of their stream."),
		folds: desc("compaction_folds_total",
			"Streams a compaction gave data objects of their own and a checkpoint."),
		merges: desc("compaction_merges_total",
			"Of compaction_folds_total, the folds that wrote the stream's last data object, smaller than merge_below, again with the new records as one object, and queued the old one's delete."),
		packed: desc("compaction_packed_total",
			"Streams whose new records a compaction put into a pack shared with other streams instead (see pack_below)."),
		repacked: desc("compaction_repacked_total",
			"Of compaction_packed_total, the packings that took a stream's records already in packs along with its new ones, so that it keeps one pack run instead of getting data objects of its own."),
		packsWritten: desc("packs_written_total",
			"Packs written by compactions."),
		orphanBlobs: desc("orphan_blobs_deleted_total",
			"Blobs of large appends that never committed (their node died between the blob and its WAL entry) that the sweep after a start deleted."),
		damagedWAL: desc("wal_damaged_entries_total",
			"Committed WAL entries found failing their checksum or framing when read back (each counted once): their streams are not compacted past them, the WAL is not retired past them, and reads of their records answer 500 until the object is restored."),
		damagedObjects: desc("damaged_objects_total",
			"Data objects, blobs and metadata objects found failing to decode, or data objects missing where a stream's records must be (each counted once): reads that need them answer 500 until the object is restored."),
		packsLive: desc("packs_live",
			"Packs that some stream still reads: listed in the manifest, read by a replay."),
		streamsInMemory: desc("streams_in_memory",
			"Stream handles held now: streams used in the last 30 s, and idle ones whose records wait for a compaction. An idle node holds none."),
		open: desc("storage_open",
			"1 while the storage is open; 0 before it opens, and while a start that could not reach the store, or found another node holding it, is retried (requests get 503)."),
		subLinksRefused: desc("subscription_links_refused_total",
			"Appends to a stream a subscription's pattern matches that did not link the stream, the subscription linking the most streams it may."),
		subscribers: desc("open_subscribers",
			"Live reads open now: SSE responses and long-polls, by protocol and mode.",
			"protocol", "mode"),
	}
}

// Describe implements prometheus.Collector.
func (c *storageCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{
		c.appends, c.records, c.bytes, c.flushes, c.aborted,
		c.cacheHits, c.cacheMisses, c.buffersReused, c.expired, c.requests, c.uploads, c.subscribers, c.busy, c.pending,
		c.folds, c.merges, c.packed, c.repacked, c.packsWritten, c.packsLive, c.streamsInMemory, c.orphanBlobs,
		c.damagedWAL, c.damagedObjects, c.open, c.subLinksRefused,
	} {
		ch <- d
	}
}

// Collect implements prometheus.Collector. Before the engine starts its
// totals read zero.
func (c *storageCollector) Collect(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	es, open := c.engine()
	openValue := 0.0
	if open {
		openValue = 1
	}
	ch <- prometheus.MustNewConstMetric(c.open, prometheus.GaugeValue, openValue)
	counter(c.appends, es.Appends)
	counter(c.records, es.Records)
	counter(c.bytes, es.Bytes)
	counter(c.flushes, es.WALObjects)
	counter(c.aborted, es.AbortedBatches)
	counter(c.cacheHits, es.CacheHits)
	counter(c.cacheMisses, es.CacheMisses)
	counter(c.buffersReused, es.BuffersReused)
	counter(c.expired, es.Expired)
	counter(c.busy, es.Busy)
	ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, float64(es.PendingBytes))
	counter(c.folds, es.Folds)
	counter(c.merges, es.Merges)
	counter(c.packed, es.Packed)
	counter(c.repacked, es.Repacked)
	counter(c.packsWritten, es.PacksWritten)
	counter(c.orphanBlobs, es.OrphanBlobsDeleted)
	counter(c.damagedWAL, es.DamagedWALEntries)
	counter(c.damagedObjects, es.DamagedObjects+c.metrics.subDocsDamaged.Load())
	counter(c.subLinksRefused, c.metrics.subLinksRefused.Load())
	ch <- prometheus.MustNewConstMetric(c.packsLive, prometheus.GaugeValue, float64(es.LivePacks))
	ch <- prometheus.MustNewConstMetric(c.streamsInMemory, prometheus.GaugeValue, float64(es.StreamsInMemory))

	rs := &c.metrics.requests
	for _, op := range segment.Ops {
		for _, o := range segment.Outcomes {
			counter(c.requests, rs.Requests(op, o), op.String(), o.String())
		}
	}
	for _, kind := range segment.UploadKinds {
		h := rs.Uploads(kind)
		buckets := make(map[float64]uint64, len(segment.UploadBuckets))
		for i, bound := range segment.UploadBuckets {
			buckets[bound] = h.Cumulative[i]
		}
		ch <- prometheus.MustNewConstHistogram(c.uploads, h.Count, h.Sum, buckets, kind.String())
	}
	for i, p := range metricProtocols {
		l := &c.metrics.live[i]
		for _, mode := range []string{liveSSE, liveLongPoll} {
			ch <- prometheus.MustNewConstMetric(c.subscribers, prometheus.GaugeValue,
				float64(l.counter(mode).Load()), p, mode)
		}
	}
}

// collector returns the metrics collector of the engine's storage.
func (r *engineRef) collector() *storageCollector {
	return newStorageCollector(storageLabel(r.key), func() (streamstore.StatsSnapshot, bool) {
		eng := r.eng.Load()
		if eng == nil {
			return streamstore.StatsSnapshot{}, false
		}
		return eng.Stats(), true
	}, r.metrics)
}

// registerMetrics registers the collector of ref in this config's metrics
// registry. Each config load has a registry of its own, so the same engine
// is registered once per config, never twice in one registry.
func (a *App) registerMetrics(ref *engineRef) error {
	if a.registry == nil {
		return nil
	}
	if err := a.registry.Register(ref.collector()); err != nil {
		return fmt.Errorf("registering metrics of storage %s: %w", storageLabel(ref.key), err)
	}
	return nil
}

// Interface guards.
var _ prometheus.Collector = (*storageCollector)(nil)
