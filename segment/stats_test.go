package segment_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/segment"
)

func TestHistogramBuckets(t *testing.T) {
	for _, tc := range []struct {
		name   string
		obs    []time.Duration
		bucket []int // cumulative counts expected at UploadBuckets[i] for the listed i
		at     []int
		count  uint64
	}{
		{name: "empty", at: []int{0, len(segment.UploadBuckets) - 1}, bucket: []int{0, 0}},
		{
			name:   "bounds are inclusive",
			obs:    []time.Duration{time.Millisecond, 2 * time.Millisecond, 5 * time.Millisecond, 10 * time.Millisecond, 11 * time.Millisecond},
			at:     []int{0, 1, 2, 3, 4},
			bucket: []int{1, 2, 3, 4, 5},
			count:  5,
		},
		{
			name:   "past the last bound only in the count",
			obs:    []time.Duration{time.Minute, time.Millisecond},
			at:     []int{0, len(segment.UploadBuckets) - 1},
			bucket: []int{1, 1},
			count:  2,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var h segment.Histogram
			var sum time.Duration
			for _, d := range tc.obs {
				h.Observe(d)
				sum += d
			}
			s := h.Snapshot()
			if s.Count != tc.count {
				t.Errorf("count %d, want %d", s.Count, tc.count)
			}
			if want := sum.Seconds(); s.Sum < want-1e-9 || s.Sum > want+1e-9 {
				t.Errorf("sum %v, want %v", s.Sum, want)
			}
			for j, i := range tc.at {
				if got := s.Cumulative[i]; got != uint64(tc.bucket[j]) {
					t.Errorf("bucket le=%v holds %d, want %d", segment.UploadBuckets[i], got, tc.bucket[j])
				}
			}
		})
	}
}

func TestRequestStatsNil(t *testing.T) {
	var s *segment.RequestStats
	if n := s.Requests(segment.OpPut, segment.OutcomeOK); n != 0 {
		t.Errorf("nil stats count %d", n)
	}
	if h := s.Uploads(segment.UploadWAL); h.Count != 0 {
		t.Errorf("nil stats histogram count %d", h.Count)
	}
}

// wantRequests checks the stats against expected counts; every pair not
// listed must be zero.
func wantRequests(t *testing.T, st *segment.RequestStats, want map[[2]string]uint64) {
	t.Helper()
	for _, op := range segment.Ops {
		for _, o := range segment.Outcomes {
			k := [2]string{op.String(), o.String()}
			if got := st.Requests(op, o); got != want[k] {
				t.Errorf("%s/%s: %d attempts counted, want %d", k[0], k[1], got, want[k])
			}
		}
	}
}

func TestFileStoreCountsCalls(t *testing.T) {
	st := new(segment.RequestStats)
	s, err := segment.Open("file://"+t.TempDir(), segment.OpenOptions{Stats: st})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	steps := []struct {
		name string
		do   func() error
	}{
		{"put wal", func() error {
			_, err := s.Put(ctx, "wal/0/0", []byte("x"), segment.PutOptions{IfNoneMatch: true})
			return err
		}},
		{"put again", func() error {
			_, err := s.Put(ctx, "wal/0/0", []byte("y"), segment.PutOptions{IfNoneMatch: true})
			if errors.Is(err, segment.ErrPreconditionFailed) {
				return nil
			}
			return fmt.Errorf("second create-only put: %v", err)
		}},
		{"put meta", func() error { _, err := s.Put(ctx, "streams/a.m", []byte("m"), segment.PutOptions{}); return err }},
		{"get", func() error { _, _, err := s.Get(ctx, "wal/0/0", 0, -1); return err }},
		{"head", func() error { _, _, err := s.Get(ctx, "wal/0/0", 0, 0); return err }},
		{"get missing", func() error {
			if _, _, err := s.Get(ctx, "nope", 0, -1); !errors.Is(err, segment.ErrNotFound) {
				return fmt.Errorf("get of a missing key: %v", err)
			}
			return nil
		}},
		// Cold readers read data objects through BufferGetter: those
		// reads are GETs too.
		{"get into a buffer", func() error {
			_, err := s.(segment.BufferGetter).GetBuffer(ctx, "wal/0/0", func(n int) []byte { return make([]byte, n) })
			return err
		}},
		{"get missing into a buffer", func() error {
			_, err := s.(segment.BufferGetter).GetBuffer(ctx, "nope", func(n int) []byte { return make([]byte, n) })
			if !errors.Is(err, segment.ErrNotFound) {
				return fmt.Errorf("buffered get of a missing key: %v", err)
			}
			return nil
		}},
		{"list", func() error { _, _, err := s.List(ctx, "wal/", "", 10); return err }},
		{"stale conditional delete", func() error {
			if err := s.DeleteIfMatch(ctx, "streams/a.m", `"00000000000000000000000000000000"`); !errors.Is(err, segment.ErrPreconditionFailed) {
				return fmt.Errorf("conditional delete with a stale ETag: %v", err)
			}
			return nil
		}},
		{"delete", func() error { return s.Delete(ctx, []string{"wal/0/0", "streams/a.m"}) }},
	}
	for _, step := range steps {
		if err := step.do(); err != nil {
			t.Fatalf("%s: %v", step.name, err)
		}
	}
	wantRequests(t, st, map[[2]string]uint64{
		{"put", "ok"}: 2, {"put", "precondition_failed"}: 1,
		{"get", "ok"}: 2, {"get", "not_found"}: 2, {"head", "ok"}: 1,
		{"list", "ok"}: 1, {"delete", "ok"}: 1, {"delete", "precondition_failed"}: 1,
	})
	if wal, other := st.Uploads(segment.UploadWAL).Count, st.Uploads(segment.UploadOther).Count; wal != 2 || other != 1 {
		t.Errorf("upload histogram counts wal %d other %d, want 2 and 1", wal, other)
	}
}

// TestS3StoreCountsAttempts checks that every attempt of a retried S3
// request is counted with its own outcome, exactly as often as the server
// saw it.
func TestS3StoreCountsAttempts(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]int{} // "METHOD path" -> requests
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		mu.Lock()
		k := r.Method + " " + r.URL.Path
		seen[k]++
		n := seen[k]
		mu.Unlock()
		s3Error := func(status int, code string) {
			w.Header().Set("Content-Type", "application/xml")
			w.WriteHeader(status)
			fmt.Fprintf(w, `<?xml version="1.0" encoding="UTF-8"?><Error><Code>%s</Code><Message>m</Message></Error>`, code)
		}
		switch k {
		case "PUT /bkt/pfx/wal/1":
			if n <= 2 { // two throttled attempts, then success
				s3Error(http.StatusServiceUnavailable, "SlowDown")
				return
			}
			w.Header().Set("ETag", `"e1"`)
		case "PUT /bkt/pfx/lease":
			s3Error(http.StatusPreconditionFailed, "PreconditionFailed")
		case "GET /bkt/pfx/missing":
			s3Error(http.StatusNotFound, "NoSuchKey")
		case "GET /bkt/pfx/slow":
			select { // every attempt stalls past its timeout
			case <-r.Context().Done():
			case <-time.After(5 * time.Second):
			}
		case "HEAD /bkt/pfx/there":
			w.Header().Set("ETag", `"e2"`)
		case "GET /bkt":
			w.Header().Set("Content-Type", "application/xml")
			io.WriteString(w, `<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>bkt</Name><IsTruncated>false</IsTruncated></ListBucketResult>`)
		default:
			s3Error(http.StatusBadRequest, "InvalidRequest")
		}
	}))
	defer srv.Close()
	st := new(segment.RequestStats)
	s, err := segment.Open("s3://bkt/pfx?path_style=true&endpoint="+url.QueryEscape(srv.URL), segment.OpenOptions{
		AccessKeyID: "k", SecretAccessKey: "s", MaxAttempts: 3,
		MinBackoff: time.Millisecond, MaxBackoff: 2 * time.Millisecond,
		RequestTimeout: 200 * time.Millisecond, Stats: st,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := s.Put(ctx, "wal/1", []byte("batch"), segment.PutOptions{IfNoneMatch: true}); err != nil {
		t.Fatalf("put after throttling: %v", err)
	}
	if _, err := s.Put(ctx, "lease", []byte("l"), segment.PutOptions{IfMatch: `"old"`}); !errors.Is(err, segment.ErrPreconditionFailed) {
		t.Fatalf("compare-and-swap put: %v, want precondition failed", err)
	}
	if _, _, err := s.Get(ctx, "missing", 0, -1); !errors.Is(err, segment.ErrNotFound) {
		t.Fatalf("get missing: %v", err)
	}
	if _, _, err := s.Get(ctx, "slow", 0, -1); err == nil {
		t.Fatal("get of a stalled object succeeded")
	}
	if _, _, err := s.Get(ctx, "there", 0, 0); err != nil {
		t.Fatalf("head: %v", err)
	}
	if _, _, err := s.List(ctx, "wal/", "", 10); err != nil {
		t.Fatalf("list: %v", err)
	}
	wantRequests(t, st, map[[2]string]uint64{
		{"put", "error"}: 2, {"put", "ok"}: 1, {"put", "precondition_failed"}: 1,
		{"get", "not_found"}: 1, {"get", "timeout"}: 3,
		{"head", "ok"}: 1, {"list", "ok"}: 1,
	})
	mu.Lock()
	defer mu.Unlock()
	if seen["PUT /bkt/pfx/wal/1"] != 3 || seen["GET /bkt/pfx/slow"] != 3 {
		t.Errorf("server saw %v", seen)
	}
	if wal, other := st.Uploads(segment.UploadWAL).Count, st.Uploads(segment.UploadOther).Count; wal != 3 || other != 1 {
		t.Errorf("upload histogram counts wal %d other %d, want 3 and 1", wal, other)
	}
}
