package segment_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"testing"

	"github.com/picomq/caddy-picomq/internal/testenv"
	"github.com/picomq/caddy-picomq/segment"
)

// TestTransient: the errors an S3Store returns when the store cannot be
// reached or fails on its side are transient; refusals that need the
// operator are not. The module starts in the background on the first kind
// only (app.go), so a refusal misread as transient would turn a failed
// "caddy run" into a server answering 503 for good.
func TestTransient(t *testing.T) {
	s3err := func(status int, code string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/xml")
			w.WriteHeader(status)
			fmt.Fprintf(w, `<?xml version="1.0" encoding="UTF-8"?><Error><Code>%s</Code><Message>test</Message></Error>`, code)
		}
	}
	tests := []struct {
		name      string
		handler   http.HandlerFunc // nil: nobody listens on the endpoint
		transient bool
		permanent bool // a refusal that needs the operator (Permanent)
	}{
		{name: "connection refused", transient: true},
		{name: "503 SlowDown", handler: s3err(http.StatusServiceUnavailable, "SlowDown"), transient: true},
		{name: "500 InternalError", handler: s3err(http.StatusInternalServerError, "InternalError"), transient: true},
		{name: "connection cut", handler: func(w http.ResponseWriter, r *http.Request) {
			conn, _, err := w.(http.Hijacker).Hijack()
			if err == nil {
				conn.Close()
			}
		}, transient: true},
		{name: "403 AccessDenied", handler: s3err(http.StatusForbidden, "AccessDenied"), permanent: true},
		{name: "403 InvalidAccessKeyId", handler: s3err(http.StatusForbidden, "InvalidAccessKeyId"), permanent: true},
		{name: "404 NoSuchBucket", handler: s3err(http.StatusNotFound, "NoSuchBucket"), permanent: true},
		{name: "400 garbage", handler: func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusBadRequest)
			io.WriteString(w, "not xml")
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			endpoint := testenv.ClosedURL(t)
			if tt.handler != nil {
				srv := httptest.NewServer(tt.handler)
				t.Cleanup(srv.Close)
				endpoint = srv.URL
			}
			s, err := segment.Open("s3://bkt/pfx?path_style=true&endpoint="+endpoint, segment.OpenOptions{
				AccessKeyID: "k", SecretAccessKey: "s", MaxAttempts: 2,
			})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.(io.Closer).Close() })
			_, _, err = s.Get(context.Background(), "lease", 0, -1)
			if err == nil {
				t.Fatal("Get succeeded")
			}
			if got := segment.Transient(fmt.Errorf("start engine: %w", err)); got != tt.transient {
				t.Errorf("Transient(%v) = %v, want %v", err, got, tt.transient)
			}
			if got := segment.Permanent(fmt.Errorf("put wal: %w", err)); got != tt.permanent {
				t.Errorf("Permanent(%v) = %v, want %v", err, got, tt.permanent)
			}
		})
	}
	_, fileErr := os.ReadFile(t.TempDir()) // is a directory
	for _, err := range []error{nil, context.Canceled, errors.New("format object is not PicoMQ's"), segment.ErrLeaseHeld,
		fmt.Errorf("reading node id: %w", fileErr)} {
		if segment.Transient(err) {
			t.Errorf("Transient(%v) = true", err)
		}
	}
}
