package segment

import (
	"context"
	"testing"

	"github.com/aws/smithy-go/logging"
)

// TestS3StoreSDKLogger: the SDK's own messages go to the logger the
// store is opened with, and nowhere without one; they went to stderr in
// the SDK's plain-text format. Request and response logging stays off.
func TestS3StoreSDKLogger(t *testing.T) {
	var got []string
	mine := logging.LoggerFunc(func(c logging.Classification, format string, v ...any) {
		got = append(got, string(c))
	})
	for _, tc := range []struct {
		name   string
		logger logging.Logger
		nop    bool
	}{
		{name: "none given", logger: nil, nop: true},
		{name: "given", logger: mine},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("AWS_EC2_METADATA_DISABLED", "true")
			loc := Location{Scheme: "s3", Bucket: "b", Region: "us-east-1", Endpoint: "http://127.0.0.1:1"}
			s, err := NewS3Store(context.Background(), loc, OpenOptions{AccessKeyID: "AKIA", SecretAccessKey: "s", Logger: tc.logger})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			o := s.client.Options()
			if o.ClientLogMode != 0 {
				t.Errorf("client log mode %v, want none", o.ClientLogMode)
			}
			if tc.nop {
				if _, ok := o.Logger.(logging.Nop); !ok {
					t.Errorf("with no logger given, the SDK logs to %T, want nowhere", o.Logger)
				}
				return
			}
			got = nil
			o.Logger.Logf(logging.Warn, "x")
			if len(got) != 1 || got[0] != "WARN" {
				t.Errorf("the SDK's logger did not reach the one given: %v", got)
			}
		})
	}
}
