// Starts the Durable Streams Node reference server in memory (no dataDir) on
// 127.0.0.1:PORT (first argument, or the PORT environment variable), prints
// its URL once it listens, and stops on SIGTERM or SIGINT. cmd/benchmatrix
// runs it for the Node row of docs/benchmarks.md.
import { DurableStreamTestServer } from "@durable-streams/server"

const port = Number(process.argv[2] ?? process.env.PORT ?? 4437)
const server = new DurableStreamTestServer({
  port,
  host: "127.0.0.1",
  // The bench measures the protocol's own work, as Caddy does none either.
  compression: false,
})
const url = await server.start()
console.log(`listening ${url}`)

let stopping = false
for (const sig of ["SIGTERM", "SIGINT"]) {
  process.on(sig, async () => {
    if (stopping) return
    stopping = true
    await server.stop()
    process.exit(0)
  })
}
