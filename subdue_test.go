package picomq

import (
	"context"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/streamstore"
)

// dueRig is a loop-less subscription manager (the test runs its ticks, at
// the times it chooses) on an engine over an in-memory store whose
// subscription document writes fail while failSaves is set, and a webhook
// receiver that answers {"done":true} after failing as many deliveries as
// hookFailures says. Each delivery's generation arrives on hooks.
type dueRig struct {
	m            *subManager
	eng          *streamstore.Engine
	failSaves    atomic.Bool
	hookFailures atomic.Int32
	hooks        chan float64
	hookURL      string
	// held, when set, parks the next write of the subscription document
	// it names (holdPut).
	held atomic.Pointer[putHold]
	// putLatency, when set, is how long each document write takes; putsNow
	// and putsMost count the writes under way, now and at most.
	putLatency        atomic.Int64
	putsNow, putsMost atomic.Int32
}

// putHold parks a document write: arrived is closed when it is parked,
// and it goes on (or fails, with fail) when release is closed.
type putHold struct {
	key     string
	fail    bool
	arrived chan struct{}
	release chan struct{}
}

const dueRoot = "/r/"

func newDueRig(t *testing.T) *dueRig {
	t.Helper()
	g := &dueRig{hooks: make(chan float64, 16)}
	store := memstore.New()
	store.SetFail(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, "subs/") && g.failSaves.Load() {
			return errors.New("injected: subscription document write refused")
		}
		if d := time.Duration(g.putLatency.Load()); d > 0 && op == "PUT" && strings.HasPrefix(key, "subs/") {
			n := g.putsNow.Add(1)
			for most := g.putsMost.Load(); n > most && !g.putsMost.CompareAndSwap(most, n); most = g.putsMost.Load() {
			}
			time.Sleep(d) // the bucket's latency, not a wait for anything
			g.putsNow.Add(-1)
		}
		if h := g.held.Load(); op == "PUT" && h != nil && strings.HasSuffix(key, h.key) && g.held.CompareAndSwap(h, nil) {
			close(h.arrived)
			<-h.release
			if h.fail {
				return errors.New("injected: subscription document write refused")
			}
		}
		return nil
	})
	g.eng = streamstore.New(store, streamstore.Config{NodeID: "test-node", FlushInterval: time.Millisecond}, zaptest.NewLogger(t))
	if err := g.eng.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := g.eng.Close(context.Background()); err != nil {
			t.Errorf("closing engine: %v", err)
		}
	})
	recv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct{ Generation float64 }
		b, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(b, &body)
		g.hooks <- body.Generation
		if g.hookFailures.Add(-1) >= 0 {
			http.Error(w, "not now", http.StatusServiceUnavailable)
			return
		}
		io.WriteString(w, `{"done":true}`)
	}))
	t.Cleanup(recv.Close)
	g.hookURL = recv.URL + "/hook"
	g.m = g.newManager(t)
	return g
}

// newManager is a loop-less manager on g's engine, with no subscriptions.
// pullLeaseRunsOut checks that the lease of pull-wake s holds, in
// generation gen by holder, until the tick at its last millisecond, and
// that the tick at its end opens the next generation with no holder.
func (g *dueRig) pullLeaseRunsOut(t *testing.T, s *subState, which string, gen uint64, holder string) {
	t.Helper()
	lease := g.snap(s).LeaseUntil
	g.tick(t, lease-1)
	if got := g.snap(s); got.Generation != gen || got.Holder != holder {
		t.Fatalf("before the %s lease ran out: generation %d holder %q, want %d and %s", which, got.Generation, got.Holder, gen, holder)
	}
	g.tick(t, lease)
	if got := g.snap(s); got.Generation != gen+1 || got.Holder != "" {
		t.Fatalf("when the %s lease ran out: generation %d holder %q, want %d and none", which, got.Generation, got.Holder, gen+1)
	}
}

func (g *dueRig) newManager(t *testing.T) *subManager {
	t.Helper()
	m := loopLessSubManager(t, g.eng)
	// Delivery and wake event goroutines may outlive the test by a moment
	// (the engine closing fails them): they must not log through t then.
	m.log = zap.NewNop()
	m.priv = ed25519.NewKeyFromSeed(randBytes(ed25519.SeedSize))
	m.kid = jwkThumbprintKID(m.priv.Public().(ed25519.PublicKey))
	m.client = &http.Client{Timeout: webhookTimeout}
	return m
}

// createStream creates stream rel under dueRoot with n records.
func (g *dueRig) createStream(t *testing.T, rel string, n int) {
	t.Helper()
	recs := make([]streamstore.NewRecord, n)
	for i := range recs {
		recs[i] = streamstore.NewRecord{Body: []byte(`{}`)}
	}
	if _, _, err := g.eng.Create(context.Background(), dueRoot+rel, streamstore.CreateRequest{ContentType: "application/json", Records: recs}); err != nil {
		t.Fatalf("create %s: %v", rel, err)
	}
}

// add stores s (a subscription under dueRoot of pattern events/*, with
// the longest lease) and makes it the manager's.
func (g *dueRig) add(t *testing.T, s *subState) *subState {
	t.Helper()
	s.Root, s.key = dueRoot, subDocKey(dueRoot, s.ID)
	s.Config.Pattern, s.Config.LeaseTTLms = "events/*", subMaxLease.Milliseconds()
	if s.Config.Type == "webhook" {
		s.Config.WebhookURL = g.hookURL
	} else {
		s.Config.WakeStream = "wake"
	}
	g.m.mu.Lock()
	defer g.m.mu.Unlock()
	if err := g.m.putSub(s); err != nil {
		t.Fatalf("saving %s: %v", s.ID, err)
	}
	g.m.addSubLocked(s)
	checkDueLocked(t, g.m)
	return s
}

// call serves a claim, ack (heartbeat, or done with an ack of every link at
// its tail), callback or release of s, as its worker would send it, and
// returns the status.
func (g *dueRig) call(t *testing.T, s *subState, op string, done bool) int {
	t.Helper()
	g.m.mu.Lock()
	tok := g.m.tokenLocked(s)
	body := fmt.Sprintf(`{"worker":"w2","wake_id":%q,"generation":%d,"done":%t,"acks":[`, s.WakeID, s.Generation, done)
	if done {
		sep := ""
		for p, l := range s.Links {
			body += fmt.Sprintf(`%s{"stream":%q,"offset":%q}`, sep, p, position{seq: l.Tail}.String())
			sep = ","
		}
	}
	body += "]}"
	g.m.mu.Unlock()
	req := httptest.NewRequest(http.MethodPost, dueRoot+"__ds/subscriptions/"+s.ID+"/"+op, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+tok)
	rec := httptest.NewRecorder()
	switch op {
	case "claim":
		g.m.handleClaim(rec, req, dueRoot, s.ID)
	case "ack", "callback":
		g.m.handleAck(rec, req, dueRoot, s.ID, op == "callback")
	case "release":
		g.m.handleRelease(rec, req, dueRoot, s.ID)
	default:
		t.Fatalf("no such operation %q", op)
	}
	g.m.mu.Lock()
	checkDueLocked(t, g.m)
	g.m.mu.Unlock()
	return rec.Code
}

// tick runs the manager's tick at ms (unix ms), and waits for the writes
// it started.
func (g *dueRig) tick(t *testing.T, ms int64) {
	t.Helper()
	g.m.mu.Lock()
	g.m.tickLocked(time.UnixMilli(ms))
	checkDueLocked(t, g.m)
	g.m.mu.Unlock()
	g.settle(t)
}

// settle waits until no subscription has a writer: the writes the manager
// started in the background (for append notes, the tick) are done.
func (g *dueRig) settle(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		g.m.mu.Lock()
		busy := 0
		for _, s := range g.m.subs {
			if s.busy != nil {
				busy++
			}
		}
		if busy == 0 {
			checkDueLocked(t, g.m)
		}
		g.m.mu.Unlock()
		if busy == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d subscriptions still being written", busy)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// snap returns a copy of s made under the manager's lock (delivery
// goroutines change s).
func (g *dueRig) snap(s *subState) subState {
	g.m.mu.Lock()
	defer g.m.mu.Unlock()
	return *s
}

// waitFor polls until cond holds of s (read under the manager's lock).
func (g *dueRig) waitFor(t *testing.T, s *subState, what string, cond func(s *subState) bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		g.m.mu.Lock()
		ok := cond(s)
		if ok {
			checkDueLocked(t, g.m)
		}
		g.m.mu.Unlock()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: never happened", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// wakeEvents returns the generations of s's events on the wake stream,
// waiting until there are want of them.
func (g *dueRig) wakeEvents(t *testing.T, s *subState, want int) []float64 {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		res, err := g.eng.Read(context.Background(), dueRoot+s.Config.WakeStream, streamstore.ReadRequest{})
		if err != nil && !errors.Is(err, streamstore.ErrNotFound) {
			t.Fatal(err)
		}
		var gens []float64
		for _, r := range res.Records {
			var ev struct {
				SubscriptionID string `json:"subscription_id"`
				Generation     float64
			}
			if json.Unmarshal(r.Body, &ev) == nil && ev.SubscriptionID == s.ID {
				gens = append(gens, ev.Generation)
			}
		}
		if len(gens) >= want || time.Now().After(deadline) {
			return gens
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// hook returns the generation of the next webhook delivery.
func (g *dueRig) hook(t *testing.T) float64 {
	t.Helper()
	select {
	case gen := <-g.hooks:
		return gen
	case <-time.After(10 * time.Second):
		t.Fatal("no webhook delivery")
		return 0
	}
}

// checkDueLocked fails t unless m's due heap holds exactly the
// subscriptions that have a tick case, each at the time of its case, in
// heap order: what the tick used to find by looking at all of them.
func checkDueLocked(t *testing.T, m *subManager) {
	t.Helper()
	in := 0
	for _, s := range m.subs {
		kind, at := s.nextTick()
		listed := s.dueIdx > 0 && s.dueIdx <= len(m.due) && m.due[s.dueIdx-1] == s
		switch {
		case kind == tickNone && s.dueIdx != 0:
			t.Errorf("subscription %s has nothing due but is in the due heap at %d", s.ID, s.dueAt)
		case kind != tickNone && !listed:
			t.Errorf("subscription %s is due at %d (case %d) but not in the due heap (place %d)", s.ID, at, kind, s.dueIdx)
		case kind != tickNone && s.dueAt != at:
			t.Errorf("subscription %s is in the due heap at %d, but due at %d (case %d)", s.ID, s.dueAt, at, kind)
		}
		if listed {
			in++
		}
	}
	if in != len(m.due) {
		t.Errorf("the due heap holds %d entries, %d of them the manager's subscriptions", len(m.due), in)
	}
	for i := 1; i < len(m.due); i++ {
		if m.due[(i-1)/2].dueAt > m.due[i].dueAt {
			t.Errorf("due heap out of order at %d", i)
		}
	}
}

func pendingLink() map[string]*subLink {
	return map[string]*subLink{"events/a": {Glob: true, Acked: 0, Tail: 1, Stream: "x"}}
}

// retryingHook is a webhook subscription whose wake (generation 3) failed
// once and is due to be sent again 5 s after t0, its lease a minute on.
func retryingHook(t0 int64) *subState {
	return &subState{ID: "h", Config: subConfig{Type: "webhook"}, Links: pendingLink(),
		Generation: 3, WakeID: "w_old", LeaseUntil: t0 + 60000, Failures: 1, NextTry: t0 + 5000}
}

// TestSubTickAtDeadline: each of the tick's four cases fires at its time
// and not before, when what happens in between (acks, claims, releases,
// callbacks, failed deliveries) moves or ends it: a time that moved later
// is kept, and one that went is not acted on. Every step also checks that
// the due heap holds exactly what a look at every subscription would find
// (checkDueLocked).
func TestSubTickAtDeadline(t *testing.T) {
	for _, tc := range []struct {
		name string
		run  func(t *testing.T, g *dueRig, t0 int64)
	}{
		{"lease expiry, moved later by a heartbeat", func(t *testing.T, g *dueRig, t0 int64) {
			g.createStream(t, "wake", 0)
			s := g.add(t, &subState{ID: "p", Config: subConfig{Type: "pull-wake"}, Links: pendingLink(),
				Generation: 3, WakeID: "w_old", Holder: "w1", LeaseUntil: t0 + 60000})
			if st := g.call(t, s, "ack", false); st != 200 {
				t.Fatalf("heartbeat: %d", st)
			}
			g.tick(t, t0+60000)
			g.pullLeaseRunsOut(t, s, "renewed", 3, "w1")
			if gens := g.wakeEvents(t, s, 1); fmt.Sprint(gens) != "[4]" {
				t.Fatalf("wake events %v, want [4]", gens)
			}
		}},
		{"lease expiry, moved by a release and a claim", func(t *testing.T, g *dueRig, t0 int64) {
			g.createStream(t, "wake", 0)
			s := g.add(t, &subState{ID: "p", Config: subConfig{Type: "pull-wake"}, Links: pendingLink(),
				Generation: 3, WakeID: "w_old", Holder: "w1", LeaseUntil: t0 + 60000})
			if st := g.call(t, s, "release", false); st != 204 {
				t.Fatalf("release: %d", st)
			}
			g.tick(t, t0+60000) // no lease now: nothing to expire
			if gens := g.wakeEvents(t, s, 1); fmt.Sprint(gens) != "[4]" {
				t.Fatalf("wake events after the release %v, want [4]", gens)
			}
			if st := g.call(t, s, "claim", false); st != 200 {
				t.Fatalf("claim: %d", st)
			}
			g.pullLeaseRunsOut(t, s, "claim's", 4, "w2")
			if gens := g.wakeEvents(t, s, 2); fmt.Sprint(gens) != "[4 5]" {
				t.Fatalf("wake events %v, want [4 5]", gens)
			}
		}},
		{"webhook lease expiry, moved later by a callback", func(t *testing.T, g *dueRig, t0 int64) {
			s := g.add(t, &subState{ID: "h", Config: subConfig{Type: "webhook"}, Links: pendingLink(),
				Generation: 3, WakeID: "w_old", LeaseUntil: t0 + 60000})
			if st := g.call(t, s, "callback", false); st != 200 {
				t.Fatalf("callback: %d", st)
			}
			lease := g.snap(s).LeaseUntil
			g.tick(t, t0+60000)
			g.tick(t, lease-1)
			if got := g.snap(s); got.Generation != 3 || got.WakeID != "w_old" {
				t.Fatalf("before the renewed lease ran out: generation %d wake %q, want 3 and w_old", got.Generation, got.WakeID)
			}
			g.tick(t, lease)
			if gen := g.hook(t); gen != 4 {
				t.Fatalf("delivery when the lease ran out: generation %v, want 4", gen)
			}
			g.waitFor(t, s, "the delivery's done ends the wake", func(s *subState) bool { return s.WakeID == "" })
		}},
		{"webhook retry, after a heartbeat callback", func(t *testing.T, g *dueRig, t0 int64) {
			s := g.add(t, retryingHook(t0))
			if st := g.call(t, s, "callback", false); st != 200 {
				t.Fatalf("callback: %d", st)
			}
			g.tick(t, t0+4999)
			if got := g.snap(s); got.NextTry != t0+5000 || got.Snapshot != nil {
				t.Fatalf("before the retry's time: next try %d, snapshot %v; want %d and none", got.NextTry, got.Snapshot, t0+5000)
			}
			g.tick(t, t0+5000)
			if gen := g.hook(t); gen != 3 {
				t.Fatalf("retried delivery of generation %v, want 3", gen)
			}
			g.waitFor(t, s, "the retry's done ends the wake", func(s *subState) bool { return s.WakeID == "" })
		}},
		{"webhook retry, after a failed retry", func(t *testing.T, g *dueRig, t0 int64) {
			g.hookFailures.Store(1)
			s := g.add(t, retryingHook(t0))
			g.tick(t, t0+5000)
			if gen := g.hook(t); gen != 3 {
				t.Fatalf("first retry of generation %v, want 3", gen)
			}
			g.waitFor(t, s, "the failed retry sets the next", func(s *subState) bool { return s.NextTry > 0 })
			next := g.snap(s).NextTry
			g.tick(t, next-1)
			if got := g.snap(s); got.NextTry != next {
				t.Fatalf("before the next retry's time: next try %d, want %d", got.NextTry, next)
			}
			g.tick(t, next)
			if gen := g.hook(t); gen != 3 {
				t.Fatalf("second retry of generation %v, want 3", gen)
			}
			g.waitFor(t, s, "the retry's done ends the wake", func(s *subState) bool { return s.WakeID == "" })
		}},
		{"webhook retry, ended by a done callback", func(t *testing.T, g *dueRig, t0 int64) {
			s := g.add(t, retryingHook(t0))
			if st := g.call(t, s, "callback", true); st != 200 {
				t.Fatalf("done callback: %d", st)
			}
			g.tick(t, t0+5000)
			g.m.mu.Lock()
			defer g.m.mu.Unlock()
			if s.Generation != 3 || s.WakeID != "" || s.Snapshot != nil || len(g.m.due) != 0 {
				t.Fatalf("after the done callback, at the retry's time: generation %d wake %q snapshot %v, %d due; want 3, none, none, 0",
					s.Generation, s.WakeID, s.Snapshot, len(g.m.due))
			}
		}},
		{"wake event rewrite, after a failed write", func(t *testing.T, g *dueRig, t0 int64) {
			s := g.add(t, &subState{ID: "p", Config: subConfig{Type: "pull-wake"},
				Links: map[string]*subLink{"events/a": {Glob: true, Stream: "x"}}})
			g.m.mu.Lock()
			g.m.applyNoteLocked(appendNote{name: dueRoot + "events/a", id: "x", first: 0, next: 1})
			g.m.mu.Unlock()
			// The wake stream does not exist: the event cannot be written.
			g.waitFor(t, s, "the failed wake event sets a retry", func(s *subState) bool { return s.NextTry > 0 })
			g.createStream(t, "wake", 0)
			next := g.snap(s).NextTry
			g.tick(t, next-1)
			if got := g.snap(s); got.NextTry != next {
				t.Fatalf("before the retry's time: next try %d, want %d", got.NextTry, next)
			}
			g.tick(t, next)
			if gens := g.wakeEvents(t, s, 1); fmt.Sprint(gens) != "[1]" {
				t.Fatalf("wake events %v, want [1]", gens)
			}
		}},
		{"wake event rewrite, ended by a claim", func(t *testing.T, g *dueRig, t0 int64) {
			g.createStream(t, "wake", 0)
			s := g.add(t, &subState{ID: "p", Config: subConfig{Type: "pull-wake"}, Links: pendingLink(),
				Generation: 3, WakeID: "w_old", Failures: 1, NextTry: t0 + 5000})
			if st := g.call(t, s, "claim", false); st != 200 {
				t.Fatalf("claim: %d", st)
			}
			lease := g.snap(s).LeaseUntil
			g.tick(t, t0+5000)
			if gens, got := g.wakeEvents(t, s, 0), g.snap(s); len(gens) != 0 || got.Holder != "w2" {
				t.Fatalf("after the claim, at the retry's time: wake events %v, holder %q; want none and w2", gens, got.Holder)
			}
			g.tick(t, lease)
			if gens := g.wakeEvents(t, s, 1); fmt.Sprint(gens) != "[4]" {
				t.Fatalf("wake events after the lease ran out %v, want [4]", gens)
			}
		}},
		{"pending with nothing in flight, after a wake that could not be saved", func(t *testing.T, g *dueRig, t0 int64) {
			g.createStream(t, "wake", 0)
			s := g.add(t, &subState{ID: "p", Config: subConfig{Type: "pull-wake"},
				Links: map[string]*subLink{"events/a": {Glob: true, Stream: "x"}}})
			g.failSaves.Store(true)
			g.m.mu.Lock()
			g.m.applyNoteLocked(appendNote{name: dueRoot + "events/a", id: "x", first: 0, next: 1})
			checkDueLocked(t, g.m)
			g.m.mu.Unlock()
			g.settle(t)
			if got := g.snap(s); got.WakeID != "" {
				t.Fatalf("a wake was issued although it could not be saved: %q", got.WakeID)
			}
			g.tick(t, t0) // still failing: due again at the next tick
			g.failSaves.Store(false)
			g.tick(t, t0+subTickInterval.Milliseconds())
			if gens := g.wakeEvents(t, s, 1); fmt.Sprint(gens) != "[1]" {
				t.Fatalf("wake events %v, want [1]", gens)
			}
		}},
		{"pending with nothing in flight, ended by the stream's delete", func(t *testing.T, g *dueRig, t0 int64) {
			s := g.add(t, &subState{ID: "p", Config: subConfig{Type: "pull-wake"},
				Links: map[string]*subLink{"events/a": {Glob: true, Stream: "x"}}})
			g.failSaves.Store(true)
			g.m.mu.Lock()
			g.m.applyNoteLocked(appendNote{name: dueRoot + "events/a", id: "x", first: 0, next: 1})
			g.m.mu.Unlock()
			g.settle(t)
			g.failSaves.Store(false)
			g.m.mu.Lock()
			g.m.applyNoteLocked(appendNote{name: dueRoot + "events/a", id: "x", deleted: true})
			checkDueLocked(t, g.m)
			g.m.mu.Unlock()
			g.settle(t)
			g.tick(t, t0)
			if got := g.snap(s); got.Generation != 0 || got.WakeID != "" {
				t.Fatalf("a wake for a deleted stream's records: generation %d wake %q", got.Generation, got.WakeID)
			}
		}},
		{"pending with nothing in flight, ended by removing the stream", func(t *testing.T, g *dueRig, t0 int64) {
			s := g.add(t, &subState{ID: "p", Config: subConfig{Type: "pull-wake"},
				Links: map[string]*subLink{"other/x": {Explicit: true, Stream: "y"}}})
			g.failSaves.Store(true)
			g.m.mu.Lock()
			g.m.applyNoteLocked(appendNote{name: dueRoot + "other/x", id: "y", first: 0, next: 1})
			g.m.mu.Unlock()
			g.settle(t)
			g.failSaves.Store(false)
			rec := httptest.NewRecorder()
			g.m.handleRemoveStream(rec, httptest.NewRequest(http.MethodDelete, dueRoot+"__ds/subscriptions/p/streams/other/x", nil), dueRoot, "p", "other/x")
			if rec.Code != 204 {
				t.Fatalf("remove stream: %d %s", rec.Code, rec.Body)
			}
			g.m.mu.Lock()
			checkDueLocked(t, g.m)
			g.m.mu.Unlock()
			g.tick(t, t0)
			if got := g.snap(s); got.Generation != 0 || got.WakeID != "" {
				t.Fatalf("a wake for a removed stream's records: generation %d wake %q", got.Generation, got.WakeID)
			}
		}},
		{"lease expiry, of a deleted subscription", func(t *testing.T, g *dueRig, t0 int64) {
			g.add(t, &subState{ID: "p", Config: subConfig{Type: "pull-wake"}, Links: pendingLink(),
				Generation: 3, WakeID: "w_old", Holder: "w1", LeaseUntil: t0 + 60000})
			rec := httptest.NewRecorder()
			g.m.handleDelete(rec, httptest.NewRequest(http.MethodDelete, dueRoot+"__ds/subscriptions/p", nil), dueRoot, "p")
			if rec.Code != 204 {
				t.Fatalf("delete: %d %s", rec.Code, rec.Body)
			}
			g.m.mu.Lock()
			checkDueLocked(t, g.m)
			g.m.mu.Unlock()
			g.tick(t, t0+60000)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := newDueRig(t)
			tc.run(t, g, time.Now().UnixMilli())
		})
	}
}

// TestSubLoadSchedulesTicks: after a restart, what the documents say is
// due is the tick's: pending work not woken before the stop, a webhook
// wake in flight (delivered again), a lease running; an idle subscription
// is not in the due heap.
func TestSubLoadSchedulesTicks(t *testing.T) {
	g := newDueRig(t)
	g.createStream(t, "wake", 0)
	g.createStream(t, "events/a", 1)
	info, err := g.eng.Head(context.Background(), dueRoot+"events/a")
	if err != nil {
		t.Fatal(err)
	}
	link := func(acked uint64) map[string]*subLink {
		return map[string]*subLink{"events/a": {Glob: true, Acked: acked, Tail: 1, Stream: info.ID}}
	}
	t0 := time.Now().UnixMilli()
	g.add(t, &subState{ID: "pending", Config: subConfig{Type: "pull-wake"}, Links: link(0)})
	g.add(t, &subState{ID: "hook", Config: subConfig{Type: "webhook"}, Links: link(0), Generation: 3, WakeID: "w_hook", LeaseUntil: t0 + 60000})
	g.add(t, &subState{ID: "leased", Config: subConfig{Type: "pull-wake"}, Links: link(0), Generation: 5, WakeID: "w_leased", Holder: "w1", LeaseUntil: t0 + 60000})
	g.add(t, &subState{ID: "idle", Config: subConfig{Type: "pull-wake"}, Links: link(1)})

	g.m = g.newManager(t)
	if err := g.m.load(); err != nil {
		t.Fatalf("load: %v", err)
	}
	g.m.mu.Lock()
	checkDueLocked(t, g.m)
	subs := map[string]*subState{}
	for _, s := range g.m.subs {
		subs[s.ID] = s
	}
	if n := len(g.m.due); n != 3 {
		t.Errorf("%d subscriptions due after the load, want 3 (all but the idle one)", n)
	}
	g.m.mu.Unlock()

	g.tick(t, time.Now().UnixMilli())
	if gens := g.wakeEvents(t, subs["pending"], 1); fmt.Sprint(gens) != "[1]" {
		t.Errorf("wake events of the pending subscription %v, want [1]", gens)
	}
	if gen := g.hook(t); gen != 3 {
		t.Errorf("delivery of generation %v after the load, want 3 again", gen)
	}
	g.waitFor(t, subs["hook"], "the delivery's done ends the wake", func(s *subState) bool { return s.WakeID == "" })
	if got := g.snap(subs["leased"]); got.Holder != "w1" {
		t.Fatalf("the lease ended before its time: holder %q", got.Holder)
	}
	g.tick(t, t0+60000)
	if gens := g.wakeEvents(t, subs["leased"], 1); fmt.Sprint(gens) != "[6]" {
		t.Errorf("wake events after the stored lease ran out %v, want [6]", gens)
	}
}

// TestSubLoadAnnouncesUnclaimedWake: a pull-wake whose wake was saved but
// whose wake event never landed (the node stopped between the two, or the
// append failed and its retry, kept in memory only, went with the node)
// is announced again after a restart. It used to wait for a claim no
// worker would make: no lease runs for an unclaimed wake, no other wake
// starts while it is in flight, and nothing retried the announcement.
func TestSubLoadAnnouncesUnclaimedWake(t *testing.T) {
	g := newDueRig(t)
	g.createStream(t, "wake", 0)
	g.createStream(t, "events/a", 1)
	info, err := g.eng.Head(context.Background(), dueRoot+"events/a")
	if err != nil {
		t.Fatal(err)
	}
	links := map[string]*subLink{"events/a": {Glob: true, Tail: 1, Stream: info.ID}}
	g.add(t, &subState{ID: "unheard", Config: subConfig{Type: "pull-wake"}, Links: links, Generation: 2, WakeID: "w_unheard"})

	g.m = g.newManager(t)
	if err := g.m.load(); err != nil {
		t.Fatalf("load: %v", err)
	}
	g.m.mu.Lock()
	s := g.m.subs[subDocKey(dueRoot, "unheard")]
	checkDueLocked(t, g.m)
	g.m.mu.Unlock()
	g.tick(t, time.Now().UnixMilli())
	if gens := g.wakeEvents(t, s, 1); fmt.Sprint(gens) != "[2]" {
		t.Fatalf("wake events after the load %v, want [2]: the wake in flight announced again", gens)
	}
}

// TestSlowWebhookWakeIsNotIssuedUnsaved: when a webhook's lease runs out
// on a POST still under way, the next wake waits out the backoff, and, as
// every wake, goes out only once the document holding it is saved: with
// the save refused, the wake is cleared and no new one issued. A first
// version of the backoff built the next wake in the tick and kept it in
// memory when its save failed, and the retry then delivered a generation
// the bucket never held.
func TestSlowWebhookWakeIsNotIssuedUnsaved(t *testing.T) {
	g := newDueRig(t)
	t0 := time.Now().UnixMilli()
	s := g.add(t, &subState{ID: "h", Config: subConfig{Type: "webhook"}, Links: pendingLink(),
		Generation: 3, WakeID: "w_old", LeaseUntil: t0 + 1000})
	g.m.mu.Lock()
	s.posting = "w_old" // its POST still under way
	g.m.mu.Unlock()
	g.failSaves.Store(true)
	g.tick(t, t0+1000)
	got := g.snap(s)
	if got.Generation != 3 || got.WakeID != "" || got.Failures != 1 || got.NextTry <= t0+1000 {
		t.Fatalf("after the lease ran out, saves refused: generation %d wake %q failures %d next try %d; want 3, none, 1, after %d",
			got.Generation, got.WakeID, got.Failures, got.NextTry, t0+1000)
	}
	select {
	case gen := <-g.hooks:
		t.Fatalf("delivered generation %v while its save was refused", gen)
	case <-time.After(100 * time.Millisecond):
	}
	// Saves work again; the backoff runs out: the next wake, saved, goes.
	g.failSaves.Store(false)
	time.Sleep(time.Until(time.UnixMilli(got.NextTry)))
	g.tick(t, time.Now().UnixMilli())
	if gen := g.hook(t); gen != 4 {
		t.Fatalf("delivered generation %v, want 4", gen)
	}
}
