package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// The fault tests run Caddy with a small per-request S3 timeout, so that
// every failure is detected within a few seconds.
const fhS3Timeout = time.Second

// fhFailBound is how long an append may take to fail while the object store
// is faulty, derived from the configured timeouts: a store request makes at
// most 5 attempts (segment.OpenOptions' default), each bounded by
// s3_timeout, with at most 50+100+200+400 ms of backoff between them; an
// append's fate needs its WAL upload plus the seal that settles it, two
// such requests. Add the flush interval and 2 s for a busy 2-core machine.
const fhFailBound = 2*(5*fhS3Timeout+time.Second) + 2*time.Second

// fhRecoverBound is how long after the store is healthy again appends must
// be acknowledged again, without restarting Caddy.
const fhRecoverBound = 30 * time.Second

const (
	fhFaultStreams  = 3 // streams, one writer each
	fhAppendsBefore = 4 // acknowledged appends per stream before the fault
	fhAppendsDuring = 3 // appends per stream while the fault holds
	fhAppendsAfter  = 3 // appends per stream once recovered
)

// fhMsg is the JSON message each append carries.
type fhMsg struct {
	W     int    `json:"w"`     // writer (= stream)
	N     int    `json:"n"`     // position in the writer's sends
	Phase string `json:"phase"` // before, during, recover, after
}

// fhOutcome is what one append got.
type fhOutcome struct {
	msg    fhMsg
	resp   fhResp
	err    error
	offset string // Stream-Next-Offset on 2xx
}

func (o fhOutcome) acked() bool { return o.err == nil && o.resp.Status/100 == 2 }

// TestObjectStoreFaults injects each kind of object-store failure under
// live appends and checks that the module answers 503 with a reason and a
// Retry-After within fhFailBound, never acknowledges what is not durable,
// and recovers on its own once the store is back.
func TestObjectStoreFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	cases := []struct {
		name string
		// inject starts the fault and returns the function that ends it.
		inject func(t *testing.T, e *fhEnv) (heal func())
		// mayLand: the fault lets writes reach the bucket (only the
		// answer is lost), so a 503'd append may still show up, and a
		// 2xx is allowed while it holds as long as the record is durable.
		mayLand bool
	}{
		{
			name: "wal-put-503",
			inject: func(t *testing.T, e *fhEnv) func() {
				p := e.proxy
				return p.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Status: http.StatusServiceUnavailable})
			},
		},
		{
			name: "wal-put-500",
			inject: func(t *testing.T, e *fhEnv) func() {
				p := e.proxy
				return p.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Status: http.StatusInternalServerError})
			},
		},
		{
			name: "connection-reset",
			inject: func(t *testing.T, e *fhEnv) func() {
				p := e.proxy
				// Every request of every kind has its connection dropped
				// before it reaches the server.
				return p.AddFault(testenv.Fault{Reset: true})
			},
		},
		{
			name: "reset-after-write-landed",
			inject: func(t *testing.T, e *fhEnv) func() {
				p := e.proxy
				// WAL PUTs land, but their answers are lost.
				return p.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Reset: true, AfterForward: true})
			},
			mayLand: true,
		},
		{
			name: "wal-upload-lands-after-its-503",
			inject: func(t *testing.T, e *fhEnv) func() {
				p := e.proxy
				// The first WAL upload is parked; every later WAL PUT
				// (its retries, the seals) fails with 503 until the
				// fault ends. Then the parked upload is delivered
				// first, and only after it has landed may the seal
				// that settles it through: the append was answered 503
				// long before, yet its record is stored.
				var before map[string]bool
				release := p.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Times: 1})
				removed := make(chan func(), 1)
				go func() {
					ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					defer cancel()
					if err := p.WaitHeld(ctx, 1); err != nil {
						removed <- func() {}
						return
					}
					before = fhKeySet(e.mustList("wal/"))
					removed <- p.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Status: http.StatusServiceUnavailable})
				}()
				return func() {
					remove := <-removed
					release()
					err := fhWaitFor(10*time.Second, 20*time.Millisecond, func() error {
						for k := range fhKeySet(e.mustList("wal/")) {
							if !before[k] {
								return nil
							}
						}
						return errors.New("the parked upload has not landed")
					})
					if err != nil {
						t.Errorf("releasing the parked WAL upload: %v", err)
					}
					remove()
				}
			},
			mayLand: true,
		},
		{
			name: "stall-past-s3-timeout",
			inject: func(t *testing.T, e *fhEnv) func() {
				p := e.proxy
				// Held three timeouts long: the client gives up first,
				// and a request whose client left is never forwarded.
				return p.AddFault(testenv.Fault{Op: testenv.OpPut, Stall: 3 * fhS3Timeout})
			},
		},
		{
			name: "s3-down",
			inject: func(t *testing.T, e *fhEnv) func() {
				p := e.proxy
				p.Down()
				return func() {
					if err := p.Up(); err != nil {
						t.Errorf("proxy up: %v", err)
					}
				}
			},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			fhRunFault(t, tc.inject, tc.mayLand)
		})
	}
}

func fhRunFault(t *testing.T, inject func(*testing.T, *fhEnv) func(), mayLand bool) {
	e := fhStart(t, fhOptions{
		Directives: []string{"s3_timeout " + fhS3Timeout.String()},
		Client:     &http.Client{Timeout: 2 * time.Minute},
	})
	const ct = "application/json"
	paths := make([]string, fhFaultStreams)
	outcomes := make([][]fhOutcome, fhFaultStreams)
	send := func(w int, phase string) fhOutcome {
		m := fhMsg{W: w, N: len(outcomes[w]), Phase: phase}
		body, _ := json.Marshal(m)
		resp, err := e.send(fhReq{Method: http.MethodPost, Path: paths[w], Header: map[string]string{"Content-Type": ct}, Body: body})
		o := fhOutcome{msg: m, resp: resp, err: err}
		if o.acked() {
			o.offset = resp.Header.Get("Stream-Next-Offset")
		}
		outcomes[w] = append(outcomes[w], o)
		return o
	}
	// each runs f for every writer at once and waits for them.
	each := func(f func(w int)) {
		var wg sync.WaitGroup
		for w := range fhFaultStreams {
			wg.Add(1)
			go func() { defer wg.Done(); f(w) }()
		}
		wg.Wait()
	}

	for w := range fhFaultStreams {
		paths[w] = fmt.Sprintf("/faults/s%d", w)
		e.create(paths[w], ct)
	}
	each(func(w int) {
		for range fhAppendsBefore {
			send(w, "before")
		}
	})
	for w := range fhFaultStreams {
		for _, o := range outcomes[w] {
			if !o.acked() {
				t.Fatalf("stream %d: append before the fault: %v %s", w, o.err, o.resp)
			}
		}
	}
	beforeFault := make([][]json.RawMessage, fhFaultStreams)
	for w := range fhFaultStreams {
		msgs, _, err := e.readJSON(paths[w])
		if err != nil {
			t.Fatalf("read before the fault: %v", err)
		}
		beforeFault[w] = msgs
	}

	// The fault holds while every writer sends its appends one after
	// the other.
	heal := inject(t, e)
	faultStart := time.Now()
	each(func(w int) {
		for range fhAppendsDuring {
			send(w, "during")
		}
	})
	// Reads while the fault holds: served or refused, but never showing
	// a record that is not durable.
	for w := range fhFaultStreams {
		resp, err := e.send(fhReq{Method: http.MethodGet, Path: paths[w] + "?offset=-1"})
		if err != nil {
			t.Errorf("stream %d: read during the fault: %v", w, err)
			continue
		}
		switch {
		case resp.Status == http.StatusOK && !mayLand:
			var msgs []json.RawMessage
			if err := json.Unmarshal(resp.Body, &msgs); err != nil {
				t.Errorf("stream %d: read during the fault: not a JSON array: %s", w, resp)
			} else if len(msgs) > len(beforeFault[w]) {
				t.Errorf("stream %d: read during the fault shows %d messages; only %d were durable: %s",
					w, len(msgs), len(beforeFault[w]), resp)
			}
		case resp.Status == http.StatusOK:
		case resp.Status == http.StatusServiceUnavailable:
		default:
			t.Errorf("stream %d: read during the fault: %s, want 200 or 503", w, resp)
		}
	}
	faultHeld := time.Since(faultStart)
	heal()
	healedAt := time.Now()

	// Every append during the fault failed properly.
	var slowest time.Duration
	for w := range fhFaultStreams {
		for _, o := range outcomes[w][fhAppendsBefore:] {
			slowest = max(slowest, o.resp.Took)
			switch {
			case o.err != nil:
				t.Errorf("stream %d append %d during the fault: transport error after %s: %v", w, o.msg.N, o.resp.Took, o.err)
				continue
			case o.acked() && mayLand:
				continue // checked below: it must be durable
			case o.resp.Status != http.StatusServiceUnavailable:
				t.Errorf("stream %d append %d during the fault: %s, want 503", w, o.msg.N, o.resp)
				continue
			}
			if o.resp.Took > fhFailBound {
				t.Errorf("stream %d append %d: 503 after %s; the bound derived from s3_timeout %s is %s",
					w, o.msg.N, o.resp.Took.Round(time.Millisecond), fhS3Timeout, fhFailBound)
			}
			if ra := o.resp.Header.Get("Retry-After"); !fhRetryAfterOK(ra) {
				t.Errorf("stream %d append %d: 503 with Retry-After %q, want seconds or an HTTP date", w, o.msg.N, ra)
			}
			if !fhContainsAny(string(o.resp.Body), "storage", "unavailable", "s3", "object", "timeout", "timed out") {
				t.Errorf("stream %d append %d: 503 body gives no reason: %q", w, o.msg.N, o.resp.Body)
			}
		}
	}
	statuses := map[string]int{}
	for w := range fhFaultStreams {
		for _, o := range outcomes[w][fhAppendsBefore:] {
			if o.err != nil {
				statuses["error"]++
			} else {
				statuses[fmt.Sprint(o.resp.Status)]++
			}
		}
	}
	t.Logf("fault held %s; appends during it got %v; slowest took %s (bound %s)",
		faultHeld.Round(time.Millisecond), statuses, slowest.Round(time.Millisecond), fhFailBound)

	// Recovery without a restart: each writer retries until acknowledged.
	var recoverMu sync.Mutex
	var recovered time.Duration
	each(func(w int) {
		for attempt := 0; ; attempt++ {
			o := send(w, "recover")
			if o.acked() {
				recoverMu.Lock()
				recovered = max(recovered, time.Since(healedAt))
				recoverMu.Unlock()
				return
			}
			if time.Since(healedAt) > fhRecoverBound {
				return
			}
			time.Sleep(200 * time.Millisecond)
		}
	})
	for w := range fhFaultStreams {
		if last := outcomes[w][len(outcomes[w])-1]; !last.acked() {
			t.Fatalf("stream %d: appends still fail %s after the store came back: %v %s",
				w, fhRecoverBound, last.err, last.resp)
		}
	}
	t.Logf("appends acknowledged again %s after the store came back", recovered.Round(time.Millisecond))
	each(func(w int) {
		for range fhAppendsAfter {
			send(w, "after")
		}
	})
	for w := range fhFaultStreams {
		for _, o := range outcomes[w][len(outcomes[w])-fhAppendsAfter:] {
			if !o.acked() {
				t.Errorf("stream %d append %d after recovery: %v %s", w, o.msg.N, o.err, o.resp)
			}
		}
	}
	if !e.caddy.Running() {
		t.Fatal("Caddy is not running after the fault")
	}

	// Every acknowledged record is there, in order, and nothing else.
	got := make([][]fhMsg, fhFaultStreams)
	tails := make([]string, fhFaultStreams)
	for w := range fhFaultStreams {
		got[w], tails[w] = fhCheckStream(t, e, paths[w], w, outcomes[w])
	}

	// The same after a crash: what was acknowledged was durable.
	e.caddy.Kill()
	e.caddy.Restart()
	for w := range fhFaultStreams {
		again, tail := fhCheckStream(t, e, paths[w], w, outcomes[w])
		if fmt.Sprint(again) != fmt.Sprint(got[w]) || tail != tails[w] {
			t.Errorf("stream %d changed across a restart:\nbefore %v (tail %s)\nafter  %v (tail %s)", w, got[w], tails[w], again, tail)
		}
	}
}

// fhCheckStream reads stream w in full and checks it against what was sent:
// every acknowledged append present exactly once, nothing that was never
// sent, send order kept. An append that got an error may be there (its
// upload may have succeeded after all); that is logged, not failed. The
// tail must equal the last acknowledgement's Stream-Next-Offset and HEAD's.
// It returns the messages and the tail.
func fhCheckStream(t *testing.T, e *fhEnv, path string, w int, sent []fhOutcome) ([]fhMsg, string) {
	t.Helper()
	raw, tail, err := e.readJSON(path)
	if err != nil {
		t.Errorf("stream %d: %v", w, err)
		return nil, ""
	}
	msgs := make([]fhMsg, len(raw))
	for i, r := range raw {
		if err := json.Unmarshal(r, &msgs[i]); err != nil {
			t.Errorf("stream %d message %d is not one we sent: %s", w, i, r)
			return nil, ""
		}
	}
	present := map[int]int{}
	last := -1
	for i, m := range msgs {
		if m.W != w || m.N < 0 || m.N >= len(sent) || sent[m.N].msg != m {
			t.Errorf("stream %d message %d was never sent: %+v", w, i, m)
			continue
		}
		present[m.N]++
		if m.N <= last {
			t.Errorf("stream %d: message %+v comes after message %d; sends were sequential", w, m, last)
		}
		last = m.N
	}
	var lastAck string
	for _, o := range sent {
		switch n := present[o.msg.N]; {
		case n > 1:
			t.Errorf("stream %d: %+v is stored %d times", w, o.msg, n)
		case o.acked() && n == 0:
			t.Errorf("stream %d: %+v was acknowledged (%d, offset %s) but is missing", w, o.msg, o.resp.Status, o.offset)
		}
		if o.acked() {
			lastAck = o.offset
		}
	}
	if tail != lastAck {
		t.Errorf("stream %d: tail %s, but the last acknowledged append answered %s", w, tail, lastAck)
	}
	head := e.must(fhReq{Method: http.MethodHead, Path: path})
	if h := head.Header.Get("Stream-Next-Offset"); head.Status != http.StatusOK || h != tail {
		t.Errorf("stream %d: HEAD %d with Stream-Next-Offset %q; the read ended at %q", w, head.Status, h, tail)
	}
	var landed []string
	for _, o := range sent {
		if !o.acked() && present[o.msg.N] == 1 {
			landed = append(landed, fmt.Sprintf("%+v (%v %s)", o.msg, o.err, o.resp))
			// A client told that nothing changed retries, and the
			// record is then stored twice.
			if fhContainsAny(string(o.resp.Body), "nothing was changed", "nothing changed", "not stored") {
				t.Errorf("stream %d: %+v got %d %q, yet it is stored", w, o.msg, o.resp.Status, o.resp.Body)
			}
		}
	}
	if len(landed) > 0 {
		t.Logf("stream %d: %d appends that got an error are stored (their writes landed): %s",
			w, len(landed), strings.Join(landed, "; "))
	}
	if t.Failed() {
		var b strings.Builder
		for _, o := range sent {
			fmt.Fprintf(&b, "\n\t%+v → %v %s", o.msg, o.err, o.resp)
		}
		t.Logf("stream %d sends:%s", w, b.String())
	}
	return msgs, tail
}
