package picomq

import (
	"net/http/httptest"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// TestLiveDeadline: a live response ends by its own timeout unless Caddy's
// `write` timeout would cut it first; then it ends a quarter of that
// timeout (at most a second) before the cut.
func TestLiveDeadline(t *testing.T) {
	start := time.Now()
	tests := []struct {
		name  string
		write time.Duration // the server's write timeout; 0: none
		wait  time.Duration
		want  time.Duration // after start
	}{
		{name: "no write timeout", wait: 30 * time.Second, want: 30 * time.Second},
		{name: "write 5s cuts a 30s long-poll", write: 5 * time.Second, wait: 30 * time.Second, want: 4 * time.Second},
		{name: "write 2s leaves a quarter", write: 2 * time.Second, wait: 30 * time.Second, want: 1500 * time.Millisecond},
		{name: "write 1m outlasts a 30s long-poll", write: time.Minute, wait: 30 * time.Second, want: 30 * time.Second},
		{name: "write 1m cuts a 60s feed", write: time.Minute, wait: time.Minute, want: 59 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest("GET", "/s?live=long-poll", nil)
			w := &caddyhttp.IdleTimeoutWriter{Deadline: caddyhttp.IdleDeadline{Start: start, Timeout: time.Minute}}
			if tt.write > 0 {
				w.Deadline.HardDeadline = start.Add(tt.write)
			}
			r = r.WithContext(caddyhttp.ContextWithIdleTimeouts(r.Context(), nil, w))
			got := liveDeadline(r, tt.wait).Sub(start)
			// The request's own timeout counts from the call, a moment
			// after start.
			if got < tt.want || got > tt.want+time.Second/2 {
				t.Errorf("liveDeadline = start + %v, want start + %v", got, tt.want)
			}
		})
	}
	t.Run("outside Caddy", func(t *testing.T) {
		before := time.Now()
		got := liveDeadline(httptest.NewRequest("GET", "/s", nil), time.Minute)
		if got.Before(before.Add(time.Minute)) || got.After(time.Now().Add(time.Minute)) {
			t.Errorf("liveDeadline = now + %v, want now + 1m", got.Sub(before))
		}
	})
}
