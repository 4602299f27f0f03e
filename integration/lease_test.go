package integration

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
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
	if err == nil {
		err = waitServing(b, 30*time.Second)
	}
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
		if err == nil {
			err = waitServing(b, 30*time.Second)
		}
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
	err = a.TryRestart()
	if err == nil {
		err = waitServing(a, 30*time.Second)
	}
	if err != nil {
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

// TestLeaseExpiryFencesPartitionedNode cuts a running node off from the
// storage (its S3 proxy goes down) while it is taking appends, starts a
// second node, which takes the storage over once the first one's lease
// has expired, then reconnects the first. The first must not become a second writer: nothing it
// acknowledges may be lost, whatever it did while cut off or after, and the
// storage must still replay cleanly for the new holder. Both nodes append
// to the same stream, so a rogue write would interleave with the new
// holder's appends.
func TestLeaseExpiryFencesPartitionedNode(t *testing.T) {
	t.Parallel() // waits on timers most of its run: beside the other such tests, not after them
	const (
		// The engine's lease lasts 30s without renewal (lease_ttl's
		// default); the second node retries its start this long.
		takeoverLimit = 60 * time.Second
		name          = "/fence/s"
	)
	v := testenv.NewVersity(t)
	bucket := v.NewBucket(t)
	pA := newProxy(t, v)
	storageA := testenv.StoreURL(pA.URL(), bucket, caddytest.S3Prefix)
	storageB := testenv.StoreURL(v.Endpoint, bucket, caddytest.S3Prefix)

	a := caddytest.Start(t, caddyOptions(v, storageA, "s3_timeout 2s", "long_poll_timeout 2s"))
	clA := newClient(t, a.URL(), false)
	clA.create(t, name, 30*time.Second)

	abort, abortCancel := context.WithCancel(context.Background())
	stopA, stopB := make(chan struct{}), make(chan struct{})
	var onceA, onceB sync.Once
	var wg sync.WaitGroup
	t.Cleanup(func() {
		onceA.Do(func() { close(stopA) })
		onceB.Do(func() { close(stopB) })
		abortCancel()
		wg.Wait()
	})
	wA := newWriter(abort, clA, 0, name, 20*time.Millisecond)
	wA.shared = true
	wg.Add(1)
	go func() { defer wg.Done(); wA.run(stopA) }()
	time.Sleep(2 * time.Second)

	// Cut the first node off from the storage.
	pA.Down()
	partitioned := time.Now()

	// The second node gets the storage once the lease has expired.
	var b *caddytest.Caddy
	var err error
	for attempt := 0; ; attempt++ {
		if b == nil {
			b, err = caddytest.Launch(t, caddyOptions(v, storageB, "long_poll_timeout 2s"))
		} else {
			err = b.TryRestart()
		}
		if err == nil {
			err = waitServing(b, 30*time.Second)
		}
		if err == nil {
			break
		}
		if !mentionsLease(err.Error()) {
			t.Fatalf("second node's start failed for another reason than the lease: %v", err)
		}
		if time.Since(partitioned) > takeoverLimit {
			t.Fatalf("second node still refused %s after the first was cut off: %v", takeoverLimit, err)
		}
		time.Sleep(2 * time.Second)
	}
	// Started, the second node answers 503 naming the holder until the
	// lease lapses and its retried start takes the storage over.
	clB := newClient(t, b.URL(), false)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		r, err := clB.do(ctx, http.MethodGet, name, "offset=-1", nil, nil)
		cancel()
		if err == nil && r.status != http.StatusServiceUnavailable {
			break
		}
		if err == nil && !mentionsLease(string(r.body)) {
			t.Fatalf("second node refused a read for another reason than the lease: %s", r)
		}
		if time.Since(partitioned) > takeoverLimit {
			t.Fatalf("second node still refused %s after the first was cut off: %v %v", takeoverLimit, r, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
	tookOver := time.Now()
	wB := newWriter(abort, clB, 1, name, 20*time.Millisecond)
	wB.shared = true
	wg.Add(1)
	go func() { defer wg.Done(); wB.run(stopB) }()

	// Reconnect the first node while the second is writing.
	time.Sleep(2 * time.Second)
	pA.Reset()
	if err := pA.Up(); err != nil {
		t.Fatalf("proxy up: %v", err)
	}
	reconnected := time.Now()
	time.Sleep(8 * time.Second)
	onceA.Do(func() { close(stopA) })
	onceB.Do(func() { close(stopB) })
	abortCancel()
	wg.Wait()
	// An append whose request the writers just cancelled was never
	// acknowledged but may still be in a batch in flight; let it settle
	// before the content is taken as the reference.
	time.Sleep(time.Second)

	content, _, err := clB.readAll(name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []*writer{wA, wB} {
		for _, pr := range w.verify(content) {
			t.Error(pr)
		}
	}
	// Acknowledgements by the first node after it was cut off.
	var ackedLate, ackedAfterReconnect, sentAfterReconnect int
	wA.mu.Lock()
	for n := range wA.acked {
		sp := wA.spans[n]
		if sp.done.After(partitioned) {
			ackedLate++
		}
		if sp.sent.After(reconnected) {
			ackedAfterReconnect++
		}
	}
	for _, sp := range wA.spans {
		if sp.sent.After(reconnected) {
			sentAfterReconnect++
		}
	}
	wA.mu.Unlock()
	// None acknowledged proves the fence only if the first node was asked.
	if sentAfterReconnect == 0 {
		t.Error("the first node's writer sent no append after it came back: nothing tested")
	}
	// What the first node wrote once it could reach the storage again.
	var rogue []string
	for key, n := range pA.Counts().Keys(testenv.OpPut) {
		rogue = append(rogue, fmt.Sprintf("%s x%d", strings.TrimPrefix(key, caddytest.S3Prefix+"/"), n))
	}
	slices.Sort(rogue)
	if ackedAfterReconnect > 0 {
		t.Errorf("the first node acknowledged %d appends sent after it came back while another node holds the storage; "+
			"its PUTs after reconnecting (key x attempts, %d keys): %v",
			ackedAfterReconnect, len(rogue), rogue[:min(len(rogue), 12)])
	}

	// The storage replays cleanly for its holder, with the same content.
	b.Kill()
	if err := b.TryRestart(); err != nil {
		t.Fatalf("restarting the second node: %v", err)
	}
	if err := waitServing(b, 30*time.Second); err != nil {
		t.Fatalf("restarting the second node: %v", err)
	}
	again, _, err := clB.readAll(name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if string(again) != string(content) {
		d := firstDiff(again, content)
		t.Errorf("after the second node's restart the stream reads differently at byte %d: %s, before %s",
			d, around(again, d), around(content, d))
	}
	aAcked, aFailed := wA.counts()
	bAcked, bFailed := wB.counts()
	t.Logf("second node took over %s after the partition; first node: %d acknowledged (%d completed after the partition), "+
		"%d failed; second node: %d acknowledged, %d failed; first node says: %s",
		tookOver.Sub(partitioned).Round(time.Millisecond), aAcked, ackedLate, aFailed, bAcked, bFailed,
		leaseLine(a.Logs()))
}
