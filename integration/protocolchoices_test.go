package integration

import (
	"bufio"
	"context"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestProtocolChoicesTheSpecLeavesOpen pins down, through Caddy on
// versitygw, answers where the Durable Streams protocol leaves the server a
// choice and the README's "Durable Streams" section states the one made:
// what SSE does to a text stream's line endings and non-UTF-8 bytes (5.8),
// media types compared without parameters on a create and a fork (5.1,
// 4.2), Stream-Fork-Offset: now (4.2), a producer the stream has never
// seen starting past seq 0 (5.2.1), and an append with data but no usable
// Content-Type on a closed stream (5.2).
func TestProtocolChoicesTheSpecLeavesOpen(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	const tp = "text/plain"
	h := func(kv ...string) map[string]string {
		m := map[string]string{}
		for i := 0; i+1 < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}

	t.Run("SSE carries a text stream as lines", func(t *testing.T) {
		e.create("/choices/text", tp)
		e.append("/choices/text", tp, []byte("one\r\ntwo\rthree\n"))
		e.append("/choices/text", tp, []byte("caf\xe9"))
		// A catch-up read gives the bytes as written.
		body, _, err := e.readBytes("/choices/text")
		if err != nil {
			t.Fatal(err)
		}
		if want := "one\r\ntwo\rthree\ncaf\xe9"; string(body) != want {
			t.Fatalf("catch-up read %q, want %q", body, want)
		}
		// SSE splits them into data lines at every line ending, which a
		// reader joins with LF, and sends the byte that is not UTF-8 as
		// it is, without base64.
		data, encoding := sseTextUntilUpToDate(t, e, "/choices/text?offset=-1&live=sse")
		if encoding != "" {
			t.Errorf("Stream-SSE-Data-Encoding %q on a text/plain stream, want none", encoding)
		}
		if want := "one\ntwo\nthree\ncaf\xe9"; data != want {
			t.Errorf("SSE data %q, want %q", data, want)
		}
	})

	t.Run("types compare without parameters", func(t *testing.T) {
		e.create("/choices/typed", tp)
		e.append("/choices/typed", tp, []byte("x"))
		rules := []protocolRule{
			{"a create repeated with a charset", fhReq{Method: http.MethodPut, Path: "/choices/typed", Header: h("Content-Type", "text/plain; charset=latin1")},
				http.StatusOK, h("Content-Type", tp), nil},
			{"the stream keeps the type it was made with", fhReq{Method: http.MethodHead, Path: "/choices/typed"},
				http.StatusOK, h("Content-Type", tp), nil},
			{"a fork given its source's media type with a charset", fhReq{Method: http.MethodPut, Path: "/choices/typed-fork",
				Header: h("Stream-Forked-From", "/choices/typed", "Content-Type", "text/plain; charset=utf-8")},
				http.StatusCreated, h("Content-Type", "text/plain; charset=utf-8"), nil},
			{"the fork keeps the type it was given", fhReq{Method: http.MethodHead, Path: "/choices/typed-fork"},
				http.StatusOK, h("Content-Type", "text/plain; charset=utf-8"), nil},
			{"a fork given another media type", fhReq{Method: http.MethodPut, Path: "/choices/typed-fork2",
				Header: h("Stream-Forked-From", "/choices/typed", "Content-Type", "application/json")},
				http.StatusConflict, nil, nil},
		}
		for _, r := range rules {
			r.check(t, e)
		}
	})

	t.Run("Stream-Fork-Offset now is the source's tail", func(t *testing.T) {
		e.create("/choices/src", tp)
		tail := e.append("/choices/src", tp, []byte("ab"))
		now := h("Stream-Forked-From", "/choices/src", "Stream-Fork-Offset", "now")
		protocolRule{"a fork at now", fhReq{Method: http.MethodPut, Path: "/choices/at-now", Header: now},
			http.StatusCreated, h("Stream-Next-Offset", tail), nil}.check(t, e)
		e.append("/choices/src", tp, []byte("cd"))
		ab := "ab"
		for _, r := range []protocolRule{
			{"the same create after the source grew", fhReq{Method: http.MethodPut, Path: "/choices/at-now", Header: now},
				http.StatusOK, h("Stream-Next-Offset", tail), nil},
			{"the same create without the offset", fhReq{Method: http.MethodPut, Path: "/choices/at-now", Header: h("Stream-Forked-From", "/choices/src")},
				http.StatusOK, h("Stream-Next-Offset", tail), nil},
			{"the fork holds what the source had", fhReq{Method: http.MethodGet, Path: "/choices/at-now?offset=-1"},
				http.StatusOK, h("Stream-Next-Offset", tail), &ab},
		} {
			r.check(t, e)
		}
	})

	t.Run("a producer the stream has not seen starts at seq 0", func(t *testing.T) {
		e.create("/choices/prod", tp)
		tail := e.append("/choices/prod", tp, []byte("first"))
		prod := func(epoch, seq string) fhReq {
			return fhReq{Method: http.MethodPost, Path: "/choices/prod", Body: []byte("p"),
				Header: h("Content-Type", tp, "Producer-Id", "fresh", "Producer-Epoch", epoch, "Producer-Seq", seq)}
		}
		gap := h("Producer-Expected-Seq", "0", "Producer-Received-Seq", "2", "Producer-Epoch", "")
		for _, r := range []protocolRule{
			{"epoch 0 at seq 2", prod("0", "2"), http.StatusConflict, gap, nil},
			{"epoch 3 at seq 2", prod("3", "2"), http.StatusConflict, gap, nil},
			{"nothing was written", fhReq{Method: http.MethodHead, Path: "/choices/prod"}, http.StatusOK, h("Stream-Next-Offset", tail), nil},
			{"epoch 3 at seq 0", prod("3", "0"), http.StatusOK, h("Producer-Epoch", "3", "Producer-Seq", "0"), nil},
		} {
			r.check(t, e)
		}
	})

	t.Run("an append without a usable type is 400 on a closed stream", func(t *testing.T) {
		if r := e.must(fhReq{Method: http.MethodPut, Path: "/choices/closed", Header: h("Content-Type", tp, "Stream-Closed", "true")}); r.Status != http.StatusCreated {
			t.Fatalf("create closed: %s", r)
		}
		for _, r := range []protocolRule{
			{"no Content-Type", fhReq{Method: http.MethodPost, Path: "/choices/closed", Body: []byte("x")},
				http.StatusBadRequest, h("Stream-Closed", ""), nil},
			{"a malformed Content-Type", fhReq{Method: http.MethodPost, Path: "/choices/closed", Body: []byte("x"), Header: h("Content-Type", "garbage")},
				http.StatusBadRequest, h("Stream-Closed", ""), nil},
			{"another media type", fhReq{Method: http.MethodPost, Path: "/choices/closed", Body: []byte("x"), Header: h("Content-Type", "application/json")},
				http.StatusConflict, h("Stream-Closed", "true"), nil},
		} {
			r.check(t, e)
		}
	})
}

// TestConfirmedCreateRenewsTTL shows that a create confirmed with 200
// counts as a write for Stream-TTL (section 5.1): it renews the window,
// where HEAD does not.
func TestConfirmedCreateRenewsTTL(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	ttl := map[string]string{"Stream-TTL": "3"}
	if r := e.must(fhReq{Method: http.MethodPut, Path: "/renew", Header: ttl}); r.Status != http.StatusCreated {
		t.Fatalf("create: %s", r)
	}
	start := time.Now()
	sleepUntil(start.Add(2 * time.Second))
	if r := e.must(fhReq{Method: http.MethodPut, Path: "/renew", Header: ttl}); r.Status != http.StatusOK {
		t.Fatalf("create repeated after 2s: %s, want 200", r)
	}
	renewed := time.Now()
	// Four seconds after the create, one past its TTL, two after the
	// confirmation.
	sleepUntil(start.Add(4 * time.Second))
	if r := e.must(fhReq{Method: http.MethodHead, Path: "/renew"}); r.Status != http.StatusOK {
		t.Fatalf("HEAD 4s after the create, %v after the confirmation: %s, want 200", time.Since(renewed).Round(time.Millisecond), r)
	}
	sleepUntil(renewed.Add(3*time.Second + 500*time.Millisecond))
	if r := e.must(fhReq{Method: http.MethodHead, Path: "/renew"}); r.Status != http.StatusNotFound {
		t.Fatalf("HEAD 3.5s after the confirmation: %s, want 404 (expired)", r)
	}
}

func sleepUntil(t time.Time) { time.Sleep(time.Until(t)) }

// sseTextUntilUpToDate reads an SSE feed until a control event says it is
// up to date, and returns its data events joined as a reader joins them,
// with the response's Stream-SSE-Data-Encoding.
func sseTextUntilUpToDate(t *testing.T, e *fhEnv, path string) (data, encoding string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp := sseResponse(ctx, t, e, path)
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("SSE: status %d", resp.StatusCode)
	}
	br := bufio.NewReader(resp.Body)
	var parts []string
	for {
		ev, err := readSSEEvent(br)
		if err != nil {
			t.Fatalf("SSE: %v after %q", err, parts)
		}
		switch ev.event {
		case "data":
			parts = append(parts, ev.data)
		case "control":
			if strings.Contains(ev.data, `"upToDate":true`) {
				return strings.Join(parts, ""), resp.Header.Get("Stream-SSE-Data-Encoding")
			}
		}
	}
}
