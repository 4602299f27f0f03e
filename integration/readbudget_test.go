package integration

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestCatchUpAnswersWithinItsTime: through Caddy on versitygw, a catch-up
// read from the start of a stream whose second data object the bucket
// takes 15 s to serve answers with the first object's record, not up to
// date, within Caddy's `write` timeout when one is set and within the
// module's 10 s catch-up budget when none is; the read after it gets the
// rest. It used to wait for every object of the answer: Caddy's write
// timeout cut the response, and without one the client (or a CDN in
// front) waited as long as the slowest object took.
func TestCatchUpAnswersWithinItsTime(t *testing.T) {
	t.Parallel() // waits on timers most of its run: beside the other such tests, not after them
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	for _, tc := range []struct {
		name  string
		write time.Duration // Caddy's write timeout; 0: none
	}{
		{"write timeout 3s", 3 * time.Second},
		{"no write timeout", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			v := testenv.NewVersity(t)
			p := newProxy(t, v)
			storage := caddytest.S3Storage(t, v, p.URL())
			global := ""
			if tc.write > 0 {
				global = fmt.Sprintf("\tservers {\n\t\ttimeouts {\n\t\t\twrite %v\n\t\t}\n\t}\n", tc.write)
			}
			caddyfile := fmt.Sprintf(siteGlobal, global) +
				"http://127.0.0.1:{$" + caddytest.PortEnv + "} {\n\tbind 127.0.0.1\n" +
				fmt.Sprintf("\thandle_path /ds/* {\n\t\tpicomq {\n\t\t\tstorage %q\n\t\t\tpack_below off\n\t\t\tmerge_below off\n\t\t\tcompact_interval 200ms\n\t\t}\n\t}\n", storage) +
				"}\n"
			c := caddytest.Start(t, caddytest.Options{Caddyfile: caddyfile, Env: caddytest.S3Env(v), ReadyTimeout: 90 * time.Second})
			tr := &http.Transport{DisableKeepAlives: true, DisableCompression: true}
			t.Cleanup(tr.CloseIdleConnections)
			sc := &siteClient{origin: c.URL(), hc: &http.Client{Transport: tr}}
			do := func(method, path string, body []byte) (*siteResp, error) {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				return sc.do(ctx, method, path, http.Header{"Content-Type": {textPlain}}, body)
			}
			const path = "/ds/budget"
			if r, err := do(http.MethodPut, path, nil); err != nil || r.status != http.StatusCreated {
				t.Fatalf("create: %v %v", r, err)
			}
			// Two data objects: each record compacted on its own.
			for i, body := range []string{"r0;", "r1;"} {
				if r, err := do(http.MethodPost, path, []byte(body)); err != nil || r.status/100 != 2 {
					t.Fatalf("append: %v %v", r, err)
				}
				if err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
					m, err := mGet(c.AdminAddr())
					if err != nil {
						return err
					}
					if n := m.sum("picomq_compaction_folds_total"); n < float64(i+1) {
						return fmt.Errorf("%v folds", n)
					}
					return nil
				}); err != nil {
					t.Fatalf("the append was not compacted: %v", err)
				}
			}
			c.Restart() // nothing cached
			// The second object, records [1, 2): data/<id>/<end>.<first>.
			remove := p.AddFault(testenv.Fault{Op: testenv.OpGet, KeyContains: "/00000000000000000002.00000000000000000001", Stall: 15 * time.Second})
			defer remove()
			began := time.Now()
			r, err := do(http.MethodGet, path+"?offset=-1", nil)
			took := time.Since(began)
			if err != nil {
				t.Fatalf("a catch-up whose second object is held (%v): %v", took.Round(100*time.Millisecond), err)
			}
			t.Logf("answered in %v: %v, Stream-Up-To-Date %q", took.Round(100*time.Millisecond), r, r.header.Get("Stream-Up-To-Date"))
			if r.status != http.StatusOK || string(r.body) != "r0;" || r.header.Get("Stream-Up-To-Date") != "" {
				t.Fatalf("a catch-up whose second object is held: %v; want 200 with r0; alone, not up to date", r)
			}
			if p.Counts().Faults == 0 {
				t.Fatal("the second object's GET was never held: the test checks nothing")
			}
			// The held GET goes on; once it lands, the next read from the
			// answer's offset gets the rest.
			next := r.header.Get("Stream-Next-Offset")
			remove()
			if err := fhWaitFor(30*time.Second, 500*time.Millisecond, func() error {
				r, err := do(http.MethodGet, path+"?offset="+next, nil)
				if err != nil || r.status != http.StatusOK || string(r.body) != "r1;" {
					return fmt.Errorf("%v %v", r, err)
				}
				return nil
			}); err != nil {
				t.Fatalf("the read from the answer's offset: %v; want r1;", err)
			}
			if tc.write == 0 {
				return
			}
			// A read that cannot even look the stream up (its metadata
			// held) before the write timeout is told so: 503, a read's
			// reason. It used to be cut with its connection.
			c.Restart()
			removeMeta := p.AddFault(testenv.Fault{Op: testenv.OpGet, KeyContains: "/streams/", Stall: 10 * time.Second})
			defer removeMeta()
			r, err = do(http.MethodGet, path+"?offset=-1", nil)
			if err != nil || r.status != http.StatusServiceUnavailable || !strings.Contains(string(r.body), "could not be read") {
				t.Fatalf("a read whose metadata is held past the write timeout: %v %v; want 503 saying it could not be read", r, err)
			}
		})
	}
}
