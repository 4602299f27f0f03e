package picomq

import (
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// A follower's loggers keep their names, fields and levels across the
// logger they write through, and each write goes where the follower points
// at that moment, judged by that logger's core (its level, and filters
// that look at the entry).
func TestLogFollower(t *testing.T) {
	core1, logs1 := observer.New(zapcore.InfoLevel)
	core2, logs2 := observer.New(zapcore.WarnLevel)
	f := newLogFollower(zap.New(core1).Named("picomq"))
	l := f.logger().Named("aws_sdk").With(zap.String("storage", "s"))

	l.Info("one")
	f.follow(zap.New(core2).Named("picomq"))
	l.Info("two") // below the second core's level
	l.Warn("three")

	for _, tc := range []struct {
		logs *observer.ObservedLogs
		want []string
	}{
		{logs1, []string{"one"}},
		{logs2, []string{"three"}},
	} {
		var got []string
		for _, e := range tc.logs.All() {
			got = append(got, e.Message)
			if e.LoggerName != "picomq.aws_sdk" || e.ContextMap()["storage"] != "s" {
				t.Errorf("%q: logger %q, fields %v; want picomq.aws_sdk with storage s", e.Message, e.LoggerName, e.ContextMap())
			}
		}
		if len(got) != len(tc.want) || (len(got) > 0 && got[0] != tc.want[0]) {
			t.Errorf("logged %v, want %v", got, tc.want)
		}
	}
}
