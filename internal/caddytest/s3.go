package caddytest

import (
	"testing"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// S3Prefix is the key prefix S3Storage puts the module's objects under.
const S3Prefix = "picomq"

// S3Storage creates a fresh bucket on v for this test and returns the picomq
// storage URL for it, reached through endpointURL (v.Endpoint, or a
// testenv.Proxy's URL() to inject faults):
//
//	s3://BUCKET/picomq?region=us-east-1&path_style=true&endpoint=ENDPOINT
//
// The credentials are not in the URL: pass S3Env(v) as Options.Env.
func S3Storage(t testing.TB, v *testenv.Versity, endpointURL string) string {
	t.Helper()
	return testenv.StoreURL(endpointURL, v.NewBucket(t), S3Prefix)
}

// S3Env is the environment that gives the child Caddy v's credentials
// through the AWS SDK's standard chain, and for a server over TLS the
// authority that signed its certificate.
func S3Env(v *testenv.Versity) []string {
	region := v.Region
	if region == "" {
		region = testenv.VersityRegion
	}
	env := []string{
		"AWS_ACCESS_KEY_ID=" + v.AccessKey,
		"AWS_SECRET_ACCESS_KEY=" + v.SecretKey,
		"AWS_REGION=" + region,
	}
	if v.CAFile != "" {
		// The SDK's own setting for a private authority, as a user of an
		// S3-compatible store with an in-house certificate would set it.
		env = append(env, "AWS_CA_BUNDLE="+v.CAFile)
	}
	return env
}
