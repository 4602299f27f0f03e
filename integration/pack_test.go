package integration

import (
	"bytes"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestPacksKeepManySlowStreamsCheap: many streams with a few appends each
// between compactions share pack objects instead of each getting a data
// object and a checkpoint at every compaction. It counts at the S3 proxy
// what retiring the WAL costs, reads every stream back byte-exact from
// the packs after a SIGKILL, and after a reload with pack_below off sees
// every stream folded into data objects of its own and the packs deleted.
func TestPacksKeepManySlowStreamsCheap(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const streams, rounds = 200, 3
	p := newPackRig(t, "/packs/s", streams, rounds+1)
	e := p.e
	p.walRetired() // the creates' entries
	var packPuts, walPuts int
	for r := range rounds {
		d := p.round(r)
		packPuts += d(testenv.OpPut, "/pack/")
		walPuts += d(testenv.OpPut, "/wal/")
		if d(testenv.OpPut, "/pack/") == 0 {
			t.Fatalf("round %d: the WAL was retired without a pack", r)
		}
	}
	t.Logf("%d appends over %d streams: %d WAL PUTs, %d pack PUTs, no data objects or checkpoints", streams*rounds, streams, walPuts, packPuts)
	m := mMust(t, e.caddy.AdminAddr())
	if packed, written, live := m.sum("picomq_compaction_packed_total"), m.sum("picomq_packs_written_total"), m.sum("picomq_packs_live"); packed < streams*rounds || written < float64(packPuts) || live < 1 {
		t.Fatalf("metrics: %v streams packed, %v packs written, %v live; want at least %d, %d, and at least 1", packed, written, live, streams*rounds, packPuts)
	}
	if data := e.mustList("data/"); len(data) != 0 {
		t.Fatalf("data objects after packing: %d", len(data))
	}

	// A crash: the replay rebuilds the streams from the packs' indexes.
	e.caddy.Kill()
	e.caddy.Restart()
	before := e.proxy.Counts()
	p.readBack("after SIGKILL and restart", rounds)
	if gets := e.proxy.Counts().Containing(testenv.OpGet, "/pack/") - before.Containing(testenv.OpGet, "/pack/"); gets == 0 {
		t.Fatal("the reads after the restart fetched nothing from the packs")
	}
	p.appendRound(rounds) // the tails carry on where they were
	p.readBack("after appending past the restart", rounds+1)

	// pack_below off: the next compaction gives every stream data objects
	// of its own, and the packs leave the bucket.
	opts := caddytest.Options{Storage: testenv.StoreURL(e.proxy.URL(), e.bucket, caddytest.S3Prefix),
		Directives: []string{"compact_interval 1s", "pack_below off"}}
	if err := e.reload(e.caddy.Config(opts)); err != nil {
		t.Fatal(err)
	}
	err := e.waitGone("pack/")
	if err != nil {
		t.Fatalf("pack_below off: %v", err)
	}
	if data := e.mustList("data/"); len(data) < streams {
		t.Fatalf("%d data objects for %d folded streams", len(data), streams)
	}
	if m := mMust(t, e.caddy.AdminAddr()); m.sum("picomq_compaction_folds_total") < streams || m.sum("picomq_packs_live") != 0 {
		t.Fatalf("metrics after folding: %v folds, %v live packs; want at least %d and 0",
			m.sum("picomq_compaction_folds_total"), m.sum("picomq_packs_live"), streams)
	}
	e.caddy.Kill()
	e.caddy.Restart()
	p.readBack("after folding and a restart", rounds+1)
}

// TestPacksRepackStreamsAtTheirRunCap: a stream with an append at every
// compaction gets a pack run at each; at its cap (10 to 16 runs, by its
// name) it is repacked into one run instead of getting a data object and a
// checkpoint. A SIGKILL while older packs still hold the repacked streams'
// old runs (other streams read those packs) loses nothing. The restarted
// process checkpoints each stream its replay brought back at the first
// compaction that finds something new in it (a checkpoint of the killed
// process may still land: see TestLateCheckpointThenPacks), so after a
// round every stream is folded and the packs leave the bucket; from then
// on the streams share packs again.
func TestPacksRepackStreamsAtTheirRunCap(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const streams, rounds = 40, 15
	p := newPackRig(t, "/repack/s", streams, rounds)
	e := p.e
	p.walRetired()
	const crashAfter = 12 // streams with caps of 10 and 11 repacked, the others not yet
	for r := range crashAfter {
		p.round(r)
	}
	repacked := mMust(t, e.caddy.AdminAddr()).sum("picomq_compaction_repacked_total")
	if repacked == 0 || repacked >= streams {
		t.Fatalf("%v repacks after %d rounds; want some of the %d streams (those with the lowest caps), not all", repacked, crashAfter, streams)
	}
	e.caddy.Kill()
	e.caddy.Restart()
	// Counted from the restart: a compaction that finds the killed
	// process's last entries in the WAL folds their streams before the
	// round's appends do.
	before := e.proxy.Counts()
	p.readBack("after SIGKILL with some streams repacked", crashAfter)
	p.appendRound(crashAfter)
	p.walRetired()
	if meta := e.proxy.Counts().Containing(testenv.OpPut, "/streams/") - before.Containing(testenv.OpPut, "/streams/"); meta < streams {
		t.Fatalf("the first round after the restart wrote %d checkpoints; want every one of the %d replayed streams folded", meta, streams)
	}
	if err := e.waitGone("pack/"); err != nil {
		t.Fatalf("every stream folded: %v", err)
	}
	for r := crashAfter + 1; r < rounds; r++ {
		p.round(r) // packed again
	}
	if packs := e.mustList("pack/"); len(packs) == 0 {
		t.Fatal("no packs after the rounds past the restart")
	}
	e.caddy.Kill()
	e.caddy.Restart()
	p.readBack("after packing again and a SIGKILL", rounds)
}

// packRig is streams that each take one small append per round, compacted
// after each round (compact_interval 1s).
type packRig struct {
	t       *testing.T
	e       *fhEnv
	paths   []string
	records [][][]byte
	tails   []string
}

const packRigType = "application/octet-stream"

func newPackRig(t *testing.T, prefix string, streams, rounds int) *packRig {
	t.Helper()
	p := &packRig{t: t, e: fhStart(t, fhOptions{Directives: []string{"compact_interval 1s"}}),
		paths: make([]string, streams), records: make([][][]byte, streams), tails: make([]string, streams)}
	for s := range streams {
		p.paths[s] = fmt.Sprintf("%s%03d", prefix, s)
		p.e.create(p.paths[s], packRigType)
		p.records[s] = fhRandomRecords(uint64(7000+s), rounds, 200+s)
	}
	return p
}

// appendRound appends record r to every stream, 16 at a time.
func (p *packRig) appendRound(r int) {
	p.t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, len(p.paths))
	sem := make(chan struct{}, 16)
	for s, path := range p.paths {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			resp, err := p.e.send(fhReq{Method: http.MethodPost, Path: path, Header: map[string]string{"Content-Type": packRigType}, Body: p.records[s][r]})
			switch {
			case err != nil:
				errs <- err
			case resp.Status/100 != 2:
				errs <- fmt.Errorf("POST %s: %s", path, resp)
			default:
				p.tails[s] = resp.Header.Get("Stream-Next-Offset")
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		p.t.Fatal(err)
	}
}

// walRetired waits until no WAL object that held records is left.
func (p *packRig) walRetired() {
	p.t.Helper()
	wal := p.e.mustList("wal/")
	err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
		now := fhKeySet(p.e.mustList("wal/"))
		for _, o := range wal {
			if now[o.Key] {
				return fmt.Errorf("%s is still there", o.Key)
			}
		}
		return nil
	})
	if err != nil {
		p.t.Fatalf("WAL objects not retired by compaction (compact_interval 1s): %v", err)
	}
}

// round appends record r everywhere and waits for the WAL to be retired;
// retiring it must write no data object or checkpoint. It returns the S3
// proxy's count of requests of an operation on keys containing a string
// over the round.
func (p *packRig) round(r int) func(op, sub string) int {
	p.t.Helper()
	before := p.e.proxy.Counts()
	p.appendRound(r)
	p.walRetired()
	after := p.e.proxy.Counts()
	d := func(op, sub string) int { return after.Containing(op, sub) - before.Containing(op, sub) }
	if data, meta := d(testenv.OpPut, "/data/"), d(testenv.OpPut, "/streams/"); data != 0 || meta != 0 {
		p.t.Fatalf("round %d: compacting %d streams with one small append each wrote %d data objects and %d checkpoints; want them packed",
			r, len(p.paths), data, meta)
	}
	return d
}

// readBack reads every stream byte-exact: its first n records, ending at
// the offset its last append answered.
func (p *packRig) readBack(when string, n int) {
	p.t.Helper()
	for s, path := range p.paths {
		got, tail, err := p.e.readBytes(path)
		if err != nil {
			p.t.Fatalf("%s: %v", when, err)
		}
		if want := bytes.Join(p.records[s][:n], nil); !bytes.Equal(got, want) {
			p.t.Fatalf("%s: %s reads %d bytes, want the %d written (equal prefix %d)", when, path, len(got), len(want), fhCommonPrefix(got, want))
		}
		if tail != p.tails[s] {
			p.t.Fatalf("%s: %s ends at %s; its last append answered %s", when, path, tail, p.tails[s])
		}
	}
}

// TestStreamWithManyProducersIsFoldedThroughCaddy: a stream appended to by
// more than 16 idempotent producers gets a data object of its own at the
// compaction, where a stream with one producer goes into a pack: each pack
// index entry holds its stream's producers, and a stream with thousands of
// them put them all into every pack it was in. Both read back whole.
func TestStreamWithManyProducersIsFoldedThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s"}})
	const ct = "text/plain"
	const many, one = "/producers/many", "/producers/one"
	e.create(many, ct)
	e.create(one, ct)
	produce := func(path, id string, seq int, body string) {
		t.Helper()
		e.must(fhReq{Method: http.MethodPost, Path: path, Body: []byte(body), Header: map[string]string{
			"Content-Type": ct, "Producer-Id": id, "Producer-Epoch": "0", "Producer-Seq": fmt.Sprint(seq)}})
	}
	var wantMany, wantOne string
	for i := range 17 {
		body := fmt.Sprintf("m%02d;", i)
		produce(many, fmt.Sprintf("p%02d", i), 0, body)
		wantMany += body
	}
	for i := range 3 {
		body := fmt.Sprintf("o%d;", i)
		produce(one, "p", i, body)
		wantOne += body
	}
	if err := e.waitGone("wal/"); err != nil {
		t.Fatalf("not compacted: %v", err)
	}
	manyData := e.mustList("data/" + e.streamID(many) + "/")
	oneData := e.mustList("data/" + e.streamID(one) + "/")
	packs := e.mustList("pack/")
	t.Logf("data objects: %d of the stream with 17 producers, %d of the one with 1; %d packs", len(manyData), len(oneData), len(packs))
	if len(manyData) != 1 || len(oneData) != 0 || len(packs) == 0 {
		t.Fatalf("%d data objects of the stream with 17 producers, %d of the one with 1, %d packs; want 1, 0 and some",
			len(manyData), len(oneData), len(packs))
	}
	for path, want := range map[string]string{many: wantMany, one: wantOne} {
		got, _, err := e.readBytes(path)
		if err != nil || string(got) != want {
			t.Fatalf("read %s: %q (%v), want %q", path, got, err, want)
		}
	}
}
