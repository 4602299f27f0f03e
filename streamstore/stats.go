package streamstore

import (
	"sync/atomic"

	"github.com/picomq/caddy-picomq/segment"
)

// Stats are an engine's running totals since it was built. The engine adds
// to them with atomic adds on its commit and read paths; read them at any
// time with Engine.Stats.
type Stats struct {
	appends      atomic.Uint64 // committed WAL entries that carry records
	records      atomic.Uint64 // records in them
	bytes        atomic.Uint64 // record body bytes in them
	walObjects   atomic.Uint64 // WAL objects committed
	walEntries   atomic.Uint64 // every committed WAL entry, record-less ones too
	abortedBatch atomic.Uint64 // WAL batches aborted after a failed upload
	expired      atomic.Uint64 // streams deleted for having expired
	busy         atomic.Uint64 // writes refused with ErrBusy
	folds        atomic.Uint64 // streams compacted into data objects of their own
	merges       atomic.Uint64 // of which folds that wrote the last data object again (merge.go)
	packed       atomic.Uint64 // stream backlogs compacted into packs
	repacked     atomic.Uint64 // of which repacks: packed records with the new ones
	packsWritten atomic.Uint64 // packs written
	packsLive    atomic.Int64  // packs listed, or about to be, in the manifest
	orphanBlobs  atomic.Int64  // blobs deleted for no entry naming them (orphans.go)
	damagedWAL   atomic.Uint64 // distinct WAL entries found damaged (damaged.go)
	damagedObjs  atomic.Uint64 // distinct data objects, blobs, metadata found damaged
}

// StatsSnapshot is Stats read at one moment.
type StatsSnapshot struct {
	// Appends is how many appends became durable (were acknowledged, or
	// would have been had the client waited), each one counted also when
	// several of one stream share a WAL entry.
	Appends uint64
	// Records and Bytes are the records those appends carried and the
	// bytes of their bodies.
	Records, Bytes uint64
	// WALObjects is how many WAL objects (group-commit batches) were
	// committed; WALEntries the entries in them, record-less ones (TTL
	// renewals, closes without data) included.
	WALObjects, WALEntries uint64
	// AbortedBatches is how many WAL batches were aborted after an upload
	// failed, their appends answered with an error.
	AbortedBatches uint64
	// CacheHits and CacheMisses count lookups of committed records in the
	// block cache by reads; a miss costs a GET (or a LIST and a GET).
	CacheHits, CacheMisses uint64
	// BuffersReused counts data objects read by cold readers into the
	// buffer of one read before (see bufPool) rather than fresh memory.
	BuffersReused uint64
	// Expired is how many streams were deleted for having expired: found
	// by an access or by the expiry sweep.
	Expired uint64
	// Busy is how many writes were refused at once with ErrBusy because
	// the appends waiting for storage held Config.MaxPending bytes.
	Busy uint64
	// PendingBytes is a gauge: the memory held by appends waiting for
	// storage now (WAL entries not yet released, large appends' own
	// uploads, appends queued behind a large append or a close).
	PendingBytes uint64
	// Folds is how many times a compaction gave a stream's records data
	// objects of their own and checkpointed it; Packed how many times it
	// put a stream's new records into a shared pack instead, and
	// PacksWritten the packs that took. Repacked counts the packings that
	// took a stream's packed records along with its new ones, to keep it
	// in one pack run. LivePacks is a gauge: the packs some stream still
	// reads.
	Folds, Packed, Repacked, PacksWritten uint64
	// Merges counts the folds that wrote the stream's small last data
	// object again with their records, as one (see Config.MergeBelow).
	Merges    uint64
	LivePacks int64
	// OrphanBlobsDeleted is how many blobs of large appends that never
	// committed (their process died first) a start's sweep deleted.
	OrphanBlobsDeleted uint64
	// DamagedWALEntries is how many committed WAL entries this process
	// found failing their checksum or framing when it read them back (each
	// once): their streams are not compacted past them, and reads of their
	// records fail with ErrDamaged.
	DamagedWALEntries uint64
	// DamagedObjects is how many data objects, blobs and metadata objects
	// this process found failing to decode (or missing where a stream's
	// records must be), each once: reads that need them fail with
	// ErrDamaged.
	DamagedObjects uint64
	// StreamsInMemory is a gauge: the stream handles held now, which are
	// the streams used within Config.IdleAfter and those whose records
	// wait for a compaction; an idle node holds none.
	StreamsInMemory int64
}

// Stats returns the engine's running totals. The counters are read one by
// one, so a snapshot taken while appends commit may be a few appends apart
// between fields.
func (e *Engine) Stats() StatsSnapshot {
	s := &e.stats
	snap := StatsSnapshot{
		Appends:        s.appends.Load(),
		Records:        s.records.Load(),
		Bytes:          s.bytes.Load(),
		WALObjects:     s.walObjects.Load(),
		WALEntries:     s.walEntries.Load(),
		AbortedBatches: s.abortedBatch.Load(),
		CacheHits:      e.cache.hits.Load(),
		CacheMisses:    e.cache.misses.Load(),
		BuffersReused:  uint64(e.bufs.reused.Load()),
		Expired:        s.expired.Load(),
		Busy:           s.busy.Load(),
		Folds:          s.folds.Load(),
		Merges:         s.merges.Load(),
		Packed:         s.packed.Load(),
		Repacked:       s.repacked.Load(),
		PacksWritten:   s.packsWritten.Load(),
		LivePacks:      s.packsLive.Load(),

		OrphanBlobsDeleted: uint64(s.orphanBlobs.Load()),
		DamagedWALEntries:  s.damagedWAL.Load(),
		DamagedObjects:     s.damagedObjs.Load(),
	}
	if w := e.statsW.Load(); w != nil {
		snap.PendingBytes = uint64(w.Pending())
	}
	e.mu.RLock()
	snap.StreamsInMemory = int64(len(e.streams))
	e.mu.RUnlock()
	return snap
}

// committed counts a committed WAL batch. It runs on the commit path, once
// per batch: a loop over the batch's records and a few atomic adds.
func (s *Stats) committed(b *segment.Batch) {
	var appends, records, bytes uint64
	for _, ent := range b.Entries {
		if len(ent.Records) == 0 {
			continue
		}
		appends += 1 + uint64(ent.Merged)
		records += uint64(len(ent.Records))
		for i := range ent.Records {
			bytes += uint64(len(ent.Records[i].Body))
		}
	}
	s.walObjects.Add(1)
	s.walEntries.Add(uint64(len(b.Entries)))
	if appends > 0 {
		s.appends.Add(appends)
		s.records.Add(records)
		s.bytes.Add(bytes)
	}
}

// aborted counts an aborted WAL batch.
func (s *Stats) aborted(*segment.Batch) { s.abortedBatch.Add(1) }
