package picomq

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2"

	"github.com/picomq/caddy-picomq/internal/picowire"
	"github.com/picomq/caddy-picomq/streamstore"
)

// Durable Streams header names.
const (
	hdrStreamNextOffset   = "Stream-Next-Offset"
	hdrStreamUpToDate     = "Stream-Up-To-Date"
	hdrStreamCursor       = "Stream-Cursor"
	hdrStreamClosed       = "Stream-Closed"
	hdrStreamTTL          = "Stream-Ttl"
	hdrStreamExpiresAt    = "Stream-Expires-At"
	hdrStreamSeq          = "Stream-Seq"
	hdrSSEDataEncoding    = "Stream-Sse-Data-Encoding"
	hdrProducerID         = "Producer-Id"
	hdrProducerEpoch      = "Producer-Epoch"
	hdrProducerSeq        = "Producer-Seq"
	hdrProducerExpected   = "Producer-Expected-Seq"
	hdrProducerReceived   = "Producer-Received-Seq"
	hdrForkedFrom         = "Stream-Forked-From"
	hdrForkOffset         = "Stream-Fork-Offset"
	hdrForkSubOffset      = "Stream-Fork-Sub-Offset"
	defaultContentType    = "application/octet-stream"
	maxSafeInteger        = 1<<53 - 1 // producer epochs and seqs must survive JavaScript numbers
	maxTTLSeconds         = int64(100 * 365 * 24 * 3600)
	cacheControlCatchUp   = "public, max-age=60, stale-while-revalidate=300"
	cacheControlPrivate   = "private, max-age=60, stale-while-revalidate=300"
	cacheControlNoStore   = "no-store"
	cacheControlEventFeed = "no-cache"
)

// How long a cache may keep a read answer, and serve it stale while it
// asks again: the cacheControlCatchUp and cacheControlPrivate values.
const (
	cacheMaxAge               = 60
	cacheStaleWhileRevalidate = 300
)

// readCacheControl is the Cache-Control of a read answer that may be kept
// (data, or a closed stream's EOF) of a stream with expiry x, read at or
// after readAt. It says "private" when privateRead holds: a shared cache
// (a CDN) may not reuse the answer to a request with Authorization unless
// the response says "public" (RFC 9111 section 3.5), and nothing stops it
// storing the answer to a request with a Cookie, a token in the query or
// an API key in a header of its own when it says "public", so "public"
// there would hand a reader's stream to clients without credentials;
// section 10.1 asks for "private" on streams that may be user-specific,
// and a server behind an authenticating proxy cannot tell. The module sees
// Authorization and Cookie, and whether Caddy's authentication handler let
// the request through; what it cannot see, a site declares with
// cache_reads private (alwaysPrivate).
//
// The answer carries no Vary: its bytes are the same whoever asks, so a
// cache that hands a "public" copy (made for a request without
// credentials, which the site let through) to one with them gives what the
// module would have given; a shared cache keeps no "private" answer at
// all; and Vary: Cookie would make some CDNs keep nothing, and a browser
// ask again each time any cookie of the site changed.
func readCacheControl(r *http.Request, alwaysPrivate bool, x streamstore.Expiry, readAt time.Time) string {
	return cacheControlFor(privateRead(r, alwaysPrivate), x, readAt, time.Now())
}

// cacheControlPrivateFeed is cacheControlEventFeed for a private read.
const cacheControlPrivateFeed = "private, no-cache"

// eventFeedCacheControl is the Cache-Control of a Durable Streams SSE
// feed: "no-cache", or "private, no-cache" when the read is private
// (privateRead). A shared cache may store a 200 that says only "no-cache"
// (RFC 9111 sections 3 and 5.2.2.4) and a CDN may collapse readers of one
// URL onto it, which for a reader with credentials would hand that
// reader's records to the others; "private" keeps it to the reader.
func eventFeedCacheControl(r *http.Request, alwaysPrivate bool) string {
	if privateRead(r, alwaysPrivate) {
		return cacheControlPrivateFeed
	}
	return cacheControlEventFeed
}

// privateRead reports whether the answer to read r must be kept out of
// shared caches: always when the handler says so, else when r carries
// credentials or passed Caddy's authentication.
func privateRead(r *http.Request, always bool) bool {
	return always || hasCredentials(r.Header) || authenticated(r)
}

// authUserIDPlaceholder is the placeholder Caddy's authentication handler
// (basic_auth, or the authentication module with any provider) sets on a
// request it let through: to the user's id, empty when the provider names
// none. The vars handler may set it too, for the access log's user_id.
const authUserIDPlaceholder = "http.auth.user.id"

// authenticated reports whether Caddy's authentication handler let r
// through. Such a request is not for everyone, even when its credential
// did not come in Authorization or a Cookie (a provider reading a header
// of its own, or a site that strips Authorization before the module).
// Being set is what counts, not the value: a provider may authenticate
// without naming a user.
func authenticated(r *http.Request) bool {
	repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if !ok || repl == nil {
		return false
	}
	_, set := repl.Get(authUserIDPlaceholder)
	return set
}

// credentialHeaders are the request headers that carry a client's
// credentials to a site: Authorization (basic_auth, bearer tokens) and
// Cookie (a login portal's session, checked by forward_auth in front of
// the module).
var credentialHeaders = []string{"Authorization", "Cookie"}

// hasCredentials reports whether a request carries credentials: any
// credentialHeaders value that is not blank. A cookie the site did not
// mean as a credential counts too, as the module cannot tell; a CDN that
// strips cookies before the origin gets "public" answers again.
func hasCredentials(h http.Header) bool {
	for _, name := range credentialHeaders {
		for _, v := range h.Values(name) {
			if strings.TrimSpace(v) != "" {
				return true
			}
		}
	}
	return false
}

// cacheControlFor is readCacheControl at time now. A stream that expires
// must not outlive its deadline in a cache: a CDN would go on serving its
// chunks after the server has forgotten it, and cached reads never reach
// the server to renew a sliding TTL. So max-age and stale-while-revalidate
// together fit in the whole seconds left; under one second, nothing may be
// kept. A sliding TTL's deadline is as of readAt, a time no later than the
// read's own renewal, so the estimate errs short.
func cacheControlFor(private bool, x streamstore.Expiry, readAt, now time.Time) string {
	maxAge, swr := int64(cacheMaxAge), int64(cacheStaleWhileRevalidate)
	if !x.IsZero() {
		deadline := x.ExpiresAt
		if x.TTL > 0 {
			deadline = readAt.Add(x.TTL)
		}
		left := int64(deadline.Sub(now) / time.Second)
		if left < 1 {
			return cacheControlNoStore
		}
		maxAge = min(maxAge, left)
		swr = min(swr, left-maxAge)
	}
	if maxAge == cacheMaxAge && swr == cacheStaleWhileRevalidate {
		if private {
			return cacheControlPrivate
		}
		return cacheControlCatchUp
	}
	cc := "public"
	if private {
		cc = "private"
	}
	cc += ", max-age=" + strconv.FormatInt(maxAge, 10)
	if swr > 0 {
		cc += ", stale-while-revalidate=" + strconv.FormatInt(swr, 10)
	}
	return cc
}

// isTrue implements the protocol's Stream-Closed rule: the header counts only
// when its value is exactly "true", ignoring case; anything else is absent.
func isTrue(v string) bool { return strings.EqualFold(v, "true") }

// parseTTL parses Stream-TTL strictly: a decimal integer of seconds with no
// sign, no leading zeros, no fraction and no exponent.
func parseTTL(v string) (time.Duration, error) {
	n, ok := parseDigits(v)
	if !ok || (len(v) > 1 && v[0] == '0') {
		return 0, fmt.Errorf("Stream-TTL must be a whole number of seconds without sign or leading zeros, got %q", v)
	}
	if n == 0 {
		// The engine reads a zero TTL as "no TTL"; refusing it beats
		// silently creating a stream that never expires.
		return 0, errors.New("Stream-TTL must be at least 1 second")
	}
	if n > uint64(maxTTLSeconds) {
		return 0, fmt.Errorf("Stream-TTL %s is too large; the limit is %d seconds", v, maxTTLSeconds)
	}
	return time.Duration(n) * time.Second, nil
}

// parseExpiry reads Stream-TTL and Stream-Expires-At; giving both is an
// error, and so is an Expires-At that is not after now.
func parseExpiry(h http.Header, now time.Time) (streamstore.Expiry, error) {
	ttl, hasTTL := headerValue(h, hdrStreamTTL)
	at, hasAt := headerValue(h, hdrStreamExpiresAt)
	var x streamstore.Expiry
	if hasTTL && hasAt {
		return x, errors.New("Stream-TTL and Stream-Expires-At are mutually exclusive")
	}
	if hasTTL {
		d, err := parseTTL(ttl)
		if err != nil {
			return x, err
		}
		x.TTL = d
	}
	if hasAt {
		t, err := parseRFC3339(at)
		if err != nil {
			return x, fmt.Errorf("Stream-Expires-At must be an RFC 3339 timestamp, got %q", at)
		}
		// The engine keeps milliseconds: compare a repeated create with
		// what it stored, or an identical PUT would conflict.
		x.ExpiresAt = t.UTC().Truncate(time.Millisecond)
		if err := checkFuture(hdrStreamExpiresAt, x.ExpiresAt, now); err != nil {
			return x, err
		}
	}
	return x, nil
}

// parseRFC3339 parses an RFC 3339 timestamp, fractional seconds optional.
// RFC 3339 lets its "T" and "Z" be lower case (section 5.6), which Go's
// layout does not; the syntax has no other letters. Go's parser also takes
// a comma before the fraction and a zone offset of 24 hours or 60
// minutes, which section 5.6 does not: such a value is refused, not
// read as some instant its sender may not have meant.
func parseRFC3339(v string) (time.Time, error) {
	v = strings.ToUpper(v)
	t, err := time.Parse(time.RFC3339Nano, v)
	if err != nil {
		return t, err
	}
	if strings.Contains(v, ",") {
		return time.Time{}, fmt.Errorf("timestamp %q has a comma before its fraction", v)
	}
	if !strings.HasSuffix(v, "Z") {
		// The parse left a numeric offset, "+hh:mm" or "-hh:mm", at the end.
		zone := v[len(v)-5:]
		if zone[:2] > "23" || zone[3:] > "59" {
			return time.Time{}, fmt.Errorf("timestamp %q has a zone offset out of range", v)
		}
	}
	return t, nil
}

// checkFuture refuses an expiry instant at or before now: the stream would
// be gone as soon as it was written (or, for Unix millisecond 0, read as no
// expiry at all), so the create can only be a client's mistake.
func checkFuture(header string, at, now time.Time) error {
	if !at.After(now) {
		return fmt.Errorf("%s %s is not in the future: the stream would expire at once",
			displayHeader(header), at.UTC().Format(time.RFC3339Nano))
	}
	return nil
}

// dsSingleHeaders are the request headers of Durable Streams that carry
// one value each, checked on every request. Content-Type is checked only
// where it is used (dsContentTypeHeader), and Stream-Closed by what its
// values mean (conflictingClosed).
var dsSingleHeaders = []string{hdrStreamTTL, hdrStreamExpiresAt, hdrStreamSeq,
	hdrProducerID, hdrProducerEpoch, hdrProducerSeq, hdrForkedFrom, hdrForkOffset, hdrForkSubOffset}

// dsContentTypeHeader is Content-Type for conflictingHeader, on the
// requests that use it: a create (the stream's type) and an append with
// data (the body's). A close-only append has no body, and section 5.2 says
// a server MUST NOT refuse it for its Content-Type, which client libraries
// attach whatever the request; reads and deletes never look at it.
var dsContentTypeHeader = []string{"Content-Type"}

// conflictingClosed reports whether Stream-Closed is given on several
// lines that mean different things. Section 4.1 has only "true", in any
// case, mean a close, and every other value mean the header is absent,
// which is no error: "true" and "TRUE" say one thing, and so do "yes" and
// "no". Only "true" beside another value asks for two things at once.
func conflictingClosed(h http.Header) bool {
	vs := h[hdrStreamClosed]
	for _, v := range vs[min(1, len(vs)):] {
		if isTrue(v) != isTrue(vs[0]) {
			return true
		}
	}
	return false
}

// conflictingHeader returns the first of names (canonical) that the request
// gives more than once with different values. Each holds one value (RFC
// 9110 section 5.3 forbids repeating such a field): taking the first of two
// would be a guess at what the client meant, so the request is refused.
// The same value twice is taken as once.
func conflictingHeader(h http.Header, names []string) (string, bool) {
	for _, name := range names {
		vs := h[name]
		for _, v := range vs[min(1, len(vs)):] {
			if v != vs[0] {
				return name, true
			}
		}
	}
	return "", false
}

// headerDisplayNames spells, for messages people read, the header names
// whose canonical Go form (the key net/http stores and the constants
// hold) differs from the protocol references' spelling: "Pico-Ttl" reads
// as a typo to someone who has only seen "Pico-TTL" in the docs. The keys
// set and read stay canonical; header names are case-insensitive.
var headerDisplayNames = map[string]string{
	hdrPicoTTL:     "Pico-TTL",
	hdrStreamTTL:   "Stream-TTL",
	hdrLastEventID: "Last-Event-ID",
}

// displayHeader returns name as the protocol references spell it, for
// error messages and logs.
func displayHeader(name string) string {
	if d, ok := headerDisplayNames[http.CanonicalHeaderKey(name)]; ok {
		return d
	}
	return name
}

// headerValue returns a header's first value and whether it was sent at all,
// so that an empty value is told apart from an absent header.
func headerValue(h http.Header, name string) (string, bool) {
	vs, ok := h[http.CanonicalHeaderKey(name)]
	if !ok || len(vs) == 0 {
		return "", false
	}
	return vs[0], true
}

// normalizeContentType canonicalises a media type (lower-case type and
// parameter names) so that "TEXT/PLAIN" and "text/plain" name one stream type.
func normalizeContentType(v string) (string, error) {
	// Most appends carry a bare lower-case type/subtype, which is its own
	// canonical form: skip the parse (a few percent of an append's CPU).
	if plainMediaType(v) {
		return v, nil
	}
	return parseContentType(v)
}

// newStreamContentType is normalizeContentType for a create, whose type
// the stream keeps: at most streamstore.MaxContentTypeLength bytes.
func newStreamContentType(v string) (string, error) {
	ct, err := normalizeContentType(v)
	if err != nil {
		return "", err
	}
	if len(ct) > streamstore.MaxContentTypeLength {
		return "", fmt.Errorf("Content-Type is %d bytes; the limit for a stream's type is %d", len(ct), streamstore.MaxContentTypeLength)
	}
	return ct, nil
}

// parseContentType is normalizeContentType without its fast path.
func parseContentType(v string) (string, error) {
	mt, params, err := mime.ParseMediaType(v)
	if err != nil {
		return "", fmt.Errorf("invalid Content-Type %q: %v", v, err)
	}
	if typ, sub, ok := strings.Cut(mt, "/"); !ok || typ == "" || sub == "" {
		return "", fmt.Errorf("invalid Content-Type %q: want type/subtype", v)
	}
	out := mime.FormatMediaType(mt, params)
	if out == "" {
		return "", fmt.Errorf("invalid Content-Type %q", v)
	}
	return out, nil
}

// plainMediaType reports whether v is a lower-case type/subtype of token
// characters without parameters.
func plainMediaType(v string) bool {
	slash := -1
	for i := 0; i < len(v); i++ {
		c := v[i]
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		case strings.IndexByte("!#$&-^_.+", c) >= 0:
		case c == '/' && slash < 0:
			slash = i
		default:
			return false
		}
	}
	return slash > 0 && slash < len(v)-1
}

// mediaType returns the lower-case type/subtype of a content type, without
// parameters.
func mediaType(ct string) string {
	mt, _, _ := strings.Cut(ct, ";")
	return strings.ToLower(strings.TrimSpace(mt))
}

// sameMediaType reports whether an append's content type matches the
// stream's. Parameters such as charset are not compared.
func sameMediaType(a, b string) bool { return mediaType(a) == mediaType(b) }

// isJSON reports whether a content type selects JSON mode (section 9.1).
func isJSON(ct string) bool { return mediaType(ct) == "application/json" }

// isTextual reports whether SSE may carry the stream's bytes as text; every
// other type is base64-encoded (section 5.8).
func isTextual(ct string) bool {
	mt := mediaType(ct)
	return strings.HasPrefix(mt, "text/") || mt == "application/json"
}

// parseProducer reads the idempotent-producer headers. All three or none.
func parseProducer(h http.Header) (*streamstore.Producer, error) {
	id, hasID := headerValue(h, hdrProducerID)
	epoch, hasEpoch := headerValue(h, hdrProducerEpoch)
	seq, hasSeq := headerValue(h, hdrProducerSeq)
	if !hasID && !hasEpoch && !hasSeq {
		return nil, nil
	}
	if !hasID || !hasEpoch || !hasSeq {
		return nil, errors.New("Producer-Id, Producer-Epoch and Producer-Seq must be sent together")
	}
	if id == "" {
		return nil, errors.New("Producer-Id must not be empty")
	}
	if len(id) > streamstore.MaxProducerIDLength {
		return nil, fmt.Errorf("Producer-Id is %d bytes; the limit is %d", len(id), streamstore.MaxProducerIDLength)
	}
	e, ok := parseDigits(epoch)
	if !ok || e > maxSafeInteger {
		return nil, fmt.Errorf("Producer-Epoch must be an integer from 0 to 2^53-1, got %q", epoch)
	}
	s, ok := parseDigits(seq)
	if !ok || s > maxSafeInteger {
		return nil, fmt.Errorf("Producer-Seq must be an integer from 0 to 2^53-1, got %q", seq)
	}
	return &streamstore.Producer{ID: id, Epoch: e, Seq: s}, nil
}

// parseStreamSeq reads Stream-Seq (section 5.2): any non-empty string up
// to streamstore.MaxStreamSeqLength bytes, "" when absent.
func parseStreamSeq(h http.Header) (string, error) {
	v := h.Get(hdrStreamSeq)
	if v == "" && len(h.Values(hdrStreamSeq)) > 0 {
		// Sent empty, it would sort before every other value, and the
		// engine keeps none as "no Stream-Seq yet": refused, not ignored.
		return "", errors.New("Stream-Seq must not be empty")
	}
	if len(v) > streamstore.MaxStreamSeqLength {
		return "", fmt.Errorf("Stream-Seq is %d bytes; the limit is %d", len(v), streamstore.MaxStreamSeqLength)
	}
	return v, nil
}

// repeatedParam returns the first of names that q holds more than once,
// or "": a read that says two things must not be answered by either.
func repeatedParam(q url.Values, names ...string) string {
	for _, n := range names {
		if len(q[n]) > 1 {
			return n
		}
	}
	return ""
}

// errBodyTooLarge reports a request body over max_append_size, or over a
// smaller limit that Caddy's request_body max_size put in front of the
// handler. Errors that match it are a bodyTooLargeError.
var errBodyTooLarge = errors.New("request body too large")

// bodyTooLargeError is errBodyTooLarge with the limit the body went over,
// so that the 413 names the limit that applies: behind request_body
// max_size 1KB, a client told of a 16 MiB limit would send its body again.
// name says which setting that is, so that the operator a client quotes
// the answer to need not guess it from the number.
type bodyTooLargeError struct {
	limit int64
	name  string
}

func (e bodyTooLargeError) Error() string {
	return fmt.Sprintf("body is larger than the %d-byte limit (%s)", e.limit, e.name)
}

// Names of the limits a body can go over, for bodyTooLargeError.
const (
	limitMaxAppendSize = "max_append_size"
	limitRequestBody   = "the site's request_body max_size"
	limitSubscription  = "the subscription API's"
)

func (e bodyTooLargeError) Is(target error) bool { return target == errBodyTooLarge }

// errBodyEncoded reports a request body sent with a content coding: its
// bytes are not the records the client means (a gzip-encoded append would
// be stored as gzip), so it is refused (415) rather than stored.
var errBodyEncoded = errors.New("request bodies are accepted without a content coding")

// errBodyTimeout reports a request body that stopped arriving at the
// connection's read deadline (the server's read_body timeout, which is what
// cuts off a client dripping a body to hold a connection). It is the
// client's slowness, not a malformed request: 408 tells it so, where 400
// would tell it not to send the same body again.
var errBodyTimeout = errors.New("request body did not arrive within the server's read_body timeout")

// bodyReadError is err of a body read as readBody returns it: a read past the
// connection's deadline is errBodyTimeout (net's error would also name the
// server's and client's addresses), a body over request_body's limit a
// bodyTooLargeError with that limit.
func bodyReadError(err error) error {
	var mbe *http.MaxBytesError
	var ne net.Error
	switch {
	case errors.As(err, &mbe):
		return bodyTooLargeError{limit: mbe.Limit, name: limitRequestBody}
	case errors.Is(err, os.ErrDeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()):
		return errBodyTimeout
	}
	return fmt.Errorf("reading request body: %w", err)
}

// readBody reads the whole request body, but never more than max+1 bytes, so
// an oversized body costs at most that much memory before it is refused;
// name is the limit's, for the error.
func readBody(r *http.Request, max int64, name string) ([]byte, error) {
	for _, v := range r.Header.Values("Content-Encoding") {
		for c := range strings.SplitSeq(v, ",") {
			if c = strings.TrimSpace(c); c != "" && !strings.EqualFold(c, "identity") {
				return nil, fmt.Errorf("%w: Content-Encoding %q", errBodyEncoded, c)
			}
		}
	}
	if r.ContentLength > max {
		return nil, bodyTooLargeError{limit: max, name: name}
	}
	if r.Body == nil {
		return nil, nil
	}
	if r.ContentLength > 0 {
		b, err := readKnownLength(r.Body, r.ContentLength)
		if err != nil {
			return nil, bodyReadError(err)
		}
		return b, nil
	}
	b, err := io.ReadAll(io.LimitReader(r.Body, max+1))
	if err != nil {
		return nil, bodyReadError(err)
	}
	if int64(len(b)) > max {
		return nil, bodyTooLargeError{limit: max, name: name}
	}
	return b, nil
}

// bodyFirstRead is the buffer a body of known length starts in, when it is
// longer.
const bodyFirstRead = 64 << 10

// readKnownLength reads a body of n bytes (its Content-Length) into a
// buffer that grows, doubling up to n, with what arrives: reserving n at
// once let a client that announced max_append_size and sent a kilobyte hold
// 16 MiB per connection (300 such connections took Caddy 900 MiB, for
// 300 KiB sent). Doubling from 64 KiB copies at most n bytes in all, where
// io.ReadAll, starting at 512 bytes, copies a dozen times for 1 MiB.
func readKnownLength(body io.Reader, n int64) ([]byte, error) {
	b := make([]byte, 0, min(n, bodyFirstRead))
	for int64(len(b)) < n {
		if len(b) == cap(b) {
			b = slices.Grow(b, int(min(2*int64(cap(b)), n))-len(b))
		}
		m, err := body.Read(b[len(b):int(min(int64(cap(b)), n))])
		b = b[:len(b)+m]
		if int64(len(b)) == n {
			break
		}
		if err == io.EOF {
			return nil, io.ErrUnexpectedEOF
		}
		if err != nil {
			return nil, err
		}
	}
	return b, nil
}

// jsonMessages splits a JSON-mode body into messages (section 9.1): a
// top-level array is flattened one level, one message per element; any other
// value is one message. Messages are stored compacted, which keeps the JSON
// value while dropping the raw newlines that would otherwise split SSE lines.
// An empty array yields no messages; the caller decides whether that is
// allowed (PUT) or not (POST).
func jsonMessages(body []byte) ([][]byte, error) {
	if !utf8.Valid(body) {
		return nil, errors.New("body is not valid JSON: it is not UTF-8 (RFC 8259 section 8.1)")
	}
	if !json.Valid(body) {
		return nil, errors.New("body is not valid JSON")
	}
	trimmed := bytes.TrimSpace(body)
	if len(trimmed) == 0 || trimmed[0] != '[' {
		var buf bytes.Buffer
		if err := json.Compact(&buf, trimmed); err != nil {
			return nil, fmt.Errorf("compacting JSON: %w", err)
		}
		return [][]byte{buf.Bytes()}, nil
	}
	// Element by element, so that an array of more than the most records
	// an append may hold is refused before it costs a slice of them all.
	dec := json.NewDecoder(bytes.NewReader(trimmed))
	if _, err := dec.Token(); err != nil { // '['
		return nil, fmt.Errorf("decoding JSON array: %w", err)
	}
	var out [][]byte
	for dec.More() {
		if len(out) == picowire.MaxRecords {
			return nil, picowire.TooMany("more than " + strconv.Itoa(picowire.MaxRecords))
		}
		var e json.RawMessage
		if err := dec.Decode(&e); err != nil {
			return nil, fmt.Errorf("decoding JSON element %d: %w", len(out), err)
		}
		var buf bytes.Buffer
		if err := json.Compact(&buf, e); err != nil {
			return nil, fmt.Errorf("compacting JSON element %d: %w", len(out), err)
		}
		out = append(out, buf.Bytes())
	}
	return out, nil
}

// bodyErrorStatus is the status of a body refused by its decoder: 413 for
// more records than an append may hold, 400 for a malformed one.
func bodyErrorStatus(err error) int {
	if errors.Is(err, picowire.ErrTooManyRecords) {
		return http.StatusRequestEntityTooLarge
	}
	return http.StatusBadRequest
}

// validJSON reports whether b is one JSON value encoded in UTF-8.
// json.Valid alone lets invalid UTF-8 inside strings through, which RFC
// 8259 (section 8.1) forbids and JSON readers of the stream would choke on.
func validJSON(b []byte) bool { return utf8.Valid(b) && json.Valid(b) }

// ttlSeconds formats a TTL for the Stream-TTL response header.
func ttlSeconds(d time.Duration) string {
	return fmt.Sprintf("%d", int64(d/time.Second))
}
