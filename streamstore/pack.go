package streamstore

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"maps"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/segment"
)

// Packs keep many slow streams cheap. Retiring the WAL used to cost every
// stream with new records a data object and a checkpoint at each
// compaction, however few its records: 10,000 streams sharing 2,000
// appends/s cost 440 S3 requests per 1,000 appends. Now a compaction puts
// the small backlogs of busy streams into shared pack objects (one PUT for
// hundreds of streams) whose index carries each stream's state, and the
// manifest lists the live packs. A stream leaves the packs, folded into its
// own data objects and checkpoint as before, once its packed records are
// big or idle; a pack dies when no stream needs it any more. A stream that
// has been in the packs long, or has many runs there, is repacked instead:
// its packed records and its new ones become one entry of the next pack,
// so it stays cheap for as long as it stays small, and the packs it was in
// can die.
//
// A stream's records are in exactly one of the WAL, a pack or its data
// objects at every moment that a replay could see: a pack is listed in the
// manifest in the same update that retires the WAL it was cut from, and a
// fold's checkpoint (whose Upto passes the packed positions) is written
// before the manifest stops listing the pack.

const (
	// DefaultPackBelow is Config.PackBelow's default: a stream whose packed
	// and new records together pass this many bytes gets data objects of
	// its own. A busy stream fills a data object of its own soon enough.
	// Exported so that the module spells out the same default.
	DefaultPackBelow = 256 << 10
	// packResidency bounds how long a stream's records stay in one pack
	// run, so that packs die and a replay's index stays short: after it,
	// the stream's packed records are repacked (or folded if big). Each
	// stream's limit is between half of it and all of it (packLimits), so
	// that streams that came into the packs together are not all repacked
	// at one compaction.
	packResidency = 10 * time.Minute
	// packMaxRuns caps the pack runs of one stream (one per compaction
	// that packed it): they are what a replay reads (about 200 bytes of
	// index each) and memory keeps (about 300 bytes each). With 10,000
	// streams sharing 2,000 appends/s, a busy node compacts every 20 s or
	// so, and 32 runs a stream came to 90 MB of index for a restart. A
	// stream at its cap is repacked into one run. Each stream's cap is
	// between 10 and this (packLimits): with one cap for all, streams that
	// came in together left together (20,000 PUTs in one compaction,
	// before repacking), and would now be repacked together.
	packMaxRuns = 16
	// packTarget is the size a pack is closed at.
	packTarget = maxDataObject
	// packReadGap: pack runs read back for a fold are fetched by one
	// ranged GET when the bytes between them are fewer than this.
	packReadGap = 256 << 10
	// packReadBatch bounds the records a fold reads back from packs at
	// once, and the records a compaction gathers for packs at once, by
	// what they hold in memory (walRun.memSize).
	packReadBatch = 32 << 20
)

// packLimits are how long the oldest pack run of the stream called name
// may be, and how many runs it may have in the packs, before the stream is
// repacked.
func packLimits(name string) (stay time.Duration, runs int) {
	h := fnv.New32a()
	h.Write([]byte(name))
	sum := h.Sum32()
	return packResidency/2 + time.Duration(sum%8)*packResidency/16, packMaxRuns - int((sum>>8)%7)
}

// packIndexEntry is one stream's run in a pack's index: where its entry
// is, which WAL position the run reaches (for the checkpoint's Upto), and
// the stream's state after it. A repack entry holds every record of the
// stream since its checkpoint, and replaces the runs older packs have.
type packIndexEntry struct {
	Name   string      `json:"n"`
	ID     string      `json:"i"`
	First  uint64      `json:"f"`
	End    uint64      `json:"e"`
	Off    int64       `json:"o"`
	Len    int64       `json:"l"`
	Pos    walPos      `json:"p"`
	Packed int64       `json:"t"`
	State  writerState `json:"s"`
	Repack bool        `json:"r,omitempty"`
}

// packIndexBytes is about what a pack index entry takes besides its
// stream's name and ID (JSON field names, numbers, a writer state without
// producers): EncodePack's hint.
const packIndexBytes = 320

// packMaxProducers is the most producers a stream may have and still be
// packed. Every pack index entry holds the stream's writer state after its
// run, producers included: a public stream with thousands of producers put
// them all into the index of every pack it was in (about 80 bytes each),
// up to 16 runs of it, every one of them read and decoded into a map of
// its own by a replay. Folded, its producers are in its checkpoint once.
const packMaxProducers = 16

// packJob is a stream whose runs [from, to) are to be packed: its new WAL
// runs, and with repack its pack runs before them too (from is 0).
type packJob struct {
	s        *stream
	from, to int
	repack   bool
	est      int64  // what the runs hold once gather reads them (walRun.memSize)
	first    walPos // the position of runs[from], to check nothing moved
	leaveAt  int64  // when the stream is repacked next (Unix ms)
	maxRuns  int    // or after how many runs
	used     int64  // its last use (Unix ns)
	ent      *segment.Entry
	state    writerState
	pos      walPos
	size     int
}

// packDecision says what a compaction does with a stream that has runs
// before the cut: fold it (its own data objects and checkpoint), pack its
// new runs (repacking its packed ones with them when they are old or
// many), or leave it (it has nothing new and may stay in the packs).
type packDecision int

const (
	decideFold packDecision = iota
	decidePack
	decideLeave
)

// decide picks what the compaction cutting at end does with s, idle meaning
// unused since idleBefore (Unix ns) and small meaning a backlog of limit
// bytes or fewer. It fills job when the answer is decidePack.
func decide(s *stream, end walPos, now time.Time, idleBefore, limit int64, job *packJob) packDecision {
	s.mu.Lock()
	defer s.mu.Unlock()
	// Soft-deleted, it is folded, so that the fold deletes what no fork
	// reads (metaObject.thinTo), where packs would keep it; and so is a
	// stream with trimmed records a fold would delete. A trimmed source
	// that forks read used to be folded at every compaction for as long
	// as it had forks, though the first fold had deleted all it could.
	if s.gone || s.meta.Deleted || s.meta.trimPending() || s.used.Load() < idleBefore {
		return decideFold // gone: compactStream does nothing
	}
	from := 0
	for from < len(s.runs) && s.runs[from].snap != nil {
		from++
	}
	leaveAt := s.leavePacksLocked(now)
	_, maxRuns := packLimits(s.name)
	due := from >= maxRuns || (from > 0 && now.UnixMilli() >= leaveAt)
	to, size, mem, packedMem := 0, int64(0), int64(0), int64(0)
	for ; to < len(s.runs) && end.after(s.runs[to].pos); to++ {
		r := &s.runs[to]
		if r.blob != "" || r.ch.TrimTo != 0 {
			return decideFold
		}
		size += r.span.Len
		mem += r.memSize()
		if to < from {
			packedMem += r.memSize()
		}
	}
	if size > limit || (due && size > limit/2) {
		// Past half of the limit a stream due to be repacked is folded
		// instead: it would soon pass the limit anyway, and then at the
		// same compaction as every stream that grows as fast (10,000
		// streams at one rate passed it together, 20,000 PUTs at once),
		// not at a time spread by its name, as its due time is.
		return decideFold
	}
	if to < from || (to == from && !due) {
		// Nothing new before the cut; or the cut comes before some of the
		// stream's pack runs, as a window of a compaction after a failed
		// one can (that one packed the stream and retired no WAL): those
		// runs are later in the WAL than this window, whose job is not
		// to take them apart.
		return decideLeave
	}
	if s.pend.Producers.exceeds(packMaxProducers) {
		return decideFold
	}
	if s.metaUnsure.Load() {
		// A checkpoint that may land unseen (this process's, or the
		// replaced one's: markReplayed) moves the stream's tail in the
		// bucket past the one known here, and a pack entry must continue
		// the bucket's (replay ignores one that does not); the fold's
		// writeMeta finds out and writes over it. Left in the packs, the
		// stream writes nothing a late checkpoint could contradict: a
		// replay passes over the pack runs it covers.
		return decideFold
	}
	est := mem - packedMem
	if due {
		// Repacked: one run again, in a pack of this compaction, instead
		// of a data object and a checkpoint of its own.
		from, est = 0, mem
		leaveAt = now.Add(packStay(s.name)).UnixMilli()
	}
	*job = packJob{s: s, from: from, to: to, repack: due, est: est, first: s.runs[from].pos, pos: s.runs[to-1].pos,
		leaveAt: leaveAt, maxRuns: maxRuns, used: s.used.Load()}
	return decidePack
}

// leavePacksLocked is when the stream is repacked (or folded) for the age
// of its packed records (Unix ms): its stay after its oldest pack run was
// written, or after now if it has none.
func (s *stream) leavePacksLocked(now time.Time) int64 {
	if len(s.runs) > 0 && s.runs[0].snap != nil {
		return s.runs[0].packed + packStay(s.name).Milliseconds()
	}
	return now.Add(packStay(s.name)).UnixMilli()
}

// packStay is how old the stream called name lets its oldest pack run get.
func packStay(name string) time.Duration {
	stay, _ := packLimits(name)
	return stay
}

// gather reads the records of the job's runs (WAL runs from the cache,
// which holds them unless the backlog outgrew it; pack runs from pre, read
// back in bulk) and works out the stream's state after them.
func (e *Engine) gather(ctx context.Context, j *packJob, pre *readBack) error {
	s := j.s
	s.mu.Lock()
	runs := append([]walRun(nil), s.runs[:j.to]...)
	meta := *s.meta
	s.mu.Unlock()
	st := meta.State
	for i := range runs[:j.from] {
		runs[i].applyTo(&st)
	}
	ent := &segment.Entry{StreamID: meta.ID, Name: s.name, FirstSeq: runs[j.from].ch.First}
	for _, r := range runs[j.from:] {
		if r.ch.End > r.ch.First {
			recs, ok := pre.take(runCacheKey(r.key, r.span))
			if !ok {
				recs, ok = e.cache.peek(runCacheKey(r.key, r.span))
			}
			if !ok {
				var err error
				if recs, err = e.recordsKept(ctx, s, meta.ID, r.ch.First); err != nil {
					return fmt.Errorf("pack %s: %w", s.name, err)
				}
			}
			for _, rec := range recs {
				if rec.Seq >= r.ch.First && rec.Seq < r.ch.End {
					ent.Records = append(ent.Records, rec)
					j.size += segment.RecordSize(&rec)
				}
			}
		}
		r.applyTo(&st)
	}
	if ent.EndSeq() != st.NextSeq {
		return fmt.Errorf("pack %s: %w: records [%d, %d) do not reach the tail %d", s.name, segment.ErrCorrupt,
			ent.FirstSeq, ent.EndSeq(), st.NextSeq)
	}
	j.ent, j.state = ent, st
	return nil
}

// pack writes the jobs' entries as packs of about packTarget bytes, and
// points each stream's packed runs at its pack.
func (e *Engine) pack(ctx context.Context, jobs []*packJob, end walPos, back *readBack) error {
	// Streams that will be repacked or leave the packs together (at one
	// time, or after as many runs) sit together in every pack, so the
	// compaction that takes them out reads their records back with a few
	// large ranged GETs (readPacked).
	slices.SortFunc(jobs, func(a, b *packJob) int {
		return cmp.Or(cmp.Compare(a.leaveAt, b.leaveAt), cmp.Compare(a.maxRuns, b.maxRuns), cmp.Compare(a.s.name, b.s.name))
	})
	// A group of jobs at a time, so that the records gathered (repacks
	// bring their packed ones) stay bounded.
	for len(jobs) > 0 {
		n := fitting(jobs, packReadBatch, func(j *packJob) int64 { return j.est })
		if err := e.packGroup(ctx, jobs[:n], end, back); err != nil {
			return err
		}
		jobs = jobs[n:]
	}
	return nil
}

// packGroup gathers the records of a group of jobs and writes them out.
func (e *Engine) packGroup(ctx context.Context, jobs []*packJob, end walPos, back *readBack) error {
	var repack []*stream
	for _, j := range jobs {
		if j.repack {
			repack = append(repack, j.s)
		}
	}
	if len(repack) > 0 {
		got, err := e.readPacked(ctx, repack)
		if err != nil {
			return err
		}
		back.add(got)
	}
	// Several at once, as folds are.
	if err := e.inParallel(len(jobs), compactWorkers, func(i int) error { return e.gather(ctx, jobs[i], back) }); err != nil {
		return err
	}
	for len(jobs) > 0 {
		n := fitting(jobs, packTarget, func(j *packJob) int64 { return int64(j.size) })
		if err := e.writePack(ctx, jobs[:n], end); err != nil {
			return err
		}
		jobs = jobs[n:]
	}
	return nil
}

// fitting is how many of the first items fit in limit by size: at least
// one, however big.
func fitting[T any](items []T, limit int64, size func(T) int64) int {
	n, sum := 0, int64(0)
	for n < len(items) && (n == 0 || sum+size(items[n]) <= limit) {
		sum += size(items[n])
		n++
	}
	return n
}

func (e *Engine) writePack(ctx context.Context, jobs []*packJob, end walPos) error {
	now := time.Now().UnixMilli()
	entries := make([]*segment.Entry, len(jobs))
	for i, j := range jobs {
		entries[i] = j.ent
	}
	var spans []segment.Span
	hint := 0
	for _, j := range jobs {
		hint += packIndexBytes + len(j.s.name) + len(j.ent.StreamID)
	}
	data, ref := segment.EncodePack(entries, hint, func(sp []segment.Span) []byte {
		spans = sp
		idx := make([]packIndexEntry, len(jobs))
		for i, j := range jobs {
			idx[i] = packIndexEntry{Name: j.s.name, ID: j.ent.StreamID, First: j.ent.FirstSeq, End: j.ent.EndSeq(),
				Off: sp[i].Off, Len: sp[i].Len, Pos: j.pos, Packed: now, State: j.state, Repack: j.repack}
		}
		b, err := json.Marshal(idx)
		if err != nil {
			panic(err) // plain structs of strings and numbers always encode
		}
		return b
	})
	ref.Key = segment.PackKey(end.NS, end.Seq, newID())
	if _, err := e.store.Put(ctx, ref.Key, data, segment.PutOptions{IfNoneMatch: true}); err != nil {
		return fmt.Errorf("put pack %s: %w", ref.Key, err)
	}
	if ce := e.log.Check(zap.DebugLevel, "pack written"); ce != nil {
		runs := make([]string, len(jobs))
		for i, j := range jobs {
			runs[i] = fmt.Sprintf("%s [%d, %d) at %s repack=%v", j.s.name, j.ent.FirstSeq, j.ent.EndSeq(), j.pos, j.repack)
		}
		ce.Write(zap.String("key", ref.Key), zap.Strings("runs", runs))
	}
	// Listed from now on, in memory: the manifest update that retires the
	// WAL lists it too, this compaction's or a later one's.
	e.packs = append(e.packs, ref)
	e.stats.packsWritten.Add(1)
	e.stats.packed.Add(uint64(len(jobs)))
	for _, j := range jobs {
		if j.repack {
			e.stats.repacked.Add(1)
		}
	}
	e.stats.packsLive.Store(int64(len(e.packs)))
	for i, j := range jobs {
		e.repoint(j, ref.Key, spans[i], now)
		// The records are in the pack now. The compaction keeps its jobs
		// until its last pack is written, and a job that kept its entry
		// kept every record gathered (a repack's read back from older
		// packs too): 84 MiB of ranges read back were live at once in
		// row 2-many's repacks, against packReadBatch per group.
		j.ent = nil
	}
	return nil
}

// repoint replaces the job's WAL runs by one run in the pack.
func (e *Engine) repoint(j *packJob, key string, sp segment.Span, packed int64) {
	s := j.s
	st := j.state
	run := walRun{pos: j.pos, key: key, span: sp, snap: &st, packed: packed,
		ch: change{First: j.ent.FirstSeq, End: j.ent.EndSeq(), LastTS: st.LastTS}}
	s.mu.Lock()
	// Only compaction (which this is) takes runs off the front, and a
	// delete marks the stream gone; appends add at the back.
	if s.gone || len(s.runs) < j.to || s.runs[j.from].pos != j.first || s.runs[j.to-1].pos != j.pos {
		s.mu.Unlock()
		return
	}
	dead := make([]string, 0, j.to-j.from)
	for _, r := range s.runs[j.from:j.to] {
		dead = append(dead, runCacheKey(r.key, r.span))
	}
	s.runs = slices.Replace(s.runs, j.from, j.to, run)
	s.mu.Unlock()
	// Not cached under the pack's key: the cache is for the WAL entries
	// the next compactions read, and a backlog that outgrew it was read
	// back with a GET per entry, one after another, until the compaction
	// fell behind for good (the fold reads packs back in bulk instead).
	e.cache.remove(dead)
}

// livePacks splits the packs into those a stream in memory still reads
// (every stream with pack runs is in memory: runs pin it) and the dead.
func (e *Engine) livePacks() (live []segment.PackRef, dead []string) {
	used := map[string]bool{}
	e.mu.RLock()
	for _, s := range e.streams {
		s.mu.Lock()
		for i := 0; i < len(s.runs) && s.runs[i].snap != nil; i++ {
			used[s.runs[i].key] = true
		}
		s.mu.Unlock()
	}
	e.mu.RUnlock()
	for _, p := range e.packs {
		if used[p.Key] {
			live = append(live, p)
		} else {
			dead = append(dead, p.Key)
		}
	}
	return live, dead
}

// replayPacks rebuilds the packed runs of the streams the manifest's packs
// hold, oldest pack first, before the WAL is replayed.
func (e *Engine) replayPacks(ctx context.Context, metas *metaLoader, refs []segment.PackRef) error {
	e.packs = append([]segment.PackRef(nil), refs...)
	e.stats.packsLive.Store(int64(len(e.packs)))
	// The indexes come in several at a time: on a bucket 25 ms away, one
	// at a time, a few hundred packs would add seconds to a restart.
	idxs := make([][]packIndexEntry, len(refs))
	err := e.inParallel(len(refs), replayMetaLoads, func(i int) error {
		data, err := segment.ReadPackIndex(ctx, e.store, refs[i])
		if err != nil {
			return err
		}
		if err := json.Unmarshal(data, &idxs[i]); err != nil {
			return fmt.Errorf("index of %s: %w: %v", refs[i].Key, segment.ErrCorrupt, err)
		}
		if err := checkPackIndex(refs[i], idxs[i]); err != nil {
			return err
		}
		for _, ent := range idxs[i] {
			metas.load(ent.Name)
		}
		return nil
	})
	if err != nil {
		return err
	}
	// A repack entry holds every record of its stream since the checkpoint,
	// and replaces the stream's entries in older packs. Those packs stay
	// listed while other streams need them, but some of the stream's older
	// entries are gone with the packs that died: the ones left would not
	// continue its tail. They are passed over, from the start, up to the
	// stream's last repack entry.
	type at struct{ pack, ent int }
	lastRepack := map[string]at{}
	for i := range refs {
		for j, ent := range idxs[i] {
			if !ent.Repack {
				continue
			}
			s, err := e.replayStream(metas, ent.Name)
			if err != nil {
				return err
			}
			if s != nil && s.meta.ID == ent.ID && !s.meta.Upto.after(ent.Pos) && ent.First == s.meta.State.NextSeq &&
				ent.End == ent.State.NextSeq {
				lastRepack[ent.Name] = at{i, j}
			}
		}
	}
	for i, ref := range refs {
		for j, ent := range idxs[i] {
			s, err := e.replayStream(metas, ent.Name)
			if err != nil {
				return err
			}
			if s == nil || s.meta.ID != ent.ID || s.meta.Upto.after(ent.Pos) {
				continue // deleted, or folded since
			}
			if r, ok := lastRepack[ent.Name]; ok && (i < r.pack || i == r.pack && j < r.ent) {
				continue // repacked later
			}
			if !s.replayPackEntry(ref.Key, ent) {
				e.log.Error("pack entry does not continue its stream; ignored",
					zap.String("key", ref.Key), zap.String("stream", ent.Name),
					zap.Uint64("first", ent.First), zap.Uint64("end", ent.End), zap.Uint64("tail", s.durable.NextSeq),
					zap.Bool("repack", ent.Repack), zap.Stringer("at", ent.Pos),
					zap.Uint64("checkpoint_tail", s.meta.State.NextSeq), zap.Stringer("checkpoint_upto", s.meta.Upto))
			}
		}
	}
	return nil
}

// checkPackIndex refuses an index whose entries the pack cannot hold: a
// span outside the entries' part of the object, or records that end before
// they start. The index matched its checksum, so only a faulty writer
// makes one; its spans would otherwise be sliced as they come, and a
// stream's tail could move back.
func checkPackIndex(ref segment.PackRef, idx []packIndexEntry) error {
	for i, ent := range idx {
		if !spanWithin(ent.Off, ent.Len, ref.IndexOff) || ent.First > ent.End {
			return fmt.Errorf("index of %s: %w: entry %d (%s) spans [%d, +%d) of %d bytes, seqs [%d, %d)",
				ref.Key, segment.ErrCorrupt, i, ent.Name, ent.Off, ent.Len, ref.IndexOff, ent.First, ent.End)
		}
	}
	return nil
}

// replayPackEntry adds pack entry ent, found in pack key, to the runs of s
// as the replay rebuilds them, and reports whether it did: an entry that
// does not continue the stream (or whose state does not end where its
// records do) changes nothing. A repack entry holds everything since the
// checkpoint and replaces the runs older packs still listed hold, but only
// once it is known sound: a damaged one dropped them and added nothing.
func (s *stream) replayPackEntry(key string, ent packIndexEntry) bool {
	if ent.End != ent.State.NextSeq {
		return false
	}
	repack := ent.Repack && ent.First == s.meta.State.NextSeq
	if !repack && ent.First != s.durable.NextSeq {
		return false
	}
	if repack {
		s.runs = s.runs[:0]
	}
	st := ent.State
	s.durable, s.pend = st, st
	s.runs = append(s.runs, walRun{pos: ent.Pos, key: key, span: segment.Span{Off: ent.Off, Len: ent.Len},
		snap: &st, packed: ent.Packed, ch: change{First: ent.First, End: ent.End, LastTS: st.LastTS}})
	return true
}

// sweepPacks deletes packs the manifest does not list: written by a
// compaction that did not get to list them before the process ended.
// Called before this process's first compaction, so every pack it could
// have written is listed; and only while the storage is still this
// process's, so that none a process that replaced it wrote is lost.
func (e *Engine) sweepPacks(ctx context.Context) error {
	listed := map[string]bool{}
	for _, p := range e.packs {
		listed[p.Key] = true
	}
	after := ""
	for {
		objs, more, err := e.store.List(ctx, segment.PackPrefix(), after, 1000)
		if err != nil {
			return fmt.Errorf("list packs: %w", err)
		}
		var dead []string
		for _, o := range objs {
			if !listed[o.Key] {
				dead = append(dead, o.Key)
			}
			after = o.Key
		}
		if len(dead) > 0 {
			// A process that replaced this one (a restart of the node
			// while this one still started) lists packs of its own that
			// this process's manifest never will: the page may hold them
			// only if it took the lease before the listing ended, which
			// the lease, read now, shows.
			if err := e.confirmOwner(ctx); err != nil {
				return fmt.Errorf("delete unlisted packs: %w", err)
			}
			if err := e.store.Delete(ctx, dead); err != nil {
				return fmt.Errorf("delete unlisted packs: %w", err)
			}
		}
		if !more || len(objs) == 0 {
			return nil
		}
	}
}

// packedRange is one ranged GET of a pack or WAL object that reads back
// the runs in it.
type packedRange struct {
	key      string
	off, end int64
	runs     []walRun
}

// readPacked reads back the pack runs of streams about to be folded or
// repacked. It returns the records by run cache key.
func (e *Engine) readPacked(ctx context.Context, streams []*stream) (map[string][]Record, error) {
	var runs []walRun
	for _, s := range streams {
		s.mu.Lock()
		for i := 0; i < len(s.runs) && s.runs[i].snap != nil; i++ {
			if r := s.runs[i]; r.ch.End > r.ch.First && !e.cache.has(runCacheKey(r.key, r.span)) {
				runs = append(runs, r)
			}
		}
		s.mu.Unlock()
	}
	return e.readRuns(ctx, runs, nil)
}

// readBack is the records a compaction has for its runs, by run cache key:
// WAL entries it found in the cache or read back, and pack runs read back.
// Each run's records are taken once, by the stream compacted, so what the
// compaction holds shrinks as it goes.
type readBack struct {
	mu   sync.Mutex
	recs map[string][]Record
}

// add joins more records to rb.
func (rb *readBack) add(recs map[string][]Record) {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	maps.Copy(rb.recs, recs)
}

// take returns the records of key and lets go of them.
func (rb *readBack) take(key string) ([]Record, bool) {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	recs, ok := rb.recs[key]
	delete(rb.recs, key)
	return recs, ok
}

// readRuns reads back runs of packs or WAL objects, merging runs that sit
// close together in one object into one ranged GET. It returns the
// records by run cache key. A run that does not decode fails the read,
// unless damaged is set: it is then told of the run, and the others are
// still returned.
func (e *Engine) readRuns(ctx context.Context, runs []walRun, damaged func(walRun, error)) (map[string][]Record, error) {
	byPack := map[string][]walRun{}
	for _, r := range runs {
		byPack[r.key] = append(byPack[r.key], r)
	}
	var ranges []packedRange
	for key, runs := range byPack {
		slices.SortFunc(runs, func(a, b walRun) int { return cmp.Compare(a.span.Off, b.span.Off) })
		var cur *packedRange
		for _, r := range runs {
			end := r.span.Off + r.span.Len
			if cur == nil || r.span.Off-cur.end > packReadGap || end-cur.off > maxDataObject {
				ranges = append(ranges, packedRange{key: key, off: r.span.Off, end: end})
				cur = &ranges[len(ranges)-1]
			}
			cur.end = max(cur.end, end)
			cur.runs = append(cur.runs, r)
		}
	}
	out := map[string][]Record{}
	var mu sync.Mutex
	err := e.inParallel(len(ranges), compactWorkers, func(i int) error {
		got, err := e.readRange(ctx, ranges[i], damaged)
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		maps.Copy(out, got)
		return nil
	})
	return out, err
}

// readRange fetches one range of an object and decodes the runs in it. The
// runs are copied out of the range first: a range spans other streams'
// entries between the runs (up to packReadGap each), and records decoded
// in place would keep the whole range alive for as long as a fold holds
// them. Compacted, a fold batch holds what it folds, not up to a hundred
// times that (a Caddy folding 10,000 streams out of the packs peaked near
// 1 GB of heap).
func (e *Engine) readRange(ctx context.Context, rg packedRange, damaged func(walRun, error)) (map[string][]Record, error) {
	data, _, err := e.store.Get(ctx, rg.key, rg.off, rg.end-rg.off)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", rg.key, err)
	}
	var size int64
	for _, r := range rg.runs {
		size += r.span.Len
	}
	out := make(map[string][]Record, len(rg.runs))
	if size == int64(len(data)) {
		// Nothing but the runs in the range: it holds only what the
		// fold keeps, so the records stay where they were read rather
		// than take a copy of the range (in row 2-many, where repacked
		// streams sit side by side in the packs, the copies were half of
		// what reading packs back allocated).
		for _, r := range rg.runs {
			ent, err := decodeRun(data, rg.off, r)
			if err != nil {
				if damaged == nil || !isDamage(err) {
					return nil, err
				}
				damaged(r, err)
				continue
			}
			out[runCacheKey(r.key, r.span)] = ent.Records
		}
		return out, nil
	}
	own := make([]byte, 0, size)
	for _, r := range rg.runs {
		// Each run is checked on its own (its span is known here, not
		// taken from the object), so a damaged entry costs only its own
		// run, not its neighbours in the range.
		off := r.span.Off - rg.off
		if !spanWithin(off, r.span.Len, int64(len(data))) {
			err := fmt.Errorf("read %s: %w: short range", r.key, segment.ErrCorrupt)
			if damaged == nil {
				return nil, err
			}
			damaged(r, err)
			continue
		}
		at := int64(len(own))
		own = append(own, data[off:off+r.span.Len]...)
		ent, err := decodeRun(own[at:], r.span.Off, r)
		if err != nil {
			if damaged == nil || !isDamage(err) {
				return nil, err
			}
			own = own[:at]
			damaged(r, err)
			continue
		}
		out[runCacheKey(r.key, r.span)] = ent.Records
	}
	return out, nil
}
