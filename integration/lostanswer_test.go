package integration

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// laCase is one request sent while every answer of one kind of bucket
// write is lost (the write lands, its answer is a 500), and repeated by its
// client once the bucket answers again.
type laCase struct {
	name  string
	setup func(e *fhEnv)
	req   fhReq
	// paths are the streams whose state is compared before and after a
	// crash.
	paths []string
	// done reports whether the state (laState of each path) shows the
	// request carried out.
	done func(state map[string]string) bool
}

// laState describes a stream as a reader sees it: HEAD's status, or its
// tail, closure and content.
func laState(e *fhEnv, path string) string {
	e.t.Helper()
	h := e.must(fhReq{Method: http.MethodHead, Path: path})
	if h.Status != http.StatusOK {
		return fmt.Sprintf("HEAD %d", h.Status)
	}
	body, next, err := e.readBytes(path)
	if err != nil {
		e.t.Fatalf("read %s: %v", path, err)
	}
	return fmt.Sprintf("next=%s closed=%q body=%q", next, h.Header.Get("Stream-Closed"), body)
}

// TestLostAnswersOnEveryWritePath: while the bucket applies the writes of
// one kind (metadata, expiry markers, tombstones, WAL objects, deletes) but
// answers the first, or every one, with a 500, a create (plain, with a TTL, with a body, over a
// grave, a fork), a close, a producer's append or a delete is answered
// either 2xx, and then done, or 5xx with a Retry-After; repeated once the
// bucket answers again, it is done, exactly once; readers agree before and
// after a crash; and the next create and append go through. The fault
// tests cover lost answers of WAL uploads and lease renewals under plain
// appends; these are the other writes a request waits for.
func TestLostAnswersOnEveryWritePath(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	text := map[string]string{"Content-Type": "text/plain"}
	base := func(e *fhEnv) {
		e.create("/s", "text/plain")
		e.append("/s", "text/plain", []byte("a"))
	}
	withFork := func(e *fhEnv) {
		base(e)
		if r := e.must(fhReq{Method: http.MethodPut, Path: "/f", Header: map[string]string{"Stream-Forked-From": "/s"}}); r.Status != http.StatusCreated {
			e.t.Fatalf("fork: %s", r)
		}
	}
	has := func(path, want string) func(map[string]string) bool {
		return func(s map[string]string) bool { return strings.Contains(s[path], want) }
	}
	producer := map[string]string{"Content-Type": "text/plain", "Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "0"}
	ops := []struct {
		laCase
		keys []string // what the fault matches: a key part of PUTs, or DELETE
	}{
		{laCase{name: "create", setup: base, req: fhReq{Method: http.MethodPut, Path: "/n", Header: text},
			paths: []string{"/n"}, done: has("/n", "next=")}, []string{"/streams/"}},
		{laCase{name: "create-ttl", setup: base,
			req:   fhReq{Method: http.MethodPut, Path: "/n", Header: map[string]string{"Content-Type": "text/plain", "Stream-TTL": "3600"}},
			paths: []string{"/n"}, done: has("/n", "next=")}, []string{"/expiry/", "/streams/"}},
		{laCase{name: "create-with-body", setup: base, req: fhReq{Method: http.MethodPut, Path: "/n", Header: text, Body: []byte("x")},
			paths: []string{"/n"}, done: has("/n", `body="x"`)}, []string{"/wal/", "/streams/"}},
		{laCase{name: "create-over-grave", setup: func(e *fhEnv) {
			base(e)
			if r := e.must(fhReq{Method: http.MethodDelete, Path: "/s"}); r.Status/100 != 2 {
				e.t.Fatalf("delete: %s", r)
			}
		}, req: fhReq{Method: http.MethodPut, Path: "/s", Header: text, Body: []byte("n")},
			paths: []string{"/s"}, done: has("/s", `body="n"`)}, []string{"/streams/"}},
		{laCase{name: "fork", setup: base, req: fhReq{Method: http.MethodPut, Path: "/f", Header: map[string]string{"Stream-Forked-From": "/s"}},
			paths: []string{"/f", "/s"}, done: has("/f", `body="a"`)}, []string{"/streams/"}},
		{laCase{name: "producer-append", setup: base, req: fhReq{Method: http.MethodPost, Path: "/s", Header: producer, Body: []byte("p")},
			paths: []string{"/s"}, done: has("/s", `body="ap"`)}, []string{"/wal/"}},
		{laCase{name: "close", setup: base, req: fhReq{Method: http.MethodPost, Path: "/s", Header: map[string]string{"Stream-Closed": "true"}},
			paths: []string{"/s"}, done: has("/s", `closed="true"`)}, []string{"/wal/"}},
		{laCase{name: "delete", setup: base, req: fhReq{Method: http.MethodDelete, Path: "/s"},
			paths: []string{"/s"}, done: has("/s", "HEAD 404")}, []string{"/gc/", "/streams/", "DELETE"}},
		{laCase{name: "delete-seeded", setup: func(e *fhEnv) {
			if r := e.must(fhReq{Method: http.MethodPut, Path: "/s", Header: text, Body: []byte("a")}); r.Status != http.StatusCreated {
				e.t.Fatalf("create with a body: %s", r)
			}
		}, req: fhReq{Method: http.MethodDelete, Path: "/s"},
			paths: []string{"/s"}, done: has("/s", "HEAD 404")}, []string{"/wal/", "/streams/"}},
		{laCase{name: "delete-forked-source", setup: withFork, req: fhReq{Method: http.MethodDelete, Path: "/s"},
			paths: []string{"/s", "/f"}, done: func(s map[string]string) bool {
				return (s["/s"] == "HEAD 410" || s["/s"] == "HEAD 404") && strings.Contains(s["/f"], `body="a"`)
			}}, []string{"/expiry/", "/streams/"}},
	}
	// Every answer lost, the store's retries of a write included (which
	// then see no failed precondition, only 500s), or the first only (its
	// retry finds the condition false after its own write).
	times := map[string]int{"every": 0, "once": 1}
	for _, op := range ops {
		for _, key := range op.keys {
			for lost, n := range times {
				t.Run(op.name+"/"+strings.Trim(key, "/")+"/"+lost, func(t *testing.T) {
					t.Parallel()
					f := testenv.Fault{Op: testenv.OpPut, KeyContains: key, Status: http.StatusInternalServerError, AfterForward: true, Times: n}
					if key == "DELETE" {
						f = testenv.Fault{Op: testenv.OpDelete, Status: http.StatusInternalServerError, AfterForward: true, Times: n}
					}
					laRun(t, op.laCase, f)
				})
			}
		}
	}
}

func laRun(t *testing.T, c laCase, f testenv.Fault) {
	t.Helper()
	e := fhStart(t, fhOptions{Directives: []string{"s3_timeout " + fhS3Timeout.String()}})
	c.setup(e)
	state := func() map[string]string {
		m := map[string]string{}
		for _, p := range c.paths {
			m[p] = laState(e, p)
		}
		return m
	}
	remove := e.proxy.AddFault(f)
	first, err := e.send(c.req)
	remove()
	if err != nil {
		t.Fatalf("%s %s under the fault: %v", c.req.Method, c.req.Path, err)
	}
	t.Logf("under the fault: %s", first)
	switch first.Status / 100 {
	case 2:
		if s := state(); !c.done(s) {
			t.Errorf("answered %s under the fault, but readers see %v", first, s)
		}
	case 5:
		if first.Header.Get("Retry-After") == "" {
			t.Errorf("answered %s under the fault, without Retry-After", first)
		}
	default:
		t.Errorf("answered %s under the fault; want 2xx, or 5xx as the bucket failed", first)
	}
	// The client repeats what was not acknowledged, for as long as the
	// answer says to retry (the writer may still be settling its failed
	// uploads).
	if first.Status/100 != 2 {
		var again fhResp
		if err := fhWaitFor(30*time.Second, 200*time.Millisecond, func() error {
			var err error
			if again, err = e.send(c.req); err != nil {
				return err
			}
			if again.Status == http.StatusServiceUnavailable {
				return fmt.Errorf("repeat: %s", again)
			}
			return nil
		}); err != nil {
			t.Fatalf("repeated once the bucket answers again: %v", err)
		}
		gone := c.req.Method == http.MethodDelete && (again.Status == http.StatusNotFound || again.Status == http.StatusGone)
		if again.Status/100 != 2 && !gone {
			t.Errorf("first %s, repeated %s", first, again)
		}
	}
	before := state()
	if !c.done(before) {
		t.Errorf("readers see %v", before)
	}
	// Nothing left behind that a later request trips on. (A producer's
	// append, so that a 503 may be repeated without a duplicate.)
	zHeader := map[string]string{"Content-Type": "text/plain", "Producer-Id": "z", "Producer-Epoch": "0", "Producer-Seq": "0"}
	if err := fhWaitFor(30*time.Second, 200*time.Millisecond, func() error {
		if r := e.must(fhReq{Method: http.MethodPut, Path: "/z", Header: map[string]string{"Content-Type": "text/plain"}}); r.Status/100 != 2 {
			return fmt.Errorf("create after: %s", r)
		}
		if r := e.must(fhReq{Method: http.MethodPost, Path: "/z", Header: zHeader, Body: []byte("z")}); r.Status/100 != 2 {
			return fmt.Errorf("append after: %s", r)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
	e.caddy.Kill()
	e.caddy.Restart()
	if after := state(); fmt.Sprint(after) != fmt.Sprint(before) {
		t.Errorf("readers disagree across a crash:\nbefore %v\nafter  %v", before, after)
	}
	if got := laState(e, "/z"); !strings.Contains(got, `body="z"`) {
		t.Errorf("/z after a crash: %s", got)
	}
}
