package picomq

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
)

// TestExamplesValidate does what `caddy adapt --validate` does for every
// Caddyfile in examples/: adapt it and provision every module. It runs
// offline, so it also proves Provision touches no network (the S3 examples
// name buckets that do not exist here).
func TestExamplesValidate(t *testing.T) {
	files, err := filepath.Glob("examples/*Caddyfile")
	if err != nil || len(files) == 0 {
		t.Fatalf("no examples found: %v", err)
	}
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			body, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			cfgJSON, _, err := caddyconfig.GetAdapter("caddyfile").Adapt(body, map[string]any{"filename": f})
			if err != nil {
				t.Fatalf("adapt: %v", err)
			}
			var cfg caddy.Config
			if err := json.Unmarshal(cfgJSON, &cfg); err != nil {
				t.Fatalf("decode adapted config: %v", err)
			}
			if err := caddy.Validate(&cfg); err != nil {
				t.Fatalf("validate: %v", err)
			}
		})
	}
}
