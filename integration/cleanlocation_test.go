package integration

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestLocationIsTheCleanedStreamURL: a create sent with dot segments or
// repeated slashes (which Caddy cleans before handle_path strips its
// prefix) is answered with the Location of the stream it made, in clean
// form, in both protocols; and such a path may name a fork's source by
// that Location. Before, the prefix was taken from the client's path
// wherever the stream's name happened to end it, so /streams/a/../b got
// Location /streams/a/../b, and a fork sent that way was refused for a
// source outside "/streams/a/..".
func TestLocationIsTheCleanedStreamURL(t *testing.T) {
	v := testenv.NewVersity(t)
	storage := caddytest.S3Storage(t, v, v.Endpoint)
	site := func(extra string) string {
		return fmt.Sprintf("\t\tpicomq {\n\t\t\tstorage %q\n%s\t\t}\n", storage, extra)
	}
	caddyfile := "{\n\tpersist_config off\n}\n\n" +
		"http://127.0.0.1:{$" + caddytest.PortEnv + "} {\n\tbind 127.0.0.1\n" +
		"\thandle_path /streams/* {\n" + site("") + "\t}\n" +
		"\thandle_path /pico/* {\n" + site("\t\t\tprotocol pico\n") + "\t}\n}\n"
	c := caddytest.Start(t, caddytest.Options{Caddyfile: caddyfile, Env: caddytest.S3Env(v), ReadyTimeout: 90 * time.Second})
	cl := newClient(t, c.URL(), true)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	for _, tc := range []struct {
		path, want string // want is the Location after the server's origin (Durable Streams) or alone (Pico)
		origin     bool
	}{
		{"/streams/a/../b", "/streams/b", true},
		{"/streams/./c", "/streams/c", true},
		{"/streams//d", "/streams/d", true},
		{"/streams/x/..//e/./f", "/streams/e/f", true},
		{"/pico/a/../pb", "/pico/pb", false},
		{"/pico/./pc", "/pico/pc", false},
		{"/pico//pd", "/pico/pd", false},
	} {
		r, err := cl.do(ctx, http.MethodPut, tc.path, "", http.Header{"Content-Type": {textPlain}}, nil)
		if err != nil {
			t.Fatalf("PUT %s: %v", tc.path, err)
		}
		if r.status != http.StatusCreated {
			t.Errorf("PUT %s: %s", tc.path, r.String())
			continue
		}
		want := tc.want
		if tc.origin {
			want = c.URL() + want
		}
		if got := r.header.Get("Location"); got != want {
			t.Errorf("PUT %s: Location = %q, want %q", tc.path, got, want)
		}
	}

	// A fork named through such a path finds its source under the
	// handler's prefix.
	fork := http.Header{"Content-Type": {textPlain}, "Stream-Forked-From": {c.URL() + "/streams/b"}}
	r, err := cl.do(ctx, http.MethodPut, "/streams/a/../copy", "", fork, nil)
	if err != nil {
		t.Fatal(err)
	}
	if r.status != http.StatusCreated || r.header.Get("Location") != c.URL()+"/streams/copy" {
		t.Errorf("fork through /streams/a/../copy: %s, Location %q", r.String(), r.header.Get("Location"))
	}
}
