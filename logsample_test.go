package picomq

import (
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestSampledLog: of a run of failures of one kind, the first is logged,
// the rest of its interval held back, and the first after the interval
// says how many were; another kind has its own interval, and a nil
// sampler logs every line.
func TestSampledLog(t *testing.T) {
	core, logs := observer.New(zapcore.WarnLevel)
	log := zap.New(core)
	now := time.Unix(1_000_000, 0)
	s := newSampledLog(10 * time.Second)
	s.now = func() time.Time { return now }

	for range 100 {
		s.warn(log, "storage unavailable", zap.String("stream", "/a"))
		now = now.Add(50 * time.Millisecond) // 5 s in all
	}
	s.warn(log, "write not confirmed in time")
	now = now.Add(5 * time.Second)
	s.warn(log, "storage unavailable", zap.String("stream", "/b"))

	type line struct {
		msg    string
		stream any
		held   any
	}
	var got []line
	for _, e := range logs.All() {
		m := e.ContextMap()
		got = append(got, line{e.Message, m["stream"], m["similar_held_back"]})
	}
	want := []line{
		{"storage unavailable", "/a", nil},
		{"write not confirmed in time", nil, nil},
		{"storage unavailable", "/b", int64(99)},
	}
	if len(got) != len(want) {
		t.Fatalf("logged %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("line %d: %v, want %v", i, got[i], want[i])
		}
	}

	var none *sampledLog
	for range 3 {
		none.warn(log, "unsampled")
	}
	if n := logs.FilterMessage("unsampled").Len(); n != 3 {
		t.Errorf("a nil sampler logged %d of 3 lines", n)
	}
}
