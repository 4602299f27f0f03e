// Package picowire encodes and decodes the Pico protocol's record batches:
// the binary batch (application/vnd.picomq.batch) and the JSON batch
// (application/vnd.picomq.batch+json), for appends and for reads. It knows
// records and bytes only; HTTP and storage are elsewhere.
package picowire

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/picomq/caddy-picomq/segment"
)

// Media types of the batch formats.
const (
	BinaryBatch = "application/vnd.picomq.batch"
	JSONBatch   = "application/vnd.picomq.batch+json"
)

// Version is the only binary batch version there is.
const Version = 1

// ErrMalformed wraps every decoding error: the batch is rejected whole.
var ErrMalformed = errors.New("malformed batch")

// MaxRecords is the most records one append may hold, whichever protocol
// and format carry them (a Pico batch, a Durable Streams JSON array). Each
// record costs the engine a few hundred bytes whatever its size, so without
// a bound a 16 MiB batch of empty records held about 2 GiB of memory.
const MaxRecords = 100_000

// ErrTooManyRecords reports a batch of more than MaxRecords records. It is
// not ErrMalformed: the batch is well formed, and too large.
var ErrTooManyRecords = errors.New("too many records in one append")

// TooMany is the ErrTooManyRecords of an append of count records (text,
// such as "more than 100000", where the decoder stopped counting).
func TooMany(count string) error {
	return fmt.Errorf("%w: %s records; the limit is %d", ErrTooManyRecords, count, MaxRecords)
}

// Record is a record to append: headers and body.
type Record struct {
	Headers []segment.Header
	Body    []byte
}

func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
}

// reader reads big-endian fields from a batch; the first error sticks.
type reader struct {
	b   []byte
	off int
	err error
}

func (r *reader) take(n uint64, what string) []byte {
	if r.err != nil {
		return nil
	}
	if n > uint64(len(r.b)-r.off) {
		r.err = malformed("truncated %s at byte %d", what, r.off)
		return nil
	}
	v := r.b[r.off : r.off+int(n)]
	r.off += int(n)
	return v
}

func (r *reader) u32(what string) uint32 {
	if v := r.take(4, what); v != nil {
		return binary.BigEndian.Uint32(v)
	}
	return 0
}

func (r *reader) text(what string) string {
	v := r.take(uint64(r.u32(what+" length")), what)
	if r.err == nil && !utf8.Valid(v) {
		r.err = malformed("%s is not valid UTF-8", what)
	}
	return string(v)
}

func (r *reader) headers() []segment.Header {
	n := r.u32("header count")
	// Each header needs at least 8 bytes: a count beyond that is a lie.
	if r.err == nil && uint64(n)*8 > uint64(len(r.b)-r.off) {
		r.err = malformed("header count %d exceeds the batch", n)
	}
	if r.err != nil || n == 0 {
		return nil
	}
	hs := make([]segment.Header, n)
	for i := range hs {
		hs[i] = segment.Header{Name: r.text("header name"), Value: r.text("header value")}
	}
	return hs
}

// repeatedName returns a header name that hs holds more than once. A
// record's headers are a string-to-string map (pico-wire.md): two values
// for one name have no meaning, and the JSON read form, an object, could
// not carry them both.
func repeatedName(hs []segment.Header) (string, bool) {
	if len(hs) <= 16 {
		// Records carry a few headers: comparing them beats a map.
		for i := 1; i < len(hs); i++ {
			for j := range i {
				if hs[i].Name == hs[j].Name {
					return hs[i].Name, true
				}
			}
		}
		return "", false
	}
	seen := make(map[string]struct{}, len(hs))
	for _, h := range hs {
		if _, ok := seen[h.Name]; ok {
			return h.Name, true
		}
		seen[h.Name] = struct{}{}
	}
	return "", false
}

// DecodeBinary decodes a binary append batch. Bodies alias data.
func DecodeBinary(data []byte) ([]Record, error) {
	r := &reader{b: data}
	if v := r.take(1, "version"); v != nil && v[0] != Version {
		return nil, malformed("unknown batch version %d", v[0])
	}
	n := r.u32("record count")
	if r.err == nil && n == 0 {
		return nil, malformed("batch has no records")
	}
	// Each record needs at least 8 bytes.
	if r.err == nil && uint64(n)*8 > uint64(len(data)-r.off) {
		return nil, malformed("record count %d exceeds the batch", n)
	}
	if r.err == nil && n > MaxRecords {
		return nil, TooMany(strconv.FormatUint(uint64(n), 10))
	}
	var recs []Record
	if r.err == nil {
		recs = make([]Record, n)
	}
	for i := range recs {
		recs[i].Headers = r.headers()
		if name, dup := repeatedName(recs[i].Headers); r.err == nil && dup {
			r.err = malformed("record %d has header %q twice", i, name)
		}
		recs[i].Body = r.take(uint64(r.u32("body length")), "body")
		if r.err != nil {
			break
		}
	}
	if r.err != nil {
		return nil, r.err
	}
	if r.off != len(data) {
		return nil, malformed("%d bytes after the last record", len(data)-r.off)
	}
	return recs, nil
}

// EncodeBinary encodes records to append as a binary batch.
func EncodeBinary(recs []Record) []byte {
	b := []byte{Version}
	b = binary.BigEndian.AppendUint32(b, uint32(len(recs)))
	for _, r := range recs {
		b = appendHeaders(b, r.Headers)
		b = binary.BigEndian.AppendUint32(b, uint32(len(r.Body)))
		b = append(b, r.Body...)
	}
	return b
}

func appendHeaders(b []byte, hs []segment.Header) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(len(hs)))
	for _, h := range hs {
		b = binary.BigEndian.AppendUint32(b, uint32(len(h.Name)))
		b = append(b, h.Name...)
		b = binary.BigEndian.AppendUint32(b, uint32(len(h.Value)))
		b = append(b, h.Value...)
	}
	return b
}

// AppendBinaryRead appends the binary read form of stored records: version,
// count, then per record seq, timestamp, headers and body.
func AppendBinaryRead(b []byte, recs []segment.Record) []byte {
	b = append(b, Version)
	b = binary.BigEndian.AppendUint32(b, uint32(len(recs)))
	for i := range recs {
		r := &recs[i]
		b = binary.BigEndian.AppendUint64(b, r.Seq)
		b = binary.BigEndian.AppendUint64(b, uint64(r.Timestamp))
		b = appendHeaders(b, r.Headers)
		b = binary.BigEndian.AppendUint32(b, uint32(len(r.Body)))
		b = append(b, r.Body...)
	}
	return b
}

// DecodeBinaryRead decodes the binary read form (used by clients and tests).
func DecodeBinaryRead(data []byte) ([]segment.Record, error) {
	r := &reader{b: data}
	if v := r.take(1, "version"); v != nil && v[0] != Version {
		return nil, malformed("unknown batch version %d", v[0])
	}
	n := r.u32("record count")
	if r.err == nil && uint64(n)*24 > uint64(len(data)-r.off) {
		return nil, malformed("record count %d exceeds the batch", n)
	}
	var recs []segment.Record
	for i := uint32(0); r.err == nil && i < n; i++ {
		var rec segment.Record
		if v := r.take(16, "seq and timestamp"); v != nil {
			rec.Seq = binary.BigEndian.Uint64(v)
			rec.Timestamp = int64(binary.BigEndian.Uint64(v[8:]))
		}
		rec.Headers = r.headers()
		rec.Body = r.take(uint64(r.u32("body length")), "body")
		recs = append(recs, rec)
	}
	if r.err != nil {
		return nil, r.err
	}
	if r.off != len(data) {
		return nil, malformed("%d bytes after the last record", len(data)-r.off)
	}
	return recs, nil
}

// DecodeJSON decodes a JSON append batch:
// {"records":[{"body":"text","headers":{"k":"v"}},{"body_b64":"AAEC"}]}.
// Header order is kept as written.
func DecodeJSON(data []byte) ([]Record, error) {
	if !utf8.Valid(data) {
		return nil, malformed("batch is not valid UTF-8")
	}
	// encoding/json would decode such an escape to U+FFFD: the record
	// stored would not be the one sent.
	if at, ok := unpairedSurrogate(data); ok {
		return nil, malformed("the escape %s at byte %d is half a UTF-16 surrogate pair, which stands for no character; "+
			"send a body that is not text as body_b64", data[at:at+6], at)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var recs []Record
	seen := false
	err := object(dec, func(key string) error {
		if key != "records" {
			return skipValue(dec)
		}
		if seen {
			// encoding/json would keep the last array, this loop would
			// append both: refuse a batch that means two things.
			return malformed("records given twice")
		}
		seen = true
		if err := expectDelim(dec, '['); err != nil {
			return malformed("records must be an array")
		}
		for dec.More() {
			if len(recs) == MaxRecords {
				return TooMany("more than " + strconv.Itoa(MaxRecords))
			}
			rec, err := jsonRecord(dec)
			if err != nil {
				return err
			}
			recs = append(recs, rec)
		}
		_, err := dec.Token() // ']'
		return err
	})
	if err != nil {
		if errors.Is(err, ErrMalformed) || errors.Is(err, ErrTooManyRecords) {
			return nil, err
		}
		return nil, malformed("%v", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, malformed("data after the batch object")
	}
	if !seen || len(recs) == 0 {
		return nil, malformed("records must be a non-empty array")
	}
	return recs, nil
}

func jsonRecord(dec *json.Decoder) (Record, error) {
	var rec Record
	var hasBody, hasB64, hasHeaders bool
	err := object(dec, func(key string) error {
		if (key == "body" && hasBody) || (key == "body_b64" && hasB64) || (key == "headers" && hasHeaders) {
			return malformed("a record has %s twice", key)
		}
		// A member that is null is left out, as encoders write absent
		// optional fields (Go's for a nil map, PicoMQ's own codec).
		switch key {
		case "body":
			s, present, err := optionalString(dec, "body")
			if present {
				rec.Body, hasBody = []byte(s), true
			}
			return err
		case "body_b64":
			s, present, err := optionalString(dec, "body_b64")
			if err != nil || !present {
				return err
			}
			b, err := decodeBase64(s)
			if err != nil {
				return malformed("body_b64 is not valid base64: %v", err)
			}
			rec.Body, hasB64 = b, true
			return nil
		case "headers":
			hasHeaders = true
			tok, err := dec.Token()
			if err != nil || tok == nil {
				return err
			}
			if d, ok := tok.(json.Delim); !ok || d != '{' {
				return malformed("headers must be an object")
			}
			err = members(dec, func(name string) error {
				v, err := stringValue(dec, "header "+strconv.Quote(name))
				rec.Headers = append(rec.Headers, segment.Header{Name: name, Value: v})
				return err
			})
			if name, dup := repeatedName(rec.Headers); err == nil && dup {
				// encoding/json would keep the last value, this loop
				// both: refuse a record that means two things.
				return malformed("a record has header %q twice", name)
			}
			return err
		case "key":
			// Later PicoMQ releases give records a key, which these
			// formats (pico-wire.md) have no place for: skipped like an
			// unknown member, the record would be stored without it
			// under a 200. A null key is no key.
			var v json.RawMessage
			if err := dec.Decode(&v); err != nil {
				return err
			}
			if string(v) != "null" {
				return malformed("a record has a key, which this protocol does not carry; " +
					"put it in a header (\"headers\": {\"key\": ...}) instead")
			}
			return nil
		default:
			return skipValue(dec)
		}
	})
	switch {
	case err != nil:
		return Record{}, err
	case hasBody && hasB64:
		return Record{}, malformed("a record has both body and body_b64")
	case !hasBody && !hasB64:
		return Record{}, malformed("a record needs body or body_b64")
	}
	return rec, nil
}

// decodeBase64 decodes body_b64, which pico-wire.md gives as standard
// base64 (RFC 4648 section 4): padded, every character from the alphabet,
// and zero bits after the last byte. Go's decoder skips CR and LF and, but
// in strict mode, ignores those bits, so it would store texts that are no
// base64 (PicoMQ's own decoder refuses them) and several texts as one body.
func decodeBase64(s string) ([]byte, error) {
	if i := strings.IndexAny(s, "\r\n"); i >= 0 {
		return nil, fmt.Errorf("line break at byte %d", i)
	}
	return base64.StdEncoding.Strict().DecodeString(s)
}

// unpairedSurrogate returns the offset of the first \u escape in a string
// of the JSON text data that is a UTF-16 surrogate without its other
// half: a high one (D800-DBFF) not followed at once by an escaped low one
// (DC00-DFFF), or a low one alone. It reads only as much of the syntax as
// it needs; the decoder refuses what is not JSON.
func unpairedSurrogate(data []byte) (int, bool) {
	inString := false
	for i := 0; i < len(data); i++ {
		switch c := data[i]; {
		case !inString:
			inString = c == '"'
		case c == '"':
			inString = false
		case c == '\\':
			u, ok := escapedUnit(data, i)
			if !ok {
				i++ // a one-letter escape, or a malformed one
				continue
			}
			switch {
			case u >= 0xd800 && u <= 0xdbff:
				if low, ok := escapedUnit(data, i+6); ok && low >= 0xdc00 && low <= 0xdfff {
					i += 11
					continue
				}
				return i, true
			case u >= 0xdc00 && u <= 0xdfff:
				return i, true
			}
			i += 5
		}
	}
	return 0, false
}

// escapedUnit reads a \uXXXX escape at data[i:].
func escapedUnit(data []byte, i int) (uint16, bool) {
	if i+6 > len(data) || data[i] != '\\' || data[i+1] != 'u' {
		return 0, false
	}
	n, err := strconv.ParseUint(string(data[i+2:i+6]), 16, 16)
	return uint16(n), err == nil
}

// object walks a JSON object, calling fn with the decoder positioned at
// each key's value; fn must consume the value.
func object(dec *json.Decoder, fn func(key string) error) error {
	if err := expectDelim(dec, '{'); err != nil {
		return err
	}
	return members(dec, fn)
}

// members is object past its opening brace.
func members(dec *json.Decoder, fn func(key string) error) error {
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		key, ok := tok.(string)
		if !ok {
			return malformed("object key expected")
		}
		if err := fn(key); err != nil {
			return err
		}
	}
	_, err := dec.Token() // '}'
	return err
}

func expectDelim(dec *json.Decoder, want json.Delim) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	if d, ok := tok.(json.Delim); !ok || d != want {
		return malformed("expected %q", string(want))
	}
	return nil
}

func stringValue(dec *json.Decoder, what string) (string, error) {
	tok, err := dec.Token()
	if err != nil {
		return "", err
	}
	s, ok := tok.(string)
	if !ok {
		return "", malformed("%s must be a string", what)
	}
	return s, nil
}

// optionalString is stringValue for a member that may be null, which
// reports it not present.
func optionalString(dec *json.Decoder, what string) (s string, present bool, _ error) {
	tok, err := dec.Token()
	if err != nil || tok == nil {
		return "", false, err
	}
	s, ok := tok.(string)
	if !ok {
		return "", false, malformed("%s must be a string", what)
	}
	return s, true, nil
}

func skipValue(dec *json.Decoder) error {
	var v json.RawMessage
	return dec.Decode(&v)
}

// AppendJSONRead appends the JSON read form of stored records: an array of
// {"seq","timestamp","headers"?,"body"|"body_b64"}. headers is omitted when
// empty; a body that is valid UTF-8 is "body", otherwise "body_b64".
func AppendJSONRead(b []byte, recs []segment.Record) []byte {
	b = append(b, '[')
	for i := range recs {
		if i > 0 {
			b = append(b, ',')
		}
		b = AppendJSONRecord(b, &recs[i])
	}
	return append(b, ']')
}

// AppendJSONRecord appends one record in the JSON read form.
func AppendJSONRecord(b []byte, r *segment.Record) []byte {
	b = append(b, `{"seq":`...)
	b = strconv.AppendUint(b, r.Seq, 10)
	b = append(b, `,"timestamp":`...)
	b = strconv.AppendInt(b, r.Timestamp, 10)
	if len(r.Headers) > 0 {
		b = append(b, `,"headers":{`...)
		for i, h := range r.Headers {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendJSONString(b, h.Name)
			b = append(b, ':')
			b = appendJSONString(b, h.Value)
		}
		b = append(b, '}')
	}
	if utf8.Valid(r.Body) {
		b = append(b, `,"body":`...)
		b = appendJSONString(b, r.Body)
	} else {
		b = append(b, `,"body_b64":"`...)
		b = base64.StdEncoding.AppendEncode(b, r.Body)
		b = append(b, '"')
	}
	return append(b, '}')
}

// appendJSONString appends s as a JSON string, escaping only what JSON
// requires (and U+2028, U+2029, which JavaScript source does not take in
// a string); invalid UTF-8 becomes U+FFFD, as encoding/json writes it.
// encoding/json also escapes <, > and & for HTML, six bytes for one: a
// body of them made a response six times the record, built in three
// copies.
func appendJSONString[T ~string | ~[]byte](b []byte, s T) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRune([]byte(s[i:min(i+utf8.UTFMax, len(s))]))
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hex[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
