package integration

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// While the store stalls, appends stop joining once the bytes waiting for
// it reach max_pending: each further append is answered 503 with
// Retry-After at once, and nothing of it is ever stored. The appends that
// joined are acknowledged when the store comes back, and the streams hold
// exactly them. Small appends wait in the WAL writer; large ones (256 KiB
// and more) wait in their own blob uploads, on a stream each, since one
// stream's large appends queue behind each other rather than being refused.
func TestAppendsRefusedPastMaxPending(t *testing.T) {
	for _, tc := range []refusalCase{
		{"WAL entries", 64 << 10, 16 << 10, 16, false, "/wal/", 5},
		{"large appends' blobs", 1 << 20, 300 << 10, 8, true, "/blob/", 4},
	} {
		t.Run(tc.name, func(t *testing.T) { testRefusedPastMaxPending(t, tc) })
	}
}

// refusalCase is one run of TestAppendsRefusedPastMaxPending.
type refusalCase struct {
	name      string
	bound     int    // max_pending in bytes
	size      int    // bytes per append
	appends   int    // sent one after the other, 20 ms apart
	streams   bool   // a stream per append rather than one for all
	held      string // key part of the PUTs the proxy holds
	maxJoined int    // appends that fit under the bound, at most
}

func testRefusedPastMaxPending(t *testing.T, tc refusalCase) {
	e := fhStart(t, fhOptions{
		Directives: []string{fmt.Sprintf("max_pending %d", tc.bound)},
		Optional:   []string{"compact_interval 1h"},
	})
	path := func(i int) string {
		if tc.streams {
			return fmt.Sprintf("/busy/stream-%02d", i)
		}
		return "/busy/stream"
	}
	for i := range tc.appends {
		if i == 0 || tc.streams {
			e.create(path(i), "application/octet-stream")
		}
	}

	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: tc.held})
	released := false
	defer func() {
		if !released {
			release()
		}
	}()

	bodies := make([][]byte, tc.appends)
	results := make([]fhResp, tc.appends)
	errs := make([]error, tc.appends)
	done := make(chan int, tc.appends)
	var wg sync.WaitGroup
	for i := range tc.appends {
		bodies[i] = bytes.Repeat([]byte{byte('a' + i)}, tc.size)
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = e.send(fhReq{Method: http.MethodPost, Path: path(i),
				Header: map[string]string{"Content-Type": "application/octet-stream"}, Body: bodies[i]})
			done <- i
		}()
		// One at a time, so that the first ones join whatever the
		// scheduling: the refusals are the later ones.
		time.Sleep(20 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := e.proxy.WaitHeld(ctx, 1); err != nil {
		t.Fatalf("no upload of %s reached the store: %v", tc.held, err)
	}

	// At most tc.maxJoined appends fit under the bound; every other one must
	// be answered while the store is still stalled.
	refused := map[int]bool{}
	for len(refused) < tc.appends-tc.maxJoined {
		select {
		case i := <-done:
			if errs[i] != nil {
				t.Fatalf("append %d: %v", i, errs[i])
			}
			r := results[i]
			if r.Status != http.StatusServiceUnavailable || r.Header.Get("Retry-After") == "" ||
				!strings.Contains(string(r.Body), "too many appends are waiting for storage") {
				t.Fatalf("append %d answered while the store stalled: %s (Retry-After %q), want 503 busy",
					i, r, r.Header.Get("Retry-After"))
			}
			if r.Took > 5*time.Second {
				t.Errorf("append %d refused after %s, want at once", i, r.Took)
			}
			refused[i] = true
		case <-ctx.Done():
			t.Fatalf("only %d of %d appends refused while the store stalled", len(refused), tc.appends)
		}
	}
	s, err := mGet(e.caddy.AdminAddr())
	if err != nil {
		t.Fatalf("metrics: %v", err)
	}
	if got := s.sum("picomq_appends_refused_busy_total"); got < float64(len(refused)) {
		t.Errorf("picomq_appends_refused_busy_total = %v, want at least %d", got, len(refused))
	}
	if got := s.sum("picomq_wal_pending_bytes"); got < float64(tc.bound) {
		t.Errorf("picomq_wal_pending_bytes = %v while refusing, want at least %d", got, tc.bound)
	}

	release()
	released = true
	wg.Wait()
	close(done)
	for i := range done {
		if errs[i] != nil {
			t.Fatalf("append %d: %v", i, errs[i])
		}
		switch r := results[i]; {
		case r.Status/100 == 2:
		case r.Status == http.StatusServiceUnavailable && strings.Contains(string(r.Body), "too many appends are waiting for storage"):
			refused[i] = true // refused too, answered after the count above
		default:
			t.Errorf("append %d after the store came back: %s, want 2xx (or the busy 503)", i, r)
		}
	}

	check := func(p string, want []byte) {
		t.Helper()
		got, _, err := e.readBytes(p)
		if err != nil {
			t.Fatalf("read back %s: %v", p, err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s holds %d bytes (%s), want %d (%s)", p, len(got), runsOf(got), len(want), runsOf(want))
		}
	}
	var all []byte
	for i := range tc.appends {
		var want []byte
		if !refused[i] {
			want = bodies[i]
		}
		if tc.streams {
			check(path(i), want)
		}
		all = append(all, want...)
	}
	if !tc.streams {
		check(path(0), all)
	}
	t.Logf("store stalled: %d of %d appends of %d KiB joined, %d refused with 503 at once; all joined ones acknowledged once it came back",
		tc.appends-len(refused), tc.appends, tc.size>>10, len(refused))
}

// runsOf describes b as runs of one repeated byte ("a x16384, b x16384").
func runsOf(b []byte) string {
	var parts []string
	for len(b) > 0 {
		n := 1
		for n < len(b) && b[n] == b[0] {
			n++
		}
		parts = append(parts, fmt.Sprintf("%c x%d", b[0], n))
		b = b[n:]
	}
	return strings.Join(parts, ", ")
}

// TestMaxPendingBoundsMemoryOfTinyRecords: max_pending bounds the memory
// that appends waiting for a stalled store hold, however small their
// records. Appends of 20,000 one-byte JSON messages join one after the
// other while the WAL's PUTs are held, until one is refused; Caddy's live
// heap then has grown by little more than max_pending. Counted by their encoded size
// (17 bytes a record, where each holds a 64-byte Record and a 64-byte
// buffer), they held several times it before the first refusal.
func TestMaxPendingBoundsMemoryOfTinyRecords(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const maxPending = 8 << 20
	e := fhStart(t, fhOptions{Directives: []string{"max_pending 8MiB", "compact_interval 1h"}})
	const path, ct = "/busy/tiny", "application/json"
	e.create(path, ct)
	const perAppend = 20_000
	body := digitMessages(perAppend)
	pending := func() float64 { return walPendingBytes(t, e) }
	base := e.heapAlloc(true)

	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/"})
	released := false
	defer func() {
		if !released {
			release()
		}
	}()
	waiting, heap := joinUntilRefused(t, e, 100, pending, func(int) fhReq {
		return fhReq{Method: http.MethodPost, Path: path, Header: map[string]string{"Content-Type": ct}, Body: body}
	})
	mib := func(b float64) float64 { return b / (1 << 20) }
	t.Logf("%d appends of %d one-byte records joined before one was refused, max_pending %d MiB: live heap %.1f MiB before, %.1f MiB then (%.1f MiB pending counted)",
		len(waiting), perAppend, maxPending>>20, mib(base), mib(heap), mib(pending()))
	// The writer counts the entries; each waiting request also holds its
	// body and its own slice of the records (48 bytes each) until it is
	// answered: half as much again with records this small.
	if grew := heap - base; grew > 5*maxPending/2 {
		t.Errorf("appends waiting for the store grew the live heap by %.1f MiB with max_pending %d MiB", mib(grew), maxPending>>20)
	}

	release()
	released = true
	for i, ch := range waiting {
		if r := <-ch; r.err != nil || r.resp.Status/100 != 2 {
			t.Fatalf("append %d, joined, once the store came back: %v %s", i, r.err, r.resp)
		}
	}
	msgs, _, err := e.readJSON(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(msgs) != len(waiting)*perAppend {
		t.Errorf("%s holds %d messages, want the %d of the %d appends that joined", path, len(msgs), len(waiting)*perAppend, len(waiting))
	}
}

// TestMaxPendingBoundsLargeAppendsOfTinyRecords: a large append (256 KiB
// of bodies or more, uploaded as a blob of its own) counts against
// max_pending what its records hold in memory, as a small append's WAL
// entry does, not its bodies' bytes alone. Appends of 30,000 nine-byte
// JSON messages, each to a stream of its own, join one after the other
// while the blob PUTs are held, until one is refused; Caddy's live heap
// then has grown by little more than max_pending. Each such append holds
// about 4 MiB (a 64-byte Record and a 64-byte buffer per message, and its
// encoded blob), and was counted at its 270,000 bytes of bodies: 24 of
// them joined under a max_pending of 6 MiB, and the live heap grew by
// 139 MiB.
func TestMaxPendingBoundsLargeAppendsOfTinyRecords(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const maxPending = 6 << 20
	e := fhStart(t, fhOptions{Directives: []string{"max_pending 6MiB", "compact_interval 1h"}})
	const ct, perAppend, most = "application/json", 30_000, 40
	path := func(i int) string { return fmt.Sprintf("/busy/large-%02d", i) }
	for i := range most {
		e.create(path(i), ct)
	}
	body := numberMessages(perAppend, 100_000_000)
	pending := func() float64 { return walPendingBytes(t, e) }
	base := e.heapAlloc(true)

	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "/blob/"})
	released := false
	defer func() {
		if !released {
			release()
		}
	}()
	waiting, heap := joinUntilRefused(t, e, most, pending, func(i int) fhReq {
		return fhReq{Method: http.MethodPost, Path: path(i), Header: map[string]string{"Content-Type": ct}, Body: body}
	})
	mib := func(b float64) float64 { return b / (1 << 20) }
	t.Logf("%d large appends of %d nine-byte records joined before one was refused, max_pending %d MiB: live heap %.1f MiB before, %.1f MiB then (%.1f MiB pending counted)",
		len(waiting), perAppend, maxPending>>20, mib(base), mib(heap), mib(pending()))
	// The last append to join may pass the bound by its own size, and
	// each waiting request also holds its body until it is answered.
	if grew := heap - base; grew > 3*maxPending {
		t.Errorf("large appends waiting for the store grew the live heap by %.1f MiB with max_pending %d MiB", mib(grew), maxPending>>20)
	}

	release()
	released = true
	for i, ch := range waiting {
		if r := <-ch; r.err != nil || r.resp.Status/100 != 2 {
			t.Fatalf("append %d, joined, once the store came back: %v %s", i, r.err, r.resp)
		}
		msgs, _, err := e.readJSON(path(i))
		if err != nil {
			t.Fatal(err)
		}
		if len(msgs) != perAppend {
			t.Errorf("%s holds %d messages, want the %d of its append", path(i), len(msgs), perAppend)
		}
	}
}

// TestAppendsQueuedBehindALargeAppendAreBounded: appends to a stream whose
// large append is still uploading wait for it (the large append holds the
// next seqs), and while they wait they hold their records in memory as
// appends waiting in the WAL do, so they count against max_pending: past
// it they are answered 503 with Retry-After at once and nothing of them is
// stored. They used to wait uncounted, however many came, for as long as
// the store stalled: sixteen appends of 25,000 nine-byte JSON messages
// behind a stalled large append grew the live heap by 49 MiB, with 0.3 MiB
// counted against a max_pending of 6 MiB. With nothing to wait for when
// all is well, the look at their
// answers is bounded, not a deadline: the heap is what is asserted.
func TestAppendsQueuedBehindALargeAppendAreBounded(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const maxPending = 6 << 20
	e := fhStart(t, fhOptions{Directives: []string{"max_pending 6MiB", "compact_interval 1h"}})
	const path, ct = "/busy/queue", "application/json"
	e.create(path, ct)
	const large, small, queued = 30_000, 25_000, 16 // 270,000 and 225,000 bytes of bodies
	pending := func() float64 { return walPendingBytes(t, e) }
	base := e.heapAlloc(true)

	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "/blob/"})
	released := false
	defer func() {
		if !released {
			release()
		}
	}()
	send := func(body []byte) chan fhResult {
		ch := make(chan fhResult, 1)
		go func() {
			r, err := e.send(fhReq{Method: http.MethodPost, Path: path, Header: map[string]string{"Content-Type": ct}, Body: body})
			ch <- fhResult{r, err}
		}()
		return ch
	}
	first := send(numberMessages(large, 100_000_000))
	if !waitFor(30*time.Second, func() bool { return pending() > 0 }) {
		t.Fatal("the large append did not start its upload in 30s")
	}
	var chans []chan fhResult
	for i := range queued {
		chans = append(chans, send(numberMessages(small, 200_000_000+i*small)))
	}
	answers := make([]*fhResult, queued)
	answered := func() int {
		n := 0
		for i, ch := range chans {
			if answers[i] == nil {
				select {
				case r := <-ch:
					answers[i] = &r
				default:
				}
			}
			if answers[i] != nil {
				n++
			}
		}
		return n
	}
	waitFor(5*time.Second, func() bool { return answered() >= queued-1 })
	answered()
	heap := e.heapAlloc(true)
	refused := 0
	for i, a := range answers {
		if a == nil {
			continue
		}
		if a.err != nil || a.resp.Status != http.StatusServiceUnavailable || a.resp.Header.Get("Retry-After") == "" {
			t.Fatalf("queued append %d answered while the store stalled: %v %s, want 503 busy with Retry-After", i, a.err, a.resp)
		}
		refused++
	}
	mib := func(b float64) float64 { return b / (1 << 20) }
	t.Logf("%d of %d appends queued behind a large append refused, max_pending %d MiB: live heap %.1f MiB before, %.1f MiB then (%.1f MiB pending counted)",
		refused, queued, maxPending>>20, mib(base), mib(heap), mib(pending()))
	if grew := heap - base; grew > 3*maxPending {
		t.Errorf("appends queued behind a stalled large append grew the live heap by %.1f MiB with max_pending %d MiB", mib(grew), maxPending>>20)
	}

	release()
	released = true
	if r := <-first; r.err != nil || r.resp.Status/100 != 2 {
		t.Fatalf("the large append, once the store came back: %v %s", r.err, r.resp)
	}
	joined := 0
	for i, ch := range chans {
		if answers[i] != nil {
			continue
		}
		// Taken, or refused as busy when the appends let go together
		// hold max_pending again: nothing of it is stored then.
		r := <-ch
		switch {
		case r.err == nil && r.resp.Status/100 == 2:
			joined++
		case r.err == nil && r.resp.Status == http.StatusServiceUnavailable && r.resp.Header.Get("Retry-After") != "":
		default:
			t.Fatalf("queued append %d, not refused, once the store came back: %v %s", i, r.err, r.resp)
		}
	}
	msgs, _, err := e.readJSON(path)
	if err != nil {
		t.Fatal(err)
	}
	if want := large + joined*small; len(msgs) != want {
		t.Errorf("%s holds %d messages, want the %d of the large append and the %d queued ones that were not refused", path, len(msgs), want, joined)
	}
}

// fhResult is the answer to a request sent on a goroutine of its own.
type fhResult struct {
	resp fhResp
	err  error
}

// walPendingBytes is what Caddy's WAL writer counts against max_pending.
func walPendingBytes(t *testing.T, e *fhEnv) float64 {
	t.Helper()
	s, err := mGet(e.caddy.AdminAddr())
	if err != nil {
		t.Fatalf("metrics: %v", err)
	}
	return s.sum("picomq_wal_pending_bytes")
}

// numberMessages is a JSON array of the n numbers from from on.
func numberMessages(n, from int) []byte {
	b := []byte{'['}
	for i := range n {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, int64(from+i), 10)
	}
	return append(b, ']')
}

// joinUntilRefused sends req(0), req(1), ... one at a time, with the store
// stalled, until one is answered 503 busy; each other one must join the
// appends waiting for the store (pending grows) first. It returns the
// answers to come of those that joined, and Caddy's live heap taken right
// after the refusal. More than most joining fails the test.
func joinUntilRefused(t *testing.T, e *fhEnv, most int, pending func() float64, req func(i int) fhReq) (waiting []chan fhResult, heap float64) {
	t.Helper()
	for i := 0; ; i++ {
		if i == most {
			t.Fatalf("%d appends joined with the store stalled", most)
		}
		before := pending()
		ch := make(chan fhResult, 1)
		go func() {
			r, err := e.send(req(i))
			ch <- fhResult{r, err}
		}()
		// It joins (what waits grows) or is answered: refused.
		var answer *fhResult
		if !waitFor(30*time.Second, func() bool {
			select {
			case r := <-ch:
				answer = &r
				return true
			default:
			}
			return pending() > before
		}) {
			t.Fatalf("append %d neither joined nor was answered in 30s", i)
		}
		if answer == nil {
			waiting = append(waiting, ch)
			continue
		}
		if answer.err != nil || answer.resp.Status != http.StatusServiceUnavailable {
			t.Fatalf("append %d answered while the store stalled: %v %s, want 503 busy", i, answer.err, answer.resp)
		}
		return waiting, e.heapAlloc(true)
	}
}
