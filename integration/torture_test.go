package integration

// TestCrashTorture is a randomized crash torture run, skipped unless asked
// for. Run it with
//
//	PICOMQ_TORTURE=10m go test -count=1 -timeout 60m -run '^TestCrashTorture$' -v ./integration
//
// and replay a run's choices (timing still varies) with PICOMQ_TORTURE_SEED,
// which every run logs. PICOMQ_TORTURE is the length of the load phase, a Go
// duration. The seed also picks whether streams are closed and deleted often
// or live long and grow; PICOMQ_TORTURE_CHURN=1 or 0 picks it instead.
// PICOMQ_TORTURE_ENGINE pins engine settings the seed would pick, written
// as a run logs them: "pack_below 32KiB; compact_interval 300ms".
// PICOMQ_KEEP=DIR keeps a failed run's whole Caddy logs there, with the
// engine's debug log (and the two-node run's bucket too).
//
// Caddy serves one storage through both protocols (/ds and /pico) on
// versitygw behind the fault-injecting proxy (latency, a few 503s), with
// settings that keep every background path busy: a tiny cache, a short
// flush interval and compaction interval, packs, a fast expiry sweep.
// Workers append (Durable Streams and Pico, with and without idempotent
// producers, with Stream-Seq, a few bodies large enough to go to blobs),
// create streams (some with a TTL, a quarter of them application/json,
// whose appends are arrays of messages), fork, trim (Pico-Trim-Seq), close
// and delete them, and read them (catch-up reads, Durable Streams
// long-polls and SSE, Pico long-polls). Every acknowledged append and every
// byte (or JSON message) a reader was served is recorded with its position.
// The workers in torture_ops_test.go do the trims, the Stream-Seq appends
// and the JSON bodies, and the checks of the first two; those in
// torture_pico_test.go the Pico batches (binary, and JSON with record
// headers), Pico-Match-Seq appends, binary reads and Pico SSE readers, and
// the check of every known record's headers and timestamp.
// PICOMQ_TORTURE_STORE=file runs it all on a file:// directory (the
// embedded default) instead: no proxy there, so every kill is at a random
// moment.
//
// Meanwhile Caddy is SIGKILLed again and again at random moments, some
// while the proxy holds an upload of a chosen kind (WAL, data object, pack,
// blob, stream metadata, manifest, a WAL delete) so that the kill lands in
// the middle of a group commit, a compaction or a delete, half of them
// with a trim, a Stream-Seq append and an append sent just before (waiting
// in a held batch, if any), some while a reload of the same configuration,
// or one with other engine settings (POST /load), is under way, some in a
// graceful shutdown (SIGTERM) that the SIGKILL cuts short, and restarted on
// the same storage. After each restart every fact recorded so far is
// checked while the load goes on: every acknowledged record reads back at
// its seq with its bytes, every byte a reader was served reads back at its
// offset, no stream's tail is below an offset already handed out, a closed
// stream is closed at the same tail, a deleted stream stays gone, a stream
// starts at or after its last acknowledged trim and at a point some trim
// named (a trim that got no answer happened whole or not at all) with the
// record before it gone, and the highest acknowledged Stream-Seq is
// refused again. At the end, with the load stopped, each stream is read
// whole: a body that was acknowledged (producer retries across kills
// included) is there exactly once unless a trim took it, one whose request
// got no answer at most once, one refused with a 4xx not at all.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// Body states, for the final exactly-once check.
const (
	tBodyMaybe  = iota // no answer, or a 5xx: stored at most once
	tBodyAcked         // acknowledged: stored exactly once
	tBodyAbsent        // refused with a 4xx: never stored
)

// tStream is what the torture knows of one stream: facts that must hold
// for as long as it exists.
type tStream struct {
	name string // below /ds and /pico
	ttl  bool   // may expire (a 404 is then no violation)
	// fork point in records, for a fork (-1 for other streams).
	forkOf *tStream
	forkAt uint64

	mu sync.Mutex
	// recs holds every record known by seq: acknowledged by an append,
	// or served by a Pico read.
	recs map[uint64]tRec
	// obs are the Durable Streams reads that served bytes.
	obs []tObs
	// maxTail is the highest tail seq anyone was given, and tailHow
	// what gave it when known (torture_pico_test.go's seeTailBy).
	maxTail uint64
	tailHow string
	// bodies maps each body's token to its state.
	bodies map[string]int
	// live: created and acknowledged, not closing or deleting.
	created  bool
	closing  bool
	closedAt int64 // tail at the acknowledged close; -1 while open
	deleting bool
	deleted  bool // a delete was acknowledged

	// json: an application/json stream, whose records are JSON messages
	// and whose Durable Streams reads answer arrays of them.
	json bool
	// Trims (Pico-Trim-Seq), the stream's own and, for a fork, those its
	// source had when it was made: the first retained seq is at least
	// trimAcked, and is one of starts (0 or a trim point somebody sent):
	// never halfway.
	trimAcked, trimSent uint64
	starts              map[uint64]bool
	// Stream-Seq: the next value to hand out, and the highest one
	// acknowledged (-1 for none), which the stream refuses from then on.
	seqNext, seqAcked int
}

// tRec is one known record and how it became known.
type tRec struct {
	body []byte
	how  string
	meta *tMeta // what a Pico read shows besides the body; nil: not known
}

// tObs is one Durable Streams read: data served at a position.
type tObs struct {
	seq, off uint64
	data     []byte
	how      string
}

func (s *tStream) knowRec(seq uint64, body []byte, how string) (problem string) {
	return s.knowRecMeta(seq, body, nil, how)
}

func (s *tStream) seeTail(seq uint64) { s.seeTailBy(seq, "") }

func (s *tStream) setBody(token string, state int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	// Acked wins over anything; maybe over absent.
	if old, ok := s.bodies[token]; ok && (old == tBodyAcked || (old == tBodyMaybe && state == tBodyAbsent)) {
		return
	}
	s.bodies[token] = state
}

// tModel is every stream of the run.
type tModel struct {
	mu      sync.Mutex
	streams []*tStream
	next    int

	violations atomic.Int64
	vmu        sync.Mutex
	vlist      []string

	// counters
	appends, producerAppends, picoAppends, large, creates, forks, closes, deletes atomic.Int64
	reads, servedBytes, polls, sseEvents, picoPolls                               atomic.Int64
	noAnswer, refused, fenced                                                     atomic.Int64
	jsonStreams, trims, trimsLost                                                 atomic.Int64
	seqAppends, seqRefused, seqProbes                                             atomic.Int64
	pico                                                                          tPicoStats // torture_pico_test.go
}

func (m *tModel) violation(format string, args ...any) {
	m.violations.Add(1)
	m.vmu.Lock()
	if len(m.vlist) < 200 {
		m.vlist = append(m.vlist, fmt.Sprintf(format, args...))
	}
	m.vmu.Unlock()
}

// newStream adds a stream to be created (a fork of forkOf when not nil).
func (m *tModel) newStream(ttl, isJSON bool, forkOf *tStream) *tStream {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := &tStream{name: fmt.Sprintf("/torture/s%04d", m.next), ttl: ttl, forkOf: forkOf, recs: map[uint64]tRec{},
		bodies: map[string]int{}, closedAt: -1, json: isJSON, starts: map[uint64]bool{0: true}, seqAcked: -1}
	m.next++
	m.streams = append(m.streams, s)
	return s
}

func (m *tModel) all() []*tStream {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]*tStream(nil), m.streams...)
}

// pick returns a random stream that is created and, with open, not closing
// or going away; nil when there is none.
func (m *tModel) pick(rng *rand.Rand, open bool) *tStream {
	all := m.all()
	var c []*tStream
	for _, s := range all {
		s.mu.Lock()
		ok := s.created && !s.deleting && (!open || !s.closing)
		s.mu.Unlock()
		if ok {
			c = append(c, s)
		}
	}
	if len(c) == 0 {
		return nil
	}
	return c[rng.IntN(len(c))]
}

func (m *tModel) openCount() int {
	n := 0
	for _, s := range m.all() {
		s.mu.Lock()
		if s.created && !s.deleting && !s.closing {
			n++
		}
		s.mu.Unlock()
	}
	return n
}

// tortureBody is a body starting with a unique token ended by '|', then
// filler: no newline and no leading space, so that SSE carries it as is.
func tortureBody(rng *rand.Rand, token string, size int) []byte {
	b := make([]byte, 0, size+len(token)+1)
	b = append(b, token...)
	b = append(b, '|')
	for len(b) < size {
		b = append(b, byte('a'+rng.IntN(26)))
	}
	return b
}

func clipB(b []byte) string { return fhClip(string(b), 60) }

// parseDSOffset decodes "%016d_%016d".
func parseDSOffset(s string) (seq, off uint64, ok bool) {
	a, b, found := strings.Cut(s, "_")
	if !found {
		return 0, 0, false
	}
	x, err1 := strconv.ParseUint(a, 10, 64)
	y, err2 := strconv.ParseUint(b, 10, 64)
	return x, y, err1 == nil && err2 == nil
}

// tRun is one run: what every view of it (tTorture) shares.
type tRun struct {
	t     *testing.T
	m     *tModel
	kills atomic.Int64
	// probeN numbers the bodies the checks send; spare the workers that
	// send requests to be under way at a kill.
	probeN, spare atomic.Int64
	// churn: streams are closed and deleted often; without it they live
	// long and grow, compacted again and again.
	churn bool
	// stop is closed when the load ends.
	stop chan struct{}
	// nodes are the clients of the nodes serving the storage (two in the
	// two-node mode, torture_nodes_test.go): a view without a client of
	// its own sends each request to one of them at random.
	nodes []*dsClient
	// answered, when set, is told of every answer to a request sent to a
	// node picked at random: which node, and when the request was sent.
	answered func(node int, sent time.Time, method, path string, hdr map[string]string, r *response)
}

// tTorture is a run seen through one node (its process c and client cl),
// or, with cl nil, through any of them at random.
type tTorture struct {
	*tRun
	c  *caddytest.Caddy
	cl *dsClient
	// reloads are the configs a reload of c loads: the one running, and
	// others that differ only in engine settings.
	reloads []string
}

// client is the client a request goes out on, and the node's index in
// nodes when it was picked at random (-1 otherwise).
func (tt *tTorture) client() (*dsClient, int) {
	if tt.cl != nil {
		return tt.cl, -1
	}
	i := rand.IntN(len(tt.nodes))
	return tt.nodes[i], i
}

func (tt *tTorture) stopped() bool {
	select {
	case <-tt.stop:
		return true
	default:
		return false
	}
}

// req sends one request with a timeout.
func (tt *tTorture) req(method, path, query string, hdr map[string]string, body []byte, timeout time.Duration) (*response, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	h := http.Header{}
	for k, v := range hdr {
		h.Set(k, v)
	}
	cl, node := tt.client()
	sent := time.Now()
	r, err := cl.do(ctx, method, path, query, h, body)
	if err == nil && node >= 0 && tt.answered != nil {
		tt.answered(node, sent, method, path, hdr, r)
	}
	return r, err
}

// settle sends a request until it gets an answer below 500 or until
// giveUp; lost reports whether any attempt went unanswered (or 5xx).
func (tt *tTorture) settle(method, path string, hdr map[string]string, body []byte, giveUp time.Duration) (r *response, lost bool) {
	deadline := time.Now().Add(giveUp)
	for {
		r, err := tt.req(method, path, "", hdr, body, 20*time.Second)
		if err == nil && r.status < 500 {
			return r, lost
		}
		lost = true
		tt.m.noAnswer.Add(1)
		if time.Now().After(deadline) {
			return nil, true
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// ---- workers

type tWorker struct {
	tt  *tTorture
	id  int
	rng *rand.Rand
	n   int
	// producer seqs per stream, for this worker's DS and Pico producers.
	dsSeq, picoSeq map[*tStream]int
	dsEpoch        map[*tStream]int
	// offsets this worker was served, to read again from.
	offsets map[*tStream][]string
	pico    *tPicoWorker // torture_pico_test.go
}

func (w *tWorker) token(s *tStream) string {
	w.n++
	return fmt.Sprintf("%s/w%d/%d", strings.TrimPrefix(s.name, "/torture/"), w.id, w.n)
}

func (w *tWorker) size() int {
	switch r := w.rng.IntN(100); {
	case r < 2:
		w.tt.m.large.Add(1)
		return 270<<10 + w.rng.IntN(20<<10) // beyond 256 KiB: a blob of its own
	case r < 10:
		return 2<<10 + w.rng.IntN(20<<10)
	default:
		return 20 + w.rng.IntN(200)
	}
}

func (w *tWorker) run() {
	for !w.tt.stopped() {
		m := w.tt.m
		r := w.rng.IntN(100)
		open := m.openCount()
		switch {
		case open < 8 || (r < 3 && open < 60):
			w.create()
		case r < 30:
			w.dsAppend(false)
		case r < 42:
			w.dsAppend(true)
		case r < 52:
			w.picoAppend(false)
		case r < 60:
			w.picoAppend(true)
		case r < 75:
			w.catchUp()
		case r < 77:
			if open < 60 {
				w.fork()
			}
		case r < 78:
			if w.tt.churn || w.rng.IntN(10) == 0 {
				w.close()
			}
		case r < 79:
			if w.tt.churn || w.rng.IntN(10) == 0 {
				w.delete()
			}
		case r < 80:
			w.trim(false)
		case r < 85:
			w.seqAppend()
		case r < 86:
			w.seqStale()
		case r < 93:
			w.picoOp()
		default:
			time.Sleep(time.Duration(w.rng.IntN(30)) * time.Millisecond)
		}
	}
}

func (w *tWorker) create() {
	tt, m := w.tt, w.tt.m
	ttl := w.rng.IntN(5) == 0
	isJSON := w.rng.IntN(4) == 0
	s := m.newStream(ttl, isJSON, nil)
	hdr := map[string]string{"Content-Type": s.contentType()}
	path := "/ds" + s.name
	if w.rng.IntN(2) == 0 {
		path = "/pico" + s.name
		if ttl {
			hdr["Pico-TTL"] = strconv.Itoa(3 + w.rng.IntN(5))
		}
	} else if ttl {
		hdr["Stream-TTL"] = strconv.Itoa(3 + w.rng.IntN(5))
	}
	r, _ := tt.settle(http.MethodPut, path, hdr, nil, 90*time.Second)
	switch {
	case r == nil:
		return // never settled: the name is left alone
	case r.status == http.StatusCreated || r.status == http.StatusOK:
		m.creates.Add(1)
		if isJSON {
			m.jsonStreams.Add(1)
		}
		s.mu.Lock()
		s.created = true
		s.mu.Unlock()
	default:
		m.violation("create %s: %s (a create repeated after a lost answer must be 200)", path, r)
	}
}

func (w *tWorker) fork() {
	tt, m := w.tt, w.tt.m
	src := m.pick(w.rng, false)
	if src == nil {
		return
	}
	src.mu.Lock()
	ttl := src.ttl
	// The fork's start is its source's when it is made: at least the
	// trims acknowledged before it is asked for.
	trimAcked := src.trimAcked
	src.mu.Unlock()
	s := m.newStream(ttl, src.json, src)
	hdr := map[string]string{"Content-Type": s.contentType(), "Stream-Forked-From": "/ds" + src.name}
	r, _ := tt.settle(http.MethodPut, "/ds"+s.name, hdr, nil, 90*time.Second)
	switch {
	case r == nil:
		return
	case r.status == http.StatusCreated || r.status == http.StatusOK:
		seq, off, ok := parseDSOffset(r.next())
		if !ok || off != 0 {
			m.violation("fork %s of %s: Stream-Next-Offset %q", s.name, src.name, r.next())
			return
		}
		m.forks.Add(1)
		s.forkAt = seq
		// The source's known records below the fork point are the fork's.
		src.mu.Lock()
		inherited := map[uint64]tRec{}
		for q, rec := range src.recs {
			if q < seq {
				inherited[q] = tRec{body: rec.body, meta: rec.meta, how: "source " + src.name + " " + rec.how}
			}
		}
		// Any start the source may have had by now may be the fork's.
		starts, trimSent := maps.Clone(src.starts), src.trimSent
		src.mu.Unlock()
		s.mu.Lock()
		for q, rec := range inherited {
			s.recs[q] = rec
		}
		s.starts, s.trimAcked, s.trimSent = starts, trimAcked, trimSent
		s.maxTail = seq
		s.created = true
		s.mu.Unlock()
		src.seeTail(seq)
	case r.status == http.StatusNotFound || r.status == http.StatusGone || r.status == http.StatusConflict:
		// The source went away (deleted, expired) meanwhile.
	default:
		m.violation("fork %s of %s: %s", s.name, src.name, r)
	}
}

func (w *tWorker) dsAppend(producer bool) {
	tt, m := w.tt, w.tt.m
	s := m.pick(w.rng, true)
	if s == nil {
		return
	}
	p := w.dsPayload(s, 0)
	tok, body := p.toks[0], p.body
	hdr := map[string]string{"Content-Type": s.contentType()}
	if !producer {
		r, err := tt.req(http.MethodPost, "/ds"+s.name, "", hdr, body, 30*time.Second)
		switch {
		case err != nil || r.status >= 500:
			m.noAnswer.Add(1)
			p.set(s, tBodyMaybe)
		case r.status == http.StatusNoContent || r.status == http.StatusOK:
			m.appends.Add(1)
			p.set(s, tBodyAcked)
			w.ackDS(s, r, p, "DS append "+tok)
		default:
			m.refused.Add(1)
			p.set(s, tBodyAbsent)
			w.expectRefusal(s, r, "DS append")
		}
		return
	}
	if w.dsSeq == nil {
		w.dsSeq = map[*tStream]int{}
	}
	seq := w.dsSeq[s]
	if seq < 0 {
		return // this producer ended on this stream
	}
	if w.dsEpoch == nil {
		w.dsEpoch = map[*tStream]int{}
	}
	// Now and then the producer starts a new epoch (at seq 0), and then
	// checks that its old epoch is fenced, across kills too.
	epoch, oldSeq := w.dsEpoch[s], seq
	bump := seq > 0 && w.rng.IntN(15) == 0
	if bump {
		epoch, seq = epoch+1, 0
	}
	hdr["Producer-Id"] = fmt.Sprintf("ds-w%d", w.id)
	hdr["Producer-Epoch"] = strconv.Itoa(epoch)
	hdr["Producer-Seq"] = strconv.Itoa(seq)
	p.set(s, tBodyMaybe)
	r, lost := tt.settle(http.MethodPost, "/ds"+s.name, hdr, body, 120*time.Second)
	switch {
	case r == nil:
		m.violation("%s: DS producer seq %d (%s) not settled in 120s", s.name, seq, tok)
		w.dsSeq[s] = -1
	case r.status == http.StatusOK || r.status == http.StatusNoContent:
		m.producerAppends.Add(1)
		p.set(s, tBodyAcked)
		w.dsSeq[s], w.dsEpoch[s] = seq+1, epoch
		if r.status == http.StatusOK {
			w.ackDS(s, r, p, "DS producer append "+tok)
		} else if !lost {
			m.violation("%s: DS producer seq %d answered 204 (duplicate) on its first request", s.name, seq)
		} else {
			tt.seeDSTail(s, r.next())
		}
		if bump {
			w.staleEpoch(s, hdr["Producer-Id"], epoch-1, oldSeq)
		}
	default:
		if !lost {
			p.set(s, tBodyAbsent)
		}
		w.dsSeq[s] = -1
		w.expectRefusal(s, r, "DS producer append")
	}
}

// staleEpoch sends an append under a producer's epoch that a newer one
// replaced: it must be refused (403) and never stored.
func (w *tWorker) staleEpoch(s *tStream, id string, epoch, seq int) {
	if w.rng.IntN(2) == 0 {
		// Mostly after a kill or two: the fencing must survive them.
		time.Sleep(time.Duration(w.rng.IntN(3000)) * time.Millisecond)
	}
	p := w.dsPayload(s, 40)
	hdr := map[string]string{"Content-Type": s.contentType(), "Producer-Id": id,
		"Producer-Epoch": strconv.Itoa(epoch), "Producer-Seq": strconv.Itoa(seq)}
	p.set(s, tBodyMaybe)
	r, err := w.tt.req(http.MethodPost, "/ds"+s.name, "", hdr, p.body, 30*time.Second)
	switch {
	case err != nil || r.status >= 500:
		// No answer: never stored all the same, which the final check
		// cannot tell from a maybe; leave it at that.
	case r.status == http.StatusForbidden:
		p.set(s, tBodyAbsent)
		w.tt.m.fenced.Add(1)
	case r.status < 300:
		w.tt.m.violation("%s: producer %s epoch %d seq %d accepted (%s) after epoch %d was acknowledged",
			s.name, id, epoch, seq, r, epoch+1)
	default:
		p.set(s, tBodyAbsent)
		w.expectRefusal(s, r, "stale-epoch append")
	}
}

// ackDS records an acknowledged Durable Streams append: its records (one,
// or a JSON stream's messages) end at the tail it was answered.
func (w *tWorker) ackDS(s *tStream, r *response, p tPayload, how string) {
	seq, off, ok := parseDSOffset(r.next())
	k := uint64(len(p.msgs))
	if !ok || off != 0 || seq < k {
		w.tt.m.violation("%s: %s of %d records acknowledged with Stream-Next-Offset %q", s.name, how, k, r.next())
		return
	}
	for i, msg := range p.msgs {
		// No headers: Durable Streams has no way to send them.
		if pr := s.knowRecMeta(seq-k+uint64(i), msg, &tMeta{hdrs: "{}"}, fmt.Sprintf("%s (acked, after %d kills)", how, w.tt.kills.Load())); pr != "" {
			w.tt.m.violation("%s", pr)
		}
	}
}

func (tt *tTorture) seeDSTail(s *tStream, off string) {
	if seq, _, ok := parseDSOffset(off); ok {
		s.seeTail(seq)
	}
}

// expectRefusal accepts the 4xx answers a stream that is closing, deleted
// or expired gives; any other is a violation.
func (w *tWorker) expectRefusal(s *tStream, r *response, what string) {
	s.mu.Lock()
	closing, deleting, ttl := s.closing, s.deleting, s.ttl
	fork := s.forkOf
	s.mu.Unlock()
	if fork != nil {
		fork.mu.Lock()
		ttl = ttl || fork.ttl
		fork.mu.Unlock()
	}
	switch {
	case r.status == http.StatusConflict && (r.header.Get("Stream-Closed") == "true" || r.header.Get("Pico-Closed") == "true") && closing:
	case (r.status == http.StatusNotFound || r.status == http.StatusGone) && (deleting || ttl):
	default:
		w.tt.m.violation("%s %s: %s (closing %v, deleting %v, ttl %v; headers %v)", what, s.name, r, closing, deleting, ttl, r.header)
	}
}

func (w *tWorker) picoAppend(producer bool) {
	tt, m := w.tt, w.tt.m
	s := m.pick(w.rng, true)
	if s == nil {
		return
	}
	k := 1 + w.rng.IntN(4)
	var toks []string
	var bodies [][]byte
	type rec struct {
		Body string `json:"body"`
	}
	var batch struct {
		Records []rec `json:"records"`
	}
	for i := 0; i < k; i++ {
		tok := w.token(s)
		size := w.size()
		if size > 64<<10 {
			size = 64 << 10 // the batch goes through the WAL; blobs come from DS
		}
		b := tortureBody(w.rng, tok, size)
		if s.json {
			b = jsonString(b) // a JSON stream's records are JSON values
		}
		toks = append(toks, tok)
		bodies = append(bodies, b)
		batch.Records = append(batch.Records, rec{Body: string(b)})
	}
	payload, _ := json.Marshal(batch)
	hdr := map[string]string{"Content-Type": "application/vnd.picomq.batch+json"}
	seq := 0
	if producer {
		if w.picoSeq == nil {
			w.picoSeq = map[*tStream]int{}
		}
		seq = w.picoSeq[s]
		if seq < 0 {
			return
		}
		hdr["Pico-Producer-Id"] = fmt.Sprintf("pico-w%d", w.id)
		hdr["Pico-Producer-Epoch"] = "0"
		hdr["Pico-Producer-Seq"] = strconv.Itoa(seq)
	}
	set := func(state int) {
		for _, tok := range toks {
			s.setBody(tok, state)
		}
	}
	set(tBodyMaybe)
	var r *response
	lost := false
	if producer {
		r, lost = tt.settle(http.MethodPost, "/pico"+s.name, hdr, payload, 120*time.Second)
		if r == nil {
			m.violation("%s: Pico producer seq %d not settled in 120s", s.name, seq)
			w.picoSeq[s] = -1
			return
		}
	} else {
		var err error
		r, err = tt.req(http.MethodPost, "/pico"+s.name, "", hdr, payload, 30*time.Second)
		if err != nil || r.status >= 500 {
			m.noAnswer.Add(1)
			return
		}
	}
	switch {
	case r.status == http.StatusOK:
		set(tBodyAcked)
		m.picoAppends.Add(1)
		if producer {
			w.picoSeq[s] = seq + 1
		}
		next, err := strconv.ParseUint(r.header.Get("Pico-Next-Seq"), 10, 64)
		if err != nil {
			m.violation("%s: Pico append acknowledged without Pico-Next-Seq: %v", s.name, r.header)
			return
		}
		s.seeTail(next)
		start := r.header.Get("Pico-Start-Seq")
		if start == "" {
			if !lost {
				m.violation("%s: Pico append answered as a duplicate on its first request", s.name)
			}
			return
		}
		first, err := strconv.ParseUint(start, 10, 64)
		ts, err2 := strconv.ParseInt(r.header.Get("Pico-Timestamp"), 10, 64)
		if err != nil || err2 != nil || first+uint64(k) != next {
			m.violation("%s: Pico append of %d records: Pico-Start-Seq %q, Pico-Next-Seq %d, Pico-Timestamp %q", s.name, k, start, next, r.header.Get("Pico-Timestamp"))
			return
		}
		for i := range bodies {
			meta := &tMeta{hdrs: "{}", ts: ts}
			if p := s.knowRecMeta(first+uint64(i), bodies[i], meta, fmt.Sprintf("Pico append %s (acked, after %d kills)", toks[i], tt.kills.Load())); p != "" {
				m.violation("%s", p)
			}
		}
	default:
		if !lost {
			set(tBodyAbsent)
		}
		if producer {
			w.picoSeq[s] = -1
		}
		w.expectRefusal(s, r, "Pico append")
	}
}

func (w *tWorker) close() {
	tt, m := w.tt, w.tt.m
	s := m.pick(w.rng, true)
	if s == nil {
		return
	}
	s.mu.Lock()
	s.closing = true
	s.mu.Unlock()
	path, hdr := "/ds"+s.name, map[string]string{"Stream-Closed": "true"}
	if w.rng.IntN(2) == 0 {
		path, hdr = "/pico"+s.name, map[string]string{"Pico-Closed": "true"}
	}
	r, _ := tt.settle(http.MethodPost, path, hdr, nil, 90*time.Second)
	switch {
	case r == nil:
		return
	case r.status == http.StatusNoContent || r.status == http.StatusOK:
		var tail uint64
		var ok bool
		if strings.HasPrefix(path, "/ds") {
			var off uint64
			tail, off, ok = parseDSOffset(r.next())
			ok = ok && off == 0
		} else {
			var err error
			tail, err = strconv.ParseUint(r.header.Get("Pico-Next-Seq"), 10, 64)
			ok = err == nil
		}
		if !ok {
			m.violation("close %s: no tail in %v", path, r.header)
			return
		}
		m.closes.Add(1)
		s.mu.Lock()
		if s.closedAt >= 0 && uint64(s.closedAt) != tail {
			m.violation("%s closed at %d and again at %d", s.name, s.closedAt, tail)
		}
		s.closedAt = int64(tail)
		s.mu.Unlock()
		s.seeTail(tail)
	default:
		w.expectRefusal(s, r, "close")
	}
}

func (w *tWorker) delete() {
	tt, m := w.tt, w.tt.m
	s := m.pick(w.rng, false)
	if s == nil {
		return
	}
	s.mu.Lock()
	s.deleting = true
	s.mu.Unlock()
	path := "/ds" + s.name
	if w.rng.IntN(2) == 0 {
		path = "/pico" + s.name
	}
	r, lost := tt.settle(http.MethodDelete, path, nil, nil, 90*time.Second)
	switch {
	case r == nil:
	case r.status == http.StatusNoContent || r.status == http.StatusOK || (lost && r.status == http.StatusNotFound):
		m.deletes.Add(1)
		s.mu.Lock()
		s.deleted = true
		s.mu.Unlock()
	case r.status == http.StatusNotFound && s.ttl:
	case r.status == http.StatusGone:
		// Deleted already (soft, forks still read it): by an earlier
		// request whose answer was lost, or expired.
		if !lost && !s.ttl {
			m.violation("delete %s: %s, though nobody deleted it before", path, r)
		}
	default:
		m.violation("delete %s: %s", path, r)
	}
}

// catchUp reads a stream from its start or from an offset this worker
// was served before.
func (w *tWorker) catchUp() {
	tt, m := w.tt, w.tt.m
	s := m.pick(w.rng, false)
	if s == nil {
		return
	}
	if w.offsets == nil {
		w.offsets = map[*tStream][]string{}
	}
	offset := "-1"
	if offs := w.offsets[s]; len(offs) > 0 && w.rng.IntN(3) > 0 {
		offset = offs[w.rng.IntN(len(offs))]
	}
	for i := 0; i < 20; i++ {
		r, err := tt.req(http.MethodGet, "/ds"+s.name, "offset="+url.QueryEscape(offset), nil, nil, 20*time.Second)
		if err != nil || r.status >= 500 {
			return
		}
		if r.status != http.StatusOK {
			w.readRefused(s, r, "catch-up read at "+offset)
			return
		}
		m.reads.Add(1)
		if !tt.recordDS(s, offset, r.body, r.next(), "catch-up") {
			return
		}
		if len(w.offsets[s]) < 50 {
			w.offsets[s] = append(w.offsets[s], r.next())
		}
		offset = r.next()
		if r.header.Get("Stream-Up-To-Date") == "true" {
			return
		}
	}
}

func (w *tWorker) readRefused(s *tStream, r *response, what string) {
	s.mu.Lock()
	deleting, ttl := s.deleting, s.ttl
	s.mu.Unlock()
	if (r.status == http.StatusNotFound || r.status == http.StatusGone) && (deleting || ttl) || s.trimmedGone(r) {
		return
	}
	w.tt.m.violation("%s %s: %s (deleting %v, ttl %v)", what, s.name, r, deleting, ttl)
}

// recordDS records data served at offset with next after it; false when
// the answer is malformed (recorded as a violation).
func (tt *tTorture) recordDS(s *tStream, offset string, data []byte, next, how string) bool {
	var seq, off uint64
	if offset != "-1" {
		var ok bool
		if seq, off, ok = parseDSOffset(offset); !ok {
			tt.m.violation("%s: bad offset %q", s.name, offset)
			return false
		}
	}
	nseq, noff, ok := parseDSOffset(next)
	if !ok {
		tt.m.violation("%s: %s at %s: Stream-Next-Offset %q", s.name, how, offset, next)
		return false
	}
	if nseq < seq || (nseq == seq && noff < off) {
		tt.m.violation("%s: %s at %s answered Stream-Next-Offset %s, before it", s.name, how, offset, next)
		return false
	}
	if noff == 0 {
		s.seeTail(nseq)
	} else {
		s.seeTail(nseq + 1)
	}
	if s.json {
		return tt.recordDSJSON(s, offset, seq, data, nseq, noff, how)
	}
	if len(data) == 0 {
		return true
	}
	tt.m.servedBytes.Add(int64(len(data)))
	if offset == "-1" && s.mayStartLate() {
		// Served from the first retained record, which a trim may have
		// moved: where these bytes begin is not known.
		return true
	}
	s.mu.Lock()
	if len(s.obs) < 400 {
		s.obs = append(s.obs, tObs{seq: seq, off: off, data: data,
			how: fmt.Sprintf("%s (served after %d kills)", how, tt.kills.Load())})
	} else {
		// Keep a bounded, changing sample.
		s.obs[rand.IntN(len(s.obs))] = tObs{seq: seq, off: off, data: data,
			how: fmt.Sprintf("%s (served after %d kills)", how, tt.kills.Load())}
	}
	s.mu.Unlock()
	return true
}

// ---- live readers

// tailer follows streams with Durable Streams long-polls, SSE, or Pico
// long-polls, moving to another stream when one goes away or closes.
func (tt *tTorture) tail(rng *rand.Rand, mode string) {
	for !tt.stopped() {
		s := tt.m.pick(rng, false)
		if s == nil {
			time.Sleep(200 * time.Millisecond)
			continue
		}
		deadline := time.Now().Add(time.Duration(5+rng.IntN(20)) * time.Second)
		switch mode {
		case "long-poll":
			tt.dsLongPoll(s, deadline)
		case "sse":
			tt.dsSSE(s, deadline)
		case "pico":
			tt.picoLongPoll(s, deadline)
		case "pico-sse":
			tt.picoSSE(rng, s, deadline)
		}
	}
}

func (tt *tTorture) goneOK(s *tStream, r *response) bool {
	if s.trimmedGone(r) {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return (r.status == http.StatusNotFound || r.status == http.StatusGone) && (s.deleting || s.ttl || (s.forkOf != nil && s.forkOf.ttl))
}

func (tt *tTorture) dsLongPoll(s *tStream, until time.Time) {
	offset := "-1"
	for time.Now().Before(until) && !tt.stopped() {
		r, err := tt.req(http.MethodGet, "/ds"+s.name, "live=long-poll&offset="+url.QueryEscape(offset), nil, nil, 10*time.Second)
		if err != nil || r.status >= 500 {
			time.Sleep(100 * time.Millisecond)
			continue
		}
		tt.m.polls.Add(1)
		switch r.status {
		case http.StatusOK:
			if !tt.recordDS(s, offset, r.body, r.next(), "long-poll") {
				return
			}
			offset = r.next()
		case http.StatusNoContent:
			if n := r.next(); n != "" {
				if offset != "-1" && n < offset {
					tt.m.violation("%s: long-poll at %s answered 204 with Stream-Next-Offset %s", s.name, offset, n)
				}
				offset = n
			}
			if r.header.Get("Stream-Closed") == "true" {
				return
			}
		default:
			if !tt.goneOK(s, r) {
				tt.m.violation("%s: long-poll at %s: %s", s.name, offset, r)
			}
			return
		}
	}
}

func (tt *tTorture) dsSSE(s *tStream, until time.Time) {
	offset := "-1"
	for time.Now().Before(until) && !tt.stopped() {
		ctx, cancel := context.WithDeadline(context.Background(), until)
		closed, gone := tt.sseOnce(ctx, s, &offset)
		cancel()
		if closed || gone {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (tt *tTorture) sseOnce(ctx context.Context, s *tStream, offset *string) (closed, gone bool) {
	cl, _ := tt.client()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, cl.base+"/ds"+s.name+"?live=sse&offset="+url.QueryEscape(*offset), nil)
	if err != nil {
		return false, true
	}
	resp, err := cl.hc.Do(req)
	if err != nil {
		return false, false
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		r := &response{status: resp.StatusCode, header: resp.Header, body: b}
		if resp.StatusCode >= 500 {
			return false, false
		}
		if !tt.goneOK(s, r) {
			tt.m.violation("%s: SSE at %s: %s", s.name, *offset, r)
		}
		return false, true
	}
	br := bufio.NewReader(resp.Body)
	var pending []byte
	havePending := false
	for {
		ev, err := readSSEEvent(br)
		if err != nil {
			return false, false
		}
		tt.m.sseEvents.Add(1)
		switch ev.event {
		case "data":
			if s.json {
				// One array per event: the messages of all of them
				// up to the control event, as one array.
				if pending, err = joinJSONArrays(pending, ev.data); err != nil {
					tt.m.violation("%s: SSE data of a JSON stream at %s: %v", s.name, *offset, err)
					return false, true
				}
			} else {
				pending = append(pending, ev.data...)
			}
			havePending = true
		case "control":
			var ctl sseControl
			if err := json.Unmarshal([]byte(ev.data), &ctl); err != nil {
				tt.m.violation("%s: SSE control %q: %v", s.name, ev.data, err)
				return false, true
			}
			if havePending {
				if !tt.recordDS(s, *offset, pending, ctl.StreamNextOffset, "SSE") {
					return false, true
				}
			} else if ctl.StreamNextOffset != "" {
				if *offset != "-1" && ctl.StreamNextOffset < *offset {
					tt.m.violation("%s: SSE control at %s names %s, before it", s.name, *offset, ctl.StreamNextOffset)
				}
			}
			pending, havePending = nil, false
			if ctl.StreamNextOffset != "" {
				*offset = ctl.StreamNextOffset
			}
			if ctl.StreamClosed {
				return true, false
			}
		}
	}
}

func (tt *tTorture) picoLongPoll(s *tStream, until time.Time) {
	seq := uint64(0)
	for time.Now().Before(until) && !tt.stopped() {
		r, err := tt.req(http.MethodGet, "/pico"+s.name, fmt.Sprintf("seq=%d&live=long-poll&format=json", seq), nil, nil, 10*time.Second)
		if err != nil || r.status >= 500 {
			time.Sleep(100 * time.Millisecond)
			continue
		}
		tt.m.picoPolls.Add(1)
		switch r.status {
		case http.StatusOK:
			var recs []picoRecord
			if err := json.Unmarshal(r.body, &recs); err != nil {
				tt.m.violation("%s: Pico long-poll at %d: %v", s.name, seq, err)
				return
			}
			for _, rec := range recs {
				if !tt.knowPicoRecord(s, rec, "Pico long-poll") {
					return
				}
				seq = rec.Seq + 1
			}
			if n, err := strconv.ParseUint(r.header.Get("Pico-Next-Seq"), 10, 64); err == nil {
				if n < seq {
					tt.m.violation("%s: Pico long-poll: Pico-Next-Seq %d below records up to %d", s.name, n, seq)
				}
				s.seeTail(n)
				seq = n
			}
		case http.StatusNoContent:
			if r.header.Get("Pico-Closed") == "true" {
				return
			}
		default:
			if !tt.goneOK(s, r) {
				tt.m.violation("%s: Pico long-poll at %d: %s", s.name, seq, r)
			}
			return
		}
	}
}

// ---- checks

// check verifies every fact recorded so far, stream by stream, while the
// load goes on. final adds the exactly-once check of every body, which
// needs the load stopped.
func (tt *tTorture) check(final bool) (checkedRecs, checkedObs, checkedStreams int) {
	streams := tt.m.all()
	var mu sync.Mutex
	var wg sync.WaitGroup
	work := make(chan *tStream)
	for i := 0; i < 3; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for s := range work {
				r, o, ok := tt.checkStream(s, final)
				mu.Lock()
				checkedRecs += r
				checkedObs += o
				if ok {
					checkedStreams++
				}
				mu.Unlock()
			}
		}()
	}
	for _, s := range streams {
		work <- s
	}
	close(work)
	wg.Wait()
	return
}

func (tt *tTorture) checkStream(s *tStream, final bool) (nRecs, nObs int, ok bool) {
	m := tt.m
	// Facts first, then the stream: anything recorded later is newer.
	s.mu.Lock()
	if !s.created {
		s.mu.Unlock()
		return 0, 0, false
	}
	recs := make(map[uint64]tRec, len(s.recs))
	for k, v := range s.recs {
		recs[k] = v
	}
	obs := append([]tObs(nil), s.obs...)
	maxTail, closedAt, deleted, trimAcked, tailHow := s.maxTail, s.closedAt, s.deleted, s.trimAcked, s.tailHow
	ttl := s.ttl || (s.forkOf != nil && s.forkOf.ttl)
	bodies := map[string]int{}
	for k, v := range s.bodies {
		bodies[k] = v
	}
	s.mu.Unlock()

	head, _ := tt.settle(http.MethodHead, "/ds"+s.name, nil, nil, 60*time.Second)
	if head == nil {
		m.violation("%s: HEAD not answered within 60s after a restart", s.name)
		return 0, 0, false
	}
	// A delete may have begun since the facts were taken.
	nowDeleting := func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.deleting
	}
	switch {
	case head.status == http.StatusNotFound || head.status == http.StatusGone:
		if !deleted && !nowDeleting() && !ttl {
			m.violation("%s: %d after a restart, though it was never deleted and has no TTL (%d records known)", s.name, head.status, len(recs))
		}
		return 0, 0, false
	case head.status != http.StatusOK:
		m.violation("%s: HEAD %s", s.name, head)
		return 0, 0, false
	case deleted:
		m.violation("%s: deleted (acknowledged) but HEAD is %s", s.name, head)
		return 0, 0, false
	}
	tail, _, okTail := parseDSOffset(head.next())
	if !okTail {
		m.violation("%s: HEAD without a tail: %v", s.name, head.header)
		return 0, 0, false
	}
	if tail < maxTail {
		m.violation("%s: tail %d after %d kills, but tail %d was handed out before%s", s.name, tail, tt.kills.Load(), maxTail, tailHow)
	}
	if closedAt >= 0 {
		if head.header.Get("Stream-Closed") != "true" {
			m.violation("%s: closed at %d (acknowledged) but HEAD says open at %d", s.name, closedAt, tail)
		} else if tail != uint64(closedAt) {
			m.violation("%s: closed at %d (acknowledged) but now closed at %d", s.name, closedAt, tail)
		}
	}
	need := maxTail
	if final {
		need = tail
	}
	// Where the records begin: a trim acknowledged is in force, one that
	// was not may or may not be, but never half of one.
	start, err := tt.checkStart(s, trimAcked)
	var got map[uint64][]byte
	metas := map[uint64]tMeta{}
	if err == nil {
		got, start, err = tt.readRecords(s, start, need, trimAcked, metas)
	}
	if err != nil {
		if errors.Is(err, errTortureGone) && (nowDeleting() || ttl) {
			return 0, 0, false
		}
		m.violation("%s: reading records below %d: %v", s.name, need, err)
		return 0, 0, false
	}
	for seq, want := range recs {
		if seq < start {
			continue // trimmed, by a trim checkStart found in order
		}
		have, ok := got[seq]
		nRecs++
		switch {
		case !ok:
			m.violation("%s: record %d (%s) is missing after %d kills (tail %d)", s.name, seq, want.how, tt.kills.Load(), tail)
		case !bytes.Equal(have, want.body):
			d := firstDiff(have, want.body)
			m.violation("%s: record %d (%s) reads differently after %d kills: at +%d was %s, now %s",
				s.name, seq, want.how, tt.kills.Load(), d, around(want.body, d), around(have, d))
		}
	}
	tt.checkMetas(s, start, recs, metas)
	for _, o := range obs {
		if o.seq < start {
			continue
		}
		nObs++
		var b []byte
		seq, off := o.seq, o.off
		for len(b) < len(o.data) {
			rec, ok := got[seq]
			if !ok {
				break
			}
			if off > uint64(len(rec)) {
				break
			}
			b = append(b, rec[off:]...)
			seq, off = seq+1, 0
		}
		if !bytes.HasPrefix(b, o.data) {
			d := firstDiff(b, o.data)
			m.violation("%s: offset %d_%d (%s) reads differently after %d kills: at +%d served %s, now %s",
				s.name, o.seq, o.off, o.how, tt.kills.Load(), d, around(o.data, d), around(b, d))
		}
	}
	if final {
		count := map[string]int{}
		for seq := start; seq < tail; seq++ {
			rec, ok := got[seq]
			if !ok {
				m.violation("%s: record %d missing from the final read (tail %d)", s.name, seq, tail)
				continue
			}
			count[recToken(rec)]++
		}
		// Below the start, bodies went with a trim: those whose seq is
		// known to be there, and on a trimmed stream those whose seq is
		// not known (a producer's retry answered as a duplicate).
		trimmed := map[string]bool{}
		for seq, rec := range recs {
			if seq < start {
				trimmed[recToken(rec.body)] = true
			}
		}
		placed := map[string]bool{}
		for _, rec := range recs {
			placed[recToken(rec.body)] = true
		}
		// A fork's records below its point are its source's.
		own := func(tok string) bool {
			return strings.HasPrefix(tok, strings.TrimPrefix(s.name, "/torture/")+"/")
		}
		for tok, n := range count {
			state, known := bodies[tok]
			switch {
			case !own(tok):
				// inherited from the source; checked there and by recs
			case !known:
				m.violation("%s: holds %d copies of %q, which nobody sent to it", s.name, n, tok)
			case n > 1:
				m.violation("%s: holds %d copies of %q (state %d)", s.name, n, tok, state)
			case state == tBodyAbsent:
				m.violation("%s: holds %q, whose append was refused", s.name, tok)
			}
		}
		for tok, state := range bodies {
			if trimmed[tok] || (start > 0 && !placed[tok]) {
				continue
			}
			if state == tBodyAcked && count[tok] == 0 {
				m.violation("%s: acknowledged body %q is not in the stream", s.name, tok)
			}
		}
	} else {
		tt.probeStreamSeq(s)
	}
	return nRecs, nObs, true
}

// ---- the run

// tortureEngine picks a run's engine settings: each seed another corner,
// all of them keeping compaction, packs and the cache busy.
func tortureEngine(rng *rand.Rand) []string {
	pickOne := func(opts ...string) string { return opts[rng.IntN(len(opts))] }
	engine := []string{
		pickOne("cache_size 16KiB", "cache_size 256KiB", "cache_size 4MiB"),
		pickOne("flush_interval 5ms", "flush_interval 20ms"),
		pickOne("compact_interval 300ms", "compact_interval 700ms", "compact_interval 2s"),
		pickOne("pack_below 32KiB", "pack_below 256KiB", "pack_below off"),
		"s3_timeout 5s", "expiry_sweep_interval 1s", "long_poll_timeout 1500ms",
	}
	if rng.IntN(3) == 0 {
		engine = append(engine, "flush_quiet 1ms")
	}
	return overrideEngine(engine, os.Getenv("PICOMQ_TORTURE_ENGINE"))
}

// overrideEngine replaces the settings of engine named in spec (directives
// separated by ";", as a run logs them) by spec's, and adds the others, so
// that a corner a failure came from can be run again and again.
func overrideEngine(engine []string, spec string) []string {
	for _, d := range strings.Split(spec, ";") {
		d = strings.TrimSpace(d)
		if d == "" {
			continue
		}
		name, _, _ := strings.Cut(d, " ")
		engine = slices.DeleteFunc(engine, func(e string) bool { return strings.HasPrefix(e, name+" ") || e == name })
		engine = append(engine, d)
	}
	return engine
}

// startLoad starts the torture's workers and live readers on tt, each with
// a generator of its own drawn from seed; they run until tt's stop closes.
func startLoad(tt *tTorture, seed uint64, wg *sync.WaitGroup) {
	for i := 0; i < 8; i++ {
		w := &tWorker{tt: tt, id: i, rng: rand.New(rand.NewPCG(seed+uint64(i)+1, 7))}
		wg.Add(1)
		go func() { defer wg.Done(); w.run() }()
	}
	for i, mode := range []string{"long-poll", "long-poll", "sse", "sse", "pico", "pico", "pico-sse", "pico-sse"} {
		r := rand.New(rand.NewPCG(seed+uint64(i)+100, 11))
		wg.Add(1)
		go func() { defer wg.Done(); tt.tail(r, mode) }()
	}
}

// tortureCaddyfile serves storage through both protocols, /ds and /pico,
// with the engine settings given.
func tortureCaddyfile(storage string, engine []string) string {
	block := func(extra ...string) string {
		var b strings.Builder
		fmt.Fprintf(&b, "\t\tpicomq {\n\t\t\tstorage %q\n", storage)
		for _, d := range append(append([]string(nil), engine...), extra...) {
			fmt.Fprintf(&b, "\t\t\t%s\n", d)
		}
		b.WriteString("\t\t}\n")
		return b.String()
	}
	global := "\tpersist_config off\n"
	if os.Getenv(caddytest.KeepEnv) != "" {
		// Kept for a failure's post-mortem: the engine's debug log too.
		global += "\tlog default {\n\t\texclude picomq\n\t}\n\tlog picomq {\n\t\tlevel DEBUG\n\t\tinclude picomq\n\t}\n"
	}
	return "{\n" + global + "}\n\nhttp://:{$" + caddytest.PortEnv + "} {\n\tbind 127.0.0.1\n" +
		"\thandle_path /ds/* {\n" + block("sse_reconnect_interval 3s") + "\t}\n" +
		"\thandle_path /pico/* {\n" + block("protocol pico") + "\t}\n}\n"
}

// tortureLength reads PICOMQ_TORTURE (skipping the test without it) and
// the seed, which it logs.
func tortureLength(t *testing.T) (time.Duration, uint64, *rand.Rand) {
	t.Helper()
	spec := os.Getenv("PICOMQ_TORTURE")
	if spec == "" {
		t.Skip("a long randomized crash run: set PICOMQ_TORTURE=10m (the load phase's length) to run it")
	}
	length, err := time.ParseDuration(spec)
	if err != nil {
		t.Fatalf("PICOMQ_TORTURE: %v", err)
	}
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("PICOMQ_TORTURE_SEED"); s != "" {
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			t.Fatalf("PICOMQ_TORTURE_SEED: %v", err)
		}
	}
	t.Logf("random seed %d (PICOMQ_TORTURE_SEED)", seed)
	return length, seed, rand.New(rand.NewPCG(seed, seed^0x5bd1e995))
}

func TestCrashTorture(t *testing.T) {
	length, seed, rng := tortureLength(t)

	storage, env, px := tortureStorage(t) // px is nil on file://
	pickEngine := func() []string { return tortureEngine(rng) }
	config := func(engine []string) string { return tortureCaddyfile(storage, engine) }
	engine := pickEngine()
	t.Logf("engine settings: %s", strings.Join(engine, "; "))
	caddyfile := config(engine)
	// Reloads load this config again, or one whose engine settings were
	// picked again, which the running engine takes on without a restart.
	reloads := []string{caddyfile, config(pickEngine())}
	c := caddytest.Start(t, caddytest.Options{Caddyfile: caddyfile, Env: env, ReadyTimeout: 90 * time.Second})
	if px != nil {
		if rng.IntN(3) == 0 {
			px.SetLatency(10*time.Millisecond, 30*time.Millisecond) // a distant bucket
		} else {
			px.SetLatency(time.Millisecond, 4*time.Millisecond)
		}
		px.AddFault(testenv.Fault{Status: http.StatusServiceUnavailable, Rate: 0.01})
		// Now and then a write lands but its answer is lost: the engine
		// must find out what it stored.
		px.AddFault(testenv.Fault{Op: testenv.OpPut, Status: http.StatusServiceUnavailable, AfterForward: true, Rate: 0.005})
	}

	cl := newClient(t, c.URL(), true)
	tt := &tTorture{tRun: &tRun{t: t, m: &tModel{}, stop: make(chan struct{}), nodes: []*dsClient{cl}}, c: c, cl: cl, reloads: reloads}
	tt.churn = rng.IntN(2) == 0
	if v := os.Getenv("PICOMQ_TORTURE_CHURN"); v != "" {
		tt.churn = v == "1"
	}
	t.Logf("stream churn: %v", tt.churn)
	var wg sync.WaitGroup
	var stopOnce sync.Once
	stopLoad := func() { stopOnce.Do(func() { close(tt.stop) }); wg.Wait() }
	t.Cleanup(stopLoad)
	startLoad(tt, seed, &wg)

	holds := []testenv.Fault{
		{Op: testenv.OpPut, KeyContains: "/wal/", Times: 1},
		{Op: testenv.OpPut, KeyContains: "/data/", Times: 1},
		{Op: testenv.OpPut, KeyContains: "/pack/", Times: 1},
		{Op: testenv.OpPut, KeyContains: "/blob/", Times: 1},
		{Op: testenv.OpPut, KeyContains: "/streams/", Times: 1},
		{Op: testenv.OpPut, KeyContains: "/manifest", Times: 1},
		{Op: testenv.OpDelete, KeyContains: "/wal/", Times: 1},
		{Op: testenv.OpPut, KeyContains: "/wal/"}, // every WAL upload from now until the kill
		{Op: testenv.OpDelete, KeyContains: "/data/", Times: 1},
		{Op: testenv.OpPut, KeyContains: "/gc/", Times: 1},
		{Op: testenv.OpPut, KeyContains: "/expiry/", Times: 1},
		{Op: testenv.OpDelete, KeyContains: "/streams/", Times: 1},
	}
	// Requests a start-up makes: the lease, the manifest, reading the
	// WAL it replays, sealing and compacting what it found.
	startHolds := []testenv.Fault{
		{Op: testenv.OpPut, KeyContains: "/lease", Times: 1},
		{Op: testenv.OpPut, KeyContains: "/manifest", Times: 1},
		{Op: testenv.OpGet, KeyContains: "/wal/", Times: 1},
		{Op: testenv.OpList, KeyContains: "/wal/", Times: 1},
		{Op: testenv.OpGet, KeyContains: "/manifest", Times: 1},
	}
	began := time.Now()
	var kills, heldKills, checks int
	var killKinds = map[string]int{}
	endings := map[string]int{}
	// A reload of the same configuration works before it is cut short.
	reloadBegan := time.Now()
	if err := tt.reload(tt.reloads[1]); err != nil {
		t.Fatalf("reload of the running configuration: %v", err)
	}
	t.Logf("a reload under the load took %s", time.Since(reloadBegan).Round(time.Millisecond))
	var totalRecs, totalObs int
	for time.Since(began) < length && !t.Failed() {
		gap := 500*time.Millisecond + time.Duration(rng.Int64N(int64(5*time.Second)))
		if rng.IntN(6) == 0 {
			gap = time.Duration(rng.Int64N(int64(300 * time.Millisecond))) // right after the restart
		}
		time.Sleep(gap)
		var release func()
		kind := "plain"
		if rng.IntN(3) > 0 && px != nil {
			h := holds[rng.IntN(len(holds))]
			rel := px.Hold(h)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			err := px.WaitHeld(ctx, 1)
			cancel()
			if err != nil {
				rel()
			} else {
				time.Sleep(time.Duration(rng.Int64N(int64(200 * time.Millisecond))))
				release = rel
				kind = h.Op + " " + h.KeyContains
				if h.Times == 0 {
					kind += " (all)"
				}
				heldKills++
			}
		}
		if rng.IntN(2) == 0 {
			tt.inFlight(rng, &wg)
			time.Sleep(time.Duration(10+rng.IntN(40)) * time.Millisecond)
		}
		ending := tt.crash(rng)
		kills++
		killKinds[kind]++
		endings[ending]++
		tt.kills.Add(1)
		if release != nil {
			if rng.IntN(2) == 0 {
				release()
			} else {
				d := time.Duration(rng.Int64N(int64(700 * time.Millisecond)))
				wg.Add(1)
				go func() { defer wg.Done(); time.Sleep(d); release() }()
			}
		}
		time.Sleep(time.Duration(rng.Int64N(int64(400 * time.Millisecond))))
		if startKill := rng.IntN(5) == 0; startKill && px == nil {
			// No proxy to hold a request with: kill the next process
			// at a random moment of its start-up.
			if tt.killInStartUp(rng) {
				killKinds["start-up"]++
			} else {
				killKinds["just after start-up"]++
			}
			kills++
			tt.kills.Add(1)
		} else if startKill {
			// Kill the next process during its start-up: while its
			// recovery waits on a held request of the kind picked.
			h := startHolds[rng.IntN(len(startHolds))]
			rel := px.Hold(h)
			started := make(chan error, 1)
			go func() { started <- c.TryRestart() }()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			err := px.WaitHeld(ctx, 1)
			cancel()
			if err == nil {
				time.Sleep(time.Duration(rng.Int64N(int64(100 * time.Millisecond))))
				c.Kill()
				kills++
				killKinds["start-up, "+h.Op+" "+h.KeyContains]++
				tt.kills.Add(1)
			}
			rel()
			<-started // an error when the kill came first
			time.Sleep(time.Duration(rng.Int64N(int64(200 * time.Millisecond))))
		}
		if err := c.TryRestart(); err != nil {
			t.Fatalf("restart after kill %d (%s): %v", kills, kind, err)
		}
		if rng.IntN(2) == 0 {
			// Check now, while the load goes on.
			r, o, _ := tt.check(false)
			totalRecs += r
			totalObs += o
			checks++
			if n := tt.m.violations.Load(); n > 0 {
				t.Errorf("violations after kill %d (%s)", kills, kind)
				break
			}
		}
	}
	loadTook := time.Since(began)
	stopLoad()
	// Let the last incarnation settle (answers in flight, compaction).
	time.Sleep(2 * time.Second)
	// The last incarnation too refuses every acknowledged Stream-Seq again.
	for _, s := range tt.m.all() {
		s.mu.Lock()
		created := s.created
		s.mu.Unlock()
		if created {
			tt.probeStreamSeq(s)
		}
	}
	r, o, n := tt.check(true)
	totalRecs += r
	totalObs += o
	for _, v := range replayAnomalies(c.Logs()) {
		tt.m.violation("%s", v)
	}
	for _, v := range tt.m.vlist {
		t.Error(v)
	}
	m := tt.m
	t.Logf("load %s: kills %d (%d while an upload was held: %v; ended by: %v), checks %d during the load and one at the end",
		loadTook.Round(time.Second), kills, heldKills, killKinds, endings, checks)
	t.Logf("streams %d (checked at the end %d): creates %d, forks %d, closes %d, deletes %d; appends acked: DS %d, DS producer %d, Pico batches %d (%d large); no answer %d, refused %d; stale producer epochs fenced %d",
		len(m.all()), n, m.creates.Load(), m.forks.Load(), m.closes.Load(), m.deletes.Load(), m.appends.Load(), m.producerAppends.Load(),
		m.picoAppends.Load(), m.large.Load(), m.noAnswer.Load(), m.refused.Load(), m.fenced.Load())
	t.Logf("JSON streams %d (messages served by DS reads are in the facts); trims acked %d (each followed by a read below it) unanswered %d; Stream-Seq appends acked %d, refused as out of order %d, stale ones refused %d",
		m.jsonStreams.Load(), m.trims.Load(), m.trimsLost.Load(), m.seqAppends.Load(), m.seqRefused.Load(), m.seqProbes.Load())
	t.Logf("reads: catch-up %d, long-polls %d, SSE events %d, Pico long-polls %d, bytes served %d; facts checked: records %d, served ranges %d",
		m.reads.Load(), m.polls.Load(), m.sseEvents.Load(), m.picoPolls.Load(), m.servedBytes.Load(), totalRecs, totalObs)
	tt.logPico()
	if px == nil {
		return
	}
	counts := px.Counts()
	t.Logf("S3 through the proxy: PUT %d (data %d, pack %d, blob %d), GET %d, LIST %d, DELETE %d",
		counts.Put, counts.PutsUnder(caddytest.S3Prefix+"/data/"), counts.PutsUnder(caddytest.S3Prefix+"/pack/"),
		counts.PutsUnder(caddytest.S3Prefix+"/blob/"), counts.Get, counts.List, counts.Delete)
}
