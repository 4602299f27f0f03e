package integration

import (
	"net/http"
	"testing"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestCreateAfterADeleteOfUnknownOutcome: through Caddy on versitygw, a
// DELETE whose grave lands while every answer to it is lost, and whose
// read-back fails too, is a 503. Once the bucket answers again, the same
// client creates the name afresh: 201, an empty stream that takes the
// new records. The create was judged against the deleted stream still in
// memory: 200 "exists" (409 with another content type), and the next
// append 404.
func TestCreateAfterADeleteOfUnknownOutcome(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	for _, ct := range []string{textPlain, "application/json"} {
		t.Run(ct, func(t *testing.T) {
			t.Parallel()
			e := fhStart(t, fhOptions{Directives: []string{"s3_timeout " + fhS3Timeout.String()}})
			const path = "/unsure/s"
			e.create(path, textPlain)
			e.append(path, textPlain, []byte("old"))

			removePut := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "/streams/", Status: http.StatusInternalServerError, AfterForward: true})
			removeGet := e.proxy.AddFault(testenv.Fault{Op: testenv.OpGet, KeyContains: "/streams/", Status: http.StatusInternalServerError})
			del := e.must(fhReq{Method: http.MethodDelete, Path: path})
			removePut()
			removeGet()
			if del.Status != http.StatusServiceUnavailable {
				t.Fatalf("DELETE with every answer lost and no read-back: %s, want 503", del)
			}

			body := []byte("new")
			if ct == "application/json" {
				body = []byte(`"new"`)
			}
			hdr := map[string]string{"Content-Type": ct}
			if r := e.must(fhReq{Method: http.MethodPut, Path: path, Header: hdr}); r.Status != http.StatusCreated {
				t.Fatalf("create once the bucket answers again: %s, want 201 (the delete landed)", r)
			}
			if r := e.must(fhReq{Method: http.MethodPost, Path: path, Header: hdr, Body: body}); r.Status != http.StatusNoContent {
				t.Fatalf("append to the new stream: %s, want 204", r)
			}
			got, _, err := e.readBytes(path)
			want := "new"
			if ct == "application/json" {
				want = `["new"]`
			}
			if err != nil || string(got) != want {
				t.Errorf("read of the new stream: %q %v, want %q", got, err, want)
			}
		})
	}
}
