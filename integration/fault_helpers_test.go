package integration

// Helpers of the object-store fault, bad-input, cache, compaction and group
// commit tests. Every name here starts with "fh" so that it cannot collide
// with the helpers of the other integration tests in this package.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// fhPrefix is where the module's objects live inside the test bucket: the
// storage URL is s3://BUCKET/picomq, so every key starts with it.
const fhPrefix = caddytest.S3Prefix + "/"

// Keys the engine writes on its own clock, whatever the requests: the
// storage lease (renewed every third of its lifetime) and the manifest
// (rewritten by every compaction pass).
const (
	fhLeaseKey    = fhPrefix + "lease"
	fhManifestKey = fhPrefix + "manifest"
)

// fhEnv is one Caddy child with the picomq module, storing into a fresh
// versitygw bucket through a counting, fault-injecting S3 proxy.
type fhEnv struct {
	t      testing.TB
	v      *testenv.Versity
	proxy  *testenv.Proxy
	bucket string
	caddy  *caddytest.Caddy
	client *http.Client
	// directives are those the instance runs with (after dropping
	// optional ones this build does not know).
	directives []string
}

// fhOptions describe the instance fhStart brings up.
type fhOptions struct {
	// Directives go into the picomq block; a build that rejects one fails
	// the test.
	Directives []string
	// Optional directives are used when the module knows them and dropped,
	// with a log line, when Caddy refuses them as unrecognized. They are
	// for settings that only make a test quieter (such as a long
	// compact_interval), never for what a test asserts.
	Optional []string
	// Client is the HTTP client for requests to Caddy; nil gives one with
	// a 2-minute timeout.
	Client *http.Client
	// TLS serves versitygw over HTTPS, its authority given to Caddy in
	// AWS_CA_BUNDLE, and points Caddy straight at it: the proxy speaks
	// plain HTTP, so there is none (proxy is nil: no counts, no faults).
	TLS bool
}

// fhStart starts versitygw, a proxy in front of it, and Caddy on a fresh
// bucket reached through the proxy (with o.TLS, versitygw over HTTPS and
// no proxy). Everything is stopped and removed when the test ends.
func fhStart(t testing.TB, o fhOptions) *fhEnv {
	t.Helper()
	var v *testenv.Versity
	var p *testenv.Proxy
	endpoint := ""
	if o.TLS {
		v = testenv.NewVersityTLS(t)
		endpoint = v.Endpoint
	} else {
		v = testenv.NewVersity(t)
		var err error
		if p, err = testenv.NewProxy(v.Endpoint); err != nil {
			t.Fatalf("S3 proxy: %v", err)
		}
		t.Cleanup(func() { p.Close() })
		endpoint = p.URL()
	}
	bucket := v.NewBucket(t)
	e := &fhEnv{t: t, v: v, proxy: p, bucket: bucket, client: o.Client}
	if e.client == nil {
		e.client = &http.Client{Timeout: 2 * time.Minute}
	}
	e.directives = append(append([]string(nil), o.Directives...), o.Optional...)
	for attempt := 0; attempt <= len(o.Optional); attempt++ {
		c, err := caddytest.Launch(t, caddytest.Options{
			Storage:    testenv.StoreURL(endpoint, bucket, caddytest.S3Prefix),
			Directives: e.directives,
			Env:        caddytest.S3Env(v),
		})
		if err == nil {
			e.caddy = c
			return e
		}
		dropped := false
		for _, opt := range o.Optional {
			name, _, _ := strings.Cut(opt, " ")
			// The reason comes from Caddy's JSON log, quotes escaped.
			msg := strings.ReplaceAll(err.Error(), `\"`, `"`)
			if strings.Contains(msg, fmt.Sprintf("unrecognized picomq option %q", name)) {
				t.Logf("this build does not know the optional directive %q; running without it", name)
				e.directives = slices.DeleteFunc(e.directives, func(d string) bool { return d == opt })
				dropped = true
			}
		}
		if !dropped {
			t.Fatalf("caddytest: %v", err)
		}
	}
	t.Fatal("caddytest: could not start Caddy")
	return nil
}

// fhResp is an HTTP response read in full.
type fhResp struct {
	Status int
	Header http.Header
	Body   []byte
	Took   time.Duration
}

func (r fhResp) String() string {
	return fmt.Sprintf("%d %q", r.Status, fhClip(string(r.Body), 300))
}

// fhReq describes one request to Caddy. Path is sent as written (dot
// segments and escapes included).
type fhReq struct {
	Method  string
	Path    string
	Header  map[string]string
	Body    []byte
	Chunked bool // send the body without Content-Length
	// More are header lines added after Header's, so that a name can be
	// sent twice.
	More [][2]string
}

// send performs r and reads the whole response.
func (e *fhEnv) send(r fhReq) (fhResp, error) {
	return fhSend(e.client, e.caddy.URL(), r)
}

func fhSend(client *http.Client, base string, r fhReq) (fhResp, error) {
	var body io.Reader
	if r.Body != nil {
		body = bytes.NewReader(r.Body)
	}
	req, err := http.NewRequest(r.Method, base+r.Path, body)
	if err != nil {
		return fhResp{}, err
	}
	if r.Chunked && r.Body != nil {
		req.Body = io.NopCloser(bytes.NewReader(r.Body))
		req.ContentLength = -1
		req.GetBody = nil
	}
	for k, v := range r.Header {
		req.Header.Set(k, v)
	}
	for _, kv := range r.More {
		req.Header.Add(kv[0], kv[1])
	}
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return fhResp{Took: time.Since(start)}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	out := fhResp{Status: resp.StatusCode, Header: resp.Header, Body: b, Took: time.Since(start)}
	if err != nil {
		return out, fmt.Errorf("%s %s: reading body: %w", r.Method, r.Path, err)
	}
	return out, nil
}

// must performs r and fails the test on a transport error.
func (e *fhEnv) must(r fhReq) fhResp {
	e.t.Helper()
	resp, err := e.send(r)
	if err != nil {
		e.t.Fatalf("%s %s: %v", r.Method, r.Path, err)
	}
	return resp
}

// create creates a stream and fails the test unless it answers 201.
func (e *fhEnv) create(path, contentType string) {
	e.t.Helper()
	resp := e.must(fhReq{Method: http.MethodPut, Path: path, Header: map[string]string{"Content-Type": contentType}})
	if resp.Status != http.StatusCreated {
		e.t.Fatalf("PUT %s: %s, want 201", path, resp)
	}
}

// append posts body and fails the test unless it is acknowledged (2xx).
// It returns the Stream-Next-Offset of the answer.
func (e *fhEnv) append(path, contentType string, body []byte) string {
	e.t.Helper()
	resp := e.must(fhReq{Method: http.MethodPost, Path: path, Header: map[string]string{"Content-Type": contentType}, Body: body})
	if resp.Status/100 != 2 {
		e.t.Fatalf("POST %s: %s, want 2xx", path, resp)
	}
	off := resp.Header.Get("Stream-Next-Offset")
	if off == "" {
		e.t.Fatalf("POST %s: %d without Stream-Next-Offset", path, resp.Status)
	}
	return off
}

// heapAlloc returns the Go heap of Caddy: go_memstats_heap_alloc_bytes of
// its admin /metrics. With gc, two collections run first (asked for
// through the admin's /debug/pprof/heap?gc=1), so the heap is what is
// live: the second empties what sync.Pools kept through the first.
func (e *fhEnv) heapAlloc(gc bool) float64 {
	e.t.Helper()
	admin := "http://" + e.caddy.AdminAddr()
	for i := 0; gc && i < 2; i++ {
		r, err := fhSend(e.client, admin, fhReq{Method: http.MethodGet, Path: "/debug/pprof/heap?gc=1"})
		if err != nil || r.Status != http.StatusOK {
			e.t.Fatalf("admin /debug/pprof/heap?gc=1: %v %s", err, r)
		}
	}
	r, err := fhSend(e.client, admin, fhReq{Method: http.MethodGet, Path: "/metrics"})
	if err != nil || r.Status != http.StatusOK {
		e.t.Fatalf("admin /metrics: %v %s", err, r)
	}
	for _, line := range strings.Split(string(r.Body), "\n") {
		if v, ok := strings.CutPrefix(line, "go_memstats_heap_alloc_bytes "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				e.t.Fatalf("go_memstats_heap_alloc_bytes %q: %v", v, err)
			}
			return f
		}
	}
	e.t.Fatal("admin /metrics has no go_memstats_heap_alloc_bytes")
	return 0
}

// allocTotal returns the bytes Caddy has allocated on its Go heap since it
// started (go_memstats_alloc_bytes_total of its admin /metrics): what a
// request churns through, where heapAlloc shows only what it keeps.
func (e *fhEnv) allocTotal() float64 {
	e.t.Helper()
	admin := "http://" + e.caddy.AdminAddr()
	r, err := fhSend(e.client, admin, fhReq{Method: http.MethodGet, Path: "/metrics"})
	if err != nil || r.Status != http.StatusOK {
		e.t.Fatalf("admin /metrics: %v %s", err, r)
	}
	for _, line := range strings.Split(string(r.Body), "\n") {
		if v, ok := strings.CutPrefix(line, "go_memstats_alloc_bytes_total "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				e.t.Fatalf("go_memstats_alloc_bytes_total %q: %v", v, err)
			}
			return f
		}
	}
	e.t.Fatal("admin /metrics has no go_memstats_alloc_bytes_total")
	return 0
}

// fhMaxReads bounds the catch-up requests of one full read.
const fhMaxReads = 10000

// readFrom reads a stream from offset to its tail with catch-up reads and
// returns the bodies of every response, in order, and the final
// Stream-Next-Offset.
func (e *fhEnv) readFrom(path, offset string) (chunks [][]byte, next string, err error) {
	for i := 0; i < fhMaxReads; i++ {
		resp, err := e.send(fhReq{Method: http.MethodGet, Path: path + "?offset=" + url.QueryEscape(offset)})
		if err != nil {
			return nil, "", err
		}
		if resp.Status != http.StatusOK {
			return nil, "", fmt.Errorf("GET %s?offset=%s: %s", path, offset, resp)
		}
		n := resp.Header.Get("Stream-Next-Offset")
		if n == "" {
			return nil, "", fmt.Errorf("GET %s?offset=%s: 200 without Stream-Next-Offset", path, offset)
		}
		chunks = append(chunks, resp.Body)
		if resp.Header.Get("Stream-Up-To-Date") == "true" {
			return chunks, n, nil
		}
		if n == offset {
			return nil, "", fmt.Errorf("GET %s?offset=%s: not up to date, but the offset did not move", path, offset)
		}
		offset = n
	}
	return nil, "", fmt.Errorf("GET %s: not up to date after %d reads", path, fhMaxReads)
}

// readBytes reads a whole byte stream and returns its content and tail.
func (e *fhEnv) readBytes(path string) ([]byte, string, error) {
	chunks, next, err := e.readFrom(path, "-1")
	if err != nil {
		return nil, "", err
	}
	return bytes.Join(chunks, nil), next, nil
}

// readJSON reads a whole application/json stream and returns its messages
// and tail.
func (e *fhEnv) readJSON(path string) ([]json.RawMessage, string, error) {
	chunks, next, err := e.readFrom(path, "-1")
	if err != nil {
		return nil, "", err
	}
	var msgs []json.RawMessage
	for _, c := range chunks {
		var part []json.RawMessage
		if err := json.Unmarshal(c, &part); err != nil {
			return nil, "", fmt.Errorf("GET %s: body is not a JSON array: %v: %q", path, err, fhClip(string(c), 200))
		}
		msgs = append(msgs, part...)
	}
	return msgs, next, nil
}

// fhObject is one object in the bucket, with its key relative to fhPrefix.
type fhObject struct {
	Key  string
	Size int64
}

// list lists the module's objects under prefix (relative to the storage
// prefix, e.g. "wal/") straight from versitygw, so the proxy's counts stay
// untouched.
func (e *fhEnv) list(prefix string) ([]fhObject, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out []fhObject
	pg := s3.NewListObjectsV2Paginator(e.v.Client(), &s3.ListObjectsV2Input{
		Bucket: aws.String(e.bucket),
		Prefix: aws.String(fhPrefix + prefix),
	})
	for pages := 0; pg.HasMorePages(); pages++ {
		if pages > 1000 {
			return nil, errors.New("listing did not end after 1000 pages")
		}
		page, err := pg.NextPage(ctx)
		if err != nil {
			return nil, fmt.Errorf("list %s: %w", prefix, err)
		}
		for _, o := range page.Contents {
			out = append(out, fhObject{Key: strings.TrimPrefix(aws.ToString(o.Key), fhPrefix), Size: aws.ToInt64(o.Size)})
		}
	}
	return out, nil
}

// mustList is list failing the test on error.
func (e *fhEnv) mustList(prefix string) []fhObject {
	e.t.Helper()
	objs, err := e.list(prefix)
	if err != nil {
		e.t.Fatal(err)
	}
	return objs
}

// waitGone waits, up to fhCompactWait, until no object is left under prefix:
// "wal/" once compaction has folded the WAL, "pack/" once packs are
// retired. The error names what is still there.
func (e *fhEnv) waitGone(prefix string) error {
	e.t.Helper()
	return fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
		if objs := e.mustList(prefix); len(objs) > 0 {
			return fmt.Errorf("%d objects left under %s, e.g. %s", len(objs), prefix, objs[0].Key)
		}
		return nil
	})
}

// reload replaces the instance's configuration and drops the client's idle
// connections: the old server closes them as it shuts down, and a POST sent
// on one in that moment meets EOF, which net/http does not retry for a
// request that is not idempotent.
func (e *fhEnv) reload(caddyfile string) error {
	e.t.Helper()
	err := e.caddy.Reload(caddyfile)
	e.client.CloseIdleConnections()
	return err
}

// fhKeySet returns the keys of objs as a set.
func fhKeySet(objs []fhObject) map[string]bool {
	m := make(map[string]bool, len(objs))
	for _, o := range objs {
		m[o.Key] = true
	}
	return m
}

// get reads one object (key relative to the storage prefix) straight from
// versitygw.
func (e *fhEnv) get(key string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := e.v.Client().GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(fhPrefix + key)})
	if err != nil {
		return nil, fmt.Errorf("get %s: %w", key, err)
	}
	defer out.Body.Close()
	return io.ReadAll(out.Body)
}

// isGrave reports whether a stream's metadata key holds the grave a
// delete leaves there rather than a stream's metadata.
func isGrave(body []byte) bool { return bytes.HasPrefix(body, []byte(`{"grave":`)) }

// fhWriteOps are the proxy operations that change the bucket.
var fhWriteOps = []string{testenv.OpPut, testenv.OpDelete, testenv.OpOther}

// fhWrites returns the writes between two proxy snapshots as
// "OP key" → requests, leaving out the storage lease, which the engine
// renews on its own clock whatever the requests.
func fhWrites(before, after testenv.Counts) map[string]int {
	out := map[string]int{}
	for _, op := range fhWriteOps {
		b := before.Keys(op)
		for k, n := range after.Keys(op) {
			if k == fhLeaseKey {
				continue
			}
			if d := n - b[k]; d > 0 {
				out[op+" "+k] += d
			}
		}
	}
	return out
}

// fhReadPathRequests counts the requests a read of records makes: GETs of
// WAL, data and metadata objects and listings of data objects. Background
// reads of the manifest, the lease and the format object are left out.
func fhReadPathRequests(c testenv.Counts) int {
	n := 0
	for k, v := range c.Keys(testenv.OpGet) {
		if strings.Contains(k, "/wal/") || strings.Contains(k, "/data/") || strings.Contains(k, "/streams/") {
			n += v
		}
	}
	for k, v := range c.Keys(testenv.OpList) {
		if strings.Contains(k, "/data/") {
			n += v
		}
	}
	return n
}

// fhSortedKeys renders a count map in key order.
func fhSortedKeys(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "\n\t%s ×%d", k, m[k])
	}
	return b.String()
}

// fhWaitFor polls cond every interval until it returns nil or timeout
// passes; it returns the last error then.
func fhWaitFor(timeout, interval time.Duration, cond func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		err := cond()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("still not true after %s: %w", timeout, err)
		}
		time.Sleep(interval)
	}
}

// fhRetryAfterOK reports whether v is a valid Retry-After value: a
// non-negative number of seconds or an HTTP date.
func fhRetryAfterOK(v string) bool {
	if v == "" {
		return false
	}
	if n, err := strconv.Atoi(v); err == nil {
		return n >= 0
	}
	_, err := http.ParseTime(v)
	return err == nil
}

// fhContainsAny reports whether s contains any of subs, ignoring case.
func fhContainsAny(s string, subs ...string) bool {
	s = strings.ToLower(s)
	for _, sub := range subs {
		if strings.Contains(s, strings.ToLower(sub)) {
			return true
		}
	}
	return false
}

func fhClip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// fhPercentile returns the p-th percentile (0–100) of sorted durations.
func fhPercentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted)-1) * p / 100)
	return sorted[i]
}

// fhWaitLongPolls waits until the Caddy whose admin endpoint is admin has n
// long-poll reads open (its picomq_open_subscribers gauge), so that a test
// appends to a long-poll that is waiting, not to one still on its way.
func fhWaitLongPolls(t *testing.T, admin string, n float64) {
	t.Helper()
	err := fhWaitFor(30*time.Second, 20*time.Millisecond, func() error {
		s, err := mGet(admin)
		if err != nil {
			return err
		}
		if got := s.sum("picomq_open_subscribers", "mode", "long-poll"); got != n {
			return fmt.Errorf("%v long-polls open, want %v", got, n)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
