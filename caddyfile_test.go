package picomq

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	// The directives a site uses around picomq (handle_path, route, ...).
	_ "github.com/caddyserver/caddy/v2/modules/standard"
)

func TestUnmarshalCaddyfile(t *testing.T) {
	d := caddyfile.NewTestDispenser(`picomq {
		protocol durable-streams
		storage s3://bucket/prefix?region=eu-west-1&endpoint=http://127.0.0.1:7070&path_style=true
		flush_interval 5ms
		flush_size 2MiB
		flush_quiet 500us
		max_pending 32MiB
		long_poll_timeout 20s
		sse_reconnect_interval 1m
		sse_keepalive 15s
		max_append_size 8MB
		cache_size 128MiB
		compact_interval 1m
		pack_below 64KiB
		merge_below 128KiB
		s3_timeout 3s
		expiry_sweep_interval 10m
		grave_time 30m
		lease_ttl 10s
		max_subscriptions 50
		cache_reads private
	}`)
	var h Handler
	if err := h.UnmarshalCaddyfile(d); err != nil {
		t.Fatal(err)
	}
	want := Handler{
		Protocol:             "durable-streams",
		Storage:              "s3://bucket/prefix?region=eu-west-1&endpoint=http://127.0.0.1:7070&path_style=true",
		FlushInterval:        caddy.Duration(5 * time.Millisecond),
		FlushSize:            2 << 20,
		FlushQuiet:           caddy.Duration(500 * time.Microsecond),
		MaxPending:           32 << 20,
		LongPollTimeout:      caddy.Duration(20 * time.Second),
		SSEReconnectInterval: caddy.Duration(time.Minute),
		SSEKeepAlive:         caddy.Duration(15 * time.Second),
		MaxAppendSize:        8_000_000,
		CacheSize:            128 << 20,
		CompactInterval:      caddy.Duration(time.Minute),
		PackBelow:            64 << 10,
		MergeBelow:           128 << 10,
		S3Timeout:            caddy.Duration(3 * time.Second),
		ExpirySweepInterval:  caddy.Duration(10 * time.Minute),
		GraveTime:            caddy.Duration(30 * time.Minute),
		LeaseTTL:             caddy.Duration(10 * time.Second),
		MaxSubscriptions:     50,
		CacheReads:           "private",
	}
	if got, _ := json.Marshal(h); string(got) != string(mustJSON(t, want)) {
		t.Errorf("got  %s\nwant %s", got, mustJSON(t, want))
	}
}

// pack_below off turns packs off, merge_below off merging: -1 in JSON, as
// zero means the default. Validate refuses a size past the bound.
func TestUnmarshalCaddyfileSizesOff(t *testing.T) {
	for _, tc := range []struct {
		option string
		field  func(*Handler) *int64
		over   int64
	}{
		{"pack_below", func(h *Handler) *int64 { return &h.PackBelow }, 32 << 20},
		{"merge_below", func(h *Handler) *int64 { return &h.MergeBelow }, 8 << 20},
	} {
		var h Handler
		if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("picomq {\n " + tc.option + " off\n}")); err != nil {
			t.Fatal(err)
		}
		if got := *tc.field(&h); got != -1 {
			t.Fatalf("%s off gave %d, want -1", tc.option, got)
		}
		h.applyDefaults()
		if err := h.Validate(); err != nil {
			t.Fatalf("%s off: %v", tc.option, err)
		}
		*tc.field(&h) = tc.over
		if err := h.Validate(); err == nil || !strings.Contains(err.Error(), tc.option) {
			t.Fatalf("%s %d: %v; want refused", tc.option, tc.over, err)
		}
	}
}

// TestOptionsAtTheirBound: a value at its bound is taken, in the Caddyfile
// and through Validate: each duration with a floor at the floor, each size
// at its ceiling (the bounds are inclusive, as Validate's).
func TestOptionsAtTheirBound(t *testing.T) {
	if len(loopDurations) != 7 {
		t.Fatalf("loopDurations has %d options; update this test", len(loopDurations))
	}
	lines := []string{"pack_below 16MiB", "merge_below 4MiB", "flush_size 1GiB", "max_append_size 1GiB"}
	for o := range loopDurations {
		lines = append(lines, o+" 100ms")
	}
	for _, line := range lines {
		var h Handler
		if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("picomq {\n\t" + line + "\n}")); err != nil {
			t.Errorf("%q: %v", line, err)
			continue
		}
		h.applyDefaults()
		if err := h.Validate(); err != nil {
			t.Errorf("%q: validate: %v", line, err)
		}
	}
}

// TestUnmarshalCaddyfileCacheReads: cache_reads takes public or private,
// and a handler without it keeps today's public reads.
func TestUnmarshalCaddyfileCacheReads(t *testing.T) {
	for _, tc := range []struct{ src, want string }{
		{"picomq", cacheReadsPublic},
		{"picomq {\n\tcache_reads public\n}", cacheReadsPublic},
		{"picomq {\n\tcache_reads private\n}", cacheReadsPrivate},
	} {
		var h Handler
		if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.src)); err != nil {
			t.Fatalf("%q: %v", tc.src, err)
		}
		h.applyDefaults()
		if err := h.Validate(); err != nil {
			t.Fatalf("%q: %v", tc.src, err)
		}
		if h.CacheReads != tc.want {
			t.Errorf("%q: cache_reads %q, want %q", tc.src, h.CacheReads, tc.want)
		}
	}
}

func TestUnmarshalCaddyfileEmpty(t *testing.T) {
	for _, src := range []string{`picomq`, `picomq {
	}`} {
		var h Handler
		if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(src)); err != nil {
			t.Errorf("%q: %v", src, err)
		}
		if got := string(mustJSON(t, h)); got != "{}" {
			t.Errorf("%q: %s", src, got)
		}
	}
}

// TestUnmarshalCaddyfileErrors: every subdirective with a bad value, a
// missing value or one too many, and an unknown subdirective, is refused
// with an error that names the problem and the line it is on. Each bad
// line comes third, after a good one, so the line number is checked.
func TestUnmarshalCaddyfileErrors(t *testing.T) {
	durations := []string{"flush_interval", "flush_quiet", "long_poll_timeout", "sse_reconnect_interval", "sse_keepalive",
		"compact_interval", "s3_timeout", "expiry_sweep_interval", "grave_time", "lease_ttl"}
	sizes := []string{"flush_size", "max_pending", "max_append_size", "cache_size", "pack_below", "merge_below"}
	type tc struct{ line, want string }
	cases := []tc{
		{"bogus 1", `unrecognized picomq option "bogus"`},
		{"bogus", `unrecognized picomq option "bogus"`},
		{"allow_loopback_webhook", `unrecognized picomq option "allow_loopback_webhook"`},
		{"allow_loopback_webhooks yes", `allow_loopback_webhooks: wrong argument count: it takes no value, got "yes"`},
		{"protocol", "protocol: wrong argument count: it takes one value, got none"},
		{"protocol mqtt", `protocol: unknown protocol "mqtt" (use durable-streams or pico)`},
		{"protocol pico durable-streams", "protocol: wrong argument count: it takes one value, got 2 (pico durable-streams)"},
		{"storage", "storage: wrong argument count: it takes one value, got none"},
		{"storage s3://bkt/p region=eu-west-1", "storage: wrong argument count: it takes one value, got 2 (s3://bkt/p region=eu-west-1)"},
		{"storage ftp://x/y", `storage: storage URL "ftp://x/y": unsupported scheme "ftp"`},
		{"storage file://relative/dir", "a file URL needs an absolute path"},
		{"storage s3:///prefix", "missing bucket"},
		// What only the store's own parser knew used to pass the
		// Caddyfile and fail at provisioning, without a line.
		{"storage s3://my-bucket/p?regoin=eu-west-1", `storage: storage URL: unknown parameter "regoin" (known: region, endpoint, path_style)`},
		{"storage s3://My_Bucket/p", `storage: storage URL: invalid bucket name "My_Bucket"`},
		{"storage s3://my-bucket/p?path_style=yes", `storage: storage URL: path_style="yes": want true or false`},
		{"storage s3://my-bucket/p?endpoint=127.0.0.1:9000", "storage: storage URL: endpoint does not parse as a URL"},
		{"storage file:///srv/streams?sync=1", "file URLs take no parameters"},
		{"storage file:///a {\n}", "unexpected '{': picomq options take no block"},
		// What follows a '#' is a fragment to url.Parse, which it used
		// to drop without a word: a prefix or a parameter lost.
		{"storage s3://my-bucket/team#1", `storage: storage URL "s3://my-bucket/team": a '#' ends the URL there, and what follows it would be ignored; remove it, or write a '#' that belongs in the prefix as %23`},
		{"storage s3://my-bucket/p?region=eu-west-1#&path_style=true", `storage URL "s3://my-bucket/p?region=eu-west-1": a '#' ends the URL`},
		{"storage s3://my-bucket/p#", "a '#' ends the URL"},
		{"storage file:///srv/streams#old", `storage URL "file:///srv/streams": a '#' ends the URL`},
		{"pack_below none", `pack_below: invalid size "none"`},
		{"max_subscriptions", "max_subscriptions: wrong argument count: it takes one value, got none"},
		{"max_subscriptions many", `max_subscriptions: want a count between 1 and 1073741824, got "many"`},
		{"max_subscriptions 0", `max_subscriptions: want a count between 1 and 1073741824, got "0"`},
		{"max_subscriptions 1.5", `max_subscriptions: want a count`},
		{"cache_reads", "cache_reads: wrong argument count: it takes one value, got none"},
		{"cache_reads public private", "cache_reads: wrong argument count: it takes one value, got 2 (public private)"},
		{"cache_reads privat", `cache_reads: unknown value "privat" (use public or private)`},
		{"cache_reads Private", `cache_reads: unknown value "Private" (use public or private)`},
		{"cache_reads off", `cache_reads: unknown value "off" (use public or private)`},
		// Bounds below 1TiB, named with the line and the value as written.
		{"pack_below 32MiB", "pack_below: must be at most 16MiB, got 32MiB"},
		{"pack_below 16777217", "pack_below: must be at most 16MiB, got 16777217"},
		{"merge_below 5MiB", "merge_below: must be at most 4MiB, got 5MiB"},
		{"flush_size 2GiB", "flush_size: must be at most 1GiB, got 2GiB"},
		{"max_append_size 1.5GiB", "max_append_size: must be at most 1GiB, got 1.5GiB"},
		// A lease renewed every third of 1s leaves a store no room.
		{"lease_ttl 1s", "lease_ttl: must be at least 3s, got 1s"},
		{"lease_ttl 2999ms", "lease_ttl: must be at least 3s, got 2999ms"},
	}
	for _, o := range durations {
		cases = append(cases,
			tc{o, o + ": wrong argument count: it takes one value, got none"},
			tc{o + " 1s 2s", o + ": wrong argument count: it takes one value, got 2 (1s 2s)"},
			tc{o + " soon", o + `: time: invalid duration "soon"`},
			tc{o + " 5", o + `: time: missing unit in duration "5"`},
			tc{o + " 0s", o + ": must be positive, got 0s"},
			tc{o + " -1s", o + ": must be positive, got -1s"},
		)
	}
	for o := range loopDurations {
		// Far too short for what it paces, though positive.
		cases = append(cases, tc{o + " 50ms", o + ": must be at least 100ms, got 50ms"})
	}
	for _, o := range sizes {
		cases = append(cases,
			tc{o, o + ": wrong argument count: it takes one value, got none"},
			tc{o + " 1MiB 2MiB", o + ": wrong argument count: it takes one value, got 2 (1MiB 2MiB)"},
			tc{o + " lots", o + `: invalid size "lots"`},
			tc{o + " -5", o + `: invalid size "-5"`},
			tc{o + " 0", o + ": must be between 1B and 1TiB, got 0"},
			tc{o + " 2TiB", o + ": must be between 1B and 1TiB, got 2TiB"},
			// Under 1KiB a number without a unit is a slip for MiB
			// far more often than a size in bytes.
			tc{o + " 64", o + ": 64 has no unit, and 64 bytes is too small to be meant; write the unit: 64MiB, 64KiB, or 64B if bytes are what you mean"},
			tc{o + " 1023", o + ": 1023 has no unit"},
			tc{o + " 1.5", o + ": 1.5 has no unit"},
			// humanize drops commas as thousands separators, so a
			// decimal comma made 1,5MiB fifteen MiB without a word.
			tc{o + " 1,5MiB", o + `: invalid size "1,5MiB": a size takes no comma (1.5MiB is one and a half MiB, 1048576 that many bytes)`},
			tc{o + " 1,048,576", o + `: invalid size "1,048,576": a size takes no comma`},
		)
	}
	for _, c := range cases {
		src := "picomq {\n\t# options\n\t" + c.line + "\n}"
		var h Handler
		err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(src))
		if err == nil {
			t.Errorf("%q was accepted: %s", c.line, mustJSON(t, h))
			continue
		}
		if !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "Testfile:3") {
			t.Errorf("%q: %v\n\twant an error naming line 3 (Testfile:3) and saying %q", c.line, err, c.want)
		}
	}
	for _, c := range []tc{
		{"picomq extra", `picomq takes no argument but a matcher, got "extra"; options go in a block, as in: picomq { storage <url> }, at Testfile:1`},
		{"picomq {\n\tstorage file:///a\n\tstorage file:///b\n}", "storage given more than once, at Testfile:3"},
	} {
		var h Handler
		if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(c.line)); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: %v, want an error saying %q", c.line, err, c.want)
		}
	}
	// A storage URL with runtime placeholders is checked at provisioning.
	var h Handler
	if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("picomq {\n\tstorage s3://{env.BUCKET}/p\n}")); err != nil {
		t.Errorf("storage with a placeholder: %v", err)
	}
}

// TestCaddyfileArgumentAfterMatcher: through the Caddyfile adapter, which
// takes a matcher off the line first, a storage URL written on the
// directive's line is named in the error with where it belongs.
func TestCaddyfileArgumentAfterMatcher(t *testing.T) {
	for _, line := range []string{"picomq s3://bkt/p", "picomq /streams/* s3://bkt/p"} {
		src := "{\n\tadmin off\n}\n:0 {\n\t" + line + "\n}\n"
		_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(src), map[string]any{"filename": "Caddyfile"})
		want := `picomq takes no argument but a matcher, got "s3://bkt/p"; options go in a block, as in: picomq { storage <url> }, at Caddyfile:5`
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v, want an error saying %q", line, err, want)
		}
	}
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// adapt turns a Caddyfile into JSON config, as "caddy adapt" does.
func adapt(t *testing.T, src string) []byte {
	t.Helper()
	js, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(src), map[string]any{"filename": "Caddyfile"})
	if err != nil {
		t.Fatalf("adapt: %v", err)
	}
	for _, w := range warnings {
		t.Logf("adapt warning: %s", w.Message)
	}
	return js
}

// validate provisions every module of a config without starting it, as
// "caddy adapt --validate" does.
func validate(t *testing.T, js []byte) error {
	t.Helper()
	var cfg caddy.Config
	if err := json.Unmarshal(js, &cfg); err != nil {
		t.Fatalf("decoding config: %v", err)
	}
	return caddy.Validate(&cfg)
}

func TestCaddyfileDirectiveOrder(t *testing.T) {
	// No "order" option needed: picomq runs before respond.
	js := string(adapt(t, `{
		admin off
	}
	:8080 {
		respond "fallback"
		picomq /streams/*
	}`))
	p, r := strings.Index(js, `"handler":"picomq"`), strings.Index(js, `"handler":"static_response"`)
	if p < 0 || r < 0 || p > r {
		t.Errorf("picomq should come before respond: %s", js)
	}
	// An explicit order option is still accepted.
	adapt(t, `{
		admin off
		order picomq before respond
	}
	:8080 {
		picomq
	}`)
}

func TestValidateS3ConfigOffline(t *testing.T) {
	data := t.TempDir()
	t.Setenv("XDG_DATA_HOME", data)
	t.Setenv("PICOMQ_TEST_BUCKET", "offline-bucket")
	// 127.0.0.1:9 (discard) never answers: validation must not try.
	js := adapt(t, `{
		admin off
	}
	:0 {
		handle_path /v1/stream/* {
			picomq {
				storage s3://{env.PICOMQ_TEST_BUCKET}/streams?region=us-east-1&endpoint=http://127.0.0.1:9&path_style=true
				s3_timeout 1s
			}
		}
		route /other/* {
			picomq {
				storage s3://{env.PICOMQ_TEST_BUCKET}/streams?path_style=true&endpoint=http://127.0.0.1:9&region=us-east-1
				s3_timeout 1s
			}
		}
		handle /local/* {
			picomq
		}
	}`)
	start := time.Now()
	if err := validate(t, js); err != nil {
		t.Fatalf("validate: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("validation took %v; did it reach the network?", d)
	}
	// Provisioning writes nothing: no node id, no default storage.
	entries, _ := os.ReadDir(filepath.Join(data, "caddy"))
	for _, e := range entries {
		if e.Name() == "picomq" {
			t.Errorf("validation created %s", filepath.Join(data, "caddy", e.Name()))
		}
	}
}

func TestValidateRejectsBadConfigs(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	for name, tc := range map[string]struct{ src, want string }{
		"unset env": {`:0 {
			picomq {
				storage s3://{env.PICOMQ_SURELY_UNSET_VAR}/p
			}
		}`, "storage"},
		"quiet not below interval": {`:0 {
			picomq {
				flush_interval 5ms
				flush_quiet 5ms
			}
		}`, "flush_quiet (5ms) must be below flush_interval (5ms)"},
		"settings disagree": {`:0 {
			handle /a/* {
				picomq {
					storage file:///tmp/picomq-validate
					flush_interval 5ms
				}
			}
			handle /b/* {
				picomq {
					storage file:///tmp/picomq-validate/
				}
			}
		}`, "disagree on flush_interval (5ms in one, 20ms in another)"},
	} {
		t.Run(name, func(t *testing.T) {
			err := validate(t, adapt(t, "{\n\tadmin off\n}\n"+tc.src))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want one mentioning %q", err, tc.want)
			}
		})
	}
	// What the Caddyfile refuses as it parses, a JSON config meets at
	// provisioning.
	for name, tc := range map[string]struct{ handler, want string }{
		"unknown protocol": {`{"handler":"picomq","protocol":"mqtt"}`, `protocol: unknown protocol "mqtt" (use durable-streams or pico)`},
		"too many subs":    {`{"handler":"picomq","max_subscriptions":2147483647}`, "max_subscriptions must be at most 1073741824"},
		"bad scheme":       {`{"handler":"picomq","storage":"ftp://x/y"}`, "unsupported scheme"},
		"relative dir":     {`{"handler":"picomq","storage":"file://relative/dir"}`, "absolute"},
		"fragment":         {`{"handler":"picomq","storage":"s3://my-bucket/p#x"}`, `storage: storage URL "s3://my-bucket/p": a '#' ends the URL`},
		"cache_reads":      {`{"handler":"picomq","cache_reads":"shared"}`, `cache_reads: unknown value "shared" (use public or private)`},
		// A JSON integer is nanoseconds: meant as 30 seconds, this
		// long-poll would answer 204 at once, every time.
		"integer duration": {`{"handler":"picomq","long_poll_timeout":30}`,
			`long_poll_timeout must be at least 100ms, got 30ns (an integer in JSON is nanoseconds: write a string such as "30s")`},
		"sweep too short":  {`{"handler":"picomq","expiry_sweep_interval":"10ms"}`, "expiry_sweep_interval must be at least 100ms, got 10ms"},
		"compaction in ns": {`{"handler":"picomq","compact_interval":30000000}`, "compact_interval must be at least 100ms, got 30ms"},
		"s3_timeout in ns": {`{"handler":"picomq","s3_timeout":10}`, "s3_timeout must be at least 100ms, got 10ns"},
		"sse in ns":        {`{"handler":"picomq","sse_reconnect_interval":60}`, "sse_reconnect_interval must be at least 100ms"},
		"grave_time in ns": {`{"handler":"picomq","grave_time":1200}`, "grave_time must be at least 100ms"},
		"lease_ttl short":  {`{"handler":"picomq","lease_ttl":"2s"}`, "lease_ttl must be at least 3s, got 2s"},
		"cache over 1TiB":  {`{"handler":"picomq","cache_size":2199023255552}`, "cache_size must be at most 1TiB"},
	} {
		t.Run("json "+name, func(t *testing.T) {
			js := `{"admin":{"disabled":true},"apps":{"http":{"servers":{"s":{"listen":[":0"],"routes":[{"handle":[` +
				tc.handler + `]}]}}}}}`
			if err := validate(t, []byte(js)); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want one mentioning %q", err, tc.want)
			}
		})
	}
}

func TestValidateSharedStorageSameSettings(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	dir := t.TempDir()
	js := adapt(t, `{
		admin off
	}
	:0 {
		handle /a/* {
			picomq {
				storage file://`+dir+`
				long_poll_timeout 5s
			}
		}
		handle /b/* {
			picomq {
				storage file://`+dir+`/
				long_poll_timeout 9s
			}
		}
	}`)
	if err := validate(t, js); err != nil {
		t.Fatalf("handler-level options may differ on one storage: %v", err)
	}
}

// TestValidateSharedStorageDefaultSpelledOut: a handler that writes an
// engine setting at its documented default and one that leaves it out
// give one storage the same settings, so the config loads. pack_below
// left out used to stay 0 ("the engine's default") and be refused as
// differing from 256KiB.
func TestValidateSharedStorageDefaultSpelledOut(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	for _, line := range []string{
		"flush_interval 20ms",
		"flush_size 1MiB",
		"max_pending 64MiB",
		"cache_size 64MiB",
		"compact_interval 30s",
		"pack_below 256KiB",
		"merge_below 64KiB",
		"s3_timeout 10s",
		"expiry_sweep_interval 5m",
		"grave_time 20m",
	} {
		t.Run(line, func(t *testing.T) {
			dir := t.TempDir()
			js := adapt(t, `{
				admin off
			}
			:0 {
				handle /a/* {
					picomq {
						storage file://`+dir+`
						`+line+`
					}
				}
				handle /b/* {
					picomq {
						storage file://`+dir+`
					}
				}
			}`)
			if err := validate(t, js); err != nil {
				t.Errorf("%q in one handler of a storage and left out in the other: %v", line, err)
			}
		})
	}
}

// TestCaddyfileSmallSizes: a size under 1KiB is taken when it has a unit,
// bytes included, and from 1KiB up a bare number is bytes as before.
func TestCaddyfileSmallSizes(t *testing.T) {
	for _, tc := range []struct {
		line string
		get  func(*Handler) int64
		want int64
	}{
		{"max_pending 1B", func(h *Handler) int64 { return h.MaxPending }, 1},
		{"cache_size 4KiB", func(h *Handler) int64 { return h.CacheSize }, 4 << 10},
		{"max_append_size 100 B", nil, 0}, // two arguments: refused
		{"max_append_size 512b", func(h *Handler) int64 { return h.MaxAppendSize }, 512},
		{"flush_size 1024", func(h *Handler) int64 { return h.FlushSize }, 1024},
		{"pack_below 100B", func(h *Handler) int64 { return h.PackBelow }, 100},
	} {
		var h Handler
		err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("picomq {\n\t" + tc.line + "\n}"))
		if tc.get == nil {
			if err == nil {
				t.Errorf("%q was accepted", tc.line)
			}
			continue
		}
		if err != nil {
			t.Errorf("%q: %v", tc.line, err)
			continue
		}
		if got := tc.get(&h); got != tc.want {
			t.Errorf("%q: got %d bytes, want %d", tc.line, got, tc.want)
		}
	}
}

// TestStorageFragmentAfterPlaceholders: a storage URL whose '#' appears
// only once its placeholders are replaced is refused when the storage is
// acquired, as a literal one is by Validate; it used to share the engine
// of the URL without the fragment.
func TestStorageFragmentAfterPlaceholders(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("PICOMQ_TEST_PREFIX", "team#1")
	js := `{"admin":{"disabled":true},"apps":{"http":{"servers":{"s":{"listen":[":0"],"routes":[{"handle":[` +
		`{"handler":"picomq","storage":"s3://my-bucket/{env.PICOMQ_TEST_PREFIX}"}]}]}}}}}`
	const want = `storage URL "s3://my-bucket/team": a '#' ends the URL there`
	if err := validate(t, []byte(js)); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("err = %v, want one mentioning %q", err, want)
	}
}

// TestCaddyfileGlobalOptionRefused: picomq written among the global
// options is refused saying where it goes, with its line; Caddy's own
// error named neither.
func TestCaddyfileGlobalOptionRefused(t *testing.T) {
	src := "{\n\tadmin off\n\tpicomq {\n\t\tstorage file:///srv/streams\n\t}\n}\n:0 {\n\trespond 200\n}\n"
	_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(src), map[string]any{"filename": "Caddyfile"})
	const want = "picomq is a site directive, not a global option: put it inside a site block, " +
		"as in: localhost { picomq { storage s3://bucket/prefix } }, at Caddyfile:3"
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("err = %v, want one saying %q", err, want)
	}
}

// A Pico handler given the subscription options, which only Durable
// Streams handlers use, names them to be warned about (checked before the
// defaults, which set max_subscriptions whatever the protocol).
func TestIgnoredDSOnly(t *testing.T) {
	tests := []struct {
		name string
		h    Handler
		want []string
	}{
		{"pico", Handler{Protocol: protocolPico}, nil},
		{"durable streams with both", Handler{MaxSubscriptions: 10, AllowLoopbackWebhooks: true}, nil},
		{"pico with max_subscriptions", Handler{Protocol: protocolPico, MaxSubscriptions: 10}, []string{"max_subscriptions"}},
		{"pico with both", Handler{Protocol: protocolPico, MaxSubscriptions: 10, AllowLoopbackWebhooks: true},
			[]string{"max_subscriptions", "allow_loopback_webhooks"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.h.ignoredDSOnly(); !slices.Equal(got, tt.want) {
				t.Errorf("ignoredDSOnly() = %q, want %q", got, tt.want)
			}
		})
	}
}
