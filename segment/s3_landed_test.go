package segment_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
	"github.com/picomq/caddy-picomq/segment"
)

// TestS3StoreConditionalPutLandedBeforeARefusal: a conditional PUT is
// applied and then answered with an error that says it was not (503
// SlowDown, 429, 409 ConditionalRequestConflict), as a gateway in front of
// the store can answer after forwarding. The retry finds the condition
// false against the PUT's own object: that is the PUT done, not a
// conflict. A real conflict met by a retry stays one.
func TestS3StoreConditionalPutLandedBeforeARefusal(t *testing.T) {
	s, p := proxiedS3(t, segment.OpenOptions{
		RequestTimeout: 2 * time.Second,
		MaxAttempts:    3,
		MinBackoff:     time.Millisecond,
		MaxBackoff:     10 * time.Millisecond,
	})
	ctx := context.Background()
	for _, status := range []int{http.StatusServiceUnavailable, http.StatusTooManyRequests, http.StatusConflict} {
		for _, ifMatch := range []bool{false, true} {
			name := http.StatusText(status) + "/create"
			if ifMatch {
				name = http.StatusText(status) + "/compare-and-swap"
			}
			t.Run(name, func(t *testing.T) {
				key := fmt.Sprintf("landed/%d/%v", status, ifMatch)
				opts := segment.PutOptions{IfNoneMatch: true}
				if ifMatch {
					etag, err := s.Put(ctx, key, []byte("before"), segment.PutOptions{})
					if err != nil {
						t.Fatal(err)
					}
					opts = segment.PutOptions{IfMatch: etag}
				}
				p.Reset()
				remove := p.AddFault(testenv.Fault{Op: testenv.OpPut, Status: status, AfterForward: true, Times: 1})
				etag, err := s.Put(ctx, key, []byte("mine"), opts)
				remove()
				if err != nil {
					t.Fatalf("Put: %v; want it done, its first attempt landed", err)
				}
				if n := p.Counts().Put; n != 2 {
					t.Fatalf("PUTs = %d, want 2", n)
				}
				got, cur, err := s.Get(ctx, key, 0, -1)
				if err != nil || string(got) != "mine" || cur != etag {
					t.Fatalf("Get = %q %s, %v; want %q %s", got, cur, err, "mine", etag)
				}
			})
		}
	}
	// The retry's refusal cannot be told from a conflict when the object
	// cannot be read back: the first attempt may have landed.
	t.Run("landed, and not read back", func(t *testing.T) {
		p.Reset()
		removePut := p.AddFault(testenv.Fault{Op: testenv.OpPut, Status: http.StatusServiceUnavailable, AfterForward: true, Times: 1})
		removeGet := p.AddFault(testenv.Fault{Op: testenv.OpGet, Status: http.StatusInternalServerError, Times: 100})
		_, err := s.Put(ctx, "unread", []byte("mine"), segment.PutOptions{IfNoneMatch: true})
		removePut()
		removeGet()
		if !errors.Is(err, segment.ErrUnknownOutcome) {
			t.Fatalf("Put: %v, want ErrUnknownOutcome", err)
		}
		if got, _, err := s.Get(ctx, "unread", 0, -1); err != nil || string(got) != "mine" {
			t.Fatalf("Get = %q, %v; want the first attempt's object", got, err)
		}
	})
	t.Run("a real conflict after a refusal", func(t *testing.T) {
		etag, err := s.Put(ctx, "taken", []byte("theirs"), segment.PutOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, opts := range []segment.PutOptions{{IfNoneMatch: true}, {IfMatch: `"0123456789abcdef0123456789abcdef"`}} {
			remove := p.AddFault(testenv.Fault{Op: testenv.OpPut, Status: http.StatusServiceUnavailable, Times: 1})
			_, err := s.Put(ctx, "taken", []byte("mine"), opts)
			remove()
			if !errors.Is(err, segment.ErrPreconditionFailed) || errors.Is(err, segment.ErrUnknownOutcome) {
				t.Fatalf("Put(%+v) over another's object after a 503: %v, want ErrPreconditionFailed", opts, err)
			}
		}
		if got, cur, err := s.Get(ctx, "taken", 0, -1); err != nil || string(got) != "theirs" || cur != etag {
			t.Fatalf("Get = %q %s, %v; want theirs untouched", got, cur, err)
		}
	})
}
