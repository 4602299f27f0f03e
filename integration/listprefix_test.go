package integration

import (
	"encoding/json"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
)

// TestListPrefixLongerThanAnyName: a Pico listing whose prefix is longer
// than the longest stream name can match nothing, and is answered an empty
// page. Its key went to the store as a LIST prefix: the local-directory
// store refuses a key over 1,024 bytes, and the listing was answered 503
// "durability, retry" (a retry could never help) and logged and counted as
// a storage failure. On both stores the answer is 200 with no streams, and
// a prefix at the limit still lists the stream of that name.
func TestListPrefixLongerThanAnyName(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy")
	}
	store := filepath.Join(t.TempDir(), "store")
	fileCaddy := caddytest.Start(t, caddytest.Options{ReadyTimeout: 90 * time.Second, Caddyfile: "{\n\tpersist_config off\n}\n\nhttp://:{$" + caddytest.PortEnv + "} {\n\tbind 127.0.0.1\n" +
		"\thandle_path /pico/* {\n\t\tpicomq {\n\t\t\tstorage file://" + store + "\n\t\t\tprotocol pico\n\t\t}\n\t}\n}\n"})
	s3 := picoStart(t, nil, nil)
	client := &http.Client{Timeout: time.Minute}
	longest := "/" + strings.Repeat("n", 255) // at MaxNameLength
	for name, base := range map[string]string{"file": fileCaddy.URL(), "s3": s3.caddy.URL()} {
		t.Run(name, func(t *testing.T) {
			for _, p := range []string{"/pico/a", "/pico" + longest} {
				if r, err := fhSend(client, base, fhReq{Method: http.MethodPut, Path: p, Header: map[string]string{"Content-Type": textPlain}}); err != nil || r.Status != http.StatusCreated {
					t.Fatalf("PUT %s: %s %v", fhClip(p, 40), r, err)
				}
			}
			for _, c := range []struct {
				prefix string
				want   int
			}{
				{longest, 1},
				{longest + "n", 0},
				{"/" + strings.Repeat("p", 600), 0},
				{"/" + strings.Repeat("p", 3000), 0},
				{"/" + strings.Repeat("%C3%A9", 1000), 0},
			} {
				r, err := fhSend(client, base, fhReq{Method: http.MethodGet, Path: "/pico/?prefix=" + c.prefix})
				if err != nil {
					t.Fatal(err)
				}
				var page struct {
					Streams []struct{ Name string } `json:"streams"`
					HasMore bool                    `json:"has_more"`
				}
				if r.Status != http.StatusOK || json.Unmarshal(r.Body, &page) != nil || len(page.Streams) != c.want || page.HasMore {
					t.Errorf("list prefix of %d bytes: %s, want 200 with %d streams", len(c.prefix), r, c.want)
				}
			}
		})
	}
}
