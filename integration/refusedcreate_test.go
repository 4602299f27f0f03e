package integration

import (
	"bytes"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestRefusedCreateNamesTheCause: a create (or a delete) whose metadata object the
// bucket refuses for good (403) is answered 503 naming the refusal in
// both protocols, not as a write "not confirmed in time" nor a bare
// "storage unavailable". A create without records wrote nothing, whether
// or not the bucket lets the name be read back, and says so; one with
// records has them in the WAL and may still take effect, and says that a
// repeat is safe: once the bucket takes writes again, the repeat confirms
// the stream, which holds the records.
func TestRefusedCreateNamesTheCause(t *testing.T) {
	const text = "text/plain"
	e := picoStart(t, []string{"s3_timeout 30s", "compact_interval 1h"}, nil)
	message := map[string]func(t *testing.T, what string, r fhResp) string{
		"ds": func(t *testing.T, what string, r fhResp) string {
			t.Helper()
			picoWant(t, what, r, http.StatusServiceUnavailable, "Retry-After", "1", "Content-Type", "text/plain; charset=utf-8")
			return string(r.Body)
		},
		"pico": func(t *testing.T, what string, r fhResp) string {
			t.Helper()
			picoWant(t, what, r, http.StatusServiceUnavailable, "Retry-After", "1")
			body := picoWantError(t, what, r, http.StatusServiceUnavailable, "durability")
			msg, _ := body["message"].(string)
			return msg
		},
	}
	tests := []struct {
		name   string
		proto  string
		op     string // the requests on metadata objects refused: PUTs, or all
		body   []byte
		want   []string
		repeat bool // repeat the create once the fault is gone, and read the stream
	}{
		{"DS, PUT refused", "ds", testenv.OpPut, nil, []string{"nothing was written"}, false},
		{"Pico, PUT refused", "pico", testenv.OpPut, nil, []string{"nothing was written"}, false},
		{"DS, reads refused too", "ds", "", nil, []string{"nothing was written"}, false},
		{"Pico, reads refused too", "pico", "", nil, []string{"nothing was written"}, false},
		{"DS, with records", "ds", testenv.OpPut, []byte("first;"), []string{"may or may not take effect", "repeat it"}, true},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := "/" + tt.proto + "/refusedcreate/" + string(rune('a'+i))
			remove := e.proxy.AddFault(testenv.Fault{Op: tt.op, KeyContains: "streams/", Status: http.StatusForbidden})
			defer remove()
			msg := message[tt.proto](t, "create", picoDo(e, http.MethodPut, path, tt.body, "Content-Type", text))
			t.Logf("create: %q", msg)
			for _, want := range append([]string{"storage refuses writes: ", "AccessDenied (HTTP 403)"}, tt.want...) {
				if !strings.Contains(msg, want) {
					t.Errorf("create refused by the bucket: message %q does not say %q", msg, want)
				}
			}
			for _, wrong := range []string{"in time", "streams/"} {
				if strings.Contains(msg, wrong) {
					t.Errorf("create refused by the bucket: message %q says %q", msg, wrong)
				}
			}
			if !tt.repeat {
				return
			}
			remove()
			r := picoDo(e, http.MethodPut, path, tt.body, "Content-Type", text)
			for deadline := time.Now().Add(30 * time.Second); r.Status == http.StatusServiceUnavailable && time.Now().Before(deadline); {
				time.Sleep(50 * time.Millisecond)
				r = picoDo(e, http.MethodPut, path, tt.body, "Content-Type", text)
			}
			if r.Status/100 != 2 {
				t.Fatalf("create repeated once the bucket takes writes again: %s, want 2xx", r)
			}
			if got, _, err := e.readBytes(path); err != nil || !bytes.Equal(got, tt.body) {
				t.Errorf("the stream reads %q (%v), want the create's records %q", got, err, tt.body)
			}
		})
	}
	// A delete the bucket refuses (its gc record, or the metadata's
	// grave) changes nothing and says why; once the bucket takes writes
	// again the delete goes through.
	for _, proto := range []string{"ds", "pico"} {
		path := "/" + proto + "/refusedcreate/deleted"
		picoWant(t, proto+" create", picoDo(e, http.MethodPut, path, nil, "Content-Type", text), http.StatusCreated)
		for _, key := range []string{"gc/", "streams/"} {
			remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: key, Status: http.StatusForbidden})
			what := proto + " delete, PUT of " + key + " refused"
			msg := message[proto](t, what, picoDo(e, http.MethodDelete, path, nil))
			remove()
			t.Logf("%s: %q", what, msg)
			for _, want := range []string{"storage refuses writes: ", "AccessDenied (HTTP 403)", "nothing was written"} {
				if !strings.Contains(msg, want) {
					t.Errorf("%s: message %q does not say %q", what, msg, want)
				}
			}
		}
		if r := picoDo(e, http.MethodDelete, path, nil); r.Status/100 != 2 {
			t.Errorf("%s delete once the bucket takes writes again: %s, want 2xx", proto, r)
		}
	}
	// The warnings have the refusal's name: nothing here was slow.
	logs := e.caddy.Logs()
	if !strings.Contains(logs, `"msg":"storage refuses writes"`) {
		t.Error(`no "storage refuses writes" warning in the log`)
	}
	for _, wrong := range []string{"write not confirmed in time", "storage unavailable"} {
		if n := strings.Count(logs, `"msg":"`+wrong+`"`); n > 0 {
			t.Errorf("%d %q warnings for creates the bucket refused", n, wrong)
		}
	}
}
