package picomq

import (
	"bufio"
	"context"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/segment"
	"github.com/picomq/caddy-picomq/streamstore"
)

func TestStorageLabel(t *testing.T) {
	for _, tc := range []struct{ key, want string }{
		{"file:///var/lib/caddy/picomq/data", "file:///var/lib/caddy/picomq/data"},
		{"s3://bkt/p", "s3://bkt/p"},
		{"s3://bkt/p?path_style=true&region=eu-west-1", "s3://bkt/p?path_style=true&region=eu-west-1"},
		{"s3://bkt/p?endpoint=http%3A%2F%2F127.0.0.1%3A9000&path_style=true",
			"s3://bkt/p?endpoint=http://127.0.0.1:9000&path_style=true"},
		// Credentials never reach a label, wherever they hide.
		{"s3://AKIA:secret@bkt/p", "s3://bkt/p"},
		{"s3://bkt/p?endpoint=https%3A%2F%2Fuser%3Apass%40minio.example%3A9000", "s3://bkt/p?endpoint=https://minio.example:9000"},
		// Without "//", credentials are no user information to drop.
		{"s3://bkt/p?endpoint=AKIAEXAMPLE%3AwJalrSECRET%40minio%3A9000", "s3://bkt/p?endpoint=(hidden: it holds an '@' outside user information)"},
		{"s3://bkt/p?endpoint=http%3AAKIA%3AwJalrSECRET%40minio%3A9000", "s3://bkt/p?endpoint=(hidden: it holds an '@' outside user information)"},
	} {
		if got := storageLabel(tc.key); got != tc.want {
			t.Errorf("storageLabel(%q) = %q, want %q", tc.key, got, tc.want)
		}
	}
}

func TestLiveReaders(t *testing.T) {
	var l liveReaders
	for _, tc := range []struct {
		begin, end    []string
		sse, longPoll int64
	}{
		{begin: []string{"sse", "sse", "long-poll", ""}, sse: 2, longPoll: 1},
		{end: []string{"sse", ""}, sse: 1, longPoll: 1},
		{begin: []string{"bogus"}, end: []string{"sse", "long-poll"}, sse: 0, longPoll: 0},
	} {
		for _, m := range tc.begin {
			l.begin(m)
		}
		for _, m := range tc.end {
			l.end(m)
		}
		if l.sse.Load() != tc.sse || l.longPoll.Load() != tc.longPoll {
			t.Errorf("after %v/%v: sse %d long-poll %d, want %d and %d",
				tc.begin, tc.end, l.sse.Load(), l.longPoll.Load(), tc.sse, tc.longPoll)
		}
	}
	var none *liveReaders // handlers built without metrics
	none.begin(liveSSE)
	none.end(liveSSE)
	if (*engineMetrics)(nil).liveFor(protocolPico) != nil {
		t.Error("liveFor on nil metrics")
	}
}

// scrape gathers reg as the admin endpoint would serve it and returns every
// sample by its series ("name{labels}", labels in the order printed).
func scrape(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	rec := httptest.NewRecorder()
	promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.HTTPErrorOnError}).
		ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	if rec.Code != 200 {
		t.Fatalf("scrape: %d %s", rec.Code, rec.Body)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(rec.Body)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("scrape: bad line %q", line)
		}
		out[line[:i]] = v
	}
	return out
}

func TestStorageCollector(t *testing.T) {
	m := new(engineMetrics)
	store, err := openStore("file://"+t.TempDir(), time.Second, &m.requests, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := store.Put(ctx, "wal/0000/0000", []byte("x"), segment.PutOptions{IfNoneMatch: true}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := store.Get(ctx, "missing", 0, -1); err == nil {
		t.Fatal("get of a missing key succeeded")
	}
	m.liveFor(protocolPico).begin(liveSSE)
	m.liveFor(protocolDurableStreams).begin(liveLongPoll)
	m.liveFor(protocolDurableStreams).begin(liveLongPoll)
	snap := streamstore.StatsSnapshot{Appends: 3, Records: 5, Bytes: 42, WALObjects: 2, CacheHits: 7, CacheMisses: 1, Expired: 4,
		Folds: 6, Merges: 5, Packed: 9, PacksWritten: 2, LivePacks: 1, StreamsInMemory: 11, OrphanBlobsDeleted: 13}
	m.subLinksRefused.Add(3)
	c := newStorageCollector("file:///x", func() (streamstore.StatsSnapshot, bool) { return snap, true }, m)

	// Caddy's registries are pedantic: they check that every metric
	// collected was described.
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(c); err != nil {
		t.Fatal(err)
	}
	got := scrape(t, reg)
	const s = `storage="file:///x"`
	for _, tc := range []struct {
		series string
		want   float64
	}{
		{`picomq_appends_total{` + s + `}`, 3},
		{`picomq_appended_records_total{` + s + `}`, 5},
		{`picomq_appended_bytes_total{` + s + `}`, 42},
		{`picomq_wal_flushes_total{` + s + `}`, 2},
		{`picomq_wal_aborted_batches_total{` + s + `}`, 0},
		{`picomq_cache_hits_total{` + s + `}`, 7},
		{`picomq_cache_misses_total{` + s + `}`, 1},
		{`picomq_streams_expired_total{` + s + `}`, 4},
		{`picomq_compaction_folds_total{` + s + `}`, 6},
		{`picomq_compaction_merges_total{` + s + `}`, 5},
		{`picomq_compaction_packed_total{` + s + `}`, 9},
		{`picomq_packs_written_total{` + s + `}`, 2},
		{`picomq_orphan_blobs_deleted_total{` + s + `}`, 13},
		{`picomq_packs_live{` + s + `}`, 1},
		{`picomq_streams_in_memory{` + s + `}`, 11},
		{`picomq_storage_open{` + s + `}`, 1},
		{`picomq_storage_requests_total{op="put",outcome="ok",` + s + `}`, 1},
		{`picomq_storage_requests_total{op="get",outcome="not_found",` + s + `}`, 1},
		{`picomq_storage_requests_total{op="list",outcome="error",` + s + `}`, 0},
		{`picomq_upload_duration_seconds_count{object="wal",` + s + `}`, 1},
		{`picomq_upload_duration_seconds_bucket{object="wal",` + s + `,le="+Inf"}`, 1},
		{`picomq_upload_duration_seconds_count{object="other",` + s + `}`, 0},
		{`picomq_subscription_links_refused_total{` + s + `}`, 3},
		{`picomq_open_subscribers{mode="sse",protocol="pico",` + s + `}`, 1},
		{`picomq_open_subscribers{mode="long-poll",protocol="durable-streams",` + s + `}`, 2},
		{`picomq_open_subscribers{mode="sse",protocol="durable-streams",` + s + `}`, 0},
	} {
		v, ok := got[tc.series]
		if !ok {
			t.Errorf("%s missing from the scrape", tc.series)
			continue
		}
		if v != tc.want {
			t.Errorf("%s = %v, want %v", tc.series, v, tc.want)
		}
	}
	if n := len(got); n < 40 {
		t.Errorf("only %d series scraped", n)
	}
}

// TestMetricsAcrossReload follows a reload: each config registers the
// shared engine in its own registry without a clash, and the counters the
// new config shows continue the old ones.
func TestMetricsAcrossReload(t *testing.T) {
	storage := testStorage(t)
	settings := testSettings()
	ctx := context.Background()
	series := `picomq_appends_total{storage="` + storageLabel(mustStorageKey(t, storage)) + `"}`

	app1 := newTestApp(t)
	app1.registry = prometheus.NewPedanticRegistry()
	ref, err := app1.acquire(storage, settings)
	if err != nil {
		t.Fatal(err)
	}
	if got := scrape(t, app1.registry)[series]; got != 0 {
		t.Errorf("before start %s = %v", series, got)
	}
	if err := app1.Start(); err != nil {
		t.Fatal(err)
	}
	eng, err := ref.engine(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	appendOne := func() {
		t.Helper()
		if _, err := eng.Append(ctx, "/s", streamstore.AppendRequest{ContentType: "text/plain",
			Records: []streamstore.NewRecord{{Body: []byte("x")}}}); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := eng.Create(ctx, "/s", streamstore.CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	appendOne()
	appendOne()

	app2 := newTestApp(t)
	app2.registry = prometheus.NewPedanticRegistry()
	if _, err := app2.acquire(storage, settings); err != nil {
		t.Fatalf("second config on the same storage: %v", err)
	}
	if err := app2.Start(); err != nil {
		t.Fatal(err)
	}
	for i, reg := range []*prometheus.Registry{app1.registry, app2.registry} {
		if got := scrape(t, reg)[series]; got != 2 {
			t.Errorf("config %d: %s = %v, want 2", i+1, series, got)
		}
	}
	if err := app1.Cleanup(); err != nil {
		t.Fatal(err)
	}
	appendOne()
	if got := scrape(t, app2.registry)[series]; got != 3 {
		t.Errorf("after the old config's cleanup %s = %v, want 3", series, got)
	}
	// One registry takes a storage's collector once: a second would clash.
	if err := app2.registerMetrics(ref); err == nil {
		t.Error("registering a storage twice in one registry succeeded")
	}
	if err := app2.Cleanup(); err != nil {
		t.Fatal(err)
	}
}

func mustStorageKey(t *testing.T, raw string) string {
	t.Helper()
	k, err := storageKey(raw)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// TestMetricHelpNamesOnlySettings reads every metric's help text, which an
// operator sees on the metrics endpoint: a setting it names must be one the
// Caddyfile has, not an engine field the module never exposes, and another
// metric it names must exist.
func TestMetricHelpNamesOnlySettings(t *testing.T) {
	c := newStorageCollector("file:///x", func() (streamstore.StatsSnapshot, bool) { return streamstore.StatsSnapshot{}, true }, nil)
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(c); err != nil {
		t.Fatal(err)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	known := make(map[string]bool)
	for opt := range caddyfileOptions {
		known[opt] = true
	}
	for _, f := range families {
		known[strings.TrimPrefix(f.GetName(), "picomq_")] = true
	}
	// snake_case words: settings and metric names, never prose.
	word := regexp.MustCompile(`\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b`)
	for _, f := range families {
		for _, w := range word.FindAllString(f.GetHelp(), -1) {
			if !known[w] {
				t.Errorf("%s: help names %q, which is neither a picomq subdirective nor a metric: %q", f.GetName(), w, f.GetHelp())
			}
		}
	}
}
