package picomq

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
)

// TestReadJSONBodyLimits: a subscription request's body over the module's
// limit, or over a smaller one that Caddy's request_body max_size put in
// front, is 413 naming the limit that applies, as an append's is; it was
// 400 "unreadable or oversized body", which tells a client its request is
// malformed. A body with a content coding is 415, as an append's is.
func TestReadJSONBodyLimits(t *testing.T) {
	big := `{"description":"` + strings.Repeat("x", subMaxBody) + `"}`
	tests := []struct {
		name     string
		body     io.Reader
		length   int64 // Content-Length; -1: chunked
		maxBytes int64 // request_body max_size; 0: none
		encoding string
		want     int
		reason   string // in the answer
	}{
		{name: "fits", body: strings.NewReader(`{"type":"pull-wake"}`), length: -1, want: http.StatusOK},
		{name: "over the module's limit, with its length", body: strings.NewReader(big), length: int64(len(big)),
			want: http.StatusRequestEntityTooLarge, reason: "the " + strconv.Itoa(subMaxBody) + "-byte limit"},
		{name: "over the module's limit, chunked", body: strings.NewReader(big), length: -1,
			want: http.StatusRequestEntityTooLarge, reason: "the " + strconv.Itoa(subMaxBody) + "-byte limit"},
		{name: "over request_body max_size, chunked", body: strings.NewReader(big[:2000]), length: -1, maxBytes: 1000,
			want: http.StatusRequestEntityTooLarge, reason: "the 1000-byte limit"},
		{name: "encoded", body: bytes.NewReader([]byte{0x1f, 0x8b}), length: 2, encoding: "gzip",
			want: http.StatusUnsupportedMediaType, reason: "content coding"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest(http.MethodPut, "/r/__ds/subscriptions/s1", tt.body)
			r.ContentLength = tt.length
			if tt.encoding != "" {
				r.Header.Set("Content-Encoding", tt.encoding)
			}
			rec := httptest.NewRecorder()
			if tt.maxBytes > 0 {
				r.Body = http.MaxBytesReader(rec, r.Body, tt.maxBytes)
			}
			var v map[string]any
			ok := readJSONBody(rec, r, &v)
			if tt.want == http.StatusOK {
				if !ok || v["type"] != "pull-wake" {
					t.Fatalf("readJSONBody = %v, %v; answered %d %s", ok, v, rec.Code, rec.Body)
				}
				return
			}
			if ok || rec.Code != tt.want || !strings.Contains(rec.Body.String(), tt.reason) {
				t.Errorf("readJSONBody = %v, answered %d %s; want %d naming %q", ok, rec.Code, rec.Body, tt.want, tt.reason)
			}
		})
	}
}
