package segment

import (
	"errors"
	"strings"
	"testing"
)

// TestHalfKeyPair: half an access key pair in the environment, under any
// of the names the SDK reads, is named in the no-credentials error; a
// whole pair, or none, adds nothing.
func TestHalfKeyPair(t *testing.T) {
	for _, tc := range []struct {
		env  map[string]string
		want string
	}{
		{map[string]string{}, ""},
		{map[string]string{"AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "s"}, ""},
		{map[string]string{"AWS_ACCESS_KEY": "AKIA", "AWS_SECRET_KEY": "s"}, ""},
		{map[string]string{"AWS_ACCESS_KEY_ID": "AKIA"}, "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not"},
		{map[string]string{"AWS_ACCESS_KEY": "AKIA", "AWS_SECRET_ACCES_KEY": "typo"}, "AWS_ACCESS_KEY is set but AWS_SECRET_ACCESS_KEY is not"},
		{map[string]string{"AWS_SECRET_KEY": "s"}, "AWS_SECRET_KEY is set but AWS_ACCESS_KEY_ID is not"},
		{map[string]string{"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "s"}, "AWS_SECRET_ACCESS_KEY is set but AWS_ACCESS_KEY_ID is not"},
	} {
		got := halfKeyPair(func(k string) string { return tc.env[k] })
		if tc.want == "" && got != "" || !strings.HasPrefix(got, tc.want) {
			t.Errorf("env %v: %q, want %q", tc.env, got, tc.want)
		}
	}
	err := &NoCredentialsError{Err: errors.New("no EC2 IMDS role found"), Hint: "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not"}
	if msg := err.Error(); !strings.HasPrefix(msg, "no AWS credentials: AWS_ACCESS_KEY_ID is set but") ||
		!strings.HasSuffix(msg, "gave none: no EC2 IMDS role found") {
		t.Errorf("NoCredentialsError with a hint: %s", msg)
	}
}
