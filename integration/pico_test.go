package integration

// Tests of the Pico protocol through a real Caddy child on versitygw. Every
// name here starts with "pico" so that it cannot collide with the helpers of
// the other integration tests in this package.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// Media types of the Pico batch formats.
const (
	picoBinaryBatch = "application/vnd.picomq.batch"
	picoJSONBatch   = "application/vnd.picomq.batch+json"
)

// picoStart starts versitygw, the counting proxy in front of it, and Caddy
// serving one bucket through both protocols, as a user would configure it:
//
//	handle_path /ds/*   { picomq { storage S } }
//	handle_path /pico/* { picomq { protocol pico; storage S } }
//
// engine directives go into both blocks (handlers on one storage must agree
// on them); picoOnly ones into the Pico block only.
func picoStart(t *testing.T, engine, picoOnly []string) *fhEnv {
	t.Helper()
	return picoStartGuarded(t, engine, picoOnly, "")
}

// picoStartGuarded is picoStart with guard (Caddyfile directives, such as a
// basic_auth block) ahead of the module in both routes.
func picoStartGuarded(t *testing.T, engine, picoOnly []string, guard string) *fhEnv {
	t.Helper()
	v := testenv.NewVersity(t)
	p, err := testenv.NewProxy(v.Endpoint)
	if err != nil {
		t.Fatalf("S3 proxy: %v", err)
	}
	t.Cleanup(func() { p.Close() })
	bucket := v.NewBucket(t)
	storage := testenv.StoreURL(p.URL(), bucket, caddytest.S3Prefix)
	block := func(extra ...string) string {
		var b strings.Builder
		b.WriteString(guard)
		fmt.Fprintf(&b, "\t\tpicomq {\n\t\t\tstorage %q\n", storage)
		for _, d := range append(append([]string(nil), engine...), extra...) {
			fmt.Fprintf(&b, "\t\t\t%s\n", d)
		}
		b.WriteString("\t\t}\n")
		return b.String()
	}
	caddyfile := "{\n\tpersist_config off\n}\n\nhttp://:{$" + caddytest.PortEnv + "} {\n\tbind 127.0.0.1\n" +
		"\thandle_path /ds/* {\n" + block() + "\t}\n" +
		"\thandle_path /pico/* {\n" + block(append([]string{"protocol pico"}, picoOnly...)...) + "\t}\n}\n"
	c := caddytest.Start(t, caddytest.Options{
		Caddyfile:    caddyfile,
		Env:          caddytest.S3Env(v),
		ReadyTimeout: 90 * time.Second,
	})
	return &fhEnv{t: t, v: v, proxy: p, bucket: bucket, caddy: c, client: &http.Client{Timeout: 2 * time.Minute}}
}

// picoHdr builds a header map from name/value pairs.
func picoHdr(kv ...string) map[string]string {
	m := make(map[string]string, len(kv)/2)
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return m
}

// picoDo sends a request and fails the test on a transport error.
func picoDo(e *fhEnv, method, path string, body []byte, kv ...string) fhResp {
	e.t.Helper()
	return e.must(fhReq{Method: method, Path: path, Body: body, Header: picoHdr(kv...)})
}

// picoWant fails the test unless resp has the status and headers given as
// name/value pairs ("" means absent).
func picoWant(t *testing.T, what string, resp fhResp, status int, kv ...string) {
	t.Helper()
	if resp.Status != status {
		t.Fatalf("%s: %s, want %d (headers %v)", what, resp, status, resp.Header)
	}
	for i := 0; i+1 < len(kv); i += 2 {
		if got := resp.Header.Get(kv[i]); got != kv[i+1] {
			t.Errorf("%s: %s = %q, want %q", what, kv[i], got, kv[i+1])
		}
	}
}

// picoWantError fails the test unless resp is a Pico JSON error with the
// status and error name.
func picoWantError(t *testing.T, what string, resp fhResp, status int, code string) map[string]any {
	t.Helper()
	picoWant(t, what, resp, status)
	var body map[string]any
	if err := json.Unmarshal(resp.Body, &body); err != nil {
		t.Fatalf("%s: error body %q is not JSON: %v", what, resp.Body, err)
	}
	if body["error"] != code {
		t.Errorf("%s: error %v, want %q (body %s)", what, body["error"], code, resp.Body)
	}
	if resp.Header.Get("Content-Type") != "application/json" || resp.Header.Get("Cache-Control") != "no-store" {
		t.Errorf("%s: error headers %v", what, resp.Header)
	}
	return body
}

// picoRecord is a record of a Pico JSON read.
type picoRecord struct {
	Seq       uint64            `json:"seq"`
	Timestamp int64             `json:"timestamp"`
	Headers   map[string]string `json:"headers"`
	Body      *string           `json:"body"`
	BodyB64   *string           `json:"body_b64"`
}

// data is the record's body, decoded.
func (r picoRecord) data(t *testing.T) []byte {
	t.Helper()
	switch {
	case r.Body != nil && r.BodyB64 == nil:
		return []byte(*r.Body)
	case r.BodyB64 != nil && r.Body == nil:
		b, err := base64.StdEncoding.DecodeString(*r.BodyB64)
		if err != nil {
			t.Fatalf("record %d: body_b64: %v", r.Seq, err)
		}
		return b
	}
	t.Fatalf("record %d has neither or both of body and body_b64", r.Seq)
	return nil
}

// picoRecords decodes a JSON read.
func picoRecords(t *testing.T, resp fhResp) []picoRecord {
	t.Helper()
	var recs []picoRecord
	if err := json.Unmarshal(resp.Body, &recs); err != nil {
		t.Fatalf("JSON read %q: %v", fhClip(string(resp.Body), 300), err)
	}
	return recs
}

// picoNewRecord is a record to append.
type picoNewRecord struct {
	headers [][2]string
	body    []byte
}

// picoEncodeBinary encodes a binary append batch (pico-wire.md), written
// here from the spec rather than with the module's own encoder.
func picoEncodeBinary(recs []picoNewRecord) []byte {
	b := []byte{1}
	b = binary.BigEndian.AppendUint32(b, uint32(len(recs)))
	for _, r := range recs {
		b = binary.BigEndian.AppendUint32(b, uint32(len(r.headers)))
		for _, h := range r.headers {
			b = binary.BigEndian.AppendUint32(b, uint32(len(h[0])))
			b = append(b, h[0]...)
			b = binary.BigEndian.AppendUint32(b, uint32(len(h[1])))
			b = append(b, h[1]...)
		}
		b = binary.BigEndian.AppendUint32(b, uint32(len(r.body)))
		b = append(b, r.body...)
	}
	return b
}

// picoReadRecord is a record of a binary read.
type picoReadRecord struct {
	seq     uint64
	ts      int64
	headers [][2]string
	body    []byte
}

// picoDecodeBinaryRead decodes a binary read (pico-wire.md).
func picoDecodeBinaryRead(b []byte) ([]picoReadRecord, error) {
	take := func(n int) ([]byte, error) {
		if n > len(b) {
			return nil, io.ErrUnexpectedEOF
		}
		v := b[:n]
		b = b[n:]
		return v, nil
	}
	u32 := func() (int, error) {
		v, err := take(4)
		if err != nil {
			return 0, err
		}
		return int(binary.BigEndian.Uint32(v)), nil
	}
	str := func() ([]byte, error) {
		n, err := u32()
		if err != nil {
			return nil, err
		}
		return take(n)
	}
	v, err := take(1)
	if err != nil || v[0] != 1 {
		return nil, fmt.Errorf("bad version %v %v", v, err)
	}
	n, err := u32()
	if err != nil {
		return nil, err
	}
	var out []picoReadRecord
	for range n {
		var r picoReadRecord
		st, err := take(16)
		if err != nil {
			return nil, err
		}
		r.seq, r.ts = binary.BigEndian.Uint64(st), int64(binary.BigEndian.Uint64(st[8:]))
		nh, err := u32()
		if err != nil {
			return nil, err
		}
		for range nh {
			k, err := str()
			if err != nil {
				return nil, err
			}
			val, err := str()
			if err != nil {
				return nil, err
			}
			r.headers = append(r.headers, [2]string{string(k), string(val)})
		}
		if r.body, err = str(); err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	if len(b) != 0 {
		return nil, fmt.Errorf("%d bytes after the last record", len(b))
	}
	return out, nil
}

// TestPicoProtocol goes through the Pico protocol's operations on versitygw:
// create, append (single records, JSON and binary batches with headers and
// non-UTF-8 bodies), producers, conditional appends, close, trim, reads in
// every format with ETags, long-poll, SSE with a Last-Event-ID resume, HEAD,
// DELETE with soft deletion, listing, the error table, and bad input that
// must write nothing.
func TestPicoProtocol(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"s3_timeout 2s", "compact_interval 1h"}, []string{"long_poll_timeout 1s", "max_append_size 64KiB"})

	t.Run("create", func(t *testing.T) {
		r := picoDo(e, "PUT", "/pico/orders", nil, "Content-Type", "application/json")
		picoWant(t, "create", r, 201, "Location", "/pico/orders", "Pico-Next-Seq", "0", "Content-Type", "application/json")
		picoWant(t, "same create", picoDo(e, "PUT", "/pico/orders", nil, "Content-Type", "application/json"), 200, "Pico-Next-Seq", "0")
		picoWantError(t, "other type", picoDo(e, "PUT", "/pico/orders", nil, "Content-Type", "text/plain"), 409, "conflict")
		picoWantError(t, "TTL and Expires-At", picoDo(e, "PUT", "/pico/both", nil, "Pico-TTL", "60",
			"Pico-Expires-At", "2099-01-01T00:00:00Z"), 400, "bad_request")
		picoWant(t, "HEAD after refused create", picoDo(e, "HEAD", "/pico/both", nil), 404)

		picoWant(t, "create with TTL", picoDo(e, "PUT", "/pico/ttl", nil, "Pico-TTL", "3600"), 201)
		picoWant(t, "HEAD ttl", picoDo(e, "HEAD", "/pico/ttl", nil), 200, "Pico-TTL", "3600",
			"Content-Type", "application/octet-stream", "Pico-Start-Seq", "0", "Pico-Next-Seq", "0")
		picoWant(t, "DS sees the TTL", picoDo(e, "HEAD", "/ds/ttl", nil), 200, "Stream-TTL", "3600")
		// The message names the setting that differs as the reference
		// spells it, with both values.
		body := picoWantError(t, "create with another TTL", picoDo(e, "PUT", "/pico/ttl", nil, "Pico-TTL", "60"), 409, "conflict")
		if want := "stream exists with Pico-TTL 3600, not 60; a create of an existing stream must give the same settings, " +
			"or delete the stream first"; body["message"] != want {
			t.Errorf("create with another TTL: message %q, want %q", body["message"], want)
		}
		ms := strconv.FormatInt(time.Date(2099, 3, 4, 5, 6, 7, 8e6, time.UTC).UnixMilli(), 10)
		picoWant(t, "create with Unix ms expiry", picoDo(e, "PUT", "/pico/exp", nil, "Pico-Expires-At", ms), 201)
		picoWant(t, "HEAD exp", picoDo(e, "HEAD", "/pico/exp", nil), 200, "Pico-Expires-At", "2099-03-04T05:06:07.008Z")
		picoWant(t, "same expiry in RFC 3339", picoDo(e, "PUT", "/pico/exp", nil, "Pico-Expires-At", "2099-03-04T05:06:07.008Z"), 200)
		// Finer than the milliseconds kept: the same create again is 200.
		subMilli := []string{"Content-Type", "text/plain", "Stream-Expires-At", "2099-03-04T05:06:07.008123Z"}
		picoWant(t, "DS create with a sub-millisecond expiry", picoDo(e, "PUT", "/ds/exp-sub", nil, subMilli...), 201)
		picoWant(t, "the same DS create again", picoDo(e, "PUT", "/ds/exp-sub", nil, subMilli...), 200,
			"Stream-Next-Offset", "0000000000000000_0000000000000000")
		picoWant(t, "create closed", picoDo(e, "PUT", "/pico/sealed", nil, "Pico-Closed", "true"), 201, "Pico-Closed", "true")
		picoWant(t, "HEAD sealed", picoDo(e, "HEAD", "/pico/sealed", nil), 200, "Pico-Closed", "true")

		// A body is the first record; a batch body the first records.
		picoWant(t, "create with body", picoDo(e, "PUT", "/pico/withbody", []byte("first"), "Content-Type", "text/plain"), 201, "Pico-Next-Seq", "1")
		batch := picoEncodeBinary([]picoNewRecord{{body: []byte("a")}, {headers: [][2]string{{"k", "v"}}, body: []byte{0xff}}})
		picoWant(t, "create with batch", picoDo(e, "PUT", "/pico/withbatch", batch, "Content-Type", picoBinaryBatch), 201, "Pico-Next-Seq", "2")
		recs := picoRecords(t, picoDo(e, "GET", "/pico/withbatch", nil))
		if len(recs) != 2 || string(recs[0].data(t)) != "a" || !bytes.Equal(recs[1].data(t), []byte{0xff}) || recs[1].Headers["k"] != "v" {
			t.Errorf("records of the batch create: %+v", recs)
		}
		picoWant(t, "batch create repeated", picoDo(e, "PUT", "/pico/withbatch", batch, "Content-Type", picoBinaryBatch), 200, "Pico-Next-Seq", "2")
		// Ending in a record that weighs nothing: the repeat was 409.
		weightless := picoEncodeBinary([]picoNewRecord{{body: []byte("a")}, {}})
		picoWant(t, "create ending in an empty record", picoDo(e, "PUT", "/pico/weightless", weightless, "Content-Type", picoBinaryBatch), 201, "Pico-Next-Seq", "2")
		picoWant(t, "the same create repeated", picoDo(e, "PUT", "/pico/weightless", weightless, "Content-Type", picoBinaryBatch), 200, "Pico-Next-Seq", "2")
	})

	// A null member is an absent one, as Go's encoding/json writes a nil
	// map and clients that always write every member write the others.
	t.Run("JSON batch with null members", func(t *testing.T) {
		picoWant(t, "create", picoDo(e, "PUT", "/pico/nulls", nil, "Content-Type", "text/plain"), 201)
		batch := []byte(`{"records":[{"body":"a","headers":null},{"body":null,"body_b64":"AAEC"},{"key":null,"body":"c"}]}`)
		picoWant(t, "batch", picoDo(e, "POST", "/pico/nulls", batch, "Content-Type", picoJSONBatch), 200, "Pico-Next-Seq", "3")
		recs := picoRecords(t, picoDo(e, "GET", "/pico/nulls?seq=0", nil))
		want := [][]byte{[]byte("a"), {0, 1, 2}, []byte("c")}
		if len(recs) != len(want) {
			t.Fatalf("%d records, want %d", len(recs), len(want))
		}
		for i, rec := range recs {
			if !bytes.Equal(rec.data(t), want[i]) || len(rec.Headers) != 0 {
				t.Errorf("record %d: body %q headers %v, want %q and none", i, rec.data(t), rec.Headers, want[i])
			}
		}
	})

	t.Run("append and read back", func(t *testing.T) {
		picoWant(t, "create", picoDo(e, "PUT", "/pico/rt", nil, "Content-Type", "application/octet-stream"), 201)
		r := picoDo(e, "POST", "/pico/rt", []byte("single"), "Content-Type", "application/octet-stream")
		picoWant(t, "single", r, 200, "Pico-Start-Seq", "0", "Pico-Next-Seq", "1", "Cache-Control", "no-store")
		ts0, _ := strconv.ParseInt(r.Header.Get("Pico-Timestamp"), 10, 64)

		nonUTF8 := []byte{0xc3, 0x28, 0x00, 0xff, '\n', '\r', 0x80}
		jsonBatch, _ := json.Marshal(map[string]any{"records": []any{
			map[string]any{"body": "text body", "headers": map[string]string{"content-type": "text/plain", "ünï": "cödé"}},
			map[string]any{"body_b64": base64.StdEncoding.EncodeToString(nonUTF8), "headers": map[string]string{"bin": "1"}},
			map[string]any{"body": ""},
		}})
		r = picoDo(e, "POST", "/pico/rt", jsonBatch, "Content-Type", picoJSONBatch)
		picoWant(t, "JSON batch", r, 200, "Pico-Start-Seq", "1", "Pico-Next-Seq", "4")
		tsJSON, _ := strconv.ParseInt(r.Header.Get("Pico-Timestamp"), 10, 64)

		bin := picoEncodeBinary([]picoNewRecord{
			{headers: [][2]string{{"trace", "t-1"}, {"empty", ""}, {"emoji", "🦀"}}, body: nonUTF8},
			{body: bytes.Repeat([]byte{0, 1, 2, 0xfe}, 1000)},
			{headers: [][2]string{{"last", "yes"}}, body: []byte("last")},
		})
		r = picoDo(e, "POST", "/pico/rt", bin, "Content-Type", picoBinaryBatch)
		picoWant(t, "binary batch", r, 200, "Pico-Start-Seq", "4", "Pico-Next-Seq", "7")
		tsBin, _ := strconv.ParseInt(r.Header.Get("Pico-Timestamp"), 10, 64)
		if !(ts0 > 0 && ts0 < tsJSON && tsJSON < tsBin) {
			t.Errorf("Pico-Timestamp not increasing: %d %d %d", ts0, tsJSON, tsBin)
		}

		wantBodies := [][]byte{[]byte("single"), []byte("text body"), nonUTF8, {}, nonUTF8, bytes.Repeat([]byte{0, 1, 2, 0xfe}, 1000), []byte("last")}
		wantTS := []int64{ts0, tsJSON, tsJSON, tsJSON, tsBin, tsBin, tsBin}
		r = picoDo(e, "GET", "/pico/rt?seq=0", nil)
		picoWant(t, "JSON read", r, 200, "Content-Type", "application/json", "Pico-Next-Seq", "7", "Pico-Up-To-Date", "true",
			"Cache-Control", "public, max-age=60, stale-while-revalidate=300")
		recs := picoRecords(t, r)
		if len(recs) != len(wantBodies) {
			t.Fatalf("JSON read: %d records, want %d", len(recs), len(wantBodies))
		}
		for i, rec := range recs {
			if rec.Seq != uint64(i) || !bytes.Equal(rec.data(t), wantBodies[i]) || rec.Timestamp != wantTS[i] {
				t.Errorf("record %d: seq %d ts %d body %q, want ts %d body %q", i, rec.Seq, rec.Timestamp, rec.data(t), wantTS[i], wantBodies[i])
			}
		}
		if recs[0].Headers != nil || recs[1].Headers["ünï"] != "cödé" || recs[1].Headers["content-type"] != "text/plain" ||
			recs[2].Headers["bin"] != "1" || recs[4].Headers["emoji"] != "🦀" || recs[4].Headers["empty"] != "" || len(recs[4].Headers) != 3 {
			t.Errorf("headers in the JSON read: %s", fhClip(string(r.Body), 600))
		}
		if recs[2].Body != nil || recs[1].Body == nil {
			t.Errorf("body/body_b64 choice: %s", fhClip(string(r.Body), 600))
		}

		r = picoDo(e, "GET", "/pico/rt?seq=0&format=binary", nil)
		picoWant(t, "binary read", r, 200, "Content-Type", picoBinaryBatch, "Pico-Next-Seq", "7")
		brecs, err := picoDecodeBinaryRead(r.Body)
		if err != nil {
			t.Fatalf("binary read: %v", err)
		}
		for i, rec := range brecs {
			if rec.seq != uint64(i) || rec.ts != wantTS[i] || !bytes.Equal(rec.body, wantBodies[i]) {
				t.Errorf("binary record %d: seq %d ts %d body %q", i, rec.seq, rec.ts, rec.body)
			}
		}
		if len(brecs) != 7 || fmt.Sprint(brecs[4].headers) != fmt.Sprint([][2]string{{"trace", "t-1"}, {"empty", ""}, {"emoji", "🦀"}}) {
			t.Errorf("binary read headers (in order): %+v", brecs)
		}

		r = picoDo(e, "GET", "/pico/rt?seq=4&format=raw", nil)
		picoWant(t, "raw read", r, 200, "Content-Type", "application/octet-stream")
		if !bytes.Equal(r.Body, bytes.Join(wantBodies[4:], nil)) {
			t.Errorf("raw read: %d bytes", len(r.Body))
		}
		// count and bytes.
		r = picoDo(e, "GET", "/pico/rt?seq=1&count=2", nil)
		picoWant(t, "count=2", r, 200, "Pico-Next-Seq", "3", "Pico-Up-To-Date", "")
		r = picoDo(e, "GET", "/pico/rt?seq=4&bytes=10", nil)
		picoWant(t, "bytes=10", r, 200, "Pico-Next-Seq", "5")
	})

	t.Run("bad input writes nothing", func(t *testing.T) {
		picoWant(t, "create", picoDo(e, "PUT", "/pico/bad", []byte("ok"), "Content-Type", "text/plain"), 201)
		good := picoEncodeBinary([]picoNewRecord{{headers: [][2]string{{"k", "v"}}, body: []byte("x")}})
		for _, c := range []struct {
			name, ct string
			body     []byte
			status   int
			hdr      []string
		}{
			{"bad version", picoBinaryBatch, append([]byte{9}, good[1:]...), 400, nil},
			{"truncated", picoBinaryBatch, good[:len(good)-2], 400, nil},
			{"invalid UTF-8 header", picoBinaryBatch, picoEncodeBinary([]picoNewRecord{{headers: [][2]string{{"k\xff", "v"}}}}), 400, nil},
			{"empty binary batch", picoBinaryBatch, []byte{1, 0, 0, 0, 0}, 400, nil},
			{"bad base64", picoJSONBatch, []byte(`{"records":[{"body_b64":"not base64!"}]}`), 400, nil},
			{"empty records", picoJSONBatch, []byte(`{"records":[]}`), 400, nil},
			{"invalid UTF-8 JSON", picoJSONBatch, []byte("{\"records\":[{\"body\":\"a\xfe\"}]}"), 400, nil},
			{"not JSON", picoJSONBatch, []byte(`{"records":[{"body":"x"`), 400, nil},
			{"records twice", picoJSONBatch, []byte(`{"records":[{"body":"a"}],"records":[{"body":"b"}]}`), 400, nil},
			{"empty body", "text/plain", nil, 400, nil},
			{"too large", "text/plain", bytes.Repeat([]byte("x"), 65*1024), 413, nil},
			{"bad producer", "text/plain", []byte("x"), 400, []string{"Pico-Producer-Id", "p"}},
			// Durable Streams clients read producer state as JavaScript
			// numbers: 2^53 is past what they can hold.
			{"producer epoch past 2^53-1", "text/plain", []byte("x"), 400,
				[]string{"Pico-Producer-Id", "p", "Pico-Producer-Epoch", "9007199254740992", "Pico-Producer-Seq", "0"}},
			{"bad match", "text/plain", []byte("x"), 400, []string{"Pico-Match-Seq", "-1"}},
			{"trim with body", "text/plain", []byte("x"), 400, []string{"Pico-Trim-Seq", "0"}},
			{"trim beyond the tail", "", nil, 400, []string{"Pico-Trim-Seq", "5"}},
			// A trim cannot close, match or be a producer's step.
			{"trim with close", "", nil, 400, []string{"Pico-Trim-Seq", "1", "Pico-Closed", "true"}},
			{"trim with match", "", nil, 400, []string{"Pico-Trim-Seq", "1", "Pico-Match-Seq", "1"}},
			{"trim with a producer", "", nil, 400, []string{"Pico-Trim-Seq", "1", "Pico-Producer-Id", "p", "Pico-Producer-Epoch", "0", "Pico-Producer-Seq", "0"}},
			{"other content type", "image/png", []byte("x"), 409, nil},
			{"content coding", "text/plain", []byte("\x1f\x8b\x08\x00"), 415, []string{"Content-Encoding", "gzip"}},
		} {
			hdr := picoHdr(c.hdr...)
			if c.ct != "" {
				hdr["Content-Type"] = c.ct
			}
			resp, writes := fhExpectNoWrites(t, e, fhReq{Method: "POST", Path: "/pico/bad", Header: hdr, Body: c.body})
			if resp.Status != c.status {
				t.Errorf("%s: %s, want %d", c.name, resp, c.status)
			}
			var body map[string]any
			if json.Unmarshal(resp.Body, &body) != nil || body["error"] == nil || body["message"] == nil {
				t.Errorf("%s: body %q is not a Pico error with a message", c.name, resp.Body)
			}
			if len(writes) > 0 {
				t.Errorf("%s: the refused request wrote to the bucket: %s", c.name, fhSortedKeys(writes))
			}
		}
		// A header of one value sent twice with two means two things.
		for _, more := range [][2]string{{"Pico-Producer-Id", "q"}, {"Content-Type", "application/json"}} {
			req := fhReq{Method: "POST", Path: "/pico/bad", Body: []byte("x"), More: [][2]string{more},
				Header: picoHdr("Content-Type", "text/plain", "Pico-Producer-Id", "p", "Pico-Producer-Epoch", "0", "Pico-Producer-Seq", "0")}
			resp, writes := fhExpectNoWrites(t, e, req)
			if resp.Status != http.StatusBadRequest || !strings.Contains(string(resp.Body), "more than once") {
				t.Errorf("%s twice: %s, want 400 saying so", more[0], resp)
			}
			if len(writes) > 0 {
				t.Errorf("%s twice: the refused request wrote to the bucket: %s", more[0], fhSortedKeys(writes))
			}
		}
		// An application/json stream's records are JSON values in UTF-8
		// (RFC 8259 section 8.1).
		// Closure and a content-type mismatch are told before that (409).
		picoWant(t, "create a JSON stream", picoDo(e, "PUT", "/pico/badjson", []byte(`{"ok":1}`), "Content-Type", "application/json"), 201)
		picoWant(t, "create a closed JSON stream", picoDo(e, "PUT", "/pico/badjson-sealed", []byte(`{"ok":1}`),
			"Content-Type", "application/json", "Pico-Closed", "true"), 201)
		for _, c := range []struct {
			name, path, ct string
			body           []byte
			status         int
			reason         string
		}{
			{"JSON that is not UTF-8", "/pico/badjson", "application/json", []byte("{\"a\":\"\xff\xfe\"}"), 400, "UTF-8"},
			{"JSON that is not UTF-8, in a batch", "/pico/badjson", picoJSONBatch, []byte(`{"records":[{"body_b64":"eyJhIjoi//4ifQ=="}]}`), 400, "UTF-8"},
			{"not JSON, sent as another type", "/pico/badjson", "text/plain", []byte("nope"), 409, "Content-Type"},
			{"not JSON, to a closed stream", "/pico/badjson-sealed", "application/json", []byte("nope"), 409, "closed"},
		} {
			resp, writes := fhExpectNoWrites(t, e, fhReq{Method: "POST", Path: c.path, Header: picoHdr("Content-Type", c.ct), Body: c.body})
			if resp.Status != c.status || !strings.Contains(string(resp.Body), c.reason) {
				t.Errorf("%s: %s, want %d saying %q", c.name, resp, c.status, c.reason)
			}
			if len(writes) > 0 {
				t.Errorf("%s: the refused request wrote to the bucket: %s", c.name, fhSortedKeys(writes))
			}
		}
		for _, name := range []string{"/pico/badjson", "/pico/badjson-sealed"} {
			if recs := picoRecords(t, picoDo(e, "GET", name, nil)); len(recs) != 1 {
				t.Errorf("%s changed by refused requests: %+v", name, recs)
			}
		}
		for _, c := range []struct {
			name string
			hdr  []string
		}{
			{"TTL and Expires-At", []string{"Pico-TTL", "1", "Pico-Expires-At", "1"}},
			{"bad TTL", []string{"Pico-TTL", "soon"}},
			{"TTL with a leading zero", []string{"Pico-TTL", "060"}},
			{"bad Expires-At", []string{"Pico-Expires-At", "next week"}},
			// Not in the future; 0 would otherwise read as "never expires".
			{"Expires-At 0", []string{"Pico-Expires-At", "0"}},
			{"Expires-At in the past", []string{"Pico-Expires-At", "2001-01-01T00:00:00Z"}},
		} {
			resp, writes := fhExpectNoWrites(t, e, fhReq{Method: "PUT", Path: "/pico/neverthere", Header: picoHdr(c.hdr...)})
			if resp.Status != 400 || len(writes) > 0 {
				t.Errorf("create with %s: %s, writes %s", c.name, resp, fhSortedKeys(writes))
			}
		}
		picoWant(t, "HEAD after refused creates", picoDo(e, "HEAD", "/pico/neverthere", nil), 404)
		recs := picoRecords(t, picoDo(e, "GET", "/pico/bad", nil))
		if len(recs) != 1 || string(recs[0].data(t)) != "ok" {
			t.Errorf("stream changed by refused requests: %+v", recs)
		}
	})

	t.Run("producers", func(t *testing.T) {
		picoWant(t, "create", picoDo(e, "PUT", "/pico/prod", nil, "Content-Type", "text/plain"), 201)
		send := func(epoch, seq int, body string) fhResp {
			return picoDo(e, "POST", "/pico/prod", []byte(body), "Content-Type", "text/plain", "Pico-Producer-Id", "writer-1",
				"Pico-Producer-Epoch", strconv.Itoa(epoch), "Pico-Producer-Seq", strconv.Itoa(seq))
		}
		picoWant(t, "first", send(0, 0, "a"), 200, "Pico-Producer-Epoch", "0", "Pico-Producer-Seq", "0", "Pico-Start-Seq", "0", "Pico-Next-Seq", "1")
		picoWant(t, "second", send(0, 1, "b"), 200, "Pico-Producer-Seq", "1", "Pico-Next-Seq", "2")
		picoWant(t, "retry", send(0, 1, "b"), 200, "Pico-Next-Seq", "2", "Pico-Start-Seq", "", "Pico-Timestamp", "")
		picoWantError(t, "gap", send(0, 5, "x"), 409, "sequence_gap")
		picoWant(t, "gap headers", send(0, 5, "x"), 409, "Pico-Expected-Seq", "2", "Pico-Received-Seq", "5")
		picoWant(t, "new epoch", send(1, 0, "c"), 200, "Pico-Producer-Epoch", "1", "Pico-Next-Seq", "3")
		picoWantError(t, "stale epoch", send(0, 2, "x"), 403, "fenced")
		picoWant(t, "fenced headers", send(0, 2, "x"), 403, "Pico-Producer-Epoch", "1")
		recs := picoRecords(t, picoDo(e, "GET", "/pico/prod", nil))
		if len(recs) != 3 || string(recs[2].data(t)) != "c" {
			t.Errorf("producer stream %+v", recs)
		}
		// Closed, the stream tells a stale epoch it is closed (closure is
		// checked first, section 5.2.1), through either protocol.
		picoWant(t, "close", picoDo(e, "POST", "/pico/prod", nil, "Pico-Closed", "true"), 200, "Pico-Closed", "true")
		picoWantError(t, "stale epoch after the close", send(0, 2, "x"), 409, "closed")
		picoWant(t, "DS stale epoch after the close", picoDo(e, "POST", "/ds/prod", []byte("x"), "Content-Type", "text/plain",
			"Producer-Id", "writer-1", "Producer-Epoch", "0", "Producer-Seq", "2"), 409,
			"Stream-Closed", "true", "Stream-Next-Offset", "0000000000000003_0000000000000000")
	})

	t.Run("match, close, trim", func(t *testing.T) {
		picoWant(t, "create", picoDo(e, "PUT", "/pico/mct", []byte("0"), "Content-Type", "text/plain"), 201)
		body := picoWantError(t, "mismatch", picoDo(e, "POST", "/pico/mct", []byte("1"), "Pico-Match-Seq", "0"), 412, "match_failed")
		if body["next_seq"] != float64(1) {
			t.Errorf("match_failed next_seq %v", body["next_seq"])
		}
		picoWant(t, "mismatch header", picoDo(e, "POST", "/pico/mct", []byte("1"), "Pico-Match-Seq", "7"), 412, "Pico-Next-Seq", "1")
		picoWant(t, "match", picoDo(e, "POST", "/pico/mct", []byte("1"), "Pico-Match-Seq", "1"), 200, "Pico-Next-Seq", "2")
		for i := 2; i < 6; i++ {
			picoWant(t, "append", picoDo(e, "POST", "/pico/mct", []byte(strconv.Itoa(i))), 200)
		}
		picoWant(t, "trim", picoDo(e, "POST", "/pico/mct", nil, "Pico-Trim-Seq", "3"), 200, "Pico-Start-Seq", "3")
		picoWant(t, "HEAD after trim", picoDo(e, "HEAD", "/pico/mct", nil), 200, "Pico-Start-Seq", "3", "Pico-Next-Seq", "6")
		picoWantError(t, "read below the trim", picoDo(e, "GET", "/pico/mct?seq=1", nil), 410, "gone")
		recs := picoRecords(t, picoDo(e, "GET", "/pico/mct", nil))
		if len(recs) != 3 || recs[0].Seq != 3 {
			t.Errorf("read from the start after a trim: %+v", recs)
		}
		picoWant(t, "close", picoDo(e, "POST", "/pico/mct", nil, "Pico-Closed", "true"), 200, "Pico-Closed", "true", "Pico-Next-Seq", "6")
		body = picoWantError(t, "append after close", picoDo(e, "POST", "/pico/mct", []byte("x")), 409, "closed")
		if body["next_seq"] != float64(6) {
			t.Errorf("closed next_seq %v", body["next_seq"])
		}
		picoWant(t, "closed headers", picoDo(e, "POST", "/pico/mct", []byte("x")), 409, "Pico-Closed", "true", "Pico-Next-Seq", "6")
		picoWant(t, "close again", picoDo(e, "POST", "/pico/mct", nil, "Pico-Closed", "true"), 200, "Pico-Closed", "true")
		picoWant(t, "HEAD closed", picoDo(e, "HEAD", "/pico/mct", nil), 200, "Pico-Closed", "true")
		picoWant(t, "read to the end", picoDo(e, "GET", "/pico/mct?seq=5", nil), 200, "Pico-Closed", "true", "Pico-Up-To-Date", "true")
	})

	t.Run("ETag, seq=now, long-poll", func(t *testing.T) {
		picoWant(t, "create", picoDo(e, "PUT", "/pico/lp", []byte("a"), "Content-Type", "text/plain"), 201)
		r := picoDo(e, "GET", "/pico/lp?seq=0", nil)
		tag := r.Header.Get("ETag")
		picoWant(t, "read", r, 200, "Pico-Up-To-Date", "true")
		if tag == "" {
			t.Fatal("no ETag on a caught-up read")
		}
		picoWant(t, "If-None-Match", picoDo(e, "GET", "/pico/lp?seq=0", nil, "If-None-Match", tag), 304)
		// A list header may come on several lines (RFC 9110 section 5.3).
		picoWant(t, "If-None-Match with the tag on its second line", e.must(fhReq{Method: "GET", Path: "/pico/lp?seq=0",
			Header: picoHdr("If-None-Match", `"other"`), More: [][2]string{{"If-None-Match", tag}}}), 304)
		r = picoDo(e, "GET", "/pico/lp?seq=now", nil)
		picoWant(t, "seq=now", r, 200, "Pico-Next-Seq", "1", "Pico-Up-To-Date", "true", "Cache-Control", "no-store")
		picoWantError(t, "seq=now on a missing stream", picoDo(e, "GET", "/pico/nope?seq=now", nil), 404, "not_found")

		start := time.Now()
		r = picoDo(e, "GET", "/pico/lp?seq=1&live=long-poll", nil)
		picoWant(t, "idle long-poll", r, 204, "Pico-Up-To-Date", "true", "Pico-Next-Seq", "1", "Cache-Control", "no-store")
		if r.Header.Get("Pico-Cursor") == "" || time.Since(start) < 900*time.Millisecond {
			t.Errorf("idle long-poll: cursor %q after %v", r.Header.Get("Pico-Cursor"), time.Since(start))
		}
		done := make(chan fhResp, 1)
		go func() {
			resp, err := e.send(fhReq{Method: "GET", Path: "/pico/lp?seq=1&live=long-poll&format=binary"})
			if err != nil {
				resp.Status = -1
			}
			done <- resp
		}()
		// The long-poll is open before the append: one that came after it
		// would answer b at once, and the wake-up would go untested.
		fhWaitLongPolls(t, e.caddy.AdminAddr(), 1)
		picoWant(t, "append", picoDo(e, "POST", "/pico/lp", []byte("b")), 200)
		select {
		case r = <-done:
			picoWant(t, "woken long-poll", r, 200, "Pico-Next-Seq", "2")
			brecs, err := picoDecodeBinaryRead(r.Body)
			if err != nil || len(brecs) != 1 || string(brecs[0].body) != "b" {
				t.Errorf("woken long-poll records %+v %v", brecs, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the parked long-poll did not wake")
		}
	})

	t.Run("SSE", func(t *testing.T) {
		picoWant(t, "create", picoDo(e, "PUT", "/pico/sse", nil), 201)
		bin := picoEncodeBinary([]picoNewRecord{{headers: [][2]string{{"h", "1"}}, body: []byte{0xff, 0}}, {body: []byte("two\nlines")}})
		picoWant(t, "append", picoDo(e, "POST", "/pico/sse", bin, "Content-Type", picoBinaryBatch), 200)
		s := picoOpenSSE(t, e, "/pico/sse?seq=0&live=sse")
		recs := s.data(t, 2)
		if len(recs) != 2 || !bytes.Equal(recs[0].data(t), []byte{0xff, 0}) || recs[0].Headers["h"] != "1" || string(recs[1].data(t)) != "two\nlines" {
			t.Errorf("catch-up records %+v", recs)
		}
		s.control(t, 2, true, false)
		picoWant(t, "live append", picoDo(e, "POST", "/pico/sse", []byte("three")), 200)
		if recs = s.data(t, 3); len(recs) != 1 || recs[0].Seq != 2 || string(recs[0].data(t)) != "three" {
			t.Errorf("live records %+v", recs)
		}
		s.control(t, 3, true, false)
		s.close()
		// The client reconnects with the last event id it saw.
		picoWant(t, "append while away", picoDo(e, "POST", "/pico/sse", []byte("four")), 200)
		s = picoOpenSSE(t, e, "/pico/sse?live=sse", "Last-Event-ID", "3")
		if recs = s.data(t, 4); len(recs) != 1 || recs[0].Seq != 3 || string(recs[0].data(t)) != "four" {
			t.Errorf("resumed records %+v", recs)
		}
		s.control(t, 4, true, false)
		picoWant(t, "close", picoDo(e, "POST", "/pico/sse", []byte("five"), "Pico-Closed", "true"), 200)
		s.data(t, 5)
		s.control(t, 5, true, true)
		s.ends(t, 5*time.Second)
	})

	t.Run("SSE fan-out", func(t *testing.T) {
		// Feeds at the tail share their stream's hub (one per set of read
		// limits): every feed gets every record, in the events its own
		// reads would have made, and the close ends them all.
		const whole, single = 30, 5
		picoWant(t, "create", picoDo(e, "PUT", "/pico/fan", nil), 201)
		var feeds []*picoSSEReader
		for i := range whole + single {
			path := "/pico/fan?seq=now&live=sse"
			if i >= whole {
				path += "&count=1"
			}
			s := picoOpenSSE(t, e, path)
			s.control(t, 0, true, false)
			feeds = append(feeds, s)
		}
		picoWant(t, "append", picoDo(e, "POST", "/pico/fan", []byte("r0")), 200)
		batch := picoEncodeBinary([]picoNewRecord{{body: []byte("r1")}, {body: []byte("r2")}})
		picoWant(t, "append a batch", picoDo(e, "POST", "/pico/fan", batch, "Content-Type", picoBinaryBatch), 200)
		picoWant(t, "close", picoDo(e, "POST", "/pico/fan", []byte("r3"), "Pico-Closed", "true"), 200)
		for i, s := range feeds {
			var got []string
			for len(got) < 4 {
				ev := s.next(t)
				var recs []picoRecord
				if ev.event != "data" || json.Unmarshal([]byte(ev.data), &recs) != nil || len(recs) == 0 {
					t.Fatalf("feed %d after %q: event %+v", i, got, ev)
				}
				if i >= whole && len(recs) != 1 {
					t.Fatalf("count=1 feed %d: %d records in one event", i, len(recs))
				}
				for _, r := range recs {
					if r.Seq != uint64(len(got)) {
						t.Fatalf("feed %d: seq %d after %q", i, r.Seq, got)
					}
					got = append(got, string(r.data(t)))
				}
				if next := uint64(len(got)); next == 4 {
					s.control(t, 4, true, true)
				} else if c := s.next(t); c.event != "control" || c.id != strconv.FormatUint(next, 10) {
					t.Fatalf("feed %d: control %+v after %q", i, c, got)
				}
			}
			if strings.Join(got, ",") != "r0,r1,r2,r3" {
				t.Errorf("feed %d got %q", i, got)
			}
			s.ends(t, 5*time.Second)
		}
	})

	t.Run("close without records ends live reads", func(t *testing.T) {
		// The close moves no tail: feeds parked at it hear of it all the
		// same, with a closed control event at the same id, and end.
		picoWant(t, "create", picoDo(e, "PUT", "/pico/sealed-tail", []byte("a")), 201)
		tail := picoOpenSSE(t, e, "/pico/sealed-tail?seq=1&live=sse")
		tail.control(t, 1, true, false)
		single := picoOpenSSE(t, e, "/pico/sealed-tail?live=sse&count=1")
		single.data(t, 1)
		single.control(t, 1, true, false)
		picoWant(t, "close", picoDo(e, "POST", "/pico/sealed-tail", nil, "Pico-Closed", "true"), 200, "Pico-Closed", "true", "Pico-Next-Seq", "1")
		for _, s := range []*picoSSEReader{tail, single} {
			s.control(t, 1, true, true)
			s.ends(t, 5*time.Second)
		}
		picoWant(t, "long-poll at the sealed tail", picoDo(e, "GET", "/pico/sealed-tail?seq=1&live=long-poll", nil), 204,
			"Pico-Closed", "true", "Pico-Up-To-Date", "true", "Pico-Next-Seq", "1")
	})

	t.Run("HEAD, DELETE, soft delete, list", func(t *testing.T) {
		picoWant(t, "create", picoDo(e, "PUT", "/pico/del/a", []byte("x"), "Content-Type", "text/plain"), 201)
		picoWant(t, "delete", picoDo(e, "DELETE", "/pico/del/a", nil), 204)
		picoWantError(t, "delete again", picoDo(e, "DELETE", "/pico/del/a", nil), 404, "not_found")
		picoWant(t, "HEAD deleted", picoDo(e, "HEAD", "/pico/del/a", nil), 404)
		picoWant(t, "recreate", picoDo(e, "PUT", "/pico/del/a", nil, "Content-Type", "text/plain"), 201, "Pico-Next-Seq", "0")

		picoWant(t, "source", picoDo(e, "PUT", "/pico/del/src", []byte("kept"), "Content-Type", "text/plain"), 201)
		picoWant(t, "fork", picoDo(e, "PUT", "/ds/del/fork", nil, "Content-Type", "text/plain", "Stream-Forked-From", "/ds/del/src"), 201)
		picoWant(t, "soft delete", picoDo(e, "DELETE", "/pico/del/src", nil), 204)
		picoWantError(t, "Pico read of a soft-deleted stream", picoDo(e, "GET", "/pico/del/src", nil), 410, "gone")
		picoWant(t, "DS read of a soft-deleted stream", picoDo(e, "GET", "/ds/del/src?offset=-1", nil), 410)
		picoWantError(t, "delete a soft-deleted stream", picoDo(e, "DELETE", "/pico/del/src", nil), 410, "gone")
		if recs := picoRecords(t, picoDo(e, "GET", "/pico/del/fork", nil)); len(recs) != 1 || string(recs[0].data(t)) != "kept" {
			t.Errorf("fork after its source's soft delete: %+v", recs)
		}
		picoWant(t, "delete fork", picoDo(e, "DELETE", "/pico/del/fork", nil), 204)
		picoWantError(t, "source gone with its last fork", picoDo(e, "GET", "/pico/del/src", nil), 404, "not_found")

		for _, n := range []string{"/del/b", "/del/c", "/del0"} {
			picoWant(t, "create", picoDo(e, "PUT", "/pico"+n, nil, "Content-Type", "text/plain", "Pico-TTL", "600"), 201)
		}
		var page struct {
			Streams []map[string]any `json:"streams"`
			HasMore bool             `json:"has_more"`
		}
		r := picoDo(e, "GET", "/pico/?prefix=/del/&limit=2", nil)
		picoWant(t, "list", r, 200, "Content-Type", "application/json", "Cache-Control", "no-store")
		if err := json.Unmarshal(r.Body, &page); err != nil || len(page.Streams) != 2 || !page.HasMore ||
			page.Streams[0]["name"] != "/del/a" || page.Streams[1]["name"] != "/del/b" || page.Streams[1]["ttl"] != float64(600) ||
			page.Streams[1]["content_type"] != "text/plain" || page.Streams[1]["closed"] != false || page.Streams[0]["next_seq"] != float64(0) {
			t.Errorf("list page 1: %s (%v)", r.Body, err)
		}
		r = picoDo(e, "GET", "/pico/?prefix=/del/&limit=2&start_after=/del/b", nil)
		if err := json.Unmarshal(r.Body, &page); err != nil || len(page.Streams) != 1 || page.HasMore || page.Streams[0]["name"] != "/del/c" {
			t.Errorf("list page 2: %s (%v)", r.Body, err)
		}

		// Soft-deleted streams are listed past: the first page is not
		// empty with has_more, which would leave a client no start_after.
		for _, n := range []string{"/hid/a", "/hid/b"} {
			picoWant(t, "create", picoDo(e, "PUT", "/pico"+n, nil, "Content-Type", "text/plain"), 201)
			picoWant(t, "fork", picoDo(e, "PUT", "/ds/forks"+n, nil, "Stream-Forked-From", "/ds"+n), 201)
			picoWant(t, "soft delete", picoDo(e, "DELETE", "/pico"+n, nil), 204)
		}
		picoWant(t, "create", picoDo(e, "PUT", "/pico/hid/c", nil, "Content-Type", "text/plain"), 201)
		r = picoDo(e, "GET", "/pico/?prefix=/hid/&limit=1", nil)
		page.Streams, page.HasMore = nil, false
		if err := json.Unmarshal(r.Body, &page); err != nil || len(page.Streams) != 1 || page.HasMore || page.Streams[0]["name"] != "/hid/c" {
			t.Errorf("list past soft-deleted streams: %s (%v)", r.Body, err)
		}
	})

	t.Run("errors", func(t *testing.T) {
		picoWantError(t, "bad name", picoDo(e, "GET", "/pico/a%00b", nil), 400, "bad_request")
		picoWantError(t, "bad format", picoDo(e, "GET", "/pico/orders?format=xml", nil), 400, "bad_request")
		picoWantError(t, "bad seq", picoDo(e, "GET", "/pico/orders?seq=abc", nil), 400, "bad_request")
		picoWantError(t, "seq twice", picoDo(e, "GET", "/pico/orders?seq=0&seq=1", nil), 400, "bad_request")
		// The largest seq is a position like any other (the engine once
		// took it for seq=now).
		picoWantError(t, "seq beyond the tail", picoDo(e, "GET", "/pico/orders?seq=18446744073709551615", nil), 400, "bad_request")
		picoWantError(t, "seq overflowing", picoDo(e, "GET", "/pico/orders?seq=18446744073709551616", nil), 400, "bad_request")
		picoWantError(t, "limit twice", picoDo(e, "GET", "/pico/?prefix=/&limit=1&limit=2", nil), 400, "bad_request")
		picoWantError(t, "missing", picoDo(e, "GET", "/pico/missing", nil), 404, "not_found")
		picoWantError(t, "method", picoDo(e, "PATCH", "/pico/orders", nil), 405, "method_not_allowed")
		r := picoDo(e, "PUT", "/pico/orders", nil, "Content-Type", "application/json")
		if exp := r.Header.Get("Access-Control-Expose-Headers"); !strings.Contains(exp, "Pico-Next-Seq") || !strings.Contains(exp, "ETag") {
			t.Errorf("CORS exposes %q", exp)
		}
		// Storage failing: 503 with Retry-After, and a clear error.
		remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpGet, KeyContains: "/streams/", Status: 500})
		r = picoDo(e, "HEAD", "/pico/not-in-memory", nil)
		r2 := picoDo(e, "GET", "/pico/not-in-memory", nil)
		remove()
		picoWant(t, "HEAD with the store failing", r, 503)
		picoWantError(t, "GET with the store failing", r2, 503, "durability")
		if !fhRetryAfterOK(r.Header.Get("Retry-After")) || !fhRetryAfterOK(r2.Header.Get("Retry-After")) {
			t.Errorf("Retry-After %q %q", r.Header.Get("Retry-After"), r2.Header.Get("Retry-After"))
		}
		picoWant(t, "HEAD once the store is back", picoDo(e, "HEAD", "/pico/not-in-memory", nil), 404)

		// WAL uploads failing: the append is not acknowledged, 503 with
		// Retry-After, and its record never shows.
		picoWant(t, "create", picoDo(e, "PUT", "/pico/faulty", []byte("before"), "Content-Type", "text/plain"), 201)
		// Every attempt of the upload fails (the store tries each request
		// five times); the seal that settles its fate gets through.
		remove = e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Status: 500, Times: 5})
		began := time.Now()
		r = picoDo(e, "POST", "/pico/faulty", []byte(`{"records":[{"body":"lost"}]}`), "Content-Type", picoJSONBatch)
		remove()
		picoWantError(t, "append with WAL uploads failing", r, 503, "durability")
		if !fhRetryAfterOK(r.Header.Get("Retry-After")) {
			t.Errorf("Retry-After %q", r.Header.Get("Retry-After"))
		}
		t.Logf("append with WAL uploads failing answered %d after %v", r.Status, time.Since(began).Round(time.Millisecond))
		// A client retries after Retry-After until the store takes it.
		err := fhWaitFor(30*time.Second, time.Second, func() error {
			if r := picoDo(e, "POST", "/pico/faulty", []byte("after")); r.Status != 200 {
				return fmt.Errorf("append once the store is back: %s", r)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		recs := picoRecords(t, picoDo(e, "GET", "/pico/faulty", nil))
		if len(recs) != 2 || string(recs[0].data(t)) != "before" || string(recs[1].data(t)) != "after" {
			t.Errorf("records after the fault: %+v", recs)
		}
	})
}

// picoSSEReader reads Pico SSE events from a live response.
type picoSSEReader struct {
	resp   *http.Response
	cancel context.CancelFunc
	events chan picoSSEEvent
	done   chan struct{}
}

type picoSSEEvent struct{ event, id, data string }

func picoOpenSSE(t *testing.T, e *fhEnv, path string, hdr ...string) *picoSSEReader {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, "GET", e.caddy.URL()+path, nil)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		cancel()
		t.Fatalf("SSE %s: %d %q", path, resp.StatusCode, b)
	}
	s := &picoSSEReader{resp: resp, cancel: cancel, events: make(chan picoSSEEvent, 64), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		br := bufio.NewReader(resp.Body)
		var ev picoSSEEvent
		for {
			line, err := br.ReadString('\n')
			if err != nil {
				return
			}
			line = strings.TrimRight(line, "\r\n")
			field, value, _ := strings.Cut(line, ":")
			value = strings.TrimPrefix(value, " ")
			switch {
			case line == "":
				s.events <- ev
				ev = picoSSEEvent{}
			case field == "event":
				ev.event = value
			case field == "id":
				ev.id = value
			case field == "data":
				ev.data += value
			}
		}
	}()
	t.Cleanup(s.close)
	return s
}

func (s *picoSSEReader) close() {
	s.cancel()
	s.resp.Body.Close()
	<-s.done
}

func (s *picoSSEReader) next(t *testing.T) picoSSEEvent {
	t.Helper()
	select {
	case ev := <-s.events:
		return ev
	case <-s.done:
		select {
		case ev := <-s.events:
			return ev
		default:
		}
		t.Fatal("the SSE response ended")
	case <-time.After(10 * time.Second):
		t.Fatal("no SSE event within 10s")
	}
	return picoSSEEvent{}
}

func (s *picoSSEReader) data(t *testing.T, id uint64) []picoRecord {
	t.Helper()
	ev := s.next(t)
	if ev.event != "data" || ev.id != strconv.FormatUint(id, 10) {
		t.Fatalf("event %+v, want data with id %d", ev, id)
	}
	var recs []picoRecord
	if err := json.Unmarshal([]byte(ev.data), &recs); err != nil {
		t.Fatalf("data event %q: %v", ev.data, err)
	}
	return recs
}

func (s *picoSSEReader) control(t *testing.T, next uint64, upToDate, closed bool) {
	t.Helper()
	ev := s.next(t)
	if ev.event != "control" || ev.id != strconv.FormatUint(next, 10) {
		t.Fatalf("event %+v, want control with id %d", ev, next)
	}
	want := fmt.Sprintf(`{"next_seq":%d,"up_to_date":%t}`, next, upToDate)
	if closed {
		want = fmt.Sprintf(`{"next_seq":%d,"up_to_date":%t,"closed":true}`, next, upToDate)
	}
	if ev.data != want {
		t.Errorf("control %s, want %s", ev.data, want)
	}
}

func (s *picoSSEReader) ends(t *testing.T, within time.Duration) {
	t.Helper()
	select {
	case <-s.done:
	case <-time.After(within):
		t.Fatalf("the SSE response is still open after %v", within)
	}
}

// TestPicoCrossProtocol appends through each protocol and reads through the
// other, on one stream in one bucket: Pico seq n is Durable Streams offset
// (n, 0), and a record's byte b is offset (n, b).
func TestPicoCrossProtocol(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"compact_interval 1h"}, nil)
	const ct = "application/octet-stream"
	picoWant(t, "create through Pico", picoDo(e, "PUT", "/pico/orders", nil, "Content-Type", ct, "Pico-TTL", "86400"), 201)
	picoWant(t, "DS sees it", picoDo(e, "HEAD", "/ds/orders", nil), 200, "Stream-Next-Offset", picoOffset(0, 0), "Stream-TTL", "86400")

	var want [][]byte // every record's body, by seq
	rng := rand.New(rand.NewPCG(4, 2))
	body := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.IntN(256))
		}
		return b
	}
	for round := range 3 {
		// Pico: a binary batch of three records with headers.
		var batch []picoNewRecord
		for i := range 3 {
			batch = append(batch, picoNewRecord{headers: [][2]string{{"round", strconv.Itoa(round)}, {"i", strconv.Itoa(i)}}, body: body(100 + 50*i)})
		}
		r := picoDo(e, "POST", "/pico/orders", picoEncodeBinary(batch), "Content-Type", picoBinaryBatch)
		picoWant(t, "Pico batch", r, 200, "Pico-Start-Seq", strconv.Itoa(len(want)), "Pico-Next-Seq", strconv.Itoa(len(want)+3))
		for _, rec := range batch {
			want = append(want, rec.body)
		}
		// Durable Streams: one record per append; its next offset is
		// the Pico next seq.
		b := body(300)
		r = picoDo(e, "POST", "/ds/orders", b, "Content-Type", ct)
		want = append(want, b)
		picoWant(t, "DS append", r, 204, "Stream-Next-Offset", picoOffset(uint64(len(want)), 0))
		picoWant(t, "Pico HEAD after a DS append", picoDo(e, "HEAD", "/pico/orders", nil), 200, "Pico-Next-Seq", strconv.Itoa(len(want)))
	}

	// Pico reads everything: seqs, bodies, and headers only on Pico's records.
	r := picoDo(e, "GET", "/pico/orders?seq=0&format=binary", nil)
	picoWant(t, "Pico read", r, 200, "Pico-Next-Seq", strconv.Itoa(len(want)))
	recs, err := picoDecodeBinaryRead(r.Body)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != len(want) {
		t.Fatalf("Pico read %d records, want %d", len(recs), len(want))
	}
	for i, rec := range recs {
		fromDS := i%4 == 3
		if rec.seq != uint64(i) || !bytes.Equal(rec.body, want[i]) || (len(rec.headers) == 0) != fromDS || rec.ts == 0 {
			t.Errorf("Pico record %d: seq %d, %d bytes, headers %v", i, rec.seq, len(rec.body), rec.headers)
		}
	}

	// Durable Streams reads everything from every seq, and from inside a record.
	all := bytes.Join(want, nil)
	got, tail, err := e.readBytes("/ds/orders")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, all) || tail != picoOffset(uint64(len(want)), 0) {
		t.Errorf("DS read: %d bytes ending at %s, want %d ending at %s", len(got), tail, len(all), picoOffset(uint64(len(want)), 0))
	}
	for seq := range want {
		chunks, _, err := e.readFrom("/ds/orders", picoOffset(uint64(seq), 0))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(bytes.Join(chunks, nil), bytes.Join(want[seq:], nil)) {
			t.Errorf("DS read from Pico seq %d does not start at that record", seq)
		}
	}
	chunks, _, err := e.readFrom("/ds/orders", picoOffset(5, 7))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(bytes.Join(chunks, nil), append(append([]byte(nil), want[5][7:]...), bytes.Join(want[6:], nil)...)) {
		t.Error("DS read from inside record 5 does not start at its byte 7")
	}
	// SSE through both: the Pico event ids and the DS offsets agree.
	s := picoOpenSSE(t, e, "/pico/orders?seq=10&live=sse")
	if recs := s.data(t, uint64(len(want))); len(recs) != 2 || recs[0].Seq != 10 {
		t.Errorf("Pico SSE from seq 10: %+v", recs)
	}
	s.control(t, uint64(len(want)), true, false)

	// One closure for both protocols.
	picoWant(t, "close through DS", picoDo(e, "POST", "/ds/orders", nil, "Stream-Closed", "true"), 204)
	picoWantError(t, "Pico append after a DS close", picoDo(e, "POST", "/pico/orders", []byte("x"), "Content-Type", ct), 409, "closed")
	s.control(t, uint64(len(want)), true, true)
	picoWant(t, "Pico HEAD", picoDo(e, "HEAD", "/pico/orders", nil), 200, "Pico-Closed", "true")

	// And the other way round: a DS stream read through Pico.
	picoWant(t, "DS create", picoDo(e, "PUT", "/ds/events", []byte(`[{"a":1},{"b":2}]`), "Content-Type", "application/json"), 201)
	picoWant(t, "Pico append of a JSON record", picoDo(e, "POST", "/pico/events", []byte(`{"c":3}`), "Content-Type", "application/json"), 200, "Pico-Start-Seq", "2")
	jrecs := picoRecords(t, picoDo(e, "GET", "/pico/events", nil))
	if len(jrecs) != 3 || string(jrecs[0].data(t)) != `{"a":1}` || string(jrecs[2].data(t)) != `{"c":3}` {
		t.Errorf("Pico read of DS JSON messages: %+v", jrecs)
	}
	msgs, next, err := e.readJSON("/ds/events")
	if err != nil || len(msgs) != 3 || string(msgs[2]) != `{"c":3}` || next != picoOffset(3, 0) {
		t.Errorf("DS read of a Pico-appended JSON record: %s at %s (%v)", msgs, next, err)
	}

	// Every stream Pico creates is one Durable Streams reaches: names
	// with a __ds segment, where DS serves its control resources, are
	// refused, and nothing is made.
	for _, name := range []string{"/w/__ds", "/__ds/subscriptions/s9"} {
		picoWantError(t, "Pico create of "+name, picoDo(e, "PUT", "/pico"+name, []byte("x"), "Content-Type", "text/plain"), 400, "bad_request")
		picoWant(t, "Pico HEAD of "+name, picoDo(e, "HEAD", "/pico"+name, nil), 404)
	}
	picoWant(t, "Pico create of a name that only contains __ds", picoDo(e, "PUT", "/pico/w/__dsx", nil, "Content-Type", "text/plain"), 201)
	picoWant(t, "DS sees it", picoDo(e, "HEAD", "/ds/w/__dsx", nil), 200)
}

// picoOffset is the Durable Streams offset of byte b of record seq.
func picoOffset(seq, b uint64) string { return fmt.Sprintf("%016d_%016d", seq, b) }

// TestPicoList10k creates 10,000 streams under a prefix (and some around
// it), pages through them with limit and start_after, and checks the order,
// the completeness and that every page cost at most two LIST requests to the
// bucket (counted at the S3 proxy).
func TestPicoList10k(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"compact_interval 1h"}, nil)
	const n = 10000
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("/list/s%05d", i)
	}
	// Neighbours that must not show up under /list/.
	others := []string{"/lis", "/list", "/list0", "/lisu/s00001", "/a/list/x"}

	transport := &http.Transport{MaxIdleConnsPerHost: 64, MaxConnsPerHost: 64}
	defer transport.CloseIdleConnections()
	client := &http.Client{Transport: transport, Timeout: time.Minute}
	start := time.Now()
	work := make(chan string)
	var failed atomic.Int64
	var firstErr atomic.Value
	var wg sync.WaitGroup
	for range 48 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for name := range work {
				resp, err := fhSend(client, e.caddy.URL(), fhReq{Method: "PUT", Path: "/pico" + name, Header: picoHdr("Content-Type", "text/plain")})
				if err == nil && resp.Status != 201 {
					err = fmt.Errorf("PUT %s: %s", name, resp)
				}
				if err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err)
				}
			}
		}()
	}
	for _, name := range append(append([]string(nil), names...), others...) {
		if failed.Load() > 0 {
			break
		}
		work <- name
	}
	close(work)
	wg.Wait()
	if failed.Load() > 0 {
		t.Fatalf("%d creates failed, e.g. %v", failed.Load(), firstErr.Load())
	}
	t.Logf("created %d streams in %s", n+len(others), time.Since(start).Round(time.Millisecond))

	// page lists one page and returns its names, has_more and the LIST
	// requests it cost at the bucket.
	page := func(limit int, after string) ([]string, bool, int) {
		t.Helper()
		q := url.Values{"prefix": {"/list/"}, "limit": {strconv.Itoa(limit)}}
		if after != "" {
			q.Set("start_after", after)
		}
		before := e.proxy.Counts()
		resp := e.must(fhReq{Method: "GET", Path: "/pico/?" + q.Encode()})
		lists := e.proxy.Counts().Under(testenv.OpList, fhPrefix+"streams/") - before.Under(testenv.OpList, fhPrefix+"streams/")
		if resp.Status != 200 {
			t.Fatalf("list after %q: %s", after, resp)
		}
		var p struct {
			Streams []struct {
				Name    string `json:"name"`
				NextSeq uint64 `json:"next_seq"`
			} `json:"streams"`
			HasMore bool `json:"has_more"`
		}
		if err := json.Unmarshal(resp.Body, &p); err != nil {
			t.Fatalf("list body %q: %v", fhClip(string(resp.Body), 200), err)
		}
		out := make([]string, len(p.Streams))
		for i, s := range p.Streams {
			out[i] = s.Name
		}
		return out, p.HasMore, lists
	}

	for _, limit := range []int{1000, 777} {
		start := time.Now()
		var got []string
		after, pages, maxLists, totalLists := "", 0, 0, 0
		for {
			names, more, lists := page(limit, after)
			pages++
			maxLists, totalLists = max(maxLists, lists), totalLists+lists
			if lists > 2 {
				t.Errorf("limit %d: the page after %q cost %d LIST requests", limit, after, lists)
			}
			if len(names) > limit {
				t.Fatalf("limit %d: a page of %d streams", limit, len(names))
			}
			if more && len(names) < limit {
				t.Errorf("limit %d: a short page (%d) with has_more", limit, len(names))
			}
			got = append(got, names...)
			if !more {
				break
			}
			if len(names) == 0 || pages > n {
				t.Fatalf("limit %d: paging does not end (page %d)", limit, pages)
			}
			after = names[len(names)-1]
		}
		if len(got) != n || !sort.StringsAreSorted(got) || strings.Join(got, ",") != strings.Join(names, ",") {
			t.Errorf("limit %d: listed %d names (sorted %t), want the %d created", limit, len(got), sort.StringsAreSorted(got), n)
		}
		t.Logf("limit %d: %d pages in %s, %d LIST requests (at most %d per page)",
			limit, pages, time.Since(start).Round(time.Millisecond), totalLists, maxLists)
	}
	// start_after in the middle, and a limit of one.
	got, more, lists := page(3, "/list/s04999")
	if strings.Join(got, " ") != "/list/s05000 /list/s05001 /list/s05002" || !more || lists > 2 {
		t.Errorf("page after /list/s04999: %v more=%t lists=%d", got, more, lists)
	}
	got, more, _ = page(1, "/list/s09998")
	if strings.Join(got, " ") != "/list/s09999" || more {
		t.Errorf("last page: %v more=%t", got, more)
	}
	if got, more, _ = page(10, "/list/s09999"); len(got) != 0 || more {
		t.Errorf("after the last name: %v more=%t", got, more)
	}
}

// TestPicoTrimLeavesBucket trims a stream whose records are partly in data
// objects and partly still in the WAL, and checks in the bucket itself that
// after compaction no object holds a trimmed record's bytes while every
// kept record is still there.
func TestPicoTrimLeavesBucket(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	// Without packs, so the first records are in a data object of their own.
	e := picoStart(t, []string{"compact_interval 1s", "pack_below off"}, nil)
	const name = "/trim/t"
	picoWant(t, "create", picoDo(e, "PUT", "/pico"+name, nil), 201)
	records := fhRandomRecords(77, 20, 2048)
	appendRange := func(from, to int) {
		for i := from; i < to; i += 2 {
			batch := picoEncodeBinary([]picoNewRecord{{body: records[i]}, {headers: [][2]string{{"i", strconv.Itoa(i + 1)}}, body: records[i+1]}})
			picoWant(t, "append", picoDo(e, "POST", "/pico"+name, batch, "Content-Type", picoBinaryBatch), 200, "Pico-Start-Seq", strconv.Itoa(i))
		}
	}
	// holders returns, per record, the keys of the objects that hold it.
	holders := func() [][]string {
		objs, bodies := fhReadAll(t, e, "")
		out := make([][]string, len(records))
		for i, r := range records {
			for j, b := range bodies {
				if bytes.Contains(b, r) {
					out[i] = append(out[i], objs[j].Key)
				}
			}
		}
		return out
	}
	// The first ten go into data objects.
	appendRange(0, 10)
	err := fhWaitFor(fhCompactWait, 250*time.Millisecond, func() error {
		for i, keys := range holders()[:10] {
			if len(keys) != 1 || !strings.HasPrefix(keys[0], "data/") {
				return fmt.Errorf("record %d is in %v, not in one data object", i, keys)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("compaction did not move the first records into data objects: %v", err)
	}
	// The next ten stay in the WAL for now; the trim cuts through both.
	appendRange(10, 20)
	const trimTo = 15
	picoWant(t, "trim", picoDo(e, "POST", "/pico"+name, nil, "Pico-Trim-Seq", strconv.Itoa(trimTo)), 200,
		"Pico-Start-Seq", strconv.Itoa(trimTo), "Pico-Next-Seq", "20")
	picoWantError(t, "read below the trim", picoDo(e, "GET", "/pico"+name+"?seq=3", nil), 410, "gone")

	err = fhWaitFor(fhCompactWait, 250*time.Millisecond, func() error {
		h := holders()
		for i := range trimTo {
			if len(h[i]) > 0 {
				return fmt.Errorf("trimmed record %d is still in %v", i, h[i])
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("trimmed bytes stay in the bucket after compaction: %v", err)
	}
	h := holders()
	for i := trimTo; i < len(records); i++ {
		if len(h[i]) == 0 {
			t.Errorf("kept record %d is in no object", i)
		}
	}
	var keys []string
	for _, o := range e.mustList("") {
		keys = append(keys, o.Key)
	}
	t.Logf("bucket after the trim's compaction: %s", strings.Join(keys, " "))

	// The kept records read back, through both protocols, at their seqs.
	r := picoDo(e, "GET", "/pico"+name+"?format=binary", nil)
	picoWant(t, "read after trim", r, 200, "Pico-Next-Seq", "20")
	recs, err := picoDecodeBinaryRead(r.Body)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != len(records)-trimTo {
		t.Fatalf("read %d records after the trim, want %d", len(recs), len(records)-trimTo)
	}
	for i, rec := range recs {
		if rec.seq != uint64(trimTo+i) || !bytes.Equal(rec.body, records[trimTo+i]) {
			t.Errorf("record %d after the trim: seq %d", trimTo+i, rec.seq)
		}
	}
	got, _, err := e.readBytes("/ds" + name)
	if err != nil || !bytes.Equal(got, bytes.Join(records[trimTo:], nil)) {
		t.Errorf("DS read after the trim: %d bytes (%v)", len(got), err)
	}
	if errors.Is(err, io.EOF) {
		t.Log(err)
	}

	// Forks of the trimmed stream, whose trimmed bytes are gone: a fork
	// point before the retained start is 410 (as a read there is) and
	// writes nothing; a fork from -1 or above it inherits only retained
	// records.
	dsOffset := func(seq, b int) string { return fmt.Sprintf("%016d_%016d", seq, b) }
	for _, c := range []struct {
		name string
		hdr  []string
	}{
		{"below the trim", []string{"Stream-Fork-Offset", dsOffset(3, 0)}},
		{"at 0 with a sub-offset reaching past the trim", []string{"Stream-Fork-Offset", dsOffset(0, 0), "Stream-Fork-Sub-Offset", "40000"}},
	} {
		hdr := picoHdr(append([]string{"Stream-Forked-From", "/ds" + name}, c.hdr...)...)
		resp, writes := fhExpectNoWrites(t, e, fhReq{Method: "PUT", Path: "/ds/trim/refused", Header: hdr})
		if resp.Status != 410 || !strings.Contains(string(resp.Body), "retained") {
			t.Errorf("fork %s: %s, want 410 saying where the retained records start", c.name, resp)
		}
		if len(writes) > 0 {
			t.Errorf("fork %s: the refused fork wrote to the bucket: %s", c.name, fhSortedKeys(writes))
		}
		picoWant(t, "HEAD after the refused fork "+c.name, picoDo(e, "HEAD", "/ds/trim/refused", nil), 404)
	}
	picoWant(t, "fork from -1", picoDo(e, "PUT", "/ds/trim/from-start", nil, "Stream-Forked-From", "/ds"+name, "Stream-Fork-Offset", "-1"),
		201, "Stream-Next-Offset", dsOffset(trimTo, 0))
	picoWant(t, "fork above the trim", picoDo(e, "PUT", "/ds/trim/above", nil, "Stream-Forked-From", "/ds"+name, "Stream-Fork-Offset", dsOffset(17, 0)), 201)
	picoWant(t, "Pico HEAD of the fork", picoDo(e, "HEAD", "/pico/trim/above", nil), 200,
		"Pico-Start-Seq", strconv.Itoa(trimTo), "Pico-Next-Seq", "17")
	for fork, want := range map[string][]byte{"/ds/trim/from-start": nil, "/ds/trim/above": bytes.Join(records[trimTo:17], nil)} {
		if got, _, err := e.readBytes(fork); err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s reads %d bytes, want %d (%v)", fork, len(got), len(want), err)
		}
	}
}

// TestPicoLiveEndsAtShutdown parks a Pico long-poll and an SSE reader on an
// idle stream and stops Caddy: both must end promptly (a 204 and a final
// control event saying where to resume), and Caddy must exit without waiting
// for them.
func TestPicoLiveEndsAtShutdown(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const promptEnd = 3 * time.Second // live responses open at SIGTERM end within this
	e := picoStart(t, []string{"compact_interval 1h"}, []string{"long_poll_timeout 5m", "sse_reconnect_interval 5m"})
	picoWant(t, "create", picoDo(e, "PUT", "/pico/idle", []byte("a")), 201)
	s := picoOpenSSE(t, e, "/pico/idle?live=sse")
	s.data(t, 1)
	s.control(t, 1, true, false)
	type result struct {
		resp fhResp
		err  error
		at   time.Time
	}
	polled := make(chan result, 1)
	go func() {
		resp, err := fhSend(&http.Client{}, e.caddy.URL(), fhReq{Method: "GET", Path: "/pico/idle?seq=1&live=long-poll"})
		polled <- result{resp, err, time.Now()}
	}()
	// Let the long-poll park: one still on its way at the stop would
	// find no server, on a machine busy enough to outlast a fixed pause.
	fhWaitLongPolls(t, e.caddy.AdminAddr(), 1)
	stopped := time.Now()
	stopErr := make(chan error, 1)
	go func() { stopErr <- e.caddy.StopTimeout(30 * time.Second) }()

	select {
	case r := <-polled:
		if r.err != nil {
			t.Errorf("long-poll at shutdown: %v", r.err)
		} else {
			picoWant(t, "long-poll at shutdown", r.resp, 204, "Pico-Up-To-Date", "true", "Pico-Next-Seq", "1")
		}
		if d := r.at.Sub(stopped); d > promptEnd {
			t.Errorf("the long-poll ended %v after SIGTERM", d)
		}
	case <-time.After(promptEnd + 10*time.Second):
		t.Fatal("the long-poll did not end at shutdown")
	}
	s.control(t, 1, true, false) // where to resume
	s.ends(t, promptEnd)
	if err := <-stopErr; err != nil {
		t.Errorf("stopping Caddy: %v", err)
	}
	t.Logf("Caddy exited %v after SIGTERM", time.Since(stopped).Round(time.Millisecond))
}

// TestPicoListBehindDeletedStreams: deleted streams keep their keys for
// grave_time, and a page behind 300 of them passes over them in a few
// LISTs that double, not one LIST and GET per key: a page of one after
// them, and the probe behind a full page, each cost 300 LISTs before. A
// page that has found a stream stops after a few listings, short, with
// has_more: the next one goes on from there.
func TestPicoListBehindDeletedStreams(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"compact_interval 1h"}, nil)
	for _, name := range []string{"/graves/a", "/graves/z"} {
		picoWant(t, "create", picoDo(e, "PUT", "/pico"+name, nil, "Content-Type", "text/plain"), 201)
	}
	const deleted = 300
	for i := range deleted {
		name := fmt.Sprintf("/pico/graves/m%03d", i)
		picoWant(t, "create", picoDo(e, "PUT", name, nil, "Content-Type", "text/plain"), 201)
		picoWant(t, "delete", picoDo(e, "DELETE", name, nil), 204)
	}
	cases := []struct {
		query string
		want  string // the names listed, then has_more
	}{
		{"limit=1&start_after=/graves/a", "[/graves/z] false"},
		{"limit=1", "[/graves/a] true"},
		{"limit=2", "[/graves/a] true"},
		{"limit=2&start_after=/graves/a", "[/graves/z] false"},
	}
	for _, tc := range cases {
		before := e.proxy.Counts()
		resp := e.must(fhReq{Method: "GET", Path: "/pico/?prefix=/graves/&" + tc.query})
		lists := e.proxy.Counts().Under(testenv.OpList, fhPrefix+"streams/") - before.Under(testenv.OpList, fhPrefix+"streams/")
		if resp.Status != 200 {
			t.Fatalf("list %s: %s", tc.query, resp)
		}
		var p struct {
			Streams []struct {
				Name string `json:"name"`
			} `json:"streams"`
			HasMore bool `json:"has_more"`
		}
		if err := json.Unmarshal(resp.Body, &p); err != nil {
			t.Fatalf("list body %q: %v", fhClip(string(resp.Body), 200), err)
		}
		var names []string
		for _, s := range p.Streams {
			names = append(names, s.Name)
		}
		t.Logf("%s: %v, %d LISTs", tc.query, names, lists)
		if got := fmt.Sprint(names, " ", p.HasMore); got != tc.want {
			t.Errorf("list %s: %s, want %s", tc.query, got, tc.want)
		}
		if lists > 16 {
			t.Errorf("list %s behind %d deleted streams: %d LIST requests, want at most 16", tc.query, deleted, lists)
		}
	}
}
