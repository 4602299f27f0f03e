package streamstore

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

// TestLeaseFailuresLogSparsely cuts the store off from the lease for a
// run of renewals and lets it back: the failures are warned of at the
// first few and ever more sparsely (not once each, which buried an
// outage's log in identical lines), and the renewal that succeeds again
// says so, with how many failed.
func TestLeaseFailuresLogSparsely(t *testing.T) {
	st := memstore.New()
	var cutOff atomic.Bool
	var failed atomic.Int64
	st.SetFail(func(op, key string) error {
		if cutOff.Load() && op == "PUT" && key == "lease" {
			failed.Add(1)
			return errors.New("store unreachable")
		}
		return nil
	})
	core, logs := observer.New(zapcore.DebugLevel)
	// Renewed every 100ms, and retried as often while it fails.
	e := New(st, testConfig(Config{LeaseTTL: 300 * time.Millisecond}), zap.New(core))
	if err := e.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close(context.Background()) })

	cutOff.Store(true)
	if waitUntil(15*time.Second, func() bool { return failed.Load() >= 6 }) != nil {
		t.Fatalf("%d lease renewals failed within 15s, want 6", failed.Load())
	}
	cutOff.Store(false)
	if waitUntil(10*time.Second, func() bool { return logs.FilterMessage("storage lease renewed again").Len() > 0 }) != nil {
		t.Errorf("no line says the lease was renewed again after %d failures", failed.Load())
	}
	n := failed.Load()
	want := 0
	for i := 1; i <= int(n); i++ {
		if leaseFailureLogged(i) {
			want++
		}
	}
	if warned := logs.FilterMessage("renew storage lease").Len(); warned != want {
		t.Errorf("%d failed renewals in a row gave %d warnings, want %d", n, warned, want)
	}
	if ok := logs.FilterMessage("storage lease renewed again").All(); len(ok) > 0 {
		if got := ok[0].ContextMap()["failures"]; got != n {
			t.Errorf("the renewal after the outage counts %v failures, want %d", got, n)
		}
	}
}

func TestLeaseFailureLogged(t *testing.T) {
	var logged []int
	for n := 1; n <= 130; n++ {
		if leaseFailureLogged(n) {
			logged = append(logged, n)
		}
	}
	want := []int{1, 2, 4, 8, 16, 32, 60, 64, 120, 128}
	if len(logged) != len(want) {
		t.Fatalf("failures logged: %v, want %v", logged, want)
	}
	for i := range want {
		if logged[i] != want[i] {
			t.Fatalf("failures logged: %v, want %v", logged, want)
		}
	}
}

// TestStartLogNamesTheWALNamespaceAsItsKeys: the "storage opened" line's
// namespace is spelled as the process's WAL keys spell it, so an operator
// can find them in a listing of the bucket.
func TestStartLogNamesTheWALNamespaceAsItsKeys(t *testing.T) {
	st := memstore.New()
	core, logs := observer.New(zapcore.InfoLevel)
	e := New(st, testConfig(Config{}), zap.New(core))
	if err := e.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close(context.Background()) })
	if _, _, err := e.Create(context.Background(), "/s", CreateRequest{ContentType: "text/plain", Records: []NewRecord{{Body: []byte("x")}}}); err != nil {
		t.Fatal(err)
	}
	opened := logs.FilterMessage("storage opened").All()
	if len(opened) != 1 {
		t.Fatalf("%d storage opened lines, want 1", len(opened))
	}
	ns, _ := opened[0].ContextMap()["namespace"].(string)
	objs, _, err := st.List(context.Background(), "wal/", "", 100)
	if err != nil {
		t.Fatal(err)
	}
	if len(objs) == 0 {
		t.Fatal("no WAL object after a create with a record")
	}
	for _, o := range objs {
		if !strings.HasPrefix(o.Key, "wal/"+ns+"/") {
			t.Errorf("WAL key %s is not under the namespace the log names (%q)", o.Key, ns)
		}
	}
}
