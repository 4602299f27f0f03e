package picomq

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"runtime"
	"time"

	"github.com/picomq/caddy-picomq/streamstore"
)

// sseControl is the payload of a Durable Streams "control" event.
type sseControl struct {
	StreamNextOffset string `json:"streamNextOffset"`
	StreamCursor     string `json:"streamCursor,omitempty"`
	UpToDate         bool   `json:"upToDate,omitempty"`
	StreamClosed     bool   `json:"streamClosed,omitempty"`
}

// base64LineLen is how many base64 characters go on one "data:" line; a
// multiple of 4 so that every line decodes on its own too.
const base64LineLen = 4096

// writeSSEEvent writes one event. Every line of payload becomes its own
// "data:" line; CR, LF and CRLF all end a line, so bytes in the payload can
// never end the event or start a forged one.
func writeSSEEvent(w *bufio.Writer, event string, payload []byte) error {
	if _, err := fmt.Fprintf(w, "event: %s\n", event); err != nil {
		return err
	}
	for {
		line, rest, more := cutLine(payload)
		w.WriteString("data:")
		if len(line) > 0 && line[0] == ' ' {
			// Readers drop one space after "data:"; give them one to
			// drop so the line's own leading space survives.
			w.WriteByte(' ')
		}
		w.Write(line)
		w.WriteByte('\n')
		if !more {
			break
		}
		payload = rest
	}
	return w.WriteByte('\n')
}

// cutLine splits b at its first line ending (CRLF, CR or LF).
func cutLine(b []byte) (line, rest []byte, found bool) {
	for i, c := range b {
		switch c {
		case '\n':
			return b[:i], b[i+1:], true
		case '\r':
			if i+1 < len(b) && b[i+1] == '\n' {
				return b[:i], b[i+2:], true
			}
			return b[:i], b[i+1:], true
		}
	}
	return b, nil, false
}

// writeSSEBase64 writes a data event whose payload is data in standard
// base64, split into lines of base64LineLen characters.
func writeSSEBase64(w *bufio.Writer, data []byte) error {
	enc := make([]byte, base64.StdEncoding.EncodedLen(len(data)))
	base64.StdEncoding.Encode(enc, data)
	w.WriteString("event: data\n")
	for len(enc) > base64LineLen {
		w.WriteString("data:")
		w.Write(enc[:base64LineLen])
		w.WriteByte('\n')
		enc = enc[base64LineLen:]
	}
	w.WriteString("data:")
	w.Write(enc)
	_, err := w.WriteString("\n\n")
	return err
}

// writeSSEControl writes a control event.
func writeSSEControl(w *bufio.Writer, c sseControl) error {
	b, err := json.Marshal(c)
	if err != nil {
		return fmt.Errorf("encoding control event: %w", err)
	}
	return writeSSEEvent(w, "control", b)
}

// eventStream is a server-sent events response being written: events go
// through a buffer, and flush pushes them to the client.
type eventStream struct {
	bw *bufio.Writer
	rc *http.ResponseController
}

// startEventStream sends the 200 of an event stream and flushes it, so the
// client sees the response start at once. A server write timeout would cut
// the feed short; the caller's reconnect interval bounds it instead.
func startEventStream(w http.ResponseWriter) (*eventStream, bool) {
	rc := http.NewResponseController(w)
	_ = rc.SetWriteDeadline(time.Time{})
	w.WriteHeader(http.StatusOK)
	// Events are flushed one by one, so the buffer only needs to hold a
	// typical one; larger writes go straight through. Thousands of feeds
	// each holding 32 KiB was most of a fan-out's memory.
	es := &eventStream{bw: bufio.NewWriterSize(w, 4<<10), rc: rc}
	return es, es.flush()
}

// flush writes out buffered events; false means the client is gone.
func (es *eventStream) flush() bool {
	if err := es.bw.Flush(); err != nil {
		return false
	}
	if err := es.rc.Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
		return false
	}
	return true
}

// liveWait bounds the waits of one live response (a long-poll, or an SSE
// feed that waits many times): they end at its deadline, when the server
// shuts down or when the client leaves. One context serves every wait of
// the response, so a feed woken by each append does not build and tear
// down a timer and a shutdown hook per event.
type liveWait struct {
	client context.Context
	ctx    context.Context
	cancel context.CancelFunc
	stop   func() bool
}

func newLiveWait(r *http.Request, shutdown context.Context, deadline time.Time) *liveWait {
	ctx, cancel := context.WithDeadline(r.Context(), deadline)
	return &liveWait{client: r.Context(), ctx: ctx, cancel: cancel, stop: context.AfterFunc(shutdown, cancel)}
}

func (lw *liveWait) close() {
	lw.stop()
	lw.cancel()
}

// wait waits for the stream to move past seq. It returns errWaitOver when
// the deadline passes or the server shuts down, the client's context error
// when the client left, or the engine's error.
func (lw *liveWait) wait(eng *streamstore.Engine, name, id string, seq uint64) (streamstore.Info, error) {
	info, err := eng.Wait(lw.ctx, name, id, seq)
	if err == nil {
		return info, nil
	}
	if cerr := lw.client.Err(); cerr != nil {
		return info, cerr
	}
	if lw.ctx.Err() != nil || errors.Is(err, streamstore.ErrShuttingDown) {
		return info, errWaitOver
	}
	return info, err
}

// fanout bounds how many live feeds turn a wake-up into a read and a write
// at the same time. An append to a stream with thousands of subscribers
// wakes them all at once; unbounded, they flood the scheduler's run queues
// and everything else on the node (the upload that acknowledges the next
// append, other requests) waits behind thousands of feeds. Through the gate
// the feeds take turns a few at a time, FIFO, and a feed that waited reads
// every record that arrived meanwhile in one event, so a fan-out that
// outgrows the CPU batches instead of falling behind without bound.
type fanout chan struct{}

func newFanout() fanout { return make(fanout, 2*runtime.GOMAXPROCS(0)) }

// enter waits for a turn; false means ctx ended first.
func (f fanout) enter(ctx context.Context) bool {
	select {
	case f <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

func (f fanout) leave() { <-f }

// turn is one feed's hold on the fanout gate: taken before a read, given
// back once the write is flushed. A nil gate admits everyone.
type turn struct {
	gate fanout
	held bool
}

func (t *turn) take(ctx context.Context) bool {
	if t.held || t.gate == nil {
		return true
	}
	if !t.gate.enter(ctx) {
		return false
	}
	t.held = true
	return true
}

func (t *turn) release() {
	if t.held {
		t.gate.leave()
		t.held = false
	}
}
