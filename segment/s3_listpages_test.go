package segment_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/segment"
)

// A store that gives a continuation token for one page and none for the
// next (paging on by the last key, as ListObjects v1 does) is followed by
// start-after alone: sent with the old token too, it answered the same
// page again, and the listing repeated keys or never ended.
func TestS3ListFollowsStartAfterWithoutAnOldToken(t *testing.T) {
	var requests atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if requests.Add(1) > 10 {
			http.Error(w, "too many list requests", http.StatusBadRequest)
			return
		}
		q := r.URL.Query()
		var keys []string
		var truncated bool
		var token string
		switch {
		case q.Get("continuation-token") == "t1":
			keys, truncated = []string{"pfx/wal/b"}, true // no token: page on from the last key
		case q.Get("start-after") == "pfx/wal/b":
			keys = []string{"pfx/wal/c"}
		default:
			keys, truncated, token = []string{"pfx/wal/a"}, true, "t1"
		}
		var b strings.Builder
		b.WriteString(`<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>bkt</Name>`)
		fmt.Fprintf(&b, "<IsTruncated>%v</IsTruncated>", truncated)
		if token != "" {
			fmt.Fprintf(&b, "<NextContinuationToken>%s</NextContinuationToken>", token)
		}
		for _, k := range keys {
			fmt.Fprintf(&b, "<Contents><Key>%s</Key><Size>1</Size><ETag>\"e\"</ETag></Contents>", k)
		}
		b.WriteString("</ListBucketResult>")
		w.Header().Set("Content-Type", "application/xml")
		io.WriteString(w, b.String())
	}))
	defer srv.Close()
	s, err := segment.Open("s3://bkt/pfx?path_style=true&endpoint="+url.QueryEscape(srv.URL), segment.OpenOptions{
		AccessKeyID: "k", SecretAccessKey: "s", MaxAttempts: 1, RequestTimeout: time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	objs, more, err := s.List(context.Background(), "wal/", "", 100)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, o := range objs {
		got = append(got, o.Key)
	}
	if strings.Join(got, " ") != "wal/a wal/b wal/c" || more {
		t.Fatalf("listed %v (more %v) in %d requests, want [wal/a wal/b wal/c] in 3", got, more, requests.Load())
	}
}
