//go:build linux

package loadgen

import (
	"context"
	"errors"
	"io"
	"sync"
	"syscall"
	"time"
)

// poller reads many feeds on one goroutine: epoll says which connections
// have bytes, and each gets one read into a shared buffer, decoded in
// place. Against a goroutine per feed this saves, per event, a goroutine
// wake-up and the read that finds nothing before it parks again.
type poller struct {
	epfd   int
	mu     sync.Mutex
	feeds  map[int]*rawFeed // by file descriptor
	closed bool
}

func newPoller() (*poller, error) {
	fd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	return &poller{epfd: fd, feeds: make(map[int]*rawFeed)}, nil
}

// add starts reading f; how it ended arrives on f.done. The poller owns
// f's connection from here on: it keeps a duplicate of the descriptor and
// closes the net.Conn, so that the runtime's own poller, which would wake
// for every event too, lets go of the socket.
func (p *poller) add(f *rawFeed) error {
	rc, err := f.conn.SyscallConn()
	if err != nil {
		f.conn.Close()
		return err
	}
	var dupErr error
	err = rc.Control(func(fd uintptr) {
		r, _, errno := syscall.Syscall(syscall.SYS_FCNTL, fd, syscall.F_DUPFD_CLOEXEC, 0)
		if errno != 0 {
			dupErr = errno
		}
		f.fd = int(r)
	})
	f.conn.Close() // the duplicate keeps the connection open
	if err = errors.Join(err, dupErr); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		syscall.Close(f.fd)
		return errPollerClosed
	}
	p.feeds[f.fd] = f
	ev := syscall.EpollEvent{Events: syscall.EPOLLIN | syscall.EPOLLRDHUP, Fd: int32(f.fd)}
	if err := syscall.EpollCtl(p.epfd, syscall.EPOLL_CTL_ADD, f.fd, &ev); err != nil {
		delete(p.feeds, f.fd)
		syscall.Close(f.fd)
		return err
	}
	return nil
}

// pollTick is how long the poller sleeps when it has caught up. It polls
// rather than sleeping in epoll_wait so that the server's writes never have
// to wake it: on a virtual machine a cross-process wake-up costs the
// writing server more than the write itself, a cost that remote clients
// would not put on it. An event that arrives during a nap waits for its
// end, so the tick adds at most this much to a measured latency.
const pollTick = time.Millisecond

var errPollerClosed = errors.New("poller stopped")

// run serves the feeds until ctx ends, then ends every feed still open.
func (p *poller) run(ctx context.Context) {
	events := make([]syscall.EpollEvent, 256)
	buf := make([]byte, 64<<10)
	var cause error
	for cause == nil {
		if cause = ctx.Err(); cause != nil {
			break
		}
		n, err := syscall.EpollWait(p.epfd, events, 0)
		if err != nil {
			if err != syscall.EINTR {
				cause = err
			}
			continue
		}
		for _, ev := range events[:n] {
			p.mu.Lock()
			f := p.feeds[int(ev.Fd)]
			p.mu.Unlock()
			if f != nil {
				p.serve(f, buf)
			}
		}
		// Caught up: nap once what was ready is read, not before (which
		// added the tick to every delivery's measured latency).
		if n < len(events) {
			time.Sleep(pollTick)
		}
	}
	p.mu.Lock()
	p.closed = true
	left := make([]*rawFeed, 0, len(p.feeds))
	for _, f := range p.feeds {
		left = append(left, f)
	}
	p.mu.Unlock()
	for _, f := range left {
		p.end(f, cause)
	}
	syscall.Close(p.epfd)
}

// serve reads what f's connection has and decodes it.
func (p *poller) serve(f *rawFeed, buf []byte) {
	n, err := syscall.Read(f.fd, buf)
	switch {
	case err == syscall.EAGAIN || err == syscall.EINTR:
	case err != nil:
		p.end(f, err)
	case n == 0:
		p.end(f, f.body.eof(io.EOF))
	default:
		if end, ferr := f.feed(buf[:n]); ferr != nil || end {
			p.end(f, ferr)
		}
	}
}

// end stops reading f, closes its descriptor and reports err.
func (p *poller) end(f *rawFeed, err error) {
	p.mu.Lock()
	delete(p.feeds, f.fd)
	p.mu.Unlock()
	// Deregister before the close frees the descriptor for reuse.
	_ = syscall.EpollCtl(p.epfd, syscall.EPOLL_CTL_DEL, f.fd, nil)
	syscall.Close(f.fd)
	f.done <- err
}
