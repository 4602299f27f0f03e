package streamstore

import (
	"sync"
	"sync/atomic"
)

// Cold readers walk a stream's data objects one after another, and each
// object used to come in a buffer of its own: a catch-up read of 256 MiB
// allocated 256 MiB, the heap grew to twice what the cache and the
// read-ahead hold, and on a VM, where the first write to a fresh page costs
// about 15 us, a freshly started node spent a quarter of its CPU on page
// faults. The buffers of cold data objects are recycled instead, once
// nothing holds their records.
//
// An objBuf counts its holders. The cache holds one while the object is
// cached, a fetch one until it hands the object over, and a read one until
// the caller of Engine.Read releases the result (after writing the
// records). A holder that never lets go costs only the reuse: the buffer
// is left to the garbage collector. Records handed out without a hold (by
// blockCache.get and peek, which compaction uses) mark the buffer escaped,
// and an escaped buffer is never reused.

// bufClass is the size step of pooled buffers; bufPoolMax is the largest
// pooled buffer. Smaller objects are cheap to allocate; larger ones are
// blobs, read once.
const (
	bufClass   = 64 << 10
	bufPoolMin = bufClass
	bufPoolMax = maxDataObject + bufClass
)

// bufPool keeps released buffers by size class, rounded up to bufClass. The
// sync.Pools empty over garbage collections, so an idle node gives the
// memory back.
type bufPool struct {
	classes [bufPoolMax / bufClass]sync.Pool
	poison  bool         // tests: overwrite a buffer as it returns to the pool
	reused  atomic.Int64 // allocations served from the pool
}

// alloc returns a buffer of length n, pooled when n is in the pooled range.
func (p *bufPool) alloc(n int) []byte {
	if n < bufPoolMin || n > bufPoolMax {
		return make([]byte, n)
	}
	c := (n + bufClass - 1) / bufClass
	if v := p.classes[c-1].Get(); v != nil {
		p.reused.Add(1)
		return (*v.(*[]byte))[:n]
	}
	return make([]byte, n, c*bufClass)
}

// free returns b to the pool; b must not be used afterwards.
func (p *bufPool) free(b []byte) {
	c := cap(b) / bufClass
	if cap(b)%bufClass != 0 || c < 1 || c > len(p.classes) {
		return
	}
	b = b[:cap(b)]
	if p.poison {
		for i := range b {
			b[i] = 0xA5
		}
	}
	p.classes[c-1].Put(&b)
}

// objBuf is the buffer of one cold data object, its records' bodies inside.
type objBuf struct {
	b       []byte
	pool    *bufPool
	refs    atomic.Int32
	escaped atomic.Bool
}

// newObjBuf wraps b, held once by the caller.
func newObjBuf(b []byte, pool *bufPool) *objBuf {
	o := &objBuf{b: b, pool: pool}
	o.refs.Store(1)
	return o
}

// hold adds a holder. The caller must already hold o (or reach it through
// a holder that cannot let go meanwhile, as the cache under its lock).
func (o *objBuf) hold() {
	if o != nil {
		o.refs.Add(1)
	}
}

// release drops a hold; the last one returns the buffer to its pool unless
// records of it were handed out without a hold.
func (o *objBuf) release() {
	if o == nil {
		return
	}
	switch n := o.refs.Add(-1); {
	case n < 0:
		panic("streamstore: object buffer released more often than held")
	case n == 0 && !o.escaped.Load():
		b := o.b
		o.b = nil
		o.pool.free(b)
	}
}

// escape marks o as reachable by holders that do not count: its buffer is
// never reused.
func (o *objBuf) escape() {
	if o != nil {
		o.escaped.Store(true)
	}
}

// holds are the buffers a read result keeps from reuse. A pointer, so
// that copies of a ReadResult release once between them.
type holds struct {
	bufs []*objBuf
	done atomic.Bool
}

func (h *holds) release() {
	if h == nil || !h.done.CompareAndSwap(false, true) {
		return
	}
	for _, o := range h.bufs {
		o.release()
	}
}
