package integration

// The crash torture's (torture_test.go) Pico workers and checks: binary
// and JSON batches whose records carry headers, appends with
// Pico-Match-Seq, binary reads and Pico SSE readers, and what a Pico read
// shows of a record besides its body (its headers and timestamp), checked
// after every restart. Also the choice of the storage the torture runs on:
// versitygw behind the fault-injecting proxy, or the embedded file://
// directory.

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// ---- the storage

// tortureStorage returns the storage URL the torture's Caddy runs on, the
// environment it needs, and the S3 proxy in front of it: versitygw behind
// the fault-injecting proxy by default, or with PICOMQ_TORTURE_STORE=file a
// local directory (file://, the embedded default), where there is no proxy
// (px is nil): no held uploads and no injected faults, kills at random
// moments only.
func tortureStorage(t *testing.T) (storage string, env []string, px *testenv.Proxy) {
	t.Helper()
	switch kind := os.Getenv("PICOMQ_TORTURE_STORE"); kind {
	case "", "s3":
		v := testenv.NewVersity(t)
		px = newProxy(t, v)
		bucket := v.NewBucket(t)
		t.Logf("storage: versitygw behind the fault-injecting proxy (PICOMQ_TORTURE_STORE=s3)")
		return testenv.StoreURL(px.URL(), bucket, caddytest.S3Prefix), caddytest.S3Env(v), px
	case "file":
		dir := filepath.Join(t.TempDir(), "store")
		t.Logf("storage: file://%s (PICOMQ_TORTURE_STORE=file)", dir)
		return "file://" + dir, nil, nil
	default:
		t.Fatalf("PICOMQ_TORTURE_STORE=%q: want s3 or file", kind)
		return "", nil, nil
	}
}

// killInStartUp restarts Caddy and kills the new process at a random
// moment of its first few hundred milliseconds, mostly while it is still
// starting up: the file store's stand-in for the S3 runs' kills while a
// start-up request is held. It reports whether the kill cut the start-up
// short; either way the process is gone.
func (tt *tTorture) killInStartUp(rng *rand.Rand) bool {
	started := make(chan error, 1)
	go func() { started <- tt.c.TryRestart() }()
	// The old process is dead: Running turns true once the new one is
	// spawned.
	for deadline := time.Now().Add(10 * time.Second); !tt.c.Running() && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(time.Duration(rng.Int64N(int64(250 * time.Millisecond))))
	tt.c.Kill()
	return <-started != nil
}

// ---- what Pico reads show of a record

// tMeta is what a Pico read shows of a record besides its body.
type tMeta struct {
	hdrs string // its headers, canonical (see canonHeaders)
	ts   int64  // its timestamp; 0 when not known
}

// canonHeaders is a record's headers as a JSON object with sorted names:
// "{}" for none.
func canonHeaders(h map[string]string) string {
	if len(h) == 0 {
		return "{}"
	}
	b, _ := json.Marshal(h) // sorts the names
	return string(b)
}

// tPicoStats are the Pico workers' counters.
type tPicoStats struct {
	binBatches, jsonHdrBatches, producerBatches, dupBatches      atomic.Int64
	matchAcked, matchRefused, matchStale, matchMaybe             atomic.Int64
	binReads, binRecords, sseConns, sseEvents, sseRecords        atomic.Int64
	metaChecked, tsChecked, hdrRecords, sseLastEventID, noAnswer atomic.Int64
}

// knowRecMeta records a known record (see knowRec), with what a Pico read
// would show of it besides its body when meta is not nil: once known,
// headers and a timestamp must never change either.
func (s *tStream) knowRecMeta(seq uint64, body []byte, meta *tMeta, how string) (problem string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	old, ok := s.recs[seq]
	if ok && string(old.body) != string(body) {
		return fmt.Sprintf("%s: record %d known as %s (%s) and now as %s (%s)",
			s.name, seq, clipB(old.body), old.how, clipB(body), how)
	}
	if ok && old.meta != nil && meta != nil {
		if old.meta.hdrs != meta.hdrs {
			return fmt.Sprintf("%s: record %d known with headers %s (%s) and now with %s (%s)",
				s.name, seq, old.meta.hdrs, old.how, meta.hdrs, how)
		}
		if old.meta.ts != 0 && meta.ts != 0 && old.meta.ts != meta.ts {
			return fmt.Sprintf("%s: record %d known with timestamp %d (%s) and now with %d (%s)",
				s.name, seq, old.meta.ts, old.how, meta.ts, how)
		}
	}
	rec := tRec{body: body, how: how, meta: meta}
	if ok && old.meta != nil {
		// Keep what was known; a timestamp learnt later joins it.
		m := *old.meta
		if meta != nil && m.ts == 0 {
			m.ts = meta.ts
		}
		rec.meta, rec.how = &m, old.how
	}
	s.recs[seq] = rec
	if seq+1 > s.maxTail {
		s.maxTail, s.tailHow = seq+1, " (record "+strconv.FormatUint(seq, 10)+", "+rec.how+")"
	}
	return ""
}

// seeTailBy records a tail seq someone was given, and by what when how
// is not empty: a check that finds the stream's tail below it names it.
func (s *tStream) seeTailBy(seq uint64, how string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if seq > s.maxTail {
		s.maxTail, s.tailHow = seq, ""
		if how != "" {
			s.tailHow = " (by " + how + ")"
		}
	}
}

// knowPicoRecord records a record a Pico JSON read or SSE event served.
func (tt *tTorture) knowPicoRecord(s *tStream, rec picoRecord, how string) bool {
	var body []byte
	switch {
	case rec.Body != nil && rec.BodyB64 == nil:
		body = []byte(*rec.Body)
	case rec.BodyB64 != nil && rec.Body == nil:
		b, err := base64.StdEncoding.DecodeString(*rec.BodyB64)
		if err != nil {
			tt.m.violation("%s: %s: record %d: body_b64: %v", s.name, how, rec.Seq, err)
			return false
		}
		body = b
	default:
		tt.m.violation("%s: %s: record %d has neither or both of body and body_b64", s.name, how, rec.Seq)
		return false
	}
	meta := &tMeta{hdrs: canonHeaders(rec.Headers), ts: rec.Timestamp}
	if p := s.knowRecMeta(rec.Seq, body, meta, fmt.Sprintf("%s (served after %d kills)", how, tt.kills.Load())); p != "" {
		tt.m.violation("%s", p)
		return false
	}
	return true
}

// checkMetas checks what a Pico read after a restart (metas, by seq, from
// start on) shows besides the bodies: the headers and timestamp every
// known record had, and timestamps that never go back along the stream.
func (tt *tTorture) checkMetas(s *tStream, start uint64, recs map[uint64]tRec, metas map[uint64]tMeta) {
	m := tt.m
	for seq, want := range recs {
		if seq < start || want.meta == nil {
			continue
		}
		have, ok := metas[seq]
		if !ok {
			continue // missing: reported with the bodies
		}
		m.pico.metaChecked.Add(1)
		if have.hdrs != want.meta.hdrs {
			m.violation("%s: record %d (%s) has headers %s after %d kills, was %s",
				s.name, seq, want.how, have.hdrs, tt.kills.Load(), want.meta.hdrs)
		}
		if want.meta.ts != 0 && have.ts != want.meta.ts {
			m.violation("%s: record %d (%s) has timestamp %d after %d kills, was %d",
				s.name, seq, want.how, have.ts, tt.kills.Load(), want.meta.ts)
		}
	}
	prev, ok := metas[start]
	for seq := start + 1; ok; seq++ {
		cur, found := metas[seq]
		if !found {
			break
		}
		m.pico.tsChecked.Add(1)
		if cur.ts < prev.ts {
			m.violation("%s: record %d has timestamp %d, before record %d's %d (after %d kills): timestamps went back",
				s.name, seq, cur.ts, seq-1, prev.ts, tt.kills.Load())
		}
		prev = cur
	}
}

// ---- appends

// tPicoWorker is a worker's state for the Pico operations of this file.
type tPicoWorker struct {
	// seqs holds the next seq of the worker's producer of each batch
	// form on each stream (-1: it ended there).
	seqs map[tProducerKey]int
}

type tProducerKey struct {
	s    *tStream
	form string
}

func (w *tWorker) picoState() *tPicoWorker {
	if w.pico == nil {
		w.pico = &tPicoWorker{seqs: map[tProducerKey]int{}}
	}
	return w.pico
}

// picoOp is one of this file's operations, picked at random.
func (w *tWorker) picoOp() {
	switch r := w.rng.IntN(100); {
	case r < 35:
		w.picoBatchAppend("binary")
	case r < 55:
		w.picoBatchAppend("json")
	case r < 85:
		w.picoMatchAppend()
	default:
		w.picoBinaryRead()
	}
}

// tPicoBatch is a Pico append's body and the records it makes.
type tPicoBatch struct {
	payload []byte
	ctype   string
	toks    []string
	bodies  [][]byte
	hdrs    []string // canonical
}

func (b tPicoBatch) set(s *tStream, state int) {
	for _, tok := range b.toks {
		s.setBody(tok, state)
	}
}

// recHeaders makes a record's headers: none, or a few, some of them with
// characters a header name or value may hold beyond ASCII letters.
func (w *tWorker) recHeaders(tok string) map[string]string {
	if w.rng.IntN(4) == 0 {
		return nil
	}
	h := map[string]string{"tok": tok}
	names := []string{"trace-id", "Content-Kind", "ünï", "k", "with space", "x:y"}
	for range w.rng.IntN(4) {
		name := names[w.rng.IntN(len(names))]
		switch w.rng.IntN(4) {
		case 0:
			h[name] = ""
		case 1:
			h[name] = "vålue " + strconv.Itoa(w.rng.IntN(1000)) + " \"quoted\" / \\ ☃"
		default:
			h[name] = strconv.FormatUint(w.rng.Uint64(), 36)
		}
	}
	return h
}

// picoBatch makes a body for s: a binary batch, a JSON batch (bodies as
// text or base64), each of 1-4 records with headers, or one record in the
// stream's own type ("single").
func (w *tWorker) picoBatch(s *tStream, form string) tPicoBatch {
	k := 1 + w.rng.IntN(4)
	if form == "single" {
		k = 1
	}
	var b tPicoBatch
	type jrec struct {
		Body    *string           `json:"body,omitempty"`
		BodyB64 *string           `json:"body_b64,omitempty"`
		Headers map[string]string `json:"headers,omitempty"`
	}
	var jrecs []jrec
	var brecs []picoNewRecord
	for range k {
		tok := w.token(s)
		size := w.size()
		if size > 64<<10 {
			size = 64 << 10 // a batch goes through the WAL; blobs come from DS
		}
		body := tortureBody(w.rng, tok, size)
		if s.json {
			body = jsonString(body)
		}
		var h map[string]string
		if form != "single" {
			h = w.recHeaders(tok)
		}
		b.toks = append(b.toks, tok)
		b.bodies = append(b.bodies, body)
		b.hdrs = append(b.hdrs, canonHeaders(h))
		switch form {
		case "json":
			r := jrec{Headers: h}
			if w.rng.IntN(3) == 0 {
				enc := base64.StdEncoding.EncodeToString(body)
				r.BodyB64 = &enc
			} else {
				str := string(body)
				r.Body = &str
			}
			jrecs = append(jrecs, r)
		case "binary":
			nr := picoNewRecord{body: body}
			for name, v := range h {
				nr.headers = append(nr.headers, [2]string{name, v})
			}
			brecs = append(brecs, nr)
		}
	}
	switch form {
	case "json":
		b.payload, _ = json.Marshal(map[string]any{"records": jrecs})
		b.ctype = "application/vnd.picomq.batch+json"
	case "binary":
		b.payload = picoEncodeBinary(brecs)
		b.ctype = "application/vnd.picomq.batch"
	default:
		b.payload = b.bodies[0]
		b.ctype = s.contentType()
	}
	return b
}

// ackPico records the records of an acknowledged Pico append that wrote
// them (Pico-Start-Seq present), with their headers and timestamp.
func (tt *tTorture) ackPico(s *tStream, r *response, b tPicoBatch, how string) (first uint64, ok bool) {
	m := tt.m
	first, err1 := strconv.ParseUint(r.header.Get("Pico-Start-Seq"), 10, 64)
	next, err2 := strconv.ParseUint(r.header.Get("Pico-Next-Seq"), 10, 64)
	ts, err3 := strconv.ParseInt(r.header.Get("Pico-Timestamp"), 10, 64)
	if err1 != nil || err2 != nil || err3 != nil || first+uint64(len(b.bodies)) != next {
		m.violation("%s: %s of %d records acknowledged with Pico-Start-Seq %q, Pico-Next-Seq %q, Pico-Timestamp %q",
			s.name, how, len(b.bodies), r.header.Get("Pico-Start-Seq"), r.header.Get("Pico-Next-Seq"), r.header.Get("Pico-Timestamp"))
		return 0, false
	}
	for i, body := range b.bodies {
		if b.hdrs[i] != "{}" {
			m.pico.hdrRecords.Add(1)
		}
		meta := &tMeta{hdrs: b.hdrs[i], ts: ts}
		if p := s.knowRecMeta(first+uint64(i), body, meta, fmt.Sprintf("%s %s (acked, after %d kills)", how, b.toks[i], tt.kills.Load())); p != "" {
			m.violation("%s", p)
		}
	}
	return first, true
}

// picoBatchAppend appends a binary or JSON batch whose records carry
// headers, half of them as an idempotent producer retrying across kills.
func (w *tWorker) picoBatchAppend(form string) {
	tt, m := w.tt, w.tt.m
	s := m.pick(w.rng, true)
	if s == nil {
		return
	}
	b := w.picoBatch(s, form)
	hdr := map[string]string{"Content-Type": b.ctype}
	producer := w.rng.IntN(2) == 0
	ps, key := w.picoState(), tProducerKey{s: s, form: form}
	seq := ps.seqs[key]
	if producer {
		if seq < 0 {
			return // this producer ended on this stream
		}
		hdr["Pico-Producer-Id"] = fmt.Sprintf("pico-%s-w%d", form, w.id)
		hdr["Pico-Producer-Epoch"] = "0"
		hdr["Pico-Producer-Seq"] = strconv.Itoa(seq)
	}
	b.set(s, tBodyMaybe)
	var r *response
	lost := false
	if producer {
		if r, lost = tt.settle(http.MethodPost, "/pico"+s.name, hdr, b.payload, 120*time.Second); r == nil {
			m.violation("%s: Pico %s batch producer seq %d not settled in 120s", s.name, form, seq)
			ps.seqs[key] = -1
			return
		}
	} else {
		var err error
		if r, err = tt.req(http.MethodPost, "/pico"+s.name, "", hdr, b.payload, 30*time.Second); err != nil || r.status >= 500 {
			m.pico.noAnswer.Add(1)
			return
		}
	}
	switch {
	case r.status == http.StatusOK:
		b.set(s, tBodyAcked)
		if form == "binary" {
			m.pico.binBatches.Add(1)
		} else {
			m.pico.jsonHdrBatches.Add(1)
		}
		if producer {
			m.pico.producerBatches.Add(1)
			ps.seqs[key] = seq + 1
		}
		if next, err := strconv.ParseUint(r.header.Get("Pico-Next-Seq"), 10, 64); err == nil {
			s.seeTail(next)
		}
		if r.header.Get("Pico-Start-Seq") == "" {
			if !producer || !lost {
				m.violation("%s: Pico %s batch answered as a duplicate on its first request: %v", s.name, form, r.header)
			}
			m.pico.dupBatches.Add(1)
			return
		}
		tt.ackPico(s, r, b, "Pico "+form+" batch")
	default:
		if !lost {
			b.set(s, tBodyAbsent)
		}
		if producer {
			ps.seqs[key] = -1
		}
		w.expectRefusal(s, r, "Pico "+form+" batch")
	}
}

// picoMatchAppend appends with Pico-Match-Seq at the tail a Pico HEAD
// just gave (a batch with headers or one record), or now and then below
// it, which must be refused: an acknowledged one landed exactly at the
// seq it named, a 412 wrote nothing.
func (w *tWorker) picoMatchAppend() {
	tt, m := w.tt, w.tt.m
	s := m.pick(w.rng, true)
	if s == nil {
		return
	}
	head, err := tt.req(http.MethodHead, "/pico"+s.name, "", nil, nil, 20*time.Second)
	if err != nil || head.status != http.StatusOK {
		return
	}
	tail, err := strconv.ParseUint(head.header.Get("Pico-Next-Seq"), 10, 64)
	if err != nil {
		m.violation("%s: Pico HEAD without Pico-Next-Seq: %v", s.name, head.header)
		return
	}
	// A tail a HEAD showed is durable: no kill may take it back.
	s.seeTailBy(tail, fmt.Sprintf("a Pico HEAD after %d kills", tt.kills.Load()))
	match, stale := tail, false
	if tail > 0 && w.rng.IntN(5) == 0 {
		match, stale = tail-1-uint64(w.rng.IntN(int(min(tail, 3)))), true
	}
	form := []string{"binary", "json", "single"}[w.rng.IntN(3)]
	b := w.picoBatch(s, form)
	hdr := map[string]string{"Content-Type": b.ctype, "Pico-Match-Seq": strconv.FormatUint(match, 10)}
	b.set(s, tBodyMaybe)
	var r *response
	lost := false
	if w.rng.IntN(2) == 0 {
		if r, lost = tt.settle(http.MethodPost, "/pico"+s.name, hdr, b.payload, 90*time.Second); r == nil {
			m.pico.matchMaybe.Add(1)
			return
		}
	} else if r, err = tt.req(http.MethodPost, "/pico"+s.name, "", hdr, b.payload, 30*time.Second); err != nil || r.status >= 500 {
		m.pico.matchMaybe.Add(1)
		return
	}
	what := fmt.Sprintf("Pico append with Pico-Match-Seq %d (tail %d by HEAD)", match, tail)
	switch {
	case r.status == http.StatusOK && stale:
		m.violation("%s: %s accepted after %d kills, below the tail: Pico-Start-Seq %q", s.name, what, tt.kills.Load(), r.header.Get("Pico-Start-Seq"))
	case r.status == http.StatusOK:
		b.set(s, tBodyAcked)
		m.pico.matchAcked.Add(1)
		if first, ok := tt.ackPico(s, r, b, what); ok && first != match {
			m.violation("%s: %s acknowledged at seq %d", s.name, what, first)
		}
	case r.status == http.StatusPreconditionFailed:
		n, err := strconv.ParseUint(r.header.Get("Pico-Next-Seq"), 10, 64)
		var eb struct {
			Error   string `json:"error"`
			NextSeq uint64 `json:"next_seq"`
		}
		jerr := json.Unmarshal(r.body, &eb)
		switch {
		case err != nil || jerr != nil || eb.Error != "match_failed" || eb.NextSeq != n:
			m.violation("%s: %s: 412 with Pico-Next-Seq %q and body %s", s.name, what, r.header.Get("Pico-Next-Seq"), clipB(r.body))
		case n == match || n < tail:
			m.violation("%s: %s refused with Pico-Next-Seq %d after %d kills", s.name, what, n, tt.kills.Load())
		}
		s.seeTailBy(n, fmt.Sprintf("the 412 of a Pico-Match-Seq %d after %d kills", match, tt.kills.Load()))
		if stale {
			m.pico.matchStale.Add(1)
		} else {
			m.pico.matchRefused.Add(1)
		}
		if !lost {
			b.set(s, tBodyAbsent) // a 412 wrote nothing
		}
	default:
		if !lost {
			b.set(s, tBodyAbsent)
		}
		w.expectRefusal(s, r, what)
	}
}

// ---- reads

// picoBinaryRead reads a stream with format=binary from its start or a
// seq below its highest tail, and records what it was served, headers and
// timestamps included.
func (w *tWorker) picoBinaryRead() {
	tt, m := w.tt, w.tt.m
	s := m.pick(w.rng, false)
	if s == nil {
		return
	}
	s.mu.Lock()
	from := uint64(0)
	if s.maxTail > 0 && w.rng.IntN(2) == 0 {
		from = uint64(w.rng.Int64N(int64(s.maxTail)))
	}
	s.mu.Unlock()
	r, err := tt.req(http.MethodGet, "/pico"+s.name, fmt.Sprintf("seq=%d&format=binary", from), nil, nil, 20*time.Second)
	if err != nil || r.status >= 500 {
		return
	}
	if r.status != http.StatusOK {
		w.readRefused(s, r, fmt.Sprintf("Pico binary read at %d", from))
		return
	}
	recs, err := picoDecodeBinaryRead(r.body)
	if err != nil {
		m.violation("%s: Pico binary read at %d: %v", s.name, from, err)
		return
	}
	m.pico.binReads.Add(1)
	for i, rec := range recs {
		if (from > 0 && i == 0 && rec.seq != from) || (i > 0 && rec.seq != recs[i-1].seq+1) {
			m.violation("%s: Pico binary read at %d: record %d at position %d", s.name, from, rec.seq, i)
			return
		}
		h := map[string]string{}
		for _, kv := range rec.headers {
			h[kv[0]] = kv[1]
		}
		m.pico.binRecords.Add(1)
		meta := &tMeta{hdrs: canonHeaders(h), ts: rec.ts}
		if p := s.knowRecMeta(rec.seq, rec.body, meta, fmt.Sprintf("Pico binary read (served after %d kills)", tt.kills.Load())); p != "" {
			m.violation("%s", p)
			return
		}
	}
	if n, err := strconv.ParseUint(r.header.Get("Pico-Next-Seq"), 10, 64); err == nil {
		s.seeTailBy(n, fmt.Sprintf("a Pico binary read after %d kills", tt.kills.Load()))
	}
}

// picoSSE follows s with Pico SSE until the deadline, reconnecting where
// the last event left it, by seq= or by Last-Event-ID.
func (tt *tTorture) picoSSE(rng *rand.Rand, s *tStream, until time.Time) {
	seq, resumed := uint64(0), false
	for time.Now().Before(until) && !tt.stopped() {
		ctx, cancel := context.WithDeadline(context.Background(), until)
		closed, gone := tt.picoSSEOnce(ctx, s, &seq, resumed && rng.IntN(2) == 0)
		cancel()
		if closed || gone {
			return
		}
		resumed = true
		time.Sleep(50 * time.Millisecond)
	}
}

// picoSSEOnce reads one Pico SSE response from *seq on, moving *seq on
// with its events.
func (tt *tTorture) picoSSEOnce(ctx context.Context, s *tStream, seq *uint64, byEventID bool) (closed, gone bool) {
	m := tt.m
	cl, _ := tt.client() // in the two-node mode, either node
	u := cl.base + "/pico" + s.name + "?live=sse"
	if !byEventID {
		u += "&seq=" + strconv.FormatUint(*seq, 10)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return false, true
	}
	if byEventID {
		req.Header.Set("Last-Event-ID", strconv.FormatUint(*seq, 10))
		m.pico.sseLastEventID.Add(1)
	}
	resp, err := cl.hc.Do(req)
	if err != nil {
		return false, false
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b := make([]byte, 4096)
		n, _ := resp.Body.Read(b)
		r := &response{status: resp.StatusCode, header: resp.Header, body: b[:n]}
		if resp.StatusCode >= 500 {
			return false, false
		}
		if !tt.goneOK(s, r) {
			m.violation("%s: Pico SSE at %d: %s", s.name, *seq, r)
		}
		return false, true
	}
	m.pico.sseConns.Add(1)
	from := *seq
	first := true
	br := bufio.NewReader(resp.Body)
	for {
		event, id, data, err := readPicoSSEEvent(br)
		if err != nil {
			return false, false
		}
		m.pico.sseEvents.Add(1)
		switch event {
		case "data":
			var recs []picoRecord
			if err := json.Unmarshal([]byte(data), &recs); err != nil || len(recs) == 0 {
				m.violation("%s: Pico SSE data at %d: %v: %s", s.name, *seq, err, fhClip(data, 80))
				return false, true
			}
			for _, rec := range recs {
				// In order from the seq asked for; from the stream's
				// start (seq 0) on a trimmed one, wherever that is.
				startsLate := first && from == 0 && s.mayStartLate()
				if rec.Seq != *seq && !(startsLate && rec.Seq > *seq) {
					m.violation("%s: Pico SSE from %d served record %d where %d was next", s.name, from, rec.Seq, *seq)
					return false, true
				}
				first = false
				m.pico.sseRecords.Add(1)
				if !tt.knowPicoRecord(s, rec, "Pico SSE") {
					return false, true
				}
				*seq = rec.Seq + 1
			}
			if id != strconv.FormatUint(*seq, 10) {
				m.violation("%s: Pico SSE data event with id %q after record %d", s.name, id, *seq-1)
				return false, true
			}
		case "control":
			var ctl struct {
				NextSeq *uint64 `json:"next_seq"`
				Closed  bool    `json:"closed"`
			}
			if err := json.Unmarshal([]byte(data), &ctl); err != nil || ctl.NextSeq == nil {
				m.violation("%s: Pico SSE control %q: %v", s.name, data, err)
				return false, true
			}
			n := *ctl.NextSeq
			if n < *seq || id != strconv.FormatUint(n, 10) {
				m.violation("%s: Pico SSE control (id %q) names %d, records up to %d served", s.name, id, n, *seq)
				return false, true
			}
			s.seeTailBy(n, fmt.Sprintf("a Pico SSE control event after %d kills", tt.kills.Load()))
			*seq, first = n, false
			if ctl.Closed {
				return true, false
			}
		}
	}
}

// readPicoSSEEvent reads one event; comments are skipped.
func readPicoSSEEvent(br *bufio.Reader) (event, id, data string, err error) {
	var lines []string
	started := false
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			return "", "", "", err
		}
		line = strings.TrimSuffix(strings.TrimSuffix(line, "\n"), "\r")
		if line == "" {
			if started {
				return event, id, strings.Join(lines, "\n"), nil
			}
			continue
		}
		if strings.HasPrefix(line, ":") {
			continue
		}
		started = true
		field, value, _ := strings.Cut(line, ":")
		value = strings.TrimPrefix(value, " ")
		switch field {
		case "event":
			event = value
		case "id":
			id = value
		case "data":
			lines = append(lines, value)
		}
	}
}

// logPico logs the counters of this file's workers and checks.
func (tt *tTorture) logPico() {
	p := &tt.m.pico
	tt.t.Logf("Pico: batches acked: binary %d, JSON with headers %d (as producers %d, duplicates %d; %d records with headers), unanswered %d; "+
		"Pico-Match-Seq: acked %d, refused (412) %d, below a tail refused %d, no answer %d",
		p.binBatches.Load(), p.jsonHdrBatches.Load(), p.producerBatches.Load(), p.dupBatches.Load(), p.hdrRecords.Load(), p.noAnswer.Load(),
		p.matchAcked.Load(), p.matchRefused.Load(), p.matchStale.Load(), p.matchMaybe.Load())
	tt.t.Logf("Pico reads: binary %d (%d records), SSE responses %d (%d by Last-Event-ID), events %d, records %d; checked: headers and timestamps %d, timestamp order %d",
		p.binReads.Load(), p.binRecords.Load(), p.sseConns.Load(), p.sseLastEventID.Load(), p.sseEvents.Load(), p.sseRecords.Load(),
		p.metaChecked.Load(), p.tsChecked.Load())
}
