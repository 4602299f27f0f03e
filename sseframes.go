package picomq

import (
	"context"
	"sync"
	"time"

	"github.com/picomq/caddy-picomq/streamstore"
)

// An append to a stream with thousands of SSE subscribers wakes them all at
// the same position. Each used to read the same records from the engine,
// copy them into its own chunk and encode its own data event: the same
// bytes thousands of times over, most of a fan-out's CPU and garbage. A
// sseFrame is that data event encoded once; feeds that wake at the same
// position write the same frame and only build their own small control
// event (it carries their cursor).

// sseEncoding is how a stream's bytes travel in data events.
type sseEncoding uint8

const (
	sseText   sseEncoding = iota // text/* : the bytes as data lines
	sseJSON                      // application/json: a JSON array of the messages
	sseBase64                    // everything else: base64 (section 5.8)
)

func sseEncodingOf(contentType string) sseEncoding {
	switch {
	case isJSON(contentType):
		return sseJSON
	case isTextual(contentType):
		return sseText
	default:
		return sseBase64
	}
}

// sseFrame is one read's worth of a feed: where it starts and ends, what
// the stream looked like, and the encoded data event (empty when the read
// brought nothing new). Frames are shared and never modified.
type sseFrame struct {
	id       string // the stream's internal id
	start    position
	next     position
	tail     uint64 // the stream's tail when the frame was read
	upToDate bool   // next is the tail as of the read
	closed   bool   // ... and the stream is closed there
	data     []byte // "event: data" with the records; nil when start == next
	made     time.Time
}

func (f *sseFrame) hasData() bool { return f.next != f.start }

// frameFromChunk encodes a read into a frame.
func frameFromChunk(c chunk, enc sseEncoding, now time.Time) *sseFrame {
	f := &sseFrame{
		id:       c.info.ID,
		start:    c.start,
		next:     c.next,
		tail:     c.info.NextSeq,
		upToDate: c.upToDate,
		closed:   c.closed,
		made:     now,
	}
	if c.hasData() {
		switch enc {
		case sseJSON:
			f.data = appendSSEEvent(nil, "data", c.payload())
		case sseBase64:
			f.data = appendSSEBase64(nil, c.bytes())
		default:
			f.data = appendSSEEvent(nil, "data", c.bytes())
		}
	}
	return f
}

// frameControl is the control event that follows frame f in a feed with
// the given cursor.
func frameControl(f *sseFrame, cursor string) sseControl {
	return sseControl{StreamNextOffset: f.next.String(), UpToDate: f.upToDate || !f.hasData(),
		StreamCursor: controlCursor(f, cursor), StreamClosed: f.closed}
}

// controlCursor is the cursor f's control event carries: none once the
// stream is closed.
func controlCursor(f *sseFrame, cursor string) string {
	if f.closed {
		return ""
	}
	return cursor
}

// Frames are kept only while a wave of wake-ups can use them: a fraction of
// a second, a few MiB in all.
const (
	frameMaxAge   = time.Second
	frameMaxBytes = 8 << 20
	frameMaxCount = 4096
)

type frameKey struct {
	id    string
	start position
	enc   sseEncoding
}

// frameCache holds the frames feeds made lately, oldest first out. The zero
// value is ready to use.
type frameCache struct {
	mu       sync.Mutex
	m        map[frameKey]*sseFrame
	order    []frameKey // insertion order, for eviction
	bytes    int
	sweeping bool // a sweep is due: frames are kept
}

// get returns a frame for a feed at start that knows the stream's tail to
// be at least tail: one that reaches that far, or one cut short by the
// chunk limit (reading again would cut it the same way, records being
// immutable). nil when there is none.
func (fc *frameCache) get(k frameKey, tail uint64, now time.Time) *sseFrame {
	fc.mu.Lock()
	defer fc.mu.Unlock()
	f := fc.m[k]
	if f == nil || now.Sub(f.made) > frameMaxAge || (f.upToDate && f.tail < tail) {
		return nil
	}
	return f
}

// put adds f under k, replacing an older frame and evicting the oldest
// ones beyond the limits.
func (fc *frameCache) put(k frameKey, f *sseFrame) {
	if len(f.data) == 0 || len(f.data) > frameMaxBytes/4 {
		return
	}
	fc.mu.Lock()
	defer fc.mu.Unlock()
	if fc.m == nil {
		fc.m = make(map[frameKey]*sseFrame)
	}
	if old, ok := fc.m[k]; ok {
		fc.bytes -= len(old.data)
	} else {
		fc.order = append(fc.order, k)
	}
	fc.m[k] = f
	fc.bytes += len(f.data)
	fc.evictLocked(f.made)
	if cap(fc.order) > 4*frameMaxCount {
		// The slice only ever moves forward; copy it back now and then.
		fc.order = append([]frameKey(nil), fc.order...)
	}
	if !fc.sweeping {
		// Eviction also runs with no frame coming after: a burst's last
		// frames would otherwise stay until the next feed, a handler's
		// worth of megabytes in an idle process.
		fc.sweeping = true
		time.AfterFunc(2*frameMaxAge, fc.sweep)
	}
}

// evictLocked drops the oldest frames beyond the limits, and those made
// more than frameMaxAge before now.
func (fc *frameCache) evictLocked(now time.Time) {
	for len(fc.order) > 0 {
		oldest := fc.m[fc.order[0]]
		if fc.bytes <= frameMaxBytes && len(fc.order) <= frameMaxCount && now.Sub(oldest.made) <= frameMaxAge {
			break
		}
		fc.bytes -= len(oldest.data)
		delete(fc.m, fc.order[0])
		fc.order[0] = frameKey{}
		fc.order = fc.order[1:]
	}
}

// sweep evicts the frames too old to share, and comes back while any are
// left; the last one gone, the cache holds no memory.
func (fc *frameCache) sweep() {
	fc.mu.Lock()
	defer fc.mu.Unlock()
	fc.evictLocked(time.Now())
	if len(fc.order) > 0 {
		time.AfterFunc(2*frameMaxAge, fc.sweep)
		return
	}
	fc.sweeping, fc.m, fc.order = false, nil, nil
}

// frameAt returns the frame of a feed of stream id at pos that knows the
// tail to be at least tail: a shared one when another feed made it lately,
// else a fresh read. The read's stream may have another id (deleted and
// recreated); the caller checks.
func (d *durableStreams) frameAt(ctx context.Context, eng *streamstore.Engine, name, id string, pos position, tail uint64, enc sseEncoding) (*sseFrame, error) {
	k := frameKey{id: id, start: pos, enc: enc}
	now := time.Now()
	if f := d.frames.get(k, tail, now); f != nil {
		return f, nil
	}
	c, err := d.read(ctx, eng, name, readOffset{kind: offsetAt, pos: pos})
	if err != nil {
		return nil, err
	}
	f := frameFromChunk(c, enc, now)
	c.release()
	if f.id == id {
		d.frames.put(k, f)
	}
	return f, nil
}

// dsHubSource is the hub source of Durable Streams feeds of one stream and
// encoding: frames come from frameAt, and a feed's control event carries
// its cursor.
type dsHubSource struct {
	d   *durableStreams
	eng *streamstore.Engine
	key hubKey
}

func (s dsHubSource) frameAt(ctx context.Context, pos position, tail uint64) (*sseFrame, error) {
	return s.d.frameAt(ctx, s.eng, s.key.name, s.key.id, pos, tail, s.key.enc)
}

func (s dsHubSource) variant(f *sseFrame, cursor string) string { return controlCursor(f, cursor) }

func (s dsHubSource) encode(f *sseFrame, cursor string) []byte {
	return appendSSEControl(append([]byte(nil), f.data...), frameControl(f, cursor))
}

func (s dsHubSource) writeTimeout() time.Duration { return feedWriteTimeout(s.d.writeTimeout) }
