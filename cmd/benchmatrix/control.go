//go:build linux

package main

import (
	"encoding/json"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// control is the HTTP endpoint the load generator marks its measured window
// on (bench --mark URL): POST /mark?phase=start and ?phase=end snapshot the
// counters of the S3 proxy in front of the row's Caddy, so that S3 requests
// per 1,000 appends cover exactly the window the appends were counted in.
// GET /counts shows the proxy's counters as they are.
type control struct {
	srv *http.Server
	url string

	mu    sync.Mutex
	proxy *testenv.Proxy
	marks map[string]mark
}

// mark is a snapshot of the proxy's counters at a window edge.
type mark struct {
	At     time.Time
	Counts testenv.Counts
}

func newControl() (*control, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	c := &control{url: "http://" + ln.Addr().String(), marks: map[string]mark{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /mark", c.serveMark)
	mux.HandleFunc("GET /counts", c.serveCounts)
	c.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go c.srv.Serve(ln)
	return c, nil
}

func (c *control) markURL() string { return c.url + "/mark" }

// use points the endpoint at the proxy of the row about to run and forgets
// earlier marks.
func (c *control) use(p *testenv.Proxy) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.proxy = p
	c.marks = map[string]mark{}
}

func (c *control) serveMark(w http.ResponseWriter, r *http.Request) {
	phase := r.URL.Query().Get("phase")
	if phase != "start" && phase != "end" {
		http.Error(w, "phase must be start or end", http.StatusBadRequest)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.proxy == nil {
		// A row without a proxy (the ceiling, Node): nothing to count.
		w.WriteHeader(http.StatusNoContent)
		return
	}
	c.marks[phase] = mark{At: time.Now(), Counts: c.proxy.Counts()}
	w.WriteHeader(http.StatusNoContent)
}

func (c *control) serveCounts(w http.ResponseWriter, r *http.Request) {
	c.mu.Lock()
	p := c.proxy
	c.mu.Unlock()
	var counts testenv.Counts
	if p != nil {
		counts = p.Counts()
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(countsJSON(counts))
}

// window returns the proxy's counts between the start and end marks, and
// whether both marks arrived.
func (c *control) window() (s3Window, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	start, ok1 := c.marks["start"]
	end, ok2 := c.marks["end"]
	if !ok1 || !ok2 {
		return s3Window{}, false
	}
	return diffCounts(start.Counts, end.Counts, end.At.Sub(start.At)), true
}

func (c *control) close() { c.srv.Close() }

// s3Window is what the store was asked over a measured window.
type s3Window struct {
	Put, Get, List, Delete, Head, Other int
	Total                               int
	BytesPut                            int64
	Elapsed                             time.Duration
}

func diffCounts(a, b testenv.Counts, d time.Duration) s3Window {
	w := s3Window{
		Put: b.Put - a.Put, Get: b.Get - a.Get, List: b.List - a.List,
		Delete: b.Delete - a.Delete, Head: b.Head - a.Head, Other: b.Other - a.Other,
		BytesPut: b.BytesPut - a.BytesPut, Elapsed: d,
	}
	w.Total = w.Put + w.Get + w.List + w.Delete + w.Head + w.Other
	return w
}

func countsJSON(c testenv.Counts) map[string]any {
	return map[string]any{
		"put": c.Put, "get": c.Get, "list": c.List, "delete": c.Delete,
		"head": c.Head, "other": c.Other, "total": c.Total(), "bytes_put": c.BytesPut,
	}
}
