// The official Durable Streams TypeScript client (@durable-streams/client,
// pinned in package-lock.json) driven against the server at DS_BASE_URL the
// way an application uses it: handles, appends, catch-up and live reads,
// resumption from a saved offset, the idempotent producer, closure and the
// errors the client surfaces. The conformance suite checks the server's
// answers one request at a time; this checks that the library built on them
// works. conformance_test.go runs it with durable-streams.test.ts.
import { describe, expect, test } from "vitest"
import {
  DurableStream,
  FetchError,
  IdempotentProducer,
  StaleEpochError,
  StreamClosedError,
  stream,
  type LiveMode,
  type Offset,
  type StreamResponse,
} from "@durable-streams/client"

const baseUrl = process.env.DS_BASE_URL
if (!baseUrl) {
  throw new Error("DS_BASE_URL is not set: point it at a Durable Streams server")
}
const longPollMs = Number(process.env.DS_LONG_POLL_MS ?? 500)

const JSON_TYPE = "application/json"
const BYTES_TYPE = "application/octet-stream"

let streamCount = 0
// A fresh stream URL per test: runs share the server and its storage.
function newURL(name: string): string {
  streamCount++
  return `${baseUrl}/client/${name}-${Date.now().toString(36)}-${streamCount}`
}

async function createStream(name: string, contentType: string): Promise<DurableStream> {
  return DurableStream.create({ url: newURL(name), contentType })
}

const enc = new TextEncoder()

// until polls cond until it holds; the timeout is the failure, not a wait
// that the test relies on.
async function until(what: string, cond: () => boolean, timeoutMs = 5_000): Promise<void> {
  const deadline = Date.now() + timeoutMs
  while (!cond()) {
    if (Date.now() > deadline) {
      throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`)
    }
    await new Promise((r) => setTimeout(r, 10))
  }
}

const pause = (ms: number) => new Promise((r) => setTimeout(r, ms))

// A live reader of JSON items, keeping what it was given and the offset of
// the last batch, as an application that checkpoints would.
interface JsonFollower {
  res: StreamResponse<unknown>
  items: unknown[]
  offset?: Offset
  closedSeen: boolean
}

function followJson(res: StreamResponse<unknown>): JsonFollower {
  const f: JsonFollower = { res, items: [], closedSeen: false }
  res.subscribeJson((batch) => {
    f.items.push(...batch.items)
    f.offset = batch.offset
    if (batch.streamClosed) f.closedSeen = true
  })
  return f
}

// The same for bytes: the chunks' bytes joined in the order they came.
interface ByteFollower {
  res: StreamResponse<unknown>
  bytes: number[]
  offset?: Offset
}

function followBytes(res: StreamResponse<unknown>): ByteFollower {
  const f: ByteFollower = { res, bytes: [] }
  res.subscribeBytes((chunk) => {
    f.bytes.push(...chunk.data)
    f.offset = chunk.offset
  })
  return f
}

// Where a stream ends, from an append's 409 that says it is closed
// (Stream-Closed, Stream-Next-Offset); undefined for any other error.
function closedAt(err: unknown): Offset | undefined {
  if (!(err instanceof FetchError) || err.status !== 409) return undefined
  if (err.headers["stream-closed"]?.toLowerCase() !== "true") return undefined
  return err.headers["stream-next-offset"]
}

// The status an error from the client carries: FetchError and
// DurableStreamError both have one.
function statusOf(err: unknown): number | undefined {
  return (err as { status?: number } | null)?.status
}

async function rejection(p: Promise<unknown>): Promise<unknown> {
  try {
    await p
  } catch (err) {
    return err
  }
  throw new Error("expected the call to fail, and it succeeded")
}

describe("Official client", () => {
  describe("Append and read back", () => {
    test("bytes: from the start, from a HEAD offset and from a reader's saved offset", async () => {
      const h = await createStream("bytes", BYTES_TYPE)
      await h.append(new Uint8Array([0, 1, 2, 255]))
      const head = await h.head()
      expect(head.exists).toBe(true)
      if (!head.exists) return
      expect(head.offset).toBeTruthy()
      expect(head.streamClosed).toBe(false)
      await h.append("hello")

      const all = await h.stream({ live: false })
      expect(Array.from(await all.body())).toEqual([0, 1, 2, 255, ...enc.encode("hello")])
      expect(all.upToDate).toBe(true)
      const saved = all.offset

      const fromHead = await h.stream({ offset: head.offset, live: false })
      expect(await fromHead.text()).toBe("hello")
      expect(fromHead.offset).toBe(saved)

      await h.append(new Uint8Array([7, 8]))
      const rest = await stream({ url: h.url, offset: saved, live: false })
      expect(Array.from(await rest.body())).toEqual([7, 8])
      expect(rest.offset > saved).toBe(true)

      // At the tail there is nothing more, and the reader is up to date.
      const tail = await h.stream({ offset: rest.offset, live: false })
      expect((await tail.body()).length).toBe(0)
      expect(tail.upToDate).toBe(true)
      expect(tail.offset).toBe(rest.offset)
    })

    test("JSON: values come back one item each, in the order appended, batched or not", async () => {
      const h = await createStream("json", JSON_TYPE)
      await h.append(JSON.stringify({ i: 1 }))
      await h.append(JSON.stringify([1, 2])) // one item that is an array
      const first = await h.stream({ live: false })
      expect(await first.json()).toEqual([{ i: 1 }, [1, 2]])
      const saved = first.offset

      // Appends that overlap are sent as one batch by the client.
      await Promise.all([3, 4, 5, 6].map((i) => h.append(JSON.stringify({ i }))))
      await h.append(JSON.stringify("last"))

      const all = await h.stream({ live: false })
      expect(await all.json()).toEqual([{ i: 1 }, [1, 2], { i: 3 }, { i: 4 }, { i: 5 }, { i: 6 }, "last"])
      const rest = await h.stream({ offset: saved, live: false })
      expect(await rest.json()).toEqual([{ i: 3 }, { i: 4 }, { i: 5 }, { i: 6 }, "last"])
      expect(rest.offset).toBe(all.offset)
      expect(rest.contentType).toBe(JSON_TYPE)
    })

    test("appendStream and writable() send a body in pieces, stored whole", async () => {
      const h = await createStream("piped", "text/plain")
      async function* lines() {
        for (let i = 0; i < 5; i++) yield `line ${i}\n`
      }
      // One POST whose body is streamed as the source yields it.
      await h.appendStream(lines())
      const src = new ReadableStream<string>({
        start(c) {
          c.enqueue("piped ")
          c.enqueue("through ")
          c.enqueue("writable\n")
          c.close()
        },
      })
      await src.pipeTo(h.writable({ producerId: "pipe-1" }))
      const res = await h.stream({ live: false })
      const want = [0, 1, 2, 3, 4].map((i) => `line ${i}\n`).join("") + "piped through writable\n"
      expect(await res.text()).toBe(want)
    })

    test("connect finds the stream's content type and HEAD its tail", async () => {
      const h = await createStream("connect", JSON_TYPE)
      await h.append(JSON.stringify({ a: 1 }))
      const c = await DurableStream.connect({ url: h.url })
      expect(c.contentType).toBe(JSON_TYPE)
      const res = await c.stream({ live: false })
      expect(await res.json()).toEqual([{ a: 1 }])
      const head = await DurableStream.head({ url: h.url })
      expect(head.exists && head.offset).toBe(res.offset)
    })
  })

  const liveModes: Array<Exclude<LiveMode, boolean>> = ["long-poll", "sse"]

  describe("Live tail", () => {
    for (const live of liveModes) {
      test(`${live}, JSON: records appended after the reader started arrive in order, once`, async () => {
        const h = await createStream(`live-json-${live}`, JSON_TYPE)
        await h.append(JSON.stringify({ n: 0 }))
        const res = await h.stream({ live })
        expect(res.live).toBe(live)
        const f = followJson(res)
        try {
          await until("the record from before the reader", () => f.items.length >= 1)
          for (let n = 1; n <= 5; n++) {
            await h.append(JSON.stringify({ n }))
            // Once, let a long-poll run out empty (or the SSE feed idle)
            // so the next record finds a reader that went round again.
            if (n === 2) await pause(longPollMs + 200)
          }
          await until("six records", () => f.items.length >= 6)
          // Anything late and doubled would land within another poll.
          await pause(100)
          expect(f.items).toEqual([0, 1, 2, 3, 4, 5].map((n) => ({ n })))
          const head = await h.head()
          expect(head.exists && head.offset).toBe(f.offset)
        } finally {
          res.cancel()
        }
      })

      test(`${live}, bytes: records appended after the reader started arrive in order, once`, async () => {
        const h = await createStream(`live-bytes-${live}`, BYTES_TYPE)
        // Bytes that are not UTF-8, so an SSE feed has to carry them encoded.
        await h.append(new Uint8Array([0xff, 0x00]))
        const res = await h.stream({ live })
        const f = followBytes(res)
        const want = [0xff, 0x00]
        try {
          await until("the bytes from before the reader", () => f.bytes.length >= 2)
          for (let n = 1; n <= 4; n++) {
            const rec = [0xf0 + n, n, 0x80]
            want.push(...rec)
            await h.append(new Uint8Array(rec))
            if (n === 2) await pause(longPollMs + 200)
          }
          await until("every byte", () => f.bytes.length >= want.length)
          await pause(100)
          expect(f.bytes).toEqual(want)
        } finally {
          res.cancel()
        }
      })

      test(`${live}, text: lines appended after the reader started arrive in order, once`, async () => {
        const h = await createStream(`live-text-${live}`, "text/plain; charset=utf-8")
        await h.append("zero\n")
        const res = await h.stream({ live })
        let text = ""
        res.subscribeText((chunk) => {
          text += chunk.text
        })
        const want = ["zero\n", "één\n", "two 😀\n", "three\n"]
        try {
          await until("the line from before the reader", () => text.length > 0)
          for (const line of want.slice(1)) await h.append(line)
          await until("every line", () => text.length >= want.join("").length)
          await pause(100)
          expect(text).toBe(want.join(""))
        } finally {
          res.cancel()
        }
      })
    }

    test("live: true picks a mode by content type and tails JSON and bytes", async () => {
      const j = await createStream("live-auto-json", JSON_TYPE)
      const b = await createStream("live-auto-bytes", BYTES_TYPE)
      const fj = followJson(await j.stream({ live: true }))
      const fb = followBytes(await b.stream({ live: true }))
      try {
        await j.append(JSON.stringify("x"))
        await b.append(new Uint8Array([9]))
        await until("one record on each", () => fj.items.length >= 1 && fb.bytes.length >= 1)
        await j.append(JSON.stringify("y"))
        await b.append(new Uint8Array([10]))
        await until("two records on each", () => fj.items.length >= 2 && fb.bytes.length >= 2)
        await pause(100)
        expect(fj.items).toEqual(["x", "y"])
        expect(fb.bytes).toEqual([9, 10])
      } finally {
        fj.res.cancel()
        fb.res.cancel()
      }
    })
  })

  describe("Resume after a disconnect", () => {
    for (const live of liveModes) {
      test(`${live}: a reader aborted mid-stream and restarted at its last offset misses nothing, repeats nothing`, async () => {
        const h = await createStream(`resume-${live}`, JSON_TYPE)
        const abort = new AbortController()
        const first = followJson(await h.stream({ live, signal: abort.signal }))
        for (let n = 1; n <= 3; n++) await h.append(JSON.stringify(n))
        await until("the first three records", () => first.items.length >= 3)
        // The reader is waiting on the server for more when it is cut off.
        abort.abort()
        await first.res.closed.catch(() => {})
        const saved = first.offset
        expect(saved).toBeTruthy()

        // Written while nobody reads.
        for (let n = 4; n <= 6; n++) await h.append(JSON.stringify(n))

        const second = followJson(await h.stream({ live, offset: saved }))
        try {
          for (let n = 7; n <= 8; n++) await h.append(JSON.stringify(n))
          await until("records 4 to 8", () => second.items.length >= 5)
          await pause(100)
          expect(first.items).toEqual([1, 2, 3])
          expect(second.items).toEqual([4, 5, 6, 7, 8])
        } finally {
          second.res.cancel()
        }
      })
    }
  })

  describe("Idempotent producer", () => {
    test("batched, pipelined appends arrive once each, in order", async () => {
      const h = await createStream("producer", JSON_TYPE)
      const errors: Error[] = []
      const p = new IdempotentProducer(h, "writer-1", { lingerMs: 1, onError: (e) => errors.push(e) })
      for (let i = 0; i < 50; i++) p.append(JSON.stringify({ i }))
      await p.flush()
      expect(errors).toEqual([])
      const res = await h.stream({ live: false })
      expect(await res.json()).toEqual(Array.from({ length: 50 }, (_, i) => ({ i })))
      expect(p.lastSuccessfulOffset).toBe(res.offset)
      await p.detach()
    })

    test("a batch sent again after its answer was lost is stored once", async () => {
      const h = await createStream("producer-retry", JSON_TYPE)
      // The server gets every request; the answers to the first two
      // appends are lost on the way back, as when a connection drops.
      let posts = 0
      const statuses: number[] = []
      const lossy: typeof fetch = async (input, init) => {
        const resp = await fetch(input, init)
        statuses.push(resp.status)
        if (init?.method === "POST" && ++posts <= 2) {
          throw new TypeError("fetch failed: connection reset (test)")
        }
        return resp
      }
      // What an application does about a network error: send it again.
      const retrying: typeof fetch = async (input, init) => {
        for (let attempt = 1; ; attempt++) {
          try {
            return await lossy(input, init)
          } catch (err) {
            if (!(err instanceof TypeError) || attempt === 4) throw err
          }
        }
      }
      const errors: Error[] = []
      const p = new IdempotentProducer(h, "writer-retry", {
        fetch: retrying,
        maxInFlight: 1,
        onError: (e) => errors.push(e),
      })
      p.append(JSON.stringify("a"))
      await p.flush()
      p.append(JSON.stringify("b"))
      p.append(JSON.stringify("c"))
      await p.flush()
      expect(errors).toEqual([])
      // Stored the first time, answered as a duplicate the second and third.
      expect(statuses.slice(0, 3)).toEqual([200, 204, 204])
      const res = await h.stream({ live: false })
      expect(await res.json()).toEqual(["a", "b", "c"])
      await p.detach()
    })

    test("a close whose answer was lost, retried, closes once with its final message once", async () => {
      const h = await createStream("producer-close", JSON_TYPE)
      let dropClose = true
      const lossy: typeof fetch = async (input, init) => {
        const resp = await fetch(input, init)
        const closing = new Headers(init?.headers).get("Stream-Closed") === "true"
        if (closing && dropClose) {
          dropClose = false
          throw new TypeError("fetch failed: connection reset (test)")
        }
        return resp
      }
      const p = new IdempotentProducer(h, "writer-close", { fetch: lossy })
      p.append(JSON.stringify(1))
      await p.flush()
      const err = await rejection(p.close(JSON.stringify("bye")))
      expect(err).toBeInstanceOf(TypeError)
      const { finalOffset } = await p.close()
      const head = await h.head()
      expect(head.exists && head.streamClosed).toBe(true)
      expect(head.exists && head.offset).toBe(finalOffset)
      const res = await h.stream({ live: false })
      expect(await res.json()).toEqual([1, "bye"])
      expect(res.streamClosed).toBe(true)
    })

    test("a producer fenced by a newer epoch gets StaleEpochError and stores nothing more", async () => {
      const h = await createStream("producer-fence", JSON_TYPE)
      const oldErrors: Error[] = []
      const old = new IdempotentProducer(h, "writer-fence", { onError: (e) => oldErrors.push(e) })
      old.append(JSON.stringify("old-1"))
      await old.flush()

      const fresh = new IdempotentProducer(h, "writer-fence", { epoch: 1 })
      fresh.append(JSON.stringify("new-1"))
      await fresh.flush()

      old.append(JSON.stringify("old-2"))
      await old.flush().catch(() => {})
      expect(oldErrors.length).toBe(1)
      expect(oldErrors[0]).toBeInstanceOf(StaleEpochError)
      expect((oldErrors[0] as StaleEpochError).currentEpoch).toBe(1)

      // One that claims on its own takes the epoch after the newest.
      const claimer = new IdempotentProducer(h, "writer-fence", { autoClaim: true })
      claimer.append(JSON.stringify("claimed"))
      await claimer.flush()
      expect(claimer.epoch).toBe(2)
      fresh.append(JSON.stringify("new-2"))
      await fresh.flush().catch(() => {})

      const res = await h.stream({ live: false })
      expect(await res.json()).toEqual(["old-1", "new-1", "claimed"])
      await claimer.detach()
    })
  })

  describe("Closing a stream", () => {
    for (const live of liveModes) {
      test(`${live}: a live reader gets the final message, sees the end and stops`, async () => {
        const h = await createStream(`close-${live}`, JSON_TYPE)
        await h.append(JSON.stringify("one"))
        const f = followJson(await h.stream({ live }))
        await until("the first record", () => f.items.length >= 1)
        const { finalOffset } = await h.close({ body: JSON.stringify("end") })
        // The subscriber's streamClosed batch is the end to wait for: the
        // session's closed promise can settle before that batch is handed
        // over (README, Durable Streams).
        await until("the batch that says the stream is closed", () => f.closedSeen)
        // The session ends by itself once it has seen the end.
        await f.res.closed
        expect(f.items).toEqual(["one", "end"])
        expect(f.closedSeen).toBe(true)
        expect(f.res.streamClosed).toBe(true)
        expect(f.offset).toBe(finalOffset)
      })
    }

    test("after the close: appends are refused, a repeated close is harmless, reads end at EOF", async () => {
      const h = await createStream("closed", BYTES_TYPE)
      await h.append("abc")
      const { finalOffset } = await h.close()
      expect((await h.close()).finalOffset).toBe(finalOffset)

      // append() reports a 4xx as a FetchError, not the StreamClosedError
      // its README promises (README, Durable Streams): the answer's headers
      // say the stream is closed and where it ends.
      const err = await rejection(h.append("more"))
      expect(err).not.toBeInstanceOf(StreamClosedError)
      expect(closedAt(err)).toBe(finalOffset)
      // So does close() with a final message that came too late.
      const late = await rejection(h.close({ body: "late" }))
      expect(late).toBeInstanceOf(FetchError)
      expect(closedAt(late)).toBe(finalOffset)

      const res = await h.stream({ live: false })
      expect(await res.text()).toBe("abc")
      expect(res.streamClosed).toBe(true)
      expect(res.offset).toBe(finalOffset)
      // A live read at the end returns at once rather than waiting.
      const atEnd = await h.stream({ live: "long-poll", offset: finalOffset })
      expect((await atEnd.body()).length).toBe(0)
      expect(atEnd.streamClosed).toBe(true)
    })

    test("a stream created closed reads as its body and then EOF", async () => {
      const url = newURL("created-closed")
      // A create's JSON body is an array of the stream's first values.
      const body = JSON.stringify([{ only: true }])
      await DurableStream.create({ url, contentType: JSON_TYPE, body, closed: true })
      const res = await stream({ url, live: false })
      expect(await res.json()).toEqual([{ only: true }])
      expect(res.streamClosed).toBe(true)
    })
  })

  describe("Errors", () => {
    test("appending to and reading a stream that does not exist", async () => {
      const url = newURL("missing")
      const h = new DurableStream({ url, contentType: BYTES_TYPE })
      expect(statusOf(await rejection(h.append("x")))).toBe(404)
      expect(statusOf(await rejection(stream({ url, live: false })))).toBe(404)
      // connect() does not reject a missing stream (README, Durable
      // Streams); head() is how to ask.
      expect(await DurableStream.head({ url })).toEqual({ exists: false })
      // The failed append made nothing.
      expect(statusOf(await rejection(h.stream({ live: false })))).toBe(404)
    })

    test("creating a stream that exists with another content type", async () => {
      const h = await createStream("exists", JSON_TYPE)
      const err = await rejection(DurableStream.create({ url: h.url, contentType: BYTES_TYPE }))
      // A FetchError, not the DurableStreamError with code CONFLICT_EXISTS
      // that create() documents (README, Durable Streams).
      expect(err).toBeInstanceOf(FetchError)
      expect(statusOf(err)).toBe(409)
      // The stream is untouched.
      expect(await DurableStream.head({ url: h.url })).toMatchObject({ exists: true, contentType: JSON_TYPE })
    })

    test("an append out of Stream-Seq order, and JSON that does not parse, are refused and store nothing", async () => {
      const h = await createStream("refused", JSON_TYPE)
      await h.append(JSON.stringify(1), { seq: "0002" })
      expect(statusOf(await rejection(h.append(JSON.stringify(2), { seq: "0001" })))).toBe(409)
      expect(statusOf(await rejection(h.append("{not json")))).toBe(400)
      await h.append(JSON.stringify(3), { seq: "0003" })
      const res = await h.stream({ live: false })
      expect(await res.json()).toEqual([1, 3])
    })

    test("reading from an offset past the end of the stream", async () => {
      const h = await createStream("past-end", BYTES_TYPE)
      await h.append("abc")
      const first = await h.stream({ live: false })
      await first.body()
      // An offset the server never gave out, well after the tail.
      // PicoMQ's offsets are "seq_byte", both zero-padded: this is 1000
      // records on. Offsets are opaque to clients; a test may know them.
      const beyond = first.offset.replace(/^\d+/, (seq) =>
        String(Number(seq) + 1000).padStart(seq.length, "0"),
      )
      expect(beyond).not.toBe(first.offset)
      expect(statusOf(await rejection(h.stream({ offset: beyond, live: false })))).toBe(400)
    })

    for (const live of liveModes) {
      test(`a deleted stream: its ${live} reader ends with an error, then every call is 404`, async () => {
        const h = await createStream(`deleted-${live}`, JSON_TYPE)
        await h.append(JSON.stringify(1))
        const f = followJson(await h.stream({ live }))
        await until("the first record", () => f.items.length >= 1)
        // Watched from before the delete: the reader may fail before
        // delete() returns.
        const ended = rejection(f.res.closed)
        await h.delete()
        expect(statusOf(await ended)).toBe(404)
        expect(f.items).toEqual([1])

        expect(statusOf(await rejection(h.append(JSON.stringify(2))))).toBe(404)
        expect(statusOf(await rejection(h.stream({ live: false })))).toBe(404)
        expect(await h.head()).toEqual({ exists: false })
        expect(statusOf(await rejection(h.delete()))).toBe(404)
      })
    }
  })
})
