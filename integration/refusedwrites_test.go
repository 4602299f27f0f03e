package integration

import (
	"bytes"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestAppendToABucketThatRefusesWritesFailsFast: a bucket that answers
// every WAL PUT 403 (a policy or a key that lost its write permission)
// will not take the upload, nor the seal that settles it, until someone
// acts. The append is answered 503 at once rather than when the append
// timeout (here over two minutes) runs out; once the bucket takes writes
// again, appends are acknowledged, and the refused one was never stored.
func TestAppendToABucketThatRefusesWritesFailsFast(t *testing.T) {
	const (
		path = "/refused/s"
		text = "text/plain"
	)
	e := fhStart(t, fhOptions{Directives: []string{"s3_timeout 30s"}, Optional: []string{"compact_interval 1h"}})
	e.create(path, text)
	e.append(path, text, []byte("kept;"))

	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Status: http.StatusForbidden})
	defer remove()
	for _, name := range []string{"the first append", "an append while the writer is stalled"} {
		began := time.Now()
		r := e.must(fhReq{Method: http.MethodPost, Path: path, Header: map[string]string{"Content-Type": text}, Body: []byte("refused;")})
		took := time.Since(began)
		if r.Status != http.StatusServiceUnavailable {
			t.Fatalf("%s to a bucket refusing WAL PUTs: %s, want 503", name, r)
		}
		// The append timeout is 2 x (3 x 30 s + backoff): an answer that
		// waited for it would take minutes.
		if took > 30*time.Second {
			t.Errorf("%s was answered 503 after %v; want it long before the append timeout", name, took.Round(time.Millisecond))
		}
		t.Logf("%s: 503 after %v", name, took.Round(time.Millisecond))
	}

	remove()
	req := fhReq{Method: http.MethodPost, Path: path, Header: map[string]string{"Content-Type": text}, Body: []byte("after;")}
	r := e.must(req)
	// The seal retried in the background lands now; until it has, the
	// writer still refuses, and a client retries the 503 as this test does.
	for deadline := time.Now().Add(30 * time.Second); r.Status == http.StatusServiceUnavailable && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
		r = e.must(req)
	}
	if r.Status/100 != 2 {
		t.Fatalf("append once the bucket takes writes again: %s, want 2xx", r)
	}
	if got, _, err := e.readBytes(path); err != nil || !bytes.Equal(got, []byte("kept;after;")) {
		t.Errorf("the stream reads %q (%v), want only the acknowledged \"kept;after;\"", got, err)
	}
}

// TestRefusedAppendNamesTheCause: when the bucket refuses writes for good,
// the 503 of each protocol says so and names the storage's refusal, not a
// write "not confirmed in time" as if the store had been slow. The append
// the refusal caught in flight may still be stored (its upload's fate is
// settled later) and says so; the appends after it were never handed to
// storage and say that. Status, Retry-After and the Pico error name are
// those of any other 503 of their kind.
func TestRefusedAppendNamesTheCause(t *testing.T) {
	const text = "text/plain"
	e := picoStart(t, []string{"s3_timeout 30s", "compact_interval 1h"}, nil)
	const dsPath, picoPath = "/ds/why/ds", "/pico/why/pico"
	picoWant(t, "DS create", picoDo(e, http.MethodPut, dsPath, nil, "Content-Type", text), http.StatusCreated)
	picoWant(t, "Pico create", picoDo(e, http.MethodPut, picoPath, nil, "Content-Type", text), http.StatusCreated)

	type proto struct {
		name string
		path string
		// message checks the protocol's error form and returns its text.
		message func(t *testing.T, what string, r fhResp) string
	}
	ds := proto{name: "DS", path: dsPath, message: func(t *testing.T, what string, r fhResp) string {
		t.Helper()
		picoWant(t, what, r, http.StatusServiceUnavailable, "Retry-After", "1", "Content-Type", "text/plain; charset=utf-8")
		return string(r.Body)
	}}
	pico := proto{name: "Pico", path: picoPath, message: func(t *testing.T, what string, r fhResp) string {
		t.Helper()
		picoWant(t, what, r, http.StatusServiceUnavailable, "Retry-After", "1")
		body := picoWantError(t, what, r, http.StatusServiceUnavailable, "durability")
		msg, _ := body["message"].(string)
		return msg
	}}
	send := func(p proto, body string) fhResp {
		return picoDo(e, http.MethodPost, p.path, []byte(body), "Content-Type", text)
	}
	for _, p := range []proto{ds, pico} {
		if r := send(p, "kept;"); r.Status/100 != 2 {
			t.Fatalf("%s append before the fault: %s", p.name, r)
		}
	}
	for _, round := range [][2]proto{{ds, pico}, {pico, ds}} {
		first, then := round[0], round[1]
		remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Status: http.StatusForbidden})
		what := first.name + " append caught by the refusal"
		msg := first.message(t, what, send(first, "refused;"))
		t.Logf("%s: %q", what, msg)
		for _, want := range []string{"storage refuses writes: ", "403", "may still be stored", "producer headers"} {
			if !strings.Contains(msg, want) {
				t.Errorf("%s: message %q does not say %q", what, msg, want)
			}
		}
		if strings.Contains(msg, "in time") {
			t.Errorf("%s: message %q speaks of a timeout", what, msg)
		}
		what = then.name + " append while storage refuses writes"
		msg = then.message(t, what, send(then, "refused;"))
		t.Logf("%s: %q", what, msg)
		for _, want := range []string{"storage refuses writes: ", "403", "nothing was written"} {
			if !strings.Contains(msg, want) {
				t.Errorf("%s: message %q does not say %q", what, msg, want)
			}
		}
		remove()
		// The seal retried in the background lands now; until it has,
		// the writer still refuses.
		r := send(first, "after;")
		for deadline := time.Now().Add(30 * time.Second); r.Status == http.StatusServiceUnavailable && time.Now().Before(deadline); {
			time.Sleep(50 * time.Millisecond)
			r = send(first, "after;")
		}
		if r.Status/100 != 2 {
			t.Fatalf("%s append once the bucket takes writes again: %s, want 2xx", first.name, r)
		}
	}
	// The warnings have the refusal's name too: nothing was slow.
	logs := e.caddy.Logs()
	if !strings.Contains(logs, `"msg":"storage refuses writes"`) {
		t.Error(`no "storage refuses writes" warning in the log`)
	}
	if n := strings.Count(logs, `"msg":"write not confirmed in time"`); n > 0 {
		t.Errorf(`%d "write not confirmed in time" warnings for appends the bucket refused`, n)
	}
}

// TestRefusedBlobAppendNamesTheCause: an append large enough for a blob of
// its own (256 KiB and more) that the bucket refuses for good is answered
// as a small one is, with a 503 naming the refusal and saying nothing was
// written, and nothing of it is read back. It said "storage unavailable",
// as if the bucket had only been slow.
func TestRefusedBlobAppendNamesTheCause(t *testing.T) {
	const text = "text/plain"
	e := picoStart(t, []string{"s3_timeout 30s", "compact_interval 1h"}, nil)
	const path = "/ds/why/blob"
	picoWant(t, "create", picoDo(e, http.MethodPut, path, nil, "Content-Type", text), http.StatusCreated)
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/blob/", Status: http.StatusForbidden})
	r := picoDo(e, http.MethodPost, path, bytes.Repeat([]byte("x"), 300<<10), "Content-Type", text)
	remove()
	picoWant(t, "refused blob append", r, http.StatusServiceUnavailable, "Retry-After", "1")
	t.Logf("refused blob append: %q", r.Body)
	for _, want := range []string{"storage refuses writes: ", "403", "nothing was written"} {
		if !strings.Contains(string(r.Body), want) {
			t.Errorf("message %q does not say %q", r.Body, want)
		}
	}
	if r := picoDo(e, http.MethodPost, path, []byte("after;"), "Content-Type", text); r.Status/100 != 2 {
		t.Fatalf("append once the bucket takes writes again: %s", r)
	}
	r = picoDo(e, http.MethodGet, path+"?offset=-1", nil)
	if r.Status != http.StatusOK || string(r.Body) != "after;" {
		t.Errorf("the stream reads %s; want only \"after;\"", r)
	}
}
