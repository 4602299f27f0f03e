package picomq

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// credSecret is the secret every storage URL of
// TestStorageCredentialsNeverShown carries, somewhere the URL syntax lets
// an operator write it.
const credSecret = "s3cr3tKEYxyz"

// TestStorageCredentialsNeverShown: whatever names a storage (a refused
// URL, the engine's log lines, the metrics labels) names it without the
// credentials its URL carries.
func TestStorageCredentialsNeverShown(t *testing.T) {
	withCreds := "s3://bkt/p?path_style=true&endpoint=http://AKIA:" + credSecret + "@127.0.0.1:1"
	s := testSettings()
	for _, tc := range []struct {
		name string
		urls []string // acquired in turn by one config, which then starts
		// want is in the error, which comes from the last acquire or, if
		// they all succeed, from the start.
		want string
	}{
		// Refused when the config loads: Caddy would show it whole in
		// its config dump. (Before that, it got as far as a start, and
		// two of them differing in credentials as far as the label.)
		{"credentials in the endpoint", []string{withCreds}, "credentials do not belong in the endpoint"},
		{"unparsable URL", []string{"s3://AKIA:" + credSecret + "^@bkt/p"}, "invalid userinfo"},
		{"credentials in the URL", []string{"s3://AKIA:" + credSecret + "@bkt/p"}, "credentials do not belong in the URL"},
		{"unsupported scheme", []string{"s4://AKIA:" + credSecret + "@bkt/p"}, "unsupported scheme"},
		{"file URL with a host", []string{"file://AKIA:" + credSecret + "@host/dir"}, "absolute path"},
		{"endpoint not http", []string{"s3://bkt/p?endpoint=ftp://AKIA:" + credSecret + "@host"}, "must be an http(s) URL"},
		{"endpoint without //", []string{"s3://bkt/p?endpoint=AKIA:" + credSecret + "@host:9000"}, "must be an http(s) URL"},
		{"http endpoint without //", []string{"s3://bkt/p?endpoint=http:AKIA:" + credSecret + "@host:9000"}, "must be an http(s) URL"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("XDG_DATA_HOME", t.TempDir())
			// A node id the start cannot read: a directory where the file goes.
			if err := os.MkdirAll(filepath.Join(nodeIDPath(), "x"), 0o700); err != nil {
				t.Fatal(err)
			}
			core, logs := observer.New(zapcore.DebugLevel)
			reg := prometheus.NewRegistry()
			app := &App{refs: make(map[string]*appEngine), log: zap.New(core), registry: reg}
			var err error
			for _, u := range tc.urls {
				if _, err = app.acquire(u, s); err != nil {
					break
				}
			}
			if err == nil {
				err = app.Start()
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one that says %q", err, tc.want)
			}
			if strings.Contains(err.Error(), credSecret) {
				t.Errorf("the error shows the secret: %v", err)
			}
			if err := app.Cleanup(); err != nil && strings.Contains(err.Error(), credSecret) {
				t.Errorf("the cleanup error shows the secret: %v", err)
			}
			for _, e := range logs.All() {
				if strings.Contains(e.Message, credSecret) {
					t.Errorf("logged the secret: %s", e.Message)
				}
				for k, v := range e.ContextMap() {
					if s, ok := v.(string); ok && strings.Contains(s, credSecret) {
						t.Errorf("logged the secret in %s: %s", k, s)
					}
				}
			}
			mfs, err := reg.Gather()
			if err != nil {
				var multi prometheus.MultiError
				if !errors.As(err, &multi) {
					t.Fatalf("gathering metrics: %v", err)
				}
			}
			for _, mf := range mfs {
				for _, m := range mf.GetMetric() {
					for _, l := range m.GetLabel() {
						if strings.Contains(l.GetValue(), credSecret) {
							t.Errorf("metric %s has the secret in its %s label: %s", mf.GetName(), l.GetName(), l.GetValue())
						}
					}
				}
			}
		})
	}
	// The storage key itself keeps the credentials: the label is what
	// hides them, so this test must go through everything that names a
	// storage rather than trust the key.
	if key, err := storageKey(withCreds); err != nil || !strings.Contains(key, credSecret) {
		t.Fatalf("storageKey(%q) = %q, %v: this test no longer covers credentials in the key", withCreds, key, err)
	}
}
