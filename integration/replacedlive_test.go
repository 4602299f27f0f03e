package integration

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestLiveReadsEndOnAReplacedProcess: a second process of the same node
// takes the storage over while a Durable Streams long-poll and an SSE feed
// wait at a stream's tail on the first, and appends to the stream. The
// first process sees none of the new owner's appends, so its live reads
// must not go on waiting for records that will never reach it, nor tell
// their clients they are up to date at a tail the stream has moved past:
// they end once the first process learns it was replaced (its next lease
// renewal, within 10 s), the long-poll with a 503 that says why, and reads
// made there afterwards are refused the same way, so that clients go to
// the process that holds the storage now. They used to wait out their
// timeout (the long-poll then answered 204, up to date at the old tail,
// and its next poll waited again, for ever).
func TestLiveReadsEndOnAReplacedProcess(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const (
		name = "/takeover/live"
		text = "text/plain"
		// The lease is renewed every 10 s; the takeover is seen by then.
		within = 30 * time.Second
	)
	a := fhStart(t, fhOptions{
		Directives: []string{"long_poll_timeout 2m", "sse_reconnect_interval 10m"},
		Optional:   []string{"compact_interval 1h"},
	})
	a.create(name, text)
	tail := a.append(name, text, []byte("before\n"))

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	br := openSSE(ctx, t, a, name+"?live=sse&offset="+tail)
	if ev, err := readSSEEvent(br); err != nil || ev.event != "control" {
		t.Fatalf("SSE at the tail: %+v, %v; want a control event", ev, err)
	}
	sseEnded := make(chan error, 1)
	go func() {
		for {
			// Events before the end (a final control) do not matter here.
			if _, err := readSSEEvent(br); err != nil {
				sseEnded <- err
				return
			}
		}
	}()
	type result struct {
		resp fhResp
		err  error
	}
	poll := make(chan result, 1)
	go func() {
		resp, err := a.send(fhReq{Method: http.MethodGet, Path: name + "?live=long-poll&offset=" + tail})
		poll <- result{resp, err}
	}()
	fhWaitLongPolls(t, a.caddy.AdminAddr(), 1)

	b := launchSameNode(t, a)
	after := b.append(name, text, []byte("after\n"))
	t.Logf("the new owner appended; its tail is %s, the first process's %s", after, tail)

	refused := func(what string, r fhResp) {
		t.Helper()
		if r.Status != http.StatusServiceUnavailable || !strings.Contains(string(r.Body), "took this storage over") {
			t.Errorf("%s on the replaced process: %s, headers %v; want 503 saying another server took the storage over",
				what, r, r.Header)
		}
	}
	select {
	case r := <-poll:
		if r.err != nil {
			t.Errorf("long-poll on the replaced process: %v", r.err)
		} else {
			refused("the long-poll waiting at the tail", r.resp)
		}
	case <-time.After(within):
		t.Errorf("the long-poll on the replaced process still waits %s after the takeover", within)
	}
	select {
	case err := <-sseEnded:
		if !errors.Is(err, io.EOF) {
			t.Errorf("the SSE feed on the replaced process ended with %v, want a clean end", err)
		}
	case <-time.After(within):
		t.Errorf("the SSE feed on the replaced process is still open %s after the takeover", within)
	}

	// Once replaced, the first process no longer answers reads as if its
	// view were the stream's: a catch-up read would be up to date at the
	// old tail, and a long-poll there would wait for ever again.
	start := time.Now()
	refused("a catch-up read", a.must(fhReq{Method: http.MethodGet, Path: name + "?offset=" + tail}))
	refused("a new long-poll", a.must(fhReq{Method: http.MethodGet, Path: name + "?live=long-poll&offset=" + tail}))
	refused("a new SSE feed", a.must(fhReq{Method: http.MethodGet, Path: name + "?live=sse&offset=" + tail}))
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("the replaced process took %s to refuse three reads", took)
	}
	if got, _, err := b.readBytes(name); err != nil || string(got) != "before\nafter\n" {
		t.Errorf("the new owner reads %q (%v), want %q", got, err, "before\nafter\n")
	}
}
