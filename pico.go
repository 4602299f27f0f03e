package picomq

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/internal/picowire"
	"github.com/picomq/caddy-picomq/streamstore"
)

// Read limits of the Pico protocol. A read returns at most chunkBytes
// (picoDefaultReadBytes) of record bodies unless the client asks for a
// different cap with bytes=, which may not exceed picoMaxReadBytes; and
// never more than picoMaxReadRecords records, so that records with empty
// bodies cannot make a response unbounded.
const (
	picoDefaultReadBytes = 1 << 20
	picoMaxReadBytes     = 4 << 20
	picoMaxReadRecords   = 10000
	picoMaxListLimit     = 1000
	picoMediaJSON        = "application/json"
	picoMediaSSE         = "text/event-stream"
)

// picoProtocol serves the Pico protocol (pico-wire.md), PicoMQ's native
// record API, on top of the engine: numeric seqs, batches, record headers
// and timestamps, conditional appends, trims and listing. Like the Durable
// Streams handler it knows nothing of storage, and both address the same
// streams when they share a storage.
type picoProtocol struct {
	engine          func(context.Context) (*streamstore.Engine, error)
	shutdown        context.Context // done when the server begins to shut down
	log             *zap.Logger
	failLog         *sampledLog // store failures' warnings, the storage's (logsample.go)
	longPollTimeout time.Duration
	sseInterval     time.Duration
	sseKeepAlive    time.Duration // quiet this long, a feed gets its control event again; 0: hubKeepAlive
	maxAppend       int64
	chunkBytes      int          // default cap on the body bytes of one read or SSE event
	jitter          func() int   // cursor jitter in seconds
	fanout          fanout       // live feeds writing at once (sse.go)
	live            *liveReaders // open SSE and long-poll reads, for metrics (metrics.go)
	hubs            *sseHubs     // SSE feeds parked at their stream's tail (ssehub.go); nil: none
	privateReads    bool         // every cacheable read says "private" (cache_reads private)
	woken           func()       // tests: runs between a long-poll's wake-up and its next read
}

// ServeHTTP dispatches on the method. The handler's root lists streams; any
// other path is a stream name, checked before any I/O.
func (p *picoProtocol) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Access-Control-Expose-Headers", picoExposedHeaders)
	if name, bad := conflictingHeader(r.Header, picoSingleHeaders); bad {
		picoFail(w, http.StatusBadRequest, picoErrBadRequest, fmt.Sprintf("%s is given more than once, with different values", displayHeader(name)), nil)
		return
	}
	name := r.URL.Path
	if name == "/" || name == "" {
		if r.Method == http.MethodGet {
			p.list(w, r)
			return
		}
		picoFail(w, http.StatusBadRequest, picoErrBadRequest, "no stream in the path; GET / lists streams", nil)
		return
	}
	if err := streamstore.ValidateName(name); err != nil {
		picoFail(w, http.StatusBadRequest, picoErrBadRequest, badRequestReason(err), nil)
		return
	}
	// Durable Streams serves its control resources under __ds segments,
	// so a stream named with one would be out of its reach. Only creates
	// are refused: one made before this rule is still read and deleted.
	if r.Method == http.MethodPut && hasReservedSegment(name) {
		picoFail(w, http.StatusBadRequest, picoErrBadRequest, fmt.Sprintf("stream name has the segment %q, which is reserved for Durable Streams control resources", reservedSegment), nil)
		return
	}
	switch r.Method {
	case http.MethodGet:
		p.get(w, r, name)
	case http.MethodHead:
		p.head(w, r, name)
	case http.MethodPut:
		p.create(w, r, name)
	case http.MethodPost:
		p.post(w, r, name)
	case http.MethodDelete:
		p.delete(w, r, name)
	default:
		w.Header().Set("Allow", allowedMethods)
		picoFail(w, http.StatusMethodNotAllowed, picoErrMethod, fmt.Sprintf("method %s is not allowed on a stream", r.Method), nil)
	}
}

// engineFor returns the engine, answering itself while it is not available.
func (p *picoProtocol) engineFor(w http.ResponseWriter, r *http.Request) (*streamstore.Engine, bool) {
	eng, err := p.engine(r.Context())
	if err != nil {
		p.engineError(w, r, err)
		return nil, false
	}
	return eng, true
}

// readBody reads a create or append body, answering 413, 415, 408 or 400
// itself.
func (p *picoProtocol) readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	body, err := readBody(r, p.maxAppend, limitMaxAppendSize)
	switch {
	case errors.Is(err, errBodyTooLarge):
		picoFail(w, http.StatusRequestEntityTooLarge, picoErrTooLarge, err.Error(), nil)
		return nil, false
	case errors.Is(err, errBodyEncoded):
		w.Header().Set("Accept-Encoding", "identity")
		picoFail(w, http.StatusUnsupportedMediaType, picoErrBadRequest, err.Error(), nil)
		return nil, false
	case errors.Is(err, errBodyTimeout):
		// The wire names no code of its own for it: the request was not
		// received whole, which bad_request covers; the status tells
		// the client a retry may succeed.
		picoFail(w, http.StatusRequestTimeout, picoErrBadRequest, err.Error(), nil)
		return nil, false
	case err != nil:
		picoFail(w, http.StatusBadRequest, picoErrBadRequest, err.Error(), nil)
		return nil, false
	}
	return body, true
}

// create handles PUT: create a stream, or confirm an identical one. A body
// becomes the first record, or the first records when its Content-Type is a
// batch format; a batch-typed create makes an application/octet-stream
// stream, with no records when it has no body.
func (p *picoProtocol) create(w http.ResponseWriter, r *http.Request, name string) {
	if with := createConflicts(r.Header); len(with) > 0 {
		picoFail(w, http.StatusBadRequest, picoErrBadRequest, strings.Join(with, ", ")+
			": only an append (POST) takes these; a create (PUT) does not check or record them, "+
			"so create the stream without a body and append the first records with POST", nil)
		return
	}
	raw := r.Header.Get("Content-Type")
	batch := raw != "" && isBatchType(raw)
	ct := defaultContentType
	if raw != "" && !batch {
		var err error
		if ct, err = newStreamContentType(raw); err != nil {
			picoFail(w, http.StatusBadRequest, picoErrBadRequest, err.Error(), nil)
			return
		}
	}
	expiry, err := parsePicoExpiry(r.Header, time.Now())
	if err != nil {
		picoFail(w, http.StatusBadRequest, picoErrBadRequest, err.Error(), nil)
		return
	}
	body, ok := p.readBody(w, r)
	if !ok {
		return
	}
	req := streamstore.CreateRequest{
		ContentType: ct,
		Expiry:      expiry,
		Closed:      isTrue(r.Header.Get(hdrPicoClosed)),
	}
	switch {
	case batch && len(body) > 0:
		if req.Records, err = decodeBatch(raw, body); err != nil {
			failBatch(w, err)
			return
		}
	case len(body) > 0:
		req.Records = []streamstore.NewRecord{{Body: body}}
		if isJSON(ct) && firstNonJSON(req.Records) >= 0 {
			picoFail(w, http.StatusBadRequest, picoErrBadRequest, nonJSONMessage(0), nil)
			return
		}
	}

	eng, ok := p.engineFor(w, r)
	if !ok {
		return
	}
	// The body was to be the first records: a repeated create is confirmed
	// only when they are (a retry whose answer was lost), as 200 alone
	// would tell the client its records are there. Until they are found to
	// be, the create is no access (Exclusive), so a refused one renews no
	// TTL; once they are, it is made again as the access it is.
	req.Exclusive = len(req.Records) > 0
	info, created, err := eng.Create(writeContext(r), name, req)
	for tries := 1; errors.Is(err, streamstore.ErrExists); tries++ {
		msg, id, cerr := p.firstRecordsDiffer(r.Context(), eng, name, req.Records)
		switch {
		case errors.Is(cerr, streamstore.ErrNotFound): // gone since: the create below makes it
		case cerr != nil:
			p.engineError(w, r, cerr)
			return
		case msg != "":
			picoFail(w, http.StatusConflict, picoErrConflict, msg, &info.NextSeq)
			return
		}
		req.Exclusive = false
		info, created, err = eng.Create(writeContext(r), name, req)
		if err == nil && !created && (cerr != nil || info.ID != id) {
			// Deleted and created again since the records were compared:
			// the stream that holds the name now is compared in its turn.
			if tries == 3 {
				picoFail(w, http.StatusConflict, picoErrConflict,
					"stream was deleted and created again while this create was checked against it; try again", &info.NextSeq)
				return
			}
			err = streamstore.ErrExists
		}
	}
	if err != nil {
		if errors.Is(err, streamstore.ErrConflict) && info.ID != "" {
			picoFail(w, http.StatusConflict, picoErrConflict, picoCreateConflictMessage(info, req), &info.NextSeq)
			return
		}
		p.engineError(w, r, err)
		return
	}
	h := w.Header()
	h.Set("Content-Type", info.ContentType)
	h.Set(hdrPicoNextSeq, strconv.FormatUint(info.NextSeq, 10))
	if info.Closed {
		h.Set(hdrPicoClosed, "true")
	}
	h.Set("Cache-Control", cacheControlNoStore)
	if !created {
		w.WriteHeader(http.StatusOK)
		return
	}
	h.Set("Location", picoLocation(r, name))
	w.WriteHeader(http.StatusCreated)
}

// sameHeaders reports whether two records' headers are the same map. Order
// is no part of it: a record's headers are a map (names are unique in a
// batch, which refuses one given twice), and a client rebuilding a retry
// from a hash map sends them in another order.
//
// Nothing bounds how many headers a record has but its size, so the
// comparison is linear: a quadratic one let a create of one record with a
// hundred thousand headers, repeated, hold a core for many seconds.
func sameHeaders(a, b []streamstore.Header) bool {
	if len(a) != len(b) {
		return false
	}
	if len(a) <= 8 {
		for i := range a {
			if !slices.Contains(b, a[i]) || !slices.Contains(a, b[i]) {
				return false
			}
		}
		return true
	}
	values := make(map[string]string, len(a))
	for _, h := range a {
		values[h.Name] = h.Value
	}
	if len(values) != len(a) {
		// A name twice (not from a batch): the same list, in order, only.
		return slices.Equal(a, b)
	}
	for _, h := range b {
		if v, ok := values[h.Name]; !ok || v != h.Value {
			return false
		}
		delete(values, h.Name) // a name twice in b matches once
	}
	return true
}

// firstRecordsDiffer compares want, the records of a create's body, with
// the first records of the existing stream name. It returns "" when they
// are the same records (bodies and headers), else why the create is
// refused, and the internal id of the stream it compared with.
func (p *picoProtocol) firstRecordsDiffer(ctx context.Context, eng *streamstore.Engine, name string, want []streamstore.NewRecord) (string, string, error) {
	const refused = "; a create's body becomes the first records of a new stream only: append with POST"
	size := 0
	for _, rec := range want {
		size += streamstore.ReadWeight(rec.Headers, len(rec.Body))
	}
	// A read that finds other records is refused by its Judge, so that it
	// is no access to the stream either.
	errDiffer := errors.New("the first records differ")
	var id string
	same := func(info streamstore.Info, got []streamstore.Record) error {
		id = info.ID
		// The read stops at the body's size: fewer records than the
		// body's means the stream has fewer, or larger ones.
		if len(got) != len(want) {
			return errDiffer
		}
		for i := range want {
			if !bytes.Equal(got[i].Body, want[i].Body) || !sameHeaders(got[i].Headers, want[i].Headers) {
				return errDiffer
			}
		}
		return nil
	}
	res, err := eng.Read(ctx, name, streamstore.ReadRequest{Seq: 0, MaxRecords: len(want), MaxBytes: size + 1, Judge: same})
	switch {
	case errors.Is(err, errDiffer):
		return "stream exists, and its first records are not this create's body" + refused, id, nil
	case errors.Is(err, streamstore.ErrGone):
		if info, herr := eng.Head(ctx, name); herr == nil && info.StartSeq > 0 {
			return "stream exists, and its first records were trimmed, so this create's body cannot be confirmed as them" + refused, info.ID, nil
		}
		return "", "", err
	case err != nil:
		return "", "", err
	}
	res.Release()
	return "", id, nil
}

// picoCreateConflictMessage tells a client whose create found the stream
// with other settings which of them differ, the stream's value first: "stream
// exists with other settings" alone leaves it to guess which of four
// headers to change.
func picoCreateConflictMessage(have streamstore.Info, want streamstore.CreateRequest) string {
	var diffs []string
	differ := func(setting, has, asked string) {
		if has != asked {
			diffs = append(diffs, fmt.Sprintf("%s %s, not %s", setting, has, asked))
		}
	}
	differ("content type", mediaType(have.ContentType), mediaType(want.ContentType))
	ttl := func(d time.Duration) string {
		if d == 0 {
			return "none"
		}
		return ttlSeconds(d)
	}
	differ(displayHeader(hdrPicoTTL), ttl(have.Expiry.TTL), ttl(want.Expiry.TTL))
	at := func(t time.Time) string {
		if t.IsZero() {
			return "none"
		}
		return formatInstant(t)
	}
	differ(displayHeader(hdrPicoExpiresAt), at(have.Expiry.ExpiresAt), at(want.Expiry.ExpiresAt))
	differ(displayHeader(hdrPicoClosed), strconv.FormatBool(have.Closed), strconv.FormatBool(want.Closed))
	if len(diffs) == 0 {
		// The stream changed between the engine's verdict and this
		// answer: name the settings a repeated create must match.
		return "stream exists with other settings; a create of an existing stream must give its content type, " +
			"Pico-TTL, Pico-Expires-At and Pico-Closed unchanged"
	}
	return fmt.Sprintf("stream exists with %s; a create of an existing stream must give the same settings, "+
		"or delete the stream first", strings.Join(diffs, "; "))
}

// firstNonJSON returns the index of the first record whose body is not a
// JSON value in UTF-8, or -1. Records of an application/json stream must be
// JSON, so that the stream reads as JSON messages through Durable Streams
// too.
func firstNonJSON(recs []streamstore.NewRecord) int {
	for i, rec := range recs {
		if !validJSON(rec.Body) {
			return i
		}
	}
	return -1
}

func nonJSONMessage(i int) string {
	return fmt.Sprintf("record %d is not a JSON value in UTF-8, and the stream is application/json", i)
}

// picoLocation is the stream's path in the client's URL space (with any
// prefix Caddy stripped before this handler), as PicoMQ's Location carries
// the path.
func picoLocation(r *http.Request, name string) string {
	u := url.URL{Path: clientPrefix(r) + name}
	return u.EscapedPath()
}

// post handles POST: a trim when Pico-Trim-Seq is set, otherwise an append
// (possibly of no records, to close the stream).
func (p *picoProtocol) post(w http.ResponseWriter, r *http.Request, name string) {
	trim, isTrim, err := parsePicoUint(r.Header, hdrPicoTrimSeq)
	if err != nil {
		picoFail(w, http.StatusBadRequest, picoErrBadRequest, err.Error(), nil)
		return
	}
	if isTrim {
		if with := trimConflicts(r.Header); len(with) > 0 {
			// A trim is no append: it cannot close the stream, check the
			// tail or be a producer's step, and doing the trim alone would
			// drop what the client asked for without a word.
			picoFail(w, http.StatusBadRequest, picoErrBadRequest, fmt.Sprintf(
				"a trim (Pico-Trim-Seq) cannot be combined with %s; send them in a request of their own",
				strings.Join(with, ", ")), nil)
			return
		}
		p.trim(w, r, name, trim)
		return
	}
	p.append(w, r, name)
}

// trimConflicts returns the append headers of a request that a trim
// cannot honour, spelt for the error message. Pico-Closed counts only when true, as everywhere.
func trimConflicts(h http.Header) []string {
	var with []string
	if isTrue(h.Get(hdrPicoClosed)) {
		with = append(with, displayHeader(hdrPicoClosed))
	}
	for _, name := range []string{hdrPicoMatchSeq, hdrPicoProducerID, hdrPicoProducerEpoch, hdrPicoProducerSeq} {
		if _, ok := headerValue(h, name); ok {
			with = append(with, displayHeader(name))
		}
	}
	return with
}

// createConflicts returns the append headers of a create, spelt for the
// error message: the API page gives them to appends only, and a create
// would store its body without the check they ask for (a producer's retry
// with POST would then store it twice).
func createConflicts(h http.Header) []string {
	var with []string
	for _, name := range []string{hdrPicoMatchSeq, hdrPicoTrimSeq, hdrPicoProducerID, hdrPicoProducerEpoch, hdrPicoProducerSeq} {
		if _, ok := headerValue(h, name); ok {
			with = append(with, displayHeader(name))
		}
	}
	return with
}

// trim handles POST with Pico-Trim-Seq: records below it are gone for good.
func (p *picoProtocol) trim(w http.ResponseWriter, r *http.Request, name string, seq uint64) {
	body, ok := p.readBody(w, r)
	if !ok {
		return
	}
	if len(body) > 0 {
		picoFail(w, http.StatusBadRequest, picoErrBadRequest, "a trim (Pico-Trim-Seq) takes no body", nil)
		return
	}
	eng, ok := p.engineFor(w, r)
	if !ok {
		return
	}
	info, err := eng.Trim(writeContext(r), name, seq)
	if err != nil {
		p.engineError(w, r, &trimWrite{err})
		return
	}
	h := w.Header()
	h.Set(hdrPicoStartSeq, strconv.FormatUint(info.StartSeq, 10))
	h.Set(hdrPicoNextSeq, strconv.FormatUint(info.NextSeq, 10))
	if info.Closed {
		h.Set(hdrPicoClosed, "true")
	}
	h.Set("Cache-Control", cacheControlNoStore)
	w.WriteHeader(http.StatusOK)
}

// append handles POST: a single record in the stream's content type, or a
// JSON or binary batch, atomically on consecutive seqs; with Pico-Closed it
// closes the stream after them (or only closes it, without a body).
func (p *picoProtocol) append(w http.ResponseWriter, r *http.Request, name string) {
	closeReq := isTrue(r.Header.Get(hdrPicoClosed))
	producer, err := parsePicoProducer(r.Header)
	if err != nil {
		picoFail(w, http.StatusBadRequest, picoErrBadRequest, err.Error(), nil)
		return
	}
	match, hasMatch, err := parsePicoUint(r.Header, hdrPicoMatchSeq)
	if err != nil {
		picoFail(w, http.StatusBadRequest, picoErrBadRequest, err.Error(), nil)
		return
	}
	body, ok := p.readBody(w, r)
	if !ok {
		return
	}
	req := streamstore.AppendRequest{Close: closeReq, Producer: producer}
	if hasMatch {
		req.MatchSeq = &match
	}
	if len(body) == 0 {
		if !closeReq {
			picoFail(w, http.StatusBadRequest, picoErrBadRequest,
				"empty body: an append needs a record (or Pico-Closed: true to close the stream)", nil)
			return
		}
	} else {
		raw := r.Header.Get("Content-Type")
		switch {
		case raw != "" && isBatchType(raw):
			if req.Records, err = decodeBatch(raw, body); err != nil {
				failBatch(w, err)
				return
			}
		default:
			if raw != "" {
				// One record in the stream's own type: the engine checks
				// the type, after closure, as the protocol orders them.
				if req.ContentType, err = normalizeContentType(raw); err != nil {
					picoFail(w, http.StatusBadRequest, picoErrBadRequest, err.Error(), nil)
					return
				}
			}
			req.Records = []streamstore.NewRecord{{Body: body}}
		}
	}

	eng, ok := p.engineFor(w, r)
	if !ok {
		return
	}
	// A record sent as a type that is not JSON needs no look: the engine
	// refuses it for a JSON stream (409), as for any other type.
	if i := firstNonJSON(req.Records); i >= 0 && (req.ContentType == "" || isJSON(req.ContentType)) {
		// Records of an application/json stream must be JSON values, or
		// Durable Streams' JSON-mode reads of the stream would break.
		// Only the stream knows its type: a lookup, in memory unless
		// evicted, needed only when a record is not JSON.
		info, err := eng.Head(writeContext(r), name)
		if err != nil {
			p.engineError(w, r, err)
			return
		}
		if isJSON(info.ContentType) {
			// Closure and a content-type mismatch come first, as the
			// engine orders them. (A producer's retry of the append that
			// closed the stream had JSON records, as the first try did.)
			switch {
			case info.Closed:
				p.engineError(w, r, &streamstore.ClosedError{NextSeq: info.NextSeq})
			case req.ContentType != "" && !sameMediaType(req.ContentType, info.ContentType):
				p.engineError(w, r, &streamstore.ContentTypeError{Sent: req.ContentType, Stream: info.ContentType})
			default:
				picoFail(w, http.StatusBadRequest, picoErrBadRequest, nonJSONMessage(i), nil)
			}
			return
		}
		// Not a JSON stream: the records are fine, and the engine answers
		// the rest in its own order, a closed stream after a producer's
		// retry of the append that closed it (a duplicate, 200). The
		// type looked at goes with them, so that a stream deleted and
		// made again as JSON meanwhile refuses them.
		if req.ContentType == "" {
			req.ContentType = info.ContentType
		}
	}
	res, err := eng.Append(writeContext(r), name, req)
	if err != nil {
		p.engineError(w, r, closingError(req, err))
		return
	}
	h := w.Header()
	h.Set(hdrPicoNextSeq, strconv.FormatUint(res.NextSeq, 10))
	// Pico-Start-Seq and Pico-Timestamp only when records were written now:
	// PicoMQ clients tell a producer retry (nothing written) by their absence.
	if !res.Duplicate && len(req.Records) > 0 {
		h.Set(hdrPicoStartSeq, strconv.FormatUint(res.FirstSeq, 10))
		h.Set(hdrPicoTimestamp, strconv.FormatInt(res.Timestamp, 10))
	}
	if res.Closed {
		h.Set(hdrPicoClosed, "true")
	}
	if producer != nil {
		h.Set(hdrPicoProducerEpoch, strconv.FormatUint(res.ProducerEpoch, 10))
		h.Set(hdrPicoProducerSeq, strconv.FormatUint(res.ProducerSeq, 10))
	}
	h.Set("Cache-Control", cacheControlNoStore)
	w.WriteHeader(http.StatusOK)
}

// head handles HEAD: the stream's metadata, without renewing its TTL.
func (p *picoProtocol) head(w http.ResponseWriter, r *http.Request, name string) {
	eng, ok := p.engineFor(w, r)
	if !ok {
		return
	}
	info, err := eng.Head(r.Context(), name)
	if err != nil {
		p.engineError(w, r, err)
		return
	}
	h := w.Header()
	h.Set("Content-Type", info.ContentType)
	h.Set(hdrPicoStartSeq, strconv.FormatUint(info.StartSeq, 10))
	h.Set(hdrPicoNextSeq, strconv.FormatUint(info.NextSeq, 10))
	if info.Expiry.TTL > 0 {
		h.Set(hdrPicoTTL, ttlSeconds(info.Expiry.TTL))
	}
	if !info.Expiry.ExpiresAt.IsZero() {
		h.Set(hdrPicoExpiresAt, formatInstant(info.Expiry.ExpiresAt))
	}
	if info.Closed {
		h.Set(hdrPicoClosed, "true")
	}
	h.Set("Cache-Control", cacheControlNoStore)
	w.WriteHeader(http.StatusOK)
}

// delete handles DELETE. A stream that forks still read is soft-deleted by
// the engine: 410 through either protocol until its last fork goes.
func (p *picoProtocol) delete(w http.ResponseWriter, r *http.Request, name string) {
	eng, ok := p.engineFor(w, r)
	if !ok {
		return
	}
	if err := eng.Delete(r.Context(), name); err != nil {
		p.engineError(w, r, err)
		return
	}
	w.Header().Set("Cache-Control", cacheControlNoStore)
	w.WriteHeader(http.StatusNoContent)
}

// picoListEntry is one stream of a listing.
type picoListEntry struct {
	Name        string `json:"name"`
	ContentType string `json:"content_type"`
	StartSeq    uint64 `json:"start_seq"`
	NextSeq     uint64 `json:"next_seq"`
	Closed      bool   `json:"closed"`
	TTL         *int64 `json:"ttl,omitempty"`
	ExpiresAt   string `json:"expires_at,omitempty"`
}

// picoListPage is the body of a listing.
type picoListPage struct {
	Streams []picoListEntry `json:"streams"`
	HasMore bool            `json:"has_more"`
}

// list handles GET on the handler's root: the streams whose names start
// with prefix and sort after start_after, in name order, at most limit.
// A page costs one listing of metadata keys in the bucket, two for a full
// page of the largest size, and more when expired or soft-deleted streams
// in the range must be listed past (the engine never returns an empty page
// while more follow).
func (p *picoProtocol) list(w http.ResponseWriter, r *http.Request) {
	q, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		picoFail(w, http.StatusBadRequest, picoErrBadRequest, fmt.Sprintf("malformed query string: %v", err), nil)
		return
	}
	if name := repeatedParam(q, "prefix", "limit", "start_after"); name != "" {
		picoFail(w, http.StatusBadRequest, picoErrBadRequest, name+" given more than once", nil)
		return
	}
	prefix := q.Get("prefix")
	if prefix == "" {
		prefix = "/"
	}
	limit := picoMaxListLimit
	if v := q.Get("limit"); v != "" {
		n, ok := parseDigits(v)
		if !ok {
			picoFail(w, http.StatusBadRequest, picoErrBadRequest, fmt.Sprintf("limit must be a non-negative integer, got %q", v), nil)
			return
		}
		if n > 0 && n < picoMaxListLimit {
			limit = int(n)
		}
	}
	eng, ok := p.engineFor(w, r)
	if !ok {
		return
	}
	// One more than the page, so that a page that ends the listing is told
	// apart from one that does not without trusting the store's
	// truncation flag (versitygw sets it on every full page).
	infos, more, err := eng.List(r.Context(), prefix, q.Get("start_after"), min(limit+1, picoMaxListLimit))
	if err != nil {
		p.engineError(w, r, err)
		return
	}
	switch {
	case len(infos) > limit:
		infos, more = infos[:limit], true
	case more && len(infos) == limit:
		// A full page of the largest size, which the store flags as
		// truncated: one more one-key listing settles whether anything
		// follows, so a page costs at most two LIST requests.
		next, nextMore, err := eng.List(r.Context(), prefix, infos[limit-1].Name, 1)
		if err != nil {
			p.engineError(w, r, err)
			return
		}
		more = len(next) > 0 || nextMore
	}
	page := picoListPage{Streams: make([]picoListEntry, 0, len(infos)), HasMore: more}
	for _, info := range infos {
		e := picoListEntry{
			Name:        info.Name,
			ContentType: info.ContentType,
			StartSeq:    info.StartSeq,
			NextSeq:     info.NextSeq,
			Closed:      info.Closed,
		}
		if info.Expiry.TTL > 0 {
			s := int64(info.Expiry.TTL / time.Second)
			e.TTL = &s
		}
		if !info.Expiry.ExpiresAt.IsZero() {
			e.ExpiresAt = formatInstant(info.Expiry.ExpiresAt)
		}
		page.Streams = append(page.Streams, e)
	}
	body, err := json.Marshal(page)
	if err != nil {
		p.engineError(w, r, fmt.Errorf("encoding the listing: %w", err))
		return
	}
	h := w.Header()
	h.Set("Content-Type", picoMediaJSON)
	h.Set("Cache-Control", cacheControlNoStore)
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(http.StatusOK)
	w.Write(body)
}

// Read formats.
const (
	picoFormatJSON   = "json"
	picoFormatBinary = "binary"
	picoFormatRaw    = "raw"
)

// picoReadQuery is a parsed read request.
type picoReadQuery struct {
	seq       uint64
	now       bool // seq=now: start at the tail
	fromStart bool // no seq, or 0: start at the first retained record
	byEventID bool // the position came from Last-Event-ID, not the URL
	seqInURL  bool // the URL names the position (seq=)
	count     int
	bytes     int
	format    string
	live      string
	cursor    string
}

// parseReadQuery checks a read's query string (and Last-Event-ID) before
// any I/O.
func (p *picoProtocol) parseReadQuery(r *http.Request) (picoReadQuery, error) {
	q, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		return picoReadQuery{}, fmt.Errorf("malformed query string: %v", err)
	}
	if name := repeatedParam(q, "seq", "live", "format", "count", "bytes", "cursor"); name != "" {
		return picoReadQuery{}, fmt.Errorf("%s given more than once", name)
	}
	rq := picoReadQuery{
		format: q.Get("format"),
		live:   q.Get("live"),
		cursor: q.Get("cursor"),
		count:  picoMaxReadRecords,
		bytes:  p.chunkBytes,
	}
	if err := checkCursor(rq.cursor); err != nil {
		return rq, err
	}
	switch rq.format {
	case "":
		rq.format = picoFormatJSON
	case picoFormatJSON, picoFormatBinary, picoFormatRaw:
	default:
		return rq, fmt.Errorf("unknown format %q (use json, binary or raw)", rq.format)
	}
	switch rq.live {
	case "", "long-poll", "sse":
	default:
		return rq, fmt.Errorf("unknown live mode %q (use long-poll or sse)", rq.live)
	}
	if rq.live == "sse" && rq.format != picoFormatJSON {
		// The wire notes give SSE one shape, JSON arrays of records: a
		// feed in another would be sent in that one without saying so.
		return rq, fmt.Errorf("format=%s does not apply to live=sse: SSE events carry records as JSON "+
			"(the shape of format=json); leave format out, or read with format=%s without live=sse or with live=long-poll",
			rq.format, rq.format)
	}
	seq, hasSeq := q.Get("seq"), q.Has("seq")
	rq.seqInURL = hasSeq
	if !hasSeq {
		// An SSE reconnect resumes where its last event said.
		if id, ok := headerValue(r.Header, hdrLastEventID); ok && id != "" {
			seq, hasSeq, rq.byEventID = id, true, true
		}
	}
	switch {
	case !hasSeq:
		rq.fromStart = true
	case seq == "now":
		rq.now = true
	default:
		n, ok := parseDigits(seq)
		switch {
		case !ok && rq.byEventID:
			// The client sent no seq: name what it did send.
			return rq, fmt.Errorf("Last-Event-ID must be a seq (a non-negative integer) or now, got %q", seq)
		case !ok:
			return rq, fmt.Errorf("seq must be a non-negative integer or now, got %q", seq)
		}
		rq.seq, rq.fromStart = n, n == 0
	}
	if v := q.Get("count"); v != "" {
		n, ok := parseDigits(v)
		if !ok {
			return rq, fmt.Errorf("count must be a non-negative integer, got %q", v)
		}
		if n > 0 && n < picoMaxReadRecords {
			rq.count = int(n)
		}
	}
	if v := q.Get("bytes"); v != "" {
		n, ok := parseDigits(v)
		if !ok {
			return rq, fmt.Errorf("bytes must be a non-negative integer, got %q", v)
		}
		if n > 0 {
			rq.bytes = int(min(n, uint64(max(picoMaxReadBytes, p.chunkBytes))))
		}
	}
	return rq, nil
}

// picoPage is the result of one read.
type picoPage struct {
	info     streamstore.Info
	start    uint64 // seq the read started at
	records  []streamstore.Record
	next     uint64 // seq to resume from
	upToDate bool   // the page reaches the durable tail
	closed   bool   // ... and the stream is closed: nothing more will come
	done     func()
}

// release lets the engine reuse the memory of the page's records, once
// written or copied.
func (pg *picoPage) release() {
	if pg.done != nil {
		pg.done()
	}
}

// belowStartError is a read below a stream's first retained record: those
// records were trimmed for good. It matches streamstore.ErrGone (410).
type belowStartError struct{ seq, start uint64 }

func (e *belowStartError) Error() string {
	return fmt.Sprintf("seq %d was trimmed; the stream's first retained seq is %d", e.seq, e.start)
}

// Is makes the error match streamstore.ErrGone.
func (e *belowStartError) Is(target error) bool { return target == streamstore.ErrGone }

// read reads one page for q from seq on (q.seq for the first page).
func (p *picoProtocol) read(ctx context.Context, eng *streamstore.Engine, name string, q picoReadQuery) (picoPage, error) {
	if q.now {
		res, err := eng.Read(ctx, name, streamstore.ReadRequest{Tail: true})
		if err != nil {
			return picoPage{}, err
		}
		i := res.Info
		return picoPage{info: i, start: i.NextSeq, next: i.NextSeq, upToDate: true, closed: i.Closed}, nil
	}
	req := streamstore.ReadRequest{Seq: q.seq, MaxRecords: q.count, MaxBytes: q.bytes, Until: time.Now().Add(catchUpBudget)}
	res, err := eng.Read(ctx, name, req)
	if err != nil && errors.Is(err, streamstore.ErrGone) {
		// Trimmed below seq, or soft-deleted: only a live stream has a
		// retained start to report or to read from.
		info, herr := eng.Head(ctx, name)
		switch {
		case herr != nil:
		case q.fromStart:
			// "From the beginning" means the first retained record,
			// wherever trims landing meanwhile moved it (each try
			// follows one that moved it, so a few reach it).
			for range 8 {
				req.Seq = info.StartSeq
				if res, err = eng.Read(ctx, name, req); !errors.Is(err, streamstore.ErrGone) {
					break
				}
				if info, herr = eng.Head(ctx, name); herr != nil || info.StartSeq <= req.Seq {
					break
				}
			}
		default:
			err = &belowStartError{seq: q.seq, start: info.StartSeq}
		}
	}
	if err != nil {
		return picoPage{}, err
	}
	pg := picoPage{
		info:     res.Info,
		start:    req.Seq,
		records:  res.Records,
		next:     res.NextSeq,
		upToDate: res.UpToDate,
		done:     res.Release,
	}
	pg.closed = pg.upToDate && pg.info.Closed
	return pg, nil
}

// etag identifies a page's answer: stream id, format, range and, once the
// page carries the end of a closed stream, the closure. A page of count
// records reaches the tail now and not once more is appended, the range
// unchanged: "u" marks the first, so that a revalidation replaces a kept
// Pico-Up-To-Date (a 304 can add or replace a kept header, never drop one).
func (pg *picoPage) etag(format string) string {
	tag := fmt.Sprintf("%s:%s:%d:%d", pg.info.ID, format, pg.start, pg.next)
	switch {
	case pg.closed:
		tag += ":c"
	case pg.upToDate:
		tag += ":u"
	}
	return `"` + tag + `"`
}

// body encodes the page's records in format, with its content type.
func (pg *picoPage) body(format string) ([]byte, string) {
	switch format {
	case picoFormatBinary:
		return picowire.AppendBinaryRead(nil, pg.records), picowire.BinaryBatch
	case picoFormatRaw:
		n := 0
		for i := range pg.records {
			n += len(pg.records[i].Body)
		}
		out := make([]byte, 0, n)
		for i := range pg.records {
			out = append(out, pg.records[i].Body...)
		}
		return out, pg.info.ContentType
	default:
		return picowire.AppendJSONRead(nil, pg.records), picoMediaJSON
	}
}

// get handles GET on a stream: catch-up, long-poll or SSE reads.
func (p *picoProtocol) get(w http.ResponseWriter, r *http.Request, name string) {
	q, err := p.parseReadQuery(r)
	if err != nil {
		picoFail(w, http.StatusBadRequest, picoErrBadRequest, err.Error(), nil)
		return
	}
	eng, ok := p.engineFor(w, r)
	if !ok {
		return
	}
	p.live.begin(q.live)
	defer p.live.end(q.live)
	switch q.live {
	case "long-poll":
		p.longPoll(w, r, eng, name, q)
	case "sse":
		p.sse(w, r, eng, name, q)
	default:
		p.catchUp(w, r, eng, name, q)
	}
}

// catchUp answers a plain read with one page, with a Pico-Cursor.
func (p *picoProtocol) catchUp(w http.ResponseWriter, r *http.Request, eng *streamstore.Engine, name string, q picoReadQuery) {
	readAt := time.Now() // no later than the read's renewal of a sliding TTL
	pg, err := p.read(writeContext(r), eng, name, q)
	if err != nil {
		p.engineError(w, r, err)
		return
	}
	defer pg.release()
	cc := readCacheControl(r, p.privateReads, pg.info.Expiry, readAt)
	switch {
	case q.now || (len(pg.records) == 0 && !pg.closed):
		// The tail moves: a cached "nothing here yet" would hide the next
		// records from pollers for as long as it is kept.
		cc = cacheControlNoStore
	case q.byEventID:
		// The URL does not say where this page starts: a cache that
		// ignores Vary (many CDNs do) would hand it to readers of the
		// same URL from the first record, who would miss the records
		// before it.
		cc = cacheControlNoStore
	case r.URL.RawQuery == "":
		// The bare URL is HEAD's too: caches that fetch a HEAD as a GET
		// would answer later HEADs with this page's headers (its end for
		// the tail, no Pico-Start-Seq, TTL or closure).
		cc = cacheControlNoStore
	}
	if !q.seqInURL {
		// Without seq= the page starts where Last-Event-ID says: a cache
		// must not answer a request that carries one with a page kept
		// for a request that did not, or for another value.
		w.Header().Add("Vary", "Last-Event-ID")
	}
	// The API page lists Pico-Cursor for paginated catch-up reads too: the
	// token a long-poll gives, so that a reader going on from the page
	// (live or not) sends it back as cursor= the same way.
	p.writePage(w, r, &pg, q.format, cc, nextCursor(time.Now(), q.cursor, p.jitter), true)
}

// writePage writes a 200 read response (or 304 when withETag and the
// client's If-None-Match names the page).
func (p *picoProtocol) writePage(w http.ResponseWriter, r *http.Request, pg *picoPage, format, cacheControl, cursor string, withETag bool) {
	h := w.Header()
	h.Set(hdrPicoNextSeq, strconv.FormatUint(pg.next, 10))
	if pg.upToDate {
		h.Set(hdrPicoUpToDate, "true")
	}
	if pg.closed {
		h.Set(hdrPicoClosed, "true")
	}
	if cursor != "" {
		h.Set(hdrPicoCursor, cursor)
	}
	h.Set("Cache-Control", cacheControl)
	if withETag {
		tag := pg.etag(format)
		h.Set("ETag", tag)
		if etagMatches(ifNoneMatch(r.Header), tag) {
			w.WriteHeader(http.StatusNotModified)
			return
		}
	}
	body, ct := pg.body(format)
	h.Set("Content-Type", ct)
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(http.StatusOK)
	w.Write(body)
}

// longPoll answers at once when there are records (or the stream is closed
// and fully read), else waits up to the long-poll timeout for some: 204
// with Pico-Up-To-Date and Pico-Cursor when none came.
func (p *picoProtocol) longPoll(w http.ResponseWriter, r *http.Request, eng *streamstore.Engine, name string, q picoReadQuery) {
	pg, err := p.read(writeContext(r), eng, name, q)
	if err != nil {
		p.engineError(w, r, err)
		return
	}
	defer func() { pg.release() }()
	cursor := nextCursor(time.Now(), q.cursor, p.jitter)
	for {
		switch {
		case len(pg.records) > 0:
			p.writePage(w, r, &pg, q.format, cacheControlNoStore, cursor, false)
			return
		case pg.closed:
			p.writeNoContent(w, pg.next, true, cursor)
			return
		case !pg.upToDate:
			// Behind the tail yet nothing read: waiting would spin.
			p.engineError(w, r, errNoProgress)
			return
		}
		// A server write timeout shorter than the wait would lose the
		// answer; the long-poll timeout bounds the response instead
		// (and Caddy's own deadline, which stays, ends it early: see
		// liveDeadline).
		_ = http.NewResponseController(w).SetWriteDeadline(time.Time{})
		info, err := p.wait(r, eng, name, pg.info.ID, pg.next, p.longPollTimeout)
		switch {
		case errors.Is(err, errWaitOver):
			p.writeNoContent(w, pg.next, false, cursor)
			return
		case err != nil:
			p.engineError(w, r, err)
			return
		case info.ID != pg.info.ID:
			picoFail(w, http.StatusNotFound, picoErrNotFound, "stream was deleted", nil)
			return
		}
		if p.woken != nil {
			p.woken()
		}
		// A read from the start stays one (see durableStreams.longPoll).
		next := q
		next.seq, next.now = pg.next, false
		id := pg.info.ID
		pg.release()
		if pg, err = p.read(writeContext(r), eng, name, next); err != nil {
			p.engineError(w, r, err)
			return
		}
		if pg.info.ID != id {
			// Deleted and created again since the wake-up.
			picoFail(w, http.StatusNotFound, picoErrNotFound, "stream was deleted", nil)
			return
		}
	}
}

// writeNoContent writes a long-poll 204: the client is at the tail.
func (p *picoProtocol) writeNoContent(w http.ResponseWriter, next uint64, closed bool, cursor string) {
	h := w.Header()
	h.Set(hdrPicoNextSeq, strconv.FormatUint(next, 10))
	h.Set(hdrPicoUpToDate, "true")
	if closed {
		h.Set(hdrPicoClosed, "true")
	}
	h.Set(hdrPicoCursor, cursor)
	h.Set("Cache-Control", cacheControlNoStore)
	w.WriteHeader(http.StatusNoContent)
}

// wait waits up to limit for the stream to move past seq. It returns
// errWaitOver when limit passes or the server shuts down, the client's
// context error when the client left, or the engine's error.
func (p *picoProtocol) wait(r *http.Request, eng *streamstore.Engine, name, id string, seq uint64, limit time.Duration) (streamstore.Info, error) {
	lw := newLiveWait(r, p.shutdown, liveDeadline(r, limit))
	defer lw.close()
	return lw.wait(eng, name, id, seq, 0)
}

// failBatch answers a batch body its decoder refused: 413 for more records
// than an append may hold, 400 for a malformed one.
func failBatch(w http.ResponseWriter, err error) {
	if errors.Is(err, picowire.ErrTooManyRecords) {
		picoFail(w, http.StatusRequestEntityTooLarge, picoErrTooLarge, err.Error(), nil)
		return
	}
	picoFail(w, http.StatusBadRequest, picoErrBadRequest, err.Error(), nil)
}
