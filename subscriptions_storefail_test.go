package picomq

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/picomq/caddy-picomq/segment"
	"github.com/picomq/caddy-picomq/streamstore"
)

// TestSubscriptionStoreFailureAnswers: each kind of storage failure of a
// subscription request is answered 503 UNAVAILABLE with Retry-After 1 and
// its own message, none naming the object key the error holds, and is
// logged as a warning of the name a stream's failure of that kind has,
// with the error.
func TestSubscriptionStoreFailureAnswers(t *testing.T) {
	const key = "subs/2f722f/70"
	cause := errors.New("segment: put " + key + " (5 attempts): api error InternalError")
	refusal := &segment.RefusedError{Cause: fmt.Errorf("put %s: %w", key, syscall.EROFS)}
	for _, tc := range []struct {
		name    string
		op      subWrite
		err     error
		warning string
		want    string
	}{
		{"claim not confirmed", subWriteClaim,
			fmt.Errorf("saving subscription p: %w: %w: %w", streamstore.ErrUnavailable, streamstore.ErrUnconfirmed, cause),
			"write not confirmed in time",
			"storage did not confirm the claim: it was not acknowledged, and it may or may not take effect; " + subWriteClaim.repeat},
		{"callback with done not confirmed", subWriteCallbackDone,
			fmt.Errorf("saving subscription h: %w: %w: %w", streamstore.ErrUnavailable, streamstore.ErrUnconfirmed, cause),
			"write not confirmed in time",
			"storage did not confirm the callback: it was not acknowledged, and it may or may not take effect; " +
				"repeat it as it was: it is taken, or, where it took effect and ended the wake, answered 409 FENCED"},
		{"refused after an attempt that may have landed", subWriteAck,
			fmt.Errorf("saving subscription p: %w: %w: %w", streamstore.ErrUnavailable, streamstore.ErrUnconfirmed, refusal),
			"storage refuses writes",
			"storage refuses writes: read-only file system; the ack was not acknowledged, and it may or may not take effect; " +
				"once storage takes writes again, " + subWriteAck.repeat},
		{"delete not confirmed: the server finishes it", subWriteDelete,
			fmt.Errorf("%w: %w: %w", streamstore.ErrUnavailable, streamstore.ErrUnconfirmed, cause),
			"write not confirmed in time",
			"storage did not confirm the delete: it was not acknowledged, and the server goes on deleting it until storage confirms it: " +
				"the subscription is gone from this server, which wakes no worker and calls no webhook for it; " + subWriteDelete.repeat},
		{"delete refused after an attempt that may have landed", subWriteDelete,
			fmt.Errorf("%w: %w: %w", streamstore.ErrUnavailable, streamstore.ErrUnconfirmed, refusal),
			"storage refuses writes",
			"storage refuses writes: read-only file system; the delete was not acknowledged, and the server goes on deleting it " +
				"until storage confirms it: the subscription is gone from this server, which wakes no worker and calls no webhook for it; " +
				"once storage takes writes again, " + subWriteDelete.repeat},
		{"create not confirmed: the server undoes it", subWriteCreate,
			fmt.Errorf("saving subscription q: %w: %w: %w", streamstore.ErrUnavailable, streamstore.ErrUnconfirmed, cause),
			"write not confirmed in time",
			"storage did not confirm the create: it was not acknowledged, and the server undoes it until storage confirms that: " +
				"the subscription does not exist on this server; " + subWriteCreate.repeat},
		{"refused", subWriteRelease,
			fmt.Errorf("saving subscription p: %w: %w", streamstore.ErrUnavailable, refusal),
			"storage refuses writes",
			"storage refuses writes: read-only file system; nothing was written, retry once storage takes writes again"},
		{"taken over", subWriteDelete,
			fmt.Errorf("%w: %w: fenced", streamstore.ErrUnavailable, streamstore.ErrTakenOver),
			"storage taken over by another server", takenOverMessage},
		{"not written", subWriteCreate,
			fmt.Errorf("saving subscription q: %w: %w", streamstore.ErrUnavailable, cause),
			"storage unavailable", subUnavailableMessage},
		{"a lookup, before any write", subWrite{},
			fmt.Errorf("looking up stream /r/a: %w: %w", streamstore.ErrUnavailable, streamstore.ErrUnconfirmed),
			"storage unavailable", subUnavailableMessage},
	} {
		t.Run(tc.name, func(t *testing.T) {
			core, logs := observer.New(zapcore.WarnLevel)
			m := &subManager{owner: &subManagers{failLog: newSampledLog(storeFailureLogEvery)}, log: zap.New(core)}
			w := httptest.NewRecorder()
			m.storeFailed(w, httptest.NewRequest(http.MethodPost, "/r/__ds/subscriptions/p/claim", nil), tc.op, tc.err)
			var body struct {
				Error struct{ Code, Message string }
			}
			if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
				t.Fatal(err)
			}
			if w.Code != http.StatusServiceUnavailable || body.Error.Code != "UNAVAILABLE" || w.Header().Get("Retry-After") != "1" {
				t.Errorf("answer %d %s, Retry-After %q; want 503 UNAVAILABLE, Retry-After 1", w.Code, body.Error.Code, w.Header().Get("Retry-After"))
			}
			if body.Error.Message != tc.want {
				t.Errorf("message\n%q, want\n%q", body.Error.Message, tc.want)
			}
			if strings.Contains(body.Error.Message, key) {
				t.Errorf("message %q names the key", body.Error.Message)
			}
			entries := logs.All()
			if len(entries) != 1 || entries[0].Message != tc.warning ||
				entries[0].ContextMap()["error"] != tc.err.Error() || entries[0].ContextMap()["subscription"] != "/r/__ds/subscriptions/p/claim" {
				t.Errorf("logged %v, want one %q warning with the error and the subscription", entries, tc.warning)
			}
		})
	}
}
