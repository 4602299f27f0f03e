package integration

import (
	"net/http"
	"strings"
	"testing"
)

// TestCreateRefusesAppendHeaders: through Caddy on versitygw, a create
// (PUT) that carries Stream-Seq or the producer headers is 400 and writes
// nothing. Section 5.2 defines them for appends only and section 5.1 gives
// a create none of them; taken without their check, a create's body was
// stored and the append that retried the same data with them stored it a
// second time.
func TestCreateRefusesAppendHeaders(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{})
	producer := []string{"Producer-Id", "w", "Producer-Epoch", "0", "Producer-Seq", "0"}
	tests := []struct {
		name  string
		path  string
		hdr   []string
		body  string
		names string // the headers the refusal names
	}{
		{"producer headers with a body", "/cah/p", producer, "first", "Producer-Id, Producer-Epoch, Producer-Seq"},
		{"producer headers without a body", "/cah/pe", producer, "", "Producer-Id, Producer-Epoch, Producer-Seq"},
		{"Stream-Seq with a body", "/cah/s", []string{"Stream-Seq", "001"}, "first", "Stream-Seq"},
		{"a lone Producer-Seq", "/cah/ps", []string{"Producer-Seq", "0"}, "first", "Producer-Seq"},
	}
	for _, tt := range tests {
		hdr := map[string]string{"Content-Type": "text/plain"}
		for i := 0; i+1 < len(tt.hdr); i += 2 {
			hdr[tt.hdr[i]] = tt.hdr[i+1]
		}
		resp, writes := fhExpectNoWrites(t, e, fhReq{Method: http.MethodPut, Path: tt.path, Header: hdr, Body: []byte(tt.body)})
		if resp.Status != http.StatusBadRequest || !strings.Contains(string(resp.Body), tt.names) {
			t.Errorf("%s: %s, want 400 naming %s", tt.name, resp, tt.names)
		}
		if len(writes) > 0 {
			t.Errorf("%s: the refused create wrote to the bucket: %s", tt.name, fhSortedKeys(writes))
		}
		if head := e.must(fhReq{Method: http.MethodHead, Path: tt.path}); head.Status != http.StatusNotFound {
			t.Errorf("%s: HEAD after the refused create: %s, want 404", tt.name, head)
		}
	}

	// The way that keeps a producer's retry safe: create without a body,
	// append the first data with POST, retry it; it is stored once.
	e.create("/cah/ok", "text/plain")
	post := map[string]string{"Content-Type": "text/plain", "Producer-Id": "w", "Producer-Epoch": "0", "Producer-Seq": "0"}
	for i, want := range []int{http.StatusOK, http.StatusNoContent} {
		if r := e.must(fhReq{Method: http.MethodPost, Path: "/cah/ok", Header: post, Body: []byte("first")}); r.Status != want {
			t.Errorf("producer append %d: %s, want %d", i, r, want)
		}
	}
	if got, _, err := e.readBytes("/cah/ok"); err != nil || string(got) != "first" {
		t.Errorf("the stream holds %q (%v), want %q", got, err, "first")
	}
}
