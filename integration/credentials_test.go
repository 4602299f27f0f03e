package integration

import (
	"strings"
	"testing"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestStorageURLCredentialsStayOutOfTheLog: a storage URL whose endpoint
// carries credentials and which cannot be opened (its bucket does not
// exist) fails Caddy's start, and neither the error nor Caddy's log shows
// the secret.
func TestStorageURLCredentialsStayOutOfTheLog(t *testing.T) {
	const secret = "s3cr3tKEYinURL"
	v := testenv.NewVersity(t)
	endpoint := strings.Replace(v.Endpoint, "://", "://AKIAEXAMPLE:"+secret+"@", 1)
	storage := testenv.StoreURL(endpoint, "picomq-no-such-bucket", caddytest.S3Prefix)
	c, err := caddytest.Launch(t, caddyOptions(v, storage))
	if err == nil {
		t.Fatal("Caddy started on a storage whose bucket does not exist")
	}
	if !strings.Contains(err.Error(), "starting storage") {
		t.Errorf("the start failed, but not on the storage:\n%s", truncateTail(err.Error(), 3000))
	}
	for what, text := range map[string]string{"the start error": err.Error(), "Caddy's log": c.Logs()} {
		for _, line := range strings.Split(text, "\n") {
			if strings.Contains(line, secret) {
				t.Errorf("%s shows the secret of the storage URL: %s", what, truncateTail(line, 2000))
			}
		}
	}
}
