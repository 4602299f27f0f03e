package segment_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/segment"
)

// A store whose PUT answers carry no ETag cannot hold PicoMQ's state: the
// lease and the metadata are compare-and-swapped on the ETag a write
// returned, and an empty one would make the next If-Match unconditional.
// Such a write is refused as not confirmed (it landed), naming the reason.
func TestS3PutWithoutAnETagIsRefused(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if r.Method != http.MethodPut {
			http.Error(w, "unexpected request", http.StatusBadRequest)
		}
	}))
	defer srv.Close()
	s, err := segment.Open("s3://bkt/pfx?path_style=true&endpoint="+url.QueryEscape(srv.URL), segment.OpenOptions{
		AccessKeyID: "k", SecretAccessKey: "s", MaxAttempts: 1, RequestTimeout: time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	etag, err := s.Put(context.Background(), "lease", []byte("l"), segment.PutOptions{IfNoneMatch: true})
	if !errors.Is(err, segment.ErrUnknownOutcome) || !strings.Contains(err.Error(), "without an ETag") {
		t.Fatalf("put answered without an ETag: %q, %v; want an unknown outcome naming the missing ETag", etag, err)
	}
}
