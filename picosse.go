package picomq

import (
	"bufio"
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

// picoControl is the payload of a Pico SSE "control" event.
type picoControl struct {
	NextSeq  uint64 `json:"next_seq"`
	UpToDate bool   `json:"up_to_date"`
	Closed   bool   `json:"closed,omitempty"`
}

// writePicoEvent writes one SSE event with an id. payload is JSON, which
// never holds a raw line break, so it is one data line.
func writePicoEvent(w *bufio.Writer, event string, id uint64, payload []byte) error {
	w.WriteString("event: ")
	w.WriteString(event)
	w.WriteString("\nid: ")
	w.WriteString(strconv.FormatUint(id, 10))
	w.WriteString("\ndata:")
	w.Write(payload)
	_, err := w.WriteString("\n\n")
	return err
}

// writePicoData writes a data event: the records as a JSON array (the shape
// of a JSON read), its id the seq to resume from.
func writePicoData(w *bufio.Writer, next uint64, recs []streamstore.Record) error {
	return writePicoEvent(w, "data", next, picowire.AppendJSONRead(nil, recs))
}

// writePicoControl writes a control event with the same id as the data
// event it follows.
func writePicoControl(w *bufio.Writer, c picoControl) error {
	b, err := json.Marshal(c)
	if err != nil {
		return fmt.Errorf("encoding control event: %w", err)
	}
	return writePicoEvent(w, "control", c.NextSeq, b)
}

// sse streams records as Server-Sent Events until the reconnect interval
// passes, the stream is closed and fully read, the client leaves or the
// server shuts down. Each data event is followed by a control event; a
// reader that is caught up gets one control event saying so.
func (p *picoProtocol) sse(w http.ResponseWriter, r *http.Request, eng *streamstore.Engine, name string, q picoReadQuery) {
	pg, err := p.read(r.Context(), eng, name, q)
	if err != nil {
		p.engineError(w, r, err)
		return
	}
	id := pg.info.ID
	h := w.Header()
	h.Set("Content-Type", picoMediaSSE)
	h.Set("Cache-Control", cacheControlNoStore)
	// Pico events are written in many small pieces: gather them in a
	// buffer the size of a typical event.
	es, ok := startEventStream(w, 4<<10)
	if !ok {
		return
	}
	bw, flush := es.bw, es.flush

	deadline := time.Now().Add(p.sseInterval)
	lw := newLiveWait(r, p.shutdown, deadline)
	defer lw.close()
	announced := false // a control event with up_to_date was sent for pg.next
	t := turn{gate: p.fanout, es: es}
	defer t.release()
	for {
		t.limitWrites()
		switch {
		case len(pg.records) > 0:
			if writePicoData(bw, pg.next, pg.records) != nil {
				return
			}
			ctl := picoControl{NextSeq: pg.next, UpToDate: pg.upToDate, Closed: pg.closed}
			if writePicoControl(bw, ctl) != nil || !flush() || pg.closed {
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
		if pg.upToDate {
			info, err := lw.wait(eng, name, id, pg.next)
			switch {
			case errors.Is(err, errWaitOver):
				if p.shutdown.Err() != nil {
					p.finalControl(bw, pg, flush)
				}
				return
			case err != nil:
				if r.Context().Err() == nil {
					p.log.Warn("SSE wait failed", zap.String("stream", name), zap.Error(err))
				}
				return
			case info.ID != id:
				return // deleted or recreated; a reconnect reports it
			}
		}
		next := picoReadQuery{seq: pg.next, count: q.count, bytes: q.bytes}
		if !t.take(r.Context()) {
			return
		}
		if pg, err = p.read(r.Context(), eng, name, next); err != nil {
			if r.Context().Err() == nil {
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
