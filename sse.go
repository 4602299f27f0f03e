package picomq

import (
	"bufio"
	"context"
	"encoding/base64"
	"errors"
	"io"
	"net/http"
	"runtime"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

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

// appendSSEEvent appends one event to dst. Every line of payload becomes
// its own "data:" line; CR, LF and CRLF all end a line, so bytes in the
// payload can never end the event or start a forged one.
func appendSSEEvent(dst []byte, event string, payload []byte) []byte {
	dst = append(dst, "event: "...)
	dst = append(dst, event...)
	dst = append(dst, '\n')
	for {
		line, rest, more := cutLine(payload)
		dst = append(dst, "data:"...)
		if len(line) > 0 && line[0] == ' ' {
			// Readers drop one space after "data:"; give them one to
			// drop so the line's own leading space survives.
			dst = append(dst, ' ')
		}
		dst = append(dst, line...)
		dst = append(dst, '\n')
		if !more {
			break
		}
		payload = rest
	}
	return append(dst, '\n')
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

// appendSSEBase64 appends a data event whose payload is data in standard
// base64, split into lines of base64LineLen characters.
func appendSSEBase64(dst, data []byte) []byte {
	enc := base64.StdEncoding.AppendEncode(nil, data)
	dst = append(dst, "event: data\n"...)
	for len(enc) > base64LineLen {
		dst = append(dst, "data:"...)
		dst = append(dst, enc[:base64LineLen]...)
		dst = append(dst, '\n')
		enc = enc[base64LineLen:]
	}
	dst = append(dst, "data:"...)
	dst = append(dst, enc...)
	return append(dst, "\n\n"...)
}

// appendSSEControl appends a control event. Its JSON is written by hand: a
// feed writes one after every data event, and the fields are few and fixed
// (the same bytes encoding/json gives for the ASCII offsets and cursors).
func appendSSEControl(dst []byte, c sseControl) []byte {
	dst = append(dst, "event: control\ndata:{\"streamNextOffset\":"...)
	dst = appendJSONString(dst, c.StreamNextOffset)
	if c.StreamCursor != "" {
		dst = append(dst, `,"streamCursor":`...)
		dst = appendJSONString(dst, c.StreamCursor)
	}
	if c.UpToDate {
		dst = append(dst, `,"upToDate":true`...)
	}
	if c.StreamClosed {
		dst = append(dst, `,"streamClosed":true`...)
	}
	return append(dst, "}\n\n"...)
}

// appendJSONString appends s as a JSON string: quotes, backslashes and
// control characters escaped, everything else as it is.
func appendJSONString(dst []byte, s string) []byte {
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '"' || c == '\\':
			dst = append(dst, '\\', c)
		case c < 0x20:
			dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		default:
			dst = append(dst, c)
		}
	}
	return append(dst, '"')
}

// eventStream is a server-sent events response being written: events go
// to out (a buffer over the response, or the response itself), and flush
// pushes them to the client.
type eventStream struct {
	out io.Writer
	bw  *bufio.Writer // nil when events are written to the response directly
	rc  *http.ResponseController
	// deadlineFires is set on HTTP/2, where a write deadline is a timer
	// that resets the stream when it passes, written to or not: one must
	// not stay armed while the feed waits for the next event. On HTTP/1
	// (and HTTP/3) it is only checked by the next write.
	deadlineFires bool
}

// startEventStream sends the 200 of an event stream and flushes it, so the
// client sees the response start at once. With bufSize 0 events go straight
// to the response, whose own buffer then gathers an event's writes; callers
// that write an event in many small pieces pass a buffer size. A server
// write timeout would cut the feed short; the caller's reconnect interval
// bounds it instead (or Caddy's deadline for the response: liveDeadline).
func startEventStream(w http.ResponseWriter, r *http.Request, bufSize int) (*eventStream, bool) {
	rc := http.NewResponseController(w)
	_ = rc.SetWriteDeadline(time.Time{})
	w.WriteHeader(http.StatusOK)
	es := &eventStream{out: w, rc: rc, deadlineFires: r.ProtoMajor == 2}
	if bufSize > 0 {
		es.bw = bufio.NewWriterSize(w, bufSize)
		es.out = es.bw
	}
	return es, es.flush()
}

// write queues b; false means the client is gone.
func (es *eventStream) write(b []byte) bool {
	_, err := es.out.Write(b)
	return err == nil
}

// flush writes out buffered events; false means the client is gone.
func (es *eventStream) flush() bool {
	if es.bw != nil {
		if err := es.bw.Flush(); err != nil {
			return false
		}
	}
	if err := es.rc.Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
		return false
	}
	return true
}

// endDamaged ends a feed whose next read met records that are stored
// damaged (streamstore.ErrDamaged): no retry brings them back until the
// object is restored, so the feed must neither wait nor skip them. Neither
// protocol has an error event, and the response's status went out with
// its first event, so the reason goes out as an SSE comment, which
// clients ignore and a person reading the feed sees, and the response
// ends; the client's reconnect from its last offset then gets the 500
// that names the object. The engine logged the damage once; a log line
// per feed that meets it would be a storm with many readers.
func (es *eventStream) endDamaged(err error) {
	msg := []byte(damagedMessage(err))
	for i, c := range msg {
		if c == '\n' || c == '\r' {
			msg[i] = ' ' // a line break would end the comment
		}
	}
	es.write(append(append([]byte(": error: "), msg...), '\n'))
	es.flush()
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

// liveDeadline is when a live response that may last d from now must end.
// Caddy's `write` server timeout is a deadline for the whole response,
// counted from the request's start, which a handler cannot lift: each
// write past it fails, so a long-poll woken after it is cut without an
// answer, and an SSE feed's next event is lost with the connection. Such
// a response ends a margin before it instead (a long-poll's 204, a feed's
// clean end for its client to reconnect), with a quarter of the timeout,
// at most a second, left to write the end.
func liveDeadline(r *http.Request, d time.Duration) time.Time {
	end := time.Now().Add(d)
	if cut, ok := writeCut(r); ok && cut.Before(end) {
		return cut
	}
	return end
}

// writeCut is when a response to r must be done being handled for its end
// to be written before Caddy's `write` server timeout: a quarter of the
// timeout, at most a second, before it. ok is false when there is none.
func writeCut(r *http.Request) (cut time.Time, ok bool) {
	_, w := caddyhttp.IdleTimeoutsFromContext(r.Context())
	if w == nil || w.Deadline.HardDeadline.IsZero() {
		return time.Time{}, false
	}
	hard := w.Deadline.HardDeadline
	margin := min(time.Second, hard.Sub(w.Deadline.Start)/4)
	return hard.Add(-margin), true
}

// catchUpBudget bounds how long a read waits for the objects of one
// answer once it has a record: a catch-up over many small objects on a
// slow bucket answers with what it has (not up to date; the client reads
// on from there) instead of after a client or a CDN in front gave up.
// Caddy's `write` timeout, when sooner, bounds it too (writeContext).
const catchUpBudget = 10 * time.Second

// writeContext is the context of a write request r, and of the lookups it
// makes first (a read's too, whose answer is due by the same cut): the engine's wait for the write to become durable ends at
// writeCut, answering ErrUnconfirmed (a 503 that says the write was not
// acknowledged), and a wait before the write was handed to storage (the
// stream's metadata read) ErrTooLate, where Caddy's `write` timeout would
// otherwise cut the response and leave the client unable to tell a
// refused write from a network fault.
func writeContext(r *http.Request) context.Context {
	if cut, ok := writeCut(r); ok {
		return streamstore.WithAnswerBy(r.Context(), cut)
	}
	return r.Context()
}

func newLiveWait(r *http.Request, shutdown context.Context, deadline time.Time) *liveWait {
	ctx, cancel := context.WithDeadline(r.Context(), deadline)
	return &liveWait{client: r.Context(), ctx: ctx, cancel: cancel, stop: context.AfterFunc(shutdown, cancel)}
}

func (lw *liveWait) close() {
	lw.stop()
	lw.cancel()
}

// wait waits for the stream to move past seq, for keepAlive at most when
// it is not zero. It returns errKeepAlive when the stream stayed put that
// long, errWaitOver when the deadline passes or the server shuts down, the
// client's context error when the client left, or the engine's error.
func (lw *liveWait) wait(eng *streamstore.Engine, name, id string, seq uint64, keepAlive time.Duration) (streamstore.Info, error) {
	ctx := lw.ctx
	if keepAlive > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(lw.ctx, keepAlive)
		defer cancel()
	}
	info, err := eng.Wait(ctx, name, id, seq)
	if err == nil {
		return info, nil
	}
	if errors.Is(err, context.DeadlineExceeded) && lw.ctx.Err() == nil {
		return info, errKeepAlive
	}
	if cerr := lw.client.Err(); cerr != nil {
		return info, cerr
	}
	if errors.Is(err, streamstore.ErrUnavailable) {
		// The time was up on a node that lost its lease meanwhile: not
		// "nothing new", which another node's appends may belie.
		return info, err
	}
	if lw.ctx.Err() != nil || errors.Is(err, streamstore.ErrShuttingDown) {
		return info, errWaitOver
	}
	return info, err
}

// errKeepAlive: a feed's wait lasted its keep-alive interval, and the feed
// writes its control event again before it waits on.
var errKeepAlive = errors.New("keep-alive due")

// keepAliveOr is the keep-alive interval d, or hubKeepAlive for zero.
func keepAliveOr(d time.Duration) time.Duration {
	if d <= 0 {
		return hubKeepAlive
	}
	return d
}

// atTail reports whether pos is the tail of stream name (internal id id)
// now. A feed leaves its stream's hub at shutdown where the hub's writes
// left it, which can be short of records that landed during the hub's last
// pass: its final control event says it is up to date only when no record
// is past that position.
func atTail(ctx context.Context, eng *streamstore.Engine, name, id string, pos position) bool {
	info, err := eng.Head(ctx, name)
	return err == nil && info.ID == id && pos.off == 0 && pos.seq >= info.NextSeq
}

// streamDeleted reports whether a live read's wait ended because the stream
// was deleted (or soft-deleted): the feed ends, which is no failure to log.
func streamDeleted(err error) bool {
	return errors.Is(err, streamstore.ErrNotFound) || errors.Is(err, streamstore.ErrGone)
}

// feedOver reports whether a feed's wait or read failed for a reason that
// ends the feed and is no failure to log per feed: the stream was deleted,
// or the storage is unavailable here (another process took it over, or the
// lease could not be renewed in time: the engine logs those once, and the
// client's reconnect is answered with the reason).
func feedOver(err error) bool {
	return streamDeleted(err) || errors.Is(err, streamstore.ErrTakenOver) || errors.Is(err, streamstore.ErrLeaseLapsed)
}

// fanout bounds how many live feeds turn a wake-up into a read and a write
// at the same time. An append to a stream with thousands of subscribers
// wakes them all at once; unbounded, they flood the scheduler's run queues
// and everything else on the node (the upload that acknowledges the next
// append, other requests) waits behind thousands of feeds. Through the gate
// the feeds take turns a few at a time, FIFO, and a feed that waited reads
// every record that arrived meanwhile in one event, so a fan-out that
// outgrows the CPU batches instead of falling behind without bound.
// Durable Streams feeds at the tail wait in their stream's hub instead
// (ssehub.go); the gate is for feeds catching up and for Pico feeds.
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
//
// A feed writes while it holds its turn, so a client that stopped reading
// would keep a place at the gate until the server gave up on the write;
// a few such clients would stall every feed of the storage. With es set,
// a write made while the turn is held has turnWriteTimeout to finish.
type turn struct {
	gate    fanout
	held    bool
	es      *eventStream
	timeout time.Duration // for a write while held; 0: defaultFeedWriteTimeout
	limited bool          // a write deadline is set
}

// defaultFeedWriteTimeout bounds a write that other feeds wait for, one
// made holding a turn, and a hub's write (ssehub.go), which the others stop
// waiting for after a tick but which keeps a stalled client until then.
const defaultFeedWriteTimeout = 10 * time.Second

// feedWriteTimeout is timeout, or the default when it is not set.
func feedWriteTimeout(timeout time.Duration) time.Duration {
	if timeout > 0 {
		return timeout
	}
	return defaultFeedWriteTimeout
}

// limitWrites starts the write deadline of a held turn; the feed calls it
// before writing.
func (t *turn) limitWrites() {
	if t.held && t.es != nil {
		_ = t.es.rc.SetWriteDeadline(time.Now().Add(feedWriteTimeout(t.timeout)))
		t.limited = true
	}
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
	if t.limited {
		_ = t.es.rc.SetWriteDeadline(time.Time{})
		t.limited = false
	}
	if t.held {
		t.gate.leave()
		t.held = false
	}
}
