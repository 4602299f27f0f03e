package picomq

import (
	"testing"

	"github.com/aws/smithy-go/logging"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestSDKLoggerLevels: each of the SDK's classifications lands at its zap
// level, formatted, under the logger's name.
func TestSDKLoggerLevels(t *testing.T) {
	for _, tc := range []struct {
		class logging.Classification
		want  zapcore.Level
	}{
		{logging.Warn, zapcore.WarnLevel},
		{logging.Debug, zapcore.DebugLevel},
		{"SOMETHING", zapcore.InfoLevel},
	} {
		t.Run(string(tc.class), func(t *testing.T) {
			core, logs := observer.New(zapcore.DebugLevel)
			l := sdkLogger{log: zap.New(core).Named("picomq").Named(sdkLoggerName)}
			l.Logf(tc.class, "falling back to %s: %v", "IMDSv1", 403)
			all := logs.All()
			if len(all) != 1 {
				t.Fatalf("%d entries, want 1", len(all))
			}
			e := all[0]
			if e.Level != tc.want || e.Message != "falling back to IMDSv1: 403" || e.LoggerName != "picomq.aws_sdk" {
				t.Errorf("got %v %q from %q, want %v %q from picomq.aws_sdk", e.Level, e.Message, e.LoggerName, tc.want, "falling back to IMDSv1: 403")
			}
		})
	}
	// Below the logger's level nothing is formatted or written.
	core, logs := observer.New(zapcore.InfoLevel)
	sdkLogger{log: zap.New(core)}.Logf(logging.Debug, "%v", "x")
	if logs.Len() != 0 {
		t.Errorf("a debug message was written at info level")
	}
}
