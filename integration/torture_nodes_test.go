package integration

// TestCrashTortureTwoNodes is the crash torture (torture_test.go) with two
// Caddy processes on one storage: a holder of the storage lease and a
// standby. Run it as TestCrashTorture is run, with PICOMQ_TORTURE (the
// load phase's length) and PICOMQ_TORTURE_SEED:
//
//	PICOMQ_TORTURE=4m go test -count=1 -run TestCrashTortureTwoNodes -v ./integration
//
// Each node has its own data directory (its own node id), its own ports
// and its own fault-injecting S3 proxy in front of the one versitygw
// bucket, so that one node can be cut off from the store while the other
// reaches it. The lease is short (lease_ttl 3s to 6s), so that a run of a
// few minutes sees many takeovers. The workers and live readers of the
// one-node torture send each request to either node at random: the
// standby's 503 is a request without an answer, as for any 5xx. Again and
// again the holder is
//
//   - SIGKILLed, as in the one-node torture (sometimes while its proxy
//     holds an upload of a chosen kind, with a trim, a Stream-Seq append
//     and an append under way; sometimes in a reload, or in a graceful
//     stop that the kill cuts short): the standby takes the storage over
//     once the lease lapses;
//   - stopped gracefully (SIGTERM), giving the lease back: the standby
//     takes over within its poll;
//   - cut off from the store (its proxy down, sometimes with an upload
//     held that lands once the standby has taken over): the standby takes
//     over once the lease lapses; then the proxy comes back, and the old
//     holder, which learns at its next renewal that it was replaced, must
//     refuse reads and writes, until it is killed;
//
// and the old holder is started again and becomes the standby (or, now
// and then started again at once after a kill, takes its own lease back
// before the standby could). Events are dealt from a shuffled deck, and
// half of them are short ones after which the holder should still hold:
//
//   - a cut-off shorter than the lease (0.2 to 0.7 of it, ending early
//     enough for a renewal retry to land before the last expiry the
//     holder wrote, or, one in three, just before the holder stops
//     counting the lease as its own), sometimes with an upload held that
//     lands meanwhile;
//   - a few seconds of transient faults on both proxies at once (500s,
//     503s, lost answers to writes, dropped connections, stalls, added
//     latency, or most lease requests or lease writes failing) while the
//     load goes on.
//
// After one the standby must not have taken a live lease over: a watch
// reads the lease object past the proxies, and a takeover is sound only
// if the holder's latest expiry was past when the standby's lease began
// (the engine's own renewal may fail to land in time under faults; then
// the event ends as a cut-off does). Otherwise the holder must
// acknowledge a write again within 15 s and the standby still refuse.
// After each event every fact recorded so far is checked through the
// holder alone, while the load goes on: nothing acknowledged by either
// node, at any time, is missing, nothing a reader was served reads
// differently, and trims, Stream-Seq, closes and deletes hold. Besides,
// a node cut off from the store for longer than a lease must not
// acknowledge a write (an append with new records, a create, a delete)
// sent after its lease lapsed: its lease was no longer certainly its
// own. At the end the load stops and each stream is read whole through
// the holder, as in the one-node torture (and so is every write
// acknowledged after a short event), and the standby must still refuse.

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// tNode is one of the two processes.
type tNode struct {
	name string
	c    *caddytest.Caddy
	px   *testenv.Proxy
	cl   *dsClient
	// reloads are the configs a reload loads (tTorture.reloads).
	reloads []string
	// cutAt is when its proxy went down, zero while it reaches the store.
	mu    sync.Mutex
	cutAt time.Time
}

func (n *tNode) cut(at time.Time) {
	n.mu.Lock()
	n.cutAt = at
	n.mu.Unlock()
}

func (n *tNode) cutSince() time.Time {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.cutAt
}

// probe asks the node whether it serves the storage: true for an answer
// below 500 to a read of a stream that does not exist, false for a 503 (a
// standby, a replaced process) or no answer.
func (n *tNode) probe() bool {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	r, err := n.cl.do(ctx, http.MethodGet, "/ds/torture-probe/none", "offset=-1", nil, nil)
	return err == nil && r.status < 500
}

// replacedHeads sends a HEAD of each of a few streams through both
// protocols to node n, which another process took the storage over from,
// and returns the answers that served a stream's state from memory
// instead of refusing as its reads do.
func (n *tNode) replacedHeads(streams []*tStream) []string {
	var served []string
	for i, s := range streams {
		if i == 4 {
			break
		}
		for _, p := range []string{"/ds", "/pico"} {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			r, err := n.cl.do(ctx, http.MethodHead, p+s.name, "", nil, nil)
			cancel()
			if err == nil && r.status < 300 {
				served = append(served, fmt.Sprintf("HEAD %s%s: %d, tail %s%s", p, s.name, r.status,
					r.header.Get("Stream-Next-Offset"), r.header.Get("Pico-Next-Seq")))
			}
		}
	}
	return served
}

// writeAck says whether r acknowledges a write that a node may only make
// as the lease's holder: an append that stored new records, a create of a
// new stream, a delete. Answers that can come from memory alone (a
// producer's duplicate, a repeated create or close, a trim already in
// force) are left out.
func writeAck(method string, hdr map[string]string, r *response) bool {
	if r.status >= 300 {
		return false
	}
	switch method {
	case http.MethodPut:
		return r.status == http.StatusCreated
	case http.MethodDelete:
		return true
	case http.MethodPost:
		for _, h := range []string{"Stream-Closed", "Pico-Closed", "Pico-Trim-Seq"} {
			if hdr[h] != "" {
				return false
			}
		}
		if hdr["Content-Type"] == "application/vnd.picomq.batch+json" {
			return r.header.Get("Pico-Start-Seq") != ""
		}
		if hdr["Producer-Id"] != "" {
			return r.status == http.StatusOK // 204: a duplicate
		}
		return true
	}
	return false
}

func TestCrashTortureTwoNodes(t *testing.T) {
	length, seed, rng := tortureLength(t)

	v := testenv.NewVersity(t)
	bucket := v.NewBucket(t)
	keepBucket(t, v, bucket)
	engine := tortureEngine(rng)
	ttl := []time.Duration{3 * time.Second, 4 * time.Second, 6 * time.Second}[rng.IntN(3)]
	engine = append(engine, fmt.Sprintf("lease_ttl %s", ttl))
	t.Logf("engine settings: %s", strings.Join(engine, "; "))
	// A reload loads a node's config again, or one with other engine
	// settings (the lease's lifetime kept: it would change only at a
	// restart).
	reloadEngine := append(tortureEngine(rng), fmt.Sprintf("lease_ttl %s", ttl))
	slow := rng.IntN(3) == 0

	latency, jitter := time.Millisecond, 4*time.Millisecond
	if slow {
		latency, jitter = 10*time.Millisecond, 30*time.Millisecond // a distant bucket
	}

	nodes := make([]*tNode, 2)
	for i := range nodes {
		px := newProxy(t, v)
		px.SetLatency(latency, jitter)
		px.AddFault(testenv.Fault{Status: http.StatusServiceUnavailable, Rate: 0.01})
		px.AddFault(testenv.Fault{Op: testenv.OpPut, Status: http.StatusServiceUnavailable, AfterForward: true, Rate: 0.005})
		storage := testenv.StoreURL(px.URL(), bucket, caddytest.S3Prefix)
		cfg := tortureCaddyfile(storage, engine)
		opts := caddytest.Options{Caddyfile: cfg, Env: caddytest.S3Env(v), ReadyTimeout: 90 * time.Second}
		var c *caddytest.Caddy
		if i == 0 {
			c = caddytest.Start(t, opts)
		} else {
			// Its own data directory: another node id, a standby.
			var err error
			if c, err = caddytest.Launch(t, opts); err != nil {
				t.Fatalf("the second node did not start: %v", err)
			}
		}
		nodes[i] = &tNode{name: string(rune('A' + i)), c: c, px: px, cl: newClient(t, c.URL(), true),
			reloads: []string{cfg, tortureCaddyfile(storage, reloadEngine)}}
	}
	if !waitFor(30*time.Second, nodes[0].probe) {
		t.Fatal("the first node does not serve the storage")
	}
	if nodes[1].probe() {
		t.Fatal("the second node serves the storage the first one holds")
	}

	run := &tRun{t: t, m: &tModel{}, stop: make(chan struct{}),
		nodes: []*dsClient{nodes[0].cl, nodes[1].cl}}
	run.churn = rng.IntN(2) == 0
	if v := os.Getenv("PICOMQ_TORTURE_CHURN"); v != "" {
		run.churn = v == "1"
	}
	t.Logf("stream churn: %v; lease_ttl %s", run.churn, ttl)
	// A node cut off from the store holds its lease for at most ttl after
	// its last renewal, which began before the cut: from then on it must
	// acknowledge no write. (The margin: the request's own way in.)
	var fencingAcks []string
	var fmu sync.Mutex
	run.answered = func(i int, sent time.Time, method, path string, hdr map[string]string, r *response) {
		cut := nodes[i].cutSince()
		if cut.IsZero() || !sent.After(cut.Add(ttl+100*time.Millisecond)) || !writeAck(method, hdr, r) {
			return
		}
		run.m.violation("node %s acknowledged %s %s (%s) sent %s after it was cut off from the store, past its lease (%s): a second writer",
			nodes[i].name, method, path, r, sent.Sub(cut).Round(time.Millisecond), ttl)
		fmu.Lock()
		fencingAcks = append(fencingAcks, path)
		fmu.Unlock()
	}
	anyNode := &tTorture{tRun: run}
	view := func(i int) *tTorture {
		return &tTorture{tRun: run, c: nodes[i].c, cl: nodes[i].cl, reloads: nodes[i].reloads}
	}

	var wg sync.WaitGroup
	var stopOnce sync.Once
	stopLoad := func() { stopOnce.Do(func() { close(run.stop) }); wg.Wait() }
	t.Cleanup(stopLoad)
	startLoad(anyNode, seed, &wg)

	holds := []testenv.Fault{
		{Op: testenv.OpPut, KeyContains: "/wal/", Times: 1},
		{Op: testenv.OpPut, KeyContains: "/data/", Times: 1},
		{Op: testenv.OpPut, KeyContains: "/pack/", Times: 1},
		{Op: testenv.OpPut, KeyContains: "/streams/", Times: 1},
		{Op: testenv.OpPut, KeyContains: "/manifest", Times: 1},
		{Op: testenv.OpDelete, KeyContains: "/wal/", Times: 1},
		{Op: testenv.OpPut, KeyContains: "/wal/"}, // every WAL upload until the release
		{Op: testenv.OpPut, KeyContains: "/lease", Times: 1},
		{Op: testenv.OpPut, KeyContains: "/gc/", Times: 1},
	}
	// hold parks an upload of a random kind on node n's proxy, if one
	// comes within 5 s; it returns what it held and the release.
	hold := func(n *tNode) (string, func()) {
		h := holds[rng.IntN(len(holds))]
		rel := n.px.Hold(h)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := n.px.WaitHeld(ctx, 1)
		cancel()
		if err != nil {
			rel()
			return "", nil
		}
		time.Sleep(time.Duration(rng.Int64N(int64(200 * time.Millisecond))))
		kind := h.Op + " " + h.KeyContains
		if h.Times == 0 {
			kind += " (all)"
		}
		return kind, rel
	}
	// releaseLater lets a held upload land now or a little later.
	releaseLater := func(rel func()) {
		if rel == nil {
			return
		}
		if rng.IntN(2) == 0 {
			rel()
			return
		}
		d := time.Duration(rng.Int64N(int64(700 * time.Millisecond)))
		wg.Add(1)
		go func() { defer wg.Done(); time.Sleep(d); rel() }()
	}
	// takeoverLimit bounds the wait for a standby: the lease lapses at
	// most ttl after its last renewal, the standby looks every 2 s, and a
	// start replays the WAL.
	takeoverLimit := 2*ttl + 30*time.Second
	// waitHolder waits for one of the nodes (not the one excluded) to
	// serve the storage, and checks that the other does not.
	waitHolder := func(exclude int, within time.Duration) int {
		deadline := time.Now().Add(within)
		for time.Now().Before(deadline) {
			for i, n := range nodes {
				if i == exclude || !n.probe() {
					continue
				}
				if o := 1 - i; o != exclude && nodes[o].probe() {
					run.m.violation("both nodes serve the storage: %s, and %s too", n.name, nodes[o].name)
				}
				return i
			}
			time.Sleep(100 * time.Millisecond)
		}
		t.Fatalf("no node took the storage over within %s", within)
		return -1
	}
	restart := func(n *tNode) {
		n.cut(time.Time{})
		if err := n.c.TryRestart(); err != nil {
			t.Fatalf("restarting node %s: %v", n.name, err)
		}
	}

	// The short events (a cut-off shorter than the lease, faults on both
	// proxies) leave the holder holding, unless its lease lapsed: a lease
	// watch reads the lease object past the proxies and judges any
	// takeover (torture_lease_test.go). After the event the holder must
	// acknowledge a write again within resumeLimit: its renewal is retried
	// at least every second (renewRetry below, as streamstore's
	// renewLease), an S3 request the outage failed is retried by the
	// store with a backoff of at most 5 s, and a WAL writer broken by it
	// waits at most 5 s more before its next namespace; the rest is room
	// for a versitygw on two busy cores.
	s3c := v.Client()
	const resumeLimit = 15 * time.Second
	renewRetry := min(time.Second, ttl/3)
	resumeStream := "/ds/torture-probe/resumed"
	nodes[0].cl.create(t, resumeStream, 30*time.Second)
	var resumeAcked [][]byte
	// resumeWrite appends to resumeStream through n until an append is
	// acknowledged (it must then read back at the end, like every
	// acknowledged record) or until the deadline.
	resumeWrite := func(n *tNode, deadline time.Time) bool {
		body := fmt.Appendf(nil, "resumed %d on %s at %s;", len(resumeAcked), n.name, time.Now().Format("15:04:05.000"))
		for time.Now().Before(deadline) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			r, err := n.cl.appendBody(ctx, resumeStream, body)
			cancel()
			if err == nil && r.status < 300 {
				resumeAcked = append(resumeAcked, body)
				return true
			}
			if err == nil && r.status < 500 {
				run.m.violation("node %s refused an append to %s after the event: %s", n.name, resumeStream, r)
				return false
			}
			time.Sleep(100 * time.Millisecond)
		}
		return false
	}
	var slowestResume time.Duration
	// afterBlip follows a short event on holder hi that ended at back: the
	// holder must acknowledge a write again within resumeLimit and the
	// standby must not serve, unless the lease watch w saw the lease
	// lapse and the standby take it (then the old holder, which learns at
	// its next renewal that it was replaced, must refuse, and is killed
	// and started again as the standby, as after a long cut-off). It
	// returns the holder after the event and whether the lease changed
	// hands.
	afterBlip := func(what string, hi int, w *leaseWatch, back time.Time) (int, bool) {
		h, o := nodes[hi], nodes[1-hi]
		resumed, took := false, time.Duration(0)
		for deadline := back.Add(resumeLimit); time.Now().Before(deadline); {
			if o.probe() {
				break // taken over: judged below
			}
			if resumeWrite(h, time.Now().Add(min(time.Until(deadline), time.Second))) {
				resumed, took = true, time.Since(back)
				slowestResume = max(slowestResume, took)
				break
			}
		}
		// A standby looks at the lease at least every 2 s: a takeover
		// the event brought about shows by then.
		time.Sleep(3 * time.Second)
		v := judgeTakeover(w.end(), ttl)
		if !v.taken {
			if o.probe() {
				run.m.violation("after %s, node %s serves the storage, though the lease object still names node %s (%s)",
					what, o.name, h.name, v.detail)
			}
			if !resumed {
				run.m.violation("node %s acknowledged no write within %s after %s, and kept its lease (%s)",
					h.name, resumeLimit, what, v.detail)
			} else {
				t.Logf("%s: node %s kept the lease and acknowledged a write %s after", what, h.name,
					took.Round(time.Millisecond))
			}
			return hi, false
		}
		if !v.lapsed {
			run.m.violation("node %s took the storage over from node %s in %s while its lease was live: %s",
				o.name, h.name, what, v.detail)
		} else {
			t.Logf("%s: the lease of node %s lapsed and node %s took over: %s", what, h.name, o.name, v.detail)
		}
		next := waitHolder(hi, takeoverLimit)
		if !waitFor(ttl+15*time.Second, func() bool { return !h.probe() }) {
			run.m.violation("node %s still serves the storage %s after node %s took it over in %s",
				h.name, ttl+15*time.Second, nodes[next].name, what)
		} else if served := h.replacedHeads(run.m.all()); len(served) > 0 {
			run.m.violation("node %s, replaced by node %s, refuses reads but answers HEADs from memory: %s",
				h.name, nodes[next].name, strings.Join(served, "; "))
		}
		h.c.Kill()
		restart(h)
		return next, true
	}
	// freshLease waits (up to a lease) for the holder's next renewal to
	// land and returns the expiry it wrote.
	freshLease := func() time.Time {
		var first time.Time
		var last time.Time
		deadline := time.Now().Add(ttl)
		for time.Now().Before(deadline) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			s, err := readLease(ctx, s3c, bucket)
			cancel()
			if err == nil {
				if first.IsZero() {
					first = s.expires
				} else if !s.expires.Equal(first) {
					return s.expires
				}
				last = s.expires
			}
			time.Sleep(20 * time.Millisecond)
		}
		return last
	}
	faultKinds := []string{"503s", "500s", "lost answers to writes", "dropped connections", "stalls", "lease requests failing", "lease writes failing", "latency"}
	// faultBoth puts transient faults of a random kind on both proxies and
	// returns what it did and the undoing.
	faultBoth := func() (string, func()) {
		kind := faultKinds[rng.IntN(len(faultKinds))]
		rate := 0.1 + 0.3*rng.Float64()
		var f testenv.Fault
		switch kind {
		case "503s":
			f = testenv.Fault{Status: http.StatusServiceUnavailable, Rate: rate}
		case "500s":
			f = testenv.Fault{Status: http.StatusInternalServerError, Rate: rate}
		case "lost answers to writes":
			f = testenv.Fault{Op: testenv.OpPut, Status: http.StatusInternalServerError, AfterForward: true, Rate: rate}
		case "dropped connections":
			f = testenv.Fault{Reset: true, Rate: rate}
		case "stalls":
			// Requests that hang up to 2 s before they go on, past the
			// renewal's own timeout (a third of the lease) at times.
			f = testenv.Fault{Stall: 500*time.Millisecond + time.Duration(rng.Int64N(int64(1500*time.Millisecond))), Rate: rate}
		case "lease requests failing":
			// Most of the holder's renewals and the standby's looks,
			// each retried by the store: the lease may lapse (a sound
			// takeover), and the watch judges it.
			rate = 0.5 + 0.4*rng.Float64()
			f = testenv.Fault{KeyContains: "/lease", Status: http.StatusInternalServerError, Rate: rate}
		case "lease writes failing":
			// The holder's renewals, while the standby's looks read the
			// lease freely: the lease lapses more often than not, and
			// the standby's write of its own lease meets the faults.
			rate = 0.8 + 0.15*rng.Float64()
			f = testenv.Fault{Op: testenv.OpPut, KeyContains: "/lease", Status: http.StatusServiceUnavailable, Rate: rate}
		case "latency":
			add := 100*time.Millisecond + time.Duration(rng.Int64N(int64(300*time.Millisecond)))
			for _, n := range nodes {
				n.px.SetLatency(latency+add, jitter+add/2)
			}
			return fmt.Sprintf("latency +%s", add.Round(time.Millisecond)), func() {
				for _, n := range nodes {
					n.px.SetLatency(latency, jitter)
				}
			}
		}
		var undo []func()
		for _, n := range nodes {
			undo = append(undo, n.px.AddFault(f))
		}
		desc := fmt.Sprintf("%s on %.0f%% of requests", kind, 100*rate)
		if f.Stall > 0 {
			desc = fmt.Sprintf("%s of %s on %.0f%% of requests", kind, f.Stall.Round(time.Millisecond), 100*rate)
		}
		return desc, func() {
			for _, u := range undo {
				u()
			}
		}
	}

	// Events are dealt from a shuffled deck (its numbers pick the cases
	// below: two short cut-offs, two bursts of faults, a long cut-off, a
	// graceful stop and two kills), so that a run of a few minutes sees
	// each kind in proportion: drawn at random, a 3-minute run of about
	// 15 events saw one short cut-off in two of five runs.
	deck := []int{0, 0, 5, 5, 10, 13, 15, 15}
	var dealt []int
	deal := func() int {
		if len(dealt) == 0 {
			dealt = append(dealt, deck...)
			rng.Shuffle(len(dealt), func(i, j int) { dealt[i], dealt[j] = dealt[j], dealt[i] })
		}
		r := dealt[0]
		dealt = dealt[1:]
		return r
	}
	began := time.Now()
	holder := 0
	var kills, stops, cuts, takeovers, retaken, heldEvents, checks int
	var shortCuts, faultBursts, lapsedBlips int
	var longestShortCut float64
	events := map[string]int{}
	var takeoverTimes []time.Duration
	var totalRecs, totalObs int
	for time.Since(began) < length && !t.Failed() {
		time.Sleep(500*time.Millisecond + time.Duration(rng.Int64N(int64(4*time.Second))))
		h, o := nodes[holder], nodes[1-holder]
		var kind string
		var release func()
		if rng.IntN(3) > 0 {
			if kind, release = hold(h); release != nil {
				heldEvents++
			}
		}
		if rng.IntN(2) == 0 {
			anyNode.inFlight(rng, &wg)
			time.Sleep(time.Duration(10+rng.IntN(40)) * time.Millisecond)
		}
		var event string
		eventAt := time.Now()
		early, blip, handed := false, false, false
		switch r := deal(); {
		case r < 5:
			// Cut off for less than the lease: from just after a renewal
			// landed, plus a random part of the renewal period, for 0.2
			// to 0.7 of the lease, but so that the proxy is back with
			// time for a renewal retry (and latency) before the last
			// expiry written: the lease cannot lapse unless a fault
			// fails that retry too, and the lease watch tells. One in
			// three goes to the edge instead: the proxy is back just
			// before the holder stops counting the lease as its own (a
			// fifth of it before the expiry), so that its renewal may
			// land after that, while it refuses all work, or (with a
			// lease of 3 or 4 s) after the expiry, and the standby may
			// soundly take over.
			shortCuts++
			blip = true
			w := watchLease(t, s3c, bucket)
			expires := freshLease()
			time.Sleep(time.Duration(rng.Int64N(int64(ttl / 3))))
			d := ttl/5 + time.Duration(rng.Int64N(int64(ttl/2)))
			d = min(d, time.Until(expires)-renewRetry-500*time.Millisecond)
			event = "short cut-off"
			if rng.IntN(3) == 0 {
				d = time.Until(expires.Add(-ttl/5)) - time.Duration(rng.Int64N(int64(500*time.Millisecond)))
				event += " to the edge"
			}
			d = max(d, 0)
			longestShortCut = max(longestShortCut, d.Seconds()/ttl.Seconds())
			h.px.Down()
			time.Sleep(d)
			// A held upload lands while the holder hears nothing of it,
			// or a moment after the proxy is back.
			releaseLater(release)
			if err := h.px.Up(); err != nil {
				t.Fatalf("node %s's proxy up again: %v", h.name, err)
			}
			holder, handed = afterBlip(fmt.Sprintf("a %s of node %s for %s (%.2f of the lease)",
				event, h.name, d.Round(time.Millisecond), d.Seconds()/ttl.Seconds()), holder, w, time.Now())
		case r < 10:
			// Transient faults on both proxies for a few seconds, while
			// the load goes on: the holder's renewals and the standby's
			// look at the lease meet them too.
			faultBursts++
			blip = true
			w := watchLease(t, s3c, bucket)
			kind, undo := faultBoth()
			releaseLater(release)
			d := 2*time.Second + time.Duration(rng.Int64N(int64(4*time.Second)))
			time.Sleep(d)
			undo()
			event = "faults on both nodes"
			holder, handed = afterBlip(fmt.Sprintf("%s for %s on both nodes' proxies", kind, d.Round(time.Millisecond)), holder, w, time.Now())
		case r < 13:
			// Cut off: the held upload, if any, lands once the standby
			// has taken over, and its answer is lost.
			cuts++
			event = "cut off"
			h.cut(eventAt)
			h.px.Down()
			next := waitHolder(holder, takeoverLimit)
			takeoverTimes = append(takeoverTimes, time.Since(eventAt))
			releaseLater(release)
			time.Sleep(time.Duration(rng.Int64N(int64(ttl))))
			if err := h.px.Up(); err != nil {
				t.Fatalf("node %s's proxy up again: %v", h.name, err)
			}
			// Its next renewal, a third of the lease after the last one
			// tried (or a second), finds the lease taken: from then on
			// it serves nothing.
			if !waitFor(ttl+15*time.Second, func() bool { return !h.probe() }) {
				run.m.violation("node %s still serves the storage %s after it came back, though node %s took it over",
					h.name, ttl+15*time.Second, nodes[next].name)
			} else if served := h.replacedHeads(run.m.all()); len(served) > 0 {
				// Its reads refuse: its HEADs must too, as stale.
				run.m.violation("node %s, replaced by node %s, refuses reads but answers HEADs from memory: %s",
					h.name, nodes[next].name, strings.Join(served, "; "))
			}
			// Requests go to the replaced process for a moment.
			time.Sleep(time.Duration(rng.Int64N(int64(2 * time.Second))))
			if rng.IntN(3) == 0 {
				_ = h.c.StopTimeout(5 * time.Second)
			} else {
				h.c.Kill()
			}
			kills++
			restart(h)
			holder = next
		case r < 15:
			stops++
			event = "graceful stop"
			if err := h.c.StopTimeout(30 * time.Second); err != nil {
				event = "graceful stop cut by a kill after 30s"
			}
			releaseLater(release)
			// A stop released the lease: the standby takes over within
			// its poll, and the node comes back as the standby.
			holder = waitHolder(holder, takeoverLimit)
			takeoverTimes = append(takeoverTimes, time.Since(eventAt))
			restart(h)
		default:
			kills++
			event = view(holder).crash(rng)
			releaseLater(release)
			if early = rng.IntN(5) == 0; early {
				// Back at once: the same node id takes its lease back
				// before it lapses, unless a completed stop gave it to
				// the standby already.
				restart(h)
				holder = waitHolder(-1, takeoverLimit)
			} else {
				holder = waitHolder(holder, takeoverLimit)
				takeoverTimes = append(takeoverTimes, time.Since(eventAt))
				restart(h)
			}
		}
		if kind != "" {
			event += ", " + kind + " held"
		}
		if early {
			event += ", restarted at once"
		}
		if handed {
			lapsedBlips++
			event += ", lease lapsed"
		}
		events[event]++
		switch {
		case blip && !handed:
			// The holder held on: nothing was killed or taken over.
		case nodes[holder] == h:
			run.kills.Add(1)
			retaken++
		default:
			run.kills.Add(1)
			takeovers++
		}
		if o.probe() && nodes[holder] != o {
			run.m.violation("node %s serves the storage node %s holds", o.name, nodes[holder].name)
		}
		r, ob, _ := view(holder).check(false)
		totalRecs += r
		totalObs += ob
		checks++
		if n := run.m.violations.Load(); n > 0 {
			t.Errorf("violations after event %d (%s), node %s holding", kills+stops, event, nodes[holder].name)
			break
		}
	}
	loadTook := time.Since(began)
	stopLoad()
	time.Sleep(2 * time.Second)
	final := view(holder)
	for _, s := range run.m.all() {
		s.mu.Lock()
		created := s.created
		s.mu.Unlock()
		if created {
			final.probeStreamSeq(s)
		}
	}
	r, ob, n := final.check(true)
	totalRecs += r
	totalObs += ob
	if content, _, err := nodes[holder].cl.readAll(resumeStream, time.Minute); err != nil {
		run.m.violation("reading %s at the end: %v", resumeStream, err)
	} else {
		for _, b := range resumeAcked {
			if !bytes.Contains(content, b) {
				run.m.violation("%s: the append %q, acknowledged after a short event, is missing", resumeStream, b)
			}
		}
	}
	if nodes[1-holder].probe() {
		run.m.violation("at the end node %s serves the storage node %s holds", nodes[1-holder].name, nodes[holder].name)
	}
	for _, n := range nodes {
		for _, v := range replayAnomalies(n.c.Logs()) {
			run.m.violation("node %s: %s", n.name, v)
		}
	}
	for _, v := range run.m.vlist {
		t.Error(v)
	}
	m := run.m
	slowest := time.Duration(0)
	for _, d := range takeoverTimes {
		slowest = max(slowest, d)
	}
	t.Logf("load %s: takeovers %d (slowest %s after the event), lease taken back by the same node %d; kills %d, graceful stops %d, cut off from the store %d; %d with an upload held; events %v; checks %d during the load and one at the end",
		loadTook.Round(time.Second), takeovers, slowest.Round(time.Millisecond), retaken, kills, stops, cuts, heldEvents, events, checks)
	t.Logf("short events: cut-offs shorter than the lease %d (longest %.2f of the lease), faults on both nodes %d; the lease lapsed in %d of them; the holder acknowledged writes again within %s of the end at the slowest (%d such appends, all read back)",
		shortCuts, longestShortCut, faultBursts, lapsedBlips, slowestResume.Round(time.Millisecond), len(resumeAcked))
	t.Logf("streams %d (checked at the end %d): creates %d, forks %d, closes %d, deletes %d; appends acked: DS %d, DS producer %d, Pico batches %d (%d large); no answer (or 503) %d, refused %d; stale producer epochs fenced %d; writes acked by a cut-off node past its lease %d",
		len(m.all()), n, m.creates.Load(), m.forks.Load(), m.closes.Load(), m.deletes.Load(), m.appends.Load(), m.producerAppends.Load(),
		m.picoAppends.Load(), m.large.Load(), m.noAnswer.Load(), m.refused.Load(), m.fenced.Load(), len(fencingAcks))
	t.Logf("trims acked %d unanswered %d; Stream-Seq appends acked %d, refused as out of order %d, stale ones refused %d; reads: catch-up %d, long-polls %d, SSE events %d, Pico long-polls %d; facts checked: records %d, served ranges %d",
		m.trims.Load(), m.trimsLost.Load(), m.seqAppends.Load(), m.seqRefused.Load(), m.seqProbes.Load(),
		m.reads.Load(), m.polls.Load(), m.sseEvents.Load(), m.picoPolls.Load(), totalRecs, totalObs)
}

// keepBucket copies the bucket into PICOMQ_KEEP when the test fails, once
// the nodes have stopped (cleanups run last first), for a post-mortem.
func keepBucket(t *testing.T, v *testenv.Versity, bucket string) {
	t.Helper()
	dir := os.Getenv(caddytest.KeepEnv)
	if dir == "" {
		return
	}
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		dst := filepath.Join(dir, bucket)
		if err := os.CopyFS(dst, os.DirFS(filepath.Join(v.Dir, bucket))); err != nil {
			t.Logf("keeping the bucket: %v", err)
			return
		}
		t.Logf("bucket kept in %s", dst)
	})
}

// replayAnomalies returns the lines of a Caddy log in which a replay found
// the bucket inconsistent with itself: what it then ignores was written by
// the engine, so some step of it broke an invariant, even when no record a
// client was told of went missing.
func replayAnomalies(log string) []string {
	var found []string
	for line := range strings.Lines(log) {
		if strings.Contains(line, "pack entry does not continue its stream") {
			found = append(found, strings.TrimSpace(line))
		}
	}
	return found
}
