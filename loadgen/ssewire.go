package loadgen

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// With thousands of subscribers on the machine under test, the load
// generator's own cost per event decides how much CPU is left for the
// server: through net/http's client each event takes a goroutine wake-up,
// two reads (the second finds nothing and parks) and two copies. For plain
// http:// URLs a subscriber therefore speaks HTTP/1.1 itself: it sends the
// request and reads the response head with the standard library, then
// hands the connection to a poller that decodes the body in place as bytes
// arrive (see poller_linux.go). https:// URLs keep the net/http path.

// rawFeed is one SSE response read off its connection by hand.
type rawFeed struct {
	s    *subscriber
	conn *net.TCPConn
	fd   int // the connection's descriptor, while a poller reads it
	body bodyDecoder
	done chan error // the reason the feed ended; nil: the server ended it
}

// usesRawFeeds reports whether subscribers of rawURL read their feeds by
// hand.
func usesRawFeeds(rawURL string) bool {
	u, err := url.Parse(rawURL)
	return err == nil && u.Scheme == "http"
}

// openRaw sends the SSE request on a new connection and reads the response
// head. On success the feed's body decoder holds whatever of the body came
// with the head.
func (s *subscriber) openRaw(ctx context.Context) (*rawFeed, error) {
	u, err := url.Parse(s.url + s.liveQuery())
	if err != nil {
		return nil, err
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "80")
	}
	d := net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}
	c, err := d.DialContext(ctx, "tcp", host)
	if err != nil {
		return nil, err
	}
	conn := c.(*net.TCPConn)
	ok := false
	defer func() {
		if !ok {
			conn.Close()
		}
	}()
	// The head must come within the timeout, as with ResponseHeaderTimeout.
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	conn.SetDeadline(time.Now().Add(s.r.cfg.Timeout))
	if _, err := conn.Write(s.r.rawRequest(u)); err != nil {
		return nil, err
	}
	br := bufio.NewReaderSize(conn, 4096)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodGet, URL: u})
	if err != nil {
		return nil, err
	}
	if err := checkSSEResponse(resp); err != nil {
		resp.Body.Close()
		return nil, err
	}
	if !stop() {
		return nil, ctx.Err()
	}
	conn.SetDeadline(time.Time{})
	f := &rawFeed{s: s, conn: conn, done: make(chan error, 1)}
	switch {
	case len(resp.TransferEncoding) > 0 && resp.TransferEncoding[0] == "chunked":
		f.body.chunked = true
	case resp.ContentLength >= 0:
		f.body.remain = resp.ContentLength
		f.body.sized = true
	}
	s.startResponse(resp.Header)
	s.line = s.line[:0]
	if n := br.Buffered(); n > 0 {
		head, _ := br.Peek(n)
		if _, err := f.feed(head); err != nil {
			return nil, err
		}
	}
	ok = true
	return f, nil
}

// rawRequest is the SSE request for u as net/http's client would send it:
// the configured headers (a Host among them is the Host line), and basic
// auth from u's user info when they have no Authorization.
func (r *runner) rawRequest(u *url.URL) []byte {
	host := u.Host
	var b strings.Builder
	for name, values := range r.cfg.Header {
		if name == "Host" {
			host = values[0]
			continue
		}
		for _, v := range values {
			b.WriteString(name + ": " + v + "\r\n")
		}
	}
	if u.User != nil && r.cfg.Header.Get("Authorization") == "" {
		pass, _ := u.User.Password()
		cred := base64.StdEncoding.EncodeToString([]byte(u.User.Username() + ":" + pass))
		b.WriteString("Authorization: Basic " + cred + "\r\n")
	}
	return []byte("GET " + u.RequestURI() + " HTTP/1.1\r\nHost: " + host +
		"\r\nAccept: text/event-stream\r\nUser-Agent: picomq-bench\r\n" + b.String() + "\r\n")
}

// onceRaw is once for plain http:// URLs.
func (s *subscriber) onceRaw(ctx context.Context) error {
	f, err := s.openRaw(ctx)
	s.ready()
	if err != nil {
		return err
	}
	if s.poller == nil {
		return f.readLoop(ctx)
	}
	if err := s.poller.add(f); err != nil {
		return err
	}
	return <-f.done
}

// feed takes the next bytes off the connection; end says the response is
// complete (the server ended it or the stream closed).
func (f *rawFeed) feed(p []byte) (end bool, err error) {
	return f.body.decode(p, f.lines)
}

// lines splits body bytes into event stream lines, carrying a line that
// spans two reads over in s.line.
func (f *rawFeed) lines(p []byte) error {
	s := f.s
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			s.line = append(s.line, p...)
			return nil
		}
		line := p[:i]
		p = p[i+1:]
		if len(s.line) > 0 {
			s.line = append(s.line, line...)
			line = s.line
		}
		if n := len(line); n > 0 && line[n-1] == '\r' {
			line = line[:n-1]
		}
		err := s.sseLine(line)
		s.line = s.line[:0]
		if err != nil {
			return err
		}
	}
	return nil
}

// readLoop reads the feed on the calling goroutine until it ends: the
// poller's fallback where there is none.
func (f *rawFeed) readLoop(ctx context.Context) error {
	defer f.conn.Close()
	stop := context.AfterFunc(ctx, func() { f.conn.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()
	buf := make([]byte, 16<<10)
	for {
		n, err := f.conn.Read(buf)
		if n > 0 {
			if end, ferr := f.feed(buf[:n]); ferr != nil || end {
				return ferr
			}
		}
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return f.body.eof(err)
		}
	}
}

// bodyDecoder undoes HTTP/1.1 message framing as bytes arrive: chunked
// transfer coding, a Content-Length, or neither (the body runs to EOF).
type bodyDecoder struct {
	chunked bool
	sized   bool  // Content-Length framing
	remain  int64 // bytes left in the current chunk, or in a sized body
	state   chunkState
	pending []byte // a chunk-size or trailer line split across reads
}

type chunkState int

const (
	chunkSize    chunkState = iota // reading a chunk-size line
	chunkData                      // remain bytes of data to go
	chunkDataEnd                   // the CRLF after a chunk's data
	chunkTrailer                   // trailer lines, up to an empty one
	chunkDone
)

// maxChunkLine bounds a chunk-size or trailer line.
const maxChunkLine = 4096

// decode passes the body bytes in p to out; end says the body is complete.
func (d *bodyDecoder) decode(p []byte, out func([]byte) error) (end bool, err error) {
	if !d.chunked {
		if d.sized {
			if int64(len(p)) >= d.remain {
				p, end = p[:d.remain], true
			}
			d.remain -= int64(len(p))
		}
		if len(p) > 0 {
			err = out(p)
		}
		return end, err
	}
	for len(p) > 0 && d.state != chunkDone {
		switch d.state {
		case chunkData:
			n := int64(len(p))
			if n > d.remain {
				n = d.remain
			}
			if err := out(p[:n]); err != nil {
				return false, err
			}
			p = p[n:]
			if d.remain -= n; d.remain == 0 {
				d.state = chunkDataEnd
			}
		case chunkDataEnd, chunkSize, chunkTrailer:
			line, rest, ok := d.line(p)
			p = rest
			if !ok {
				if len(d.pending) > maxChunkLine {
					return false, errors.New("chunked body: line too long")
				}
				continue
			}
			if err := d.endOfLine(line); err != nil {
				return false, err
			}
		}
	}
	return d.state == chunkDone, nil
}

// line returns the next complete line of p (without CRLF) and what follows
// it; ok is false when p ends mid-line, which then waits in d.pending.
func (d *bodyDecoder) line(p []byte) (line, rest []byte, ok bool) {
	i := bytes.IndexByte(p, '\n')
	if i < 0 {
		d.pending = append(d.pending, p...)
		return nil, nil, false
	}
	line, rest = p[:i], p[i+1:]
	if len(d.pending) > 0 {
		d.pending = append(d.pending, line...)
		line = d.pending
	}
	line = bytes.TrimSuffix(line, []byte("\r"))
	return line, rest, true
}

// endOfLine acts on a complete framing line.
func (d *bodyDecoder) endOfLine(line []byte) error {
	defer func() { d.pending = d.pending[:0] }()
	switch d.state {
	case chunkDataEnd:
		if len(line) != 0 {
			return errors.New("chunked body: data longer than its chunk size")
		}
		d.state = chunkSize
	case chunkSize:
		hex, _, _ := strings.Cut(string(line), ";")
		n, err := strconv.ParseInt(strings.TrimSpace(hex), 16, 64)
		if err != nil || n < 0 {
			return fmt.Errorf("chunked body: bad chunk size %q", line)
		}
		if n == 0 {
			d.state = chunkTrailer
		} else {
			d.state, d.remain = chunkData, n
		}
	case chunkTrailer:
		if len(line) == 0 {
			d.state = chunkDone
		}
	}
	return nil
}

// eof is the outcome of a connection that ended: fine where the body runs
// to EOF, a truncated response otherwise.
func (d *bodyDecoder) eof(err error) error {
	if !errors.Is(err, io.EOF) {
		return err
	}
	if d.chunked || d.sized {
		return errors.New("response ended early: " + err.Error())
	}
	return nil
}
