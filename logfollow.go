package picomq

import (
	"slices"
	"sync/atomic"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// logFollower hands out loggers that write through the logger of the config
// started last. A storage's engine (and its S3 client) outlives the config
// that first opened it; its logs must follow each reload's log settings,
// not go on writing to the outputs of a config Caddy cleaned up, whose
// files it closed, through filters the reload changed.
type logFollower struct {
	cur atomic.Pointer[zap.Logger]
}

func newLogFollower(l *zap.Logger) *logFollower {
	f := new(logFollower)
	f.cur.Store(l)
	return f
}

// follow makes every logger f handed out write through l from now on.
func (f *logFollower) follow(l *zap.Logger) { f.cur.Store(l) }

// logger returns a logger with the name and options of the current one
// that writes through whichever is current when it writes.
func (f *logFollower) logger() *zap.Logger {
	return f.cur.Load().WithOptions(zap.WrapCore(func(zapcore.Core) zapcore.Core { return followCore{f: f} }))
}

// followCore is the zapcore.Core of a follower's loggers: the current
// logger's core, with the fields added to the follower's logger.
type followCore struct {
	f      *logFollower
	fields []zapcore.Field
}

var _ zapcore.Core = followCore{}

func (c followCore) core() zapcore.Core {
	core := c.f.cur.Load().Core()
	if len(c.fields) > 0 {
		core = core.With(c.fields)
	}
	return core
}

func (c followCore) Enabled(l zapcore.Level) bool { return c.f.cur.Load().Core().Enabled(l) }

func (c followCore) With(fields []zapcore.Field) zapcore.Core {
	return followCore{f: c.f, fields: append(slices.Clip(c.fields), fields...)}
}

// Check hands the entry to the current core's Check, so that its filters
// (a log block's include and exclude) judge it, and the entry is written
// by that core.
func (c followCore) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	return c.core().Check(e, ce)
}

func (c followCore) Write(e zapcore.Entry, fields []zapcore.Field) error {
	return c.core().Write(e, fields)
}

func (c followCore) Sync() error { return c.f.cur.Load().Core().Sync() }
