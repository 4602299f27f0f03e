package integration

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// mSample is one sample of a Prometheus text exposition.
type mSample struct {
	name   string
	labels map[string]string
	value  float64
}

// mScrape is one scrape of the admin endpoint's /metrics.
type mScrape []mSample

// sum adds the samples of name whose labels include every pair of match.
func (s mScrape) sum(name string, match ...string) float64 {
	var total float64
	for _, x := range s {
		if x.name != name {
			continue
		}
		ok := true
		for i := 0; i+1 < len(match); i += 2 {
			if x.labels[match[i]] != match[i+1] {
				ok = false
				break
			}
		}
		if ok {
			total += x.value
		}
	}
	return total
}

// has reports whether any sample is named name.
func (s mScrape) has(name string) bool {
	for _, x := range s {
		if x.name == name {
			return true
		}
	}
	return false
}

// labelValues returns the distinct values of label on samples named with
// prefix.
func (s mScrape) labelValues(prefix, label string) []string {
	seen := map[string]bool{}
	for _, x := range s {
		if strings.HasPrefix(x.name, prefix) {
			seen[x.labels[label]] = true
		}
	}
	var out []string
	for v := range seen {
		out = append(out, v)
	}
	sort.Strings(out)
	return out
}

// mParseLine parses `name{k="v",...} value` (labels optional).
func mParseLine(line string) (mSample, error) {
	s := mSample{labels: map[string]string{}}
	i := strings.IndexAny(line, "{ ")
	if i < 0 {
		return s, fmt.Errorf("no value in %q", line)
	}
	s.name = line[:i]
	rest := line[i:]
	if rest[0] == '{' {
		rest = rest[1:]
		for {
			if rest == "" {
				return s, fmt.Errorf("unterminated labels in %q", line)
			}
			if rest[0] == '}' {
				rest = rest[1:]
				break
			}
			if rest[0] == ',' {
				rest = rest[1:]
				continue
			}
			eq := strings.Index(rest, `="`)
			if eq < 0 {
				return s, fmt.Errorf("bad label in %q", line)
			}
			key := rest[:eq]
			rest = rest[eq+2:]
			var val strings.Builder
			for {
				if rest == "" {
					return s, fmt.Errorf("unterminated label value in %q", line)
				}
				c := rest[0]
				rest = rest[1:]
				if c == '\\' && rest != "" {
					switch rest[0] {
					case 'n':
						val.WriteByte('\n')
					default:
						val.WriteByte(rest[0])
					}
					rest = rest[1:]
					continue
				}
				if c == '"' {
					break
				}
				val.WriteByte(c)
			}
			s.labels[key] = val.String()
		}
	}
	fields := strings.Fields(rest)
	if len(fields) == 0 {
		return s, fmt.Errorf("no value in %q", line)
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil {
		return s, fmt.Errorf("bad value in %q: %v", line, err)
	}
	s.value = v
	return s, nil
}

// mGet scrapes the admin endpoint at addr.
func mGet(addr string) (mScrape, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return nil, fmt.Errorf("GET /metrics: %d %s", resp.StatusCode, b)
	}
	var out mScrape
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		s, err := mParseLine(line)
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, sc.Err()
}

func mMust(t *testing.T, addr string) mScrape {
	t.Helper()
	s, err := mGet(addr)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// mProxyOps maps the module's op label to the proxy's operation names.
var mProxyOps = map[string]string{
	"put": testenv.OpPut, "get": testenv.OpGet, "head": testenv.OpHead,
	"list": testenv.OpList, "delete": testenv.OpDelete,
}

func mProxyCount(c testenv.Counts, op string) int {
	switch op {
	case testenv.OpPut:
		return c.Put
	case testenv.OpGet:
		return c.Get
	case testenv.OpHead:
		return c.Head
	case testenv.OpList:
		return c.List
	case testenv.OpDelete:
		return c.Delete
	}
	return c.Other
}

// mCheckRequests waits until the module's request counts, by operation,
// equal what the proxy saw, with the proxy quiet across the scrape (the
// lease renewal runs on its own clock, and the proxy counts a request when
// it arrives, the module when its answer is in). It returns the last
// scrape.
func mCheckRequests(t *testing.T, c *caddytest.Caddy, p *testenv.Proxy) mScrape {
	t.Helper()
	var last mScrape
	err := fhWaitFor(20*time.Second, 100*time.Millisecond, func() error {
		before := p.Counts()
		s, err := mGet(c.AdminAddr())
		if err != nil {
			return err
		}
		after := p.Counts()
		last = s
		if before.Total() != after.Total() {
			return fmt.Errorf("the proxy saw requests during the scrape")
		}
		var diffs []string
		for op, pop := range mProxyOps {
			mod := s.sum("picomq_storage_requests_total", "op", op)
			if int(mod) != mProxyCount(after, pop) {
				diffs = append(diffs, fmt.Sprintf("%s: module %v, proxy %d", op, mod, mProxyCount(after, pop)))
			}
		}
		if wal := s.sum("picomq_upload_duration_seconds_count", "object", "wal"); int(wal) != after.PutsUnder(fhPrefix+"wal/") {
			diffs = append(diffs, fmt.Sprintf("WAL uploads timed %v, proxy saw %d WAL PUTs", wal, after.PutsUnder(fhPrefix+"wal/")))
		}
		if after.Other != 0 {
			diffs = append(diffs, fmt.Sprintf("%d requests of other kinds", after.Other))
		}
		if len(diffs) > 0 {
			sort.Strings(diffs)
			return fmt.Errorf("%s", strings.Join(diffs, "; "))
		}
		return nil
	})
	if err != nil {
		t.Fatalf("storage requests in /metrics vs the S3 proxy: %v", err)
	}
	return last
}

// mCaddyfile serves both protocols on one storage: Durable Streams under
// /ds/ and Pico under /pico/.
func mCaddyfile(storage, extra string) string {
	block := fmt.Sprintf("storage %q\n\t\t\tcompact_interval 1h\n\t\t\t%s", storage, extra)
	return fmt.Sprintf(`{
	admin {$%s}
	persist_config off
}

http://:{$%s} {
	bind 127.0.0.1
	handle_path /ds/* {
		picomq {
			%s
		}
	}
	handle_path /pico/* {
		picomq {
			protocol pico
			%s
		}
	}
}
`, caddytest.AdminEnv, caddytest.PortEnv, block, block)
}

// mLive opens a live read and returns once its response has started; cancel
// closes it.
func mLive(t *testing.T, url string) (cancel func(), first <-chan error) {
	t.Helper()
	ctx, cancelCtx := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			done <- err
			return
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			done <- err
			return
		}
		defer resp.Body.Close()
		if resp.StatusCode/100 != 2 {
			done <- fmt.Errorf("GET %s: %d", url, resp.StatusCode)
			return
		}
		done <- nil
		io.Copy(io.Discard, resp.Body)
	}()
	return cancelCtx, done
}

// TestMetrics drives both protocols on one storage and checks the figures
// the admin endpoint's /metrics reports: appends and bytes as acknowledged,
// storage requests exactly as the S3 proxy counted them, open subscribers
// while live reads are open, cache hits, and counters that survive a reload.
func TestMetrics(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	v := testenv.NewVersity(t)
	p := newProxy(t, v)
	storage := testenv.StoreURL(p.URL(), v.NewBucket(t), caddytest.S3Prefix)
	c := caddytest.Start(t, caddytest.Options{
		Caddyfile: mCaddyfile(storage, "long_poll_timeout 20s"),
		Env:       caddytest.S3Env(v),
	})
	e := &fhEnv{t: t, v: v, proxy: p, caddy: c, client: &http.Client{Timeout: time.Minute}}
	const ds, pico = "/ds/m", "/pico/m"
	e.create(ds, textPlain)

	// Appends through both protocols: Durable Streams one record each, a
	// Pico batch of three records counting as one append.
	appends, records, bytes := 0, 0, 0
	for i := 0; i < 20; i++ {
		body := strings.Repeat("x", 1+i*7)
		e.append(ds, textPlain, []byte(body))
		appends, records, bytes = appends+1, records+1, bytes+len(body)
	}
	batch := `{"records":[{"body":"one"},{"body":"two2"},{"body_b64":"AAEC"}]}`
	resp := e.must(fhReq{Method: http.MethodPost, Path: pico, Body: []byte(batch),
		Header: map[string]string{"Content-Type": "application/vnd.picomq.batch+json"}})
	if resp.Status/100 != 2 {
		t.Fatalf("Pico batch append: %s", resp)
	}
	appends, records, bytes = appends+1, records+3, bytes+3+4+3

	// A stream that outlived its TTL is deleted by the read that finds it.
	if r := e.must(fhReq{Method: http.MethodPut, Path: "/ds/ttl", Header: map[string]string{"Content-Type": textPlain, "Stream-TTL": "1"}}); r.Status != http.StatusCreated {
		t.Fatalf("PUT /ds/ttl: %s", r)
	}
	time.Sleep(1100 * time.Millisecond)
	if r := e.must(fhReq{Method: http.MethodGet, Path: "/ds/ttl?offset=-1"}); r.Status != http.StatusNotFound {
		t.Fatalf("GET of a stream past its TTL: %s, want 404", r)
	}

	// Repeated reads: fresh records are in the cache.
	for i := 0; i < 2; i++ {
		if _, _, err := e.readBytes(ds); err != nil {
			t.Fatal(err)
		}
	}

	s := mMust(t, c.AdminAddr())
	labels := s.labelValues("picomq_", "storage")
	if len(labels) != 1 || !strings.Contains(labels[0], "s3://") || strings.Contains(labels[0], v.SecretKey) ||
		strings.Contains(labels[0], v.AccessKey) {
		t.Errorf("storage labels %q, want one s3:// location without credentials", labels)
	}
	for _, tc := range []struct {
		name string
		want float64
	}{
		{"picomq_appends_total", float64(appends)},
		{"picomq_appended_records_total", float64(records)},
		{"picomq_appended_bytes_total", float64(bytes)},
		{"picomq_wal_aborted_batches_total", 0},
		{"picomq_streams_expired_total", 1},
		{"picomq_open_subscribers", 0},
	} {
		if got := s.sum(tc.name); got != tc.want {
			t.Errorf("%s = %v, want %v", tc.name, got, tc.want)
		}
	}
	flushes := s.sum("picomq_wal_flushes_total")
	if flushes < 1 || flushes > float64(appends) {
		t.Errorf("picomq_wal_flushes_total = %v, want between 1 and %d (the appends went one at a time)", flushes, appends)
	}
	if hits := s.sum("picomq_cache_hits_total"); hits < 1 {
		t.Errorf("picomq_cache_hits_total = %v after repeated reads of fresh records", hits)
	}
	for _, name := range []string{"picomq_cache_misses_total", "picomq_upload_duration_seconds_bucket", "caddy_config_last_reload_successful"} {
		if !s.has(name) {
			t.Errorf("%s missing from /metrics", name)
		}
	}
	s = mCheckRequests(t, c, p)
	t.Logf("after %d appends (%d records, %d bytes) and two reads: %v WAL flushes, %v PUTs, %v GETs, %v LISTs, %v HEADs, cache hits %v misses %v",
		appends, records, bytes, s.sum("picomq_wal_flushes_total"), s.sum("picomq_storage_requests_total", "op", "put"),
		s.sum("picomq_storage_requests_total", "op", "get"), s.sum("picomq_storage_requests_total", "op", "list"),
		s.sum("picomq_storage_requests_total", "op", "head"),
		s.sum("picomq_cache_hits_total"), s.sum("picomq_cache_misses_total"))
	if puts := s.sum("picomq_storage_requests_total", "op", "put", "outcome", "ok"); puts < flushes {
		t.Errorf("%v successful PUTs for %v WAL flushes", puts, flushes)
	}

	// Open subscribers: an SSE reader, then one of each protocol and mode.
	gauge := func(want float64, match ...string) error {
		s, err := mGet(c.AdminAddr())
		if err != nil {
			return err
		}
		if got := s.sum("picomq_open_subscribers", match...); got != want {
			return fmt.Errorf("picomq_open_subscribers%v = %v, want %v", match, got, want)
		}
		return nil
	}
	closeSSE, started := mLive(t, c.URL()+ds+"?offset=-1&live=sse")
	if err := <-started; err != nil {
		t.Fatal(err)
	}
	if err := gauge(1); err != nil {
		t.Error(err)
	}
	if err := gauge(1, "protocol", "durable-streams", "mode", "sse"); err != nil {
		t.Error(err)
	}
	closeSSE()
	if err := fhWaitFor(10*time.Second, 50*time.Millisecond, func() error { return gauge(0) }); err != nil {
		t.Errorf("after the SSE reader left: %v", err)
	}

	closePicoSSE, started := mLive(t, c.URL()+pico+"?seq=0&live=sse")
	if err := <-started; err != nil {
		t.Fatal(err)
	}
	closePoll, polled := mLive(t, c.URL()+ds+"?offset=now&live=long-poll")
	defer closePoll()
	if err := fhWaitFor(10*time.Second, 50*time.Millisecond, func() error {
		if err := gauge(1, "protocol", "pico", "mode", "sse"); err != nil {
			return err
		}
		return gauge(1, "protocol", "durable-streams", "mode", "long-poll")
	}); err != nil {
		t.Errorf("with a Pico SSE reader and a long-poll open: %v", err)
	}
	e.append(ds, textPlain, []byte("wake"))
	appends, records, bytes = appends+1, records+1, bytes+4
	if err := <-polled; err != nil {
		t.Errorf("long-poll: %v", err)
	}
	closePicoSSE()
	if err := fhWaitFor(10*time.Second, 50*time.Millisecond, func() error { return gauge(0) }); err != nil {
		t.Errorf("after every live read ended: %v", err)
	}

	// Retries count per attempt: two throttled WAL uploads, then success.
	s = mCheckRequests(t, c, p)
	remove := p.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Status: http.StatusServiceUnavailable, Times: 2})
	e.append(ds, textPlain, []byte("retried"))
	remove()
	appends, records, bytes = appends+1, records+1, bytes+7
	before := mCheckRequests(t, c, p)
	if d := before.sum("picomq_storage_requests_total", "op", "put", "outcome", "error") -
		s.sum("picomq_storage_requests_total", "op", "put", "outcome", "error"); d != 2 {
		t.Errorf("two throttled WAL uploads counted as %v failed PUT attempts", d)
	}

	// A reload: a new registry, the same engine, the same counters.
	if err := c.Reload(mCaddyfile(storage, "long_poll_timeout 10s")); err != nil {
		t.Fatal(err)
	}
	if err := fhWaitFor(10*time.Second, 50*time.Millisecond, func() error {
		_, err := mGet(c.AdminAddr())
		return err
	}); err != nil {
		t.Fatalf("/metrics after the reload: %v", err)
	}
	e.append(ds, textPlain, []byte("after"))
	appends, records, bytes = appends+1, records+1, bytes+5
	after := mCheckRequests(t, c, p)
	for _, tc := range []struct {
		name string
		want float64
	}{
		{"picomq_appends_total", float64(appends)},
		{"picomq_appended_records_total", float64(records)},
		{"picomq_appended_bytes_total", float64(bytes)},
		{"picomq_open_subscribers", 0},
	} {
		if got := after.sum(tc.name); got != tc.want {
			t.Errorf("after the reload: %s = %v, want %v", tc.name, got, tc.want)
		}
	}
	for _, name := range []string{"picomq_wal_flushes_total", "picomq_storage_requests_total", "picomq_cache_hits_total"} {
		if a, b := after.sum(name), before.sum(name); a < b {
			t.Errorf("after the reload: %s went back from %v to %v", name, b, a)
		}
	}
	if a, b := after.sum("picomq_wal_flushes_total"), before.sum("picomq_wal_flushes_total"); a <= b {
		t.Errorf("picomq_wal_flushes_total did not move with an append after the reload (%v, then %v)", b, a)
	}
	if logs := c.Logs(); strings.Contains(logs, "duplicate metrics collector") || strings.Contains(logs, "registering metrics") {
		t.Errorf("metrics registration errors in the log")
	}
	t.Logf("after the reload: %v appends, %v WAL flushes, %v storage requests",
		after.sum("picomq_appends_total"), after.sum("picomq_wal_flushes_total"), after.sum("picomq_storage_requests_total"))
}
