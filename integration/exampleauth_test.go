package integration

import (
	"encoding/base64"
	"fmt"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// exampleGuard returns the lines of an example Caddyfile between its site
// address and its picomq block (the guard in front of the module), with
// every bcrypt hash in it replaced by hash.
func exampleGuard(t *testing.T, file, hash string) string {
	t.Helper()
	body, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	s := string(body)
	// The site block opens on a line with an address, past any global
	// options block (a line that is "{" alone).
	site := regexp.MustCompile(`(?m)^[^\s{#][^\n]*\{\n`).FindStringIndex(s)
	end := strings.Index(s, "\tpicomq {")
	if site == nil || end < site[1] {
		t.Fatalf("%s: no site block with a picomq directive", file)
	}
	return regexp.MustCompile(`\$2a\$[0-9]+\$\S+`).ReplaceAllLiteralString(s[site[1]:end], hash)
}

// TestBasicAuthWritesExample runs the guard of
// examples/basic-auth-writes.Caddyfile through Caddy on versitygw: writes
// need the password, reads do not, and a pull-wake worker acks and releases
// with the module's bearer token alone. Before the example exempted those
// endpoints, basic_auth answered every ack 401, so no worker could finish a
// wake; the exemption must not open a stream named like them.
func TestBasicAuthWritesExample(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStartGuarded(t, nil, nil, exampleGuard(t, "../examples/basic-auth-writes.Caddyfile", readerHash))
	basic := []string{"Authorization", "Basic " + base64.StdEncoding.EncodeToString([]byte("writer:"+readerPassword))}
	const root = "/ds/v1/stream/"
	const sub = root + "__ds/subscriptions/p1"

	if st, _ := e.subCall("PUT", root+"events/a", ""); st != http.StatusUnauthorized {
		t.Fatalf("create without the password: %d, want 401", st)
	}
	for _, p := range []string{"events/a", "wake/pool", "events/x/__ack"} {
		if st, v := e.subCall("PUT", root+p, "", basic...); st != http.StatusCreated {
			t.Fatalf("create %s: %d %v", p, st, v)
		}
	}
	if st, v := e.subCall("PUT", sub, `{"type":"pull-wake","pattern":"events/*","wake_stream":"wake/pool"}`, basic...); st != http.StatusCreated {
		t.Fatalf("create subscription: %d %v", st, v)
	}
	// A subscription's document is its owner's: it shows a webhook's URL,
	// which often carries the receiver's secret in its path or query, and
	// which streams the subscription follows. Reading it needs the password
	// as changing it does; a browser's preflight does not.
	hook := root + "__ds/subscriptions/h1"
	if st, v := e.subCall("PUT", hook, `{"type":"webhook","pattern":"events/*","webhook":{"url":"https://hooks.example.com/T0/B0/s3cr3t"}}`, basic...); st != http.StatusCreated {
		t.Fatalf("create webhook subscription: %d %v", st, v)
	}
	for _, p := range []string{sub, hook, root + "__ds/subscriptions/nobody", "/ds/x/../v1/stream/__ds/subscriptions/h1"} {
		for _, m := range []string{http.MethodGet, http.MethodHead} {
			r := e.must(fhReq{Method: m, Path: p})
			if r.Status != http.StatusUnauthorized || strings.Contains(string(r.Body), "s3cr3t") {
				t.Errorf("%s %s without the password: %s, want 401", m, p, r)
			}
		}
	}
	if st, v := e.subCall("GET", hook, "", basic...); st != http.StatusOK || !strings.Contains(fmt.Sprint(v), "s3cr3t") {
		t.Errorf("GET the webhook subscription with the password: %d %v", st, v)
	}
	if r := e.must(fhReq{Method: http.MethodOptions, Path: hook, Header: map[string]string{"Origin": "https://app.example.com", "Access-Control-Request-Method": "GET"}}); r.Status != http.StatusNoContent {
		t.Errorf("preflight of the subscription without the password: %s, want 204", r)
	}
	if r := e.must(fhReq{Method: http.MethodGet, Path: root + "__ds/jwks.json"}); r.Status != http.StatusOK {
		t.Errorf("GET jwks.json without the password: %s, want 200 (receivers fetch it)", r)
	}
	for i := 0; i < 2; i++ {
		if st, v := e.subCall("POST", root+"events/a", `{"n":`+strconv.Itoa(i)+`}`, basic...); st/100 != 2 {
			t.Fatalf("append: %d %v", st, v)
		}
	}
	// Streams whose names end like the exempt endpoints stay guarded.
	for _, p := range []string{"events/x/__ack", "ack", "release"} {
		if st, _ := e.subCall("POST", root+p, `{"n":9}`); st != http.StatusUnauthorized {
			t.Errorf("append to %s without the password: %d, want 401", p, st)
		}
	}
	if err := e.waitWakes(root+"wake/pool", "p1", 1); err != nil {
		t.Fatalf("no wake for events/a (reads need no password): %v", err)
	}
	st, claim := e.subCall("POST", sub+"/claim", `{"worker":"w1"}`, basic...)
	if st != http.StatusOK {
		t.Fatalf("claim: %d %v", st, claim)
	}
	bearer := []string{"Authorization", "Bearer " + claim["token"].(string)}
	wake := `"wake_id":"` + claim["wake_id"].(string) + `","generation":` + strconv.Itoa(int(claim["generation"].(float64)))
	if st, v := e.subCall("POST", sub+"/ack", `{`+wake+`,"acks":[{"stream":"events/a","offset":"`+subOffset(2)+`"}]}`, bearer...); st != http.StatusOK {
		t.Fatalf("ack with the worker's token: %d %v, want 200", st, v)
	}
	if st, v := e.subCall("POST", sub+"/release", `{`+wake+`}`, bearer...); st != http.StatusNoContent {
		t.Fatalf("release with the worker's token: %d %v, want 204", st, v)
	}
	_, v := e.subCall("GET", sub, "", basic...)
	if got := v["streams"].([]any)[0].(map[string]any)["acked_offset"]; got != subOffset(2) {
		t.Fatalf("acked_offset after the worker's ack: %v, want %s", got, subOffset(2))
	}
}
