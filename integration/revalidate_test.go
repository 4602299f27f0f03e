package integration

import (
	"net/http"
	"testing"
)

// TestRevalidationReplacesUpToDate: through Caddy on versitygw, a Pico
// page of count records that reaches the tail is not up to date once a
// record is appended, its range unchanged. A cache revalidating it with
// its ETag gets a 200 without Pico-Up-To-Date, not a 304: a 304 can add or
// replace a kept header, never drop one, so the kept "up to date" stayed
// for good. A GET of the bare stream URL, which is HEAD's URL too, is not
// cached, in either protocol: caches that fetch a HEAD as a GET would
// answer HEADs with its headers.
func TestRevalidationReplacesUpToDate(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, nil, nil)
	const path = "/pico/revalidate/s"
	picoWant(t, "create", picoDo(e, http.MethodPut, path, nil, "Content-Type", textPlain), http.StatusCreated)
	picoWant(t, "append a", picoDo(e, http.MethodPost, path, []byte("a"), "Content-Type", textPlain), http.StatusOK)
	page := path + "?seq=0&count=1"
	first := picoDo(e, http.MethodGet, page, nil)
	picoWant(t, "the page at the tail", first, http.StatusOK, "Pico-Up-To-Date", "true")
	tag := first.Header.Get("ETag")
	picoWant(t, "revalidated at the tail", picoDo(e, http.MethodGet, page, nil, "If-None-Match", tag), http.StatusNotModified)
	picoWant(t, "append b", picoDo(e, http.MethodPost, path, []byte("b"), "Content-Type", textPlain), http.StatusOK)
	picoWant(t, "revalidated after an append", picoDo(e, http.MethodGet, page, nil, "If-None-Match", tag), http.StatusOK,
		"Pico-Up-To-Date", "", "Pico-Next-Seq", "1")

	picoWant(t, "a Pico GET of the bare URL", picoDo(e, http.MethodGet, path, nil), http.StatusOK, "Cache-Control", "no-store")
	picoWant(t, "a Pico GET with seq", picoDo(e, http.MethodGet, path+"?seq=0", nil), http.StatusOK,
		"Cache-Control", "public, max-age=60, stale-while-revalidate=300")
	picoWant(t, "a Durable Streams GET of the bare URL", picoDo(e, http.MethodGet, "/ds/revalidate/s", nil), http.StatusOK, "Cache-Control", "no-store")
}
