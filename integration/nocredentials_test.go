package integration

import (
	"context"
	"encoding/json"
	"net"
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
	srv := httptest.NewServer(imdsHandler(role, accessKey, secretKey))
	t.Cleanup(srv.Close)
	return srv.URL
}

// imdsHandler is fakeIMDS's service.
func imdsHandler(role, accessKey, secretKey string) http.Handler {
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
	return mux
}

// v1OnlyIMDS is fakeIMDS with IMDSv2 refused: its token request is
// answered 403, and the SDK falls back to IMDSv1, warning that it does.
func v1OnlyIMDS(t *testing.T, role, accessKey, secretKey string) string {
	t.Helper()
	mux := imdsHandler(role, accessKey, secretKey)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/latest/api/token" {
			http.Error(w, "Forbidden", http.StatusForbidden)
			return
		}
		mux.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// noRoleIMDS is a metadata service on an instance without a role.
func noRoleIMDS(t *testing.T) string { return fakeIMDS(t, "", "", "") }

// silentIMDS is a metadata address that takes connections and never
// answers them, as a host's firewall that swallows 169.254.169.254 looks
// to the SDK once its dial goes through. The connections are held until
// the test ends.
func silentIMDS(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
		}
	}()
	t.Cleanup(func() {
		l.Close()
		<-done
	})
	return "http://" + l.Addr().String()
}

// forbiddingIMDS answers every metadata request 403, as a metadata
// service does to a container beyond its hop limit.
func forbiddingIMDS(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "Forbidden", http.StatusForbidden)
	}))
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
	caddytest.BuildCaddy(t) // before the clock below starts
	for _, tc := range []struct {
		name  string
		imds  func(t *testing.T) string
		cause string   // the SDK's words, kept in the error
		env   []string // more of Caddy's environment
		hint  string   // what the error says of env
	}{
		{name: "the metadata service has no role", imds: noRoleIMDS, cause: "no EC2 IMDS role found"},
		{name: "no metadata service", imds: func(t *testing.T) string { return testenv.ClosedURL(t) }, cause: "connection refused"},
		// A host whose firewall drops packets to the metadata address,
		// or a metadata service in a hop-limited container.
		{name: "the metadata service never answers", imds: silentIMDS, cause: "context deadline exceeded"},
		{name: "the metadata service answers 403", imds: forbiddingIMDS, cause: "StatusCode: 403"},
		// The SDK takes keys from the environment only in pairs and
		// ignores half of one; its error then speaks of the instance
		// role alone.
		{name: "a key without its secret", imds: noRoleIMDS, cause: "no EC2 IMDS role found",
			env:  []string{"AWS_ACCESS_KEY_ID=AKIAEXAMPLE", "AWS_SECRET_ACCES_KEY=misspelt"},
			hint: "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not"},
		{name: "a secret without its key", imds: noRoleIMDS, cause: "no EC2 IMDS role found",
			env:  []string{"AWS_SECRET_ACCESS_KEY=s3cr3t"},
			hint: "AWS_SECRET_ACCESS_KEY is set but AWS_ACCESS_KEY_ID is not"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			storage := caddytest.S3Storage(t, v, v.Endpoint)
			began := time.Now()
			c, err := caddytest.Launch(t, caddytest.Options{
				Storage: storage,
				Env: append([]string{
					"AWS_REGION=" + testenv.VersityRegion,
					// caddytest turns the metadata service off; this
					// test is about what the SDK does with it.
					"AWS_EC2_METADATA_DISABLED=false",
					"AWS_EC2_METADATA_SERVICE_ENDPOINT=" + tc.imds(t),
				}, tc.env...),
				ReadyTimeout: 90 * time.Second,
			})
			if err == nil {
				c.Kill()
				t.Fatalf("Caddy started on a storage it has no credentials for; its log:\n%s", truncateTail(c.Logs(), 3000))
			}
			took := time.Since(began)
			// The SDK's metadata client gives up within seconds (short
			// dial and header timeouts, three attempts); a start that
			// took as long as Caddy is given would look hung.
			if took > 30*time.Second {
				t.Errorf("the start took %s to fail", took)
			}
			msg := err.Error()
			t.Logf("the start failed after %s: %s", took.Round(time.Millisecond), truncateTail(msg, 2000))
			for _, want := range []string{"no AWS credentials", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "instance role", tc.cause, tc.hint} {
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
	c := startWithInstanceRole(t, fakeIMDS)
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

// TestSDKWarningsInCaddysLog: the AWS SDK's own warnings, here its
// fallback to IMDSv1 when the metadata service refuses a token, are lines
// of Caddy's JSON log under picomq.aws_sdk, with the storage they concern.
// The SDK wrote them to stderr in its own plain-text format, which log
// collectors reading Caddy's JSON could neither parse nor filter.
func TestSDKWarningsInCaddysLog(t *testing.T) {
	c := startWithInstanceRole(t, v1OnlyIMDS)
	// The credentials were fetched, and the warning written, before the
	// storage answered this create.
	cl := newClient(t, c.URL(), true)
	cl.create(t, "/s", 30*time.Second)

	const warning = "falling back to IMDSv1"
	var found []map[string]any
	for _, line := range strings.Split(c.Logs(), "\n") {
		if !strings.Contains(line, warning) {
			continue
		}
		var entry map[string]any
		if err := json.Unmarshal([]byte(line), &entry); err != nil {
			t.Errorf("the SDK's warning is not a line of Caddy's JSON log: %s", line)
			continue
		}
		found = append(found, entry)
	}
	if len(found) == 0 {
		t.Fatalf("Caddy's log has no %q line:\n%s", warning, truncateTail(c.Logs(), 3000))
	}
	for _, e := range found {
		if e["logger"] != "picomq.aws_sdk" || e["level"] != "warn" || e["storage"] == nil {
			t.Errorf("the SDK's warning is logged as %v/%v with storage %v, want picomq.aws_sdk/warn with the storage: %v",
				e["logger"], e["level"], e["storage"], e)
		}
	}
}

// startWithInstanceRole starts Caddy on versitygw with no credentials in
// its environment but an instance metadata service, made by imds, that
// hands out versitygw's key pair as the role "picomq-node".
func startWithInstanceRole(t *testing.T, imds func(t *testing.T, role, key, secret string) string) *caddytest.Caddy {
	t.Helper()
	v := testenv.NewVersity(t)
	return caddytest.Start(t, caddytest.Options{
		Storage: caddytest.S3Storage(t, v, v.Endpoint),
		Env: []string{
			"AWS_REGION=" + testenv.VersityRegion,
			"AWS_EC2_METADATA_DISABLED=false",
			"AWS_EC2_METADATA_SERVICE_ENDPOINT=" + imds(t, "picomq-node", v.AccessKey, v.SecretKey),
		},
		ReadyTimeout: 90 * time.Second,
	})
}
