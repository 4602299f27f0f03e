package integration

import (
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestFailedReloadKeepsItsStorage reloads Caddy with a config that names
// the running storage by another URL (another endpoint in front of the same
// bucket and prefix), which the module takes for another storage, and
// whose start would fail after the lease. Caddy keeps the old config, and
// its storage must stay writable. The second engine used to take the lease
// (the same node id takes it at once) before failing, and the running
// engine, finding another token in it at its next renewal, stopped writing
// until a restart. It is refused now, before it writes anything.
func TestFailedReloadKeepsItsStorage(t *testing.T) {
	const (
		name = "/reload/other-url"
		text = "text/plain"
	)
	a := fhStart(t, fhOptions{})
	a.create(name, text)
	a.append(name, text, []byte("before\n"))

	other := newProxy(t, a.v)
	// The other URL's start gets as far as the lease, then fails.
	other.AddFault(testenv.Fault{Op: testenv.OpGet, KeyContains: "manifest", Status: http.StatusForbidden})
	cfg := a.caddy.Config(caddytest.Options{
		Storage:    testenv.StoreURL(other.URL(), a.bucket, caddytest.S3Prefix),
		Directives: a.directives,
	})
	err := a.reload(cfg)
	if err == nil {
		t.Fatal("a reload whose storage could not be opened succeeded")
	}
	reloaded := time.Now()
	if !strings.Contains(err.Error(), "already open in this process") {
		t.Errorf("the reload failed without saying the storage is open in this process already:\n%v", err)
	}
	if c := other.Counts(); c.Put > 0 {
		t.Errorf("the refused start wrote through the other URL: %v", c.Keys(testenv.OpPut))
	}

	// The running engine renews its lease every 10 s (a third of 30 s):
	// by 15 s it has met the lease as the failed start left it.
	var failed []string
	for i := 0; time.Since(reloaded) < 15*time.Second; i++ {
		r := a.must(fhReq{Method: http.MethodPost, Path: name, Header: map[string]string{"Content-Type": text},
			Body: []byte("after-" + strconv.Itoa(i) + "\n")})
		if r.Status/100 != 2 {
			failed = append(failed, time.Since(reloaded).Round(100*time.Millisecond).String()+": "+r.String())
		}
		time.Sleep(250 * time.Millisecond)
	}
	if len(failed) > 0 {
		t.Errorf("%d appends failed after the failed reload, first %s, last %s", len(failed), failed[0], failed[len(failed)-1])
	}
}
