package integration

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestTwoRoutesOnOneStorage serves one storage under two routes of one
// site, Durable Streams and Pico, the storage written the same way in
// both: one engine serves both and each route sees the other's streams.
// Written two ways that the module cannot tell name the same bucket and
// prefix (another host name for the endpoint), the config is refused at start with
// a message that says so, instead of two engines fencing each other.
func TestTwoRoutesOnOneStorage(t *testing.T) {
	v := testenv.NewVersity(t)
	bucket := v.NewBucket(t)
	storage := testenv.StoreURL(v.Endpoint, bucket, caddytest.S3Prefix)
	caddyfile := func(other string) string {
		return `{
	admin {$` + caddytest.AdminEnv + `}
	persist_config off
}
http://:{$` + caddytest.PortEnv + `} {
	bind 127.0.0.1
	handle_path /ds/* {
		picomq {
			storage "` + storage + `"
		}
	}
	handle_path /pico/* {
		picomq {
			protocol pico
			storage "` + other + `"
		}
	}
}
`
	}
	c := caddytest.Start(t, caddytest.Options{Caddyfile: caddyfile(storage), Env: caddytest.S3Env(v)})
	cl := newClient(t, c.URL(), true)
	cl.create(t, "/ds/shared", 30*time.Second)
	r, err := cl.do(context.Background(), http.MethodHead, "/pico/shared", "", nil, nil)
	if err != nil || r.status != http.StatusOK {
		t.Errorf("the Durable Streams route's stream seen through the Pico route: %v %v, want 200", r, err)
	}
	if _, n, err := goroutines(c.AdminAddr()); err != nil || n != 1 {
		t.Errorf("%d engines (%v) for two routes on one storage, want 1", n, err)
	}
	c.Kill()

	// localhost for 127.0.0.1: the same server, which the module cannot
	// tell (an endpoint's trailing slash it can, and shares the storage:
	// TestTwoSpellingsOfOneStorageShareIt).
	if !strings.Contains(v.Endpoint, "127.0.0.1") {
		t.Fatalf("versitygw's endpoint %s is not on 127.0.0.1", v.Endpoint)
	}
	other := testenv.StoreURL(strings.Replace(v.Endpoint, "127.0.0.1", "localhost", 1), bucket, caddytest.S3Prefix)
	// The same node again (its data directory), which takes its own
	// lease back at once: only the second URL can be refused.
	_, err = caddytest.Launch(t, caddytest.Options{Caddyfile: caddyfile(other), Env: caddytest.S3Env(v), DataDir: c.DataDir()})
	if err == nil {
		t.Fatal("a config naming one storage by two URLs started")
	}
	// The refusal names the URL the storage is open under, so the
	// operator can find the other spelling (the log escapes its quotes
	// and the label decodes the query).
	// Whichever of the two started first.
	openAs := "open here as s3://" + bucket + "/" + caddytest.S3Prefix + "?endpoint="
	msg := err.Error()
	named := strings.Contains(msg, openAs+v.Endpoint+"&") || strings.Contains(msg, openAs+strings.Replace(v.Endpoint, "127.0.0.1", "localhost", 1)+"&")
	if !strings.Contains(msg, "already open in this process") || !named {
		t.Errorf("the refusal does not say the storage is open already, as %s...:\n%s", openAs, truncateTail(msg, 3000))
	}
	for _, line := range strings.Split(err.Error(), "\n") {
		if strings.Contains(line, "already open") {
			t.Logf("refused: %s", line)
		}
	}
}

// TestTwoRoutesOneSpellingTheDefault serves one storage under two routes,
// one of which writes pack_below at its documented default (256KiB) and
// the other leaves it out: they ask for the same engine, so Caddy starts
// and both routes serve the same streams. Before the module applied
// pack_below's default itself, the two were 262144 and 0 to it, and the
// config was refused as disagreeing.
func TestTwoRoutesOneSpellingTheDefault(t *testing.T) {
	v := testenv.NewVersity(t)
	storage := caddytest.S3Storage(t, v, v.Endpoint)
	caddyfile := `{
	admin {$` + caddytest.AdminEnv + `}
	persist_config off
}
http://:{$` + caddytest.PortEnv + `} {
	bind 127.0.0.1
	handle_path /a/* {
		picomq {
			storage "` + storage + `"
			pack_below 256KiB
		}
	}
	handle_path /b/* {
		picomq {
			storage "` + storage + `"
		}
	}
}
`
	c, err := caddytest.Launch(t, caddytest.Options{Caddyfile: caddyfile, Env: caddytest.S3Env(v), ReadyTimeout: 90 * time.Second})
	if err != nil {
		t.Fatalf("two routes on one storage, one spelling out pack_below's default, were refused:\n%s", truncateTail(err.Error(), 3000))
	}
	if err := waitServing(c, 90*time.Second); err != nil {
		t.Fatal(err)
	}
	cl := newClient(t, c.URL(), true)
	cl.create(t, "/a/shared", 30*time.Second)
	r, err := cl.do(context.Background(), http.MethodHead, "/b/shared", "", nil, nil)
	if err != nil || r.status != http.StatusOK {
		t.Errorf("the stream created through /a/ seen through /b/: %v %v, want 200", r, err)
	}
}
