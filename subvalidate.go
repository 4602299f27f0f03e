package picomq

// Subscriptions: patterns, paths and webhook URLs, checked before they are kept.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"strings"
	"syscall"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/picomq/caddy-picomq/streamstore"
)

// globMatch: "*" matches one path segment, "**" zero or more.
func globMatch(pattern, path string) bool {
	return globSegs(strings.Split(strings.Trim(pattern, "/"), "/"), strings.Split(path, "/"))
}

// globSegs matches path segments s against pattern segments p in
// O(len(p)·len(s)) steps. The pattern comes from a client: a backtracking
// match would take exponential time on one with many "**" segments that
// fails at its end (each "**" trying every split of the path), spinning a
// core for good on every append to a stream under the subscription's root.
// reach[j] says whether the pattern segments seen so far match s[:j].
func globSegs(p, s []string) bool {
	reach := make([]bool, len(s)+1)
	reach[0] = true
	for _, seg := range p {
		if seg == "**" {
			// Zero or more segments: whatever was reached, and every
			// position after it.
			for j := 1; j <= len(s); j++ {
				reach[j] = reach[j] || reach[j-1]
			}
			continue
		}
		// Exactly one segment: shift by one where it matches.
		for j := len(s); j >= 1; j-- {
			reach[j] = reach[j-1] && (seg == "*" || seg == s[j-1])
		}
		reach[0] = false
	}
	return reach[len(s)]
}

// globLiteralPrefix is the pattern's segments before its first wildcard, for
// a listing prefix: every path the pattern matches starts with it. When
// what follows can match no segment at all (nothing, or only "**"), the
// last literal segment is left out: "events/a" and "events/a/**" match the
// stream "events/a" itself, of which "events/a/" is no prefix.
func globLiteralPrefix(pattern string) string {
	segs := strings.Split(strings.Trim(pattern, "/"), "/")
	k := 0
	for k < len(segs) && !strings.Contains(segs[k], "*") {
		k++
	}
	more := false // the path has a segment after the literal ones
	for _, seg := range segs[k:] {
		more = more || seg != "**"
	}
	if !more && k > 0 {
		k--
	}
	var b strings.Builder
	for _, seg := range segs[:k] {
		b.WriteString(seg + "/")
	}
	return b.String()
}

// validPattern bounds a subscription's glob pattern by the longest stream
// name: every append to a stream under the subscription's root is matched
// against it, so a pattern as large as the body allows would cost every
// append that much work.
func validPattern(pattern string) error {
	if len(pattern) > streamstore.MaxNameLength {
		return fmt.Errorf("pattern is %d bytes; the limit is %d", len(pattern), streamstore.MaxNameLength)
	}
	return nil
}

func validRelPath(root, p string) bool {
	if p == "" || p == reservedSegment || strings.HasPrefix(p, reservedSegment+"/") {
		return false
	}
	return streamstore.ValidateName(root+p) == nil
}

// wakeStreamProblem says what is wrong with the wake_stream of a pull-wake
// subscription under root, or "" when nothing is. A stream no create can
// make (a __ds segment is Durable Streams' own) would take the wake events
// of the subscription for ever, each retried on the webhook backoff.
func wakeStreamProblem(root, wake string) string {
	switch {
	case wake == "":
		return "wake_stream is required"
	case !validRelPath(root, wake):
		return fmt.Sprintf("wake_stream %q is no stream path under %s", wake, root)
	case hasReservedSegment(wake):
		return fmt.Sprintf("wake_stream %q has a %s segment, under which no stream can be created", wake, reservedSegment)
	}
	return ""
}

// validSubRoute checks the stream root and id of a subscription to create.
// Both go into its document and answers as JSON strings, and the id into
// the callback_url of its webhooks: an id that is not UTF-8 would come back
// as U+FFFD, naming another subscription; "." and ".." are dot segments
// that clients remove from a URL; a control byte has no place in one. A
// root that no stream name starts with (a dot or empty segment, NUL, not
// UTF-8) would make a subscription that matches nothing. Only creates are
// checked, so a subscription made before this rule can still be deleted.
func validSubRoute(root, id string) error {
	if root != "/" {
		if err := streamstore.ValidateName(strings.TrimSuffix(root, "/")); err != nil {
			return fmt.Errorf("the stream root %q is no stream path: %s", root, badRequestReason(err))
		}
	}
	switch {
	case !utf8.ValidString(id):
		return errors.New("the subscription id is not valid UTF-8")
	case id == "." || id == "..":
		return fmt.Errorf("the subscription id may not be %q", id)
	case strings.ContainsFunc(id, unicode.IsControl):
		return errors.New("the subscription id contains a control character")
	}
	return nil
}

// validateWebhookURL applies sections 6.2 and 12.8: https to a public
// address, or, when allowLoopback (the allow_loopback_webhooks option), the
// development exception http://localhost / http://127.0.0.x. Addresses are
// checked again at connect time (webhookDialControl), so DNS cannot point an
// accepted name at a private or loopback address.
func validateWebhookURL(raw string, allowLoopback bool) error {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" || u.User != nil {
		return errors.New("webhook.url must be an absolute URL without credentials")
	}
	host := u.Hostname()
	if isLoopbackDevHost(host) {
		if !allowLoopback {
			return errors.New("webhook.url is on localhost, which this server does not allow (allow_loopback_webhooks)")
		}
		if u.Scheme != "http" && u.Scheme != "https" {
			return errors.New("webhook.url must be http or https")
		}
		return nil
	}
	if u.Scheme != "https" {
		return errors.New("webhook.url must use https (http only for localhost)")
	}
	if ip, err := netip.ParseAddr(host); err == nil && !publicAddr(ip) {
		return errors.New("webhook.url points at a private, loopback or link-local address")
	}
	if strings.EqualFold(host, "metadata.google.internal") || strings.HasSuffix(strings.ToLower(host), ".internal") {
		return errors.New("webhook.url points at an internal host")
	}
	return nil
}

// isLoopbackDevHost is the development exception: localhost and 127.0.0.x.
func isLoopbackDevHost(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip, err := netip.ParseAddr(host)
	return err == nil && ip.Is4() && ip.As4()[0] == 127 && ip.As4()[1] == 0 && ip.As4()[2] == 0
}

// publicAddr reports whether ip is an address a webhook may be delivered
// to: one that is globally reachable and stands for itself. IPv4 excludes
// the special-purpose ranges (RFC 6890 and its updates) besides RFC 1918's;
// IPv6 is taken only in global unicast (2000::/3), so NAT64 prefixes
// (64:ff9b::/96, 64:ff9b:1::/48), IPv4-compatible addresses, ULAs,
// link-local and multicast are out, and within it the blocks that embed or
// tunnel to an IPv4 address a NAT64, 6to4 or Teredo relay would reach
// (64:ff9b::a00:5 is 10.0.0.5 behind a NAT64 gateway), and documentation
// blocks.
func publicAddr(ip netip.Addr) bool {
	ip = ip.Unmap()
	if !ip.IsValid() || ip.Zone() != "" {
		return false
	}
	nonPublic := nonPublicV6
	if ip.Is4() {
		nonPublic = nonPublicV4
	} else if !globalUnicastV6.Contains(ip) {
		return false
	}
	for _, p := range nonPublic {
		if p.Contains(ip) {
			return false
		}
	}
	return true
}

// globalUnicastV6 is the only IPv6 block webhooks may reach (RFC 4291).
var globalUnicastV6 = netip.MustParsePrefix("2000::/3")

// nonPublicV4 are the IPv4 blocks that are not globally reachable, or not
// unicast (IANA's special-purpose registry).
var nonPublicV4 = mustPrefixes(
	"0.0.0.0/8",       // this network
	"10.0.0.0/8",      // private
	"100.64.0.0/10",   // shared address space (CGNAT)
	"127.0.0.0/8",     // loopback
	"169.254.0.0/16",  // link-local, cloud metadata
	"172.16.0.0/12",   // private
	"192.0.0.0/24",    // IETF protocol assignments
	"192.0.2.0/24",    // documentation
	"192.88.99.0/24",  // 6to4 relay anycast
	"192.168.0.0/16",  // private
	"198.18.0.0/15",   // benchmarking
	"198.51.100.0/24", // documentation
	"203.0.113.0/24",  // documentation
	"224.0.0.0/4",     // multicast
	"240.0.0.0/4",     // reserved, and the limited broadcast address
)

// nonPublicV6 are the blocks of 2000::/3 that are not globally reachable
// or that lead to another address than their own.
var nonPublicV6 = mustPrefixes(
	"2001::/23",     // IETF protocol assignments, Teredo (2001::/32) among them
	"2001:db8::/32", // documentation
	"2002::/16",     // 6to4: embeds an IPv4 address
	"3fff::/20",     // documentation
)

func mustPrefixes(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}

// webhookDialControl refuses connections to non-public addresses; with
// loopback, it also allows loopback ones (the development exception).
func webhookDialControl(loopback bool) func(string, string, syscall.RawConn) error {
	return func(_, address string, _ syscall.RawConn) error {
		ap, err := netip.ParseAddrPort(address)
		if err != nil {
			return err
		}
		ip := ap.Addr().Unmap()
		if publicAddr(ip) || (loopback && ip.IsLoopback()) {
			return nil
		}
		return fmt.Errorf("webhook address %s is not public", ip)
	}
}

// loopbackKey marks a delivery whose subscription may reach loopback.
type loopbackKey struct{}

// webhookDial connects with the address check for the delivery's
// subscription (see subState.Loopback).
func webhookDial(ctx context.Context, network, addr string) (net.Conn, error) {
	loopback, _ := ctx.Value(loopbackKey{}).(bool)
	d := net.Dialer{Timeout: 5 * time.Second, Control: webhookDialControl(loopback)}
	return d.DialContext(ctx, network, addr)
}

// readJSONBody decodes a control request's JSON body into v, answering
// itself when it cannot: 413 naming the limit for a body over subMaxBody or
// over Caddy's request_body max_size (a 400 would tell the client that its
// request is malformed), 415 for one with a content coding, 408 for one
// that stopped arriving, 400 for anything else.
