package streamstore

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

func TestBlobNames(t *testing.T) {
	tests := []struct {
		name  string
		ns    uint64
		hasNS bool
		size  int64
		valid bool
	}{
		{name: newBlobName(300, 0), ns: 0, hasNS: true, size: 300, valid: true},
		{name: newBlobName(blobMinBytes, 0x1f2e), ns: 0x1f2e, hasNS: true, size: blobMinBytes, valid: true},
		// Before blobs carried their namespace.
		{name: "262144-00112233445566778899aabb", hasNS: false, size: 262144, valid: true},
		{name: "300-zz-00112233", hasNS: false, size: 300, valid: true},
		{name: "300", valid: false},
		{name: "300-a/b", valid: false},
	}
	for _, tt := range tests {
		ns, ok := blobNamespace(tt.name)
		if tt.valid && (ns != tt.ns || ok != tt.hasNS) {
			t.Errorf("blobNamespace(%q) = %x, %v; want %x, %v", tt.name, ns, ok, tt.ns, tt.hasNS)
		}
		if got := validBlobName(tt.name); got != tt.valid {
			t.Errorf("validBlobName(%q) = %v", tt.name, got)
		}
		if tt.valid && blobSize(tt.name) != tt.size {
			t.Errorf("blobSize(%q) = %d, want %d", tt.name, blobSize(tt.name), tt.size)
		}
		id, name, ok := parseBlobKey(blobKey("0a1b", tt.name))
		if ok != tt.valid || (ok && (id != "0a1b" || name != tt.name)) {
			t.Errorf("parseBlobKey(%q) = %q, %q, %v", blobKey("0a1b", tt.name), id, name, ok)
		}
	}
	for _, key := range []string{"blob/", "blob//300-1-ab", "data/0a1b/300-1-ab", "blob/0a1b"} {
		if _, _, ok := parseBlobKey(key); ok {
			t.Errorf("parseBlobKey(%q) accepted", key)
		}
	}
}

// TestStartSweepsOrphanedBlobs: a node whose WAL upload of a large append
// never landed (here it lost its storage to another node meanwhile, as a
// crash would) leaves the append's blob behind. The next node deletes it
// once it has compacted what it replayed, and keeps every blob an entry
// names, its own uploads in flight included.
func TestStartSweepsOrphanedBlobs(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var armed atomic.Bool
	entered, hold := make(chan struct{}), make(chan struct{})
	st.SetFail(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, "wal/") && armed.CompareAndSwap(true, false) {
			close(entered)
			<-hold
			return errors.New("injected: the upload never landed")
		}
		return nil
	})
	const octet = "application/octet-stream"
	e1 := startEngine(t, st, Config{})
	if _, _, err := e1.Create(ctx, "/o", CreateRequest{ContentType: octet}); err != nil {
		t.Fatal(err)
	}
	a := body(1, blobMinBytes)
	if _, err := e1.Append(ctx, "/o", AppendRequest{Records: []NewRecord{{Body: a}}}); err != nil {
		t.Fatal(err)
	}
	keys := st.Keys("blob/")
	if len(keys) != 1 {
		t.Fatalf("blobs after one large append: %v", keys)
	}
	keptA := keys[0]
	id, _, _ := parseBlobKey(keptA)

	armed.Store(true)
	lost := make(chan error, 1)
	go func() {
		_, err := e1.Append(ctx, "/o", AppendRequest{Records: []NewRecord{{Body: body(2, blobMinBytes)}}})
		lost <- err
	}()
	select {
	case <-entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the second large append's WAL upload never started")
	}
	// Another node takes the storage over while the upload hangs: its
	// replay seals the upload's place.
	e2 := startEngine(t, st, Config{})
	close(hold)
	if err := <-lost; err == nil {
		t.Fatal("an append whose WAL upload never landed was acknowledged")
	}
	orphans := slices.DeleteFunc(st.Keys("blob/"), func(k string) bool { return k == keptA })
	if len(orphans) != 1 {
		t.Fatalf("blobs besides the acknowledged one: %v, want the lost append's", orphans)
	}
	legacy := blobKey(id, "262144-00112233445566778899aabb") // named before blobs carried a namespace
	e2NS := e2.orphans.startNS
	inFlight := blobKey(id, newBlobName(blobMinBytes, e2NS)) // stands for one of e2's uploads
	for _, k := range []string{legacy, inFlight} {
		if _, err := st.Put(ctx, k, []byte("x"), segment.PutOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	b := body(3, blobMinBytes)
	if _, err := e2.Append(ctx, "/o", AppendRequest{Records: []NewRecord{{Body: b}}}); err != nil {
		t.Fatal(err)
	}
	if got := len(st.Keys("blob/")); got != 5 {
		t.Fatalf("%d blobs before e2's first compaction, want 5: %v", got, st.Keys("blob/"))
	}
	if err := e2.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	waitOrphans(t, e2, 2)
	for _, k := range append(orphans, legacy) {
		if slices.Contains(st.Keys("blob/"), k) {
			t.Errorf("orphaned blob %s is still there", k)
		}
	}
	if got := len(st.Keys("blob/")); got != 3 {
		t.Errorf("blobs after the sweep: %v, want a's, b's and the one in flight", st.Keys("blob/"))
	}
	sameBodies(t, "after the sweep", readBodies(t, e2, "/o", 0), [][]byte{a, b})
	man, _, err := segment.NewManifests(st).Load(ctx)
	if err != nil || man.BlobsSweptTo != e2NS {
		t.Fatalf("manifest after the sweep: blobs swept to %d (%v), want %d", man.BlobsSweptTo, err, e2NS)
	}

	// The next start looks only at blobs written since: those below the
	// mark were swept already (these two stand for what a sweep could not
	// have missed, and show that it is not listed again).
	below := []string{blobKey(id, "262144-ffeeddccbbaa998877665544"), blobKey(id, newBlobName(blobMinBytes, e2NS-1))}
	for _, k := range below {
		if _, err := st.Put(ctx, k, []byte("x"), segment.PutOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	e3 := startEngine(t, st, Config{CacheBytes: 1})
	if err := e3.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	waitOrphans(t, e3, 1) // e2's upload in flight, which never committed
	if slices.Contains(st.Keys("blob/"), inFlight) {
		t.Errorf("the blob of e2's that never committed outlived e3's sweep")
	}
	for _, k := range below {
		if !slices.Contains(st.Keys("blob/"), k) {
			t.Errorf("%s, below the sweep mark, was listed again and deleted", k)
		}
	}
	sameBodies(t, "from a third node", readBodies(t, e3, "/o", 0), [][]byte{a, b})
}

// waitOrphans waits for e's start sweep to end having deleted n blobs.
func waitOrphans(t *testing.T, e *Engine, n uint64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		e.orphans.mu.Lock()
		done := e.orphans.state == sweepDone
		e.orphans.mu.Unlock()
		if done {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no sweep within 5 s (deleted %d)", e.Stats().OrphanBlobsDeleted)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if got := e.Stats().OrphanBlobsDeleted; got != n {
		t.Fatalf("the sweep deleted %d orphaned blobs, want %d", got, n)
	}
}

// TestSweepWaitsForEarlierNamespaces: until every namespace before the
// start's own is retired, a blob of an earlier one may belong to an entry
// not folded yet, so the sweep must not start.
func TestSweepWaitsForEarlierNamespaces(t *testing.T) {
	const start = 7
	tests := []struct {
		name string
		man  segment.Manifest
		want sweepState
		from uint64
	}{
		{"an earlier namespace left", segment.Manifest{Namespaces: []segment.Namespace{{ID: 5}, {ID: start}}}, sweepWaiting, 0},
		{"only its own", segment.Manifest{Namespaces: []segment.Namespace{{ID: start}}}, sweepDue, 0},
		{"later ones too", segment.Manifest{Namespaces: []segment.Namespace{{ID: start}, {ID: start + 1}}, BlobsSweptTo: 4}, sweepDue, 4},
		{"none", segment.Manifest{BlobsSweptTo: 6}, sweepDue, 6},
		{"swept already", segment.Manifest{BlobsSweptTo: start}, sweepDone, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := New(memstore.New(), Config{}, nil)
			e.orphans.startNS = start
			e.noteRetired(tt.man)
			if e.orphans.state != tt.want || e.orphans.from != tt.from {
				t.Errorf("state %d from %d, want %d from %d", e.orphans.state, e.orphans.from, tt.want, tt.from)
			}
		})
	}
}

// TestSweepManyStreams: the first sweep of a bucket from before blobs
// carried their namespace checks every stream with blobs, several at once;
// a failed delete fails the sweep, and the next one finishes the work.
func TestSweepManyStreams(t *testing.T) {
	ctx := context.Background()
	st := memstore.New()
	var fail atomic.Bool
	st.SetFail(func(op, key string) error {
		if op == "DELETE" && fail.CompareAndSwap(true, false) {
			return errors.New("injected")
		}
		return nil
	})
	e := startEngine(t, st, Config{})
	var kept, orphans []string
	for i := range 3 * sweepWorkers {
		id := newID()
		name, orphan := "262144-"+newID(), "262144-"+newID()
		kept = append(kept, blobKey(id, name))
		orphans = append(orphans, blobKey(id, orphan))
		for _, k := range []string{blobKey(id, name), blobKey(id, orphan), markerKey(id, uint64(i), uint64(i+1), name), dataKey(id, 0, uint64(i))} {
			if _, err := st.Put(ctx, k, nil, segment.PutOptions{}); err != nil {
				t.Fatal(err)
			}
		}
	}
	fail.Store(true)
	to := e.orphans.startNS
	if _, _, err := e.sweepOrphanBlobs(ctx, 0, to); err == nil {
		t.Fatal("a sweep whose delete failed reported success")
	}
	n, bytes, err := e.sweepOrphanBlobs(ctx, 0, to)
	if err != nil {
		t.Fatal(err)
	}
	left := st.Keys("blob/")
	slices.Sort(kept)
	if !slices.Equal(left, kept) {
		t.Fatalf("blobs left: %d, want the %d that markers name", len(left), len(kept))
	}
	if n == 0 || n > len(orphans) || bytes != int64(n)*262144 {
		t.Fatalf("second sweep: %d deleted, %d bytes; want what the first left of %d", n, bytes, len(orphans))
	}
}
