package integration

// The crash torture's (torture_test.go) workers and checks for trims,
// Stream-Seq, JSON-mode streams, and the ways its Caddy process ends
// besides a plain SIGKILL: during a config reload, and in a graceful
// shutdown cut short.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// ---- stream helpers

func (s *tStream) contentType() string {
	if s.json {
		return "application/json"
	}
	return textPlain
}

// mayStartLate reports whether the stream's first retained record may be
// past seq 0: it was trimmed, or forked from a stream that was.
func (s *tStream) mayStartLate() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.trimSent > 0
}

// trimmedGone reports whether r is the 410 of a read below the records a
// trim left, on a stream that somebody trimmed.
func (s *tStream) trimmedGone(r *response) bool {
	return r.status == http.StatusGone && bytes.Contains(r.body, []byte("trimmed")) && s.mayStartLate()
}

// jsonString makes a torture body (letters, digits, '/', '|') a JSON string.
func jsonString(b []byte) []byte {
	out := make([]byte, 0, len(b)+2)
	out = append(out, '"')
	out = append(out, b...)
	return append(out, '"')
}

// recToken is the token a record's body starts with, in a JSON string or not.
func recToken(b []byte) string {
	tok, _, _ := bytes.Cut(bytes.TrimPrefix(b, []byte(`"`)), []byte("|"))
	return string(tok)
}

// joinJSONArrays appends the messages of the JSON array data to the array
// pending (nil for none yet), as one array.
func joinJSONArrays(pending []byte, data string) ([]byte, error) {
	var msgs []json.RawMessage
	if err := json.Unmarshal([]byte(data), &msgs); err != nil {
		return nil, fmt.Errorf("not a JSON array: %w: %s", err, fhClip(data, 80))
	}
	if len(msgs) == 0 {
		return pending, nil
	}
	if pending == nil {
		pending = []byte("[]")
	}
	out := append([]byte(nil), pending[:len(pending)-1]...)
	for i, msg := range msgs {
		if len(out) > 1 || i > 0 {
			out = append(out, ',')
		}
		out = append(out, msg...)
	}
	return append(out, ']'), nil
}

// tPayload is the body of one Durable Streams append and the records it
// makes: the body itself, or a JSON stream's messages.
type tPayload struct {
	body []byte
	toks []string
	msgs [][]byte
}

func (p tPayload) set(s *tStream, state int) {
	for _, tok := range p.toks {
		s.setBody(tok, state)
	}
}

// dsPayload makes an append's body for s (size 0 picks a size): for a
// JSON stream one to three messages, mostly as an array, now and then
// with the blanks a client may send, which the stream drops.
func (w *tWorker) dsPayload(s *tStream, size int) tPayload {
	if size == 0 {
		size = w.size()
	}
	if !s.json {
		tok := w.token(s)
		b := tortureBody(w.rng, tok, size)
		return tPayload{body: b, toks: []string{tok}, msgs: [][]byte{b}}
	}
	var p tPayload
	k := 1 + w.rng.IntN(3)
	for i := 0; i < k; i++ {
		tok := w.token(s)
		if i > 0 {
			size = 20 + w.rng.IntN(100)
		}
		p.toks = append(p.toks, tok)
		p.msgs = append(p.msgs, jsonString(tortureBody(w.rng, tok, size)))
	}
	switch {
	case k == 1 && w.rng.IntN(2) == 0:
		p.body = p.msgs[0] // a single value: one message
	case w.rng.IntN(3) == 0:
		p.body = append(append([]byte("[ "), bytes.Join(p.msgs, []byte(",\n  "))...), " ]\n"...)
	default:
		p.body = append(append([]byte("["), bytes.Join(p.msgs, []byte(","))...), ']')
	}
	return p
}

// recordDSJSON records the messages of a JSON stream's Durable Streams
// read at offset (seq): the array's last message is the one before the
// next offset, so they are placed even when the read began at the first
// retained record (offset -1) of a trimmed stream.
func (tt *tTorture) recordDSJSON(s *tStream, offset string, seq uint64, data []byte, nseq, noff uint64, how string) bool {
	if noff != 0 {
		tt.m.violation("%s: %s of a JSON stream at %s: Stream-Next-Offset %d_%d is inside a message", s.name, how, offset, nseq, noff)
		return false
	}
	if len(data) == 0 {
		return true
	}
	var msgs []json.RawMessage
	if err := json.Unmarshal(data, &msgs); err != nil {
		tt.m.violation("%s: %s of a JSON stream at %s is no JSON array: %v: %s", s.name, how, offset, err, clipB(data))
		return false
	}
	k := uint64(len(msgs))
	// Where the messages begin is known unless the read began at the
	// first retained record of a stream a trim may have moved it on.
	placed := offset != "-1" || !s.mayStartLate()
	if k > nseq || (placed && nseq-k != seq) {
		tt.m.violation("%s: %s of a JSON stream at %s: %d messages up to Stream-Next-Offset %d", s.name, how, offset, k, nseq)
		return false
	}
	tt.m.servedBytes.Add(int64(len(data)))
	for i, msg := range msgs {
		q := nseq - k + uint64(i)
		if p := s.knowRec(q, bytes.Clone(msg), fmt.Sprintf("DS %s of a JSON stream (served after %d kills)", how, tt.kills.Load())); p != "" {
			tt.m.violation("%s", p)
		}
	}
	return true
}

// ---- trims

// trim cuts a stream (Pico-Trim-Seq) at a point no further than half-way
// from its last acknowledged trim to the highest tail handed out, so that
// records stay to check; some trims are sent once, others until answered,
// and those sent in the moment before a kill (once) only.
func (w *tWorker) trim(once bool) {
	tt, m := w.tt, w.tt.m
	s := m.pick(w.rng, false)
	if s == nil {
		return
	}
	s.mu.Lock()
	lo, hi := s.trimAcked, s.maxTail
	if hi < lo+2 {
		s.mu.Unlock()
		return
	}
	n := lo + 1 + uint64(w.rng.Int64N(int64((hi-lo)/2)))
	// Known before it is sent: from now on the stream may start here.
	s.starts[n] = true
	s.trimSent = max(s.trimSent, n)
	s.mu.Unlock()
	hdr := map[string]string{"Pico-Trim-Seq": strconv.FormatUint(n, 10)}
	var r *response
	if once || w.rng.IntN(3) == 0 {
		var err error
		r, err = tt.req(http.MethodPost, "/pico"+s.name, "", hdr, nil, 30*time.Second)
		if err != nil || r.status >= 500 {
			m.noAnswer.Add(1)
			m.trimsLost.Add(1)
			return
		}
	} else if r, _ = tt.settle(http.MethodPost, "/pico"+s.name, hdr, nil, 90*time.Second); r == nil {
		m.trimsLost.Add(1)
		return
	}
	if r.status != http.StatusOK {
		w.expectRefusal(s, r, fmt.Sprintf("trim to %d", n))
		return
	}
	start, err := strconv.ParseUint(r.header.Get("Pico-Start-Seq"), 10, 64)
	if err != nil || start < n {
		m.violation("%s: trim to %d acknowledged with Pico-Start-Seq %q", s.name, n, r.header.Get("Pico-Start-Seq"))
	}
	if next, err := strconv.ParseUint(r.header.Get("Pico-Next-Seq"), 10, 64); err == nil {
		s.seeTail(next)
	}
	m.trims.Add(1)
	s.mu.Lock()
	s.trimAcked = max(s.trimAcked, n)
	s.mu.Unlock()
	// Gone at once, not at the next compaction.
	if err := tt.readBelow(s, n); err != nil {
		m.violation("%s: after the trim to %d was acknowledged, %v", s.name, n, err)
	}
}

// readBelow reads the record before start, which a trim took: 410, or
// for seq 0 (which means "from the first record a trim left") records
// from start on.
func (tt *tTorture) readBelow(s *tStream, start uint64) error {
	r, err := tt.req(http.MethodGet, "/pico"+s.name, fmt.Sprintf("seq=%d&format=json", start-1), nil, nil, 20*time.Second)
	if err != nil || r.status != http.StatusOK {
		return nil
	}
	var recs []picoRecord
	if err := json.Unmarshal(r.body, &recs); err != nil {
		return fmt.Errorf("a read at %d: %v", start-1, err)
	}
	if start-1 > 0 || (len(recs) > 0 && recs[0].Seq < start) {
		return fmt.Errorf("record %d, below the start %d, reads after %d kills: %s", start-1, start, tt.kills.Load(), r)
	}
	return nil
}

// checkStart finds where s begins (Pico-Start-Seq) and checks it: not
// below a trim acknowledged (trimAcked, taken before), and at a point a
// trim was sent for (or 0), so that no trim happened by half; the record
// before it is gone.
func (tt *tTorture) checkStart(s *tStream, trimAcked uint64) (uint64, error) {
	r, _ := tt.settle(http.MethodHead, "/pico"+s.name, nil, nil, 60*time.Second)
	switch {
	case r == nil:
		return 0, errors.New("Pico HEAD not answered within 60s")
	case r.status == http.StatusNotFound || r.status == http.StatusGone:
		return 0, fmt.Errorf("%w: Pico HEAD %d", errTortureGone, r.status)
	case r.status != http.StatusOK:
		return 0, fmt.Errorf("Pico HEAD: %s", r)
	}
	start, err1 := strconv.ParseUint(r.header.Get("Pico-Start-Seq"), 10, 64)
	next, err2 := strconv.ParseUint(r.header.Get("Pico-Next-Seq"), 10, 64)
	if err1 != nil || err2 != nil || start > next {
		return 0, fmt.Errorf("Pico HEAD: Pico-Start-Seq %q, Pico-Next-Seq %q",
			r.header.Get("Pico-Start-Seq"), r.header.Get("Pico-Next-Seq"))
	}
	if err := tt.validStart(s, start, trimAcked); err != nil {
		return 0, err
	}
	if start > 0 {
		if err := tt.readBelow(s, start); err != nil {
			return 0, err
		}
	}
	return start, nil
}

// validStart checks a start against the trims known now.
func (tt *tTorture) validStart(s *tStream, start, trimAcked uint64) error {
	s.mu.Lock()
	known := s.starts[start]
	s.mu.Unlock()
	switch {
	case start < trimAcked:
		return fmt.Errorf("starts at %d after %d kills, below the trim to %d that was acknowledged: trimmed records came back",
			start, tt.kills.Load(), trimAcked)
	case !known:
		return fmt.Errorf("starts at %d after %d kills, where no trim was sent", start, tt.kills.Load())
	}
	return nil
}

var errTortureGone = errors.New("stream gone")

// readRecords reads records [from, need) (at least) through Pico JSON
// reads. A trim that moves the start past the read meanwhile is followed
// (the new start checked like the first); it returns the start it ended
// with.
// metas (when not nil) gets what the reads show of each record besides
// its body.
func (tt *tTorture) readRecords(s *tStream, from, need, trimAcked uint64, metas map[uint64]tMeta) (map[uint64][]byte, uint64, error) {
	got := map[uint64][]byte{}
	seq := from
	deadline := time.Now().Add(2 * time.Minute)
	for seq < need {
		if time.Now().After(deadline) {
			return got, from, fmt.Errorf("not done within 2 minutes, at seq %d", seq)
		}
		r, err := tt.req(http.MethodGet, "/pico"+s.name, fmt.Sprintf("seq=%d&format=json&bytes=4194304", seq), nil, nil, 30*time.Second)
		if err != nil || r.status >= 500 {
			time.Sleep(100 * time.Millisecond)
			continue
		}
		if s.trimmedGone(r) {
			start, err := tt.checkStart(s, trimAcked)
			if err != nil {
				return got, from, err
			}
			if start <= seq {
				return got, from, fmt.Errorf("Pico read at %d: %s, but the stream starts at %d", seq, r, start)
			}
			from, seq = start, start
			continue
		}
		if r.status == http.StatusNotFound || r.status == http.StatusGone {
			return got, from, fmt.Errorf("%w: %s", errTortureGone, r)
		}
		if r.status != http.StatusOK {
			return got, from, fmt.Errorf("Pico read at %d: %s", seq, r)
		}
		var recs []picoRecord
		if err := json.Unmarshal(r.body, &recs); err != nil {
			return got, from, fmt.Errorf("Pico read at %d: %v", seq, err)
		}
		if len(recs) == 0 {
			return got, from, fmt.Errorf("Pico read at %d: no records, Pico-Next-Seq %s, below %d", seq, r.header.Get("Pico-Next-Seq"), need)
		}
		if seq == 0 && recs[0].Seq > 0 {
			// seq=0 reads from the first retained record, not a 410: a
			// trim landed since the start was checked. The start now
			// must be where the read began, or past it (another trim).
			start, err := tt.checkStart(s, trimAcked)
			if err != nil {
				return got, from, err
			}
			if start < recs[0].Seq {
				return got, from, fmt.Errorf("Pico read from the start: first record %d, but the stream starts at %d", recs[0].Seq, start)
			}
			from, seq = start, start
			continue
		}
		for _, rec := range recs {
			if rec.Seq != seq {
				return got, from, fmt.Errorf("Pico read: record seq %d where %d was next", rec.Seq, seq)
			}
			if rec.Body == nil {
				return got, from, fmt.Errorf("Pico read: record %d without a text body", rec.Seq)
			}
			got[rec.Seq] = []byte(*rec.Body)
			if metas != nil {
				metas[rec.Seq] = tMeta{hdrs: canonHeaders(rec.Headers), ts: rec.Timestamp}
			}
			seq++
		}
	}
	return got, from, nil
}

// ---- Stream-Seq

// seqAppend appends with the stream's next Stream-Seq. Workers race for a
// stream, so a value may arrive after a higher one: 409, and then a
// higher one must have been handed out.
func (w *tWorker) seqAppend() {
	tt, m := w.tt, w.tt.m
	s := m.pick(w.rng, true)
	if s == nil {
		return
	}
	s.mu.Lock()
	v := s.seqNext
	s.seqNext++
	s.mu.Unlock()
	p := w.dsPayload(s, 0)
	hdr := map[string]string{"Content-Type": s.contentType(), "Stream-Seq": fmt.Sprintf("%08d", v)}
	p.set(s, tBodyMaybe)
	r, err := tt.req(http.MethodPost, "/ds"+s.name, "", hdr, p.body, 30*time.Second)
	switch {
	case err != nil || r.status >= 500:
		m.noAnswer.Add(1)
	case r.status == http.StatusNoContent || r.status == http.StatusOK:
		m.seqAppends.Add(1)
		p.set(s, tBodyAcked)
		s.mu.Lock()
		s.seqAcked = max(s.seqAcked, v)
		s.mu.Unlock()
		w.ackDS(s, r, p, fmt.Sprintf("DS append with Stream-Seq %d", v))
	case r.status == http.StatusConflict && r.header.Get("Stream-Closed") != "true":
		p.set(s, tBodyAbsent)
		m.seqRefused.Add(1)
		s.mu.Lock()
		higher := s.seqNext > v+1
		s.mu.Unlock()
		if !higher {
			m.violation("%s: Stream-Seq %d refused (%s), though no higher one was ever sent", s.name, v, r)
		}
	default:
		p.set(s, tBodyAbsent)
		w.expectRefusal(s, r, "Stream-Seq append")
	}
}

// seqStale sends a Stream-Seq at or below one acknowledged, mostly after a
// kill or two: it must be refused, and never stored.
func (w *tWorker) seqStale() {
	s := w.tt.m.pick(w.rng, true)
	if s == nil {
		return
	}
	s.mu.Lock()
	acked := s.seqAcked
	s.mu.Unlock()
	if acked < 0 {
		return
	}
	if w.rng.IntN(2) == 0 {
		time.Sleep(time.Duration(w.rng.IntN(3000)) * time.Millisecond)
	}
	w.tt.sendStaleSeq(s, w.rng.IntN(acked+1), w.dsPayload(s, 40))
}

// probeStreamSeq sends the highest acknowledged Stream-Seq again: the check
// after a restart.
func (tt *tTorture) probeStreamSeq(s *tStream) {
	s.mu.Lock()
	acked, open := s.seqAcked, !s.closing && !s.deleting
	s.mu.Unlock()
	if acked < 0 || !open {
		return
	}
	tok := fmt.Sprintf("%s/check/%d", strings.TrimPrefix(s.name, "/torture/"), tt.probeN.Add(1))
	b := []byte(tok + "|seq-probe")
	if s.json {
		b = jsonString(b)
	}
	tt.sendStaleSeq(s, acked, tPayload{body: b, toks: []string{tok}, msgs: [][]byte{b}})
}

func (tt *tTorture) sendStaleSeq(s *tStream, v int, p tPayload) {
	m := tt.m
	hdr := map[string]string{"Content-Type": s.contentType(), "Stream-Seq": fmt.Sprintf("%08d", v)}
	p.set(s, tBodyMaybe)
	r, err := tt.req(http.MethodPost, "/ds"+s.name, "", hdr, p.body, 30*time.Second)
	switch {
	case err != nil || r.status >= 500:
		m.noAnswer.Add(1) // stored or not, at most once: a maybe
	case r.status < 300:
		s.mu.Lock()
		acked := s.seqAcked
		s.mu.Unlock()
		m.violation("%s: Stream-Seq %d accepted (%s) after %d kills, though %d was acknowledged", s.name, v, r, tt.kills.Load(), acked)
	case r.status == http.StatusConflict && r.header.Get("Stream-Closed") != "true":
		p.set(s, tBodyAbsent)
		m.seqProbes.Add(1)
	default:
		p.set(s, tBodyAbsent)
		(&tWorker{tt: tt}).expectRefusal(s, r, "stale Stream-Seq append")
	}
}

// ---- ways to end the process

// inFlight sends a trim, a Stream-Seq append and a JSON or text append,
// each once, on workers of their own, to be under way when the process
// ends: with an upload held, they wait in the batch it holds (or the next
// one), and whether it lands is left to the kill. wg tracks them.
func (tt *tTorture) inFlight(rng *rand.Rand, wg *sync.WaitGroup) {
	ops := []func(w *tWorker){
		func(w *tWorker) { w.trim(true) },
		func(w *tWorker) { w.seqAppend() },
		func(w *tWorker) { w.dsAppend(false) },
		func(w *tWorker) { w.picoOp() },
	}
	for _, op := range ops {
		w := &tWorker{tt: tt, id: 1000 + int(tt.spare.Add(1)), rng: rand.New(rand.NewPCG(rng.Uint64(), 13))}
		wg.Add(1)
		go func() { defer wg.Done(); op(w) }()
	}
}

// crash ends the running Caddy: mostly a plain SIGKILL, or a SIGKILL while
// a reload of the same configuration (POST /load) is under way, or a
// graceful shutdown (SIGTERM) that a SIGKILL cuts short unless it ends
// first. It returns what it did.
func (tt *tTorture) crash(rng *rand.Rand) string {
	switch r := rng.IntN(10); {
	case r < 3:
		done := make(chan error, 1)
		cfg := tt.reloads[rng.IntN(len(tt.reloads))]
		go func() { done <- tt.reload(cfg) }()
		// A reload takes milliseconds: mostly kill within them, or in
		// the new config's first moments.
		wait := 4 * time.Millisecond
		if rng.IntN(3) == 0 {
			wait = 600 * time.Millisecond
		}
		time.Sleep(time.Duration(rng.Int64N(int64(wait))))
		tt.c.Kill()
		if err := <-done; err == nil {
			return "kill after a reload"
		} else if !tt.killedAnswer(err) {
			tt.m.violation("reload of the same configuration refused: %v", err)
		}
		return "kill during a reload"
	case r < 5:
		if err := tt.c.StopTimeout(time.Duration(rng.Int64N(int64(400 * time.Millisecond)))); err == nil {
			return "graceful stop, completed"
		}
		return "graceful stop cut by a kill"
	default:
		tt.c.Kill()
		return "kill"
	}
}

// errReloadStatus is a reload that Caddy answered with an error status.
var errReloadStatus = errors.New("reload answered")

// killedAnswer reports whether a reload's error is the kill cutting it off
// rather than Caddy refusing the configuration.
func (tt *tTorture) killedAnswer(err error) bool { return !errors.Is(err, errReloadStatus) }

// reload loads caddyfile through the admin API, forced (Cache-Control:
// must-revalidate) so that Caddy replaces every module even when nothing
// changed, and waits for it to end. The file a restart runs stays as it
// was.
func (tt *tTorture) reload(caddyfile string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+tt.c.AdminAddr()+"/load",
		strings.NewReader(caddyfile))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "text/caddyfile")
	req.Header.Set("Cache-Control", "must-revalidate")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("POST /load: %w", err)
	}
	defer resp.Body.Close()
	b := make([]byte, 2048)
	n, _ := resp.Body.Read(b)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%w %d: %s", errReloadStatus, resp.StatusCode, b[:n])
	}
	return nil
}
