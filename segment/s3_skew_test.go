package segment_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/segment"
)

// TestS3StoreRetriesAClockSkewRefusal: the server refuses a request as
// signed at a time too far from its own (RequestTimeTooSkewed, its Date an
// hour ahead). The SDK learns the offset from that answer; its own
// retryer would sign the next attempt with it, and the store's retries,
// which replace that retryer, must do the same rather than take the 403
// for a refusal to report.
func TestS3StoreRetriesAClockSkewRefusal(t *testing.T) {
	ahead := time.Hour
	var mu sync.Mutex
	var dates []time.Time // X-Amz-Date of each request
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d, _ := time.Parse("20060102T150405Z", r.Header.Get("X-Amz-Date"))
		mu.Lock()
		dates = append(dates, d)
		first := len(dates) == 1
		mu.Unlock()
		w.Header().Set("Date", time.Now().Add(ahead).UTC().Format(http.TimeFormat))
		if first {
			w.Header().Set("Content-Type", "application/xml")
			w.WriteHeader(http.StatusForbidden)
			w.Write([]byte(`<?xml version="1.0" encoding="UTF-8"?>` + "\n" +
				`<Error><Code>RequestTimeTooSkewed</Code><Message>The difference between the request time and the current time is too large.</Message></Error>`))
			return
		}
		w.Header().Set("ETag", `"abc"`)
	}))
	defer srv.Close()
	st, err := segment.Open("s3://bkt/pfx?path_style=true&endpoint="+srv.URL, segment.OpenOptions{
		AccessKeyID: "k", SecretAccessKey: "s", MaxAttempts: 3, MinBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Put(context.Background(), "k", []byte("v"), segment.PutOptions{}); err != nil {
		t.Fatalf("Put: %v; want it retried with the server's time", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(dates) != 2 {
		t.Fatalf("%d requests, want 2", len(dates))
	}
	if skew := dates[1].Sub(dates[0]); skew < ahead-time.Minute || skew > ahead+time.Minute {
		t.Fatalf("the retry was signed %v after the first attempt, want about %v", skew, ahead)
	}
}
