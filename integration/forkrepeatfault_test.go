package integration

import (
	"encoding/hex"
	"fmt"
	"net/http"
	"testing"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestForkRepeatWhoseSourceReadFails: through Caddy on versitygw, a fork
// made with a sub-offset past the end of its anchor's record is created
// again after a restart, with a tiny cache, while the bucket fails every
// read of records. Judging the repeat reads the source's records, so the
// answer is 503 with Retry-After; once reads go through, 200. It was 409,
// telling the client its own fork conflicts with it.
func TestForkRepeatWhoseSourceReadFails(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"s3_timeout " + fhS3Timeout.String(), "cache_size 1B"}})
	const src, fork = "/forkrepeat/src", "/forkrepeat/fork"
	e.create(src, textPlain)
	e.append(src, textPlain, []byte("abcd"))
	e.append(src, textPlain, []byte("efgh"))
	create := fhReq{Method: http.MethodPut, Path: fork, Header: map[string]string{
		"Stream-Forked-From": src, "Stream-Fork-Offset": fmt.Sprintf("%016d_%016d", 0, 0), "Stream-Fork-Sub-Offset": "6"}}
	if r := e.must(create); r.Status != http.StatusCreated {
		t.Fatalf("fork: %s, want 201", r)
	}
	e.caddy.Kill()
	e.caddy.Restart()

	var removes []func()
	for _, k := range []string{"/wal/", "/data/", "/pack/"} {
		removes = append(removes, e.proxy.AddFault(testenv.Fault{Op: testenv.OpGet, KeyContains: k, Status: http.StatusInternalServerError}))
	}
	r := e.must(create)
	for _, remove := range removes {
		remove()
	}
	if r.Status != http.StatusServiceUnavailable || r.Header.Get("Retry-After") == "" {
		t.Errorf("fork repeated while the source's records cannot be read: %s (Retry-After %q), want 503 with Retry-After", r, r.Header.Get("Retry-After"))
	}
	if r := e.must(create); r.Status != http.StatusOK {
		t.Errorf("fork repeated once reads go through: %s, want 200", r)
	}
}

// TestForkRepeatWhoseMetadataReadFails: through Caddy on versitygw, a
// fork create repeated after its source was deleted (forks still read it)
// and a restart, while the bucket fails reads of the fork's own metadata,
// is a 503: what holds the name is not known, so the source cannot judge
// the repeat. It was judged by the deleted source, a 409 for the client's
// own fork; once reads go through, 200.
func TestForkRepeatWhoseMetadataReadFails(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"s3_timeout " + fhS3Timeout.String()}})
	const src, fork = "/forkrepeatmeta/src", "/forkrepeatmeta/fork"
	e.create(src, textPlain)
	e.append(src, textPlain, []byte("abcd"))
	create := fhReq{Method: http.MethodPut, Path: fork, Header: map[string]string{
		"Stream-Forked-From": src, "Stream-Fork-Offset": fmt.Sprintf("%016d_%016d", 0, 1)}}
	if r := e.must(create); r.Status != http.StatusCreated {
		t.Fatalf("fork: %s, want 201", r)
	}
	if r := e.must(fhReq{Method: http.MethodDelete, Path: src}); r.Status != http.StatusNoContent {
		t.Fatalf("delete the source: %s", r)
	}
	e.caddy.Kill()
	e.caddy.Restart()

	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpGet, KeyContains: hex.EncodeToString([]byte(fork)) + ".m", Status: http.StatusInternalServerError})
	r := e.must(create)
	remove()
	if r.Status != http.StatusServiceUnavailable || r.Header.Get("Retry-After") == "" {
		t.Errorf("fork repeated while its metadata cannot be read: %s (Retry-After %q), want 503 with Retry-After", r, r.Header.Get("Retry-After"))
	}
	if r := e.must(create); r.Status != http.StatusOK {
		t.Errorf("fork repeated once reads go through: %s, want 200", r)
	}
}
