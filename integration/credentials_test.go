package integration

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// credentialsEndpoint is endpoint with an access key and secret written
// into it, as an operator might.
func credentialsEndpoint(endpoint, secret string) string {
	return strings.Replace(endpoint, "://", "://AKIAEXAMPLE:"+secret+"@", 1)
}

// TestStorageURLCredentialsStayOutOfTheLog: a storage URL whose endpoint
// carries credentials and which cannot be opened (its bucket does not
// exist) fails Caddy's start, and neither the error nor Caddy's log shows
// the secret.
func TestStorageURLCredentialsStayOutOfTheLog(t *testing.T) {
	const secret = "s3cr3tKEYinURL"
	v := testenv.NewVersity(t)
	storage := testenv.StoreURL(credentialsEndpoint(v.Endpoint, secret), "picomq-no-such-bucket", caddytest.S3Prefix)
	c, err := caddytest.Launch(t, caddyOptions(v, storage))
	if err == nil {
		t.Fatal("Caddy started on a storage whose bucket does not exist")
	}
	noSecret(t, secret, map[string]string{"the start error": err.Error(), "Caddy's log": c.Logs()})
}

// TestStorageEndpointCredentialsRefused: an endpoint with credentials in
// it, on a bucket that exists, is refused when the config loads, saying
// where credentials go. Caddy keeps a loaded config as written and shows it
// whole (the admin API's /config/, autosave.json), so no redaction of ours
// could keep such a secret in; and the S3 SDK drops an endpoint's user
// information from its requests, so it never authenticated anything. If
// Caddy does start, the test reports where the secret shows: the config
// dump, and the answers and log lines of an append that an S3 fault makes
// fail.
func TestStorageEndpointCredentialsRefused(t *testing.T) {
	const secret = "s3cr3tKEYinURL"
	v := testenv.NewVersity(t)
	p := newProxy(t, v)
	storage := caddytest.S3Storage(t, v, credentialsEndpoint(p.URL(), secret))
	c, err := caddytest.Launch(t, caddyOptions(v, storage, "s3_timeout 1s"))
	if err != nil {
		if !strings.Contains(err.Error(), "credentials do not belong in the endpoint") {
			t.Errorf("the start failed, but not for the credentials:\n%s", truncateTail(err.Error(), 3000))
		}
		noSecret(t, secret, map[string]string{"the start error": err.Error(), "Caddy's log": c.Logs()})
		return
	}
	defer c.Kill()
	t.Errorf("Caddy started on a storage URL with credentials in its endpoint")
	seen := map[string]string{}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+c.AdminAddr()+"/config/", nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp, err := http.DefaultClient.Do(req); err == nil {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		seen["the admin API's /config/"] = string(b)
	}
	cl := newClient(t, c.URL(), false)
	cl.create(t, "/s", 30*time.Second)
	remove := p.AddFault(testenv.Fault{Op: "PUT", Reset: true})
	r, err := cl.appendBody(ctx, "/s", []byte("x"))
	remove()
	if err == nil {
		seen["the answer to an append whose upload failed"] = r.String()
	}
	seen["Caddy's log"] = c.Logs()
	noSecret(t, secret, seen)
}

// noSecret fails the test for every line of the texts that shows secret.
func noSecret(t *testing.T, secret string, texts map[string]string) {
	t.Helper()
	for what, text := range texts {
		for _, line := range strings.Split(text, "\n") {
			if strings.Contains(line, secret) {
				t.Errorf("%s shows the secret of the storage URL: %s", what, truncateTail(line, 2000))
			}
		}
	}
}

// TestSchemelessEndpointCredentialsStayOutOfTheLog: an endpoint with
// credentials but without "//" (the scheme forgotten, or its slashes) is
// no URL with a host; Caddy refuses to start, and neither the error nor its
// log shows the secret, which url.Parse takes for the URL's opaque part,
// not for user information to drop.
func TestSchemelessEndpointCredentialsStayOutOfTheLog(t *testing.T) {
	const secret = "s3cr3tKEYinURL"
	v := testenv.NewVersity(t)
	host := strings.TrimPrefix(v.Endpoint, "http://")
	for _, endpoint := range []string{"AKIAEXAMPLE:" + secret + "@" + host, "http:AKIAEXAMPLE:" + secret + "@" + host} {
		t.Run(endpoint[:4], func(t *testing.T) {
			storage := testenv.StoreURL(endpoint, "picomq-bucket", caddytest.S3Prefix)
			c, err := caddytest.Launch(t, caddyOptions(v, storage))
			if err == nil {
				t.Fatal("Caddy started on an endpoint that is no URL with a host")
			}
			if !strings.Contains(err.Error()+c.Logs(), "must be an http(s) URL") {
				t.Errorf("the start error does not say what the endpoint must be: %v", err)
			}
			noSecret(t, secret, map[string]string{"the start error": err.Error(), "Caddy's log": c.Logs()})
		})
	}
}
