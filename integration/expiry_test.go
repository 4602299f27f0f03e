package integration

import (
	"encoding/hex"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestExpirySweepDeletesUntouchedStreams creates streams with a short TTL,
// a near deadline, a TTL that reads keep renewing, a long TTL and no expiry
// at all, through Caddy on versitygw, and then never names the short-lived
// ones again: the sweep must take them out of the bucket on its own, keep
// the others (the renewed one for as long as it is read), and then take the
// renewed one too once the reads stop.
func TestExpirySweepDeletesUntouchedStreams(t *testing.T) {
	t.Parallel() // waits on timers most of its run: beside the other such tests, not after them
	// A short grave_time lets the collector finish with the deleted
	// streams (their graves, then their tombstones) inside the test.
	e := fhStart(t, fhOptions{Directives: []string{"expiry_sweep_interval 300ms", "compact_interval 1s", "grave_time 1s"}})
	const textPlain = "text/plain"
	streams := []struct {
		path   string
		header map[string]string
	}{
		{"/exp/ttl", map[string]string{"Stream-TTL": "2"}},
		{"/exp/deadline", map[string]string{"Stream-Expires-At": time.Now().Add(2 * time.Second).UTC().Format(time.RFC3339Nano)}},
		{"/exp/renewed", map[string]string{"Stream-TTL": "4"}},
		{"/exp/long", map[string]string{"Stream-TTL": "3600"}},
		{"/exp/forever", nil},
	}
	for _, s := range streams {
		hdr := map[string]string{"Content-Type": textPlain}
		for k, v := range s.header {
			hdr[k] = v
		}
		if r := e.must(fhReq{Method: http.MethodPut, Path: s.path, Header: hdr}); r.Status != http.StatusCreated {
			t.Fatalf("PUT %s: %s", s.path, r)
		}
		e.append(s.path, textPlain, []byte("x"))
	}
	if got := len(e.mustList("expiry/")); got != 4 {
		t.Fatalf("%d expiry markers in the bucket after the creates; want 4, one per stream that can expire", got)
	}

	// Read /exp/renewed every 300 ms (well inside its 4 s TTL, even on a
	// busy machine) until the two short-lived streams have left the bucket.
	began := time.Now()
	renew := func() {
		t.Helper()
		if r := e.must(fhReq{Method: http.MethodGet, Path: "/exp/renewed?offset=-1"}); r.Status != http.StatusOK {
			t.Fatalf("read of /exp/renewed while it is renewed: %s", r)
		}
	}
	for {
		renew()
		names := streamNamesInBucket(t, e)
		if !slices.Contains(names, "/exp/ttl") && !slices.Contains(names, "/exp/deadline") {
			t.Logf("the two expired streams left the bucket %v after their creates", time.Since(began).Round(time.Millisecond))
			break
		}
		if time.Since(began) > 30*time.Second {
			t.Fatalf("30 s after the creates the bucket still holds %v; the 2 s streams should be gone", names)
		}
		time.Sleep(300 * time.Millisecond)
	}
	// Two more TTLs of reads: the renewed stream must outlive them.
	for end := time.Now().Add(8 * time.Second); time.Now().Before(end); time.Sleep(300 * time.Millisecond) {
		renew()
	}
	names := streamNamesInBucket(t, e)
	for _, want := range []string{"/exp/renewed", "/exp/long", "/exp/forever"} {
		if !slices.Contains(names, want) {
			t.Errorf("%s is not in the bucket any more (bucket holds %v)", want, names)
		}
	}
	for _, p := range []string{"/exp/ttl", "/exp/deadline"} {
		if r := e.must(fhReq{Method: http.MethodGet, Path: p + "?offset=-1"}); r.Status != http.StatusNotFound {
			t.Errorf("GET %s after the sweep: %s, want 404", p, r)
		}
	}

	// Reads stop: the renewed stream goes too, and the deleted streams'
	// data with it (their tombstones are worked off).
	stopped := time.Now()
	for {
		names := streamNamesInBucket(t, e)
		tombstones := e.mustList("gc/")
		if !slices.Contains(names, "/exp/renewed") && len(tombstones) == 0 {
			t.Logf("/exp/renewed left the bucket, data included, %v after its last read", time.Since(stopped).Round(time.Millisecond))
			break
		}
		if time.Since(stopped) > 30*time.Second {
			t.Fatalf("30 s after the last read of /exp/renewed (TTL 4 s): bucket holds %v, %d tombstones", names, len(tombstones))
		}
		time.Sleep(300 * time.Millisecond)
	}
	if got := e.mustList("expiry/"); len(got) != 1 {
		t.Errorf("expiry markers left: %v; want only /exp/long's", got)
	}
	for _, p := range []string{"/exp/long", "/exp/forever"} {
		if got, _, err := e.readBytes(p); err != nil || string(got) != "x" {
			t.Errorf("%s after the sweeps: %q, %v", p, got, err)
		}
	}
}

// streamNamesInBucket lists the stream metadata objects straight from
// versitygw and decodes their names (keys are streams/<hex of name>.m, the
// hex cut into folders). A deleted stream's grave is not a stream.
func streamNamesInBucket(t *testing.T, e *fhEnv) []string {
	t.Helper()
	var names []string
	for _, o := range e.mustList("streams/") {
		h, ok := strings.CutSuffix(strings.TrimPrefix(o.Key, "streams/"), ".m")
		b, err := hex.DecodeString(strings.ReplaceAll(h, "/", ""))
		if !ok || err != nil {
			t.Fatalf("unexpected key in streams/: %q", o.Key)
		}
		if body, err := e.get(o.Key); err == nil && isGrave(body) {
			continue
		}
		names = append(names, string(b))
	}
	return names
}

// TestExpiredSourceOfAForkIsGone: a source that passes its
// Stream-Expires-At while a fork reads it is kept for the fork, soft-
// deleted: the request that finds it expired answers 410, as every later
// one does (it answered 404, and the next one 410), its name stays
// taken, and the fork reads on.
func TestExpiredSourceOfAForkIsGone(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	// No sweep in the test's time: the request finds the expiry.
	e := fhStart(t, fhOptions{Directives: []string{"expiry_sweep_interval 1h"}})
	const src, fork = "/expfork/src", "/expfork/fork"
	deadline := time.Now().Add(1500 * time.Millisecond)
	if r := e.must(fhReq{Method: http.MethodPut, Path: src, Body: []byte("hello"), Header: map[string]string{
		"Content-Type": textPlain, "Stream-Expires-At": deadline.UTC().Format(time.RFC3339Nano)}}); r.Status != http.StatusCreated {
		t.Fatalf("PUT %s: %s", src, r)
	}
	if r := e.must(fhReq{Method: http.MethodPut, Path: fork, Header: map[string]string{
		"Stream-Forked-From": src, "Stream-Expires-At": deadline.Add(time.Hour).UTC().Format(time.RFC3339Nano)}}); r.Status != http.StatusCreated {
		t.Fatalf("PUT %s: %s", fork, r)
	}
	time.Sleep(time.Until(deadline) + 50*time.Millisecond)
	for _, req := range []fhReq{
		{Method: http.MethodHead, Path: src},
		{Method: http.MethodGet, Path: src + "?offset=-1"},
		{Method: http.MethodPost, Path: src, Body: []byte("x"), Header: map[string]string{"Content-Type": textPlain}},
		{Method: http.MethodDelete, Path: src},
	} {
		if r := e.must(req); r.Status != http.StatusGone {
			t.Errorf("%s %s after the expiry: %s, want 410", req.Method, req.Path, r)
		}
	}
	if r := e.must(fhReq{Method: http.MethodPut, Path: src, Header: map[string]string{"Content-Type": textPlain}}); r.Status != http.StatusConflict {
		t.Errorf("PUT %s after the expiry: %s, want 409", src, r)
	}
	if got, _, err := e.readBytes(fork); err != nil || string(got) != "hello" {
		t.Errorf("the fork reads %q (%v)", got, err)
	}
}

// TestDeleteLeavesNoDeadlineMarker: a stream created with a
// Stream-Expires-At a year away and then deleted leaves no expiry marker
// in the bucket (it stayed until the deadline, when the sweep would have
// found nothing to expire).
func TestDeleteLeavesNoDeadlineMarker(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	const name = "/deadline/deleted"
	if r := e.must(fhReq{Method: http.MethodPut, Path: name, Header: map[string]string{
		"Content-Type": textPlain, "Stream-Expires-At": time.Now().Add(365 * 24 * time.Hour).UTC().Format(time.RFC3339)}}); r.Status != http.StatusCreated {
		t.Fatalf("PUT %s: %s", name, r)
	}
	if got := e.mustList("expiry/"); len(got) != 1 {
		t.Fatalf("expiry markers after the create: %v, want one", got)
	}
	if r := e.must(fhReq{Method: http.MethodDelete, Path: name}); r.Status != http.StatusNoContent {
		t.Fatalf("DELETE %s: %s", name, r)
	}
	if got := e.mustList("expiry/"); len(got) != 0 {
		t.Errorf("expiry markers after the delete: %v, want none", got)
	}
}

// TestLiveReadersEndAtTheDeadline: a long-poll and an SSE feed waiting at
// the tail of a stream whose Stream-Expires-At passes while they wait end
// then, through Caddy on versitygw: the long-poll answers 404 and the feed
// closes. They ran on to their own timeouts (the long-poll's 20 s here,
// the feed's minute) and, for a feed renewed by its client, until the
// sweep (every 5 minutes by default) deleted the stream, reading a stream
// that every other request found gone.
func TestLiveReadersEndAtTheDeadline(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"long_poll_timeout 20s"}})
	const name = "/deadline/live"
	const expiresIn = 2 * time.Second
	deadline := time.Now().Add(expiresIn)
	if r := e.must(fhReq{Method: http.MethodPut, Path: name, Header: map[string]string{
		"Content-Type": textPlain, "Stream-Expires-At": deadline.UTC().Format(time.RFC3339Nano)}}); r.Status != http.StatusCreated {
		t.Fatalf("PUT %s: %s", name, r)
	}
	tail := e.append(name, textPlain, []byte("x"))

	type ended struct {
		what string
		r    fhResp
		err  error
	}
	done := make(chan ended, 2)
	for _, live := range []string{"long-poll", "sse"} {
		go func() {
			r, err := e.send(fhReq{Method: http.MethodGet, Path: name + "?live=" + live + "&offset=" + tail})
			done <- ended{live, r, err}
		}()
	}
	for range 2 {
		select {
		case got := <-done:
			if got.err != nil {
				t.Errorf("%s: %v", got.what, got.err)
				continue
			}
			late := time.Since(deadline)
			t.Logf("%s ended %v after the deadline: %d", got.what, late.Round(time.Millisecond), got.r.Status)
			if late > 3*time.Second {
				t.Errorf("%s ended %v after the stream's deadline", got.what, late.Round(time.Millisecond))
			}
			if got.what == "long-poll" && got.r.Status != http.StatusNotFound {
				t.Errorf("long-poll past the deadline: %s, want 404", got.r)
			}
		case <-time.After(expiresIn + 15*time.Second):
			t.Fatalf("a live read still runs 15 s after its stream's deadline")
		}
	}
	if r := e.must(fhReq{Method: http.MethodGet, Path: name + "?offset=-1"}); r.Status != http.StatusNotFound {
		t.Errorf("read after the deadline: %s, want 404", r)
	}
}
