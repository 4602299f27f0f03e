package picowire

import (
	"context"
	"os"
	"os/exec"
	"testing"
	"time"
)

// fuzzSmokeEnv marks the fuzzing child processes, so that a child never
// starts fuzzers of its own.
const fuzzSmokeEnv = "PICOWIRE_FUZZ_SMOKE_CHILD"

// fuzzSmokeExecs is how many inputs each fuzz target runs in the smoke
// test (about 10 s each here): few and fixed, so CI's one test command
// covers the decoders with fresh random inputs on every run. A count, not a
// duration: with -fuzztime=10s the Go 1.26 fuzzing coordinator sometimes
// fails a target with "context deadline exceeded" and no failing input as
// the time runs out on a busy machine (go.dev/issue/75804, fixed in Go
// 1.27); a count never arms that deadline.
const fuzzSmokeExecs = "150000x"

// TestFuzzSmoke runs each batch decoder's fuzz target for a fixed count, as
// `go test -run=^$ -fuzz=FuzzX -fuzztime=150000x` in this package's directory,
// and fails when a fuzzer finds a failing input (a panic or a broken
// property); the fuzzer then saves it under testdata/fuzz for replay.
func TestFuzzSmoke(t *testing.T) {
	if os.Getenv(fuzzSmokeEnv) != "" {
		t.Skip("inside a fuzzing child")
	}
	if testing.Short() {
		t.Skip("fuzzing takes 20s")
	}
	// The go command that runs this test is on PATH; with GOTOOLCHAIN it
	// switches to the toolchain go.mod asks for, as the outer one did.
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("no go command to fuzz with: %v", err)
	}
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for _, target := range []string{"FuzzDecodeBinary", "FuzzDecodeJSON"} {
		t.Run(target, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			// Minimizing a new interesting input may take up to a minute by
			// default, during which nothing is fuzzed: capped at a second,
			// the smoke test's inputs stay fresh ones. One worker leaves the
			// other core to the packages go test runs alongside.
			cmd := exec.CommandContext(ctx, goBin, "test", "-run=^$", "-fuzz=^"+target+"$",
				"-fuzztime="+fuzzSmokeExecs, "-fuzzminimizetime=1s", "-parallel=1", ".")
			cmd.Dir = dir
			cmd.Env = append(os.Environ(), fuzzSmokeEnv+"=1")
			start := time.Now()
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("%s failed after %s: %v\n%s", target, time.Since(start).Round(time.Millisecond), err, out)
			}
			t.Logf("%s ran for %s:\n%s", target, time.Since(start).Round(time.Millisecond), tail(string(out), 2000))
		})
	}
}

// tail returns the last n bytes of s.
func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}
