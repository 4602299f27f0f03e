package picomq

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/internal/picowire"
	"github.com/picomq/caddy-picomq/streamstore"
)

// Pico protocol header names (pico-wire.md).
const (
	hdrPicoStartSeq      = "Pico-Start-Seq"
	hdrPicoNextSeq       = "Pico-Next-Seq"
	hdrPicoTimestamp     = "Pico-Timestamp"
	hdrPicoMatchSeq      = "Pico-Match-Seq"
	hdrPicoTrimSeq       = "Pico-Trim-Seq"
	hdrPicoTTL           = "Pico-Ttl"
	hdrPicoExpiresAt     = "Pico-Expires-At"
	hdrPicoClosed        = "Pico-Closed"
	hdrPicoUpToDate      = "Pico-Up-To-Date"
	hdrPicoCursor        = "Pico-Cursor"
	hdrPicoProducerID    = "Pico-Producer-Id"
	hdrPicoProducerEpoch = "Pico-Producer-Epoch"
	hdrPicoProducerSeq   = "Pico-Producer-Seq"
	hdrPicoExpectedSeq   = "Pico-Expected-Seq"
	hdrPicoReceivedSeq   = "Pico-Received-Seq"
	hdrLastEventID       = "Last-Event-Id"
)

// picoExposedHeaders are the response headers browser code may read on a
// Pico handler's responses.
const picoExposedHeaders = "Pico-Start-Seq, Pico-Next-Seq, Pico-Timestamp, Pico-Cursor, " +
	"Pico-Up-To-Date, Pico-Closed, Pico-TTL, Pico-Expires-At, " +
	"Pico-Producer-Epoch, Pico-Producer-Seq, Pico-Expected-Seq, Pico-Received-Seq, " +
	"ETag, Content-Type, Location, Retry-After"

// picoAllowedRequestHeaders are the request headers a preflight on a Pico
// handler allows when the browser does not list the ones it wants.
const picoAllowedRequestHeaders = "Content-Type, If-None-Match, Authorization, Last-Event-ID, " +
	"Pico-TTL, Pico-Expires-At, Pico-Closed, Pico-Match-Seq, Pico-Trim-Seq, " +
	"Pico-Producer-Id, Pico-Producer-Epoch, Pico-Producer-Seq"

// Pico error names (the "error" member of an error body).
const (
	picoErrBadRequest  = "bad_request"
	picoErrFenced      = "fenced"
	picoErrNotFound    = "not_found"
	picoErrGone        = "gone"
	picoErrSeqGap      = "sequence_gap"
	picoErrConflict    = "conflict"
	picoErrClosed      = "closed"
	picoErrMatchFailed = "match_failed"
	picoErrTooLarge    = "too_large"
	picoErrMethod      = "method_not_allowed"
	picoErrDurability  = "durability"
	picoErrUnavailable = "unavailable"
	picoErrInternal    = "internal"
)

// isBatchType reports whether a Content-Type names one of the Pico batch
// formats, whose bodies are decoded into records rather than stored whole.
func isBatchType(ct string) bool {
	mt := mediaType(ct)
	return mt == picowire.BinaryBatch || mt == picowire.JSONBatch
}

// decodeBatch decodes a batch body of content type ct into records to
// append. Any malformation rejects the whole batch.
func decodeBatch(ct string, body []byte) ([]streamstore.NewRecord, error) {
	var recs []picowire.Record
	var err error
	switch mediaType(ct) {
	case picowire.BinaryBatch:
		recs, err = picowire.DecodeBinary(body)
	case picowire.JSONBatch:
		recs, err = picowire.DecodeJSON(body)
	default:
		return nil, fmt.Errorf("%s is not a batch content type", ct)
	}
	if err != nil {
		return nil, fmt.Errorf("decoding %s body: %w", mediaType(ct), err)
	}
	out := make([]streamstore.NewRecord, len(recs))
	for i, r := range recs {
		out[i] = streamstore.NewRecord{Headers: r.Headers, Body: r.Body}
	}
	return out, nil
}

// parsePicoUint reads an optional unsigned decimal header. ok is false when
// the header is absent.
func parsePicoUint(h http.Header, name string) (n uint64, ok bool, err error) {
	v, present := headerValue(h, name)
	if !present {
		return 0, false, nil
	}
	n, valid := parseDigits(v)
	if !valid {
		return 0, false, fmt.Errorf("%s must be a non-negative integer, got %q", displayHeader(name), v)
	}
	return n, true, nil
}

// parsePicoExpiry reads Pico-TTL (seconds) and Pico-Expires-At (RFC 3339 or
// Unix milliseconds); giving both is an error, and so is an Expires-At that
// is not after now. They are the same settings as Durable Streams'
// Stream-TTL and Stream-Expires-At.
func parsePicoExpiry(h http.Header, now time.Time) (streamstore.Expiry, error) {
	var x streamstore.Expiry
	ttl, hasTTL := headerValue(h, hdrPicoTTL)
	at, hasAt := headerValue(h, hdrPicoExpiresAt)
	if hasTTL && hasAt {
		return x, errors.New("Pico-TTL and Pico-Expires-At were both given; a stream expires either after " +
			"idle seconds (Pico-TTL) or at an instant (Pico-Expires-At), so send only one")
	}
	if hasTTL {
		// The engine reads a zero TTL as "none"; refusing it beats
		// silently creating a stream that never expires. One message for
		// every bad value says the whole allowed range at once.
		n, ok := parseDigits(ttl)
		// Leading zeros are refused as Stream-TTL refuses them: the two
		// headers set the one TTL, and a value one protocol takes the
		// other would refuse is a trap for code that speaks both.
		if !ok || ttl[0] == '0' || n > uint64(maxTTLSeconds) {
			return x, fmt.Errorf("Pico-TTL must be a whole number of seconds from 1 to %d, without sign or leading zeros, got %q", maxTTLSeconds, ttl)
		}
		x.TTL = time.Duration(n) * time.Second
	}
	if hasAt {
		t, err := parseInstant(at)
		if err != nil {
			return x, err
		}
		if err := checkFuture(hdrPicoExpiresAt, t, now); err != nil {
			return x, err
		}
		x.ExpiresAt = t
	}
	return x, nil
}

// maxUnixMilli keeps Unix-millisecond instants inside time.Time's exact
// range (year 9999).
const maxUnixMilli = 253402300799999

// picoSingleHeaders are the request headers of Pico that carry one value
// each (see conflictingHeader).
var picoSingleHeaders = []string{"Content-Type", hdrPicoMatchSeq, hdrPicoTrimSeq, hdrPicoTTL, hdrPicoExpiresAt,
	hdrPicoClosed, hdrPicoProducerID, hdrPicoProducerEpoch, hdrPicoProducerSeq, hdrLastEventID}

// parseInstant parses Pico-Expires-At: Unix milliseconds (digits only) or
// RFC 3339. The engine keeps milliseconds, so the instant is truncated to
// them, which keeps a retried create with the same header idempotent.
func parseInstant(v string) (time.Time, error) {
	if n, ok := parseDigits(v); ok {
		if n > maxUnixMilli {
			return time.Time{}, fmt.Errorf("Pico-Expires-At %s is too far in the future", v)
		}
		return time.UnixMilli(int64(n)).UTC(), nil
	}
	t, err := parseRFC3339(v)
	if err != nil {
		return time.Time{}, fmt.Errorf("Pico-Expires-At must be an RFC 3339 timestamp or Unix milliseconds, got %q", v)
	}
	return t.UTC().Truncate(time.Millisecond), nil
}

// formatInstant formats an expiry for Pico-Expires-At and listings.
func formatInstant(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

// parsePicoProducer reads the idempotent-producer headers: all three or none.
func parsePicoProducer(h http.Header) (*streamstore.Producer, error) {
	id, hasID := headerValue(h, hdrPicoProducerID)
	_, hasEpoch := headerValue(h, hdrPicoProducerEpoch)
	_, hasSeq := headerValue(h, hdrPicoProducerSeq)
	if !hasID && !hasEpoch && !hasSeq {
		return nil, nil
	}
	if !hasID || !hasEpoch || !hasSeq {
		return nil, errors.New("Pico-Producer-Id, Pico-Producer-Epoch and Pico-Producer-Seq must be sent together")
	}
	if id == "" {
		return nil, errors.New("Pico-Producer-Id must not be empty")
	}
	if len(id) > streamstore.MaxProducerIDLength {
		return nil, fmt.Errorf("Pico-Producer-Id is %d bytes; the limit is %d", len(id), streamstore.MaxProducerIDLength)
	}
	// Producer state is one per stream whichever protocol writes it, and
	// Durable Streams clients read it back as JavaScript numbers: the same
	// limit as Producer-Epoch and Producer-Seq, or a Pico producer could
	// set an epoch no Durable Streams producer can fence.
	epoch, err := picoSafeUint(h, hdrPicoProducerEpoch)
	if err != nil {
		return nil, err
	}
	seq, err := picoSafeUint(h, hdrPicoProducerSeq)
	if err != nil {
		return nil, err
	}
	return &streamstore.Producer{ID: id, Epoch: epoch, Seq: seq}, nil
}

// picoSafeUint reads a present header holding an integer from 0 to 2^53-1.
func picoSafeUint(h http.Header, name string) (uint64, error) {
	v, _ := headerValue(h, name)
	n, ok := parseDigits(v)
	if !ok || n > maxSafeInteger {
		return 0, fmt.Errorf("%s must be an integer from 0 to 2^53-1, got %q", displayHeader(name), v)
	}
	return n, nil
}

// picoErrorBody is the JSON body of every Pico error response.
type picoErrorBody struct {
	Error   string  `json:"error"`
	Message string  `json:"message,omitempty"`
	NextSeq *uint64 `json:"next_seq,omitempty"`
}

// picoFail writes a JSON error. next, when set, goes into the body and into
// Pico-Next-Seq. Headers already set for the error (Pico-Closed, producer
// state) are kept; read-response headers are dropped.
func picoFail(w http.ResponseWriter, status int, code, msg string, next *uint64) {
	h := w.Header()
	h.Del("ETag")
	h.Del(hdrPicoUpToDate)
	h.Del(hdrPicoCursor)
	if next != nil {
		h.Set(hdrPicoNextSeq, strconv.FormatUint(*next, 10))
	}
	body, err := json.Marshal(picoErrorBody{Error: code, Message: msg, NextSeq: next})
	if err != nil { // cannot happen: strings and a number
		body = []byte(`{"error":"internal"}`)
	}
	body = append(body, '\n')
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", cacheControlNoStore)
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	w.Write(body)
}

// engineError maps an engine error to a Pico error response.
func (p *picoProtocol) engineError(w http.ResponseWriter, r *http.Request, err error) {
	h := w.Header()
	var (
		closed *streamstore.ClosedError
		match  *streamstore.MatchError
		fenced *streamstore.FencedError
		gap    *streamstore.SequenceGapError
		epoch  *streamstore.EpochStartError
		start  *storageStartError
	)
	switch {
	case errors.As(err, &closed):
		h.Set(hdrPicoClosed, "true")
		picoFail(w, http.StatusConflict, picoErrClosed, "stream is closed", &closed.NextSeq)
	case errors.As(err, &match):
		picoFail(w, http.StatusPreconditionFailed, picoErrMatchFailed,
			fmt.Sprintf("Pico-Match-Seq does not match the stream's next seq %d", match.NextSeq), &match.NextSeq)
	case errors.As(err, &fenced):
		h.Set(hdrPicoProducerEpoch, strconv.FormatUint(fenced.CurrentEpoch, 10))
		picoFail(w, http.StatusForbidden, picoErrFenced,
			fmt.Sprintf("producer epoch is stale; the current epoch is %d", fenced.CurrentEpoch), nil)
	case errors.As(err, &gap):
		h.Set(hdrPicoExpectedSeq, strconv.FormatUint(gap.Expected, 10))
		h.Set(hdrPicoReceivedSeq, strconv.FormatUint(gap.Received, 10))
		picoFail(w, http.StatusConflict, picoErrSeqGap,
			fmt.Sprintf("producer seq gap: expected %d, received %d", gap.Expected, gap.Received), nil)
	case errors.As(err, &epoch):
		// The wire notes' error table has a seq that does not follow the
		// producer's expected one as sequence_gap, whatever the reason;
		// a first append of a producer unknown to the stream, at a seq
		// other than 0, is one already.
		h.Set(hdrPicoExpectedSeq, "0")
		h.Set(hdrPicoReceivedSeq, strconv.FormatUint(epoch.Received, 10))
		picoFail(w, http.StatusConflict, picoErrSeqGap,
			fmt.Sprintf("producer seq gap: a new producer epoch starts at seq 0, received %d", epoch.Received), nil)
	case errors.Is(err, streamstore.ErrNotFound):
		picoFail(w, http.StatusNotFound, picoErrNotFound, "no such stream", nil)
	case errors.Is(err, streamstore.ErrGone):
		picoFail(w, http.StatusGone, picoErrGone, goneMessage(err), nil)
	case errors.Is(err, streamstore.ErrConflict):
		picoFail(w, http.StatusConflict, picoErrConflict, err.Error(), nil)
	case errors.Is(err, streamstore.ErrContentType):
		picoFail(w, http.StatusConflict, picoErrConflict, contentTypeMessage(err), nil)
	case errors.Is(err, streamstore.ErrBadRequest):
		picoFail(w, http.StatusBadRequest, picoErrBadRequest, badRequestReason(err), nil)
	case errors.Is(err, streamstore.ErrShuttingDown):
		h.Set("Retry-After", "1")
		picoFail(w, http.StatusServiceUnavailable, picoErrUnavailable, "server is shutting down; retry", nil)
	case errors.As(err, &start):
		h.Set("Retry-After", "5")
		picoFail(w, http.StatusServiceUnavailable, picoErrUnavailable, start.reason(), nil)
	case errors.Is(err, streamstore.ErrTooLate):
		h.Set("Retry-After", "1")
		picoFail(w, http.StatusServiceUnavailable, picoErrUnavailable, tooLateMessageFor(r.Method), nil)
	case errors.Is(err, streamstore.ErrTakenOver):
		p.failLog.warn(p.log, "storage taken over by another server", zap.String("method", r.Method), zap.String("stream", r.URL.Path), zap.Error(err))
		h.Set("Retry-After", "1")
		picoFail(w, http.StatusServiceUnavailable, picoErrDurability, takenOverMessageFor(r.Method), nil)
	case errors.Is(err, streamstore.ErrUnconfirmed):
		p.failLog.warn(p.log, failWarning("write not confirmed in time", err), zap.String("method", r.Method), zap.String("stream", r.URL.Path), zap.Error(err))
		h.Set("Retry-After", "1")
		picoFail(w, http.StatusServiceUnavailable, picoErrDurability, unconfirmedMessage(r.Method, err), nil)
	case errors.Is(err, streamstore.ErrBusy):
		h.Set("Retry-After", "1")
		picoFail(w, http.StatusServiceUnavailable, picoErrUnavailable, busyMessage, nil)
	case errors.Is(err, streamstore.ErrDamaged):
		picoFail(w, http.StatusInternalServerError, picoErrInternal, damagedMessage(err), nil)
	case r.Context().Err() != nil && isRead(r.Method):
		// A reader that left: its read was cut short with it, which is
		// no storage failure, and nobody reads the answer.
	case errors.Is(err, streamstore.ErrUnavailable):
		p.failLog.warn(p.log, failWarning("storage unavailable", err), zap.String("method", r.Method), zap.String("stream", r.URL.Path), zap.Error(err))
		h.Set("Retry-After", "1")
		picoFail(w, http.StatusServiceUnavailable, picoErrDurability, unavailableMessage(r.Method, err), nil)
	case r.Context().Err() != nil:
		// The client left; nobody reads the answer.
	default:
		p.log.Error("request failed", zap.String("method", r.Method), zap.String("stream", r.URL.Path), zap.Error(err))
		picoFail(w, http.StatusInternalServerError, picoErrInternal, "internal error", nil)
	}
}

// goneMessage tells a soft-deleted stream from a read below the retained
// records, both of which the engine reports as ErrGone. A read from the
// start that a trim overtook between its reads gets the engine's
// TrimmedError itself: the stream is live, only trimmed.
func goneMessage(err error) string {
	var below *belowStartError
	if errors.As(err, &below) {
		return below.Error()
	}
	var trimmed *streamstore.TrimmedError
	if errors.As(err, &trimmed) {
		return (&belowStartError{seq: trimmed.Seq, start: trimmed.StartSeq}).Error()
	}
	return "stream was deleted; its forks still use it"
}
