package integration

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestAbandonedForkCreateKeepsSourceAppends: a client gives up on a fork
// create while Caddy's write of the source's metadata (its fork count) is
// on its way to the bucket, and the write lands after Caddy was told it
// failed. The source's appends after that must survive compaction and a
// crash: the engine once took its next checkpoint's failed precondition
// for a delete, and retired WAL objects it had never checkpointed.
func TestAbandonedForkCreateKeepsSourceAppends(t *testing.T) {
	// Without packs every compaction checkpoints the stream.
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s", "pack_below off"}})
	const src = "/src"
	metaKey := "streams/" + hex.EncodeToString([]byte(src)) + ".m"
	e.create(src, "text/plain")
	want := "a"
	e.append(src, "text/plain", []byte("a"))
	if err := mwWaitCheckpoint(e, metaKey, 1); err != nil {
		t.Fatal(err)
	}

	release := e.proxy.Hold(testenv.Fault{Op: testenv.OpPut, KeyContains: metaKey, Times: 1})
	readBacks := e.proxy.Counts().Containing(testenv.OpGet, metaKey)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		req, err := http.NewRequestWithContext(ctx, http.MethodPut, e.caddy.URL()+"/fork", nil)
		if err != nil {
			done <- err
			return
		}
		req.Header.Set("Stream-Forked-From", src)
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
			err = fmt.Errorf("the fork create answered %d before its write was released", resp.StatusCode)
		}
		done <- err
	}()
	wctx, wcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer wcancel()
	if err := e.proxy.WaitHeld(wctx, 1); err != nil {
		t.Fatalf("the fork create's write of the source's metadata never came: %v", err)
	}
	cancel() // the client gives up
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("fork create: %v, want it abandoned", err)
	}
	// The write is to land after Caddy has given up on it: after its
	// read-back of the object. Released before that, it would land while
	// Caddy still waited on it, which is not the case tested.
	if err := fhWaitFor(5*time.Second, 20*time.Millisecond, func() error {
		if e.proxy.Counts().Containing(testenv.OpGet, metaKey) == readBacks {
			return fmt.Errorf("no read-back of %s", metaKey)
		}
		return nil
	}); err != nil {
		release()
		t.Fatalf("Caddy never read %s back after the client gave up, so the write would not land after it had: %v", metaKey, err)
	}
	release()
	if err := fhWaitFor(30*time.Second, 20*time.Millisecond, func() error {
		m, err := mwMeta(e, metaKey)
		if err != nil {
			return err
		}
		if m.Forks != 1 {
			return fmt.Errorf("forks %d in the bucket", m.Forks)
		}
		return nil
	}); err != nil {
		t.Fatalf("the released write did not land: %v", err)
	}

	for i, body := range []string{"b", "c"} {
		e.append(src, "text/plain", []byte(body))
		want += body
		if err := mwWaitCheckpoint(e, metaKey, uint64(2+i)); err != nil {
			t.Errorf("after the write Caddy was told had failed: %v", err)
		}
	}
	e.caddy.Kill()
	e.caddy.Restart()
	got, _, err := e.readBytes(src)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != want {
		t.Fatalf("after a crash and restart the source reads %q; acknowledged %q", got, want)
	}
}

// mwMetaObject is the part of a stream's metadata object these tests read.
type mwMetaObject struct {
	Forks int `json:"forks"`
	State struct {
		NextSeq uint64 `json:"next_seq"`
	} `json:"state"`
}

func mwMeta(e *fhEnv, key string) (mwMetaObject, error) {
	var m mwMetaObject
	b, err := e.get(key)
	if err != nil {
		return m, err
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, fmt.Errorf("metadata object %s: %w", key, err)
	}
	return m, nil
}

// mwWaitCheckpoint waits until a compaction has checkpointed the stream's
// first n records into its metadata object.
func mwWaitCheckpoint(e *fhEnv, key string, n uint64) error {
	return fhWaitFor(20*time.Second, 100*time.Millisecond, func() error {
		m, err := mwMeta(e, key)
		if err != nil {
			return err
		}
		if m.State.NextSeq < n {
			return fmt.Errorf("checkpoint at %d records, want %d", m.State.NextSeq, n)
		}
		return nil
	})
}

// TestCreateWithRecordsRollsForward: every attempt of the metadata PUT of
// a create with a body fails (503 SlowDown) while the bucket answers reads.
// The body is durable in the WAL by then, and a PUT that failed may still
// land later, so the create is not given up: the client gets a 503, the
// stream appears with its body shortly after, a repeated create finds it
// (200, the body not doubled), and it survives a restart.
func TestCreateWithRecordsRollsForward(t *testing.T) {
	e := fhStart(t, fhOptions{})
	const name = "/rolls"
	metaKey := "streams/" + hex.EncodeToString([]byte(name)) + ".m"
	create := fhReq{Method: http.MethodPut, Path: name, Header: map[string]string{"Content-Type": "text/plain"}, Body: []byte("hello")}

	// As many failures as the module's S3 client makes attempts (s3Attempts).
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: metaKey, Status: http.StatusServiceUnavailable, Times: 5})
	resp := e.must(create)
	remove()
	if resp.Status != http.StatusServiceUnavailable {
		t.Fatalf("create while its metadata PUT fails: %s, want 503", resp)
	}
	deadline := time.Now().Add(15 * time.Second)
	var body []byte
	for {
		b, _, err := e.readBytes(name)
		if err == nil {
			body = b
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the stream 15 s after its create was reported unconfirmed: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if string(body) != "hello" {
		t.Fatalf("the stream reads %q, want %q", body, "hello")
	}
	if resp := e.must(create); resp.Status != http.StatusOK {
		t.Errorf("the create repeated: %s, want 200", resp)
	}
	e.caddy.Restart()
	if b, _, err := e.readBytes(name); err != nil || string(b) != "hello" {
		t.Fatalf("after a restart the stream reads %q (%v), want %q", b, err, "hello")
	}
}
