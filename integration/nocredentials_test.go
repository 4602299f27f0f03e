package integration

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// fakeIMDS serves the EC2 instance metadata paths the AWS SDK asks for
// credentials: a token, then the instance's role and its keys. With role
// "" the instance has none, and the role list answers 404 as on an
// instance without one (or on a host whose metadata address answers
// something else).
func fakeIMDS(t *testing.T, role, accessKey, secretKey string) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("PUT /latest/api/token", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Aws-Ec2-Metadata-Token-Ttl-Seconds", "21600")
		_, _ = w.Write([]byte("token"))
	})
	mux.HandleFunc("GET /latest/meta-data/iam/security-credentials/", func(w http.ResponseWriter, r *http.Request) {
		if role == "" {
			http.NotFound(w, r)
			return
		}
		_, _ = w.Write([]byte(role))
	})
	mux.HandleFunc("GET /latest/meta-data/iam/security-credentials/{role}", func(w http.ResponseWriter, r *http.Request) {
		if role == "" || r.PathValue("role") != role {
			http.NotFound(w, r)
			return
		}
		_ = json.NewEncoder(w).Encode(map[string]string{
			"Code":            "Success",
			"Type":            "AWS-HMAC",
			"AccessKeyId":     accessKey,
			"SecretAccessKey": secretKey,
			"Expiration":      time.Now().Add(6 * time.Hour).UTC().Format(time.RFC3339),
		})
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL
}

// TestNoCredentialsFailsTheStartSayingWhatIsMissing: an s3:// storage with
// no credentials anywhere (no AWS_* keys, no shared config, no instance
// role) fails Caddy's start with an error that names where credentials
// go, with the SDK's reason kept. Whether the metadata address answers
// without a role or does not answer at all, no retry can bring a key
// there: the chain was read when the store was opened.
func TestNoCredentialsFailsTheStartSayingWhatIsMissing(t *testing.T) {
	v := testenv.NewVersity(t)
	for _, tc := range []struct {
		name  string
		imds  func(t *testing.T) string
		cause string // the SDK's words, kept in the error
	}{
		{"the metadata service has no role", func(t *testing.T) string { return fakeIMDS(t, "", "", "") }, "no EC2 IMDS role found"},
		{"no metadata service", func(t *testing.T) string { return testenv.ClosedURL(t) }, "connection refused"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			storage := caddytest.S3Storage(t, v, v.Endpoint)
			c, err := caddytest.Launch(t, caddytest.Options{
				Storage: storage,
				Env: []string{
					"AWS_REGION=" + testenv.VersityRegion,
					// caddytest turns the metadata service off; this
					// test is about what the SDK does with it.
					"AWS_EC2_METADATA_DISABLED=false",
					"AWS_EC2_METADATA_SERVICE_ENDPOINT=" + tc.imds(t),
				},
				ReadyTimeout: 90 * time.Second,
			})
			if err == nil {
				c.Kill()
				t.Fatalf("Caddy started on a storage it has no credentials for; its log:\n%s", truncateTail(c.Logs(), 3000))
			}
			msg := err.Error()
			t.Logf("the start error: %s", truncateTail(msg, 2000))
			for _, want := range []string{"no AWS credentials", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "instance role", tc.cause} {
				if !strings.Contains(msg, want) {
					t.Errorf("the start error does not say %q:\n%s", want, truncateTail(msg, 3000))
				}
			}
		})
	}
}

// TestInstanceRoleCredentialsStillWork: with nothing in the environment,
// the EC2 instance role is where the credentials come from, and a role
// that is there opens the storage.
func TestInstanceRoleCredentialsStillWork(t *testing.T) {
	v := testenv.NewVersity(t)
	storage := caddytest.S3Storage(t, v, v.Endpoint)
	c := caddytest.Start(t, caddytest.Options{
		Storage: storage,
		Env: []string{
			"AWS_REGION=" + testenv.VersityRegion,
			"AWS_EC2_METADATA_DISABLED=false",
			"AWS_EC2_METADATA_SERVICE_ENDPOINT=" + fakeIMDS(t, "picomq-node", v.AccessKey, v.SecretKey),
		},
		ReadyTimeout: 90 * time.Second,
	})
	cl := newClient(t, c.URL(), true)
	cl.create(t, "/s", 30*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := cl.appendBody(ctx, "/s", []byte("x"))
	if err != nil {
		t.Fatal(err)
	}
	if r.status != http.StatusNoContent && r.status != http.StatusOK {
		t.Fatalf("append with the instance role's credentials: %s", r.String())
	}
}
