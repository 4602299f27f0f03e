// Command s3proxy puts the test suite's S3 proxy (internal/testenv) in front
// of any path-style S3 endpoint, to make a local store behave like a cloud
// bucket and to count what a client asks of it:
//
//	go run ./cmd/s3proxy -target http://127.0.0.1:7070 -listen 127.0.0.1:9000 -latency 25ms -jitter 10ms -error-rate 0.01
//
// Point the client (a PicoMQ storage URL's endpoint=) at the -listen
// address. Every request is delayed by -latency plus up to -jitter; a
// fraction -error-rate of them is answered with -error-status (503 SlowDown
// by default) instead of being forwarded. The Host header is forwarded as
// the client signed it, so SigV4 signatures stay valid.
//
// The control endpoint (-control) serves:
//
//	GET  /counts                 requests so far, by operation, as JSON
//	POST /reset                  zero the counters
//	POST /mark?phase=start|end   snapshot the counters (what `caddy picomq bench --mark` calls)
//	GET  /window                 the requests between the last start and end marks
//
// On exit (Ctrl-C) it prints the counters.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"sync"
	"syscall"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

func main() {
	target := flag.String("target", "", "the S3 endpoint to forward to, e.g. http://127.0.0.1:7070 (required)")
	listen := flag.String("listen", "127.0.0.1:0", "address clients connect to")
	control := flag.String("control", "127.0.0.1:0", "address of the control endpoint (counts, marks)")
	latency := flag.Duration("latency", 0, "delay added to every request")
	jitter := flag.Duration("jitter", 0, "plus a random delay in [0, jitter)")
	errorRate := flag.Float64("error-rate", 0, "fraction of requests (0 to 1) answered with -error-status instead of being forwarded")
	errorStatus := flag.Int("error-status", http.StatusServiceUnavailable, "HTTP status of injected errors (503 is SlowDown, 500 InternalError)")
	pprofAddr := flag.String("pprof", "", "serve net/http/pprof on this address (the proxy's own cost shows in benchmarks)")
	flag.Parse()
	if *target == "" {
		fmt.Fprintln(os.Stderr, "s3proxy: -target is required")
		flag.Usage()
		os.Exit(2)
	}
	if *errorRate < 0 || *errorRate >= 1 {
		fmt.Fprintln(os.Stderr, "s3proxy: -error-rate must be at least 0 and below 1")
		os.Exit(2)
	}

	p, err := testenv.ListenProxy(*target, *listen)
	if err != nil {
		log.Fatalf("s3proxy: %v", err)
	}
	defer p.Close()
	p.SetLatency(*latency, *jitter)
	if *errorRate > 0 {
		p.AddFault(testenv.Fault{Status: *errorStatus, Rate: *errorRate})
	}

	if *pprofAddr != "" {
		pln, err := net.Listen("tcp", *pprofAddr)
		if err != nil {
			log.Fatalf("s3proxy: %v", err)
		}
		pm := http.NewServeMux()
		pm.HandleFunc("/debug/pprof/", pprof.Index)
		pm.HandleFunc("/debug/pprof/profile", pprof.Profile)
		go http.Serve(pln, pm)
	}

	c := &ctl{p: p, marks: map[string]testenv.Counts{}}
	cln, err := net.Listen("tcp", *control)
	if err != nil {
		log.Fatalf("s3proxy: %v", err)
	}
	go http.Serve(cln, c.mux())

	fmt.Printf("s3proxy: forwarding http://%s to %s (latency %s, jitter %s, error rate %g)\n", p.Addr(), *target, *latency, *jitter, *errorRate)
	fmt.Printf("s3proxy: control on http://%s (GET /counts, POST /reset, POST /mark?phase=start|end, GET /window)\n", cln.Addr())

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	<-ctx.Done()
	p.Down() // no new requests while the counts are printed
	b, _ := json.Marshal(countsJSON(p.Counts()))
	fmt.Printf("s3proxy: counts %s\n", b)
}

// ctl is the control endpoint.
type ctl struct {
	p     *testenv.Proxy
	mu    sync.Mutex
	marks map[string]testenv.Counts
}

func (c *ctl) mux() *http.ServeMux {
	m := http.NewServeMux()
	m.HandleFunc("GET /counts", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, countsJSON(c.p.Counts()))
	})
	m.HandleFunc("POST /reset", func(w http.ResponseWriter, r *http.Request) {
		c.p.Reset()
		c.mu.Lock()
		c.marks = map[string]testenv.Counts{}
		c.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	})
	m.HandleFunc("POST /mark", func(w http.ResponseWriter, r *http.Request) {
		phase := r.URL.Query().Get("phase")
		if phase != "start" && phase != "end" {
			http.Error(w, "phase must be start or end", http.StatusBadRequest)
			return
		}
		c.mu.Lock()
		c.marks[phase] = c.p.Counts()
		c.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	})
	m.HandleFunc("GET /window", func(w http.ResponseWriter, r *http.Request) {
		c.mu.Lock()
		start, ok1 := c.marks["start"]
		end, ok2 := c.marks["end"]
		c.mu.Unlock()
		if !ok1 || !ok2 {
			http.Error(w, "no start and end marks yet", http.StatusNotFound)
			return
		}
		writeJSON(w, diff(start, end))
	})
	return m
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(v)
}

func countsJSON(c testenv.Counts) map[string]any {
	return map[string]any{
		"put": c.Put, "get": c.Get, "list": c.List, "delete": c.Delete, "head": c.Head,
		"other": c.Other, "total": c.Total(), "bytes_put": c.BytesPut, "faults": c.Faults,
	}
}

func diff(a, b testenv.Counts) map[string]any {
	d := testenv.Counts{
		Put: b.Put - a.Put, Get: b.Get - a.Get, List: b.List - a.List, Delete: b.Delete - a.Delete,
		Head: b.Head - a.Head, Other: b.Other - a.Other, BytesPut: b.BytesPut - a.BytesPut, Faults: b.Faults - a.Faults,
	}
	return countsJSON(d)
}
