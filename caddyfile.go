package picomq

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/dustin/go-humanize"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("picomq", parseCaddyfile)
	// A terminal handler, like respond: running it before respond lets a
	// site answer streams under one path and static replies elsewhere
	// without an explicit order option.
	httpcaddyfile.RegisterDirectiveOrder("picomq", httpcaddyfile.Before, "respond")
	// Written among the global options, picomq would get Caddy's bare
	// "unrecognized global option"; say where it goes instead.
	httpcaddyfile.RegisterGlobalOption("picomq", refuseGlobalOption)
}

// refuseGlobalOption refuses picomq as a global option: its options
// belong to a site's handler.
func refuseGlobalOption(d *caddyfile.Dispenser, _ any) (any, error) {
	d.Next() // the option name
	return nil, d.Err("picomq is a site directive, not a global option: put it inside a site block, " +
		"as in: localhost { picomq { storage s3://bucket/prefix } }")
}

// parseCaddyfile builds a Handler from the picomq directive.
func parseCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	var handler Handler
	if err := handler.UnmarshalCaddyfile(h.Dispenser); err != nil {
		return nil, err
	}
	return &handler, nil
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. The syntax is
// shown on Handler.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the directive name
	if d.NextArg() {
		// A matcher token was taken by Caddy before this; what is left
		// is most often a storage URL written where a block belongs.
		return d.Errf("picomq takes no argument but a matcher, got %q; options go in a block, as in: picomq { storage <url> }", d.Val())
	}
	seen := make(map[string]bool)
	for d.NextBlock(0) {
		opt := d.Val()
		if seen[opt] {
			return d.Errf("%s given more than once", opt)
		}
		seen[opt] = true
		if opt == "{" {
			return d.Err("unexpected '{': picomq options take no block")
		}
		if !caddyfileOptions[opt] {
			// Before the argument count: a misspelt flag is reported as
			// unknown, not as a wrong number of arguments.
			return d.Errf("unrecognized picomq option %q", opt)
		}
		args := d.RemainingArgs()
		if opt == "allow_loopback_webhooks" { // a flag: no argument
			if len(args) != 0 {
				return d.Errf("%s: wrong argument count: it takes no value, got %q", opt, strings.Join(args, " "))
			}
			h.AllowLoopbackWebhooks = true
			continue
		}
		switch len(args) {
		case 0:
			return d.Errf("%s: wrong argument count: it takes one value, got none", opt)
		case 1:
		default:
			return d.Errf("%s: wrong argument count: it takes one value, got %d (%s)", opt, len(args), strings.Join(args, " "))
		}
		arg := args[0]
		var err error
		switch opt {
		case "protocol":
			if arg != protocolDurableStreams && arg != protocolPico {
				return d.Errf("protocol: unknown protocol %q (use %s or %s)", arg, protocolDurableStreams, protocolPico)
			}
			h.Protocol = arg
		case "storage":
			// A URL with runtime placeholders ({env.X}) is checked when
			// they are replaced, at provisioning.
			if !strings.Contains(arg, "{") {
				// Here the error names the line; Validate checks it
				// again, for JSON configs.
				if err := checkStorageURL(arg); err != nil {
					return d.Errf("storage: %v", err)
				}
			}
			h.Storage = arg
		case "flush_interval":
			h.FlushInterval, err = parseDuration(arg)
		case "flush_size":
			h.FlushSize, err = parseSize(arg)
		case "flush_quiet":
			h.FlushQuiet, err = parseDuration(arg)
		case "max_pending":
			h.MaxPending, err = parseSize(arg)
		case "long_poll_timeout":
			h.LongPollTimeout, err = parseDuration(arg)
		case "sse_reconnect_interval":
			h.SSEReconnectInterval, err = parseDuration(arg)
		case "sse_keepalive":
			h.SSEKeepAlive, err = parseDuration(arg)
		case "max_append_size":
			h.MaxAppendSize, err = parseSize(arg)
		case "cache_size":
			h.CacheSize, err = parseSize(arg)
		case "compact_interval":
			h.CompactInterval, err = parseDuration(arg)
		case "pack_below":
			h.PackBelow = -1
			if arg != "off" {
				h.PackBelow, err = parseSize(arg)
			}
		case "merge_below":
			h.MergeBelow = -1
			if arg != "off" {
				h.MergeBelow, err = parseSize(arg)
			}
		case "s3_timeout":
			h.S3Timeout, err = parseDuration(arg)
		case "expiry_sweep_interval":
			h.ExpirySweepInterval, err = parseDuration(arg)
		case "grave_time":
			h.GraveTime, err = parseDuration(arg)
		case "lease_ttl":
			h.LeaseTTL, err = parseDuration(arg)
			if err == nil && time.Duration(h.LeaseTTL) < minLeaseTTL {
				// Validate holds this too; here the error names the line.
				err = fmt.Errorf("must be at least %s, got %s", minLeaseTTL, arg)
			}
		case "max_subscriptions":
			h.MaxSubscriptions, err = parseCount(arg)
		case "cache_reads":
			if err := checkCacheReads(arg); err != nil {
				return d.Err(err.Error()) // the error names the option
			}
			h.CacheReads = arg
		default:
			return d.Errf("unrecognized picomq option %q", opt)
		}
		if err != nil {
			return d.Errf("%s: %v", opt, err)
		}
		if loopDurations[opt] {
			// Validate holds this too; here the error names the line.
			if v, _ := caddy.ParseDuration(arg); v < minLoopDuration {
				return d.Errf("%s: must be at least %s, got %s", opt, minLoopDuration, arg)
			}
		}
		if limit, ok := sizeLimits[opt]; ok && arg != "off" {
			// Validate holds these too, for JSON configs; here the error
			// names the line and the value as written, not a byte count.
			if n, _ := parseSize(arg); n > limit.bytes {
				return d.Errf("%s: must be at most %s, got %s", opt, limit.text, arg)
			}
		}
	}
	return nil
}

// sizeLimits are the size options with a bound below parseSize's own 1TiB,
// as Validate checks them.
var sizeLimits = map[string]struct {
	bytes int64
	text  string
}{
	"flush_size":      {maxFlushSize, "1GiB"},
	"max_append_size": {maxAppendSizeLimit, "1GiB"},
	"pack_below":      {maxPackBelow, "16MiB"},
	"merge_below":     {maxMergeBelow, "4MiB"},
}

// caddyfileOptions are the subdirectives of picomq.
var caddyfileOptions = map[string]bool{
	"protocol": true, "storage": true, "flush_interval": true, "flush_size": true,
	"flush_quiet": true, "max_pending": true, "long_poll_timeout": true,
	"sse_reconnect_interval": true, "sse_keepalive": true, "max_append_size": true, "cache_size": true,
	"compact_interval": true, "pack_below": true, "merge_below": true, "s3_timeout": true,
	"expiry_sweep_interval": true, "grave_time": true, "lease_ttl": true, "allow_loopback_webhooks": true,
	"max_subscriptions": true, "cache_reads": true,
}

// parseCount parses a positive count such as 1000.
func parseCount(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n <= 0 || n > maxSubscriptionsLimit {
		return 0, fmt.Errorf("want a count between 1 and %d, got %q", maxSubscriptionsLimit, s)
	}
	return n, nil
}

// parseDuration parses a Caddyfile duration; zero is refused because the
// JSON config reads zero as "use the default".
func parseDuration(s string) (caddy.Duration, error) {
	d, err := caddy.ParseDuration(s)
	if err != nil {
		return 0, err
	}
	if d <= 0 {
		return 0, fmt.Errorf("must be positive, got %s", s)
	}
	return caddy.Duration(d), nil
}

// parseSize parses a size such as 1MiB, 64KB or 1048576. A number under
// minBareSize needs a unit (512B).
func parseSize(s string) (int64, error) {
	if strings.Contains(s, ",") {
		// humanize drops every comma as a digit group separator, so a
		// decimal comma (1,5MiB) was read as fifteen MiB.
		return 0, fmt.Errorf("invalid size %q: a size takes no comma (1.5MiB is one and a half MiB, 1048576 that many bytes)", s)
	}
	n, err := humanize.ParseBytes(s)
	if err != nil {
		// humanize's own error names neither the value nor the syntax
		// (`strconv.ParseFloat: parsing "": invalid syntax`).
		return 0, fmt.Errorf("invalid size %q (a number of bytes, with an optional unit such as KiB, MiB, MB)", s)
	}
	if n == 0 || n > 1<<40 {
		return 0, fmt.Errorf("must be between 1B and 1TiB, got %s", s)
	}
	if n < minBareSize && s[len(s)-1] >= '0' && s[len(s)-1] <= '9' {
		// "cache_size 64" is bytes to the parser, but almost surely
		// meant 64MiB: taken as bytes it would be a cache that holds
		// nothing, or appends refused as busy or too large, with
		// nothing to say why. A unit says bytes are meant.
		return 0, fmt.Errorf("%s has no unit, and %s bytes is too small to be meant; "+
			"write the unit: %sMiB, %sKiB, or %sB if bytes are what you mean", s, s, s, s, s)
	}
	return int64(n), nil
}

// minBareSize is the least size parseSize accepts without a unit.
const minBareSize = 1024

// Interface guard.
var _ caddyfile.Unmarshaler = (*Handler)(nil)
