package integration

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
	"github.com/picomq/caddy-picomq/segment"
)

// TestRetiredWALNamespaceLeavesTheBucket: the first compaction after a
// restart takes the previous process's WAL namespace out of the manifest
// and then deletes its objects. Here the store refuses those deletes and
// the node crashes before it can try again. The next process must still
// delete them: the manifest no longer lists the namespace for replay, and
// nothing else named it, so its WAL objects stayed in the bucket for good.
func TestRetiredWALNamespaceLeavesTheBucket(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s"}})
	const path, ct = "/retire/s", "text/plain"
	e.create(path, ct)
	want := ""
	for i := range 3 {
		body := fmt.Sprintf("record %d;", i)
		e.append(path, ct, []byte(body))
		want += body
	}
	wal := e.mustList("wal/")
	if len(wal) == 0 {
		t.Fatal("no WAL object after the appends")
	}
	parts := strings.Split(wal[0].Key, "/")
	if len(parts) != 3 {
		t.Fatalf("unexpected WAL key %q", wal[0].Key)
	}
	oldPrefix := "wal/" + parts[1] + "/"
	var oldNS uint64
	if _, err := fmt.Sscanf(parts[1], "%x", &oldNS); err != nil {
		t.Fatalf("namespace of %q: %v", wal[0].Key, err)
	}

	// A crash, then a start whose compactions cannot delete the old
	// namespace's objects.
	e.caddy.Kill()
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpDelete, KeyContains: oldPrefix, Status: http.StatusInternalServerError})
	e.caddy.Restart()
	err := fhWaitFor(fhCompactWait, 200*time.Millisecond, func() error {
		man, err := e.manifest()
		if err != nil {
			return err
		}
		for _, n := range man.Namespaces {
			if n.ID == oldNS {
				return fmt.Errorf("namespace %d still listed for replay", oldNS)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("the restarted node did not retire the old namespace: %v", err)
	}
	// Its deletes are refused: the objects are still there.
	time.Sleep(2 * time.Second)
	if left := e.mustList(oldPrefix); len(left) == 0 {
		t.Fatal("the old namespace's objects went although their deletes were refused")
	}

	// Another crash before the store takes deletes again; the next
	// process's compactions must find the objects.
	e.caddy.Kill()
	remove()
	e.caddy.Restart()
	err = fhWaitFor(fhCompactWait, 200*time.Millisecond, func() error {
		if left := e.mustList(oldPrefix); len(left) > 0 {
			return fmt.Errorf("%d objects left under %s, e.g. %s", len(left), oldPrefix, left[0].Key)
		}
		return nil
	})
	if err != nil {
		t.Errorf("WAL objects of the retired namespace stay in the bucket: %v", err)
	}
	got, _, err := e.readBytes(path)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != want {
		t.Fatalf("the stream reads %q, want %q", got, want)
	}
}

// TestDeadPackLeavesTheBucketAfterAFailedDelete: a pack that no stream
// reads any more (here, its only stream was deleted) leaves the manifest
// and is then deleted. The store refuses that delete once; the running
// node must try again, where it used to forget the pack until its next
// start swept unlisted packs.
func TestDeadPackLeavesTheBucketAfterAFailedDelete(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1s"}})
	const path, ct = "/deadpack/s", "text/plain"
	e.create(path, ct)
	e.append(path, ct, []byte("packed"))
	var pack string
	err := fhWaitFor(fhCompactWait, 200*time.Millisecond, func() error {
		packs := e.mustList("pack/")
		if len(packs) == 0 {
			return fmt.Errorf("no pack yet")
		}
		pack = packs[0].Key
		return nil
	})
	if err != nil {
		t.Fatalf("the stream was not packed: %v", err)
	}

	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpDelete, KeyContains: "pack/", Status: http.StatusInternalServerError})
	if resp := e.must(fhReq{Method: http.MethodDelete, Path: path}); resp.Status/100 != 2 {
		t.Fatalf("delete: %s", resp)
	}
	err = fhWaitFor(fhCompactWait, 200*time.Millisecond, func() error {
		man, err := e.manifest()
		if err != nil {
			return err
		}
		for _, p := range man.Packs {
			if strings.HasSuffix(pack, p.Key) {
				return fmt.Errorf("pack %s still listed", pack)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("the dead pack stayed in the manifest: %v", err)
	}
	time.Sleep(2 * time.Second)
	if len(e.mustList(pack)) == 0 {
		t.Fatal("the dead pack went although its deletes were refused")
	}

	remove()
	err = fhWaitFor(fhCompactWait, 200*time.Millisecond, func() error {
		if left := e.mustList(pack); len(left) > 0 {
			return fmt.Errorf("%s is still there", pack)
		}
		return nil
	})
	if err != nil {
		t.Errorf("dead pack kept after its delete failed once: %v", err)
	}
}

// manifest reads and decodes the storage's manifest object.
func (e *fhEnv) manifest() (segment.Manifest, error) {
	var man segment.Manifest
	body, err := e.get("manifest")
	if err != nil {
		return man, err
	}
	if err := json.Unmarshal(body, &man); err != nil {
		return man, fmt.Errorf("manifest: %w", err)
	}
	return man, nil
}
