// Package loadgen is the load generator behind `caddy picomq bench`. It
// drives any Durable Streams server over plain HTTP (net/http, nothing of
// Caddy or of the storage behind the server), so the same run measures
// PicoMQ, a bare Caddy `respond` route (the HTTP ceiling) or the Node
// reference server.
//
// Modes:
//
//   - append: Writers goroutines append Size-byte bodies to Streams streams,
//     closed loop (Rate 0: each writer sends its next append when the last is
//     answered) or open loop at Rate appends/s in total.
//   - sse: Subscribers SSE readers follow one stream from its tail while a
//     single writer appends numbered records at Rate (default 20/s); delivery
//     latency is measured from the writer's acknowledgement to receipt. The
//     feeds speak Durable Streams or, with Protocol pico, PicoMQ's Pico
//     protocol (the stream's create and appends are alike in both).
//   - read: Readers goroutines each read one existing stream from the start
//     to the tail with plain GETs.
//   - populate: create Streams streams holding one deterministic Size-byte
//     record each; verify: read them back and compare.
package loadgen

import (
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Modes of Config.Mode.
const (
	ModeAppend   = "append"
	ModeSSE      = "sse"
	ModeRead     = "read"
	ModePopulate = "populate"
	ModeVerify   = "verify"
)

// Protocols of Config.Protocol: how sse mode's feeds ask for events and
// what their control events say.
const (
	ProtocolDurableStreams = "durable-streams"
	ProtocolPico           = "pico"
)

// Defaults of the command's flags.
const (
	DefaultWriters     = 64
	DefaultStreams     = 100
	DefaultSize        = 1024
	DefaultDuration    = 30 * time.Second
	DefaultContentType = "application/octet-stream"
	DefaultTimeout     = 30 * time.Second
	DefaultSSERate     = 20
)

// modeFlags are the flags of `caddy picomq bench` that only some modes
// read, each with those modes; every mode reads the others. It is the one
// place that says which settings a mode uses: the command warns of a flag
// given to a mode that ignores it, and a result leaves such settings zero.
var modeFlags = map[string][]string{
	"prefix":       {ModeAppend, ModeSSE, ModePopulate, ModeVerify},
	"writers":      {ModeAppend, ModePopulate, ModeVerify},
	"streams":      {ModeAppend, ModePopulate, ModeVerify},
	"size":         {ModeAppend, ModeSSE, ModePopulate, ModeVerify},
	"duration":     {ModeAppend, ModeSSE},
	"warmup":       {ModeAppend, ModeSSE},
	"rate":         {ModeAppend, ModeSSE},
	"content-type": {ModeAppend, ModeSSE, ModePopulate, ModeVerify},
	"create":       {ModeAppend, ModeSSE, ModePopulate},
	"subscribers":  {ModeSSE},
	"protocol":     {ModeSSE},
	"stream":       {ModeRead},
	"readers":      {ModeRead},
}

// FlagUsed reports whether mode (empty: append) reads the bench command's
// flag name (without the dashes). Flags that every mode reads, and names
// it does not know, are used.
func FlagUsed(mode, name string) bool {
	if mode == "" {
		mode = ModeAppend
	}
	modes, ok := modeFlags[name]
	return !ok || slices.Contains(modes, mode)
}

// NamedPID is a process to account CPU time and memory for.
type NamedPID struct {
	Name string
	PID  int
}

// Config describes one run.
type Config struct {
	URL    string // base URL; stream i is URL + Prefix + i
	Prefix string // stream-name prefix; empty picks "bench-" + 6 random characters
	Mode   string // one of the Mode constants; empty means append

	Writers  int
	Streams  int
	Size     int
	Duration time.Duration // the measured window (append and sse)
	Warmup   time.Duration // load before the window, not measured
	Rate     float64       // appends/s in total; 0 is closed loop (append), DefaultSSERate (sse)

	ContentType string
	Create      bool // PUT each stream before the run

	Subscribers int    // sse mode
	Protocol    string // sse mode: ProtocolDurableStreams (empty) or ProtocolPico
	Stream      string // read mode: the full stream name (no prefix)
	Readers     int    // read mode: at least 1

	PIDs    []NamedPID    // processes to account for besides this one
	Mark    string        // POSTed with ?phase=start and ?phase=end at the window's edges
	Timeout time.Duration // per request; 0 is DefaultTimeout

	// RootCAs, when set, are the certificate authorities an https:// URL's
	// certificate must chain to, in place of the system's: a staging CA, or
	// the local one Caddy's tls internal uses.
	RootCAs *x509.CertPool

	// Header is sent with every request to URL's host (never to Mark's),
	// as ParseHeader reads it: an Authorization for a site behind
	// authentication, say. A Host entry is the requests' Host.
	Header http.Header

	// Progress receives one line per second while running; nil for none.
	// With ProgressTTY each line overwrites the last (\r).
	Progress    io.Writer
	ProgressTTY bool

	// feeds picks how SSE feeds are read; the zero value chooses by URL.
	// Tests set it to cover every way.
	feeds feedReading
}

// feedReading is how subscribers read their SSE feeds.
type feedReading int

const (
	feedsByURL     feedReading = iota // by hand for http://, net/http for https://
	feedsNetHTTP                      // net/http's client
	feedsGoroutine                    // by hand, each feed on its own goroutine
)

// Check reports what Run would refuse in c, without running anything.
func (c Config) Check() error { return c.normalize() }

// normalize fills defaults and checks the configuration.
func (c *Config) normalize() error {
	if c.Mode == "" {
		c.Mode = ModeAppend
	}
	switch c.Mode {
	case ModeAppend, ModeSSE, ModeRead, ModePopulate, ModeVerify:
	default:
		return fmt.Errorf("unknown mode %q (want append, sse, read, populate or verify)", c.Mode)
	}
	if c.URL == "" {
		return errors.New("--url is required")
	}
	if c.Prefix == "" {
		c.Prefix = RandomPrefix()
	}
	appended := c.Prefix
	if c.Mode == ModeRead {
		appended = c.Stream
	}
	if err := checkBaseURL(c.URL, appended); err != nil {
		return err
	}
	if c.ContentType == "" {
		c.ContentType = DefaultContentType
	}
	if c.Timeout < 0 {
		return fmt.Errorf("--timeout %s: want more than 0", c.Timeout)
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	if c.Mode == ModeRead && c.Stream == "" {
		return errors.New("read mode needs --stream NAME")
	}
	if c.Mode == ModeRead && c.Readers <= 0 {
		// Silently reading with one reader would report figures for a
		// load that was not asked for.
		return fmt.Errorf("--readers %d: want at least 1", c.Readers)
	}
	// Only what the mode reads is checked: read mode with --writers 0,
	// say, is a run someone meant, and its figures do not depend on it.
	if FlagUsed(c.Mode, "writers") && c.Writers <= 0 {
		return fmt.Errorf("--writers %d: want at least 1", c.Writers)
	}
	if FlagUsed(c.Mode, "streams") && c.Streams <= 0 {
		return fmt.Errorf("--streams %d: want at least 1", c.Streams)
	}
	if c.Size < 0 {
		return fmt.Errorf("--size %d: want 0 or more", c.Size)
	}
	if c.Mode == ModeAppend && c.Size == 0 {
		return errors.New("--size 0: an empty append is not an append (it closes the stream)")
	}
	if c.Rate < 0 || math.IsNaN(c.Rate) || math.IsInf(c.Rate, 0) {
		// NaN passed for a closed loop and broke the JSON result at
		// the end; Inf scheduled appends 0s apart.
		return fmt.Errorf("--rate %g: want 0 or more", c.Rate)
	}
	switch c.Protocol {
	case "":
		c.Protocol = ProtocolDurableStreams
	case ProtocolDurableStreams:
	case ProtocolPico:
		if c.Mode != ModeSSE {
			return fmt.Errorf("--protocol pico is for sse mode; %s mode speaks Durable Streams", c.Mode)
		}
	default:
		return fmt.Errorf("unknown protocol %q (want durable-streams or pico)", c.Protocol)
	}
	if c.Mode == ModeSSE {
		if c.Rate == 0 {
			c.Rate = DefaultSSERate
		}
		if c.Subscribers <= 0 {
			return errors.New("sse mode needs --subscribers N (at least 1)")
		}
	}
	if (c.Mode == ModeAppend || c.Mode == ModeSSE) && c.Duration <= 0 {
		return fmt.Errorf("--duration %s: want more than 0", c.Duration)
	}
	if c.Warmup < 0 {
		return fmt.Errorf("--warmup %s: want 0 or more", c.Warmup)
	}
	if c.Mark != "" {
		// Found now, not when the window starts, after the streams are
		// created and the warm-up spent.
		if u, err := url.Parse(c.Mark); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("--mark %q: want an http:// or https:// URL", c.Mark)
		}
	}
	for _, p := range c.PIDs {
		if p.PID <= 0 || p.Name == "" {
			return fmt.Errorf("--pid %s=%d: want NAME=PID", p.Name, p.PID)
		}
	}
	if len(c.PIDs) > 0 && !procAvailable() {
		return errors.New("--pid reads the process's figures from /proc, which this system does not have (Linux only)")
	}
	// A process that cannot be read is found now, not at the start of the
	// window: by then the streams are created and the warm-up's load has
	// been spent.
	for _, p := range c.PIDs {
		if _, err := procStat(p.PID); err != nil {
			return fmt.Errorf("--pid %s=%d: cannot read the process: %w", p.Name, p.PID, err)
		}
	}
	return nil
}

// checkBaseURL checks that stream names, which start with appended (the
// prefix, or read mode's stream), can be appended to raw: an http or https
// URL with a host, a path (at least "/") unless appended starts one, and
// no query or fragment, which the names would land in.
func checkBaseURL(raw, appended string) error {
	if !strings.HasPrefix(raw, "http://") && !strings.HasPrefix(raw, "https://") {
		return fmt.Errorf("--url %q: want an http:// or https:// URL", raw)
	}
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Errorf("--url %q: %w", raw, err)
	}
	if u.Host == "" {
		return fmt.Errorf("--url %q: no host", raw)
	}
	if u.Path == "" && !strings.HasPrefix(appended, "/") {
		// Stream i is URL + prefix + i: without a path the name would be
		// glued to the host or port.
		return fmt.Errorf("--url %q: no path after the host; stream names are appended to the URL, so end it with a slash (%s/)", raw, raw)
	}
	if u.RawQuery != "" || u.ForceQuery || u.Fragment != "" {
		return fmt.Errorf("--url %q: stream names are appended to the URL, so it cannot have a query or a fragment", raw)
	}
	return nil
}

// RandomPrefix is "bench-" and 6 random lowercase letters and digits, so
// that runs against one server do not share streams.
func RandomPrefix() string {
	const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := []byte("bench-")
	for range 6 {
		b = append(b, alphabet[rand.IntN(len(alphabet))])
	}
	return string(b)
}

// ParseSize parses a byte count: a plain number or one with a unit, B, KB,
// KiB, MB, MiB, GB or GiB (case-insensitive; KB and K are 1000, KiB 1024).
func ParseSize(s string) (int, error) {
	t := strings.TrimSpace(s)
	i := 0
	for i < len(t) && (t[i] >= '0' && t[i] <= '9' || t[i] == '.') {
		i++
	}
	num, unit := t[:i], strings.ToLower(strings.TrimSpace(t[i:]))
	if num == "" {
		return 0, fmt.Errorf("size %q: want a number of bytes such as 1024, 1KiB or 1MiB", s)
	}
	mult := map[string]float64{
		"": 1, "b": 1,
		"k": 1e3, "kb": 1e3, "kib": 1 << 10,
		"m": 1e6, "mb": 1e6, "mib": 1 << 20,
		"g": 1e9, "gb": 1e9, "gib": 1 << 30,
	}[unit]
	if mult == 0 {
		return 0, fmt.Errorf("size %q: unknown unit %q (want B, KB, KiB, MB, MiB, GB or GiB)", s, t[i:])
	}
	f, err := strconv.ParseFloat(num, 64)
	if err != nil {
		return 0, fmt.Errorf("size %q: %v", s, err)
	}
	v := f * mult
	if v != float64(int64(v)) {
		return 0, fmt.Errorf("size %q is not a whole number of bytes", s)
	}
	if v > 1<<40 {
		return 0, fmt.Errorf("size %q is too large", s)
	}
	return int(v), nil
}

// ParseCACert reads PEM certificates, as --cacert gives them, into a pool.
func ParseCACert(pem []byte) (*x509.CertPool, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, errors.New("no PEM certificate in it")
	}
	return pool, nil
}

// ParseHeader parses "Name: value" as curl's -H takes it, and returns the
// canonical name. The headers the load generator sets itself to frame its
// requests are refused, Content-Type among them (--content-type sets that
// one, and the streams are created with it).
func ParseHeader(s string) (name, value string, err error) {
	name, value, ok := strings.Cut(s, ":")
	name, value = strings.TrimSpace(name), strings.TrimSpace(value)
	if !ok || !validHeaderName(name) {
		return "", "", fmt.Errorf("--header %q: want NAME: VALUE with a header name before the colon", s)
	}
	if strings.ContainsFunc(value, func(r rune) bool { return r < ' ' && r != '\t' || r == 0x7f }) {
		return "", "", fmt.Errorf("--header %q: the value has a control character", s)
	}
	name = http.CanonicalHeaderKey(name)
	switch name {
	case "Content-Type":
		return "", "", fmt.Errorf("--header %q: use --content-type", s)
	case "Content-Length", "Transfer-Encoding", "Connection", "Upgrade", "Te", "Trailer", "Expect":
		return "", "", fmt.Errorf("--header %q: the load generator sets %s itself", s, name)
	}
	return name, value, nil
}

// validHeaderName reports whether name is an HTTP token (RFC 9110).
func validHeaderName(name string) bool {
	if name == "" {
		return false
	}
	for _, c := range []byte(name) {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
			strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
		if !ok {
			return false
		}
	}
	return true
}

// ParsePID parses NAME=PID.
func ParsePID(s string) (NamedPID, error) {
	name, num, ok := strings.Cut(s, "=")
	if !ok || name == "" {
		return NamedPID{}, fmt.Errorf("--pid %q: want NAME=PID", s)
	}
	pid, err := strconv.Atoi(num)
	if err != nil || pid <= 0 {
		return NamedPID{}, fmt.Errorf("--pid %q: %q is not a process id", s, num)
	}
	return NamedPID{Name: name, PID: pid}, nil
}
