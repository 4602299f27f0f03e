import { defineConfig } from "vitest/config"

// Sized for a 2-core CI box: the suite (durable-streams.test.ts) and the
// official client's tests (client.test.ts) run one file after the other and
// their tests one after another inside each, so a single worker is all that
// is useful (and keeps timing-sensitive long-poll tests from competing for
// the CPU).
// The suite's slowest tests (TTL expiry) take about 4s and the few that need
// more set their own timeout; 10s bounds the rest, so a server that hangs
// fails each test in 10s instead of holding the run.
export default defineConfig({
  test: {
    include: ["durable-streams.test.ts", "client.test.ts"],
    pool: "threads",
    maxWorkers: 1,
    fileParallelism: false,
    testTimeout: 10_000,
    hookTimeout: 10_000,
    teardownTimeout: 5_000,
    passWithNoTests: false,
    watch: false,
    // No colours: the Go test captures this output into its log.
    env: { FORCE_COLOR: "0" },
  },
})
