package streamstore

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/segment"
)

func TestBufPoolSizes(t *testing.T) {
	var p bufPool
	for _, tc := range []struct {
		n, cap int
	}{
		{1, 1},
		{bufClass - 1, bufClass - 1},
		{bufClass, bufClass},
		{bufClass + 1, 2 * bufClass},
		{1<<20 + 26, 1<<20 + bufClass},
		{bufPoolMax, bufPoolMax},
		{bufPoolMax + 1, bufPoolMax + 1},
	} {
		b := p.alloc(tc.n)
		if len(b) != tc.n || cap(b) != tc.cap {
			t.Errorf("alloc(%d): len %d cap %d; want len %d cap %d", tc.n, len(b), cap(b), tc.n, tc.cap)
		}
	}
}

// A buffer goes back to the pool at its last release, and only then; one
// whose records went out without a hold never does.
func TestObjBufRecycling(t *testing.T) {
	tests := []struct {
		name     string
		holds    int // holds besides the creator's
		escape   bool
		recycled bool
	}{
		{"sole holder", 0, false, true},
		{"three holders", 2, false, true},
		{"escaped", 1, true, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := &bufPool{poison: true}
			b := p.alloc(3 * bufClass)
			copy(b, "records")
			o := newObjBuf(b, p)
			for range tc.holds {
				o.hold()
			}
			if tc.escape {
				o.escape()
			}
			for i := 0; i < tc.holds; i++ {
				o.release()
				if !bytes.HasPrefix(b, []byte("records")) {
					t.Fatalf("buffer recycled with %d holds left", tc.holds-i)
				}
			}
			o.release()
			if got := !bytes.HasPrefix(b, []byte("records")); got != tc.recycled {
				t.Fatalf("recycled after the last release: %v; want %v", got, tc.recycled)
			}
		})
	}
}

func TestObjBufReleasedTwicePanics(t *testing.T) {
	o := newObjBuf(make([]byte, bufClass), &bufPool{})
	o.release()
	defer func() {
		if recover() == nil {
			t.Fatal("a second release did not panic")
		}
	}()
	o.release()
}

// Copies of a read result release its buffers once between them.
func TestReadResultReleasesOnce(t *testing.T) {
	p := &bufPool{poison: true}
	o := newObjBuf(p.alloc(bufClass), p)
	o.hold() // the cache's
	res := ReadResult{held: &holds{bufs: []*objBuf{o}}}
	cp := res
	res.Release()
	cp.Release()
	if n := o.refs.Load(); n != 1 {
		t.Fatalf("%d holds left; want the cache's one", n)
	}
	ReadResult{}.Release() // a result without records
}

// Many readers walk a cold stream, larger than the cache keeps of cold
// objects, on a file store (which reads into recycled buffers), each
// checking every record only after a pause, then releasing it. Buffers go
// back to a pool that overwrites them: a buffer reused while a reader
// still held its records would show here as a wrong byte.
func TestRecycledBuffersAreNotReusedWhileHeld(t *testing.T) {
	ctx := context.Background()
	st, err := segment.NewFileStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	const name, appends, recSize = "/pooled", 200, 100 << 10
	w := startEngine(t, st, Config{})
	setPackBelow(w, -1)
	if _, _, err := w.Create(ctx, name, CreateRequest{ContentType: "application/octet-stream"}); err != nil {
		t.Fatal(err)
	}
	var seq uint64
	for i := range appends {
		var batch []NewRecord
		if i%5 == 4 {
			// An append past the blob threshold: a blob of its own.
			batch = append(batch, NewRecord{Body: pattern(seq, 3*recSize)})
			seq++
		} else {
			batch = append(batch, NewRecord{Body: pattern(seq, recSize)}, NewRecord{Body: pattern(seq+1, recSize)})
			seq += 2
		}
		if _, err := w.Append(ctx, name, AppendRequest{Records: batch}); err != nil {
			t.Fatal(err)
		}
		if err := w.Compact(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(ctx); err != nil {
		t.Fatal(err)
	}

	e := startEngine(t, st, Config{})
	e.bufs.poison = true
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for r := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(r), 7))
			for pass := 0; pass < 2; pass++ {
				for at := rng.Uint64N(seq / 2); at < seq; {
					res, err := e.Read(ctx, name, ReadRequest{Seq: at, MaxBytes: 1 << 20})
					if err != nil {
						errs <- err
						return
					}
					time.Sleep(time.Duration(rng.IntN(300)) * time.Microsecond)
					for _, rec := range res.Records {
						if err := checkPattern(rec); err != nil {
							errs <- err
							return
						}
					}
					at = res.NextSeq
					res.Release()
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if n := e.bufs.reused.Load(); n == 0 {
		t.Fatal("no buffer was reused: the test proves nothing")
	} else {
		t.Logf("%d buffers reused", n)
	}
}

// pattern is the body of record seq: its seq, then bytes that depend on it.
func pattern(seq uint64, n int) []byte {
	b := make([]byte, n)
	binary.BigEndian.PutUint64(b, seq)
	for i := 8; i < n; i++ {
		b[i] = byte(seq) + byte(i)
	}
	return b
}

func checkPattern(r Record) error {
	if len(r.Body) < 8 || binary.BigEndian.Uint64(r.Body) != r.Seq {
		return fmt.Errorf("record %d does not start with its seq", r.Seq)
	}
	for i := 8; i < len(r.Body); i++ {
		if r.Body[i] != byte(r.Seq)+byte(i) {
			return fmt.Errorf("record %d: byte %d of %d is %#x, want %#x", r.Seq, i, len(r.Body), r.Body[i], byte(r.Seq)+byte(i))
		}
	}
	return nil
}
