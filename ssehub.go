package picomq

import (
	"context"
	"errors"
	"net/http"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/picomq/caddy-picomq/streamstore"
)

// A feed at a stream's tail used to wait on its own goroutine, and every
// append woke all of them: thousands of goroutines made runnable at once,
// each handed from processor to processor, taking turns at the fan-out gate
// and parking again after one write. On a small machine the wake-ups cost
// more than the writes. Feeds that have caught up park in the stream's hub
// instead: one goroutine waits for the stream to move, reads the new
// records once and writes them to every parked feed, whose own goroutine
// sleeps until its feed needs it (its time is up, the client left, the
// server shuts down, a write failed, the stream closed or went away, or a
// write to it did not finish at once: see hubStallTick).

// sseHubs are the hubs of one handler, by stream and feed shape.
type sseHubs struct {
	mu   sync.Mutex
	hubs map[hubKey]*sseHub
	// stallTick is how often a pass looks for a write stuck on a client
	// (see sendAll); 0: hubStallTick. Tests whose writes block on purpose
	// set it long.
	stallTick time.Duration
	// keepAlive is how long parked feeds go without a write before the hub
	// writes them a control event; 0: hubKeepAlive.
	keepAlive time.Duration
}

// hubKeepAlive is Handler.SSEKeepAlive's default: how long a feed parked
// at a quiet stream's tail goes without a write before the hub writes
// every feed a control event, as if it had just caught up. Proxies and
// load balancers close connections idle for their own timeout (60 s at
// AWS's and nginx's defaults, 30 s at some), which would otherwise cut a
// feed before its sse_reconnect_interval, and the client would see a
// network error instead of the response's end.
const hubKeepAlive = 20 * time.Second

// hubKey tells hubs apart: feeds share a hub when they read the same
// stream the same way, so that one read serves them all. A Durable Streams
// feed's shape is its encoding, a Pico feed's its read limits.
type hubKey struct {
	name  string
	id    string
	enc   sseEncoding
	count int
	bytes int
}

// hubSource is what a hub needs from its protocol.
type hubSource interface {
	// frameAt reads the feeds' next frame from pos; they know the stream's
	// tail to be at least tail.
	frameAt(ctx context.Context, pos position, tail uint64) (*sseFrame, error)
	// variant names what a feed with cursor writes for f: feeds with the
	// same variant write the same bytes.
	variant(f *sseFrame, cursor string) string
	// encode is what feeds of variant v write for f: its data event, if
	// any, and the control event after it.
	encode(f *sseFrame, v string) []byte
	// writeTimeout bounds one write to one feed.
	writeTimeout() time.Duration
}

// sseHub serves the feeds parked at one stream's tail.
type sseHub struct {
	hubs *sseHubs
	src  hubSource
	eng  *streamstore.Engine
	key  hubKey

	mu     sync.Mutex
	next   position // where the parked feeds are
	feeds  map[*hubFeed]struct{}
	cancel context.CancelFunc // ends the hub's wait once no feed is left
	gen    uint64             // the run that serves the feeds; an older one bows out
	done   bool               // the hub has stopped; it takes no feeds
}

// hubFeed is a feed parked in a hub. While parked, the hub writes to it;
// mu is held by whoever writes.
type hubFeed struct {
	mu    sync.Mutex
	es    *eventStream
	write func(f *sseFrame) bool // f's events as the feed writes them, flushed; false: the client is gone
	// limit sets the connection's write deadline (zero: none).
	limit func(time.Time) error
	// direct, when set, is the response beneath Caddy's idle write timeout,
	// which the hub's writes skip (see skipIdleTimeout); directRC flushes it.
	direct   http.ResponseWriter
	directRC *http.ResponseController
	renewAt  time.Time // when the hub next pushes the deadline on
	// cursor goes in the feed's control events.
	cursor string
	next   position // where the feed is, after the hub's writes
	// closeSent: the hub wrote the feed the stream's closing events.
	closeSent bool
	ended     error         // why the hub let the feed go; nil while parked
	done      chan struct{} // closed when ended is set
}

// Reasons a hub lets a feed go.
var (
	errFeedLeft   = errors.New("feed left the hub")
	errFeedBroken = errors.New("write to the feed failed")
	errFeedClosed = errors.New("stream closed; final events written")
	errHubStopped = errors.New("hub stopped") // the feed goes on by itself
)

// park hands a feed at pos, with everything up to there written, to the
// hub of its stream. It returns the hub, or nil when the feed must go on
// by itself (the hub is at another position: the feed is behind it or the
// stream moved since the feed's read).
func (hs *sseHubs) park(src hubSource, eng *streamstore.Engine, key hubKey, pos position, f *hubFeed) *sseHub {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	h := hs.hubs[key]
	if h == nil {
		ctx, cancel := context.WithCancel(context.Background())
		h = &sseHub{hubs: hs, src: src, eng: eng, key: key, next: pos, feeds: map[*hubFeed]struct{}{f: {}}, cancel: cancel}
		if hs.hubs == nil {
			hs.hubs = make(map[hubKey]*sseHub)
		}
		hs.hubs[key] = h
		go h.run(ctx, h.gen)
		return h
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.done || h.next != pos {
		return nil
	}
	if len(h.feeds) == 0 {
		// The hub's wait was cancelled when its last feed left; it has
		// not stopped yet and takes this one with a new wait.
		ctx, cancel := context.WithCancel(context.Background())
		h.cancel = cancel
		h.gen++
		go h.run(ctx, h.gen)
	}
	h.feeds[f] = struct{}{}
	return h
}

// leave takes f back from the hub, waiting out a write in progress. It
// reports why the hub had let f go already, or nil if it had not.
func (h *sseHub) leave(f *hubFeed) error {
	f.mu.Lock()
	ended := f.ended
	if ended == nil {
		f.ended = errFeedLeft
		close(f.done)
	}
	f.mu.Unlock()
	if ended == nil {
		h.remove(f)
	}
	return ended
}

// remove drops f from the feeds; the last one out cancels the hub's wait.
func (h *sseHub) remove(f *hubFeed) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.feeds[f]; !ok {
		return
	}
	delete(h.feeds, f)
	if len(h.feeds) == 0 {
		h.cancel()
	}
}

// end lets f go for err, unless it went already.
func (h *sseHub) end(f *hubFeed, err error) {
	f.mu.Lock()
	if errors.Is(err, errFeedClosed) && !f.closeSent {
		// Parked during the closing pass, after its list of feeds was
		// taken: nothing was written to it, and it goes on by itself to
		// write the closing events (section 5.8 wants them on every feed).
		err = errHubStopped
	}
	if f.ended == nil {
		f.ended = err
		close(f.done)
	}
	f.mu.Unlock()
	h.remove(f)
}

// run is the hub's goroutine: wait for the stream to move, write what is
// new to every parked feed, again. Started by park with a context that
// ends when the last feed leaves; each run ends on its own context (a later
// park may have started another).
func (h *sseHub) run(ctx context.Context, gen uint64) {
	var scratch passScratch
	for ctx.Err() == nil {
		h.mu.Lock()
		pos := h.next
		h.mu.Unlock()
		wctx, cancel := context.WithTimeout(ctx, keepAliveOr(h.hubs.keepAlive))
		info, err := h.eng.Wait(wctx, h.key.name, h.key.id, pos.seq)
		cancel()
		if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
			err = h.keepFeedsAlive(ctx, gen, pos, &scratch)
		} else if err == nil && info.ID != h.key.id {
			err = errHubStopped
		} else if err == nil {
			err = h.catchUp(ctx, gen, info.NextSeq, &scratch)
		}
		switch {
		case errors.Is(err, errSuperseded):
			return
		case ctx.Err() != nil:
			h.stopIfIdle()
			return
		case errors.Is(err, errFeedClosed):
			h.stop(err)
			return
		case err != nil:
			// Shutting down, deleted or failing: every feed goes on by
			// itself and meets the reason there.
			h.stop(errHubStopped)
			return
		}
	}
	h.stopIfIdle()
}

// keepFeedsAlive writes the feeds parked at pos, where the stream has
// stayed for the keep-alive interval, the control event of its tail again.
// A record that came meanwhile is left to the next wait, which returns at
// once.
func (h *sseHub) keepFeedsAlive(ctx context.Context, gen uint64, pos position, scratch *passScratch) error {
	defer scratch.release()
	from, group, _, err := h.behind(gen, scratch)
	if err != nil || len(group) == 0 || from != pos {
		return err
	}
	f, err := h.src.frameAt(ctx, pos, pos.seq)
	if err != nil || f.id != h.key.id {
		return errHubStopped
	}
	if f.hasData() || f.closed || f.start != pos {
		return nil
	}
	for i := 0; i < len(group); i += hubSlice {
		if i > 0 {
			// A record that landed meanwhile goes first: the next
			// wait returns at once, and catchUp writes it to every feed.
			if info, err := h.eng.Head(ctx, h.key.name); err == nil && info.NextSeq > pos.seq {
				return nil
			}
		}
		slice := group[i:min(i+hubSlice, len(group))]
		h.sendAll(slice, f, h.encodeForFeeds(f, slice), scratch.timer())
	}
	return nil
}

// behind lists the hub's parked feeds into scratch and returns the ones
// furthest behind, where they are, and whether that is all of them; or
// errSuperseded when the last feed left and a new one parked while this
// run was on its way out: two runs must not both write.
func (h *sseHub) behind(gen uint64, scratch *passScratch) (position, []*hubFeed, bool, error) {
	h.mu.Lock()
	if h.gen != gen {
		h.mu.Unlock()
		return position{}, nil, false, errSuperseded
	}
	feeds := scratch.feeds[:0]
	for hf := range h.feeds {
		feeds = append(feeds, hf)
	}
	h.mu.Unlock()
	scratch.feeds = feeds
	from, group, all := furthestBehind(feeds, scratch.group[:0])
	scratch.group = group
	return from, group, all, nil
}

// errSuperseded: a later run serves the hub's feeds now.
var errSuperseded = errors.New("hub run superseded")

// hubSlice is how many feeds one write of a pass covers before the hub
// looks at the stream again.
const hubSlice = 256

// catchUp writes what is new to every feed until all of them are at the
// stream's tail. The feeds furthest behind go first, a slice at a time,
// and the stream is read again before each slice: a record that arrives
// while a pass is under way reaches the feeds the pass has not written yet
// in the same write as the records before it, and the feeds it has written
// in the next pass, which covers only them. Under load feeds get fewer,
// larger writes, and no record waits for a whole pass over every feed
// before its own pass begins.
func (h *sseHub) catchUp(ctx context.Context, gen uint64, tail uint64, scratch *passScratch) error {
	defer scratch.release()
	var last *sseFrame // the newest frame written
	for {
		from, group, all, err := h.behind(gen, scratch)
		if err != nil || len(group) == 0 {
			return err
		}
		if all && last != nil && from == last.next {
			if last.closed {
				return errFeedClosed
			}
			if last.upToDate {
				return nil
			}
		}
		for i := 0; i < len(group); i += hubSlice {
			if i > 0 {
				if info, err := h.eng.Head(ctx, h.key.name); err == nil && info.ID == h.key.id {
					tail = max(tail, info.NextSeq)
				}
			}
			f, err := h.src.frameAt(ctx, from, tail)
			if err != nil || f.id != h.key.id {
				return errHubStopped
			}
			if !f.hasData() && !f.closed {
				// Woken with nothing to read: let each feed find out why.
				return errHubStopped
			}
			h.mu.Lock()
			if h.gen != gen {
				// Replaced while reading (the last feed left and another
				// parked): moving h.next now would put the new run's wait
				// past the feed that parked at it, which would then miss
				// the record read here until the next one.
				h.mu.Unlock()
				return errSuperseded
			}
			if h.next.before(f.next) {
				h.next = f.next
			}
			h.mu.Unlock()
			slice := group[i:min(i+hubSlice, len(group))]
			h.sendAll(slice, f, h.encodeForFeeds(f, slice), scratch.timer())
			last = f
			tail = max(tail, f.tail)
		}
	}
}

// passScratch holds a hub run's lists of feeds from pass to pass: with
// thousands of feeds, fresh lists at every slice of every pass were most
// of what the hub allocated, and so of the collections it caused.
type passScratch struct {
	feeds, group []*hubFeed
	tick         *time.Timer // the passes' watchdog timer (sendAll), stopped between passes
}

// timer is the passes' watchdog timer, made stopped at its first use.
func (s *passScratch) timer() *time.Timer {
	if s.tick == nil {
		s.tick = time.NewTimer(time.Hour)
		s.tick.Stop()
	}
	return s.tick
}

// release drops the lists' references, so that feeds that left are not
// kept alive until the next pass, and keeps their room.
func (s *passScratch) release() {
	clear(s.feeds[:cap(s.feeds)])
	clear(s.group[:cap(s.group)])
	s.feeds, s.group = s.feeds[:0], s.group[:0]
}

// furthestBehind returns the earliest position among the feeds still
// parked, the feeds there (appended to group), and whether that is all of
// them.
func furthestBehind(feeds, group []*hubFeed) (at position, _ []*hubFeed, all bool) {
	live := 0
	for _, hf := range feeds {
		hf.mu.Lock()
		next, ended := hf.next, hf.ended
		hf.mu.Unlock()
		if ended != nil {
			continue
		}
		live++
		switch {
		case len(group) == 0 || next.before(at):
			at, group = next, append(group[:0], hf)
		case next == at:
			group = append(group, hf)
		}
	}
	return at, group, len(group) == live
}

// A write to a client that stopped reading (a phone gone without a FIN, a
// stuck consumer) does not finish until its socket drains or the write
// deadline passes, up to the feed write timeout. Every feed behind it in
// the pass, and every later append to all of them, used to wait that long.
// So a pass's writes run on goroutines of their own while the hub's
// goroutine watches them: a write still in progress at two looks in a row,
// hubStallTick apart, is left to finish on the goroutine that is making it,
// its feed leaves the hub, and a new goroutine takes over the rest of the
// pass. When that write ends, the feed goes on by itself from where it left
// off (errHubStopped): a client that was slow for a moment keeps its
// connection and catches up on its own, one that is gone is let go when the
// write times out, which a broken connection ends. The healthy feeds lose a
// tick or two once per stalled client, not a timeout per event. One look
// per tick costs the hub one timer per pass, not one per write.
const hubStallTick = 10 * time.Millisecond

// hubPass is one frame being written to a slice of feeds.
type hubPass struct {
	h      *sseHub
	feeds  []*hubFeed
	f      *sseFrame
	events map[string][]byte
	next   atomic.Int64 // index of the next feed a writer takes
	active atomic.Int32 // writers still counted; the last one out closes done
	done   chan struct{}
}

// passWriter is one goroutine writing a pass's feeds.
type passWriter struct {
	// state counts the writer's writes, two steps each: odd while one is
	// in progress. The watchdog sets writerDetached on a write it saw in
	// progress at two looks; a writer that finds its state changed when
	// its write returns knows it was detached.
	state atomic.Uint64
	// cur is the feed of the write in progress. It is set before state
	// turns odd, and the watchdog reads it only after detaching the
	// writer, which then never sets it again.
	cur *hubFeed
}

const writerDetached = 1 << 63

// work writes the pass's feeds one by one until none is left, or until
// the watchdog detached it from the pass.
func (p *hubPass) work(w *passWriter) {
	for {
		i := p.next.Add(1) - 1
		if i >= int64(len(p.feeds)) {
			if p.active.Add(-1) == 0 {
				close(p.done)
			}
			return
		}
		if !p.h.send(p.feeds[i], p.f, p.events, w) {
			return // detached: a new writer took this one's place
		}
	}
}

// sendAll writes frame f to the feeds, split over one goroutine per
// processor when there are enough of them to be worth it, and returns once
// every write is done except those it left to finish on their own (see
// hubStallTick). tick is the hub's timer, stopped.
func (h *sseHub) sendAll(feeds []*hubFeed, f *sseFrame, events map[string][]byte, tick *time.Timer) {
	n := runtime.GOMAXPROCS(0)
	if len(feeds) < 64*n {
		n = 1
	}
	p := &hubPass{h: h, feeds: feeds, f: f, events: events, done: make(chan struct{})}
	p.active.Store(int32(n))
	writers := make([]*passWriter, n)
	seen := make([]uint64, n) // each writer's state at the last look
	for i := range writers {
		writers[i] = &passWriter{}
		go p.work(writers[i])
	}
	every := h.hubs.stallTick
	if every <= 0 {
		every = hubStallTick
	}
	tick.Reset(every)
	defer tick.Stop()
	for {
		select {
		case <-p.done:
			return
		case <-tick.C:
		}
		for i, w := range writers {
			s := w.state.Load()
			if s%2 == 1 && s == seen[i] && w.state.CompareAndSwap(s, s|writerDetached) {
				// The same write as at the last look: its feed leaves the
				// hub, so no later pass waits on it either, and a new
				// writer goes on with the pass (it counts in active for
				// the detached one).
				h.remove(w.cur)
				writers[i], seen[i] = &passWriter{}, 0
				go p.work(writers[i])
				continue
			}
			seen[i] = s
		}
		tick.Reset(every)
	}
}

// maxPassVariants bounds the events one pass encodes ahead.
const maxPassVariants = 16

// encodeForFeeds encodes frame f and its control event once per variant
// among the feeds, as the bytes each feed writes; nil when the feeds have
// too many variants to be worth it (each then encodes its own).
func (h *sseHub) encodeForFeeds(f *sseFrame, feeds []*hubFeed) map[string][]byte {
	events := make(map[string][]byte)
	for _, hf := range feeds {
		v := h.src.variant(f, hf.cursor)
		if _, ok := events[v]; ok {
			continue
		}
		if len(events) == maxPassVariants {
			return nil
		}
		events[v] = h.src.encode(f, v)
	}
	return events
}

// send writes frame f to one feed, as the feed itself would have: the
// pass's shared bytes for the feed's variant when there are some. It
// reports false when the pass's watchdog detached w during the write: the
// feed has left the hub then, and send lets it go on by itself.
func (h *sseHub) send(hf *hubFeed, f *sseFrame, events map[string][]byte, w *passWriter) bool {
	hf.mu.Lock()
	if hf.ended != nil {
		hf.mu.Unlock()
		return true
	}
	if hf.next != f.start {
		// Not where the frame starts (it cannot happen with one run at a
		// time; never write a gap or a repeat): the feed goes on alone.
		hf.mu.Unlock()
		h.end(hf, errHubStopped)
		return true
	}
	// Each write has the feed write timeout to finish, so a write the pass
	// left to finish alone ends in time (and with it a client that stopped
	// reading). The deadline moves on every half of that, not at every
	// write, except where an armed deadline fires by itself (HTTP/2):
	// there it is set for each write and cleared after it, or an idle feed
	// would be reset one timeout after its last event.
	fires := hf.es.deadlineFires
	if now := time.Now(); fires || !now.Before(hf.renewAt) {
		timeout := h.src.writeTimeout()
		_ = hf.limit(now.Add(timeout))
		hf.renewAt = now.Add(timeout / 2)
	}
	w.cur = hf
	s := w.state.Add(1) // odd: a write in progress
	var ok bool
	if b, shared := events[h.src.variant(f, hf.cursor)]; shared {
		ok = hf.writeShared(b)
	} else {
		ok = hf.write(f)
	}
	if fires {
		_ = hf.limit(time.Time{})
	}
	detached := !w.state.CompareAndSwap(s, s+1)
	if ok {
		hf.next = f.next
		hf.closeSent = f.closed
	}
	if detached {
		// The feed is out of the hub already (the watchdog removed it).
		// The whole event was written, or the connection is broken.
		switch {
		case !ok:
			hf.ended = errFeedBroken
		case f.closed:
			hf.ended = errFeedClosed
		default:
			hf.ended = errHubStopped // go on alone from hf.next
		}
		close(hf.done)
		hf.mu.Unlock()
		return false
	}
	hf.mu.Unlock()
	if !ok {
		h.end(hf, errFeedBroken)
	}
	return true
}

// writeShared writes and flushes a pass's shared bytes to the feed.
func (hf *hubFeed) writeShared(b []byte) bool {
	if hf.direct == nil {
		return hf.es.write(b) && hf.es.flush()
	}
	if _, err := hf.direct.Write(b); err != nil {
		return false
	}
	err := hf.directRC.Flush()
	return err == nil || errors.Is(err, http.ErrNotSupported)
}

// skipIdleTimeout returns the response beneath Caddy's idle write timeout
// (caddyhttp.IdleTimeoutWriter) when a hub may write to it directly, nil
// when it may not. The wrapper moves the connection's write deadline before
// every write and every flush: two deadline updates per event, which with
// thousands of feeds took an eighth of the fan-out's CPU. A parked feed's
// writes are bounded by the hub's own deadline instead (send), so the
// wrapper may be skipped only where that bound is at least as strict: it
// enforces no minimum rate and no hard deadline, and its idle timeout is
// no shorter than the hub's. Another wrapper above it (an access log's
// recorder, an encoder) must see every byte, and then there is nothing to
// skip; so must a buffer of the feed's own.
func skipIdleTimeout(es *eventStream, timeout time.Duration) http.ResponseWriter {
	if es.bw != nil {
		return nil
	}
	iw, ok := es.out.(*caddyhttp.IdleTimeoutWriter)
	if !ok || iw.ResponseWriterWrapper == nil {
		return nil
	}
	d := iw.Deadline
	if d.MinRate > 0 || !d.HardDeadline.IsZero() || d.Timeout < timeout {
		return nil
	}
	return iw.ResponseWriter
}

// stop ends the hub: every feed left goes for err, and no feed parks here
// again.
func (h *sseHub) stop(err error) {
	h.hubs.mu.Lock()
	h.mu.Lock()
	h.done = true
	if h.hubs.hubs[h.key] == h {
		delete(h.hubs.hubs, h.key)
	}
	feeds := make([]*hubFeed, 0, len(h.feeds))
	for hf := range h.feeds {
		feeds = append(feeds, hf)
	}
	h.mu.Unlock()
	h.hubs.mu.Unlock()
	for _, hf := range feeds {
		h.end(hf, err)
	}
	h.cancel()
}

// stopIfIdle stops the hub after its wait was cancelled, unless a feed
// parked since, which started a new run with a new context.
func (h *sseHub) stopIfIdle() {
	h.hubs.mu.Lock()
	defer h.hubs.mu.Unlock()
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.feeds) > 0 || h.done {
		return
	}
	h.done = true
	if h.hubs.hubs[h.key] == h {
		delete(h.hubs.hubs, h.key)
	}
}

// parkAtTail parks a feed that has written everything up to pos in its
// stream's hub, and sleeps until the hub lets it go or the feed's wait is
// over (lw: its time is up, the client left, the server shuts down). It
// returns where the feed is then and why the hub let it go; nil when the
// feed could not park and must wait alone.
func (hs *sseHubs) parkAtTail(lw *liveWait, src hubSource, eng *streamstore.Engine, key hubKey, pos position, cursor string,
	es *eventStream, write func(*sseFrame) bool) (position, error) {
	hf := &hubFeed{es: es, write: write, limit: es.rc.SetWriteDeadline, cursor: cursor, next: pos, done: make(chan struct{})}
	if d := skipIdleTimeout(es, src.writeTimeout()); d != nil {
		hf.direct, hf.directRC = d, http.NewResponseController(d)
	}
	h := hs.park(src, eng, key, pos, hf)
	if h == nil {
		return pos, nil
	}
	select {
	case <-hf.done:
	case <-lw.ctx.Done():
		h.leave(hf)
	}
	hf.mu.Lock()
	defer hf.mu.Unlock()
	if !hf.renewAt.IsZero() {
		_ = hf.limit(time.Time{}) // the feed's own writes have no deadline
	}
	return hf.next, hf.ended
}
