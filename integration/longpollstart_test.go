package integration

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestLongPollFromTheStartAfterATrim: through Caddy on versitygw, a
// Durable Streams long-poll at offset=-1 and a Pico long-poll without seq
// wait on an empty stream. An upload for another stream is held at the
// proxy, so three records for this one and a trim past two of them wait
// and land in the same WAL upload. Both long-polls answer 200 with the
// record the trim kept; they answered 410, having read again at the
// position they waited at, which the trim had dropped.
func TestLongPollFromTheStartAfterATrim(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"long_poll_timeout 1m"}, nil)
	const path = "/lp/from-start"
	e.create("/ds"+path, "application/json")
	e.create("/ds/lp/other", textPlain)

	type answer struct {
		proto string
		resp  fhResp
		err   error
	}
	done := make(chan answer, 2)
	for proto, u := range map[string]string{"ds": "/ds" + path + "?offset=-1&live=long-poll", "pico": "/pico" + path + "?live=long-poll"} {
		go func() {
			r, err := e.send(fhReq{Method: http.MethodGet, Path: u})
			done <- answer{proto, r, err}
		}()
	}
	fhWaitLongPolls(t, e.caddy.AdminAddr(), 2)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Times: 1})
	defer release()
	other := make(chan error, 1)
	go func() {
		_, err := e.send(fhReq{Method: http.MethodPost, Path: "/ds/lp/other", Body: []byte("x"), Header: map[string]string{"Content-Type": textPlain}})
		other <- err
	}()
	if err := e.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("the other stream's WAL upload never reached the proxy: %v", err)
	}
	appended := make(chan answer, 1)
	go func() {
		r, err := e.send(fhReq{Method: http.MethodPost, Path: "/ds" + path, Body: []byte(`["a","b","c"]`),
			Header: map[string]string{"Content-Type": "application/json"}})
		appended <- answer{"ds", r, err}
	}()
	// The trim is refused (400, writing nothing) until the append is
	// pending behind the held upload.
	for {
		r := e.must(fhReq{Method: http.MethodPost, Path: "/pico" + path, Header: map[string]string{"Pico-Trim-Seq": "2"}})
		if r.Status == http.StatusOK {
			break
		}
		if r.Status != http.StatusBadRequest || ctx.Err() != nil {
			t.Fatalf("trim: %s", r)
		}
		time.Sleep(5 * time.Millisecond)
	}
	release()
	if err := <-other; err != nil {
		t.Fatalf("append to the other stream: %v", err)
	}
	if a := <-appended; a.err != nil || a.resp.Status != http.StatusNoContent {
		t.Fatalf("append: %v %v", a.resp, a.err)
	}

	for range 2 {
		a := <-done
		if a.err != nil {
			t.Fatalf("%s long-poll: %v", a.proto, a.err)
		}
		if a.resp.Status != http.StatusOK {
			t.Errorf("%s long-poll from the start: %s, want 200 with the record the trim kept", a.proto, a.resp)
			continue
		}
		switch a.proto {
		case "ds":
			if string(a.resp.Body) != `["c"]` {
				t.Errorf("Durable Streams long-poll from -1: %q, want %q", a.resp.Body, `["c"]`)
			}
		case "pico":
			var recs []picoRecord
			if err := json.Unmarshal(a.resp.Body, &recs); err != nil || len(recs) != 1 || recs[0].Seq != 2 || string(recs[0].data(t)) != `"c"` {
				t.Errorf("Pico long-poll from the start: %q (%v), want the record the trim kept (seq 2)", a.resp.Body, err)
			}
		}
	}
}
