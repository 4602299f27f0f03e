package integration

import (
	"net/http"
	"strings"
	"testing"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestCreateWhoseMetadataLandedDespiteARefusal: the bucket applies a
// create's metadata PUT (create-only) and then answers it with an error
// that normally means "not applied" (503 SlowDown, 409
// ConditionalRequestConflict, 429), as a gateway in front of the store can
// after forwarding the request. The store's retry then meets the
// create-only condition failing on the create's own object. That is no
// conflict: the create is answered 2xx with its body readable, or 5xx and
// done when repeated, never 409 Conflict, and never with its initial
// records dropped while the stream stays.
func TestCreateWhoseMetadataLandedDespiteARefusal(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	text := map[string]string{"Content-Type": "text/plain"}
	base := func(e *fhEnv) {
		e.create("/s", "text/plain")
		e.append("/s", "text/plain", []byte("a"))
	}
	c := laCase{name: "create-with-body", setup: base, req: fhReq{Method: http.MethodPut, Path: "/n", Header: text, Body: []byte("x")},
		paths: []string{"/n"}, done: func(s map[string]string) bool { return strings.Contains(s["/n"], `body="x"`) }}
	for _, status := range []int{http.StatusServiceUnavailable, http.StatusConflict, http.StatusTooManyRequests} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			t.Parallel()
			laRun(t, c, testenv.Fault{Op: testenv.OpPut, KeyContains: "/streams/", Status: status, AfterForward: true, Times: 1})
		})
	}
}
