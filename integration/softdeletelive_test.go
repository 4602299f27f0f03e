package integration

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"
)

// TestLiveReadsEndWhenTheStreamIsSoftDeleted: through Caddy on versitygw,
// a stream that a fork still reads is deleted while a Durable Streams
// long-poll, a Pico long-poll and an SSE feed wait at its tail. The
// stream is soft-deleted, every request to it is 410 (section 4.2), and
// the live reads end with it: both long-polls answer 410 and the feed
// closes. They used to wait on: the long-polls answered 204 (up to date,
// with a cursor to poll again) at their timeout, and the feed stayed open
// until its reconnect interval.
func TestLiveReadsEndWhenTheStreamIsSoftDeleted(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"long_poll_timeout 20s", "sse_reconnect_interval 10m", "compact_interval 1h"}, nil)
	const src, fork = "/softdelete/src", "/softdelete/fork"
	picoWant(t, "create", picoDo(e, "PUT", "/ds"+src, []byte("a"), "Content-Type", textPlain), 201)
	picoWant(t, "fork", picoDo(e, "PUT", "/ds"+fork, nil, "Stream-Forked-From", "/ds"+src), 201)
	tail := fmt.Sprintf("%016d_%016d", 1, 0)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	br := openSSE(ctx, t, e, "/ds"+src+"?live=sse&offset="+tail)
	if ev, err := readSSEEvent(br); err != nil || ev.event != "control" {
		t.Fatalf("SSE at the tail: %+v, %v; want a control event", ev, err)
	}

	type result struct {
		what string
		resp fhResp
		err  error
	}
	polls := make(chan result, 2)
	for what, path := range map[string]string{
		"Durable Streams long-poll": "/ds" + src + "?live=long-poll&offset=" + tail,
		"Pico long-poll":            "/pico" + src + "?live=long-poll&seq=1",
	} {
		go func() {
			resp, err := e.send(fhReq{Method: http.MethodGet, Path: path})
			polls <- result{what, resp, err}
		}()
	}
	// Both long-polls are open, and their reads of the tail are in memory:
	// they wait by the time the delete has written the stream's metadata.
	if err := fhWaitFor(30*time.Second, 20*time.Millisecond, func() error {
		s, err := mGet(e.caddy.AdminAddr())
		if err != nil {
			return err
		}
		if n := s.sum("picomq_open_subscribers", "mode", "long-poll"); n != 2 {
			return fmt.Errorf("%v long-polls open, want 2", n)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	picoWant(t, "delete", picoDo(e, "DELETE", "/ds"+src, nil), 204)
	picoWant(t, "read after the delete", picoDo(e, "GET", "/ds"+src, nil), 410)

	for range 2 {
		r := <-polls
		if r.err != nil || r.resp.Status != http.StatusGone {
			t.Errorf("%s on the stream soft-deleted while it waited: %s (%v), headers %v; want 410",
				r.what, r.resp, r.err, r.resp.Header)
		}
	}
	for {
		ev, err := readSSEEvent(br)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("SSE on the soft-deleted stream did not end within its minute: %v", err)
		}
		t.Errorf("SSE on the soft-deleted stream: event %+v", ev)
	}
	picoWant(t, "the fork", picoDo(e, "GET", "/ds"+fork, nil), 200)
}
