package segment_test

import (
	"context"
	"encoding/xml"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/segment"
)

// A DeleteObjects answered 200 can still refuse keys one by one. A key
// refused for now (InternalError, SlowDown) goes again, alone, with the
// backoff of a failed request; one refused for good (AccessDenied) is
// reported and not sent again.
func TestS3DeleteRetriesKeysRefusedForNow(t *testing.T) {
	var mu sync.Mutex
	var sent [][]string // the keys of each DeleteObjects
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || !r.URL.Query().Has("delete") {
			http.Error(w, "unexpected request", http.StatusBadRequest)
			return
		}
		var body struct {
			Objects []struct{ Key string } `xml:"Object"`
		}
		data, _ := io.ReadAll(r.Body)
		if err := xml.Unmarshal(data, &body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var keys []string
		for _, o := range body.Objects {
			keys = append(keys, o.Key)
		}
		mu.Lock()
		sent = append(sent, keys)
		round := len(sent)
		mu.Unlock()
		var b strings.Builder
		b.WriteString(`<?xml version="1.0" encoding="UTF-8"?><DeleteResult>`)
		for _, k := range keys {
			code := ""
			switch {
			case k == "pfx/b" && round < 3:
				code = "InternalError"
			case k == "pfx/c":
				code = "AccessDenied"
			}
			if code != "" {
				fmt.Fprintf(&b, "<Error><Key>%s</Key><Code>%s</Code><Message>m</Message></Error>", k, code)
			}
		}
		b.WriteString("</DeleteResult>")
		w.Header().Set("Content-Type", "application/xml")
		io.WriteString(w, b.String())
	}))
	defer srv.Close()
	s, err := segment.Open("s3://bkt/pfx?path_style=true&endpoint="+url.QueryEscape(srv.URL), segment.OpenOptions{
		AccessKeyID: "k", SecretAccessKey: "s", MaxAttempts: 4,
		MinBackoff: time.Millisecond, MaxBackoff: 2 * time.Millisecond, RequestTimeout: time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	err = s.Delete(context.Background(), []string{"a", "b", "c"})
	if err == nil || !strings.Contains(err.Error(), "delete c: AccessDenied") || strings.Contains(err.Error(), "delete b") {
		t.Errorf("delete: %v; want c refused (AccessDenied), b deleted on a retry", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if got := fmt.Sprint(sent); got != "[[pfx/a pfx/b pfx/c] [pfx/b] [pfx/b]]" {
		t.Errorf("DeleteObjects sent %s, want [[pfx/a pfx/b pfx/c] [pfx/b] [pfx/b]]", got)
	}
}
