import { defineConfig } from "vitest/config"

// Sized for a 2-core CI box: there is one test file and the suite's tests
// run one after another inside it, so a single worker is all that is useful.
// Several tests create streams and poll with their own timeouts; the default
// timeout below only bounds tests that do not set one.
export default defineConfig({
  test: {
    include: ["durable-streams.test.ts"],
    pool: "forks",
    maxWorkers: 1,
    fileParallelism: false,
    testTimeout: 20_000,
    hookTimeout: 20_000,
    teardownTimeout: 5_000,
    passWithNoTests: false,
    watch: false,
    // No colours: the Go test captures this output into its log.
    env: { FORCE_COLOR: "0" },
  },
})
