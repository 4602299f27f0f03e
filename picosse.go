package picomq

import (
	"bufio"
	"context"
	"errors"
	"net/http"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/internal/picowire"
	"github.com/picomq/caddy-picomq/streamstore"
)

// picoControl is the payload of a Pico SSE "control" event.
type picoControl struct {
	NextSeq  uint64 `json:"next_seq"`
	UpToDate bool   `json:"up_to_date"`
	Closed   bool   `json:"closed,omitempty"`
}

// appendPicoEvent appends one SSE event with an id. payload is JSON, which
// never holds a raw line break, so it is one data line.
func appendPicoEvent(b []byte, event string, id uint64, payload []byte) []byte {
	b = append(appendPicoEventHead(b, event, id), payload...)
	return append(b, "\n\n"...)
}

// appendPicoEventHead appends an event's lines up to its payload.
func appendPicoEventHead(b []byte, event string, id uint64) []byte {
	b = append(b, "event: "...)
	b = append(b, event...)
	b = append(b, "\nid: "...)
	b = strconv.AppendUint(b, id, 10)
	return append(b, "\ndata:"...)
}

// appendPicoControl appends a control event, with the same id as the data
// event it follows. Its three plain fields are written by hand, as
// json.Marshal of picoControl would: every feed writes one per wake-up.
func appendPicoControl(b []byte, c picoControl) []byte {
	var payload [64]byte
	p := append(payload[:0], `{"next_seq":`...)
	p = strconv.AppendUint(p, c.NextSeq, 10)
	p = append(p, `,"up_to_date":`...)
	p = strconv.AppendBool(p, c.UpToDate)
	if c.Closed {
		p = append(p, `,"closed":true`...)
	}
	return appendPicoEvent(b, "control", c.NextSeq, append(p, '}'))
}

// writePicoControl writes a control event.
func writePicoControl(w *bufio.Writer, c picoControl) error {
	_, err := w.Write(appendPicoControl(w.AvailableBuffer(), c))
	return err
}

// picoFrame is a page as the frame of a feed: its data event (the records
// as a JSON array, the shape of a JSON read, its id the seq to resume from)
// when it has records.
func picoFrame(pg picoPage, now time.Time) *sseFrame {
	f := &sseFrame{
		id:       pg.info.ID,
		start:    position{seq: pg.start},
		next:     position{seq: pg.next},
		tail:     pg.info.NextSeq,
		upToDate: pg.upToDate,
		closed:   pg.closed,
		made:     now,
	}
	if len(pg.records) > 0 {
		// The records are encoded in place: one buffer, one copy.
		f.data = picowire.AppendJSONRead(appendPicoEventHead(nil, "data", pg.next), pg.records)
		f.data = append(f.data, "\n\n"...)
	}
	return f
}

// picoFrameControl is the control event that follows frame f.
func picoFrameControl(f *sseFrame) picoControl {
	return picoControl{NextSeq: f.next.seq, UpToDate: f.upToDate || !f.hasData(), Closed: f.closed}
}

// picoHubSource is the hub source of Pico feeds of one stream and read
// limits. Pico control events carry no cursor, so every feed writes the
// same bytes.
type picoHubSource struct {
	p   *picoProtocol
	eng *streamstore.Engine
	key hubKey
}

func (s picoHubSource) frameAt(ctx context.Context, pos position, _ uint64) (*sseFrame, error) {
	pg, err := s.p.read(ctx, s.eng, s.key.name, picoReadQuery{seq: pos.seq, count: s.key.count, bytes: s.key.bytes})
	if err != nil {
		return nil, err
	}
	defer pg.release()
	return picoFrame(pg, time.Now()), nil
}

func (picoHubSource) variant(*sseFrame, string) string { return "" }

func (picoHubSource) encode(f *sseFrame, _ string) []byte {
	return appendPicoControl(append([]byte(nil), f.data...), picoFrameControl(f))
}

func (picoHubSource) writeTimeout() time.Duration { return feedWriteTimeout(0) }

// sse streams records as Server-Sent Events until the reconnect interval
// passes, the stream is closed and fully read, the client leaves or the
// server shuts down. Each data event is followed by a control event; a
// reader that is caught up gets one control event saying so.
func (p *picoProtocol) sse(w http.ResponseWriter, r *http.Request, eng *streamstore.Engine, name string, q picoReadQuery) {
	pg, err := p.read(writeContext(r), eng, name, q)
	if err != nil {
		p.engineError(w, r, err)
		return
	}
	defer func() { pg.release() }()
	id := pg.info.ID
	h := w.Header()
	h.Set("Content-Type", picoMediaSSE)
	h.Set("Cache-Control", cacheControlNoStore)
	// Pico events are written in many small pieces: gather them in a
	// buffer the size of a typical event.
	es, ok := startEventStream(w, r, 4<<10)
	if !ok {
		return
	}
	bw, flush := es.bw, es.flush

	deadline := liveDeadline(r, p.sseInterval)
	lw := newLiveWait(r, p.shutdown, deadline)
	defer lw.close()
	announced := false // a control event with up_to_date was sent for pg.next
	alone := false     // wait without the hub this once: it stopped
	// A feed's own write: the data event as it is (no copy of a large
	// one into a buffer first), then the control event.
	writeFrame := func(f *sseFrame) bool {
		_, err := bw.Write(f.data)
		return err == nil && writePicoControl(bw, picoFrameControl(f)) == nil && flush()
	}
	t := turn{gate: p.fanout, es: es}
	defer t.release()
	for {
		t.limitWrites()
		switch {
		case len(pg.records) > 0:
			if !writeFrame(picoFrame(pg, time.Now())) || pg.closed {
				return
			}
			announced = pg.upToDate
		case pg.closed:
			// Sealed and fully read: the last control event, then the end.
			writePicoControl(bw, picoControl{NextSeq: pg.next, UpToDate: true, Closed: true})
			flush()
			return
		case !pg.upToDate:
			p.log.Error("SSE read made no progress", zap.String("stream", name), zap.Error(errNoProgress))
			return
		case !announced:
			if writePicoControl(bw, picoControl{NextSeq: pg.next, UpToDate: true}) != nil || !flush() {
				return
			}
			announced = true
		}

		t.release()
		if p.shutdown.Err() != nil {
			p.finalControl(bw, pg, flush)
			return
		}
		remaining := time.Until(deadline)
		if remaining <= 0 {
			return // recycle: the client reconnects with Last-Event-ID
		}
		if pg.upToDate && !alone && p.hubs != nil {
			key := hubKey{name: name, id: id, count: q.count, bytes: q.bytes}
			next, ended := p.hubs.parkAtTail(lw, picoHubSource{p: p, eng: eng, key: key}, eng, key, position{seq: pg.next}, "", es, writeFrame)
			switch ended {
			case nil: // the hub is at another position: wait alone
			case errFeedLeft: // time is up, the client left or the server shuts down
				if p.shutdown.Err() != nil {
					p.finalControl(bw, picoPage{next: next.seq, upToDate: atTail(r.Context(), eng, name, id, next)}, flush)
				}
				return
			case errHubStopped:
				// Go on alone from where the hub left the feed, and meet
				// the reason (shutdown, deletion, a failed read) there.
				// The page read before parking goes back to its pool.
				pg.release()
				pg = picoPage{info: pg.info, start: next.seq, next: next.seq, upToDate: true}
				announced, alone = true, true
				continue
			default: // the write failed, or the stream closed and the hub said so
				return
			}
		}
		alone = false
		if pg.upToDate {
			info, err := lw.wait(eng, name, id, pg.next, keepAliveOr(p.sseKeepAlive))
			switch {
			case errors.Is(err, errKeepAlive):
				// Quiet all along: the control event again (not the
				// page already sent), as a parked feed gets it, and
				// then a try at the hub.
				pg.release()
				pg = picoPage{info: pg.info, start: pg.next, next: pg.next, upToDate: true}
				announced = false
				continue
			case errors.Is(err, errWaitOver):
				if p.shutdown.Err() != nil {
					p.finalControl(bw, pg, flush)
				}
				return
			case err != nil:
				if r.Context().Err() == nil && !feedOver(err) {
					p.log.Warn("SSE wait failed", zap.String("stream", name), zap.Error(err))
				}
				return // deleted or taken over: a reconnect reports it (404, 410 when soft, 503)
			case info.ID != id:
				return // deleted or recreated; a reconnect reports it
			}
		}
		next := picoReadQuery{seq: pg.next, count: q.count, bytes: q.bytes}
		if !t.take(r.Context()) {
			return
		}
		pg.release()
		if pg, err = p.read(writeContext(r), eng, name, next); err != nil {
			if errors.Is(err, streamstore.ErrDamaged) {
				es.endDamaged(err)
				return
			}
			if r.Context().Err() == nil && !feedOver(err) {
				p.log.Warn("SSE read failed", zap.String("stream", name), zap.Error(err))
			}
			return
		}
		if pg.info.ID != id {
			return
		}
		if len(pg.records) > 0 {
			announced = false
		}
	}
}

// finalControl tells an SSE client where it stands when the server ends the
// feed early (shutdown or reload); its reconnect resumes from the same id.
func (p *picoProtocol) finalControl(bw *bufio.Writer, pg picoPage, flush func() bool) {
	writePicoControl(bw, picoControl{NextSeq: pg.next, UpToDate: pg.upToDate})
	flush()
}
