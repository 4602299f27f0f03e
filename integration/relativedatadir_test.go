package integration

import (
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
)

// TestBarePicomqWithoutAHome: Caddy run with neither HOME nor
// XDG_DATA_HOME set (a service run as root without User=) keeps its data
// in ./caddy, and a bare picomq directive keeps its streams there too.
// It refused to start, naming a storage URL the user never wrote
// (file://caddy/picomq/data: "a file URL needs an absolute path").
func TestBarePicomqWithoutAHome(t *testing.T) {
	c, err := caddytest.Launch(t, caddytest.Options{Env: []string{"HOME=", "XDG_DATA_HOME="}, ReadyTimeout: 90 * time.Second})
	if err != nil {
		t.Fatalf("Caddy without HOME: %v", err)
	}
	e := &fhEnv{t: t, caddy: c, client: &http.Client{Timeout: time.Minute}}
	e.create("/homeless", textPlain)
	e.append("/homeless", textPlain, []byte("kept in ./caddy"))
	if got, _, err := e.readBytes("/homeless"); err != nil || string(got) != "kept in ./caddy" {
		t.Fatalf("the stream reads %q, %v", got, err)
	}
}
