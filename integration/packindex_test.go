package integration

import (
	"encoding/json"
	"fmt"
	"hash/crc32"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/segment"
)

// TestPackIndexOutOfRangeIsRefusedAtStart: through Caddy on
// versitygw, a pack whose index matches its checksum but gives an entry a
// negative length (only a faulty writer makes one) is refused at the
// start, as an index that fails its checksum is: Caddy does not start,
// and its log names the pack and the entry. Its spans used to be sliced as
// they came: Caddy started, and the first read of the stream panicked and
// took the process down.
func TestPackIndexOutOfRangeIsRefusedAtStart(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 200ms"}})
	const ct = "text/plain"
	paths := []string{"/packidx/a", "/packidx/b"}
	for _, p := range paths {
		e.create(p, ct)
		e.append(p, ct, []byte("r0;"))
	}
	if err := fhWaitFor(fhCompactWait, 100*time.Millisecond, func() error {
		if wal := e.mustList("wal/"); len(wal) > 0 {
			return fmt.Errorf("WAL objects %v", wal)
		}
		if packs := e.mustList("pack/"); len(packs) == 0 {
			return fmt.Errorf("no pack")
		}
		return nil
	}); err != nil {
		t.Fatalf("the appends were not packed: %v", err)
	}
	if err := e.caddy.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}

	raw, err := e.get("manifest")
	if err != nil {
		t.Fatal(err)
	}
	var man map[string]any
	if err := json.Unmarshal(raw, &man); err != nil {
		t.Fatalf("manifest: %v", err)
	}
	packs, _ := man["packs"].([]any)
	if len(packs) != 1 {
		t.Fatalf("manifest lists packs %v; the test needs one", man["packs"])
	}
	var ref segment.PackRef
	b, _ := json.Marshal(packs[0])
	if err := json.Unmarshal(b, &ref); err != nil {
		t.Fatal(err)
	}
	obj, err := e.get(ref.Key)
	if err != nil {
		t.Fatal(err)
	}
	var idx []map[string]any
	if err := json.Unmarshal(obj[ref.IndexOff:ref.IndexOff+ref.IndexLen], &idx); err != nil {
		t.Fatalf("index of %s: %v", ref.Key, err)
	}
	idx[len(idx)-1]["l"] = -3
	bent, err := json.Marshal(idx)
	if err != nil {
		t.Fatal(err)
	}
	fhPutRaw(t, e, ref.Key, append(obj[:ref.IndexOff:ref.IndexOff], bent...))
	p := packs[0].(map[string]any)
	p["index_len"] = len(bent)
	p["index_crc"] = crc32.Checksum(bent, crc32.MakeTable(crc32.Castagnoli))
	raw, err = json.Marshal(man)
	if err != nil {
		t.Fatal(err)
	}
	fhPutRaw(t, e, "manifest", raw)

	err = e.caddy.TryRestart()
	if err == nil {
		// The old code started, and the first read of the stream panicked.
		for _, path := range paths {
			resp, rerr := e.send(fhReq{Method: http.MethodGet, Path: path + "?offset=-1"})
			t.Logf("a read of %s: %v %v", path, resp, rerr)
		}
		t.Fatalf("Caddy started on a pack index whose spans the pack cannot hold; running: %v", e.caddy.Running())
	}
	logs := e.caddy.Logs()
	if !strings.Contains(logs, "damaged") || !strings.Contains(logs, "index of "+ref.Key) || !strings.Contains(logs, "+-3") {
		t.Fatalf("the refused start (%v) does not say the index of %s is damaged: %s", err, ref.Key, logs)
	}
	if strings.Contains(logs, "panic") {
		t.Fatalf("Caddy panicked: %s", logs)
	}
}
