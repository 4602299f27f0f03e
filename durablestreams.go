package picomq

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"
	"unsafe"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/streamstore"
)

// dsChunkBytes is the most stream bytes one Durable Streams read response
// (or one SSE data event) carries; longer reads continue at the returned
// offset. A catch-up reader waits a round trip between responses, during
// which nothing flows: with 1 MiB records, a cap of 4 MiB instead of 1 made
// a cold read on the benchmark VM some 20% faster (8 MiB gained nothing
// more). The records of a response stay pinned until it is written, so the
// cap is also what one reader holds.
const dsChunkBytes = 4 << 20

// dsChunkRecords caps the records of one read at as many as take
// dsChunkBytes in memory themselves (a record is 64 bytes before its
// body): by bytes alone, a read of one-byte records took every record up
// to the tail, four million of them within 4 MiB, 256 MiB held by one
// reader and more allocated while the slice grew.
const dsChunkRecords = dsChunkBytes / int(unsafe.Sizeof(streamstore.Record{}))

// durableStreams serves the Durable Streams protocol
// (reference/durable-streams-PROTOCOL.md) on top of the engine. It knows
// nothing of storage: every stream operation is one engine call.
type durableStreams struct {
	engine          func(context.Context) (*streamstore.Engine, error)
	shutdown        context.Context // done when the server begins to shut down
	log             *zap.Logger
	failLog         *sampledLog // store failures' warnings, the storage's (logsample.go)
	longPollTimeout time.Duration
	sseInterval     time.Duration
	sseKeepAlive    time.Duration // quiet this long, a feed gets its control event again; 0: hubKeepAlive
	maxAppend       int64
	chunkBytes      int
	jitter          func() int    // cursor jitter in seconds
	allowLoopback   bool          // webhook URLs may be on localhost (subscriptions.go)
	maxSubs         int           // subscriptions per stream root; 0: no limit (subscriptions.go)
	live            *liveReaders  // open SSE and long-poll reads, for metrics (metrics.go)
	fanout          fanout        // live feeds writing at once (sse.go)
	frames          frameCache    // data events shared by feeds at one position (sseframes.go)
	woken           func()        // tests: runs between a long-poll's wake-up and its next read
	hubs            *sseHubs      // feeds parked at their stream's tail (ssehub.go); nil: none
	writeTimeout    time.Duration // a feed write others wait for (sse.go); 0: the default
	subs            *subManagers  // the engine's subscriptions (subscriptions.go)
	privateReads    bool          // every cacheable read says "private" (cache_reads private)
}

// ServeHTTP dispatches on the method. The stream name is the request path as
// this handler sees it, checked before any I/O.
func (d *durableStreams) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if refuseConflicting(w, r.Header, dsSingleHeaders) {
		return
	}
	if conflictingClosed(r.Header) {
		fail(w, http.StatusBadRequest, hdrStreamClosed+" is given more than once, with different values")
		return
	}
	if d.serveReserved(w, r) { // __ds control paths come before streams (subscriptions.go)
		return
	}
	name := r.URL.Path
	if err := streamstore.ValidateName(name); err != nil {
		fail(w, http.StatusBadRequest, badRequestReason(err))
		return
	}
	switch r.Method {
	case http.MethodGet:
		d.get(w, r, name)
	case http.MethodHead:
		d.head(w, r, name)
	case http.MethodPut:
		d.create(w, r, name)
	case http.MethodPost:
		d.append(w, r, name)
	case http.MethodDelete:
		d.delete(w, r, name)
	default:
		w.Header().Set("Allow", allowedMethods)
		fail(w, http.StatusMethodNotAllowed, fmt.Sprintf("method %s is not allowed on a stream", r.Method))
	}
}

// create handles PUT: create a stream (or a fork of one), or confirm an
// identical one.
func (d *durableStreams) create(w http.ResponseWriter, r *http.Request, name string) {
	if refuseConflicting(w, r.Header, dsContentTypeHeader) {
		return
	}
	if err := refuseAppendHeaders(r.Header); err != nil {
		fail(w, http.StatusBadRequest, err.Error())
		return
	}
	fork, err := parseForkHeaders(r)
	if err != nil {
		fail(w, http.StatusBadRequest, err.Error())
		return
	}
	ct := r.Header.Get("Content-Type")
	if ct == "" && fork == nil {
		ct = defaultContentType // a fork without one inherits its source's
	}
	if ct != "" {
		if ct, err = newStreamContentType(ct); err != nil {
			fail(w, http.StatusBadRequest, err.Error())
			return
		}
	}
	expiry, err := parseExpiry(r.Header, time.Now())
	if err != nil {
		fail(w, http.StatusBadRequest, err.Error())
		return
	}
	body, ok := d.readBody(w, r)
	if !ok {
		return
	}
	req := streamstore.CreateRequest{
		ContentType: ct,
		Expiry:      expiry,
		Closed:      isTrue(r.Header.Get(hdrStreamClosed)),
	}

	eng, ok := d.engineFor(w, r)
	if !ok {
		return
	}
	var (
		info    streamstore.Info
		created bool
	)
	// A fork create is judged first against a fork of the same source
	// already under the name, without the source: a create repeated is
	// confirmed whatever became of the source since (deleted while forks
	// read it, trimmed past the point, grown past a tail the request left
	// implicit), as section 4.2 asks. Only when there is none is the
	// source looked at, and the fork made.
	confirm := fork != nil
	// RFC 9110 section 13.1.2: "*" is false when the resource has a
	// current representation, and a PUT is then 412, not the 200 of a
	// create confirmed. The engine judges it, so that the refusal renews
	// nothing.
	req.Exclusive = ifNoneMatchAny(r.Header)
	for {
		req.Records = nil
		ct := ct
		if confirm {
			cur, err := eng.Head(writeContext(r), name)
			if err != nil && !errors.Is(err, streamstore.ErrNotFound) && !errors.Is(err, streamstore.ErrGone) {
				// Not knowing what holds the name, the source cannot
				// judge a repeat: a fork made already would be refused
				// for what became of its source since.
				d.engineError(w, r, err)
				return
			}
			if err != nil || cur.Fork.Source != fork.from.Source {
				confirm = false
				continue
			}
			from, ok, err := forkPointOn(cur, fork)
			if err != nil {
				fail(w, http.StatusBadRequest, err.Error())
				return
			}
			if !ok {
				confirm = false
				continue
			}
			req.Fork = &from
			if ct == "" {
				ct = cur.ContentType
			}
		} else if fork != nil {
			srcCT, ok := d.resolveFork(w, r, eng, fork)
			if !ok {
				return
			}
			req.Fork = &fork.from
			if ct == "" {
				ct = srcCT // the initial body is read as the inherited type
			}
		}
		if len(body) > 0 {
			if isJSON(ct) {
				msgs, jerr := jsonMessages(body)
				if jerr != nil {
					if fork == nil || confirm {
						// A create of a stream that exists is judged on
						// its settings, whatever its body (section 5.1):
						// with this body, only confirmed, never made.
						req.ConfirmOnly = true
						info, created, err = eng.Create(writeContext(r), name, req)
						req.ConfirmOnly = false
						if confirm && errors.Is(err, streamstore.ErrNotFound) {
							// Deleted since the look: a new fork, whose
							// source is judged before its body.
							confirm = false
							continue
						}
						if !errors.Is(err, streamstore.ErrNotFound) {
							break
						}
					}
					fail(w, bodyErrorStatus(jerr), jerr.Error())
					return
				}
				req.Records = toRecords(msgs) // "[]" creates an empty stream
			} else {
				req.Records = []streamstore.NewRecord{{Body: body}}
			}
		}
		info, created, err = eng.Create(writeContext(r), name, req)
		if confirm && errors.Is(err, streamstore.ErrNotFound) {
			confirm = false // deleted since the look: a fork to make
			continue
		}
		break
	}
	if errors.Is(err, streamstore.ErrExists) {
		fail(w, http.StatusPreconditionFailed, "If-None-Match: * asks for a new stream, and the stream exists")
		return
	}
	if err != nil {
		var trimmed *streamstore.TrimmedError
		if errors.As(err, &trimmed) {
			// A trim of the source raced this fork past its point.
			failForkTrimmed(w, position{seq: trimmed.Seq}, trimmed.StartSeq)
			return
		}
		d.engineError(w, r, err)
		return
	}
	if !created && req.Exclusive {
		// Not expected (the engine refuses with ErrExists), but never a
		// 200 for a create that asked for a new stream.
		fail(w, http.StatusPreconditionFailed, "If-None-Match: * asks for a new stream, and the stream exists")
		return
	}
	h := w.Header()
	h.Set("Content-Type", info.ContentType)
	h.Set(hdrStreamNextOffset, tailOf(info).String())
	if info.Closed {
		h.Set(hdrStreamClosed, "true")
	}
	h.Set("Cache-Control", cacheControlNoStore)
	if !created {
		w.WriteHeader(http.StatusOK)
		return
	}
	h.Set("Location", publicURL(r, name))
	w.WriteHeader(http.StatusCreated)
}

// refuseConflicting answers 400 when the request gives one of names
// (canonical) more than once with different values (conflictingHeader),
// and reports whether it did.
func refuseConflicting(w http.ResponseWriter, h http.Header, names []string) bool {
	name, bad := conflictingHeader(h, names)
	if bad {
		fail(w, http.StatusBadRequest, fmt.Sprintf("%s is given more than once, with different values", displayHeader(name)))
	}
	return bad
}

// refuseAppendHeaders refuses, on a create, the headers that section 5.2
// defines for appends only: Stream-Seq and the producer headers. Section
// 5.1 gives a create none of them and the reference server ignores them
// there, so a create's body would be stored without the check they ask
// for, and an append retrying the same data with them stored it again. A
// writer that needs them creates without a body and appends with POST.
func refuseAppendHeaders(h http.Header) error {
	var named []string
	for _, name := range []string{hdrStreamSeq, hdrProducerID, hdrProducerEpoch, hdrProducerSeq} {
		if _, ok := headerValue(h, name); ok {
			named = append(named, name)
		}
	}
	if len(named) == 0 {
		return nil
	}
	return fmt.Errorf("%s: only an append (POST) takes these; a create (PUT) does not check or record them, "+
		"so create the stream without a body and append the first data with POST", strings.Join(named, ", "))
}

// forkRequest is a parsed fork: the source's name and the divergence point
// as the client gave it. from is completed by resolveFork.
type forkRequest struct {
	from      streamstore.ForkFrom
	offset    *position // nil: the source's tail
	fromStart bool      // offset -1: the source's first retained position
	subOffset uint64    // bytes, or messages on a JSON source
}

// parseForkHeaders reads the fork headers of a PUT (section 4.2) without any
// I/O. It returns nil for a plain create.
func parseForkHeaders(r *http.Request) (*forkRequest, error) {
	src, hasSrc := headerValue(r.Header, hdrForkedFrom)
	off, hasOff := headerValue(r.Header, hdrForkOffset)
	sub, hasSub := headerValue(r.Header, hdrForkSubOffset)
	if !hasSrc {
		if hasOff || hasSub {
			return nil, errors.New("Stream-Fork-Offset and Stream-Fork-Sub-Offset need Stream-Forked-From")
		}
		return nil, nil
	}
	f := &forkRequest{}
	name, err := forkSourceName(r, src)
	if err != nil {
		return nil, err
	}
	f.from.Source = name
	if hasOff {
		o, err := parseOffset(off)
		if err != nil {
			return nil, fmt.Errorf("malformed Stream-Fork-Offset %q", off)
		}
		switch o.kind {
		case offsetStart:
			f.fromStart = true
		case offsetAt:
			f.offset = &o.pos
		}
	}
	if hasSub {
		n, ok := parseDigits(sub)
		if !ok || (len(sub) > 1 && sub[0] == '0') || n > maxSafeInteger {
			return nil, fmt.Errorf("Stream-Fork-Sub-Offset must be a non-negative integer, got %q", sub)
		}
		if n > 0 && !hasOff {
			return nil, errors.New("Stream-Fork-Sub-Offset needs Stream-Fork-Offset")
		}
		f.subOffset = n
	}
	return f, nil
}

// forkSourceName maps Stream-Forked-From, a path in the client's URL space,
// back to a stream name: the prefix Caddy stripped before this handler is
// removed, so only streams this handler serves can be forked. An absolute
// URL's host may be the Host header or the public host of publicOrigin, so
// a Location written behind a trusted proxy names its source.
func forkSourceName(r *http.Request, v string) (string, error) {
	u, err := url.Parse(v)
	if err != nil {
		return "", fmt.Errorf("malformed Stream-Forked-From %q", v)
	}
	if _, public := publicOrigin(r); u.Host != "" && !strings.EqualFold(u.Host, r.Host) && !strings.EqualFold(u.Host, public) {
		return "", errors.New("Stream-Forked-From must name a stream on this server")
	}
	p := u.Path
	if prefix := clientPrefix(r); prefix != "" {
		rest, ok := strings.CutPrefix(p, prefix)
		if !ok || !strings.HasPrefix(rest, "/") {
			return "", fmt.Errorf("Stream-Forked-From must name a stream under %s", prefix)
		}
		p = rest
	}
	if err := streamstore.ValidateName(p); err != nil {
		return "", fmt.Errorf("Stream-Forked-From: %v", err)
	}
	return p, nil
}

// resolveFork turns the fork offset and sub-offset into the engine's
// (seq, bytes) form, which needs the source's tail and content type. It
// answers errors itself and returns the source's content type.
func (d *durableStreams) resolveFork(w http.ResponseWriter, r *http.Request, eng *streamstore.Engine, f *forkRequest) (string, bool) {
	src, err := eng.Head(writeContext(r), f.from.Source)
	switch {
	case errors.Is(err, streamstore.ErrNotFound):
		fail(w, http.StatusNotFound, "the Stream-Forked-From stream does not exist")
		return "", false
	case errors.Is(err, streamstore.ErrGone):
		fail(w, http.StatusConflict, "the Stream-Forked-From stream was deleted")
		return "", false
	case err != nil:
		d.engineError(w, r, err)
		return "", false
	}
	at := tailOf(src)
	f.from.Tail = !f.fromStart && f.offset == nil
	switch {
	case f.fromStart:
		// As on reads, -1 is the first position a trim left.
		at = position{seq: src.StartSeq}
	case f.offset != nil:
		at = *f.offset
	}
	if at.seq < src.StartSeq {
		// The source's records there were trimmed: nothing to inherit
		// (section 5.6 answers 410 for reads below the retained start).
		failForkTrimmed(w, at, src.StartSeq)
		return "", false
	}
	if isJSON(src.ContentType) {
		// Sub-offsets count messages, and each message is one record.
		if at.off > 0 {
			fail(w, http.StatusBadRequest, "Stream-Fork-Offset points inside a JSON message")
			return "", false
		}
		if f.subOffset > src.NextSeq || at.seq > src.NextSeq-f.subOffset {
			fail(w, http.StatusBadRequest, "the fork point is beyond the source's tail")
			return "", false
		}
		f.from.Seq, f.from.Bytes = at.seq+f.subOffset, 0
	} else {
		// Byte sub-offsets may reach past the anchor's record; the engine
		// resolves them against the records that follow.
		f.from.Seq, f.from.Bytes = at.seq, at.off+f.subOffset
	}
	return src.ContentType, true
}

// forkPointOn is the fork point f asks for, in the engine's terms, judged
// against cur, an existing fork of the same source: an offset is read as
// resolveFork reads it, with cur's content type (a fork's is its
// source's), and -1 is the source's start when cur was made. No offset is
// cur's own point if cur's create named none either (the source's tail
// then); otherwise ok is false and the request is judged against the
// source's tail now, as before forks remembered it. The point only
// confirms cur.
func forkPointOn(cur streamstore.Info, f *forkRequest) (from streamstore.ForkFrom, ok bool, err error) {
	from = streamstore.ForkFrom{Source: f.from.Source, Existing: true}
	var at position
	switch {
	case f.fromStart:
		at = position{seq: cur.Fork.Start}
	case f.offset != nil:
		at = *f.offset
	case cur.Fork.Tail:
		from.Seq, from.Bytes, from.Tail = cur.Fork.Seq, cur.Fork.Bytes, true
		return from, true, nil
	default:
		return from, false, nil
	}
	if isJSON(cur.ContentType) {
		if at.off > 0 {
			return from, false, errors.New("Stream-Fork-Offset points inside a JSON message")
		}
		from.Seq = at.seq + f.subOffset
	} else {
		from.Seq, from.Bytes = at.seq, at.off+f.subOffset
	}
	return from, true, nil
}

// failForkTrimmed answers a fork whose point at is below start, the
// source's first retained seq.
func failForkTrimmed(w http.ResponseWriter, at position, start uint64) {
	fail(w, http.StatusGone, fmt.Sprintf("Stream-Fork-Offset %s is before the source's earliest retained offset %s: "+
		"the records there were trimmed", at, position{seq: start}))
}

// append handles POST: append, close, or append and close.
func (d *durableStreams) append(w http.ResponseWriter, r *http.Request, name string) {
	closeReq := isTrue(r.Header.Get(hdrStreamClosed))
	producer, err := parseProducer(r.Header)
	if err != nil {
		fail(w, http.StatusBadRequest, err.Error())
		return
	}
	streamSeq, err := parseStreamSeq(r.Header)
	if err != nil {
		fail(w, http.StatusBadRequest, err.Error())
		return
	}
	body, ok := d.readBody(w, r)
	if !ok {
		return
	}
	req := streamstore.AppendRequest{
		Close:     closeReq,
		Producer:  producer,
		StreamSeq: streamSeq,
	}
	if len(body) == 0 {
		if !closeReq {
			fail(w, http.StatusBadRequest, "empty body: an append needs data (or Stream-Closed: true to close the stream)")
			return
		}
		// Close-only: the content type is ignored, whatever a client
		// library attached.
	} else {
		if refuseConflicting(w, r.Header, dsContentTypeHeader) {
			return
		}
		raw := r.Header.Get("Content-Type")
		if raw == "" {
			fail(w, http.StatusBadRequest, "Content-Type is required when appending data")
			return
		}
		ct, err := normalizeContentType(raw)
		if err != nil {
			fail(w, http.StatusBadRequest, err.Error())
			return
		}
		// The engine compares media types, ignoring case and parameters,
		// and only after checking closure, as the protocol orders them.
		req.ContentType = ct
		if isJSON(ct) {
			msgs, err := jsonMessages(body)
			if err == nil && len(msgs) == 0 {
				err = errors.New("empty JSON array: an append needs at least one message")
			}
			if err != nil {
				d.refuseBody(w, r, name, ct, err)
				return
			}
			req.Records = toRecords(msgs)
		} else {
			req.Records = []streamstore.NewRecord{{Body: body}}
		}
	}

	eng, ok := d.engineFor(w, r)
	if !ok {
		return
	}
	// Closing a closed stream is idempotent (section 5.2): the engine
	// answers a close-only request without a producer as a success, and
	// with one only when it repeats the request that closed the stream
	// (section 5.2.1); any other producer tuple is refused with 409 and
	// Stream-Closed, as the reference server does and as an append is.
	res, err := eng.Append(writeContext(r), name, req)
	if err != nil {
		d.engineError(w, r, closingError(req, err))
		return
	}
	h := w.Header()
	h.Set(hdrStreamNextOffset, position{seq: res.NextSeq}.String())
	if res.Closed {
		h.Set(hdrStreamClosed, "true")
	}
	status := http.StatusNoContent
	if producer != nil {
		h.Set(hdrProducerEpoch, strconv.FormatUint(res.ProducerEpoch, 10))
		h.Set(hdrProducerSeq, strconv.FormatUint(res.ProducerSeq, 10))
		// With producer headers, 200 means "new data written" and 204 a
		// recognised retry or a close without data (section 5.2.1).
		if !res.Duplicate && len(req.Records) > 0 {
			status = http.StatusOK
		}
	}
	w.WriteHeader(status)
}

// refuseBody answers an append whose body is not valid in its content type
// ct. Section 5.2 puts a closed stream's 409 and a content-type mismatch's
// 409 before that 400, and only the stream knows either, so its state is
// looked up, on this error path only (from memory, unless the stream was
// evicted). A stream that is not there is told so (404, or 410 when
// soft-deleted, the answer section 4.2 gives every operation on its URL);
// one that cannot be looked up gets the 400: the body is wrong whatever
// the stream.
func (d *durableStreams) refuseBody(w http.ResponseWriter, r *http.Request, name, ct string, bodyErr error) {
	if eng, err := d.engine(r.Context()); err == nil {
		info, err := eng.Head(writeContext(r), name)
		if errors.Is(err, streamstore.ErrNotFound) || errors.Is(err, streamstore.ErrGone) {
			d.engineError(w, r, err)
			return
		}
		if err == nil {
			switch {
			case info.Closed:
				d.engineError(w, r, &streamstore.ClosedError{NextSeq: info.NextSeq})
				return
			case !sameMediaType(ct, info.ContentType):
				d.engineError(w, r, &streamstore.ContentTypeError{Sent: ct, Stream: info.ContentType})
				return
			}
		}
	}
	fail(w, bodyErrorStatus(bodyErr), bodyErr.Error())
}

// head handles HEAD: the stream's metadata, without renewing its TTL.
func (d *durableStreams) head(w http.ResponseWriter, r *http.Request, name string) {
	eng, ok := d.engineFor(w, r)
	if !ok {
		return
	}
	info, err := eng.Head(r.Context(), name)
	if err != nil {
		d.engineError(w, r, err)
		return
	}
	h := w.Header()
	h.Set("Content-Type", info.ContentType)
	h.Set(hdrStreamNextOffset, tailOf(info).String())
	if info.Expiry.TTL > 0 {
		h.Set(hdrStreamTTL, ttlSeconds(info.Expiry.TTL))
	}
	if !info.Expiry.ExpiresAt.IsZero() {
		h.Set(hdrStreamExpiresAt, info.Expiry.ExpiresAt.UTC().Format(time.RFC3339Nano))
	}
	if info.Closed {
		h.Set(hdrStreamClosed, "true")
	}
	h.Set("Cache-Control", cacheControlNoStore)
	w.WriteHeader(http.StatusOK)
}

// delete handles DELETE.
func (d *durableStreams) delete(w http.ResponseWriter, r *http.Request, name string) {
	eng, ok := d.engineFor(w, r)
	if !ok {
		return
	}
	if err := eng.Delete(r.Context(), name); err != nil {
		d.engineError(w, r, err)
		return
	}
	w.Header().Set("Cache-Control", cacheControlNoStore)
	w.WriteHeader(http.StatusNoContent)
}

// get handles GET: catch-up, long-poll or SSE reads.
func (d *durableStreams) get(w http.ResponseWriter, r *http.Request, name string) {
	q, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		fail(w, http.StatusBadRequest, fmt.Sprintf("malformed query string: %v", err))
		return
	}
	if name := repeatedParam(q, "offset", "live", "cursor"); name != "" {
		fail(w, http.StatusBadRequest, name+" given more than once")
		return
	}
	if err := checkCursor(q.Get("cursor")); err != nil {
		fail(w, http.StatusBadRequest, err.Error())
		return
	}
	off := readOffset{kind: offsetStart}
	offs, hasOffset := q["offset"]
	if hasOffset {
		if off, err = parseOffset(offs[0]); err != nil {
			fail(w, http.StatusBadRequest, fmt.Sprintf("malformed offset %q", offs[0]))
			return
		}
	}
	live := q.Get("live")
	if live != "" && live != "long-poll" && live != "sse" {
		fail(w, http.StatusBadRequest, fmt.Sprintf("unknown live mode %q (use long-poll or sse)", live))
		return
	}
	if live != "" && !hasOffset {
		fail(w, http.StatusBadRequest, fmt.Sprintf("live=%s needs an offset (use offset=-1 for the start or offset=now for the tail)", live))
		return
	}

	eng, ok := d.engineFor(w, r)
	if !ok {
		return
	}
	d.live.begin(live)
	defer d.live.end(live)
	switch live {
	case "long-poll":
		d.longPoll(w, r, eng, name, off, q.Get("cursor"))
	case "sse":
		d.sse(w, r, eng, name, off, q.Get("cursor"))
	default:
		d.catchUp(w, r, eng, name, off, hasOffset)
	}
}

// catchUp answers a plain GET with at most one chunk; hasOffset says the
// URL named where.
func (d *durableStreams) catchUp(w http.ResponseWriter, r *http.Request, eng *streamstore.Engine, name string, off readOffset, hasOffset bool) {
	readAt := time.Now() // no later than the read's renewal of a sliding TTL
	c, err := d.read(writeContext(r), eng, name, off)
	if err != nil {
		d.readError(w, r, err)
		return
	}
	defer c.release()
	switch {
	case off.kind == offsetNow:
		// The tail moves, so an offset=now answer must not be cached.
		d.writeChunk(w, r, c, "", cacheControlNoStore, false)
	case !hasOffset:
		// The URL without an offset is HEAD's too (with whatever else
		// the site's clients put in the query, a token say), and caches
		// (nginx's proxy_cache, Varnish) fetch a HEAD as a GET and answer
		// later HEADs from the GET they kept: HEAD would then give this
		// chunk's end for the tail and lack the stream's TTL and closure,
		// for as long as it is kept. Clients that page through a stream
		// name the offset.
		d.writeChunk(w, r, c, "", cacheControlNoStore, true)
	case !c.hasData() && !c.closed:
		// "Nothing here yet" is true only until the next append (or the
		// close, whose EOF answer a cached copy would hide); data and EOF
		// answers never change, so only they are cacheable.
		d.writeChunk(w, r, c, "", cacheControlNoStore, true)
	default:
		d.writeChunk(w, r, c, "", readCacheControl(r, d.privateReads, c.info.Expiry, readAt), true)
	}
}

// longPoll answers at once when data is there, else waits up to the
// long-poll timeout for some.
func (d *durableStreams) longPoll(w http.ResponseWriter, r *http.Request, eng *streamstore.Engine, name string, off readOffset, clientCursor string) {
	readAt := time.Now() // no later than any read's renewal of a sliding TTL
	c, err := d.read(writeContext(r), eng, name, off)
	if err != nil {
		d.readError(w, r, err)
		return
	}
	defer func() { c.release() }()
	cursor := nextCursor(time.Now(), clientCursor, d.jitter)
	// An answer is cacheable under its offset and cursor (section 10.1),
	// except at offset=now: the URL names the tail, which moves, and a
	// cached answer would give clients that come later records from
	// before they asked, not the first ones after. As for a catch-up read
	// at now, no-store and no ETag.
	for {
		if c.hasData() {
			cacheControl, withETag := readCacheControl(r, d.privateReads, c.info.Expiry, readAt), true
			if off.kind == offsetNow {
				cacheControl, withETag = cacheControlNoStore, false
			}
			d.writeChunk(w, r, c, cursor, cacheControl, withETag)
			return
		}
		if c.closed {
			d.writeNoContent(w, c.next, true, "")
			return
		}
		if !c.upToDate {
			// Behind the tail yet nothing read: waiting would spin.
			d.engineError(w, r, errNoProgress)
			return
		}
		// A server write timeout shorter than the wait would lose the
		// answer; the long-poll timeout bounds the response instead
		// (and Caddy's own deadline, which stays, ends it early: see
		// liveDeadline).
		_ = http.NewResponseController(w).SetWriteDeadline(time.Time{})
		info, err := d.wait(r, eng, name, c.info.ID, c.next, d.longPollTimeout)
		switch {
		case errors.Is(err, errWaitOver):
			// Timeout or server shutdown: tell the client where the tail is.
			d.writeNoContent(w, c.next, false, cursor)
			return
		case err != nil:
			d.engineError(w, r, err)
			return
		case info.ID != c.info.ID:
			fail(w, http.StatusNotFound, "stream was deleted")
			return
		}
		if d.woken != nil {
			d.woken()
		}
		c.release()
		// A read from the start reads from the start again: a trim that
		// landed with the records it waited for moved the start past
		// where it waited, and what it asked for is what is retained.
		again := readOffset{kind: offsetAt, pos: c.next}
		if off.kind == offsetStart {
			again = off
		}
		id := c.info.ID
		if c, err = d.read(writeContext(r), eng, name, again); err != nil {
			d.readError(w, r, err)
			return
		}
		if c.info.ID != id {
			// Deleted and created again since the wake-up: the new
			// stream's records are no continuation of what was asked.
			fail(w, http.StatusNotFound, "stream was deleted")
			return
		}
	}
}

// errNoProgress reports a read below the tail that returned nothing, which
// the engine promises never happens; live reads stop rather than spin.
var errNoProgress = errors.New("read below the tail returned no records")

// errWaitOver means a live read should end normally: its time is up or the
// server is shutting down.
var errWaitOver = errors.New("wait over")

// wait waits up to limit for the stream to move past pos. It returns
// errWaitOver when limit passes or the server shuts down, the client's
// context error when the client left, or the engine's error.
func (d *durableStreams) wait(r *http.Request, eng *streamstore.Engine, name, id string, pos position, limit time.Duration) (streamstore.Info, error) {
	lw := newLiveWait(r, d.shutdown, liveDeadline(r, limit))
	defer lw.close()
	return lw.wait(eng, name, id, pos.seq, 0)
}

// sse streams the stream as Server-Sent Events until the reconnect interval
// passes, the stream is closed, the client leaves or the server shuts down.
func (d *durableStreams) sse(w http.ResponseWriter, r *http.Request, eng *streamstore.Engine, name string, off readOffset, clientCursor string) {
	c, err := d.read(writeContext(r), eng, name, off)
	if err != nil {
		d.readError(w, r, err)
		return
	}
	id := c.info.ID
	enc := sseEncodingOf(c.info.ContentType)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	if off.kind == offsetNow {
		// A cache collapsing readers onto one feed sends it from its
		// start: a reader joining later would get records from before
		// it asked, as a long-poll at now would (which is no-store too).
		h.Set("Cache-Control", cacheControlNoStore)
	} else {
		h.Set("Cache-Control", eventFeedCacheControl(r, d.privateReads))
	}
	if enc == sseBase64 {
		h.Set(hdrSSEDataEncoding, "base64")
	}
	// Events go straight to the response: a data event is one shared
	// frame, written whole, and the control event after it fits in the
	// response's own buffer, so no buffer of ours per feed.
	es, ok := startEventStream(w, r, 0)
	if !ok {
		return
	}
	// An event goes out in one write: the writer under us resets the
	// connection's deadline at every write, and two writes of one small
	// event may become two chunks. buf is reused from event to event, up
	// to a size; larger data events are written on their own.
	var buf []byte
	const maxJoined = 16 << 10
	event := func(data []byte, c sseControl) bool {
		if len(data) > maxJoined {
			if !es.write(data) {
				return false
			}
			data = nil
		}
		buf = appendSSEControl(append(buf[:0], data...), c)
		return es.write(buf)
	}
	control := func(c sseControl) bool { return event(nil, c) }

	deadline := liveDeadline(r, d.sseInterval)
	lw := newLiveWait(r, d.shutdown, deadline)
	defer lw.close()
	cursor := nextCursor(time.Now(), clientCursor, d.jitter)
	announced := false // a control event with upToDate has been sent for f.next
	alone := false     // wait without the hub this once: it stopped
	t := turn{gate: d.fanout, es: es, timeout: d.writeTimeout}
	defer t.release()
	f := frameFromChunk(c, enc, time.Now())
	c.release()
	for {
		t.limitWrites()
		switch {
		case f.hasData():
			if !event(f.data, frameControl(f, cursor)) || !es.flush() || f.closed {
				return
			}
			announced = f.upToDate
		case f.closed:
			// At the end of a closed stream: the final control event, then
			// the connection closes (section 5.8).
			control(sseControl{StreamNextOffset: f.next.String(), UpToDate: true, StreamClosed: true})
			es.flush()
			return
		case !f.upToDate:
			d.log.Error("SSE read made no progress", zap.String("stream", name), zap.Error(errNoProgress))
			return
		case !announced:
			if !control(sseControl{StreamNextOffset: f.next.String(), StreamCursor: cursor, UpToDate: true}) || !es.flush() {
				return
			}
			announced = true
		}
		t.release()

		if d.shutdown.Err() != nil {
			control(d.finalControl(f.next, cursor, f.upToDate))
			es.flush()
			return
		}
		remaining := time.Until(deadline)
		if remaining <= 0 {
			return // recycle: the client reconnects from its last offset
		}
		if f.upToDate && !alone && d.hubs != nil {
			key := hubKey{name: name, id: id, enc: enc}
			next, ended := d.hubs.parkAtTail(lw, dsHubSource{d: d, eng: eng, key: key}, eng, key, f.next, cursor, es,
				func(f *sseFrame) bool { return event(f.data, frameControl(f, cursor)) && es.flush() })
			switch ended {
			case nil: // the hub is at another position: wait alone
			case errFeedLeft: // time is up, the client left or the server shuts down
				if d.shutdown.Err() != nil {
					control(d.finalControl(next, cursor, atTail(r.Context(), eng, name, id, next)))
					es.flush()
				}
				return
			case errHubStopped:
				// Go on alone from where the hub left the feed, and meet
				// the reason (shutdown, deletion, a failed read) there.
				f = &sseFrame{id: id, start: next, next: next, tail: next.seq, upToDate: true}
				announced, alone = true, true
				continue
			default: // the write failed, or the stream closed and the hub said so
				return
			}
		}
		alone = false
		tail := f.tail
		if f.upToDate {
			info, err := lw.wait(eng, name, id, f.next.seq, keepAliveOr(d.sseKeepAlive))
			switch {
			case errors.Is(err, errKeepAlive):
				// Quiet all along: the control event again (not the
				// data already sent), as a parked feed gets it, and
				// then a try at the hub.
				f = &sseFrame{id: id, start: f.next, next: f.next, tail: f.next.seq, upToDate: true}
				announced = false
				continue
			case errors.Is(err, errWaitOver):
				if d.shutdown.Err() != nil {
					control(d.finalControl(f.next, cursor, true))
					es.flush()
				}
				return
			case err != nil:
				if r.Context().Err() == nil && !feedOver(err) {
					d.log.Warn("SSE wait failed", zap.String("stream", name), zap.Error(err))
				}
				return // deleted or taken over: a reconnect reports it (404, 410 when soft, 503)
			case info.ID != id:
				return // deleted or recreated; a reconnect reports it
			}
			tail = info.NextSeq
		}
		if !t.take(r.Context()) {
			return
		}
		if f, err = d.frameAt(r.Context(), eng, name, id, f.next, tail, enc); err != nil {
			if errors.Is(err, streamstore.ErrDamaged) {
				es.endDamaged(err)
				return
			}
			if r.Context().Err() == nil && !feedOver(err) {
				d.log.Warn("SSE read failed", zap.String("stream", name), zap.Error(err))
			}
			return
		}
		if f.id != id {
			return
		}
		if f.hasData() {
			announced = false
		}
	}
}

// finalControl is the control event that tells an SSE client where to
// resume when the server ends the feed early (shutdown or reload).
func (d *durableStreams) finalControl(next position, cursor string, upToDate bool) sseControl {
	return sseControl{StreamNextOffset: next.String(), StreamCursor: cursor, UpToDate: upToDate}
}

// chunk is the result of one read, shaped for the protocol.
type chunk struct {
	info  streamstore.Info
	start position // where the chunk begins
	next  position // where the next read begins
	json  bool     // JSON mode: msgs holds whole messages
	// Bytes mode: the stream bytes, as slices of the engine's records (or
	// of their ends), in order. They are not copied into one buffer: a
	// catch-up chunk is a megabyte, and most go straight to a socket.
	parts    [][]byte
	size     int // bytes in parts
	msgs     [][]byte
	upToDate bool // the chunk reaches the tail as of the read
	closed   bool // ... and the stream is closed: EOF
	done     func()
}

// release lets the engine reuse the memory of the chunk's bytes, once
// written or copied.
func (c *chunk) release() {
	if c.done != nil {
		c.done()
	}
}

func (c *chunk) add(b []byte) {
	if len(b) > 0 {
		c.parts = append(c.parts, b)
		c.size += len(b)
	}
}

// bytes returns the bytes-mode body in one slice (a copy unless it is one
// part).
func (c *chunk) bytes() []byte {
	if len(c.parts) == 1 {
		return c.parts[0]
	}
	out := make([]byte, 0, c.size)
	for _, p := range c.parts {
		out = append(out, p...)
	}
	return out
}

// joinBelow is the part size under which writeBody gathers parts into a
// buffer rather than write them one by one: a write per 1 KiB record
// would be a chunk and, past the response's buffer, a syscall each.
const joinBelow = 32 << 10

var joinBuffers = sync.Pool{New: func() any { b := make([]byte, 0, 64<<10); return &b }}

// writeBody writes the bytes-mode body: large parts as they are, runs of
// small ones gathered in a pooled buffer.
func (c *chunk) writeBody(w io.Writer) error {
	bp := joinBuffers.Get().(*[]byte)
	buf := (*bp)[:0]
	defer func() { *bp = buf[:0]; joinBuffers.Put(bp) }()
	for _, p := range c.parts {
		if len(p) < joinBelow && len(buf)+len(p) <= cap(buf) {
			buf = append(buf, p...)
			continue
		}
		if len(buf) > 0 {
			if _, err := w.Write(buf); err != nil {
				return err
			}
			buf = buf[:0]
		}
		if len(p) < joinBelow {
			buf = append(buf, p...)
			continue
		}
		if _, err := w.Write(p); err != nil {
			return err
		}
	}
	if len(buf) > 0 {
		_, err := w.Write(buf)
		return err
	}
	return nil
}

// hasData reports whether the chunk moves the reader forward.
func (c *chunk) hasData() bool { return c.next != c.start }

// payload is the response body: the bytes, or in JSON mode an array of the
// messages (an empty array when there are none).
func (c *chunk) payload() []byte {
	if !c.json {
		return c.bytes()
	}
	n := 2
	for _, m := range c.msgs {
		n += len(m) + 1
	}
	out := make([]byte, 0, n)
	out = append(out, '[')
	for i, m := range c.msgs {
		if i > 0 {
			out = append(out, ',')
		}
		out = append(out, m...)
	}
	return append(out, ']')
}

// etag identifies the chunk's answer: stream id, range and, once the chunk
// carries the EOF signal, the closure (so a 304 can never hide it). A
// chunk that ends exactly at a byte limit may reach the tail now and not
// once more is appended, the range unchanged: "u" marks the first, so that
// a revalidation replaces a kept Stream-Up-To-Date (a 304 can add or
// replace a kept header, never drop one).
func (c *chunk) etag() string {
	tag := c.info.ID + ":" + c.start.String() + ":" + c.next.String()
	switch {
	case c.closed:
		tag += ":c"
	case c.upToDate:
		tag += ":u"
	}
	return `"` + tag + `"`
}

// offsetError is a read offset the stream cannot serve; it is the client's
// fault (400).
type offsetError struct{ msg string }

func (e *offsetError) Error() string { return e.msg }

// read reads one chunk at off.
func (d *durableStreams) read(ctx context.Context, eng *streamstore.Engine, name string, off readOffset) (chunk, error) {
	if off.kind == offsetNow {
		res, err := eng.Read(ctx, name, streamstore.ReadRequest{Tail: true})
		if err != nil {
			return chunk{}, err
		}
		tail := tailOf(res.Info)
		return chunk{
			info:     res.Info,
			start:    tail,
			next:     tail,
			json:     isJSON(res.Info.ContentType),
			upToDate: true,
			closed:   res.Info.Closed,
		}, nil
	}
	var from position
	if off.kind == offsetAt {
		from = off.pos
	}
	req := streamstore.ReadRequest{Seq: from.seq, MaxBytes: d.chunkBytes + int(min(from.off, uint64(d.chunkBytes))),
		MaxRecords: dsChunkRecords, Until: time.Now().Add(catchUpBudget)}
	if from.off > 0 {
		// Only a position inside a record can be refused with what the
		// engine reads: judged there, the refusal is no access to the
		// stream, and renews no TTL.
		req.Judge = func(info streamstore.Info, recs []streamstore.Record) error {
			return offsetProblem(from, info, recs)
		}
	}
	res, err := eng.Read(ctx, name, req)
	if err != nil && off.kind == offsetStart && errors.Is(err, streamstore.ErrGone) {
		// "-1" means the first retained record, wherever trims left it.
		if info, herr := eng.Head(ctx, name); herr == nil && info.StartSeq > 0 {
			from.seq = info.StartSeq
			req.Seq = from.seq
			res, err = eng.Read(ctx, name, req)
		}
	}
	if err != nil {
		return chunk{}, err
	}
	c, err := assemble(res, from, d.chunkBytes)
	if err != nil {
		res.Release()
		return chunk{}, err
	}
	if !c.hasData() && !c.upToDate && c.start != from {
		// off was the end of its record (a fork cut there), and that
		// record filled the engine's read by itself: nothing of it is
		// sent, so the read brought nothing yet stopped short of the
		// tail. Read on from the next record; the offset names the same
		// position.
		res.Release()
		return d.read(ctx, eng, name, readOffset{kind: offsetAt, pos: c.start})
	}
	c.done = res.Release
	return c, nil
}

// offsetProblem refuses a read from position from of a stream in state
// info, given the records read from from.seq on: a position past the tail,
// inside a JSON message, or past the end of its record.
func offsetProblem(from position, info streamstore.Info, recs []streamstore.Record) error {
	tail := tailOf(info)
	if from.seq > tail.seq || (from.seq == tail.seq && from.off > 0) {
		return &offsetError{"offset is beyond the end of the stream"}
	}
	if from.off == 0 {
		return nil
	}
	if isJSON(info.ContentType) {
		return &offsetError{"offset points inside a JSON message"}
	}
	if len(recs) > 0 && recs[0].Seq == from.seq && from.off > uint64(len(recs[0].Body)) {
		return &offsetError{"offset is beyond the end of its record"}
	}
	return nil
}

// assemble turns an engine read into a chunk of at most limit stream bytes.
// In bytes mode a record that does not fit is left for the next read, unless
// it is the first, which is then split (text at a UTF-8 boundary). JSON
// messages are never split.
func assemble(res streamstore.ReadResult, from position, limit int) (chunk, error) {
	info := res.Info
	c := chunk{info: info, start: from, next: from, json: isJSON(info.ContentType)}
	if err := offsetProblem(from, info, res.Records); err != nil {
		return chunk{}, err
	}
	textual := isTextual(info.ContentType)
	complete := true // every record the engine returned is in the chunk
	size := 0
	for _, rec := range res.Records {
		if rec.Seq < c.next.seq {
			continue
		}
		if rec.Seq != c.next.seq {
			complete = false // a gap would be an engine bug; never skip data
			break
		}
		if c.json {
			if len(c.msgs) > 0 && size+len(rec.Body)+1 > limit {
				complete = false
				break
			}
			c.msgs = append(c.msgs, rec.Body)
			size += len(rec.Body) + 1
			c.next = position{seq: rec.Seq + 1}
			continue
		}
		skip := uint64(0)
		if rec.Seq == from.seq && from.off > 0 {
			skip = from.off
			switch {
			case skip > uint64(len(rec.Body)):
				return chunk{}, &offsetError{"offset is beyond the end of its record"}
			case skip == uint64(len(rec.Body)):
				// The end of a record is where the next one starts: a fork
				// cut at a source offset inside a record ends that record
				// there, and reading the fork from that offset reads on.
				c.start = position{seq: rec.Seq + 1}
				c.next = c.start
				continue
			}
		}
		rest := rec.Body[skip:]
		room := limit - c.size
		if len(rest) > room {
			complete = false
			if c.size > 0 {
				break
			}
			cut := room
			if textual {
				cut = runeCut(rest, room)
			}
			c.add(rest[:cut])
			c.next = position{seq: rec.Seq, off: skip + uint64(cut)}
			break
		}
		c.add(rest)
		c.next = position{seq: rec.Seq + 1}
	}
	c.upToDate = complete && c.next.off == 0 && c.next.seq >= tailOf(info).seq
	c.closed = c.upToDate && info.Closed
	return c, nil
}

// runeCut returns a cut point at most n bytes into b that does not split a
// UTF-8 sequence, so that text split over two reads decodes piece by piece.
// It never returns 0 when n > 0: binary junk in a text stream is cut at n.
func runeCut(b []byte, n int) int {
	for i := n; i > 0 && i > n-utf8.UTFMax; i-- {
		if utf8.RuneStart(b[i]) {
			return i
		}
	}
	return n
}

// writeChunk writes a 200 read response. cursor is set on live responses.
func (d *durableStreams) writeChunk(w http.ResponseWriter, r *http.Request, c chunk, cursor, cacheControl string, withETag bool) {
	h := w.Header()
	h.Set("Content-Type", c.info.ContentType)
	h.Set(hdrStreamNextOffset, c.next.String())
	if c.upToDate {
		h.Set(hdrStreamUpToDate, "true")
	}
	if c.closed {
		h.Set(hdrStreamClosed, "true")
	} else if cursor != "" {
		h.Set(hdrStreamCursor, cursor)
	}
	h.Set("Cache-Control", cacheControl)
	if withETag {
		tag := c.etag()
		h.Set("ETag", tag)
		if etagMatches(ifNoneMatch(r.Header), tag) {
			w.WriteHeader(http.StatusNotModified)
			return
		}
	}
	if c.json {
		body := c.payload()
		h.Set("Content-Length", strconv.Itoa(len(body)))
		w.WriteHeader(http.StatusOK)
		w.Write(body)
		return
	}
	h.Set("Content-Length", strconv.Itoa(c.size))
	w.WriteHeader(http.StatusOK)
	c.writeBody(w)
}

// writeNoContent writes a long-poll 204: the client is at the tail.
func (d *durableStreams) writeNoContent(w http.ResponseWriter, tail position, closed bool, cursor string) {
	h := w.Header()
	h.Set(hdrStreamNextOffset, tail.String())
	h.Set(hdrStreamUpToDate, "true")
	if closed {
		h.Set(hdrStreamClosed, "true")
	} else {
		h.Set(hdrStreamCursor, cursor)
	}
	// CDNs should not cache an empty long-poll answer (section 10.1).
	h.Set("Cache-Control", cacheControlNoStore)
	w.WriteHeader(http.StatusNoContent)
}

// ifNoneMatchAny reports whether If-None-Match holds "*", in any of its
// lines.
func ifNoneMatchAny(h http.Header) bool {
	for _, v := range h.Values("If-None-Match") {
		for _, t := range strings.Split(v, ",") {
			if strings.TrimSpace(t) == "*" {
				return true
			}
		}
	}
	return false
}

// ifNoneMatch is the request's If-None-Match as one list. A list header
// may come on several lines, which mean what one line joining them with
// commas means (RFC 9110 section 5.3); Header.Get sees the first line only,
// and a tag on another went unmatched (200 where section 10.1 asks 304).
func ifNoneMatch(h http.Header) string { return strings.Join(h.Values("If-None-Match"), ", ") }

// etagMatches implements If-None-Match for our strong tags.
func etagMatches(header, tag string) bool {
	if header == "" {
		return false
	}
	for _, t := range strings.Split(header, ",") {
		t = strings.TrimSpace(t)
		if t == "*" || strings.TrimPrefix(t, "W/") == tag {
			return true
		}
	}
	return false
}

// tailOf is the offset after the last durable record.
func tailOf(info streamstore.Info) position { return position{seq: info.NextSeq} }

// toRecords wraps message bodies as records.
func toRecords(msgs [][]byte) []streamstore.NewRecord {
	recs := make([]streamstore.NewRecord, len(msgs))
	for i, m := range msgs {
		recs[i] = streamstore.NewRecord{Body: m}
	}
	return recs
}

// readBody reads an append or create body, answering 413, 415, 408 or 400
// itself.
func (d *durableStreams) readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	body, err := readBody(r, d.maxAppend, limitMaxAppendSize)
	switch {
	case errors.Is(err, errBodyTooLarge):
		fail(w, http.StatusRequestEntityTooLarge, err.Error())
		return nil, false
	case errors.Is(err, errBodyEncoded):
		w.Header().Set("Accept-Encoding", "identity")
		fail(w, http.StatusUnsupportedMediaType, err.Error())
		return nil, false
	case errors.Is(err, errBodyTimeout):
		fail(w, http.StatusRequestTimeout, err.Error())
		return nil, false
	case err != nil:
		fail(w, http.StatusBadRequest, err.Error())
		return nil, false
	}
	return body, true
}

// engineFor returns the engine, answering 503 itself while it is not
// available.
func (d *durableStreams) engineFor(w http.ResponseWriter, r *http.Request) (*streamstore.Engine, bool) {
	eng, err := d.engine(r.Context())
	if err != nil {
		d.engineError(w, r, err)
		return nil, false
	}
	return eng, true
}

// readError answers a failed read.
func (d *durableStreams) readError(w http.ResponseWriter, r *http.Request, err error) {
	var oe *offsetError
	if errors.As(err, &oe) {
		fail(w, http.StatusBadRequest, oe.msg)
		return
	}
	d.engineError(w, r, err)
}

// engineError maps an engine error to a response.
func (d *durableStreams) engineError(w http.ResponseWriter, r *http.Request, err error) {
	h := w.Header()
	var (
		closed *streamstore.ClosedError
		fenced *streamstore.FencedError
		gap    *streamstore.SequenceGapError
		start  *storageStartError
	)
	switch {
	case errors.As(err, &closed):
		h.Set(hdrStreamClosed, "true")
		h.Set(hdrStreamNextOffset, position{seq: closed.NextSeq}.String())
		fail(w, http.StatusConflict, "stream is closed")
	case errors.As(err, &fenced):
		h.Set(hdrProducerEpoch, strconv.FormatUint(fenced.CurrentEpoch, 10))
		fail(w, http.StatusForbidden, fmt.Sprintf("producer epoch is stale; the current epoch is %d", fenced.CurrentEpoch))
	case errors.As(err, &gap):
		h.Set(hdrProducerExpected, strconv.FormatUint(gap.Expected, 10))
		h.Set(hdrProducerReceived, strconv.FormatUint(gap.Received, 10))
		fail(w, http.StatusConflict, fmt.Sprintf("producer seq gap: expected %d, received %d", gap.Expected, gap.Received))
	case errors.Is(err, streamstore.ErrNotFound):
		fail(w, http.StatusNotFound, "stream not found")
	case errors.Is(err, streamstore.ErrGone):
		fail(w, http.StatusGone, dsGoneMessage(err))
	case errors.Is(err, streamstore.ErrConflict):
		// The engine's reason: another configuration, a fork's content
		// type, a name a soft-deleted stream still holds (section 4.2).
		fail(w, http.StatusConflict, err.Error())
	case errors.Is(err, streamstore.ErrContentType):
		fail(w, http.StatusConflict, contentTypeMessage(err))
	case errors.Is(err, streamstore.ErrStreamSeq):
		fail(w, http.StatusConflict, "Stream-Seq is not greater than the last one")
	case errors.Is(err, streamstore.ErrBadRequest):
		fail(w, http.StatusBadRequest, badRequestReason(err))
	case errors.Is(err, streamstore.ErrShuttingDown):
		h.Set("Retry-After", "1")
		fail(w, http.StatusServiceUnavailable, "server is shutting down; retry")
	case errors.As(err, &start):
		h.Set("Retry-After", "5")
		fail(w, http.StatusServiceUnavailable, start.reason())
	case errors.Is(err, streamstore.ErrTooLate):
		h.Set("Retry-After", "1")
		fail(w, http.StatusServiceUnavailable, tooLateMessageFor(r.Method))
	case errors.Is(err, streamstore.ErrTakenOver):
		d.failLog.warn(d.log, "storage taken over by another server", zap.String("method", r.Method), zap.String("stream", r.URL.Path), zap.Error(err))
		h.Set("Retry-After", "1")
		fail(w, http.StatusServiceUnavailable, takenOverMessageFor(r.Method))
	case errors.Is(err, streamstore.ErrUnconfirmed):
		d.failLog.warn(d.log, failWarning("write not confirmed in time", err), zap.String("method", r.Method), zap.String("stream", r.URL.Path), zap.Error(err))
		h.Set("Retry-After", "1")
		fail(w, http.StatusServiceUnavailable, unconfirmedMessage(r.Method, err))
	case errors.Is(err, streamstore.ErrBusy):
		h.Set("Retry-After", "1")
		fail(w, http.StatusServiceUnavailable, busyMessage)
	case errors.Is(err, streamstore.ErrDamaged):
		// The engine logged it once; a reader polling it must not
		// make a log line per request.
		fail(w, http.StatusInternalServerError, damagedMessage(err))
	case r.Context().Err() != nil && isRead(r.Method):
		// A reader that left: its read was cut short with it, which is
		// no storage failure, and nobody reads the answer.
	case errors.Is(err, streamstore.ErrUnavailable):
		d.failLog.warn(d.log, failWarning("storage unavailable", err), zap.String("method", r.Method), zap.String("stream", r.URL.Path), zap.Error(err))
		h.Set("Retry-After", "1")
		fail(w, http.StatusServiceUnavailable, unavailableMessage(r.Method, err))
	case r.Context().Err() != nil:
		// The client left; nobody reads the answer.
	default:
		d.log.Error("request failed", zap.String("method", r.Method), zap.String("stream", r.URL.Path), zap.Error(err))
		fail(w, http.StatusInternalServerError, "internal error")
	}
}

// dsGoneMessage tells a read below the records a trim left from a stream
// deleted while forks still read it, both of which the engine reports as
// ErrGone: an append or a DELETE names no offset.
func dsGoneMessage(err error) string {
	var trimmed *streamstore.TrimmedError
	if errors.As(err, &trimmed) {
		return fmt.Sprintf("offset is before the stream's earliest retained offset %s: the records there were trimmed",
			position{seq: trimmed.StartSeq})
	}
	return "stream was deleted; it is kept only for the forks that still read it"
}

// badRequestReason is the reason an error wrapping streamstore.ErrBadRequest
// gives, in either protocol, without the sentinel's "bad request: ", which
// the 400 says already.
func badRequestReason(err error) string {
	return strings.TrimPrefix(err.Error(), streamstore.ErrBadRequest.Error()+": ")
}

// contentTypeMessage is the reason of an append refused for its content
// type, in either protocol: both types, so that a client that sent one it
// did not mean to (curl's --data sends application/x-www-form-urlencoded)
// sees which.
func contentTypeMessage(err error) string {
	var ct *streamstore.ContentTypeError
	if errors.As(err, &ct) {
		return fmt.Sprintf("Content-Type %s does not match the stream's (%s)", ct.Sent, ct.Stream)
	}
	return "Content-Type does not match the stream's"
}

// damagedMessage answers a read that met streamstore.ErrDamaged, in either
// protocol: no retry helps until an operator restores the object named.
func damagedMessage(err error) string {
	return err.Error() + "; a retry does not help until the object is restored"
}

// tooLateMessage answers a write that streamstore.ErrTooLate refused, in
// either protocol: it could not be handed to storage in time to be
// answered before Caddy's write timeout.
const tooLateMessage = "the write could not be handed to storage before the server's write timeout; nothing was stored, retry"

// tooLateReadMessage answers a read whose stream could not be looked up in
// time to be answered before Caddy's write timeout.
const tooLateReadMessage = "the stream could not be read before the server's write timeout; retry"

// tooLateMessageFor is the answer to a request of method that failed with
// streamstore.ErrTooLate.
func tooLateMessageFor(method string) string {
	if isRead(method) {
		return tooLateReadMessage
	}
	return tooLateMessage
}

// unavailableMessage answers a request that failed with
// streamstore.ErrUnavailable, in either protocol: a write says that none of
// it was acknowledged, a read only that it may be retried. A write the
// storage refuses for good names the refusal.
func unavailableMessage(method string, err error) string {
	if reason, ok := streamstore.StorageRefusal(err); ok {
		// Refused before it was handed to storage: nothing of it can land.
		return "storage refuses writes: " + reason + "; nothing was written, retry once storage takes writes again"
	}
	if isRead(method) {
		return "storage unavailable; retry"
	}
	return "storage unavailable; nothing was acknowledged, retry"
}

// fail writes a short plain-text error. Headers already set (Stream-Closed,
// producer state) are kept; read-response headers are not.
func fail(w http.ResponseWriter, status int, msg string) {
	h := w.Header()
	h.Del("ETag")
	h.Del(hdrStreamUpToDate)
	h.Del(hdrStreamCursor)
	h.Set("Content-Type", "text/plain; charset=utf-8")
	h.Set("Cache-Control", cacheControlNoStore)
	w.WriteHeader(status)
	io.WriteString(w, msg+"\n")
}

// clientPrefix is the part of the client's URL path that Caddy stripped
// before this handler (handle_path, uri strip_prefix), so that URLs written
// back to clients stay in their URL space. The prefix is the client's own
// spelling (its case, a "//" the route may need) where the rest of its path
// is the stream's. strip_prefix cleans the path before it strips (dot
// segments, repeated slashes), so where that changed the rest
// (/app/ds/a//b is the stream /a/b) it is the prefix of the cleaned path;
// and so it is where the stream's name merely ends a path that was cleaned
// (/app/ds/a/../b, /app/ds//b are the stream /b under /app/ds, not under
// /app/ds/a/.. or /app/ds/).
func clientPrefix(r *http.Request) string {
	orig, ok := r.Context().Value(caddyhttp.OriginalRequestCtxKey).(http.Request)
	if !ok || orig.URL == nil {
		return ""
	}
	if p, found := strings.CutSuffix(orig.URL.Path, r.URL.Path); found && cleanPrefix(p) {
		return p
	}
	if p, found := strings.CutSuffix(caddyhttp.CleanPath(orig.URL.Path, true), r.URL.Path); found {
		return p
	}
	return ""
}

// cleanPrefix reports whether p, a prefix of a request's path, is one
// Caddy's cleaning leaves as it is but for repeated slashes inside it: no
// "." or ".." segment, and no trailing slash (the "//" before the rest).
func cleanPrefix(p string) bool {
	if strings.HasSuffix(p, "/") {
		return false
	}
	for _, seg := range strings.Split(p, "/") {
		if seg == "." || seg == ".." {
			return false
		}
	}
	return true
}

// publicURL is the absolute URL clients use for the stream name.
func publicURL(r *http.Request, name string) string {
	scheme, host := publicOrigin(r)
	u := url.URL{Scheme: scheme, Host: host, Path: clientPrefix(r) + name}
	return u.String()
}

// publicOrigin is the scheme and host clients reach this handler at. It is
// what Caddy itself saw (TLS or not, the Host header) unless the peer is a
// proxy that the server's trusted_proxies names: then, as Caddy's
// reverse_proxy does, the last X-Forwarded-Proto and X-Forwarded-Host it
// sent win, since a load balancer that terminates TLS hands Caddy plain
// HTTP for what clients asked over https. From any other peer the headers
// are ignored, so a client cannot steer the URLs written for others
// (subscription documents, jwks_url). A value that is no plain scheme or
// host is ignored too, even from a trusted proxy.
func publicOrigin(r *http.Request) (scheme, host string) {
	scheme, host = "http", r.Host
	if r.TLS != nil {
		scheme = "https"
	}
	if trusted, _ := caddyhttp.GetVar(r.Context(), caddyhttp.TrustedProxyVarKey).(bool); !trusted {
		return scheme, host
	}
	if p, ok := lastHeaderValue(r.Header, "X-Forwarded-Proto"); ok {
		if p = strings.ToLower(strings.TrimSpace(p)); p == "http" || p == "https" {
			scheme = p
		}
	}
	if h, ok := lastHeaderValue(r.Header, "X-Forwarded-Host"); ok && plainHost(strings.TrimSpace(h)) {
		host = strings.TrimSpace(h)
	}
	return scheme, host
}

// lastHeaderValue is the last line of the header field, the one the
// nearest proxy wrote.
func lastHeaderValue(h http.Header, field string) (string, bool) {
	v := h.Values(field)
	if len(v) == 0 {
		return "", false
	}
	return v[len(v)-1], true
}

// plainHost reports whether h is a host or host:port and nothing more: no
// list, user, path, query or fragment that would change the URL it goes in.
func plainHost(h string) bool {
	if h == "" || strings.ContainsAny(h, ",/?#@\\ \t") {
		return false
	}
	u, err := url.Parse("//" + h)
	return err == nil && u.Host == h && u.Path == "" && u.User == nil
}
