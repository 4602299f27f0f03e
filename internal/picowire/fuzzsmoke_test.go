package picowire

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// fuzzSmokeEnv marks the fuzzing child processes, so that a child never
// starts fuzzers of its own.
const fuzzSmokeEnv = "PICOWIRE_FUZZ_SMOKE_CHILD"

// fuzzSmokeTime is how long each fuzz target runs in the smoke test: short
// and fixed, so CI's one test command covers the decoders with fresh random
// inputs on every run.
const fuzzSmokeTime = "10s"

// TestFuzzSmoke runs each batch decoder's fuzz target for a fixed time, as
// `go test -run=^$ -fuzz=FuzzX -fuzztime=10s` in this package's directory,
// and fails when a fuzzer finds a failing input (a panic or a broken
// property); the fuzzer then saves it under testdata/fuzz for replay.
func TestFuzzSmoke(t *testing.T) {
	if os.Getenv(fuzzSmokeEnv) != "" {
		t.Skip("inside a fuzzing child")
	}
	if testing.Short() {
		t.Skip("fuzzing takes 20s")
	}
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(goBin); err != nil {
		if goBin, err = exec.LookPath("go"); err != nil {
			t.Skipf("no go command to fuzz with: %v", err)
		}
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
			// the fixed time goes to fresh inputs. One worker leaves the
			// other core to the packages go test runs alongside.
			run := func() ([]byte, error) {
				cmd := exec.CommandContext(ctx, goBin, "test", "-run=^$", "-fuzz=^"+target+"$",
					"-fuzztime="+fuzzSmokeTime, "-fuzzminimizetime=1s", "-parallel=1", ".")
				cmd.Dir = dir
				cmd.Env = append(os.Environ(), fuzzSmokeEnv+"=1")
				return cmd.CombinedOutput()
			}
			start := time.Now()
			out, err := run()
			if err != nil && engineTimeout(out) {
				// The fuzzing engine itself sometimes reports "context
				// deadline exceeded" as the fixed time runs out on a busy
				// machine, with no failing input found. Once more, then
				// it counts.
				t.Logf("%s: the fuzzing engine timed out without a failing input; running it again:\n%s", target, tail(string(out), 600))
				start = time.Now()
				out, err = run()
			}
			if err != nil {
				t.Fatalf("%s failed after %s: %v\n%s", target, time.Since(start).Round(time.Millisecond), err, out)
			}
			t.Logf("%s ran for %s:\n%s", target, time.Since(start).Round(time.Millisecond), tail(string(out), 2000))
		})
	}
}

// engineTimeout reports whether a failed fuzzing run ended on the engine's
// own deadline rather than on an input: a real failure always says where it
// wrote the failing input.
func engineTimeout(out []byte) bool {
	return strings.Contains(string(out), "context deadline exceeded") &&
		!strings.Contains(string(out), "Failing input written to")
}

// tail returns the last n bytes of s.
func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}
