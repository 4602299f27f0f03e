package integration

import (
	"encoding/json"
	"fmt"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
)

// TestFileListingPagesSeeChanges pages through Pico's GET / on file://
// storage, whose store keeps the sorted names of the folder a page ended
// in for the next page: streams created and deleted between pages show
// on the next page as they would had the folder been read again.
func TestFileListingPagesSeeChanges(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy")
	}
	store := filepath.Join(t.TempDir(), "store")
	c := caddytest.Start(t, caddytest.Options{ReadyTimeout: 90 * time.Second, Caddyfile: "{\n\tpersist_config off\n}\n\nhttp://:{$" + caddytest.PortEnv + "} {\n\tbind 127.0.0.1\n" +
		"\thandle_path /pico/* {\n\t\tpicomq {\n\t\t\tstorage file://" + store + "\n\t\t\tprotocol pico\n\t\t}\n\t}\n}\n"})
	client := &http.Client{Timeout: time.Minute}
	send := func(method, path string, want int) fhResp {
		t.Helper()
		r, err := fhSend(client, c.URL(), fhReq{Method: method, Path: path, Header: map[string]string{"Content-Type": textPlain}})
		if err != nil || r.Status != want {
			t.Fatalf("%s %s: %s %v, want %d", method, path, r, err, want)
		}
		return r
	}
	var want []string
	for i := range 12 {
		name := fmt.Sprintf("s%02d", i)
		send(http.MethodPut, "/pico/"+name, http.StatusCreated)
		want = append(want, "/"+name)
	}
	// Folders last written a minute ago: a folder written in the last
	// seconds is read afresh for every page, and nothing would be kept.
	old := time.Now().Add(-time.Minute)
	err := filepath.WalkDir(store, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return err
		}
		return os.Chtimes(path, old, old)
	})
	if err != nil {
		t.Fatal(err)
	}
	page := func(after string) ([]string, bool) {
		t.Helper()
		r := send(http.MethodGet, "/pico/?limit=4&start_after="+url.QueryEscape(after), http.StatusOK)
		var p struct {
			Streams []struct{ Name string } `json:"streams"`
			HasMore bool                    `json:"has_more"`
		}
		if err := json.Unmarshal(r.Body, &p); err != nil {
			t.Fatalf("page after %q: %s: %v", after, r, err)
		}
		var names []string
		for _, s := range p.Streams {
			names = append(names, s.Name)
		}
		return names, p.HasMore
	}
	got, more := page("")
	if !more || !slices.Equal(got, want[:4]) {
		t.Fatalf("first page %q more=%v, want %q and more", got, more, want[:4])
	}
	// Between the pages: one stream made among those still to come, one
	// of them deleted.
	send(http.MethodPut, "/pico/s03x", http.StatusCreated)
	send(http.MethodDelete, "/pico/s05", http.StatusNoContent)
	rest := []string{"/s03x", "/s04", "/s06", "/s07", "/s08", "/s09", "/s10", "/s11"}
	after := got[len(got)-1]
	got = nil
	for {
		names, more := page(after)
		got = append(got, names...)
		if !more {
			break
		}
		after = names[len(names)-1]
	}
	if !slices.Equal(got, rest) {
		t.Fatalf("later pages listed %q, want %q", got, rest)
	}
}
