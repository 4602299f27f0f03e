package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// subHooks is a webhook receiver that counts deliveries by subscription
// and answers each {"done":true}, so that every append wakes again.
type subHooks struct {
	mu sync.Mutex
	n  map[string]int
}

func (h *subHooks) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var body struct {
		ID string `json:"subscription_id"`
	}
	_ = json.NewDecoder(r.Body).Decode(&body)
	h.mu.Lock()
	h.n[body.ID]++
	h.mu.Unlock()
	io.WriteString(w, `{"done":true}`)
}

func (h *subHooks) count(id string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.n[id]
}

// TestDeletedSubscriptionStaysDeleted: through Caddy on versitygw, a
// DELETE of a webhook subscription whose document write lands while the
// server cannot know it (its client leaves while the write is on its way;
// the store's answers are lost at every attempt) ends with the
// subscription gone for good: after an append to the stream it follows,
// and a delivery of another subscription on that append (so the append's
// note was applied), its document is still a grave in the bucket, its
// webhook is not called, and a GET is 404. The delete used to run under
// the request's context, and a delete whose write was not confirmed left
// the subscription in memory: its next background write (the append's)
// wrote the document again over the grave, and its webhook was called.
func TestDeletedSubscriptionStaysDeleted(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e, hooks, body := startWebhookSubs(t)

	for _, tc := range []struct {
		name, id string
		// del sends the DELETE while its document's write lands unseen.
		del func(t *testing.T, path, doc string)
	}{
		{"client leaves mid-delete", "h1", func(t *testing.T, path, doc string) {
			// The grave's PUT is parked at the proxy; the client gives
			// up meanwhile; the PUT is then forwarded and lands.
			release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: doc, Times: 1})
			defer release()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() {
				req, _ := http.NewRequestWithContext(ctx, http.MethodDelete, e.caddy.URL()+path, nil)
				resp, err := e.client.Do(req)
				if err == nil {
					resp.Body.Close()
					err = fmt.Errorf("answered %s", resp.Status)
				}
				done <- err
			}()
			wctx, wcancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer wcancel()
			if err := e.proxy.WaitHeld(wctx, 1); err != nil {
				t.Fatalf("the delete's write never reached the proxy: %v", err)
			}
			cancel()
			if err := <-done; !strings.Contains(fmt.Sprint(err), "canceled") {
				t.Fatalf("DELETE %s: %v, want the client to have left", path, err)
			}
			// Let the server see its client gone before the write goes on
			// (the server is told at once on loopback).
			time.Sleep(300 * time.Millisecond)
			release()
			if err := e.proxy.WaitLanded(wctx); err != nil {
				t.Fatal(err)
			}
		}},
		{"delete not confirmed", "h2", func(t *testing.T, path, doc string) {
			e.subFailure(t, subLandedLost, doc, "DELETE", path, "",
				[]string{"storage did not confirm the delete: ", "the server goes on deleting it"})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path, doc := "/r/__ds/subscriptions/"+tc.id, subDoc("/r/", tc.id)
			if st, v := e.subCall("PUT", path, body(tc.id)); st != http.StatusCreated {
				t.Fatalf("create %s: %d %v", path, st, v)
			}
			tc.del(t, path, doc)
			if got := e.mustDoc(t, doc); !isGrave([]byte(got)) {
				t.Fatalf("the delete's grave did not land: %q", got)
			}

			// An append to the stream both follow; once the control
			// subscription is called for it, the note was applied to
			// every subscription, and a write of the deleted one begun.
			ctlBefore := hooks.count("c")
			e.append("/r/events/a", "application/json", []byte(`{"n":1}`))
			if err := fhWaitFor(20*time.Second, 20*time.Millisecond, func() error {
				if hooks.count("c") <= ctlBefore {
					return fmt.Errorf("no delivery to the control subscription")
				}
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			// The write of the deleted subscription and its delivery
			// came within a second of the control's before the fix.
			deadline := time.Now().Add(3 * time.Second)
			for time.Now().Before(deadline) {
				if got := e.mustDoc(t, doc); !isGrave([]byte(got)) {
					t.Fatalf("the deleted subscription's document is back in the bucket: %q", fhClip(got, 300))
				}
				if n := hooks.count(tc.id); n > 0 {
					t.Fatalf("the deleted subscription's webhook was called %d times", n)
				}
				time.Sleep(50 * time.Millisecond)
			}
			if st, v := e.subCall("GET", path, ""); st != http.StatusNotFound {
				t.Fatalf("GET %s after its delete: %d %v, want 404", path, st, v)
			}
			if st, v := e.subCall("DELETE", path, ""); st != http.StatusNoContent {
				t.Fatalf("repeated DELETE %s: %d %v, want 204", path, st, v)
			}
			if got := e.mustDoc(t, doc); !isGrave([]byte(got)) {
				t.Fatalf("after the repeated delete, the document is %q", fhClip(got, 300))
			}
		})
	}

	// While storage does not confirm the delete, the id is neither served
	// nor created again: a GET is 404, a PUT and a repeated DELETE 503
	// with Retry-After. Once storage takes the write, the repeated DELETE
	// is 204 and a PUT creates the subscription anew.
	t.Run("while the delete is finished", func(t *testing.T) {
		const id = "h3"
		path, doc := "/r/__ds/subscriptions/"+id, subDoc("/r/", id)
		if st, v := e.subCall("PUT", path, body(id)); st != http.StatusCreated {
			t.Fatalf("create %s: %d %v", path, st, v)
		}
		fault := subLandedLost
		fault.KeyContains = doc
		remove := e.proxy.AddFault(fault)
		defer remove()
		pending := func(method, body string) {
			t.Helper()
			r := e.must(fhReq{Method: method, Path: path, Header: map[string]string{"Content-Type": "application/json"}, Body: []byte(body)})
			t.Logf("%s %s while the delete is not confirmed: %s, Retry-After %q", method, path, r, r.Header.Get("Retry-After"))
			if r.Status != http.StatusServiceUnavailable || r.Header.Get("Retry-After") != "1" {
				t.Errorf("%s %s: %s, Retry-After %q; want 503 with Retry-After 1", method, path, r, r.Header.Get("Retry-After"))
			}
		}
		pending("DELETE", "")
		if got := e.mustDoc(t, doc); !isGrave([]byte(got)) {
			t.Fatalf("the delete's grave did not land: %q", got)
		}
		if st, v := e.subCall("GET", path, ""); st != http.StatusNotFound {
			t.Errorf("GET %s while its delete is finished: %d %v, want 404", path, st, v)
		}
		pending("PUT", body(id))
		pending("DELETE", "")
		remove()
		if st, v := e.subCall("DELETE", path, ""); st != http.StatusNoContent {
			t.Fatalf("DELETE %s once storage takes writes: %d %v, want 204", path, st, v)
		}
		if got := e.mustDoc(t, doc); !isGrave([]byte(got)) {
			t.Fatalf("after the delete, the document is %q", fhClip(got, 300))
		}
		if st, v := e.subCall("PUT", path, body(id)); st != http.StatusCreated {
			t.Fatalf("PUT %s after its delete: %d %v, want 201", path, st, v)
		}
		if got := e.mustDoc(t, doc); isGrave([]byte(got)) {
			t.Fatalf("the new subscription's document is a grave: %q", got)
		}
	})
}

// TestUnconfirmedCreateIsUndone: through Caddy on versitygw, a create
// whose document landed while the server saw only failures (a 500 after
// every forwarded PUT) is undone by the server: the 503 says so, the
// document becomes a grave without any repeat, a DELETE of the id
// meanwhile waits for that and is 204, and after a restart neither
// subscription exists nor is its webhook called. Such a create was kept
// in the bucket and not in memory: a DELETE of its id was 204 with
// nothing deleted, and a restart brought both subscriptions back to life.
func TestUnconfirmedCreateIsUndone(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e, hooks, body := startWebhookSubs(t)
	for _, id := range []string{"u1", "u2"} {
		e.subFailure(t, subLanded500, subDoc("/r/", id), "PUT", "/r/__ds/subscriptions/"+id, body(id),
			[]string{"storage did not confirm the create: it was not acknowledged, and the server undoes it until storage confirms that"})
	}
	// u1: nobody repeats anything; the server undoes the create itself.
	if err := fhWaitFor(20*time.Second, 50*time.Millisecond, func() error {
		if got := e.mustDoc(t, subDoc("/r/", "u1")); !isGrave([]byte(got)) {
			return fmt.Errorf("the create's document is still there: %q", fhClip(got, 200))
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
	// u2: a DELETE of the id.
	if st, v := e.subCall("DELETE", "/r/__ds/subscriptions/u2", ""); st != http.StatusNoContent {
		t.Fatalf("DELETE u2: %d %v, want 204", st, v)
	}
	if got := e.mustDoc(t, subDoc("/r/", "u2")); !isGrave([]byte(got)) {
		t.Errorf("after its DELETE was answered 204, u2's document is %q", fhClip(got, 200))
	}

	e.caddy.Restart()
	for _, id := range []string{"u1", "u2"} {
		if st, v := e.subCall("GET", "/r/__ds/subscriptions/"+id, ""); st != http.StatusNotFound {
			t.Errorf("GET %s after a restart: %d %v, want 404", id, st, v)
		}
	}
	e.append("/r/events/a", "application/json", []byte(`{"n":1}`))
	if err := fhWaitFor(20*time.Second, 20*time.Millisecond, func() error {
		if hooks.count("c") == 0 {
			return fmt.Errorf("no delivery to the control subscription")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// Deliveries of one append start together; the others would have
	// come within a second of the control's.
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		for _, id := range []string{"u1", "u2"} {
			if n := hooks.count(id); n > 0 {
				t.Fatalf("%s's webhook was called %d times after the restart", id, n)
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// startWebhookSubs starts Caddy on versitygw with stream events/a and a
// control webhook subscription c on it, whose calls (as every one made to
// body(id)'s receiver) hooks counts; body(id) is the document of webhook
// subscription id on events/a.
func startWebhookSubs(t *testing.T) (e *fhEnv, hooks *subHooks, body func(id string) string) {
	t.Helper()
	hooks = &subHooks{n: map[string]int{}}
	recv := httptest.NewServer(hooks)
	t.Cleanup(recv.Close)
	e = fhStart(t, fhOptions{Directives: []string{"allow_loopback_webhooks"}, Optional: []string{"compact_interval 1h"}})
	e.create("/r/events/a", "application/json")
	body = func(id string) string {
		return `{"type":"webhook","streams":["events/a"],"webhook":{"url":"` + recv.URL + `/` + id + `"}}`
	}
	if st, v := e.subCall("PUT", "/r/__ds/subscriptions/c", body("c")); st != http.StatusCreated {
		t.Fatalf("create the control subscription: %d %v", st, v)
	}
	return e, hooks, body
}
