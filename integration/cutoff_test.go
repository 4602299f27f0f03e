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

// TestCutOffNodeAnswersNothingFromMemory: a node cut off from the store
// past its lease, which a standby has taken over and written to since,
// must not answer for the storage from what it remembers: not a read at an
// offset the new holder handed out ("beyond the tail" there), not a HEAD
// (its old tail), not a producer's next append ("sequence gap": it never
// saw the one the new holder took). Once it is back in touch and knows it
// was replaced, it must not answer HEADs from memory either, nor create
// a stream: a create without records writes its metadata object alone,
// which no WAL seal fences. The two-node crash torture
// (TestCrashTortureTwoNodes) found each of these: the node answered them
// all, and created streams after another node held the storage.
func TestCutOffNodeAnswersNothingFromMemory(t *testing.T) {
	t.Parallel() // waits on a lease most of its run
	const name = "/cutoff/s"
	v := testenv.NewVersity(t)
	bucket := v.NewBucket(t)
	pA := newProxy(t, v)
	// The holder's long-polls outlast its lease (see parked below).
	a := caddytest.Start(t, caddyOptions(v, testenv.StoreURL(pA.URL(), bucket, caddytest.S3Prefix),
		"lease_ttl 3s", "s3_timeout 1s", "long_poll_timeout 6s"))
	clA := newClient(t, a.URL(), false)
	clA.create(t, name, 30*time.Second)
	send := func(cl *dsClient, method, path, query string, hdr map[string]string, body string) *response {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		h := http.Header{}
		for k, v := range hdr {
			h.Set(k, v)
		}
		var b []byte
		if body != "" {
			b = []byte(body)
		}
		r, err := cl.do(ctx, method, path, query, h, b)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		return r
	}
	text := map[string]string{"Content-Type": textPlain}
	r := send(clA, http.MethodPost, name, "", text, "a\n")
	if r.status/100 != 2 {
		t.Fatalf("append on the holder: %s", r)
	}

	b := caddytest.Start(t, caddyOptions(v, testenv.StoreURL(v.Endpoint, bucket, caddytest.S3Prefix),
		"lease_ttl 3s", "long_poll_timeout 2s"))
	clB := newClient(t, b.URL(), false)
	// A long-poll parked at the holder's tail when it is cut off: nothing
	// wakes it as the lease lapses, and at its timeout (6 s, past the
	// lapse) it must not answer "nothing new" at a tail the new holder
	// has moved past.
	parked := make(chan *response, 1)
	at := r.next()
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		r, err := clA.do(ctx, http.MethodGet, name, "live=long-poll&offset="+at, http.Header{}, nil)
		if err != nil {
			r = &response{status: -1, body: []byte(err.Error())}
		}
		parked <- r
	}()
	fhWaitLongPolls(t, a.AdminAddr(), 1) // parked before the cut-off
	pA.Down()
	cut := time.Now()
	if !waitFor(30*time.Second, func() bool {
		return send(clB, http.MethodGet, name, "offset=-1", nil, "").status == http.StatusOK
	}) {
		t.Fatal("the standby did not take the storage over within 30s of the holder's cut-off")
	}
	t.Logf("the standby took over %s after the holder was cut off", time.Since(cut).Round(time.Millisecond))
	r = send(clB, http.MethodPost, name, "", text, "b\n")
	if r.status/100 != 2 {
		t.Fatalf("append on the new holder: %s", r)
	}
	tail := r.next()
	producer := map[string]string{"Content-Type": textPlain, "Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "0"}
	if r := send(clB, http.MethodPost, name, "", producer, "p0\n"); r.status != http.StatusOK {
		t.Fatalf("producer's first append on the new holder: %s", r)
	}

	refused := func(when, what string, r *response) {
		t.Helper()
		if r.status != http.StatusServiceUnavailable {
			t.Errorf("%s, %s on the old holder: %s, headers %v; want 503", when, what, r, r.header)
		}
	}
	const cutOff = "cut off past its lease"
	refused(cutOff, "a read at the new holder's tail "+tail, send(clA, http.MethodGet, name, "offset="+tail, nil, ""))
	refused(cutOff, "a long-poll at the new holder's tail", send(clA, http.MethodGet, name, "live=long-poll&offset="+tail, nil, ""))
	refused(cutOff, "a HEAD", send(clA, http.MethodHead, name, "", nil, ""))
	producer["Producer-Seq"] = "1"
	refused(cutOff, "the producer's second append", send(clA, http.MethodPost, name, "", producer, "p1\n"))
	refused(cutOff, "a long-poll parked before the cut-off, at its timeout", <-parked)

	if err := pA.Up(); err != nil {
		t.Fatalf("proxy up: %v", err)
	}
	// Its next renewal finds the lease taken; from then on it says so.
	if !waitFor(15*time.Second, func() bool {
		r := send(clA, http.MethodGet, name, "offset=-1", nil, "")
		return r.status == http.StatusServiceUnavailable && strings.Contains(string(r.body), "took this storage over")
	}) {
		t.Fatal("the old holder does not say, 15s after it is back, that another server took the storage over")
	}
	const replaced = "replaced"
	refused(replaced, "a HEAD", send(clA, http.MethodHead, name, "", nil, ""))
	refused(replaced, "a create", send(clA, http.MethodPut, "/cutoff/new", "", text, ""))
	if r := send(clB, http.MethodHead, "/cutoff/new", "", nil, ""); r.status != http.StatusNotFound {
		t.Errorf("the new holder finds /cutoff/new, which only the replaced node was asked to create: %s", r)
	}
	if got, _, err := clB.readAll(name, 30*time.Second); err != nil || string(got) != "a\nb\np0\n" {
		t.Errorf("the new holder reads %q (%v), want %q", got, err, "a\nb\np0\n")
	}
}
