package integration

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestServerReadBodyTimeoutCutsOnlySlowBodies runs Caddy with the server
// option the README recommends against slow-drip bodies, timeouts
// { read_body }, set far below the module's long-poll and SSE durations.
// A client dripping an append body a byte at a time is answered 408 at the
// timeout and nothing of its body is written, while a long-poll and an SSE
// response opened before it are still alive after it: each delivers an
// append made once the drip was cut off.
func TestServerReadBodyTimeoutCutsOnlySlowBodies(t *testing.T) {
	const readBody = 2 * time.Second
	v := testenv.NewVersity(t)
	storage := caddytest.S3Storage(t, v, v.Endpoint)
	caddyfile := `{
	admin {$` + caddytest.AdminEnv + `}
	persist_config off
	servers {
		timeouts {
			read_body ` + readBody.String() + `
		}
	}
}
http://:{$` + caddytest.PortEnv + `} {
	bind 127.0.0.1
	picomq {
		storage "` + storage + `"
		long_poll_timeout 60s
		sse_reconnect_interval 60s
	}
}
`
	c := caddytest.Start(t, caddytest.Options{Caddyfile: caddyfile, Env: caddytest.S3Env(v), ReadyTimeout: 90 * time.Second})
	cl := newClient(t, c.URL(), false)
	cl.create(t, "/s", 30*time.Second)
	tail, err := cl.tail("/s", 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()

	longPoll := make(chan string, 1)
	go func() {
		r, err := cl.do(ctx, http.MethodGet, "/s", "offset="+url.QueryEscape(tail)+"&live=long-poll", nil, nil)
		if err != nil {
			longPoll <- err.Error()
			return
		}
		longPoll <- r.String()
	}()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.URL()+"/s?offset="+url.QueryEscape(tail)+"&live=sse", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := cl.hc.Do(req)
	if err != nil {
		t.Fatalf("SSE: %v", err)
	}
	defer resp.Body.Close()
	sse := make(chan string, 1)
	go func() {
		// The data of the first data event, or why there was none.
		br := bufio.NewReader(resp.Body)
		for {
			ev, err := readSSEEvent(br)
			if err != nil {
				sse <- fmt.Sprintf("SSE ended before any data: %v", err)
				return
			}
			if ev.event == "data" {
				sse <- fmt.Sprintf("data %q", ev.data)
				return
			}
			var ctl sseControl
			if ev.event != "control" || json.Unmarshal([]byte(ev.data), &ctl) != nil {
				sse <- fmt.Sprintf("unexpected event %+v", ev)
				return
			}
		}
	}()

	status, sent := dripAppend(t, c.URL(), "/s", 64, 200*time.Millisecond)
	if !strings.HasPrefix(status, "HTTP/1.1 408") {
		t.Errorf("an append body dripped a byte every 200ms against read_body %s: %s after %d of 64 bytes, want 408",
			readBody, status, sent)
	}

	// The subscription API reads its JSON bodies the same way.
	if status, sent := dripAppend(t, c.URL(), "/__ds/subscriptions/s1/claim", 64, 200*time.Millisecond); !strings.HasPrefix(status, "HTTP/1.1 408") {
		t.Errorf("a claim body dripped a byte every 200ms against read_body %s: %s after %d of 64 bytes, want 408",
			readBody, status, sent)
	}

	// Both readers have now outlived read_body; an append reaches them.
	if r, err := cl.appendBody(ctx, "/s", []byte("after")); err != nil || r.status/100 != 2 {
		t.Fatalf("append after the drip: %v %v", r, err)
	}
	if got := <-longPoll; got != `200 "after"` {
		t.Errorf("long-poll opened before the drip: %s, want 200 \"after\"", got)
	}
	if got := <-sse; got != `data "after"` {
		t.Errorf("SSE opened before the drip: %s, want data \"after\"", got)
	}
	content, _, err := cl.readAll("/s", 30*time.Second)
	if err != nil || string(content) != "after" {
		t.Errorf("stream holds %q (%v), want only \"after\": the cut-off body must write nothing", content, err)
	}
}

// dripAppend POSTs a text body of length bytes to name one byte every
// pause over a raw connection, until the server answers or the whole body
// is sent. It returns the status line (or why there was none) and how
// many bytes were sent.
func dripAppend(t *testing.T, base, name string, length int, pause time.Duration) (status string, sent int) {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: test\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n",
		name, textPlain, length); err != nil {
		t.Fatal(err)
	}
	answer := make(chan string, 1)
	go func() {
		line, err := bufio.NewReader(conn).ReadString('\n')
		if err != nil && line == "" {
			line = "no answer: " + err.Error()
		}
		answer <- strings.TrimSpace(line)
	}()
	tick := time.NewTicker(pause)
	defer tick.Stop()
	for {
		select {
		case s := <-answer:
			return s, sent
		case <-tick.C:
			if sent == length {
				// The whole body is out: only the answer is left. The
				// deferred Close ends the reader if it never comes.
				conn.SetReadDeadline(time.Now().Add(30 * time.Second))
				return <-answer, sent
			}
			if _, err := io.WriteString(conn, "y"); err != nil {
				return "write failed: " + err.Error(), sent
			}
			sent++
		}
	}
}
