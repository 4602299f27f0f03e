package picomq

import (
	"fmt"

	"github.com/aws/smithy-go/logging"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// sdkLoggerName is the name, under the app's logger, of the AWS SDK's
// messages in Caddy's log: picomq.aws_sdk.
const sdkLoggerName = "aws_sdk"

// sdkLogger hands the AWS SDK's own messages (the S3 client's, the
// credential chain's) to Caddy's logger, where they are structured and
// filtered as the rest are; the SDK's default wrote them to stderr as
// plain text.
type sdkLogger struct{ log *zap.Logger }

// Logf implements logging.Logger.
func (l sdkLogger) Logf(c logging.Classification, format string, v ...any) {
	lvl := sdkLevel(c)
	if !l.log.Core().Enabled(lvl) {
		return
	}
	l.log.Log(lvl, fmt.Sprintf(format, v...))
}

// sdkLevel maps the SDK's classification of a message to a zap level. The
// SDK uses only Warn and Debug; anything else it may add is shown at info.
func sdkLevel(c logging.Classification) zapcore.Level {
	switch c {
	case logging.Warn:
		return zapcore.WarnLevel
	case logging.Debug:
		return zapcore.DebugLevel
	default:
		return zapcore.InfoLevel
	}
}
