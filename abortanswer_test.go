package picomq

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/picomq/caddy-picomq/streamstore"
)

// TestAbortedWriteAnswers: a write whose batch was aborted with its fate
// unknown to the writer is answered, in both protocols, with what
// happened and what the client may assume, and its warning is named for
// it; neither speaks of a write not confirmed "in time". The server
// stopping before storage answered leaves the write maybe stored; another
// server taking the storage over leaves it not stored. Both keep the 503,
// Retry-After and Pico error name of any write storage did not take.
func TestAbortedWriteAnswers(t *testing.T) {
	stopped := fmt.Errorf("%w: %w: %w: WAL writer unavailable: seal wal/01/02: connection reset",
		streamstore.ErrUnavailable, streamstore.ErrUnconfirmed, streamstore.ErrClosedUnconfirmed)
	tests := []struct {
		name    string
		method  string
		err     error
		want    []string // in the answer's text
		warning string
	}{
		{
			name:    "the server stopped",
			method:  http.MethodPost,
			err:     stopped,
			want:    []string{"the server stopped before storage confirmed the write", "may still be stored", "producer headers"},
			warning: "write not confirmed before the server stopped",
		},
		{
			name:    "the server stopped, a create",
			method:  http.MethodPut,
			err:     stopped,
			want:    []string{"the server stopped before storage confirmed the create", "not acknowledged", "repeat it"},
			warning: "write not confirmed before the server stopped",
		},
		{
			name:   "another server took the storage over",
			method: http.MethodPost,
			err: fmt.Errorf("%w: %w: WAL writer unavailable: storage was taken over by another node",
				streamstore.ErrUnavailable, streamstore.ErrTakenOver),
			want:    []string{"another server took this storage over", "was not stored"},
			warning: "storage taken over by another server",
		},
	}
	for _, tt := range tests {
		for _, proto := range []string{"ds", "pico"} {
			t.Run(tt.name+"/"+proto, func(t *testing.T) {
				core, logs := observer.New(zapcore.WarnLevel)
				log := zap.New(core)
				w := httptest.NewRecorder()
				r := httptest.NewRequest(tt.method, "/s", nil)
				var msg, code string
				if proto == "ds" {
					(&durableStreams{log: log}).engineError(w, r, tt.err)
					msg = w.Body.String()
				} else {
					(&picoProtocol{log: log}).engineError(w, r, tt.err)
					var body struct{ Error, Message string }
					if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
						t.Fatalf("Pico error body %q: %v", w.Body, err)
					}
					msg, code = body.Message, body.Error
				}
				t.Logf("%d %q", w.Code, msg)
				if w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") != "1" {
					t.Errorf("answered %d, Retry-After %q; want 503, 1", w.Code, w.Header().Get("Retry-After"))
				}
				if proto == "pico" && code != picoErrDurability {
					t.Errorf("Pico error %q, want %q", code, picoErrDurability)
				}
				for _, want := range tt.want {
					if !strings.Contains(msg, want) {
						t.Errorf("answer %q does not say %q", msg, want)
					}
				}
				if strings.Contains(msg, "in time") {
					t.Errorf("answer %q speaks of a timeout", msg)
				}
				if got := logs.All(); len(got) != 1 || got[0].Message != tt.warning {
					var names []string
					for _, e := range got {
						names = append(names, e.Message)
					}
					t.Errorf("warnings %q, want one %q", names, tt.warning)
				}
			})
		}
	}
}

// TestUnconfirmedCloseAnswers: a close that storage did not confirm (in
// time, before the server stopped, or refused for good) is told, in both
// protocols, that repeating it as it was is safe, not to retry with
// producer headers to avoid a duplicate: a repeat of a close that took
// effect succeeds (section 5.2), and an append that closes its stream
// cannot be stored twice, its repeat refused as the stream is closed or,
// with the same producer headers, recognised.
func TestUnconfirmedCloseAnswers(t *testing.T) {
	causes := map[string]error{
		"in time": fmt.Errorf("%w: %w: WAL writer unavailable: put wal/01/02: timeout",
			streamstore.ErrUnavailable, streamstore.ErrUnconfirmed),
		"the server stopped": fmt.Errorf("%w: %w: %w: WAL writer unavailable: seal wal/01/02: connection reset",
			streamstore.ErrUnavailable, streamstore.ErrUnconfirmed, streamstore.ErrClosedUnconfirmed),
	}
	kinds := []struct {
		name string
		req  streamstore.AppendRequest
		want []string
	}{
		{"a close", streamstore.AppendRequest{Close: true},
			[]string{"the close", "not acknowledged", "may or may not take effect", "a repeat of a close that took effect succeeds"}},
		{"records that close the stream", streamstore.AppendRequest{Close: true, Records: []streamstore.NewRecord{{Body: []byte("last")}}},
			[]string{"may still be stored", "repeat it as it was", "cannot be stored twice", "refused as the stream is closed"}},
	}
	for cause, err := range causes {
		for _, k := range kinds {
			for _, proto := range []string{"ds", "pico"} {
				t.Run(k.name+"/"+cause+"/"+proto, func(t *testing.T) {
					w := httptest.NewRecorder()
					r := httptest.NewRequest(http.MethodPost, "/s", nil)
					var msg string
					if proto == "ds" {
						(&durableStreams{log: zap.NewNop()}).engineError(w, r, closingError(k.req, err))
						msg = w.Body.String()
					} else {
						(&picoProtocol{log: zap.NewNop()}).engineError(w, r, closingError(k.req, err))
						var body struct{ Message string }
						if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
							t.Fatalf("Pico error body %q: %v", w.Body, err)
						}
						msg = body.Message
					}
					t.Logf("%d %q", w.Code, msg)
					if w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") != "1" {
						t.Errorf("answered %d, Retry-After %q; want 503, 1", w.Code, w.Header().Get("Retry-After"))
					}
					for _, want := range k.want {
						if !strings.Contains(msg, want) {
							t.Errorf("answer %q does not say %q", msg, want)
						}
					}
					if strings.Contains(msg, "avoid a duplicate") {
						t.Errorf("answer %q speaks of a duplicate a repeat cannot make", msg)
					}
				})
			}
		}
	}
}

// A DELETE, and a Pico trim, whose outcome storage did not confirm say
// to repeat them as they were: neither takes producer headers (a trim with
// them is refused), and a repeat of either that took effect changes
// nothing. Both told the client to "retry with producer headers".
func TestUnconfirmedDeleteAndTrimAnswers(t *testing.T) {
	err := fmt.Errorf("%w: %w: write metadata: timeout", streamstore.ErrUnavailable, streamstore.ErrUnconfirmed)
	tests := []struct {
		name, proto, method string
		err                 error
		want                []string
	}{
		{"DS delete", "ds", http.MethodDelete, err, []string{"the delete", "may or may not take effect", "answers 404"}},
		{"Pico delete", "pico", http.MethodDelete, err, []string{"the delete", "may or may not take effect", "answers 404"}},
		{"Pico trim", "pico", http.MethodPost, &trimWrite{err}, []string{"the trim", "may or may not take effect", "changes nothing"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := httptest.NewRecorder()
			r := httptest.NewRequest(tt.method, "/s", nil)
			msg := ""
			if tt.proto == "ds" {
				(&durableStreams{log: zap.NewNop()}).engineError(w, r, tt.err)
				msg = w.Body.String()
			} else {
				(&picoProtocol{log: zap.NewNop()}).engineError(w, r, tt.err)
				var body struct{ Message string }
				if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
					t.Fatalf("Pico error body %q: %v", w.Body, err)
				}
				msg = body.Message
			}
			t.Logf("%d %q", w.Code, msg)
			if w.Code != http.StatusServiceUnavailable {
				t.Errorf("answered %d; want 503", w.Code)
			}
			for _, want := range tt.want {
				if !strings.Contains(msg, want) {
					t.Errorf("answer %q does not say %q", msg, want)
				}
			}
			if strings.Contains(msg, "producer headers") {
				t.Errorf("answer %q asks for producer headers, which this request cannot carry", msg)
			}
		})
	}
}
