package picomq

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/picomq/caddy-picomq/internal/testenv"
	"github.com/picomq/caddy-picomq/segment"
	"github.com/picomq/caddy-picomq/streamstore"
)

func TestStorageKey(t *testing.T) {
	for _, group := range [][]string{
		{"file:///var/lib/x", "file:///var/lib/x/", "file://localhost/var/lib/x", "file:///var/lib/./x", "FILE:///var/lib/x"},
		{"s3://b/p?region=r&path_style=true", "s3://b/p/?path_style=true&region=r", "S3://b//p/?region=r&path_style=true"},
		// As the store's parser reads the parameters.
		{"s3://b/p?endpoint=http://h:9000&path_style=true", "s3://b/p?endpoint=http://h:9000/&path_style=1", "s3://b/p?path_style=TRUE&endpoint=http://h:9000//"},
	} {
		want, err := storageKey(group[0])
		if err != nil {
			t.Fatal(err)
		}
		for _, u := range group[1:] {
			if got, err := storageKey(u); err != nil || got != want {
				t.Errorf("storageKey(%q) = %q, %v; want %q", u, got, err, want)
			}
		}
	}
	a, _ := storageKey("s3://b/p?endpoint=http://one")
	b, _ := storageKey("s3://b/p?endpoint=http://two")
	if a == b {
		t.Error("different endpoints share a key")
	}
	// A path with a %, ? or # (escaped in the URL) keeps them in its key
	// and its label, and two such storages are two.
	for _, tc := range []struct{ url, label string }{
		{"file:///srv/a%25x", "file:///srv/a%25x"},
		{"file:///srv/b%25y", "file:///srv/b%25y"},
		{"file:///srv/q%3Fk=v", "file:///srv/q%3Fk=v"},
		{"file:///srv/h%23x", "file:///srv/h%23x"},
		{"s3://b/a%25x?region=r", "s3://b/a%25x?region=r"},
	} {
		k, err := storageKey(tc.url)
		if err != nil {
			t.Errorf("storageKey(%q): %v", tc.url, err)
			continue
		}
		if got := storageLabel(k); got != tc.label {
			t.Errorf("storageKey(%q) = %q, labelled %q; want %q", tc.url, k, got, tc.label)
		}
	}
	for _, bad := range []string{"", "b/p", "ftp://x/y", "s3:///p", "file://host/dir", "file:relative", "%zz", "s3://b/p#x", "file:///d#x"} {
		if k, err := storageKey(bad); err == nil {
			t.Errorf("storageKey(%q) = %q, want an error", bad, k)
		}
	}
}

func TestNodeID(t *testing.T) {
	p := filepath.Join(t.TempDir(), "deep", "node-id")
	id, err := loadNodeID(p)
	if err != nil || !validNodeID(id) || len(id) != 32 {
		t.Fatalf("first load: %q %v", id, err)
	}
	again, err := loadNodeID(p)
	if err != nil || again != id {
		t.Errorf("second load: %q %v, want %q", again, err, id)
	}
	if err := os.WriteFile(p, []byte("two words\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := loadNodeID(p); err == nil {
		t.Error("a corrupt node id was accepted")
	}
	if err := os.WriteFile(p, []byte("  operator-chosen-id \n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if id, err := loadNodeID(p); err != nil || id != "operator-chosen-id" {
		t.Errorf("operator id: %q %v", id, err)
	}
	left, _ := filepath.Glob(filepath.Join(filepath.Dir(p), ".node-id-*"))
	if len(left) != 0 {
		t.Errorf("temporary files left: %v", left)
	}
}

// TestNodeIDWithoutHardLinks: on a file system without hard links (the
// data directory on some network or FUSE mounts, which Caddy's own
// storage works on), the node id is created in place, once: the first
// start, even on s3:// storage, failed with "installing node id".
func TestNodeIDWithoutHardLinks(t *testing.T) {
	defer func(was func(string, string) error) { linkFile = was }(linkFile)
	linkFile = func(oldname, newname string) error {
		return &os.LinkError{Op: "link", Old: oldname, New: newname, Err: syscall.EPERM}
	}
	p := filepath.Join(t.TempDir(), "node-id")
	id, err := loadNodeID(p)
	if err != nil || len(id) != 32 {
		t.Fatalf("first load: %q %v", id, err)
	}
	if again, err := loadNodeID(p); err != nil || again != id {
		t.Errorf("second load: %q %v, want %q", again, err, id)
	}
	left, _ := filepath.Glob(filepath.Join(filepath.Dir(p), ".node-id-*"))
	if len(left) != 0 {
		t.Errorf("temporary files left: %v", left)
	}
}

func newTestApp(t *testing.T) *App {
	return &App{refs: make(map[string]*appEngine), log: zaptest.NewLogger(t)}
}

// testSettings are engine settings for tests of the app: appends flushed
// at once, a cache and batches large enough for any test, and no
// compaction within a test's time.
func testSettings() engineSettings {
	return engineSettings{FlushInterval: time.Millisecond, FlushSize: 1 << 20, CacheBytes: 1 << 20,
		CompactInterval: time.Hour, S3Timeout: time.Second}
}

// testStorage gives the test a Caddy data directory of its own
// (XDG_DATA_HOME) and returns the URL of a file storage of its own, both
// removed when the test ends.
func testStorage(t *testing.T) string {
	t.Helper()
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	return "file://" + t.TempDir()
}

// TestEngineSharedAcrossReload walks the lifecycle Caddy drives: a config
// provisions and starts, a reload provisions and starts a second config on
// the same storage before the first is cleaned up, and only the last
// cleanup closes the engine.
func TestEngineSharedAcrossReload(t *testing.T) {
	storage := testStorage(t)
	s1 := testSettings()
	ctx := context.Background()

	app1 := newTestApp(t)
	ref, err := app1.acquire(storage, s1)
	if err != nil {
		t.Fatal(err)
	}
	if again, err := app1.acquire(storage+"/", s1); err != nil || again != ref {
		t.Fatalf("second handler on the storage: %p %v (want %p)", again, err, ref)
	}
	s2 := s1
	s2.FlushInterval = 5 * time.Millisecond
	if _, err := app1.acquire(storage, s2); err == nil || !strings.Contains(err.Error(), "disagree") {
		t.Errorf("mismatched settings in one config: %v", err)
	}
	// Before Start, requests wait; a cancelled wait gives up.
	waitCtx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	if _, err := ref.engine(waitCtx, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("engine before start: %v", err)
	}
	cancel()
	if err := app1.Start(); err != nil {
		t.Fatalf("start: %v", err)
	}
	eng, err := ref.engine(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := eng.Create(ctx, "/s", streamstore.CreateRequest{ContentType: "text/plain"}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(nodeIDPath()); err != nil {
		t.Errorf("node id not written at start: %v", err)
	}

	// Reload: the new config gets the same engine, with its settings.
	app2 := newTestApp(t)
	ref2, err := app2.acquire(storage, s2)
	if err != nil || ref2 != ref {
		t.Fatalf("reload got %p, %v; want the running %p", ref2, err, ref)
	}
	if err := app2.Start(); err != nil {
		t.Fatal(err)
	}
	if ref.settings != s2 {
		t.Errorf("settings after reload %+v, want %+v", ref.settings, s2)
	}
	// Stopping the old config ends its live responses, not the engine.
	stopped := make(chan struct{})
	app1.onStop(func() { close(stopped) })
	if err := app1.Stop(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-stopped:
	default:
		t.Error("Stop did not end the config's live responses")
	}
	// A live waiter on the engine survives the old config's cleanup.
	waited := make(chan error, 1)
	go func() {
		_, err := eng.Wait(ctx, "/s", mustHead(t, eng, "/s").ID, 0)
		waited <- err
	}()
	if err := app1.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if _, err := eng.Append(ctx, "/s", streamstore.AppendRequest{Records: []streamstore.NewRecord{{Body: []byte("x")}}}); err != nil {
		t.Fatalf("append after the old config's cleanup: %v", err)
	}
	if err := <-waited; err != nil {
		t.Errorf("waiter: %v", err)
	}
	// The last cleanup closes it.
	if err := app2.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if _, err := eng.Wait(ctx, "/s", mustHead(t, eng, "/s").ID, 99); !errors.Is(err, streamstore.ErrShuttingDown) {
		t.Errorf("wait on a closed engine: %v", err)
	}
	if _, loaded := engines.References(ref.key); loaded {
		t.Error("the pool still holds the storage")
	}
}

func mustHead(t *testing.T, eng *streamstore.Engine, name string) streamstore.Info {
	t.Helper()
	info, err := eng.Head(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return info
}

func TestFailedStartIsReported(t *testing.T) {
	data := t.TempDir()
	t.Setenv("XDG_DATA_HOME", data)
	// A node id the start cannot read: a directory where the file goes.
	if err := os.MkdirAll(filepath.Join(nodeIDPath(), "x"), 0o700); err != nil {
		t.Fatal(err)
	}
	app := newTestApp(t)
	ref, err := app.acquire("file://"+t.TempDir(), engineSettings{S3Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := app.Start(); err == nil {
		t.Fatal("start succeeded")
	}
	_, err = ref.engine(context.Background(), nil)
	var se *storageStartError
	if !errors.As(err, &se) || !errors.Is(err, streamstore.ErrUnavailable) {
		t.Errorf("engine after a failed start: %v", err)
	}
	if err := app.Cleanup(); err != nil {
		t.Errorf("cleanup: %v", err)
	}
}

// TestFailedStartSaysItOnce: the error of a storage that cannot start
// (here, an unknown format) says where and why, naming the start once:
// it said "starting engine: start engine: ...".
func TestFailedStartSaysItOnce(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "format"), []byte("not a format"), 0o600); err != nil {
		t.Fatal(err)
	}
	app := newTestApp(t)
	if _, err := app.acquire("file://"+dir, engineSettings{S3Timeout: time.Second}); err != nil {
		t.Fatal(err)
	}
	err := app.Start()
	if err == nil {
		t.Fatal("start succeeded on a storage of an unknown format")
	}
	msg := err.Error()
	if !strings.HasPrefix(msg, "starting storage file://"+dir+": start engine: ") || strings.Count(msg, "start") != 2 {
		t.Errorf("start error %q, want \"starting storage %s: start engine: \" and the reason", msg, "file://"+dir)
	}
	if err := app.Cleanup(); err != nil {
		t.Errorf("cleanup: %v", err)
	}
}

func TestAppendTimeoutCoversRetries(t *testing.T) {
	s := engineSettings{FlushInterval: 10 * time.Millisecond, S3Timeout: time.Second}
	got := appendTimeout(s)
	if got < 2*s3Attempts*time.Second || got > 14*time.Second {
		t.Errorf("appendTimeout(1s) = %v", got)
	}
}

// TestFailedReloadKeepsEngineSettings: Caddy provisions a new config while
// the old one serves, and drops it if any module fails to provision or any
// app fails to start. The shared engine must run the settings of the newest
// config that started, so a reload that failed leaves the old ones in force
// and a successful one's settings survive the old config's cleanup.
func TestFailedReloadKeepsEngineSettings(t *testing.T) {
	storage := testStorage(t)
	s1 := testSettings()
	s2 := s1
	s2.FlushInterval = time.Second
	settings := func(ref *engineRef) engineSettings {
		ref.mu.Lock()
		defer ref.mu.Unlock()
		return ref.settings
	}

	app1 := newTestApp(t)
	ref, err := app1.acquire(storage, s1)
	if err != nil {
		t.Fatal(err)
	}
	if err := app1.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { app1.Cleanup() })

	for _, step := range []struct {
		name    string
		started bool // the new config's picomq app started before the load failed
	}{
		{"a later module failed to provision", false},
		{"another app failed to start", true},
	} {
		app2 := newTestApp(t)
		if _, err := app2.acquire(storage, s2); err != nil {
			t.Fatal(err)
		}
		if got := settings(ref); got != s1 {
			t.Errorf("%s: a provisioned config that has not started runs the engine with %+v, want %+v", step.name, got, s1)
		}
		if step.started {
			if err := app2.Start(); err != nil {
				t.Fatal(err)
			}
			if got := settings(ref); got != s2 {
				t.Errorf("%s: the started config's settings were not applied: %+v", step.name, got)
			}
			app2.Stop()
		}
		if err := app2.Cleanup(); err != nil {
			t.Fatal(err)
		}
		if got := settings(ref); got != s1 {
			t.Errorf("%s: after the failed reload the engine runs %+v, want the running config's %+v", step.name, got, s1)
		}
	}

	// A reload that succeeds keeps its settings past the old config's cleanup.
	app3 := newTestApp(t)
	if _, err := app3.acquire(storage, s2); err != nil {
		t.Fatal(err)
	}
	if err := app3.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { app3.Cleanup() })
	app1.Stop()
	if err := app1.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if got := settings(ref); got != s2 {
		t.Errorf("after a successful reload and the old config's cleanup the engine runs %+v, want %+v", got, s2)
	}
}

// TestOneStorageTwoURLsNamesTheOther: two handlers of one config reach one
// directory by two paths (a symlink), which the module takes for two
// storages. The second engine is refused at start, and the refusal names
// the URL the storage is open under, so the operator finds the other
// spelling.
func TestOneStorageTwoURLsNamesTheOther(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	dir := t.TempDir()
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	s := testSettings()
	app := newTestApp(t)
	t.Cleanup(func() { app.Cleanup() })
	for _, u := range []string{"file://" + dir, "file://" + link} {
		if _, err := app.acquire(u, s); err != nil {
			t.Fatal(err)
		}
	}
	err := app.Start()
	if !errors.Is(err, segment.ErrLeaseHeldHere) {
		t.Fatalf("start of one directory under two URLs: %v, want ErrLeaseHeldHere", err)
	}
	// Which of the two starts first is the map's choice.
	if msg := err.Error(); !strings.HasSuffix(msg, "open here as file://"+dir) && !strings.HasSuffix(msg, "open here as file://"+link) {
		t.Errorf("the refusal does not name the URL the storage is open under: %v", err)
	}
}

// TestReloadOfS3TimeoutOnly: a reload that changes only s3_timeout, which
// takes a restart, warns so and does not claim the engine's settings
// changed.
func TestReloadOfS3TimeoutOnly(t *testing.T) {
	storage := testStorage(t)
	s1 := testSettings()
	s2 := s1
	s2.S3Timeout = 3 * time.Second
	core, logs := observer.New(zapcore.InfoLevel)
	newApp := func() *App { return &App{refs: make(map[string]*appEngine), log: zap.New(core)} }

	app1 := newApp()
	t.Cleanup(func() { app1.Cleanup() })
	if _, err := app1.acquire(storage, s1); err != nil {
		t.Fatal(err)
	}
	if err := app1.Start(); err != nil {
		t.Fatal(err)
	}
	app2 := newApp()
	t.Cleanup(func() { app2.Cleanup() })
	ref, err := app2.acquire(storage, s2)
	if err != nil {
		t.Fatal(err)
	}
	if err := app2.Start(); err != nil {
		t.Fatal(err)
	}
	// Caddy cleans the old config up once the new one has started.
	app1.Cleanup()
	if got := logs.FilterMessageSnippet("s3_timeout changed").Len(); got != 1 {
		t.Errorf("%d warnings that s3_timeout takes a restart, want 1 (the old config's cleanup warned again)", got)
	}
	for _, e := range logs.FilterMessageSnippet("engine settings changed").All() {
		t.Errorf("a reload of s3_timeout alone logged %q %v", e.Message, e.ContextMap())
	}
	ref.mu.Lock()
	defer ref.mu.Unlock()
	if ref.settings != s1 {
		t.Errorf("the engine runs %+v, want %+v (s3_timeout unchanged until a restart)", ref.settings, s1)
	}
}

// TestReloadLogSaysWhatChanged: the line a reload's new settings get
// names what changed, from what to what, and shows every engine setting
// it can change, grave_time and expiry_sweep_interval included.
func TestReloadLogSaysWhatChanged(t *testing.T) {
	storage := testStorage(t)
	s1 := testSettings()
	s2 := s1
	s2.GraveTime = s1.GraveTime + 10*time.Minute
	core, logs := observer.New(zapcore.InfoLevel)
	newApp := func() *App { return &App{refs: make(map[string]*appEngine), log: zap.New(core)} }
	for _, s := range []engineSettings{s1, s2} {
		app := newApp()
		t.Cleanup(func() { app.Cleanup() })
		if _, err := app.acquire(storage, s); err != nil {
			t.Fatal(err)
		}
		if err := app.Start(); err != nil {
			t.Fatal(err)
		}
	}
	lines := logs.FilterMessage("engine settings changed by a config reload").All()
	if len(lines) != 1 {
		t.Fatalf("%d lines say the reload changed the settings, want 1", len(lines))
	}
	fields := lines[0].ContextMap()
	wantChanged := fmt.Sprintf("grave_time from %v to %v", s1.GraveTime, s2.GraveTime)
	if fields["changed"] != wantChanged {
		t.Errorf("changed = %q, want %q", fields["changed"], wantChanged)
	}
	for name, want := range map[string]any{"grave_time": s2.GraveTime, "expiry_sweep_interval": s2.ExpirySweep} {
		if fields[name] != want {
			t.Errorf("%s = %v, want %v (fields %v)", name, fields[name], want, fields)
		}
	}
}

// TestSettingsDiffNamesEveryField: handlers of one storage that disagree
// are told on which setting, whichever it is.
func TestSettingsDiffNamesEveryField(t *testing.T) {
	var a engineSettings
	typ := reflect.TypeOf(a)
	for i := 0; i < typ.NumField(); i++ {
		b := a
		f := reflect.ValueOf(&b).Elem().Field(i)
		f.SetInt(f.Int() + 1)
		if d := settingsDiff(a, b); strings.Count(d, " in one, ") != 1 {
			t.Errorf("settings differing in %s only: diff %q, want that one setting named", typ.Field(i).Name, d)
		}
	}
	b := a
	b.FlushInterval, b.CacheBytes = 5*time.Millisecond, 1<<20
	if d, want := settingsDiff(a, b), "flush_interval (0s in one, 5ms in another), cache_size (0 in one, 1048576 in another)"; d != want {
		t.Errorf("diff %q, want %q", d, want)
	}
}

// TestShortGraveTimeWarnsOnS3: a grave_time under S3's signing window is
// accepted (a store that refuses late requests sooner may want it) but
// warned about, once per S3 storage; a file storage, whose writes do not
// travel, is not.
func TestShortGraveTimeWarnsOnS3(t *testing.T) {
	file := testStorage(t)
	const s3 = "s3://grave-bkt/p?endpoint=http://127.0.0.1:1&region=us-east-1"
	for _, tc := range []struct {
		name    string
		storage string
		grave   time.Duration
		warns   int
	}{
		{"s3, 5m", s3, 5 * time.Minute, 1},
		{"s3, 15m", s3, 15 * time.Minute, 0},
		{"s3, default", s3, defaultGraveTime, 0},
		{"file, 5m", file, 5 * time.Minute, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			core, logs := observer.New(zapcore.WarnLevel)
			app := &App{refs: make(map[string]*appEngine), log: zap.New(core)}
			t.Cleanup(func() { app.Cleanup() })
			s := testSettings()
			s.GraveTime = tc.grave
			for i := 0; i < 2; i++ { // a second handler of the storage warns no more
				if _, err := app.acquire(tc.storage, s); err != nil {
					t.Fatal(err)
				}
			}
			if got := logs.FilterMessageSnippet("grave_time is shorter").Len(); got != tc.warns {
				t.Errorf("%d warnings, want %d", got, tc.warns)
			}
		})
	}
}

// TestShortGraveTimeByReloadWarns: a reload that brings an S3 storage's
// grave_time under the signing window warns as a start with it does; one
// that leaves it as it was does not warn again. A reload used to warn of
// nothing, the running engine being no new one.
func TestShortGraveTimeByReloadWarns(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	core, logs := observer.New(zapcore.WarnLevel)
	// The engine is not started (the endpoint answers nothing): a reload's
	// settings reach it all the same, and are what the warning is about.
	const s3 = "s3://grave-bkt/p?endpoint=http://127.0.0.1:1&region=us-east-1"
	warnings := func() int { return logs.FilterMessageSnippet("grave_time is shorter").Len() }
	var ref *engineRef
	for i, grave := range []time.Duration{defaultGraveTime, 5 * time.Minute, 5 * time.Minute} {
		app := &App{refs: make(map[string]*appEngine), log: zap.New(core)}
		t.Cleanup(func() { app.Cleanup() })
		s := testSettings()
		s.GraveTime = grave
		var err error
		if ref, err = app.acquire(s3, s); err != nil {
			t.Fatal(err)
		}
		ref.activate(app) // what Start does before it opens the storage
		if want := min(i, 1); warnings() != want {
			t.Errorf("after config %d (grave_time %s): %d warnings, want %d", i+1, grave, warnings(), want)
		}
	}
}

// TestUnreachableStartRetriesUntilCleanup: a store nobody listens on does
// not fail the start; requests get the reason at once, the start is
// retried in the background, and Cleanup ends the retries (the goroutine
// would otherwise outlive the config, retrying a store no config uses).
func TestUnreachableStartRetriesUntilCleanup(t *testing.T) {
	app, ref := unreachableStorage(t, "unreachable")
	if err := app.Start(); err != nil {
		t.Fatalf("start with the store unreachable: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	began := time.Now()
	_, err := ref.engine(ctx, nil)
	var se *storageStartError
	if !errors.As(err, &se) || !se.retrying || !errors.Is(err, streamstore.ErrUnavailable) ||
		!strings.Contains(err.Error(), "connection refused") {
		t.Errorf("engine while the store is unreachable: %v", err)
	}
	if waited := time.Since(began); waited > time.Second {
		t.Errorf("engine waited %v to say the store is unreachable", waited)
	}
	select {
	case <-ref.retryDone:
		t.Fatal("the retries ended while a config still uses the storage")
	default:
	}
	if err := app.Cleanup(); err != nil {
		t.Errorf("cleanup: %v", err)
	}
	select {
	case <-ref.retryDone:
	case <-time.After(5 * time.Second):
		t.Fatal("the retries went on after the last config let go of the storage")
	}
}

// TestStorageStartErrorReason: a client is told that the store cannot be
// reached, without the transport's error that names its address, while
// the start is retried; a refusal, and a start that failed for good, keep
// their reason.
func TestStorageStartErrorReason(t *testing.T) {
	refused := &net.OpError{Op: "dial", Net: "tcp",
		Addr: &net.TCPAddr{IP: net.IPv4(10, 1, 2, 3), Port: 9000}, Err: errors.New("connect: connection refused")}
	unreachable := fmt.Errorf("start engine: read lease: get http://10.1.2.3:9000/bkt/lease: %w", refused)
	held := fmt.Errorf("start engine: %w: node n2 holds it", segment.ErrLeaseHeld)
	for _, tc := range []struct {
		name     string
		err      *storageStartError
		want     string // the client's answer contains it
		mustNot  string // and does not contain it
		logWants string // the error, as logged, contains it
	}{
		{"unreachable, retrying", &storageStartError{err: unreachable, retrying: true},
			unreachableReason, "10.1.2.3", "10.1.2.3:9000"},
		{"refused, retrying", &storageStartError{err: held, retrying: true},
			"storage is not open yet (retrying): start engine: storage is in use by another PicoMQ node: node n2", "", "node n2"},
		{"failed for good", &storageStartError{err: held},
			"storage could not be opened: start engine: storage is in use", "", "node n2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := tc.err.reason()
			if !strings.Contains(got, tc.want) || (tc.mustNot != "" && strings.Contains(got, tc.mustNot)) {
				t.Errorf("reason() = %q, want it to contain %q and not %q", got, tc.want, tc.mustNot)
			}
			if !strings.Contains(tc.err.Error(), tc.logWants) {
				t.Errorf("Error() = %q lost %q", tc.err.Error(), tc.logWants)
			}
		})
	}
}

// TestUnreachableStoreFailsAReload: while a config runs, a new storage
// that cannot be reached fails the reload at once, with the reason, and
// nothing retries it: the running config goes on serving.
func TestUnreachableStoreFailsAReload(t *testing.T) {
	running := configRunning
	configRunning = func() bool { return true }
	t.Cleanup(func() { configRunning = running })
	app, ref := unreachableStorage(t, "reload")
	err := app.Start()
	if err == nil || !strings.Contains(err.Error(), "starting storage") || !strings.Contains(err.Error(), "connection refused") {
		t.Errorf("reload with the store unreachable: %v, want it to fail with the reason", err)
	}
	select {
	case <-ref.retryDone:
	default:
		t.Error("the start of a failed reload is retried in the background")
	}
	if err := app.Cleanup(); err != nil {
		t.Errorf("cleanup: %v", err)
	}
}

// unreachableStorage is an app, not started, using an s3:// storage (under
// prefix) whose endpoint is a local port nobody listens on.
func unreachableStorage(t *testing.T, prefix string) (*App, *engineRef) {
	t.Helper()
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("AWS_ACCESS_KEY_ID", "k")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "s")
	app := newTestApp(t)
	ref, err := app.acquire("s3://bkt/"+prefix+"?region=us-east-1&path_style=true&endpoint="+testenv.ClosedURL(t),
		engineSettings{S3Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return app, ref
}

// A start that found the lease held tries again just after the lease
// would lapse, and at least every standbyPoll; an unreachable store backs
// off as before.
func TestRetryWait(t *testing.T) {
	now := time.Now()
	held := func(in time.Duration) error {
		return fmt.Errorf("start engine: %w", &segment.LeaseHeldError{Node: "other", Until: now.Add(in)})
	}
	tests := []struct {
		name     string
		err      error
		delay    time.Duration
		min, max time.Duration
	}{
		{"lease lapses in 1s", held(time.Second), openRetryMax, time.Second + leaseLapseMargin, time.Second + 2*leaseLapseMargin},
		{"lease lapsed already", held(-time.Second), openRetryMax, leaseLapseMargin, leaseLapseMargin},
		{"lease held for long", held(time.Minute), openRetryMin, standbyPoll, standbyPoll},
		{"held, no expiry known", fmt.Errorf("start engine: %w", segment.ErrLeaseHeld), openRetryMax, standbyPoll / 2, standbyPoll},
		{"store unreachable", errors.New("dial tcp: connection refused"), 8 * time.Second, 4 * time.Second, 8 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if !errors.Is(tt.err, segment.ErrLeaseHeld) && strings.Contains(tt.name, "lease") {
				t.Fatalf("%v is not ErrLeaseHeld", tt.err)
			}
			for range 50 {
				if got := retryWait(tt.err, tt.delay, now); got < tt.min || got > tt.max {
					t.Fatalf("retryWait = %v, want within [%v, %v]", got, tt.min, tt.max)
				}
			}
		})
	}
}

// A start's backoff doubles while the store cannot be reached and starts
// over when an attempt reached it and found the lease held: a standby's
// looks at a held lease once doubled it to 30 s, and its first look that
// met a blip of the store then waited 15 to 30 s.
func TestNextRetryDelay(t *testing.T) {
	held := fmt.Errorf("start engine: %w", &segment.LeaseHeldError{Node: "other", Until: time.Now()})
	unreachable := errors.New("dial tcp: connection refused")
	tests := []struct {
		name        string
		err         error
		delay, want time.Duration
	}{
		{"unreachable doubles", unreachable, 2 * time.Second, 4 * time.Second},
		{"unreachable stops at the cap", unreachable, openRetryMax, openRetryMax},
		{"held starts over", held, openRetryMax, openRetryMin},
		{"held, no expiry known, starts over", fmt.Errorf("start engine: %w", segment.ErrLeaseHeld), 8 * time.Second, openRetryMin},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := nextRetryDelay(tt.err, tt.delay); got != tt.want {
				t.Errorf("nextRetryDelay(%v, %v) = %v, want %v", tt.err, tt.delay, got, tt.want)
			}
		})
	}
	// A standby's many looks at a held lease, then one that cannot reach
	// the store: the next try comes within two seconds.
	delay := openRetryMin
	for range 20 {
		delay = nextRetryDelay(held, delay)
	}
	delay = nextRetryDelay(unreachable, delay)
	for range 50 {
		if w := retryWait(unreachable, delay, time.Now()); w > 2*openRetryMin {
			t.Fatalf("after 20 looks at a held lease and one unreachable store, the next try waits %v, want at most %v", w, 2*openRetryMin)
		}
	}
}

// The lines of a retried start name its wait after what it waited for: a
// standby waits for another node's lease, which the five-minute warning
// used to call being unreachable while the line ending it said waited_for.
func TestRetriedStartLines(t *testing.T) {
	leaseHeld := fmt.Errorf("start engine: %w", &segment.LeaseHeldError{Node: "other", Until: time.Now()})
	unreachable := errors.New("dial tcp: connection refused")
	tests := []struct {
		name       string
		line       func(error, time.Duration) (string, zap.Field)
		err        error
		msg, field string
	}{
		{"warning, lease held", stillNotOpen, leaseHeld, "in use by another node", "waited_for"},
		{"warning, unreachable", stillNotOpen, unreachable, "still not open", "unreachable_for"},
		{"opened, lease was held", openedAfter, leaseHeld, "another node let go of it", "waited_for"},
		{"opened, was unreachable", openedAfter, unreachable, "after being unreachable", "unreachable_for"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			msg, f := tt.line(tt.err, 5*time.Minute)
			if !strings.Contains(msg, tt.msg) || f.Key != tt.field || time.Duration(f.Integer) != 5*time.Minute {
				t.Errorf("got %q with %s=%v, want %q with %s=5m0s", msg, f.Key, time.Duration(f.Integer), tt.msg, tt.field)
			}
		})
	}
}

// TestLoopbackOptionTakesEffectAtStart: allow_loopback_webhooks lets a
// storage's loopback subscriptions be delivered to this machine, and a
// reload that turns it off stops them. Caddy provisions a new config while
// the old one serves and drops it if a later module fails to provision or
// an app fails to start (a new storage that cannot be reached holds a
// reload's start for up to 5 × s3_timeout). A config that turned the
// option on used to count from its provisioning, so loopback deliveries
// went out all the while a reload that would fail was being loaded, under
// a running config that has the option off. Like the engine settings, it
// now takes effect when the config starts, and ends with its cleanup.
func TestLoopbackOptionTakesEffectAtStart(t *testing.T) {
	storage := testStorage(t)
	// The running config: a handler without the option.
	running := newTestApp(t)
	ref, err := running.acquire(storage, testSettings())
	if err != nil {
		t.Fatal(err)
	}
	if err := running.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { running.Cleanup() })

	// load provisions a config with one Durable Streams handler that has
	// the option (and one Pico handler, which has no subscriptions and
	// refuses the option), as Caddy does, and returns its app and its
	// handlers' cleanup.
	load := func() (*App, func()) {
		t.Helper()
		ctx, err := caddy.ProvisionContext(&caddy.Config{})
		if err != nil {
			t.Fatal(err)
		}
		var hs []*Handler
		for _, proto := range []string{protocolDurableStreams, protocolPico} {
			h := &Handler{Protocol: proto, Storage: storage, AllowLoopbackWebhooks: proto == protocolDurableStreams}
			if err := h.Provision(ctx); err != nil {
				t.Fatal(err)
			}
			hs = append(hs, h)
		}
		a, err := ctx.App("picomq")
		if err != nil {
			t.Fatal(err)
		}
		return a.(*App), func() {
			for _, h := range hs {
				h.Cleanup()
			}
		}
	}
	allowed := func() bool { return ref.subs.loopbackAllowed() }

	// A reload that fails after its provisioning.
	failed, cleanupHandlers := load()
	if allowed() {
		t.Error("a config that is provisioned and not started allows loopback deliveries")
	}
	cleanupHandlers()
	if err := failed.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if allowed() {
		t.Error("loopback deliveries are allowed after a failed reload")
	}

	// A reload that starts: allowed from its start until its cleanup, past
	// the old config's.
	ok, cleanupHandlers := load()
	if err := ok.Start(); err != nil {
		t.Fatal(err)
	}
	if !allowed() {
		t.Error("a started config with allow_loopback_webhooks does not allow loopback deliveries")
	}
	running.Stop()
	if err := running.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if !allowed() {
		t.Error("the old config's cleanup took away the new config's allow_loopback_webhooks")
	}
	ok.Stop()
	cleanupHandlers()
	if err := ok.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if allowed() {
		t.Error("loopback deliveries are still allowed after the config that allowed them was cleaned up")
	}
}

// TestStartThatFailsChangesNothing: a reload whose picomq app fails to
// start, one of its storages refusing to open (here an unknown format; an
// unreachable one holds the start for up to 5 × s3_timeout first), must
// leave a storage it shares with the running config as that config runs
// it, while it starts and after. Start used to apply each storage's
// settings and allow_loopback_webhooks as it came to it, in map order, so
// a shared storage reached before the one that failed ran the new settings
// and loopback deliveries until the failed config's cleanup.
func TestStartThatFailsChangesNothing(t *testing.T) {
	storage := testStorage(t)
	s1 := testSettings()
	s2 := s1
	s2.FlushInterval = time.Second
	running := newTestApp(t)
	ref, err := running.acquire(storage, s1)
	if err != nil {
		t.Fatal(err)
	}
	if err := running.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { running.Cleanup() })
	settings := func() engineSettings {
		ref.mu.Lock()
		defer ref.mu.Unlock()
		return ref.settings
	}

	broken := t.TempDir()
	if err := os.WriteFile(filepath.Join(broken, "format"), []byte("not a format"), 0o600); err != nil {
		t.Fatal(err)
	}
	// Map order decides which storage Start reaches first: try enough
	// times that the shared one comes first in some.
	for i := range 16 {
		failed := newTestApp(t)
		shared, err := failed.acquire(storage, s2)
		if err != nil {
			t.Fatal(err)
		}
		failed.allowLoopback(shared)
		if _, err := failed.acquire("file://"+broken, s2); err != nil {
			t.Fatal(err)
		}
		if err := failed.Start(); err == nil {
			t.Fatal("a config with a storage of an unknown format started")
		}
		if got := settings(); got != s1 {
			t.Errorf("attempt %d: after its failed start, before its cleanup, the reload's settings run the shared engine: %+v, want %+v", i, got, s1)
		}
		if ref.subs.loopbackAllowed() {
			t.Errorf("attempt %d: after its failed start, before its cleanup, the reload's allow_loopback_webhooks is in force", i)
		}
		if err := failed.Cleanup(); err != nil {
			t.Fatal(err)
		}
		if t.Failed() {
			break
		}
	}
	if got := settings(); got != s1 {
		t.Errorf("after the failed reloads the engine runs %+v, want %+v", got, s1)
	}
}

// A request refused because another server took the storage over is told
// what that means for it: a write that it was not stored, a read where to
// read instead.
func TestTakenOverMessageFor(t *testing.T) {
	for _, tc := range []struct {
		method string
		want   string
	}{
		{http.MethodGet, takenOverReadMessage},
		{http.MethodHead, takenOverReadMessage},
		{http.MethodPost, takenOverMessage},
		{http.MethodPut, takenOverMessage},
		{http.MethodDelete, takenOverMessage},
	} {
		if got := takenOverMessageFor(tc.method); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.method, got, tc.want)
		}
	}
}

// TestEngineLogsFollowTheLatestConfig: the engine a reload shares writes
// through the logger of the config started last, so that the reload's log
// settings (outputs, levels, a log block's filters) apply to it, and it
// stops writing to the old config's outputs, which Caddy closes; when a
// failed reload gives the engine back to the config before, its logs go
// back too.
func TestEngineLogsFollowTheLatestConfig(t *testing.T) {
	storage := testStorage(t)
	s1 := testSettings()
	s2 := s1
	s2.GraveTime = s1.GraveTime + 10*time.Minute
	core1, logs1 := observer.New(zapcore.InfoLevel)
	core2, logs2 := observer.New(zapcore.InfoLevel)
	app1 := &App{refs: make(map[string]*appEngine), log: zap.New(core1)}
	t.Cleanup(func() { app1.Cleanup() })
	if _, err := app1.acquire(storage, s1); err != nil {
		t.Fatal(err)
	}
	if err := app1.Start(); err != nil {
		t.Fatal(err)
	}
	app2 := &App{refs: make(map[string]*appEngine), log: zap.New(core2)}
	ref, err := app2.acquire(storage, s2)
	if err != nil {
		t.Fatal(err)
	}
	if err := app2.Start(); err != nil {
		t.Fatal(err)
	}
	const changed = "engine settings changed by a config reload"
	if n1, n2 := logs1.FilterMessage(changed).Len(), logs2.FilterMessage(changed).Len(); n1 != 0 || n2 != 1 {
		t.Fatalf("%q logged %d times through the first config's logger, %d through the reload's; want 0 and 1", changed, n1, n2)
	}
	ref.log.Info("after the reload")
	if n1, n2 := logs1.FilterMessage("after the reload").Len(), logs2.FilterMessage("after the reload").Len(); n1 != 0 || n2 != 1 {
		t.Fatalf("the engine's line went %d times to the first config's logger, %d to the reload's; want 0 and 1", n1, n2)
	}
	// The reload's config goes (its provisioning failed after its start):
	// the engine is the first config's again, and so are its logs.
	app2.Stop()
	app2.Cleanup()
	ref.log.Info("back")
	if n1, n2 := logs1.FilterMessage("back").Len(), logs2.FilterMessage("back").Len(); n1 != 1 || n2 != 0 {
		t.Fatalf("after the reload's config left, the engine's line went %d times to the first config's logger, %d to the reload's; want 1 and 0", n1, n2)
	}
}

// With neither HOME nor XDG_DATA_HOME set, Caddy's data directory is
// "./caddy": the default storage and the node id are under it, made
// absolute, not the file URL file://caddy/picomq/data, which names a host
// and was refused.
func TestDefaultStorageWithARelativeDataDir(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	t.Setenv("HOME", "")
	t.Setenv("XDG_DATA_HOME", "")
	want := "file://" + filepath.ToSlash(filepath.Join(dir, "caddy", "picomq", "data"))
	if got := defaultStorageURL(); got != want {
		t.Errorf("defaultStorageURL() = %q, want %q", got, want)
	}
	if err := checkStorageURL(defaultStorageURL()); err != nil {
		t.Errorf("the default storage URL is refused: %v", err)
	}
	if got, want := nodeIDPath(), filepath.Join(dir, "caddy", "picomq", "node-id"); got != want {
		t.Errorf("nodeIDPath() = %q, want %q", got, want)
	}
}
