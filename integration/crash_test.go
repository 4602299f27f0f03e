package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestCrashRecovery SIGKILLs Caddy again and again under concurrent appends
// to 50 streams and long-poll readers on all of them, and restarts the same
// node each time: on versitygw behind the S3 proxy, where some kills come
// while the proxy holds WAL uploads open, and on the embedded default, a
// local directory, where each kill lands wherever the load has the process.
// Afterwards every acknowledged append must be in its stream exactly once,
// byte-exact and in order; an append whose request failed may be there at
// most once; and every byte a reader was served before a kill must still be
// at the offset it was served at.
func TestCrashRecovery(t *testing.T) {
	for _, backend := range []string{"s3", "file"} {
		t.Run(backend, func(t *testing.T) {
			t.Parallel()
			crashRecovery(t, backend)
		})
	}
}

func crashRecovery(t *testing.T, backend string) {
	const (
		streams    = 50
		kills      = 6
		heldKills  = 3 // of the kills on S3, how many happen while WAL uploads are held
		minBetween = 2 * time.Second
		maxBetween = 6 * time.Second
		// Before this kill the process lives long enough to compact.
		compactKill = 2
		// This kill comes right after the restart before it.
		recoveryKill = 4
		// Shorter than the default 30s, so that compaction runs in several
		// incarnations, not only the one before compactKill.
		compactEvery = 5 * time.Second
	)
	// The kill schedule follows from the seed; set PICOMQ_CRASH_SEED to
	// replay a run's schedule (timing still varies with the machine).
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("PICOMQ_CRASH_SEED"); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("PICOMQ_CRASH_SEED: %v", err)
		}
		seed = n
	}
	rng := rand.New(rand.NewPCG(seed, seed>>7))
	t.Logf("random seed %d (PICOMQ_CRASH_SEED)", seed)

	// A tiny cache, so that reads really go to the storage.
	directives := []string{"cache_size 4KiB", "long_poll_timeout 2s", "s3_timeout 5s",
		fmt.Sprintf("compact_interval %s", compactEvery)}
	var (
		p       *testenv.Proxy // nil on the local directory
		opts    caddytest.Options
		fileDir string
	)
	switch backend {
	case "s3":
		v := testenv.NewVersity(t)
		p = newProxy(t, v)
		opts = caddyOptions(v, caddytest.S3Storage(t, v, p.URL()), directives...)
	case "file":
		fileDir = filepath.Join(t.TempDir(), "store")
		opts = caddytest.Options{Storage: "file://" + fileDir, Directives: directives, ReadyTimeout: 90 * time.Second}
	default:
		t.Fatalf("unknown backend %q", backend)
	}
	c := caddytest.Start(t, opts)
	cl := newClient(t, c.URL(), true)

	names := make([]string, streams)
	for i := range names {
		names[i] = fmt.Sprintf("/crash/s%02d", i)
		cl.create(t, names[i], 30*time.Second)
	}

	var epoch atomic.Int64 // kills so far
	abort, abortCancel := context.WithCancel(context.Background())
	stopWriters := make(chan struct{})
	readCtx, stopReaders := context.WithCancel(abort)
	var writersWG, readersWG sync.WaitGroup
	var stopOnce sync.Once
	// If the test ends early (t.Fatal), stop every loop before the Caddy
	// child is killed by its own cleanup, registered earlier.
	t.Cleanup(func() {
		stopOnce.Do(func() { close(stopWriters) })
		stopReaders()
		abortCancel()
		writersWG.Wait()
		readersWG.Wait()
	})

	writers := make([]*writer, streams)
	tailers := make([]*tailer, streams)
	for i, name := range names {
		writers[i] = newWriter(abort, cl, i, name, 150*time.Millisecond)
		tailers[i] = newTailer(cl, name, func() int { return int(epoch.Load()) })
		writersWG.Add(1)
		go func() { defer writersWG.Done(); writers[i].run(stopWriters) }()
		readersWG.Add(1)
		go func() { defer readersWG.Done(); tailers[i].run(readCtx) }()
	}

	// killTimes[k] is when kill k happened; restarts[k] how long the
	// restart after it took.
	chaosBegan := time.Now()
	var killTimes []time.Time
	var restarts []time.Duration
	held := 0
	for k := 0; k < kills; k++ {
		gap := minBetween + randDur(rng, maxBetween-minBetween)
		switch k {
		case compactKill:
			// Long enough for the engine's first compaction pass (every
			// compactEvery), with the kill landing after or during it.
			gap = compactEvery + randDur(rng, 4*time.Second)
		case recoveryKill:
			// Right after the restart: likely while the new process is
			// still sealing and replaying the WAL of the ones before.
			gap = randDur(rng, 300*time.Millisecond)
		}
		time.Sleep(gap)
		wantHold := p != nil && k%2 == 1 && held < heldKills && k != recoveryKill
		var release func()
		if wantHold {
			// Park the next WAL upload (Times 1: later ones may land
			// beyond the hole) or all of them (Times 0).
			times := rng.IntN(2)
			release = p.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: "/wal/", Times: times})
			wctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			err := p.WaitHeld(wctx, 1)
			cancel()
			if err != nil {
				release()
				t.Fatalf("kill %d: no WAL upload reached the proxy within 10s while writers were busy", k)
			}
			time.Sleep(randDur(rng, 300*time.Millisecond))
			held++
		}
		killTimes = append(killTimes, time.Now())
		c.Kill()
		epoch.Add(1)
		if release != nil {
			// The held upload lands after its writer died: before the
			// restart, or racing the new process's recovery.
			if rng.IntN(2) == 0 {
				release()
			} else {
				d := randDur(rng, 500*time.Millisecond)
				go func() { time.Sleep(d); release() }()
			}
		}
		time.Sleep(randDur(rng, 500*time.Millisecond))
		began := time.Now()
		c.Restart()
		restarts = append(restarts, time.Since(began))
	}
	chaosTook := time.Since(chaosBegan)
	// Let the last incarnation serve a while, then stop the writers.
	time.Sleep(3 * time.Second)
	stopOnce.Do(func() { close(stopWriters) })
	writersWG.Wait()

	// Final state: every stream read from its start, and every reader
	// caught up with it.
	verifyBegan := time.Now()
	contents, tails, err := readAllParallel(cl, names, 4, 2*time.Minute)
	if err != nil {
		t.Fatalf("final read: %v", err)
	}
	finalReadTook := time.Since(verifyBegan)
	caughtUp := waitFor(30*time.Second, func() bool {
		for i := range tailers {
			if tailers[i].at() != tails[i] {
				return false
			}
		}
		return true
	})
	stopReaders()
	readersWG.Wait()
	catchUpTook := time.Since(verifyBegan) - finalReadTook

	var acked, failed, answered, served, chunks, polls, ackOffsetsChecked int
	statuses := map[int]int{}
	for i := range names {
		a, f := writers[i].counts()
		acked += a
		failed += f
		for st, n := range writers[i].statusCounts() {
			statuses[st] += n
			answered += n
		}
		for _, pr := range writers[i].verify(contents[i]) {
			t.Error(pr)
		}
		tl := tailers[i]
		for _, e := range tl.errs {
			t.Error(e)
		}
		served += len(tl.content)
		chunks += len(tl.chunks)
		polls += tl.polls
		// Offsets from acknowledgements and from reads must agree: where
		// an acknowledged append's Stream-Next-Offset was also a read
		// offset, it must sit right after that append's bytes.
		checked, probs := ackOffsetsAgree(writers[i], tl, contents[i], tails[i])
		ackOffsetsChecked += checked
		for _, pr := range probs {
			t.Error(pr)
		}
		if !bytes.HasPrefix(contents[i], tl.content) {
			d := firstDiff(contents[i], tl.content)
			t.Errorf("%s: the long-poll reader was served bytes the stream does not hold: first difference at byte %d: "+
				"reader %s, stream %s", names[i], d, around(tl.content, d), around(contents[i], d))
		}
	}
	if !caughtUp {
		for i := range tailers {
			if at := tailers[i].at(); at != tails[i] {
				t.Errorf("%s: long-poll reader stopped at %s, tail is %s", names[i], at, tails[i])
			}
		}
	}
	if acked == 0 {
		t.Fatal("no append was acknowledged")
	}

	// Re-read from the offsets readers were served at: the riskiest ones
	// (served shortly before a kill) all, the others sampled.
	toCheck := pickChunks(rng, tailers, killTimes, 500*time.Millisecond, 200)
	rereadBegan := time.Now()
	rereadProblems, rereadBytes := rereadChunks(cl, toCheck, 4)
	rereadTook := time.Since(rereadBegan)
	for _, pr := range rereadProblems {
		t.Error(pr)
	}
	var verified int
	for i := range contents {
		verified += len(contents[i])
	}
	t.Logf("streams %d, kills %d (%d while WAL uploads were held) in %s, restarts took %v; verification took %s (final reads %s, readers catching up %s, re-reads %s)",
		streams, kills, held, chaosTook.Round(time.Millisecond), roundAll(restarts),
		time.Since(verifyBegan).Round(time.Millisecond), finalReadTook.Round(time.Millisecond),
		catchUpTook.Round(time.Millisecond), rereadTook.Round(time.Millisecond))
	t.Logf("appends acknowledged %d, failed %d (%d with an HTTP status, the others without an answer); bytes verified %d; long-poll polls %d, chunks served %d (%d bytes); "+
		"offsets re-read %d (%d bytes); acknowledged offsets matched to read offsets %d",
		acked, failed, answered, verified, polls, chunks, served, len(toCheck), rereadBytes, ackOffsetsChecked)
	if len(statuses) > 0 {
		t.Logf("failed appends by HTTP status: %v", statuses)
	}
	dataPuts, packPuts := compactionWrites(t, p, fileDir)
	if dataPuts+packPuts == 0 {
		t.Errorf("no data object or pack was written: compaction never ran, so its interplay with crashes went untested")
	}
	t.Logf("written by compaction: %d data objects, %d packs", dataPuts, packPuts)
	if p != nil {
		counts := p.Counts()
		t.Logf("S3 requests through the proxy: PUT %d, GET %d, LIST %d, DELETE %d, HEAD %d, other %d",
			counts.Put, counts.Get, counts.List, counts.Delete, counts.Head, counts.Other)
	}
}

// compactionWrites counts the data objects and packs compaction wrote: the
// PUTs the proxy saw, or on a local directory (p nil) the files under dir
// now, which compaction of the last incarnations may have replaced but
// never all of.
func compactionWrites(t *testing.T, p *testenv.Proxy, dir string) (data, packs int) {
	t.Helper()
	if p != nil {
		counts := p.Counts()
		return counts.PutsUnder(caddytest.S3Prefix + "/data/"), counts.PutsUnder(caddytest.S3Prefix + "/pack/")
	}
	for sub, n := range map[string]*int{"data": &data, "pack": &packs} {
		err := filepath.WalkDir(filepath.Join(dir, sub), func(_ string, d fs.DirEntry, err error) error {
			if err == nil && d.Type().IsRegular() {
				*n++
			}
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		})
		if err != nil {
			t.Fatalf("count %s files: %v", sub, err)
		}
	}
	return data, packs
}

// randDur returns a random duration in [0, d) from rng, so that a run's
// schedule follows from its logged seed.
func randDur(rng *rand.Rand, d time.Duration) time.Duration {
	return time.Duration(rng.Int64N(int64(d)))
}

// ackOffsetsAgree compares the Stream-Next-Offset of each acknowledged
// append with the offsets the reader was served at (and the final tail):
// when the same token shows up in both, it must name the byte position just
// after the append's line in the final content.
func ackOffsetsAgree(w *writer, tl *tailer, content []byte, tail string) (checked int, problems []string) {
	posOf := map[string]int{tail: len(content)}
	for _, ch := range tl.chunks {
		posOf[ch.offset] = ch.pos
	}
	lineEnd := map[int]int{}
	prefix := fmt.Sprintf("w%02d-", w.idx)
	for pos := 0; pos < len(content); {
		i := bytes.IndexByte(content[pos:], '\n')
		if i < 0 {
			break
		}
		var n int
		if _, err := fmt.Sscanf(string(content[pos:pos+i]), prefix+"%d", &n); err == nil {
			lineEnd[n] = pos + i + 1
		}
		pos += i + 1
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for n, off := range w.acked {
		pos, ok := posOf[off]
		end, present := lineEnd[n]
		if !ok || !present {
			continue
		}
		checked++
		if pos != end && len(problems) < 10 {
			problems = append(problems, fmt.Sprintf("%s: append %d was acknowledged with Stream-Next-Offset %s, "+
				"which reads start at byte %d, but the append ends at byte %d", w.name, n, off, pos, end))
		}
	}
	return checked, problems
}

// checkChunk is a chunk a reader was served, to be re-read.
type checkChunk struct {
	name string
	servedChunk
}

// pickChunks selects the chunks to re-read: every chunk served within
// window before a kill, then others at random, up to limit in all.
func pickChunks(rng *rand.Rand, tailers []*tailer, kills []time.Time, window time.Duration, limit int) []checkChunk {
	var risky, rest []checkChunk
	for _, tl := range tailers {
		for _, ch := range tl.chunks {
			cc := checkChunk{name: tl.name, servedChunk: ch}
			isRisky := false
			for _, k := range kills {
				if ch.at.Before(k) && k.Sub(ch.at) <= window {
					isRisky = true
					break
				}
			}
			if isRisky {
				risky = append(risky, cc)
			} else {
				rest = append(rest, cc)
			}
		}
	}
	rng.Shuffle(len(risky), func(i, j int) { risky[i], risky[j] = risky[j], risky[i] })
	rng.Shuffle(len(rest), func(i, j int) { rest[i], rest[j] = rest[j], rest[i] })
	out := append(risky, rest...)
	if len(out) > limit {
		out = out[:limit]
	}
	return out
}

// rereadChunks reads each chunk's offset again with catch-up reads and
// compares the bytes with what was served there.
func rereadChunks(cl *dsClient, chunks []checkChunk, workers int) (problems []string, bytesRead int) {
	var mu sync.Mutex
	var wg sync.WaitGroup
	work := make(chan checkChunk)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ch := range work {
				got, _, err := cl.readRange(ch.name, ch.offset, len(ch.data), 30*time.Second)
				mu.Lock()
				bytesRead += min(len(got), len(ch.data))
				switch {
				case err != nil:
					problems = append(problems, fmt.Sprintf("%s: re-reading offset %s: %v", ch.name, ch.offset, err))
				case !bytes.HasPrefix(got, ch.data):
					d := firstDiff(got, ch.data)
					problems = append(problems, fmt.Sprintf(
						"%s: offset %s (served after %d kills, at byte %d) now reads differently: at +%d served %s, now %s",
						ch.name, ch.offset, ch.epoch, ch.pos, d, around(ch.data, d), around(got, d)))
				}
				mu.Unlock()
			}
		}()
	}
	for _, ch := range chunks {
		work <- ch
	}
	close(work)
	wg.Wait()
	if len(problems) > 30 {
		problems = append(problems[:30], fmt.Sprintf("... and %d more", len(problems)-30))
	}
	return problems, bytesRead
}
