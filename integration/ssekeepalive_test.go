package integration

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestSSEKeepAliveThroughCaddy: a feed at the tail of a stream that stays
// quiet gets the tail's control event again at every sse_keepalive, so
// that a proxy that closes idle connections does not cut it, through both
// protocols; an append then reaches it as before.
func TestSSEKeepAliveThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const every = time.Second
	e := picoStart(t, []string{"sse_keepalive 1s"}, nil)
	cases := []struct {
		proto, feed, append string
		tail                string // in the control events at the tail
	}{
		{"ds", "/ds/ka/s?offset=now&live=sse", "/ds/ka/s", `"streamNextOffset"`},
		{"pico", "/pico/ka/p?live=sse", "/pico/ka/p", `"next_seq":0`},
	}
	for _, tc := range cases {
		t.Run(tc.proto, func(t *testing.T) {
			path := strings.TrimPrefix(strings.TrimPrefix(tc.append, "/ds"), "/pico")
			picoWant(t, "create", picoDo(e, "PUT", "/pico"+path, nil, "Content-Type", "text/plain"), 201)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			br := openSSE(ctx, t, e, tc.feed)
			began := time.Now()
			var controls []string
			for len(controls) < 4 {
				ev, err := readSSEEvent(br)
				if err != nil {
					t.Fatalf("after %d control events: %v", len(controls), err)
				}
				if ev.event != "control" || !strings.Contains(ev.data, tc.tail) {
					t.Fatalf("event %+v at a quiet tail, want its control event", ev)
				}
				controls = append(controls, ev.data)
			}
			took := time.Since(began)
			t.Logf("4 control events in %s: %v", took.Round(time.Millisecond), controls)
			if took < 2*every {
				t.Errorf("the first control event and three keep-alives in %s: sooner than the interval", took)
			}
			picoWant(t, "append", picoDo(e, "POST", "/pico"+path, []byte("one"), "Content-Type", "text/plain"), 200)
			for {
				ev, err := readSSEEvent(br)
				if err != nil {
					t.Fatalf("after the keep-alives: %v", err)
				}
				if ev.event == "control" {
					continue // a keep-alive written before the append
				}
				if ev.event != "data" || !strings.Contains(ev.data, "one") {
					t.Fatalf("after the keep-alives: event %+v, want the record", ev)
				}
				break
			}
		})
	}
}
