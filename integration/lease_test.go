package integration

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// leaseRefusal are the words a refusal because another node holds the
// storage must use (lower-cased), one group of which must all appear.
var leaseRefusal = [][]string{
	{"in use by another"},
	{"lease", "held"},
	{"lease", "another node"},
}

func mentionsLease(s string) bool {
	s = strings.ToLower(s)
	for _, group := range leaseRefusal {
		all := true
		for _, w := range group {
			if !strings.Contains(s, w) {
				all = false
				break
			}
		}
		if all {
			return true
		}
	}
	return false
}

// TestLeaseSingleWriter starts a second Caddy on the storage of a running
// one: it must not become a second writer and must say why. After the first
// is SIGKILLed the second is still refused (the lease has not expired), and
// the first, restarted with the same data directory (the same node id),
// takes its lease back at once and serves reads within seconds.
func TestLeaseSingleWriter(t *testing.T) {
	v := testenv.NewVersity(t)
	bucket := v.NewBucket(t)
	// The first node talks to versitygw directly, the second through a
	// proxy, so that every request the second makes is counted.
	storageA := testenv.StoreURL(v.Endpoint, bucket, caddytest.S3Prefix)
	pB := newProxy(t, v)
	storageB := testenv.StoreURL(pB.URL(), bucket, caddytest.S3Prefix)

	a := caddytest.Start(t, caddyOptions(v, storageA, "long_poll_timeout 2s"))
	clA := newClient(t, a.URL(), true)
	const name = "/lease/s"
	clA.create(t, name, 30*time.Second)
	var want []byte
	appendA := func(i int) {
		t.Helper()
		body := []byte(fmt.Sprintf("a-%d\n", i))
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		r, err := clA.appendBody(ctx, name, body)
		if err != nil {
			t.Fatalf("append %d to the first node: %v", i, err)
		}
		if r.status/100 != 2 {
			t.Fatalf("append %d to the first node: %s", i, r)
		}
		want = append(want, body...)
	}
	for i := 0; i < 20; i++ {
		appendA(i)
	}

	// The second process, with its own data directory (another node id).
	began := time.Now()
	b, err := caddytest.Launch(t, caddyOptions(v, storageB, "long_poll_timeout 2s"))
	t.Logf("second node's start attempt took %s", time.Since(began).Round(time.Millisecond))
	checkSecondRefused(t, "while the first node runs", b, err)
	if c := pB.Counts(); c.Put != 0 || c.Delete != 0 || c.Other != 0 {
		t.Errorf("the second node wrote to the storage the first one holds: PUT %v, DELETE %v, other %d",
			c.Keys(testenv.OpPut), c.Keys(testenv.OpDelete), c.Other)
	}

	// The first node is unaffected.
	for i := 20; i < 30; i++ {
		appendA(i)
	}
	got, _, err := clA.readAll(name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != string(want) {
		t.Fatalf("first node's stream after the second's attempt:\n got %q\nwant %q", got, want)
	}

	// A crash of the first node does not hand the storage to the second:
	// the lease runs until it expires.
	a.Kill()
	if b.Running() {
		checkSecondRefused(t, "after the first node was killed", b, nil)
	} else {
		began = time.Now()
		err := b.TryRestart()
		t.Logf("second node's start attempt after the kill took %s", time.Since(began).Round(time.Millisecond))
		checkSecondRefused(t, "after the first node was killed", b, err)
	}
	if c := pB.Counts(); c.Put != 0 || c.Delete != 0 || c.Other != 0 {
		t.Errorf("the second node wrote to the storage after the first was killed: PUT %v, DELETE %v, other %d",
			c.Keys(testenv.OpPut), c.Keys(testenv.OpDelete), c.Other)
	}
	b.Kill()

	// The same node comes back and takes its lease at once.
	began = time.Now()
	if err := a.TryRestart(); err != nil {
		t.Fatalf("restarting the first node (same data directory) %s after its crash: %v",
			time.Since(began).Round(time.Millisecond), err)
	}
	var readErr error
	ok := waitFor(20*time.Second, func() bool {
		got, _, readErr = clA.readRange(name, "-1", -1, 2*time.Second)
		return readErr == nil && string(got) == string(want)
	})
	took := time.Since(began)
	if !ok {
		t.Fatalf("restarted first node does not serve the stream %s after the restart began: %v; got %q",
			took.Round(time.Millisecond), readErr, got)
	}
	if took > 10*time.Second {
		t.Errorf("restarted first node served reads only %s after the restart began; its own lease should be "+
			"taken back at once, not after it expires", took.Round(time.Millisecond))
	}
	appendA(30)
	got, _, err = clA.readAll(name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != string(want) {
		t.Fatalf("after the restart:\n got %q\nwant %q", got, want)
	}
	if strings.Contains(strings.ToLower(a.Logs()), "lease lost") {
		t.Errorf("the first node reports losing its lease:\n%s", a.Logs())
	}
	t.Logf("first node back and serving reads %s after the restart began", took.Round(time.Millisecond))
}

// checkSecondRefused checks that the second node was refused the storage:
// either its start failed (launchErr, with the reason in the error or its
// log), or it runs but refuses appends with a status and a reason.
func checkSecondRefused(t *testing.T, when string, b *caddytest.Caddy, launchErr error) {
	t.Helper()
	if launchErr != nil {
		if !mentionsLease(launchErr.Error()) && !mentionsLease(b.Logs()) {
			t.Errorf("%s: the second node failed to start without saying the storage is held by another node:\n%v",
				when, launchErr)
		} else {
			t.Logf("%s: the second node refused to start: %s", when, leaseLine(launchErr.Error()+"\n"+b.Logs()))
		}
		return
	}
	if !b.Running() {
		t.Errorf("%s: the second node is not running, yet its start did not fail", when)
		return
	}
	// It started: then its writes must fail, clearly.
	clB := newClient(t, b.URL(), false)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := clB.appendBody(ctx, "/lease/s", []byte("b\n"))
	switch {
	case err != nil:
		t.Errorf("%s: append to the second node: %v (want a clear refusal)", when, err)
	case r.status/100 == 2:
		t.Errorf("%s: the second node acknowledged an append on storage another node holds: %s", when, r)
	case !mentionsLease(string(r.body)):
		t.Errorf("%s: the second node refused the append without saying why: %s", when, r)
	default:
		t.Logf("%s: the second node runs and refuses appends: %s", when, r)
	}
	r, err = clB.do(ctx, http.MethodPut, "/lease/other", "", http.Header{"Content-Type": {textPlain}}, nil)
	if err == nil && r.status/100 == 2 {
		t.Errorf("%s: the second node created a stream on storage another node holds: %s", when, r)
	}
}

// leaseLine picks the last line of s that gives the lease reason.
func leaseLine(s string) string {
	lines := strings.Split(s, "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if mentionsLease(lines[i]) {
			return truncate(strings.TrimSpace(lines[i]), 400)
		}
	}
	return ""
}
