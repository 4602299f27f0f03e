// The official Durable Streams server conformance suite, run against the
// server at DS_BASE_URL. conformance_test.go builds and starts Caddy with the
// picomq module and runs this file through vitest; it can also be run by hand:
//
//	DS_BASE_URL=http://127.0.0.1:8080 npx vitest run
//
// The suite's own --run CLI cannot find its test file once installed under
// node_modules, hence this file. Test selection is done by the caller with
// vitest's -t (testNamePattern), so every test of the suite is registered here.
import { runConformanceTests } from "@durable-streams/server-conformance-tests"

const baseUrl = process.env.DS_BASE_URL
if (!baseUrl) {
  throw new Error(
    "DS_BASE_URL is not set: point it at a Durable Streams server (e.g. http://127.0.0.1:8080)",
  )
}

runConformanceTests({
  baseUrl,
  longPollTimeoutMs: Number(process.env.DS_LONG_POLL_MS ?? 500),
  subscriptions: process.env.DS_SUBSCRIPTIONS === "true",
})
