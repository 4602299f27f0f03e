package integration

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestTwoSpellingsOfOneStorageShareIt: through Caddy on versitygw, two
// handlers whose storage URLs differ only in how they spell a parameter
// (an endpoint's trailing slash, path_style=1 for true) are one storage:
// Caddy starts, and a stream made through one reads through the other.
// They were two keys, so the config passed caddy validate and then failed
// to start, the storage "already open in this process".
func TestTwoSpellingsOfOneStorageShareIt(t *testing.T) {
	v := testenv.NewVersity(t)
	bucket := v.NewBucket(t)
	plain := testenv.StoreURL(v.Endpoint, bucket, caddytest.S3Prefix)
	other := strings.Replace(strings.Replace(plain, "path_style=true", "path_style=1", 1), "endpoint="+v.Endpoint, "endpoint="+v.Endpoint+"/", 1)
	if other == plain {
		t.Fatalf("the second spelling is the first: %s", plain)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "{\n\tpersist_config off\n}\n\nhttp://:{$%s} {\n\tbind 127.0.0.1\n", caddytest.PortEnv)
	for _, h := range []struct{ prefix, storage string }{{"/a", plain}, {"/b", other}} {
		fmt.Fprintf(&b, "\thandle_path %s/* {\n\t\tpicomq {\n\t\t\tstorage %q\n\t\t}\n\t}\n", h.prefix, h.storage)
	}
	b.WriteString("}\n")
	c, err := caddytest.Launch(t, caddytest.Options{Caddyfile: b.String(), Env: caddytest.S3Env(v), ReadyTimeout: 90 * time.Second})
	if err != nil {
		t.Fatalf("Caddy with two spellings of one storage: %v", err)
	}
	e := &fhEnv{t: t, v: v, bucket: bucket, caddy: c, client: &http.Client{Timeout: time.Minute}}
	e.create("/a/spelled", textPlain)
	e.append("/a/spelled", textPlain, []byte("one storage"))
	if got, _, err := e.readBytes("/b/spelled"); err != nil || string(got) != "one storage" {
		t.Fatalf("the stream through the other spelling: %q, %v", got, err)
	}
}
