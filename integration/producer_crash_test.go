package integration

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// pcProducer is an idempotent Durable Streams producer: it sends seq n until
// the server settles it (2xx, or a 4xx that ends the run) and only then
// moves on to n+1, so every seq below its next one was acknowledged.
type pcProducer struct {
	c    *dsClient
	name string
	id   string

	mu        sync.Mutex
	next      int      // seqs below this one were acknowledged
	fresh     int      // appends answered 200 (stored by that request)
	dups      int      // appends answered 204 (already stored earlier)
	resends   int      // requests beyond the first of a seq
	transport int      // requests that got no answer
	unavail   int      // requests answered 5xx
	rejected  []string // 409s and other 4xx: each one is a failure
	offsets   []string // problems with the acknowledged Stream-Next-Offset
	lastAck   string
}

func (p *pcProducer) body(n int) []byte { return []byte(fmt.Sprintf("%s seq %06d\n", p.id, n)) }

// run appends until stop is closed, then settles the seq it is on. It gives
// up on a seq only when giveUp passes (the test reports that as a failure).
func (p *pcProducer) run(stop <-chan struct{}, giveUp time.Time) {
	for {
		select {
		case <-stop:
			return
		default:
		}
		if !p.settle(giveUp) {
			return
		}
	}
}

// settle sends the current seq until it is answered 2xx (true) or with a
// 4xx, or until giveUp (false).
func (p *pcProducer) settle(giveUp time.Time) bool {
	p.mu.Lock()
	n := p.next
	p.mu.Unlock()
	hdr := http.Header{
		"Content-Type":   {textPlain},
		"Producer-Id":    {p.id},
		"Producer-Epoch": {"0"},
		"Producer-Seq":   {strconv.Itoa(n)},
	}
	for attempt := 0; ; attempt++ {
		if time.Now().After(giveUp) {
			p.mu.Lock()
			p.rejected = append(p.rejected, fmt.Sprintf("seq %d: not settled before the deadline after %d requests", n, attempt))
			p.mu.Unlock()
			return false
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		r, err := p.c.do(ctx, http.MethodPost, p.name, "", hdr, p.body(n))
		cancel()
		p.mu.Lock()
		if attempt > 0 {
			p.resends++
		}
		switch {
		case err != nil:
			p.transport++
		case r.status >= 500:
			p.unavail++
		case r.status == http.StatusOK || r.status == http.StatusNoContent:
			if r.status == http.StatusOK {
				p.fresh++
				off := r.next()
				if off == "" || off <= p.lastAck {
					p.offsets = append(p.offsets, fmt.Sprintf("seq %d: 200 with Stream-Next-Offset %q, previous ack %q", n, off, p.lastAck))
				} else {
					p.lastAck = off
				}
			} else {
				p.dups++
			}
			p.next++
			p.mu.Unlock()
			return true
		default:
			p.rejected = append(p.rejected, fmt.Sprintf("seq %d (request %d): %s (Producer-Expected-Seq %q, Producer-Received-Seq %q)",
				n, attempt+1, r, r.header.Get("Producer-Expected-Seq"), r.header.Get("Producer-Received-Seq")))
			p.mu.Unlock()
			return false
		}
		p.mu.Unlock()
		time.Sleep(30 * time.Millisecond)
	}
}

// TestProducerCrashRecovery appends with an idempotent producer, resending a
// seq until it is settled, while Caddy is SIGKILLed and restarted again and
// again, some kills while the S3 proxy holds a WAL upload open. The stream
// must end up holding exactly the acknowledged appends, once each and in
// order, and the producer must never see a 409 (a gap or a stale epoch the
// producer never caused) nor any other rejection.
func TestProducerCrashRecovery(t *testing.T) {
	if testing.Short() {
		t.Skip("kills and restarts Caddy")
	}
	const (
		kills     = 6
		heldKills = 3 // kills while a WAL upload is parked at the proxy
		minGap    = 1500 * time.Millisecond
		maxGap    = 3500 * time.Millisecond
	)
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("PICOMQ_CRASH_SEED"); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("PICOMQ_CRASH_SEED: %v", err)
		}
		seed = n
	}
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	t.Logf("random seed %d (PICOMQ_CRASH_SEED)", seed)

	v := testenv.NewVersity(t)
	px := newProxy(t, v)
	storage := caddytest.S3Storage(t, v, px.URL())
	c := caddytest.Start(t, caddyOptions(v, storage, "s3_timeout 5s"))
	// A connection per request: a request never rides a connection the
	// previous process left behind.
	cl := newClient(t, c.URL(), false)
	const name = "/producer-crash/s"
	cl.create(t, name, 30*time.Second)

	p := &pcProducer{c: cl, name: name, id: "crash-producer"}
	stop := make(chan struct{})
	var stopOnce sync.Once
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); p.run(stop, time.Now().Add(75*time.Second)) }()
	// On an early end (t.Fatal) the producer stops before Caddy's own
	// cleanup, registered earlier, kills the process.
	t.Cleanup(func() { stopOnce.Do(func() { close(stop) }); wg.Wait() })

	began := time.Now()
	held, released := 0, 0
	var restarts []time.Duration
	for k := 0; k < kills; k++ {
		time.Sleep(minGap + time.Duration(rng.Int64N(int64(maxGap-minGap))))
		p.mu.Lock()
		stuck := len(p.rejected) > 0
		p.mu.Unlock()
		if stuck {
			break
		}
		var release func()
		if k%2 == 0 && held < heldKills {
			// Park the next WAL upload: its append is in flight, unanswered,
			// when the process dies, and the upload lands afterwards.
			release = px.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Times: 1})
			wctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			err := px.WaitHeld(wctx, 1)
			cancel()
			if err != nil {
				release()
				t.Fatalf("kill %d: no WAL upload reached the proxy within 10s while the producer was appending", k)
			}
			time.Sleep(time.Duration(rng.Int64N(int64(200 * time.Millisecond))))
			held++
		}
		c.Kill()
		if release != nil {
			// Either before the restart, or racing the new process's replay
			// and sealing of the WAL.
			if rng.IntN(2) == 0 {
				release()
			} else {
				d := time.Duration(rng.Int64N(int64(400 * time.Millisecond)))
				wg.Add(1)
				go func() { defer wg.Done(); time.Sleep(d); release() }()
			}
			released++
		}
		time.Sleep(time.Duration(rng.Int64N(int64(300 * time.Millisecond))))
		t0 := time.Now()
		c.Restart()
		restarts = append(restarts, time.Since(t0))
	}
	chaos := time.Since(began)
	// The last process serves the producer for a while, then it stops
	// (after settling the seq it is on).
	time.Sleep(2 * time.Second)
	stopOnce.Do(func() { close(stop) })
	wg.Wait()

	p.mu.Lock()
	defer p.mu.Unlock()
	for _, r := range p.rejected {
		t.Errorf("producer: %s", r)
	}
	for _, o := range p.offsets {
		t.Errorf("producer: %s", o)
	}
	if len(restarts) < 5 {
		t.Fatalf("only %d kills and restarts happened, want at least 5", len(restarts))
	}
	if held != heldKills || released != held {
		t.Errorf("%d kills with a held WAL upload (%d released), want %d", held, released, heldKills)
	}
	if p.next < 50 {
		t.Errorf("only %d appends acknowledged in %s: the producer barely ran", p.next, chaos.Round(time.Millisecond))
	}
	if p.fresh+p.dups != p.next {
		t.Errorf("%d answered 200 + %d answered 204 != %d acknowledged", p.fresh, p.dups, p.next)
	}

	got, tail, err := cl.readAll(name, time.Minute)
	if err != nil {
		t.Fatalf("final read: %v", err)
	}
	var want bytes.Buffer
	for n := 0; n < p.next; n++ {
		want.Write(p.body(n))
	}
	if !bytes.Equal(got, want.Bytes()) {
		i := firstDiff(got, want.Bytes())
		t.Errorf("stream content (%d bytes) differs from the %d acknowledged appends (%d bytes) at byte %d: got %s, want %s",
			len(got), p.next, want.Len(), i, around(got, i), around(want.Bytes(), i))
		// Say what kind of difference it is: a lost, a duplicated or a
		// foreign record.
		seen := map[string]int{}
		for _, line := range bytes.SplitAfter(got, []byte("\n")) {
			if len(line) > 0 {
				seen[string(line)]++
			}
		}
		lost, duplicated := 0, 0
		for n := 0; n < p.next; n++ {
			switch seen[string(p.body(n))] {
			case 0:
				lost++
			case 1:
			default:
				duplicated++
			}
			delete(seen, string(p.body(n)))
		}
		t.Errorf("acknowledged appends missing: %d; stored more than once: %d; other records: %d", lost, duplicated, len(seen))
	}
	if p.lastAck != "" && tail < p.lastAck {
		t.Errorf("tail %s is before the last acknowledged offset %s", tail, p.lastAck)
	}
	t.Logf("producer crash: %d appends acknowledged (%d answered 200, %d duplicates answered 204), %d resends, "+
		"%d requests without an answer, %d answered 5xx; %d kills (%d with a held WAL upload) over %s; restarts took %v",
		p.next, p.fresh, p.dups, p.resends, p.transport, p.unavail, len(restarts), held, chaos.Round(time.Millisecond), restarts)
}
