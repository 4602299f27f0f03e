package picomq

import (
	"encoding/json"
	"os"
	"path/filepath"
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
		max_append_size 8MB
		cache_size 128MiB
		compact_interval 1m
		pack_below 64KiB
		s3_timeout 3s
		expiry_sweep_interval 10m
		grave_time 30m
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
		MaxAppendSize:        8_000_000,
		CacheSize:            128 << 20,
		CompactInterval:      caddy.Duration(time.Minute),
		PackBelow:            64 << 10,
		S3Timeout:            caddy.Duration(3 * time.Second),
		ExpirySweepInterval:  caddy.Duration(10 * time.Minute),
		GraveTime:            caddy.Duration(30 * time.Minute),
	}
	if got, _ := json.Marshal(h); string(got) != string(mustJSON(t, want)) {
		t.Errorf("got  %s\nwant %s", got, mustJSON(t, want))
	}
}

// pack_below off turns packs off: -1 in JSON, as zero means the default.
func TestUnmarshalCaddyfilePackBelowOff(t *testing.T) {
	var h Handler
	if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("picomq {\n pack_below off\n}")); err != nil {
		t.Fatal(err)
	}
	if h.PackBelow != -1 {
		t.Fatalf("pack_below off gave %d, want -1", h.PackBelow)
	}
	h.applyDefaults()
	if err := h.Validate(); err != nil {
		t.Fatalf("pack_below off: %v", err)
	}
	h.PackBelow = 32 << 20
	if err := h.Validate(); err == nil || !strings.Contains(err.Error(), "pack_below") {
		t.Fatalf("pack_below 32MiB: %v; want refused", err)
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

func TestUnmarshalCaddyfileErrors(t *testing.T) {
	for _, src := range []string{
		`picomq extra`,
		"picomq {\n bogus 1\n}",
		"picomq {\n storage\n}",
		"picomq {\n storage a b\n}",
		"picomq {\n storage file:///a\n storage file:///b\n}",
		"picomq {\n flush_interval soon\n}",
		"picomq {\n flush_interval 0s\n}",
		"picomq {\n long_poll_timeout -1s\n}",
		"picomq {\n expiry_sweep_interval never\n}",
		"picomq {\n flush_size lots\n}",
		"picomq {\n max_pending 0\n}",
		"picomq {\n flush_quiet 0\n}",
		"picomq {\n max_append_size 0\n}",
		"picomq {\n cache_size 2TiB\n}",
		"picomq {\n pack_below none\n}",
		"picomq {\n pack_below 0\n}",
	} {
		var h Handler
		if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(src)); err == nil {
			t.Errorf("%q was accepted: %s", src, mustJSON(t, h))
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
		"unknown protocol": {`:0 {
			picomq {
				protocol mqtt
			}
		}`, "unknown protocol"},
		"bad scheme": {`:0 {
			picomq {
				storage ftp://x/y
			}
		}`, "unsupported scheme"},
		"relative dir": {`:0 {
			picomq {
				storage file://relative/dir
			}
		}`, "absolute"},
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
		}`, "disagree on engine settings"},
	} {
		t.Run(name, func(t *testing.T) {
			err := validate(t, adapt(t, "{\n\tadmin off\n}\n"+tc.src))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
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
