package integration

import (
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestServerWriteTimeoutUnconfirmedWrites: Caddy's `write` server timeout
// is a deadline for a whole response that no handler can lift. A write
// still waiting for its WAL upload when it passed was cut with its
// connection, which a client cannot tell from a network fault. It now
// answers 503 with Retry-After and a reason that says it was not
// acknowledged, before the deadline. Once the held upload lands the
// stream shows the write, and the client's retry neither loses it nor,
// with producer headers (or as a create or a close, which are
// idempotent), duplicates it.
func TestServerWriteTimeoutUnconfirmedWrites(t *testing.T) {
	t.Parallel() // waits on timers most of its run: beside the other such tests, not after them
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const write = 2 * time.Second
	_, p, sc := startWriteTimeoutSite(t, write)
	text := http.Header{"Content-Type": {textPlain}}

	for _, m := range bothMounts {
		pr := protoOf(m)
		// The protocol's header names.
		producer, closed := http.Header{
			"Content-Type":   {textPlain},
			"Producer-Id":    {"held-writer"},
			"Producer-Epoch": {"0"},
			"Producer-Seq":   {"0"},
		}, "Stream-Closed"
		if m.pico {
			producer, closed = http.Header{
				"Content-Type":        {textPlain},
				"Pico-Producer-Id":    {"held-writer"},
				"Pico-Producer-Epoch": {"0"},
				"Pico-Producer-Seq":   {"0"},
			}, "Pico-Closed"
		}
		read := func(t *testing.T, path string) string {
			t.Helper()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			r, err := sc.do(ctx, http.MethodGet, path+"?"+pr.readAll, nil, nil)
			if err != nil || r.status != http.StatusOK {
				return fmt.Sprintf("(read: %v %v)", r, err)
			}
			return pr.bodies(t, r.body)
		}
		mustDo := func(t *testing.T, method, path string, hdr http.Header, body []byte, want ...int) {
			t.Helper()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			r, err := sc.do(ctx, method, path, hdr, body)
			if err != nil {
				t.Fatalf("%s %s: %v", method, path, err)
			}
			for _, s := range want {
				if r.status == s {
					return
				}
			}
			t.Fatalf("%s %s: %v, want one of %v", method, path, r, want)
		}

		t.Run(strings.TrimPrefix(m.prefix, "/"), func(t *testing.T) {
			t.Run("append", func(t *testing.T) {
				path := m.prefix + "/held-append" + m.tag()
				mustDo(t, http.MethodPut, path, text, nil, http.StatusCreated)
				heldWrite(t, sc, p, write, testenv.Fault{Op: testenv.OpPut, KeyContains: "wal/"}, "not acknowledged", http.MethodPost, path, producer, []byte("held;"))
				// The upload went on and landed: the append is in the
				// stream, and the producer's retry is recognised.
				if !waitFor(10*time.Second, func() bool { return read(t, path) == "held;" }) {
					t.Fatalf("after the held upload landed the stream reads %q, want %q", read(t, path), "held;")
				}
				mustDo(t, http.MethodPost, path, producer, []byte("held;"), pr.appendStatus, http.StatusNoContent)
				if got := read(t, path); got != "held;" {
					t.Errorf("after the producer's retry the stream reads %q, want %q once", got, "held;")
				}
			})
			t.Run("late body", func(t *testing.T) {
				// The body's end arrives after the time by which the
				// write must be answered (a quarter of write before
				// it) but before write: nothing was handed to the
				// store yet, so the 503 must leave nothing behind, not
				// store the append while saying it may have been.
				path := m.prefix + "/late-body" + m.tag()
				mustDo(t, http.MethodPut, path, text, nil, http.StatusCreated)
				ctx, cancel := context.WithTimeout(context.Background(), write+10*time.Second)
				defer cancel()
				body := &lateBody{first: []byte("late"), rest: []byte(";"), pause: write * 7 / 8}
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, sc.origin+path, body)
				if err != nil {
					t.Fatal(err)
				}
				req.ContentLength = int64(len(body.first) + len(body.rest))
				req.Header = text.Clone()
				resp, err := sc.hc.Do(req)
				if err != nil {
					t.Fatalf("POST %s with its body's end past the answer time: %v", path, err)
				}
				msg, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" ||
					!strings.Contains(string(msg), "nothing was stored") {
					t.Errorf("POST %s with its body's end past the answer time: %d %q, want 503 with Retry-After saying nothing was stored",
						path, resp.StatusCode, msg)
				}
				// A later append acknowledged means every earlier WAL
				// entry is settled: the late one shows now if stored.
				mustDo(t, http.MethodPost, path, text, []byte("next;"), pr.appendStatus)
				if got := read(t, path); got != "next;" {
					t.Errorf("after a late append refused with 503 and a later one the stream reads %q, want %q", got, "next;")
				}
			})
			t.Run("append behind a held close", func(t *testing.T) {
				// An append behind a close still on its way waits for
				// the close's fate. Cut at the answer time, it was never
				// handed to the store: the 503 says nothing was stored,
				// so a plain retry cannot store it twice. The producer's
				// retry of the closing append itself may still be
				// stored, and is told so.
				path := m.prefix + "/queued-behind-close" + m.tag()
				mustDo(t, http.MethodPut, path, text, []byte("before;"), http.StatusCreated)
				closing := producer.Clone()
				closing.Set(closed, "true")
				release := p.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "wal/"})
				defer release()
				type answer struct {
					r   *siteResp
					err error
				}
				closeDone := make(chan answer, 1)
				go func() {
					ctx, cancel := context.WithTimeout(context.Background(), write+10*time.Second)
					defer cancel()
					r, err := sc.do(ctx, http.MethodPost, path, closing, []byte("last;"))
					closeDone <- answer{r, err}
				}()
				hctx, hcancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer hcancel()
				if err := p.WaitHeld(hctx, 1); err != nil {
					t.Fatalf("the closing append's WAL upload was not held: %v", err)
				}
				for _, tc := range []struct {
					name string
					hdr  http.Header
					body []byte
					want string
				}{
					{"an append", text, []byte("queued;"), "nothing was stored"},
					{"the closing append's producer retry", closing, []byte("last;"), "may still be stored"},
				} {
					answeredInTime(t, sc, write, tc.name+" behind a held close", tc.want, http.MethodPost, path, tc.hdr, tc.body)
				}
				// Its records close the stream: a repeat cannot store
				// them twice, with or without producer headers.
				if a := <-closeDone; a.err != nil || a.r.status != http.StatusServiceUnavailable ||
					!strings.Contains(string(a.r.body), "may still be stored") || !strings.Contains(string(a.r.body), "cannot be stored twice") {
					t.Errorf("the held closing append: %v %v, want 503 saying it may still be stored and cannot be stored twice", a.r, a.err)
				}
				release()
				lctx, lcancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer lcancel()
				if err := p.WaitLanded(lctx); err != nil {
					t.Fatalf("the held upload did not land: %v", err)
				}
				if !waitFor(10*time.Second, func() bool { return read(t, path) == "before;last;" }) {
					t.Errorf("after the held close landed the stream reads %q, want %q", read(t, path), "before;last;")
				}
			})
			if !m.pico { // Pico has no forks
				t.Run("fork", func(t *testing.T) {
					// A fork's create raises its source's fork count, a
					// metadata PUT of the source, before it writes anything
					// of the fork: that PUT held past the answer time is
					// answered 503 too, saying nothing was stored (the fork
					// does not exist, and its create's retry makes it).
					src, fork := m.prefix+"/fork-src"+m.tag(), m.prefix+"/held-fork"+m.tag()
					mustDo(t, http.MethodPut, src, text, []byte("src;"), http.StatusCreated)
					srcName := strings.TrimPrefix(src, m.prefix)
					forked := http.Header{"Content-Type": {textPlain}, "Stream-Forked-From": {src}}
					heldWrite(t, sc, p, write, testenv.Fault{Op: testenv.OpPut, KeyContains: hex.EncodeToString([]byte(srcName)) + ".m"},
						"nothing was stored", http.MethodPut, fork, forked, nil)
					if r, err := sc.do(context.Background(), http.MethodHead, fork, nil, nil); err != nil || r.status != http.StatusNotFound {
						t.Errorf("HEAD %s after its create was refused: %v %v, want 404", fork, r, err)
					}
					mustDo(t, http.MethodPut, fork, forked, nil, http.StatusCreated)
					if got := read(t, fork); got != "src;" {
						t.Errorf("the fork made by the create's retry reads %q, want %q", got, "src;")
					}
				})
			}
			t.Run("append to an expired stream", func(t *testing.T) {
				// A write that finds its stream expired deletes it
				// first: that delete's uploads held past the answer
				// time are answered 503 too, saying nothing was stored,
				// and once they land the stream is gone.
				path := m.prefix + "/expired-append" + m.tag()
				ttl := withTTL(text, m.pico, "1")
				mustDo(t, http.MethodPut, path, ttl, nil, http.StatusCreated)
				time.Sleep(1500 * time.Millisecond) // past the TTL: the stream has expired
				heldWrite(t, sc, p, write, testenv.Fault{Op: testenv.OpPut, KeyContains: "gc/"},
					"nothing was stored", http.MethodPost, path, text, []byte("late;"))
				mustDo(t, http.MethodPost, path, text, []byte("late;"), http.StatusNotFound)
			})
			t.Run("large append", func(t *testing.T) {
				// An append of 256 KiB or more is PUT as a blob before
				// its WAL entry: a blob upload held past the answer
				// time must not let the timeout cut the response
				// either. Its entry was never written, so the 503 says
				// nothing was acknowledged, and nothing shows.
				path := m.prefix + "/held-blob" + m.tag()
				mustDo(t, http.MethodPut, path, text, nil, http.StatusCreated)
				heldWrite(t, sc, p, write, testenv.Fault{Op: testenv.OpPut, KeyContains: "blob/"},
					"nothing was acknowledged", http.MethodPost, path, text, []byte(strings.Repeat("b", 300<<10)))
				mustDo(t, http.MethodPost, path, text, []byte("next;"), pr.appendStatus)
				if got := read(t, path); got != "next;" {
					t.Errorf("after a large append refused with 503 and a later one the stream reads %.40q, want %q", got, "next;")
				}
			})
			t.Run("create", func(t *testing.T) {
				path := m.prefix + "/held-create" + m.tag()
				heldWrite(t, sc, p, write, testenv.Fault{Op: testenv.OpPut, KeyContains: "wal/"}, "not acknowledged", http.MethodPut, path, text, []byte("seed;"))
				mustDo(t, http.MethodPut, path, text, []byte("seed;"), http.StatusCreated, http.StatusOK)
				if got := read(t, path); got != "seed;" {
					t.Errorf("after the create's retry the stream reads %q, want %q once", got, "seed;")
				}
			})
			t.Run("create metadata", func(t *testing.T) {
				// A create with a body writes its metadata object once
				// its WAL entry is durable: that upload held past the
				// answer time is answered 503 too, and the create
				// rolls forward, its retry making the stream once.
				path := m.prefix + "/held-create-meta" + m.tag()
				heldWrite(t, sc, p, write, testenv.Fault{Op: testenv.OpPut, KeyContains: "streams/"}, "not acknowledged", http.MethodPut, path, text, []byte("seed;"))
				if !waitFor(10*time.Second, func() bool { return read(t, path) == "seed;" }) {
					t.Fatalf("after the held metadata upload landed the stream reads %q, want %q", read(t, path), "seed;")
				}
				mustDo(t, http.MethodPut, path, text, []byte("seed;"), http.StatusCreated, http.StatusOK)
				if got := read(t, path); got != "seed;" {
					t.Errorf("after the create's retry the stream reads %q, want %q once", got, "seed;")
				}
			})
			t.Run("create with a TTL", func(t *testing.T) {
				// A create with a TTL PUTs its expiry marker first:
				// that upload held past the answer time is answered
				// 503 too, with nothing acknowledged (a marker alone
				// makes no stream), and the create's retry makes the
				// stream once.
				path := m.prefix + "/held-create-ttl" + m.tag()
				ttl := withTTL(text, m.pico, "3600")
				heldWrite(t, sc, p, write, testenv.Fault{Op: testenv.OpPut, KeyContains: "expiry/"},
					"nothing was acknowledged", http.MethodPut, path, ttl, []byte("seed;"))
				mustDo(t, http.MethodPut, path, ttl, []byte("seed;"), http.StatusCreated, http.StatusOK)
				if got := read(t, path); got != "seed;" {
					t.Errorf("after the create's retry the stream reads %q, want %q once", got, "seed;")
				}
			})
			t.Run("close", func(t *testing.T) {
				path := m.prefix + "/held-close" + m.tag()
				mustDo(t, http.MethodPut, path, text, []byte("before;"), http.StatusCreated)
				// A close is repeated safely as it was, with no
				// producer headers: a close of a closed stream succeeds.
				heldWrite(t, sc, p, write, testenv.Fault{Op: testenv.OpPut, KeyContains: "wal/"},
					"not acknowledged, and it may or may not take effect; repeat it as it was: a repeat of a close that took effect succeeds",
					http.MethodPost, path, http.Header{closed: {"true"}}, nil)
				isClosed := func() bool {
					r, err := sc.do(context.Background(), http.MethodHead, path, nil, nil)
					return err == nil && r.status == http.StatusOK && r.header.Get(closed) == "true"
				}
				if !waitFor(10*time.Second, isClosed) {
					t.Fatal("the held close landed, but the stream is not closed")
				}
				mustDo(t, http.MethodPost, path, http.Header{closed: {"true"}}, nil, http.StatusOK, http.StatusNoContent)
				if got := read(t, path); got != "before;" {
					t.Errorf("after the close the stream reads %q, want %q", got, "before;")
				}
			})
		})
	}
}

// startWriteTimeoutSite starts Caddy with both mounts on versitygw behind
// an S3 proxy, under Caddy's `write` server timeout write, and a client
// that opens a connection per request: Go's client sends a PUT again,
// unseen, when a reused connection closes without an answer.
func startWriteTimeoutSite(t *testing.T, write time.Duration) (*caddytest.Caddy, *testenv.Proxy, *siteClient) {
	t.Helper()
	v := testenv.NewVersity(t)
	p := newProxy(t, v)
	storage := caddytest.S3Storage(t, v, p.URL())
	caddyfile := fmt.Sprintf(siteGlobal, fmt.Sprintf("\tservers {\n\t\ttimeouts {\n\t\t\twrite %v\n\t\t}\n\t}\n", write)) +
		"http://127.0.0.1:{$" + caddytest.PortEnv + "} {\n\tbind 127.0.0.1\n" +
		siteMounts(storage, bothMounts, nil) + "}\n"
	c := caddytest.Start(t, caddytest.Options{Caddyfile: caddyfile, Env: caddytest.S3Env(v), ReadyTimeout: 90 * time.Second})
	tr := &http.Transport{DisableKeepAlives: true, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return c, p, &siteClient{origin: c.URL(), hc: &http.Client{Transport: tr}}
}

// TestServerWriteTimeoutReadsBeforeTheWAL: a write reads the bucket
// before it writes anything when its stream is not in memory (made by an
// earlier process, or evicted): an append or a close loads the stream's
// metadata, a create with a body looks for an existing stream first, and
// a create without one reads the stream its create-only write found.
// Such a read held past the answer time of Caddy's `write` timeout is
// answered 503 with Retry-After saying that nothing was stored, as the
// write was never handed to the store, not cut with its connection; the
// read goes on for the requests after it, and a retry then succeeds and
// stores the write once.
func TestServerWriteTimeoutReadsBeforeTheWAL(t *testing.T) {
	t.Parallel() // waits on timers most of its run: beside the other such tests, not after them
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const write = 2 * time.Second
	c, p, sc := startWriteTimeoutSite(t, write)
	text := http.Header{"Content-Type": {textPlain}}
	do := func(t *testing.T, method, path string, hdr http.Header, body []byte) *siteResp {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		r, err := sc.do(ctx, method, path, hdr, body)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		return r
	}
	// Streams an earlier process made: this one has only their metadata
	// objects (made without a body, they have no WAL entries to replay).
	for _, m := range bothMounts {
		for _, name := range []string{"/cold-append", "/cold-close", "/cold-create", "/cold-create-empty"} {
			if r := do(t, http.MethodPut, m.prefix+name+m.tag(), text, nil); r.status != http.StatusCreated {
				t.Fatalf("PUT %s: %v", m.prefix+name+m.tag(), r)
			}
		}
	}
	c.Restart()

	for _, m := range bothMounts {
		pr := protoOf(m)
		closed := "Stream-Closed"
		// A create with a body of a stream that exists empty: Durable
		// Streams compares settings only, Pico confirms it only when the
		// stream's first records are that body.
		createAgain := []int{http.StatusOK}
		if m.pico {
			closed = "Pico-Closed"
			createAgain = []int{http.StatusConflict}
		}
		read := func(t *testing.T, path string) (int, string) {
			t.Helper()
			r := do(t, http.MethodGet, path+"?"+pr.readAll, nil, nil)
			if r.status != http.StatusOK {
				return r.status, ""
			}
			return r.status, pr.bodies(t, r.body)
		}
		for _, tc := range []struct {
			name   string
			stream string // its metadata read is held
			method string
			hdr    http.Header
			body   []byte
			// retry is the status of the write sent again once the
			// read landed; after it the stream reads want.
			retry []int
			want  string
		}{
			{"append to a stream not in memory", "/cold-append", http.MethodPost, text, []byte("a;"),
				[]int{pr.appendStatus}, "a;"},
			{"close of a stream not in memory", "/cold-close", http.MethodPost, http.Header{closed: {"true"}}, nil,
				[]int{http.StatusOK, http.StatusNoContent}, ""},
			{"create with a body of a stream not in memory", "/cold-create", http.MethodPut, text, []byte("c;"),
				createAgain, ""},
			{"create with a body of a new name", "/new-create", http.MethodPut, text, []byte("n;"),
				[]int{http.StatusCreated}, "n;"},
			// A create without a body writes its metadata create-only
			// first, and reads what holds the name when that is refused.
			{"create of a stream not in memory", "/cold-create-empty", http.MethodPut, text, nil,
				[]int{http.StatusOK}, ""},
		} {
			t.Run(strings.TrimPrefix(m.prefix, "/")+"/"+tc.name, func(t *testing.T) {
				path := m.prefix + tc.stream + m.tag()
				heldWrite(t, sc, p, write, testenv.Fault{Op: testenv.OpGet, KeyContains: hex.EncodeToString([]byte(tc.stream+m.tag())) + ".m"},
					"nothing was stored", tc.method, path, tc.hdr, tc.body)
				if r := do(t, tc.method, path, tc.hdr, tc.body); !slices.Contains(tc.retry, r.status) {
					t.Errorf("%s %s again once the read landed: %v, want one of %v", tc.method, path, r, tc.retry)
				}
				if status, got := read(t, path); status != http.StatusOK || got != tc.want {
					t.Errorf("after the refused write and its retry, %s reads %d %q, want 200 %q", path, status, got, tc.want)
				}
			})
		}
	}
}

// heldWrite sends a write whose store requests matching held (its WAL
// upload, say) the proxy parks past the server's write timeout, checks
// with answeredInTime that it is answered in time saying want, then
// releases the request and waits for it to land.
func heldWrite(t *testing.T, sc *siteClient, p *testenv.Proxy, write time.Duration, held testenv.Fault, want, method, path string, hdr http.Header, body []byte) {
	t.Helper()
	release := p.Hold(held)
	defer release()
	answeredInTime(t, sc, write, fmt.Sprintf("%s %s, its %s %q held", method, path, held.Op, held.KeyContains), want, method, path, hdr, body)
	if p.Held() == 0 {
		t.Errorf("%s %s: no %s %q was held", method, path, held.Op, held.KeyContains)
	}
	release()
	lctx, lcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer lcancel()
	if err := p.WaitLanded(lctx); err != nil {
		t.Fatalf("the held request did not land: %v", err)
	}
}

// answeredInTime sends a write that cannot finish before the server's
// write timeout and checks that it is answered 503 with Retry-After and a
// reason saying want before the timeout cuts the response.
func answeredInTime(t *testing.T, sc *siteClient, write time.Duration, what, want, method, path string, hdr http.Header, body []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), write+10*time.Second)
	defer cancel()
	start := time.Now()
	r, err := sc.do(ctx, method, path, hdr, body)
	took := time.Since(start)
	switch {
	case err != nil:
		t.Errorf("%s past write %v: %v after %v, want a 503 before the timeout", what, write, err, took.Round(time.Millisecond))
	case r.status != http.StatusServiceUnavailable || r.header.Get("Retry-After") == "" ||
		!strings.Contains(string(r.body), want):
		t.Errorf("%s past write %v: %v, want 503 with Retry-After saying %q", what, write, r, want)
	case took >= write:
		t.Errorf("%s: answered after %v, past the write timeout %v", what, took, write)
	}
}

// withTTL is hdr with the protocol's TTL header set to secs.
func withTTL(hdr http.Header, pico bool, secs string) http.Header {
	h := hdr.Clone()
	if pico {
		h.Set("Pico-TTL", secs)
	} else {
		h.Set("Stream-TTL", secs)
	}
	return h
}

// lateBody is a request body whose rest follows its first bytes after a
// pause, as from a slow client.
type lateBody struct {
	first, rest []byte
	pause       time.Duration
	step        int
}

func (b *lateBody) Read(p []byte) (int, error) {
	b.step++
	switch b.step {
	case 1:
		return copy(p, b.first), nil
	case 2:
		time.Sleep(b.pause)
		return copy(p, b.rest), nil
	}
	return 0, io.EOF
}
