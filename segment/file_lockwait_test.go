package segment

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"testing"
	"time"
)

// While another process holds a key's file lock (stopped, say, with its
// write half done), the writer of this process waiting for it holds the
// stripe's lock here too; a write of another key of the stripe must then
// give up when its own context ends, not wait for the first writer.
func TestFileLockWaitEndsWithItsContext(t *testing.T) {
	dir := t.TempDir()
	mine, err := NewFileStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mine.Close() })
	other, err := NewFileStore(dir) // another open of the lock files: another process, to flock(2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { other.Close() })

	const key = "meta/a"
	stripe := crc32.ChecksumIEEE([]byte(key)) % fileLockStripes
	key2 := "" // another key of the same stripe
	for i := 0; key2 == ""; i++ {
		if k := fmt.Sprintf("meta/b%d", i); crc32.ChecksumIEEE([]byte(k))%fileLockStripes == stripe {
			key2 = k
		}
	}
	unlock, err := other.lock(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()

	first, cancelFirst := context.WithCancel(context.Background())
	defer cancelFirst()
	firstDone := make(chan error, 1)
	go func() {
		_, err := mine.Put(first, key, []byte("1"), PutOptions{})
		firstDone <- err
	}()
	// The first write takes the stripe's lock here and waits on the
	// other's file lock; until it holds the stripe, the second write would
	// not wait on it at all.
	for deadline := time.Now().Add(5 * time.Second); len(mine.locks[stripe]) == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the first write never took the stripe's lock: nothing tested")
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := mine.Put(ctx, key2, []byte("2"), PutOptions{})
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("the second write: %v, want its context's deadline", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the second write still waits 5s after its context ended")
	}
	cancelFirst()
	if err := <-firstDone; !errors.Is(err, context.Canceled) {
		t.Errorf("the first write: %v, want its cancellation", err)
	}
}
