package loadgen

import (
	"bytes"
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fakeServer is a tiny in-memory Durable Streams server: enough of the
// protocol for the load generator (create, append, HEAD, catch-up reads in
// chunks, SSE). Offsets are byte positions in decimal.
type fakeServer struct {
	mu      sync.Mutex
	streams map[string]*fakeStream
	changed chan struct{} // closed and replaced on every append

	failAppends bool // answer 500 to every POST
	failSSE     bool // answer 400 to every SSE request
	plain       bool // answer an empty 200 to everything, as Caddy does with no route
	maxChunk    int  // catch-up reads return at most this many bytes (0: all)
	sseEvents   int  // an SSE response ends after this many data events (0: never)
	appends     int
	marks       []string
	requests    atomic.Int64 // every request, marks included

	// auth and host, when set, are what every request must carry as its
	// Authorization and Host (401 otherwise); marks are exempt.
	auth, host string
}

type fakeStream struct {
	contentType string
	data        []byte
	appends     int
}

func newFake(t *testing.T) (*fakeServer, *httptest.Server) {
	t.Helper()
	f := &fakeServer{streams: map[string]*fakeStream{}, changed: make(chan struct{})}
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	return f, srv
}

func (f *fakeServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.requests.Add(1)
	if f.plain {
		return
	}
	if r.URL.Path != "/mark" && (f.auth != "" && r.Header.Get("Authorization") != f.auth || f.host != "" && r.Host != f.host) {
		http.Error(w, "unauthorized", http.StatusUnauthorized)
		return
	}
	if r.URL.Path == "/mark" {
		f.mu.Lock()
		f.marks = append(f.marks, r.URL.Query().Get("phase"))
		f.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
		return
	}
	if r.URL.Path == "/badmark" {
		http.Error(w, "no marks here", http.StatusInternalServerError)
		return
	}
	name := strings.TrimPrefix(r.URL.Path, "/")
	if strings.HasPrefix(name, "forbidden") {
		http.Error(w, "forbidden", http.StatusForbidden)
		return
	}
	body, _ := io.ReadAll(r.Body)
	f.mu.Lock()
	s := f.streams[name]
	switch r.Method {
	case http.MethodPut:
		status := http.StatusOK
		if s == nil {
			s = &fakeStream{contentType: r.Header.Get("Content-Type"), data: body}
			f.streams[name] = s
			status = http.StatusCreated
		}
		w.Header().Set(hdrNextOffset, strconv.Itoa(len(s.data)))
		f.mu.Unlock()
		w.WriteHeader(status)
		return
	case http.MethodPost:
		switch {
		case f.failAppends:
			f.mu.Unlock()
			http.Error(w, "injected failure", http.StatusInternalServerError)
			return
		case s == nil:
			f.mu.Unlock()
			http.Error(w, "no such stream", http.StatusNotFound)
			return
		}
		s.data = append(s.data, body...)
		s.appends++
		f.appends++
		close(f.changed)
		f.changed = make(chan struct{})
		w.Header().Set(hdrNextOffset, strconv.Itoa(len(s.data)))
		f.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
		return
	}
	if s == nil {
		f.mu.Unlock()
		http.Error(w, "no such stream", http.StatusNotFound)
		return
	}
	if r.Method == http.MethodHead {
		w.Header().Set(hdrNextOffset, strconv.Itoa(len(s.data)))
		f.mu.Unlock()
		return
	}
	off := 0
	switch o := r.URL.Query().Get("offset"); o {
	case "", "-1":
	case "now":
		off = len(s.data)
	default:
		off, _ = strconv.Atoi(o)
	}
	if r.URL.Query().Get("live") != "sse" {
		end := len(s.data)
		if f.maxChunk > 0 {
			end = min(end, off+f.maxChunk)
		}
		chunk := append([]byte(nil), s.data[off:end]...)
		w.Header().Set(hdrNextOffset, strconv.Itoa(end))
		if end == len(s.data) {
			w.Header().Set(hdrUpToDate, "true")
		}
		f.mu.Unlock()
		w.Write(chunk)
		return
	}
	textual := strings.HasPrefix(s.contentType, "text/")
	failSSE := f.failSSE
	f.mu.Unlock()
	if failSSE {
		http.Error(w, "no SSE here", http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	if !textual {
		w.Header().Set("Stream-SSE-Data-Encoding", "base64")
	}
	w.WriteHeader(http.StatusOK)
	w.(http.Flusher).Flush()
	sent := 0
	for {
		f.mu.Lock()
		chunk := append([]byte(nil), s.data[off:]...)
		changed := f.changed
		f.mu.Unlock()
		if len(chunk) > 0 {
			off += len(chunk)
			var ev bytes.Buffer
			ev.WriteString("event: data\n")
			if textual {
				for _, l := range strings.Split(string(chunk), "\n") {
					ev.WriteString("data: " + l + "\n")
				}
			} else {
				enc := base64.StdEncoding.EncodeToString(chunk)
				for len(enc) > 8 { // several lines, as servers split them
					ev.WriteString("data:" + enc[:8] + "\n")
					enc = enc[8:]
				}
				ev.WriteString("data:" + enc + "\n")
			}
			fmt.Fprintf(&ev, "\nevent: control\ndata: {\"streamNextOffset\":\"%d\",\"upToDate\":true}\n\n", off)
			if _, err := w.Write(ev.Bytes()); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			if sent++; f.sseEvents > 0 && sent >= f.sseEvents {
				return // the client reconnects from the last control event
			}
		}
		select {
		case <-r.Context().Done():
			return
		case <-changed:
		case <-time.After(time.Second):
		}
	}
}

func (f *fakeServer) stream(name string) *fakeStream {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.streams[name]
}
