package integration

import (
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// picoRefStep is one request of TestPicoReference and what the Pico
// reference (picomq-api.md, picomq-openapi.yaml, pico-wire.md) says it gets.
type picoRefStep struct {
	name         string
	method, path string
	body         []byte
	hdr          []string // request headers, name/value pairs
	status       int
	code         string   // the error name of an error body; "" for a success
	says         string   // a part of the error body's message, when set
	want         []string // response headers, name/value pairs; "" means absent
	wantBody     *string  // the exact body, when set
	writeNothing bool     // a refused request: the bucket sees no write
}

// TestPicoReference walks through documented behaviours of the Pico
// protocol, in order on one server, the way a client written from the
// reference alone would meet them: statuses, headers, error names and
// bodies, including the corners the main protocol test leaves out.
func TestPicoReference(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"compact_interval 1h"}, []string{"long_poll_timeout 1s"})
	str := func(s string) *string { return &s }
	const catchUpCache = "public, max-age=60, stale-while-revalidate=300"
	twice := picoEncodeBinary([]picoNewRecord{{body: []byte("a")}, {headers: [][2]string{{"k", "1"}, {"j", ""}, {"k", "2"}}, body: []byte("b")}})
	steps := []picoRefStep{
		// Unknown streams are 404 not_found for every operation.
		{name: "append to a missing stream", method: "POST", path: "/pico/ref/missing", body: []byte("x"), status: 404, code: "not_found", writeNothing: true},
		{name: "trim a missing stream", method: "POST", path: "/pico/ref/missing", hdr: []string{"Pico-Trim-Seq", "0"}, status: 404, code: "not_found", writeNothing: true},
		{name: "delete a missing stream", method: "DELETE", path: "/pico/ref/missing", status: 404, code: "not_found", writeNothing: true},
		{name: "long-poll a missing stream", method: "GET", path: "/pico/ref/missing?live=long-poll", status: 404, code: "not_found"},
		{name: "HEAD a missing stream", method: "HEAD", path: "/pico/ref/missing", status: 404},

		{name: "create", method: "PUT", path: "/pico/ref/s", body: []byte("r0"), hdr: []string{"Content-Type", "text/plain"}, status: 201,
			want: []string{"Pico-Next-Seq", "1", "Location", "/pico/ref/s"}},
		// A record's headers are a string-to-string map: a batch that
		// gives one name twice is malformed, and writes nothing.
		{name: "binary batch with a header twice", method: "POST", path: "/pico/ref/s", body: twice, hdr: []string{"Content-Type", picoBinaryBatch},
			status: 400, code: "bad_request", writeNothing: true},
		{name: "JSON batch with a header twice", method: "POST", path: "/pico/ref/s", body: []byte(`{"records":[{"body":"a","headers":{"k":"1","k":"2"}}]}`),
			hdr: []string{"Content-Type", picoJSONBatch}, status: 400, code: "bad_request", writeNothing: true},
		// An escaped UTF-16 surrogate without its pair stands for no
		// character: decoded, it would be stored as U+FFFD, another body
		// than the one sent. Such a batch is malformed; bytes that are
		// not text go in body_b64.
		{name: "JSON batch with an unpaired surrogate in a body", method: "POST", path: "/pico/ref/s", body: []byte(`{"records":[{"body":"a\ud800b"}]}`),
			hdr: []string{"Content-Type", picoJSONBatch}, status: 400, code: "bad_request", writeNothing: true},
		{name: "JSON batch with an unpaired surrogate in a header name", method: "POST", path: "/pico/ref/s", body: []byte(`{"records":[{"body":"a","headers":{"\udc00":"v"}}]}`),
			hdr: []string{"Content-Type", picoJSONBatch}, status: 400, code: "bad_request", writeNothing: true},
		{name: "JSON batch with surrogates the wrong way round", method: "POST", path: "/pico/ref/s", body: []byte(`{"records":[{"body":"\udd80\ud83e"}]}`),
			hdr: []string{"Content-Type", picoJSONBatch}, status: 400, code: "bad_request", writeNothing: true},
		// body_b64 is standard base64 (RFC 4648): a line break or bits
		// after the last byte are no part of it, and PicoMQ refuses
		// them; taken leniently, two texts would be one body.
		{name: "JSON batch with a line break in body_b64", method: "POST", path: "/pico/ref/s", body: []byte(`{"records":[{"body_b64":"AA\nEC"}]}`),
			hdr: []string{"Content-Type", picoJSONBatch}, status: 400, code: "bad_request", says: "body_b64", writeNothing: true},
		{name: "JSON batch with stray bits in body_b64", method: "POST", path: "/pico/ref/s", body: []byte(`{"records":[{"body_b64":"AB=="}]}`),
			hdr: []string{"Content-Type", picoJSONBatch}, status: 400, code: "bad_request", says: "body_b64", writeNothing: true},
		// A record key (later PicoMQ releases) has no place in these
		// formats: a JSON record with one is refused rather than stored
		// without it, and a binary batch as PicoMQ's Go client writes it
		// (an i32 key length, -1 for none, before the headers) reads as a
		// header count larger than the batch.
		{name: "JSON batch with a record key", method: "POST", path: "/pico/ref/s", body: []byte(`{"records":[{"key":"order-1","body":"a"}]}`),
			hdr: []string{"Content-Type", picoJSONBatch}, status: 400, code: "bad_request", says: "key", writeNothing: true},
		{name: "binary batch with a key", method: "POST", path: "/pico/ref/s", body: []byte("\x01\x00\x00\x00\x01\xff\xff\xff\xff\x00\x00\x00\x00\x00\x00\x00\x01a"),
			hdr: []string{"Content-Type", picoBinaryBatch}, status: 400, code: "bad_request", says: "header count", writeNothing: true},
		{name: "binary batch with a text key", method: "POST", path: "/pico/ref/s",
			body: []byte("\x01\x00\x00\x00\x02\x00\x00\x00\x07order-1\x00\x00\x00\x00\x00\x00\x00\x01a" + "\x00\x00\x00\x07order-2\x00\x00\x00\x00\x00\x00\x00\x40" + strings.Repeat("b", 64)),
			hdr:  []string{"Content-Type", picoBinaryBatch}, status: 400, code: "bad_request", says: "malformed batch", writeNothing: true},
		{name: "create with a batch giving a header twice", method: "PUT", path: "/pico/ref/dup", body: twice, hdr: []string{"Content-Type", picoBinaryBatch},
			status: 400, code: "bad_request", writeNothing: true},
		{name: "no stream made by the refused create", method: "HEAD", path: "/pico/ref/dup", status: 404},
		// A create's body is the first records of a new stream: repeated
		// on the stream it made (a retry whose answer was lost), it is
		// confirmed; with another body it would be dropped, so it is
		// refused, and neither writes.
		{name: "the create with its body again", method: "PUT", path: "/pico/ref/s", body: []byte("r0"), hdr: []string{"Content-Type", "text/plain"}, status: 200,
			want: []string{"Pico-Next-Seq", "1", "Location", ""}},
		{name: "a create with another body", method: "PUT", path: "/pico/ref/s", body: []byte("other"), hdr: []string{"Content-Type", "text/plain"},
			status: 409, code: "conflict", says: "its first records are not this create's body", want: []string{"Pico-Next-Seq", "1"}, writeNothing: true},
		// A record's headers are a map: the create repeated with them in
		// another order (rebuilt from a hash map, say) is the same create.
		{name: "create with headers", method: "PUT", path: "/pico/ref/hdrs", body: []byte(`{"records":[{"body":"h","headers":{"x":"1","y":"2"}}]}`),
			hdr: []string{"Content-Type", picoJSONBatch}, status: 201},
		{name: "the create with its headers in another order", method: "PUT", path: "/pico/ref/hdrs", body: []byte(`{"records":[{"body":"h","headers":{"y":"2","x":"1"}}]}`),
			hdr: []string{"Content-Type", picoJSONBatch}, status: 200, want: []string{"Pico-Next-Seq", "1"}},
		{name: "the create with another header value", method: "PUT", path: "/pico/ref/hdrs", body: []byte(`{"records":[{"body":"h","headers":{"y":"2","x":"3"}}]}`),
			hdr: []string{"Content-Type", picoJSONBatch}, status: 409, code: "conflict", says: "its first records are not this create's body", writeNothing: true},
		{name: "the create with a header more", method: "PUT", path: "/pico/ref/hdrs", body: []byte(`{"records":[{"body":"h","headers":{"y":"2","x":"1","z":"3"}}]}`),
			hdr: []string{"Content-Type", picoJSONBatch}, status: 409, code: "conflict", says: "its first records are not this create's body", writeNothing: true},
		{name: "delete the stream with headers", method: "DELETE", path: "/pico/ref/hdrs", status: 204},

		// Headers the API page gives appends only are refused on a
		// create, which would neither check nor record them.
		{name: "create with producer headers", method: "PUT", path: "/pico/ref/prodcreate", body: []byte("p0"),
			hdr:    []string{"Content-Type", "text/plain", "Pico-Producer-Id", "w", "Pico-Producer-Epoch", "0", "Pico-Producer-Seq", "0"},
			status: 400, code: "bad_request", says: "Pico-Producer-Id, Pico-Producer-Epoch, Pico-Producer-Seq: only an append (POST) takes these", writeNothing: true},
		{name: "create with Pico-Match-Seq", method: "PUT", path: "/pico/ref/prodcreate", hdr: []string{"Pico-Match-Seq", "0"},
			status: 400, code: "bad_request", says: "Pico-Match-Seq", writeNothing: true},
		{name: "no stream made by the refused creates", method: "HEAD", path: "/pico/ref/prodcreate", status: 404},
		{name: "nothing appended by the refused batches", method: "GET", path: "/pico/ref/s?format=raw", status: 200, wantBody: str("r0")},

		// A surrogate pair is one character, stored as its UTF-8.
		{name: "create for a surrogate pair", method: "PUT", path: "/pico/ref/pair", hdr: []string{"Content-Type", "text/plain"}, status: 201},
		{name: "JSON batch with a surrogate pair", method: "POST", path: "/pico/ref/pair", body: []byte(`{"records":[{"body":"\ud83e\udd80","headers":{"\ud83e\udd80":"\u00e9"}}]}`),
			hdr: []string{"Content-Type", picoJSONBatch}, status: 200, want: []string{"Pico-Next-Seq", "1"}},
		{name: "the surrogate pair read back", method: "GET", path: "/pico/ref/pair?format=raw", status: 200, wantBody: str("\U0001F980")},
		{name: "delete the surrogate pair's stream", method: "DELETE", path: "/pico/ref/pair", status: 204},

		// A batch type without a body is a create without records, to
		// append batches to, and repeats as such.
		{name: "create for batches", method: "PUT", path: "/pico/ref/batches", hdr: []string{"Content-Type", picoBinaryBatch}, status: 201,
			want: []string{"Pico-Next-Seq", "0", "Content-Type", "application/octet-stream"}},
		{name: "create for batches again", method: "PUT", path: "/pico/ref/batches", hdr: []string{"Content-Type", picoJSONBatch}, status: 200,
			want: []string{"Pico-Next-Seq", "0"}},
		{name: "a batch to the stream made for batches", method: "POST", path: "/pico/ref/batches", body: picoEncodeBinary([]picoNewRecord{{body: []byte("b0")}, {body: []byte("b1")}}),
			hdr: []string{"Content-Type", picoBinaryBatch}, status: 200, want: []string{"Pico-Start-Seq", "0", "Pico-Next-Seq", "2"}},
		{name: "delete the stream made for batches", method: "DELETE", path: "/pico/ref/batches", status: 204},

		// Reads at the tail, in each format.
		{name: "read at the tail", method: "GET", path: "/pico/ref/s?seq=1", status: 200, wantBody: str("[]"),
			want: []string{"Pico-Next-Seq", "1", "Pico-Up-To-Date", "true", "Content-Type", "application/json", "Cache-Control", "no-store"}},
		{name: "seq=now, binary", method: "GET", path: "/pico/ref/s?seq=now&format=binary", status: 200, wantBody: str("\x01\x00\x00\x00\x00"),
			want: []string{"Pico-Next-Seq", "1", "Content-Type", picoBinaryBatch}},
		{name: "seq=now, raw", method: "GET", path: "/pico/ref/s?seq=now&format=raw", status: 200, wantBody: str(""),
			want: []string{"Pico-Next-Seq", "1", "Content-Type", "text/plain"}},
		{name: "count caps a page", method: "GET", path: "/pico/ref/s?count=1", status: 200,
			want: []string{"Pico-Next-Seq", "1", "Pico-Up-To-Date", "true", "Cache-Control", catchUpCache}},

		// Producers: any seq already taken is acknowledged without writing,
		// and without the position of records written now.
		{name: "producer 0", method: "POST", path: "/pico/ref/s", body: []byte("r1"), hdr: []string{"Pico-Producer-Id", "w", "Pico-Producer-Epoch", "0", "Pico-Producer-Seq", "0"},
			status: 200, want: []string{"Pico-Start-Seq", "1", "Pico-Next-Seq", "2", "Pico-Producer-Seq", "0"}},
		{name: "producer 1", method: "POST", path: "/pico/ref/s", body: []byte("r2"), hdr: []string{"Pico-Producer-Id", "w", "Pico-Producer-Epoch", "0", "Pico-Producer-Seq", "1"},
			status: 200, want: []string{"Pico-Start-Seq", "2", "Pico-Next-Seq", "3"}},
		{name: "producer 0 again, an older seq", method: "POST", path: "/pico/ref/s", body: []byte("r1"), hdr: []string{"Pico-Producer-Id", "w", "Pico-Producer-Epoch", "0", "Pico-Producer-Seq", "0"},
			status: 200, want: []string{"Pico-Start-Seq", "", "Pico-Timestamp", "", "Pico-Next-Seq", "3"}},

		// A producer's retry of the append that closed the stream (its
		// answer lost) is that append, acknowledged again without
		// writing, whatever its records hold; any other seq is refused
		// as the stream is closed.
		{name: "create for a closing producer", method: "PUT", path: "/pico/ref/pc", hdr: []string{"Content-Type", "text/plain"}, status: 201},
		{name: "a producer's closing append", method: "POST", path: "/pico/ref/pc", body: []byte("last"),
			hdr:    []string{"Pico-Producer-Id", "w", "Pico-Producer-Epoch", "0", "Pico-Producer-Seq", "0", "Pico-Closed", "true"},
			status: 200, want: []string{"Pico-Start-Seq", "0", "Pico-Next-Seq", "1", "Pico-Closed", "true"}},
		{name: "the closing append again", method: "POST", path: "/pico/ref/pc", body: []byte("last"),
			hdr:    []string{"Pico-Producer-Id", "w", "Pico-Producer-Epoch", "0", "Pico-Producer-Seq", "0", "Pico-Closed", "true"},
			status: 200, want: []string{"Pico-Start-Seq", "", "Pico-Timestamp", "", "Pico-Next-Seq", "1", "Pico-Closed", "true", "Pico-Producer-Seq", "0"}, writeNothing: true},
		{name: "the producer's next seq on the closed stream", method: "POST", path: "/pico/ref/pc", body: []byte("more"),
			hdr:    []string{"Pico-Producer-Id", "w", "Pico-Producer-Epoch", "0", "Pico-Producer-Seq", "1"},
			status: 409, code: "closed", want: []string{"Pico-Closed", "true", "Pico-Next-Seq", "1"}, writeNothing: true},
		{name: "create for a closing batch", method: "PUT", path: "/pico/ref/pcb", hdr: []string{"Content-Type", picoBinaryBatch}, status: 201},
		{name: "a producer's closing batch", method: "POST", path: "/pico/ref/pcb", body: picoEncodeBinary([]picoNewRecord{{body: []byte{0xff}}, {body: []byte("z")}}),
			hdr:    []string{"Content-Type", picoBinaryBatch, "Pico-Producer-Id", "w", "Pico-Producer-Epoch", "0", "Pico-Producer-Seq", "0", "Pico-Closed", "true"},
			status: 200, want: []string{"Pico-Start-Seq", "0", "Pico-Next-Seq", "2", "Pico-Closed", "true"}},
		{name: "the closing batch again", method: "POST", path: "/pico/ref/pcb", body: picoEncodeBinary([]picoNewRecord{{body: []byte{0xff}}, {body: []byte("z")}}),
			hdr:    []string{"Content-Type", picoBinaryBatch, "Pico-Producer-Id", "w", "Pico-Producer-Epoch", "0", "Pico-Producer-Seq", "0", "Pico-Closed", "true"},
			status: 200, want: []string{"Pico-Start-Seq", "", "Pico-Next-Seq", "2", "Pico-Closed", "true"}, writeNothing: true},
		{name: "the closed streams kept their records", method: "GET", path: "/pico/ref/pc?format=raw", status: 200, wantBody: str("last")},
		{name: "delete the closing producer's stream", method: "DELETE", path: "/pico/ref/pc", status: 204},
		{name: "delete the closing batch's stream", method: "DELETE", path: "/pico/ref/pcb", status: 204},

		// Without seq= a read starts where Last-Event-ID says, so a cache
		// must tell such pages apart, and one placed by the header alone
		// is kept by none: a CDN that ignores Vary would serve it to
		// readers from the start, who would miss records 0 and 1.
		{name: "read from Last-Event-ID", method: "GET", path: "/pico/ref/s?format=raw", hdr: []string{"Last-Event-ID", "2"}, status: 200,
			wantBody: str("r2"), want: []string{"Cache-Control", "no-store", "Vary", "Last-Event-ID", "Pico-Next-Seq", "3"}},
		// A reconnect whose Last-Event-ID is no seq (a Durable Streams
		// offset, say) is told that header is wrong: it sent no seq.
		{name: "a Last-Event-ID that is no seq", method: "GET", path: "/pico/ref/s?live=sse", hdr: []string{"Last-Event-ID", "0000000000000002_0000000000000000"},
			status: 400, code: "bad_request", says: `Last-Event-ID must be a seq (a non-negative integer) or now, got "0000000000000002_0000000000000000"`},
		{name: "read from the start without seq", method: "GET", path: "/pico/ref/s?format=raw", status: 200, wantBody: str("r0r1r2"),
			want: []string{"Cache-Control", catchUpCache, "Vary", "Last-Event-ID"}},

		// A conditional close that does not match closes nothing.
		{name: "close with a stale Pico-Match-Seq", method: "POST", path: "/pico/ref/s", hdr: []string{"Pico-Closed", "true", "Pico-Match-Seq", "1"},
			status: 412, code: "match_failed", want: []string{"Pico-Next-Seq", "3", "Pico-Closed", ""}},
		{name: "still open", method: "HEAD", path: "/pico/ref/s", status: 200, want: []string{"Pico-Closed", "", "Pico-Next-Seq", "3"}},
		{name: "trim below nothing retained yet", method: "POST", path: "/pico/ref/s", hdr: []string{"Pico-Trim-Seq", "1"}, status: 200,
			want: []string{"Pico-Start-Seq", "1", "Pico-Next-Seq", "3"}},
		{name: "a trim below the start is a no-op", method: "POST", path: "/pico/ref/s", hdr: []string{"Pico-Trim-Seq", "0"}, status: 200,
			want: []string{"Pico-Start-Seq", "1"}},
		{name: "close with the matching Pico-Match-Seq", method: "POST", path: "/pico/ref/s", hdr: []string{"Pico-Closed", "true", "Pico-Match-Seq", "3"},
			status: 200, want: []string{"Pico-Closed", "true", "Pico-Next-Seq", "3"}},
		// A repeated close is idempotent, but only where its condition
		// holds: a conditional close that names another tail did not
		// seal the stream where it meant to.
		{name: "the same conditional close again", method: "POST", path: "/pico/ref/s", hdr: []string{"Pico-Closed", "true", "Pico-Match-Seq", "3"},
			status: 200, want: []string{"Pico-Closed", "true", "Pico-Next-Seq", "3"}},
		{name: "a conditional close naming another tail of the closed stream", method: "POST", path: "/pico/ref/s", hdr: []string{"Pico-Closed", "true", "Pico-Match-Seq", "2"},
			status: 409, code: "closed", want: []string{"Pico-Closed", "true", "Pico-Next-Seq", "3"}, writeNothing: true},
		{name: "long-poll at the end of a closed stream", method: "GET", path: "/pico/ref/s?seq=3&live=long-poll", status: 204,
			want: []string{"Pico-Closed", "true", "Pico-Up-To-Date", "true", "Pico-Next-Seq", "3", "Cache-Control", "no-store"}},
		{name: "read the end of a closed stream", method: "GET", path: "/pico/ref/s?seq=2", status: 200,
			want: []string{"Pico-Closed", "true", "Pico-Up-To-Date", "true", "Pico-Next-Seq", "3"}},
		// SSE events carry JSON (pico-wire.md): another format is
		// refused, not answered in JSON without saying so.
		{name: "SSE with format=binary", method: "GET", path: "/pico/ref/s?seq=2&live=sse&format=binary", status: 400, code: "bad_request",
			says: "format=binary does not apply to live=sse"},
		{name: "SSE with format=raw", method: "GET", path: "/pico/ref/s?seq=2&live=sse&format=raw", status: 400, code: "bad_request",
			says: "format=raw does not apply to live=sse"},
		{name: "a page short of the end of a closed stream", method: "GET", path: "/pico/ref/s?seq=1&count=1", status: 200,
			want: []string{"Pico-Closed", "", "Pico-Up-To-Date", "", "Pico-Next-Seq", "2"}},

		// Expiry: an RFC 3339 time with an offset is the same instant.
		{name: "create with an Expires-At offset", method: "PUT", path: "/pico/ref/exp", hdr: []string{"Pico-Expires-At", "2099-01-01T00:00:00+02:00"}, status: 201,
			want: []string{"Content-Type", "application/octet-stream"}},
		{name: "HEAD shows the instant", method: "HEAD", path: "/pico/ref/exp", status: 200,
			want: []string{"Pico-Expires-At", "2098-12-31T22:00:00Z", "Pico-TTL", "", "Pico-Start-Seq", "0", "Pico-Next-Seq", "0"}},
		{name: "the same instant in Unix ms is the same create", method: "PUT", path: "/pico/ref/exp",
			hdr: []string{"Pico-Expires-At", strconv.FormatInt(time.Date(2098, 12, 31, 22, 0, 0, 0, time.UTC).UnixMilli(), 10)}, status: 200},

		// A producer's new epoch starts at seq 0: another seq is a gap from
		// it (the error table's sequence_gap), as for a producer the stream
		// does not know yet, where it used to be 400 bad_request.
		{name: "create for producers", method: "PUT", path: "/pico/refx/c", hdr: []string{"Content-Type", "text/plain"}, status: 201},
		{name: "a producer's first append", method: "POST", path: "/pico/refx/c", body: []byte("b"),
			hdr:    []string{"Pico-Producer-Id", "w", "Pico-Producer-Epoch", "0", "Pico-Producer-Seq", "0"},
			status: 200, want: []string{"Pico-Next-Seq", "1"}},
		{name: "its new epoch at seq 3", method: "POST", path: "/pico/refx/c", body: []byte("c"),
			hdr:    []string{"Pico-Producer-Id", "w", "Pico-Producer-Epoch", "1", "Pico-Producer-Seq", "3"},
			status: 409, code: "sequence_gap", says: "starts at seq 0", want: []string{"Pico-Expected-Seq", "0", "Pico-Received-Seq", "3"}, writeNothing: true},
		{name: "an unknown producer at seq 3", method: "POST", path: "/pico/refx/c", body: []byte("c"),
			hdr:    []string{"Pico-Producer-Id", "v", "Pico-Producer-Epoch", "1", "Pico-Producer-Seq", "3"},
			status: 409, code: "sequence_gap", want: []string{"Pico-Expected-Seq", "0", "Pico-Received-Seq", "3"}, writeNothing: true},

		// Choices the reference leaves open (README, Protocols, Pico), on
		// the stream above, outside the listing below. Pico-Closed counts
		// only as true: another value appends without closing.
		{name: "an append with Pico-Closed: 1", method: "POST", path: "/pico/refx/c", body: []byte("a"), hdr: []string{"Pico-Closed", "1"}, status: 200,
			want: []string{"Pico-Next-Seq", "2", "Pico-Closed", ""}},
		{name: "not closed by it", method: "HEAD", path: "/pico/refx/c", status: 200, want: []string{"Pico-Closed", "", "Pico-Next-Seq", "2"}},
		// A position past the tail is no place to read or trim to.
		{name: "read past the tail", method: "GET", path: "/pico/refx/c?seq=3", status: 400, code: "bad_request", says: "beyond the tail 2"},
		{name: "Last-Event-ID past the tail", method: "GET", path: "/pico/refx/c", hdr: []string{"Last-Event-ID", "5"}, status: 400, code: "bad_request",
			says: "beyond the tail 2"},
		{name: "trim past the tail", method: "POST", path: "/pico/refx/c", hdr: []string{"Pico-Trim-Seq", "3"}, status: 400, code: "bad_request",
			says: "beyond the tail 2", writeNothing: true},
		// A name is the decoded path: %2F is a slash.
		{name: "the same stream with %2F", method: "HEAD", path: "/pico/refx%2Fc", status: 200, want: []string{"Pico-Next-Seq", "2", "Content-Type", "text/plain"}},

		// Listing: limit=0 is no cap beyond the server's own.
		{name: "list with limit=0", method: "GET", path: "/pico/?prefix=/ref/&limit=0", status: 200,
			want: []string{"Content-Type", "application/json", "Cache-Control", "no-store"},
			wantBody: str(`{"streams":[{"name":"/ref/exp","content_type":"application/octet-stream","start_seq":0,"next_seq":0,"closed":false,"expires_at":"2098-12-31T22:00:00Z"},` +
				`{"name":"/ref/s","content_type":"text/plain","start_seq":1,"next_seq":3,"closed":true}],"has_more":false}`)},
	}
	for _, s := range steps {
		req := fhReq{Method: s.method, Path: s.path, Body: s.body, Header: picoHdr(s.hdr...)}
		var resp fhResp
		if s.writeNothing {
			var writes map[string]int
			resp, writes = fhExpectNoWrites(t, e, req)
			if len(writes) > 0 {
				t.Errorf("%s: the refused request wrote to the bucket: %s", s.name, fhSortedKeys(writes))
			}
		} else {
			resp = e.must(req)
		}
		if s.code != "" {
			body := picoWantError(t, s.name, resp, s.status, s.code)
			if msg, _ := body["message"].(string); msg == "" || !strings.Contains(msg, s.says) {
				t.Errorf("%s: error body %s has no message saying %q", s.name, resp.Body, s.says)
			}
		}
		picoWant(t, s.name, resp, s.status, s.want...)
		if s.wantBody != nil && string(resp.Body) != *s.wantBody {
			t.Errorf("%s: body %q, want %q", s.name, resp.Body, *s.wantBody)
		}
		if s.method == "DELETE" && resp.Status == 204 {
			// The collector buries a deleted stream in the background;
			// its writes would be taken for those of a later refused
			// request.
			picoWaitCollected(t, e)
		}
	}

	// A browser's preflight that names no headers is told the Pico ones:
	// those the reference has clients send, and the Pico-* it answers.
	r := picoDo(e, "OPTIONS", "/pico/ref/s", nil, "Origin", "https://app.example", "Access-Control-Request-Method", "POST")
	picoWant(t, "preflight", r, 204, "Access-Control-Allow-Origin", "*")
	for name, want := range map[string][]string{
		"Access-Control-Allow-Headers": {"Content-Type", "If-None-Match", "Last-Event-ID", "Pico-TTL", "Pico-Expires-At", "Pico-Closed",
			"Pico-Match-Seq", "Pico-Trim-Seq", "Pico-Producer-Id", "Pico-Producer-Epoch", "Pico-Producer-Seq"},
		"Access-Control-Expose-Headers": {"Pico-Start-Seq", "Pico-Next-Seq", "Pico-Timestamp", "Pico-Up-To-Date", "Pico-Closed",
			"Pico-Cursor", "Pico-Expected-Seq", "Pico-Received-Seq", "ETag", "Content-Type"},
	} {
		got := strings.Split(r.Header.Get(name), ", ")
		for _, h := range want {
			if !slices.ContainsFunc(got, func(g string) bool { return strings.EqualFold(g, h) }) {
				t.Errorf("preflight: %s %q lacks %s", name, got, h)
			}
		}
	}

	// The 304 of a page names it again and tells where to resume.
	r = picoDo(e, "GET", "/pico/ref/s?seq=1&count=1", nil)
	tag := r.Header.Get("ETag")
	// The API page lists Pico-Cursor for paginated catch-up reads.
	if r.Header.Get("Pico-Cursor") == "" {
		t.Errorf("a catch-up page has no Pico-Cursor (headers %v)", r.Header)
	}
	picoWant(t, "revalidated page", picoDo(e, "GET", "/pico/ref/s?seq=1&count=1", nil, "If-None-Match", tag), 304,
		"ETag", tag, "Pico-Next-Seq", "2", "Cache-Control", catchUpCache)
	var recs []picoRecord
	if err := json.Unmarshal(r.Body, &recs); err != nil || len(recs) != 1 || recs[0].Seq != 1 || recs[0].Headers != nil {
		t.Errorf("page from seq 1: %s (%v)", r.Body, err)
	}
}

// picoWaitCollected waits until the collector has worked off every
// tombstone of a deleted stream.
func picoWaitCollected(t *testing.T, e *fhEnv) {
	t.Helper()
	err := fhWaitFor(fhCompactWait, 20*time.Millisecond, func() error {
		if left := e.mustList("gc/"); len(left) > 0 {
			return fmt.Errorf("tombstones %v", left)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("the collector did not work off a delete: %v", err)
	}
}
