package streamstore

import (
	"context"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

// A process that another of the same node id replaced (it took the lease
// at once, as a restart does) finds the lease the new owner's when it
// closes: there is nothing of its own to give up. That is how a
// replacement ends, not a failure of the close: it says so plainly, once,
// as a warning, and Close succeeds. It used to fail with "release lease:
// precondition failed", which Caddy logs as a cleanup error.
func TestCloseOfReplacedProcess(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	core, logs := observer.New(zapcore.DebugLevel)
	old := New(st, testConfig(Config{}), zap.New(core))
	if err := old.Start(ctx); err != nil {
		t.Fatal(err)
	}
	const name = "/replaced"
	if _, _, err := old.Create(ctx, name, CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	cur := startEngine(t, st, Config{}) // the same node id: at once

	if err := old.Close(ctx); err != nil {
		t.Errorf("close of the replaced process: %v, want nil", err)
	}
	var replaced int
	for _, e := range logs.All() {
		t.Logf("%s %s %v", e.Level, e.Message, e.ContextMap())
		if e.Level >= zapcore.ErrorLevel {
			t.Errorf("the replaced process's close logged at %s: %s", e.Level, e.Message)
		}
		if strings.Contains(e.Message, "replaced") {
			replaced++
			if e.Level != zapcore.WarnLevel {
				t.Errorf("the replacement is logged at %s, want warn", e.Level)
			}
		}
	}
	if replaced != 1 {
		t.Errorf("%d log lines say the process was replaced, want 1", replaced)
	}
	// The new owner was not disturbed by the close.
	if _, err := cur.Append(ctx, name, AppendRequest{Records: recs("after")}); err != nil {
		t.Errorf("the new owner's append after the old process closed: %v", err)
	}
}
