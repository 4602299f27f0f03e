package testenv

import (
	"bytes"
	"context"
	"encoding/xml"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"time"
)

// Operation names used by Fault.Op and in Counts.
const (
	OpPut    = "PUT"    // PutObject
	OpGet    = "GET"    // GetObject
	OpList   = "LIST"   // ListObjects(V2): GET on the bucket
	OpDelete = "DELETE" // DeleteObjects (POST ?delete) or DeleteObject
	OpHead   = "HEAD"   // HeadObject, HeadBucket
	OpOther  = "OTHER"  // anything else (CreateBucket, multipart, ...)
)

// Fault describes requests to interfere with and how.
type Fault struct {
	// Op selects the operation ("PUT", "GET", "LIST", "DELETE", "HEAD",
	// "OTHER"); "" matches any.
	Op string
	// KeyContains, when set, must be a substring of the request's subject:
	// the object key for object requests, the prefix for a listing, and
	// any of the keys of a DeleteObjects request.
	KeyContains string
	// Status answers the request with this HTTP status and an S3 error body
	// (503 gets SlowDown, 500 InternalError, ...) instead of forwarding it.
	Status int
	// Code, when set, is the error code of that body instead of Status's
	// usual one (409 ExistingObjectIsDirectory, say).
	Code string
	// Reset drops the connection without an answer. (Go's transport
	// retries a GET or HEAD that was reset on a reused connection before
	// any answer, so such a fault may be absorbed below the SDK.)
	Reset bool
	// Stall holds the request this long (or until the client gives up)
	// before failing it as above or, with neither Status nor Reset,
	// forwarding it.
	Stall time.Duration
	// AfterForward forwards the request first and applies Status or Reset
	// to the answer: the write lands but the client sees an error, as
	// when a response is lost or a client times out after the server
	// committed.
	AfterForward bool
	// Times is how many requests the fault affects; 0 means until removed.
	Times int
	// Rate, between 0 and 1 exclusive, applies the fault to that fraction
	// of the matching requests, picked at random: a store that fails now
	// and then, as a cloud bucket does. For the others the fault is not
	// there (they do not use up Times, and later faults may match them).
	// 0 (or 1 and above) applies it to every match.
	Rate float64
}

// hits reports whether a matching request is one the fault applies to.
func (f *Fault) hits() bool {
	return f.Rate <= 0 || f.Rate >= 1 || rand.Float64() < f.Rate
}

func (f *Fault) matches(r *request) bool {
	if f.Op != "" && !strings.EqualFold(f.Op, r.op) {
		return false
	}
	if f.KeyContains == "" {
		return true
	}
	for _, k := range r.keys {
		if strings.Contains(k, f.KeyContains) {
			return true
		}
	}
	return false
}

// Proxy is an S3 proxy for path-style requests. It forwards every request
// to its target with the Host header unchanged, so SigV4 signatures made
// for the proxy's address stay valid, and counts requests, injects faults
// and latency, parks requests, and can play a stopped server.
type Proxy struct {
	target *url.URL
	rp     *httputil.ReverseProxy
	srv    *http.Server
	addr   string

	mu      sync.Mutex
	ln      net.Listener
	conns   map[net.Conn]struct{}
	closed  bool
	counts  Counts
	latency time.Duration
	jitter  time.Duration
	faults  []*faultEntry
	holds   []*holdEntry
	held    int
	// landing counts released requests still on their way to the target.
	landing  int
	heldCond *sync.Cond
}

type faultEntry struct {
	f    Fault
	left int // remaining uses; <0 means unlimited
}

type holdEntry struct {
	f        Fault
	left     int // requests still to park; <0 means unlimited
	released chan struct{}
}

// NewProxy starts a proxy on 127.0.0.1 (a free port) in front of target,
// e.g. a Versity's Endpoint.
func NewProxy(target string) (*Proxy, error) {
	return ListenProxy(target, "127.0.0.1:0")
}

// ListenProxy starts a proxy on addr in front of target; a port of 0 picks
// a free one.
func ListenProxy(target, addr string) (*Proxy, error) {
	tu, err := url.Parse(target)
	if err != nil {
		return nil, err
	}
	if tu.Scheme == "" || tu.Host == "" {
		return nil, errors.New("testenv: proxy target must be an absolute URL")
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	p := &Proxy{
		target: tu,
		ln:     ln,
		addr:   ln.Addr().String(),
		conns:  make(map[net.Conn]struct{}),
		counts: newCounts(),
	}
	p.heldCond = sync.NewCond(&p.mu)
	transport := &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		MaxIdleConns:        256,
		MaxIdleConnsPerHost: 256,
		IdleConnTimeout:     30 * time.Second,
	}
	p.rp = &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(tu)
			// Keep the Host the client signed.
			pr.Out.Host = pr.In.Host
		},
		Transport:  transport,
		BufferPool: &copyBuffers{},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			w.WriteHeader(http.StatusBadGateway)
		},
	}
	p.srv = &http.Server{
		Handler: http.HandlerFunc(p.serve),
		ConnState: func(c net.Conn, s http.ConnState) {
			p.mu.Lock()
			defer p.mu.Unlock()
			switch s {
			case http.StateNew:
				p.conns[c] = struct{}{}
			case http.StateClosed, http.StateHijacked:
				delete(p.conns, c)
			}
		},
		ErrorLog: nil,
	}
	go p.srv.Serve(ln)
	return p, nil
}

// URL returns the proxy's base URL, to be used as an S3 endpoint.
func (p *Proxy) URL() string { return "http://" + p.addr }

// Addr returns the proxy's host:port.
func (p *Proxy) Addr() string { return p.addr }

// Close stops the proxy and releases every parked request.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	for _, h := range p.holds {
		closeOnce(h.released)
	}
	p.holds = nil
	p.mu.Unlock()
	return p.srv.Close()
}

// Counts returns a snapshot of the request counters.
func (p *Proxy) Counts() Counts {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.counts.clone()
}

// Reset zeroes the counters.
func (p *Proxy) Reset() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.counts = newCounts()
}

// SetLatency delays every request by fixed plus a random duration in
// [0, jitter) before forwarding it. Zero values turn latency off.
func (p *Proxy) SetLatency(fixed, jitter time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.latency, p.jitter = fixed, jitter
}

// AddFault installs a fault; remove uninstalls it. Faults are tried in the
// order they were added and the first match applies.
func (p *Proxy) AddFault(f Fault) (remove func()) {
	e := &faultEntry{f: f, left: f.Times}
	if f.Times <= 0 {
		e.left = -1
	}
	p.mu.Lock()
	p.faults = append(p.faults, e)
	p.mu.Unlock()
	return func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		for i, x := range p.faults {
			if x == e {
				p.faults = append(p.faults[:i], p.faults[i+1:]...)
				return
			}
		}
	}
}

// Hold parks matching requests (after their whole body has arrived) until
// release is called; match.Times limits how many are parked (0 = all until
// release). On release the parked requests are forwarded even if their
// clients have gone away meanwhile, like a server that had received the
// whole request: a held upload can land after its writer was killed. Only
// Op and KeyContains of match select requests.
func (p *Proxy) Hold(match Fault) (release func()) {
	h := &holdEntry{f: match, left: match.Times, released: make(chan struct{})}
	if match.Times <= 0 {
		h.left = -1
	}
	p.mu.Lock()
	p.holds = append(p.holds, h)
	p.mu.Unlock()
	return func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		for i, x := range p.holds {
			if x == h {
				p.holds = append(p.holds[:i], p.holds[i+1:]...)
				break
			}
		}
		closeOnce(h.released)
	}
}

// Held returns how many requests are parked by Hold right now.
func (p *Proxy) Held() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.held
}

// WaitHeld waits until at least n requests are parked by Hold.
func (p *Proxy) WaitHeld(ctx context.Context, n int) error {
	return p.waitHolds(ctx, func() bool { return p.held >= n })
}

// WaitLanded waits until no request is parked by Hold and every released
// one has had its answer from the target: a test that releases a request
// to land late knows when it has.
func (p *Proxy) WaitLanded(ctx context.Context) error {
	return p.waitHolds(ctx, func() bool { return p.held == 0 && p.landing == 0 })
}

// waitHolds waits, until ctx ends, for done to hold; done runs with p.mu
// held, after every change to the parked or landing requests.
func (p *Proxy) waitHolds(ctx context.Context, done func() bool) error {
	stop := context.AfterFunc(ctx, func() {
		p.mu.Lock()
		p.heldCond.Broadcast()
		p.mu.Unlock()
	})
	defer stop()
	p.mu.Lock()
	defer p.mu.Unlock()
	for !done() {
		if err := ctx.Err(); err != nil {
			return err
		}
		p.heldCond.Wait()
	}
	return nil
}

// Down plays a stopped server: the listener is closed, so new connections
// are refused, and every open connection is dropped.
func (p *Proxy) Down() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln == nil {
		return
	}
	p.ln.Close()
	p.ln = nil
	for c := range p.conns {
		c.Close()
	}
}

// Up listens again on the same address after Down.
func (p *Proxy) Up() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != nil || p.closed {
		return nil
	}
	var ln net.Listener
	var err error
	// The port was ours a moment ago; retry briefly in case the kernel
	// still holds it.
	for i := 0; i < 50; i++ {
		ln, err = net.Listen("tcp", p.addr)
		if err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		return err
	}
	p.ln = ln
	go p.srv.Serve(ln)
	return nil
}

// request is what the proxy knows about one incoming request.
type request struct {
	op     string
	bucket string
	key    string   // object key, or list prefix
	keys   []string // subjects KeyContains is matched against
	body   []byte
}

func classify(r *http.Request, body []byte) *request {
	path := strings.TrimPrefix(r.URL.Path, "/")
	bucket, key, hasKey := strings.Cut(path, "/")
	q := r.URL.Query()
	req := &request{bucket: bucket, key: key, body: body}
	objectLevel := hasKey && key != ""
	switch {
	case objectLevel && q.Has("uploads"), objectLevel && q.Has("uploadId"):
		req.op = OpOther
	case objectLevel && r.Method == http.MethodPut:
		if r.Header.Get("X-Amz-Copy-Source") != "" {
			req.op = OpOther
		} else {
			req.op = OpPut
		}
	case objectLevel && r.Method == http.MethodGet:
		if q.Has("acl") || q.Has("tagging") || q.Has("attributes") {
			req.op = OpOther
		} else {
			req.op = OpGet
		}
	case objectLevel && r.Method == http.MethodDelete:
		req.op = OpDelete
	case r.Method == http.MethodHead:
		req.op = OpHead
	case !objectLevel && bucket != "" && r.Method == http.MethodGet &&
		(q.Get("list-type") == "2" || len(q) == 0 || q.Has("prefix") || q.Has("marker") || q.Has("max-keys")):
		req.op = OpList
		req.key = q.Get("prefix")
	case !objectLevel && bucket != "" && r.Method == http.MethodPost && q.Has("delete"):
		req.op = OpDelete
		req.key = ""
		var d struct {
			Objects []struct {
				Key string `xml:"Key"`
			} `xml:"Object"`
		}
		if err := xml.Unmarshal(body, &d); err == nil {
			for _, o := range d.Objects {
				req.keys = append(req.keys, o.Key)
			}
		}
	default:
		req.op = OpOther
	}
	if req.keys == nil {
		req.keys = []string{req.key}
	}
	return req
}

func (p *Proxy) serve(w http.ResponseWriter, r *http.Request) {
	// Read the whole body first: counts and matching need it, and the
	// server notices a client that went away only once the body is read.
	body, err := readBody(r)
	r.Body.Close()
	if err != nil {
		panic(http.ErrAbortHandler)
	}
	req := classify(r, body)

	p.mu.Lock()
	p.counts.add(req)
	var fault *Fault
	for _, e := range p.faults {
		if e.left != 0 && e.f.matches(req) && e.f.hits() {
			if e.left > 0 {
				e.left--
			}
			f := e.f
			fault = &f
			break
		}
	}
	var hold *holdEntry
	for _, h := range p.holds {
		if h.left != 0 && h.f.matches(req) {
			if h.left > 0 {
				h.left--
			}
			hold = h
			break
		}
	}
	delay := p.latency
	if p.jitter > 0 {
		delay += rand.N(p.jitter)
	}
	if fault != nil {
		p.counts.Faults++
	}
	p.mu.Unlock()

	ctx := r.Context()
	if hold != nil {
		p.mu.Lock()
		p.held++
		p.heldCond.Broadcast()
		p.mu.Unlock()
		<-hold.released
		p.mu.Lock()
		p.held--
		p.landing++
		p.heldCond.Broadcast()
		p.mu.Unlock()
		defer func() {
			p.mu.Lock()
			p.landing--
			p.heldCond.Broadcast()
			p.mu.Unlock()
		}()
		// Forward even if the client is gone (see Hold). The writer is
		// wrapped so that ReverseProxy cannot find CloseNotify on it and
		// cancel the forwarded request when the client disconnects.
		ctx = context.WithoutCancel(ctx)
		w = plainWriter{w}
	}
	if delay > 0 && !sleepCtx(ctx, delay) {
		return
	}
	if fault != nil && fault.Stall > 0 && !sleepCtx(ctx, fault.Stall) {
		return
	}
	failing := fault != nil && (fault.Status != 0 || fault.Reset)
	if failing && !fault.AfterForward {
		p.fail(w, fault)
		return
	}
	out := r.Clone(ctx)
	out.Body = io.NopCloser(bytes.NewReader(body))
	out.ContentLength = int64(len(body))
	out.TransferEncoding = nil
	out.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	if failing {
		rec := &discardWriter{h: make(http.Header)}
		p.rp.ServeHTTP(rec, out)
		p.fail(w, fault)
		return
	}
	p.rp.ServeHTTP(w, out)
}

// readBody reads a request body into one buffer of its declared length:
// benchmarks run the proxy on the machine they measure, and ReadAll's
// growing buffer (and the garbage it leaves) was most of its CPU.
func readBody(r *http.Request) ([]byte, error) {
	if r.ContentLength <= 0 || r.ContentLength > 64<<20 {
		return io.ReadAll(r.Body)
	}
	body := make([]byte, r.ContentLength)
	if _, err := io.ReadFull(r.Body, body); err != nil {
		return nil, err
	}
	return body, nil
}

// copyBuffers lends ReverseProxy its response copy buffers, which it
// would otherwise allocate per request.
type copyBuffers struct{ p sync.Pool }

func (b *copyBuffers) Get() []byte {
	if v, ok := b.p.Get().(*[]byte); ok {
		return *v
	}
	return make([]byte, 256<<10)
}

func (b *copyBuffers) Put(buf []byte) { b.p.Put(&buf) }

func (p *Proxy) fail(w http.ResponseWriter, f *Fault) {
	if f.Reset {
		panic(http.ErrAbortHandler)
	}
	code, msg := "InternalError", "injected fault"
	switch f.Status {
	case http.StatusServiceUnavailable:
		code = "SlowDown"
	case http.StatusPreconditionFailed:
		code = "PreconditionFailed"
	case http.StatusConflict:
		code = "ConditionalRequestConflict"
	case http.StatusNotFound:
		code = "NoSuchKey"
	case http.StatusForbidden:
		code = "AccessDenied"
	case http.StatusTooManyRequests:
		code = "TooManyRequests"
	}
	if f.Code != "" {
		code = f.Code
	}
	w.Header().Set("Content-Type", "application/xml")
	w.WriteHeader(f.Status)
	io.WriteString(w, `<?xml version="1.0" encoding="UTF-8"?>`+"\n<Error><Code>"+code+"</Code><Message>"+msg+"</Message></Error>")
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func closeOnce(c chan struct{}) {
	select {
	case <-c:
	default:
		close(c)
	}
}

// plainWriter hides every optional interface of a ResponseWriter.
type plainWriter struct{ http.ResponseWriter }

// discardWriter swallows a response whose request was forwarded only for
// its side effect.
type discardWriter struct{ h http.Header }

func (d *discardWriter) Header() http.Header         { return d.h }
func (d *discardWriter) Write(b []byte) (int, error) { return len(b), nil }
func (d *discardWriter) WriteHeader(int)             {}

// Counts is a snapshot of the proxy's request counters.
type Counts struct {
	Put, Get, List, Delete, Head, Other int
	// BytesPut is the sum of PutObject body sizes.
	BytesPut int64
	// Faults is how many requests a Fault applied to.
	Faults int
	// byKey counts requests per operation and key (the object key; the
	// prefix for LIST; every key of a DeleteObjects request).
	byKey map[string]map[string]int
}

func newCounts() Counts { return Counts{byKey: make(map[string]map[string]int)} }

func (c *Counts) add(r *request) {
	switch r.op {
	case OpPut:
		c.Put++
		c.BytesPut += int64(len(r.body))
	case OpGet:
		c.Get++
	case OpList:
		c.List++
	case OpDelete:
		c.Delete++
	case OpHead:
		c.Head++
	default:
		c.Other++
	}
	m := c.byKey[r.op]
	if m == nil {
		m = make(map[string]int)
		c.byKey[r.op] = m
	}
	for _, k := range r.keys {
		m[k]++
	}
}

func (c Counts) clone() Counts {
	n := c
	n.byKey = make(map[string]map[string]int, len(c.byKey))
	for op, m := range c.byKey {
		mm := make(map[string]int, len(m))
		for k, v := range m {
			mm[k] = v
		}
		n.byKey[op] = mm
	}
	return n
}

// Total is the number of requests of every kind.
func (c Counts) Total() int { return c.Put + c.Get + c.List + c.Delete + c.Head + c.Other }

// Under counts requests of op ("" = any) whose key starts with prefix. Keys
// are full keys inside the bucket (including the store's prefix). For
// DeleteObjects each key counts once; for LIST the listed prefix is the key.
func (c Counts) Under(op, prefix string) int {
	n := 0
	for o, m := range c.byKey {
		if op != "" && !strings.EqualFold(op, o) {
			continue
		}
		for k, v := range m {
			if strings.HasPrefix(k, prefix) {
				n += v
			}
		}
	}
	return n
}

// Containing counts requests of op ("" = any) whose key contains sub.
func (c Counts) Containing(op, sub string) int {
	n := 0
	for o, m := range c.byKey {
		if op != "" && !strings.EqualFold(op, o) {
			continue
		}
		for k, v := range m {
			if strings.Contains(k, sub) {
				n += v
			}
		}
	}
	return n
}

// PutsUnder counts PutObject requests whose key starts with prefix.
func (c Counts) PutsUnder(prefix string) int { return c.Under(OpPut, prefix) }

// GetsUnder counts GetObject requests whose key starts with prefix.
func (c Counts) GetsUnder(prefix string) int { return c.Under(OpGet, prefix) }

// Keys returns the per-key counts of op, as key → requests.
func (c Counts) Keys(op string) map[string]int {
	out := make(map[string]int)
	for k, v := range c.byKey[strings.ToUpper(op)] {
		out[k] = v
	}
	return out
}
