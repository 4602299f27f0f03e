package integration

import (
	"bytes"
	"fmt"
	"testing"
)

// TestSlowStreamMergesThroughCaddy: a stream appended to once per
// compaction keeps one growing data object in the bucket, each fold paying
// one GET of the object it continues; it reads back whole from a restarted
// Caddy. With merge_below off, each fold writes an object of its own and
// reads none.
func TestSlowStreamMergesThroughCaddy(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const rounds = 5
	cases := []struct {
		name        string
		directives  []string
		wantObjects int
		wantGETs    int // data GETs while folding
	}{
		{"default", nil, 1, rounds - 1},
		{"off", []string{"merge_below off"}, rounds, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := fhStart(t, fhOptions{Directives: append([]string{"compact_interval 1s", "pack_below off"}, tc.directives...)})
			const ct = "text/plain"
			const name = "/merge/slow"
			e.create(name, ct)
			var written [][]byte
			before := e.proxy.Counts()
			for round := range rounds {
				body := []byte(fmt.Sprintf("round %d;", round))
				e.append(name, ct, body)
				written = append(written, body)
				if err := e.waitGone("wal/"); err != nil {
					t.Fatalf("round %d not compacted: %v", round, err)
				}
			}
			gets := e.proxy.Counts().Containing("GET", "/data/") - before.Containing("GET", "/data/")
			objs := e.mustList("data/")
			t.Logf("%d data objects after %d folds, %d data GETs while folding", len(objs), rounds, gets)
			if len(objs) != tc.wantObjects || gets != tc.wantGETs {
				var keys []string
				for _, o := range objs {
					keys = append(keys, o.Key)
				}
				t.Fatalf("%d data objects %v and %d data GETs after %d folds, want %d and %d",
					len(objs), keys, gets, rounds, tc.wantObjects, tc.wantGETs)
			}

			e.caddy.Kill()
			e.caddy.Restart()
			got, _, err := e.readBytes(name)
			if err != nil {
				t.Fatalf("read after the restart: %v", err)
			}
			if want := bytes.Join(written, nil); !bytes.Equal(got, want) {
				t.Fatalf("read back %q, want %q", got, want)
			}
		})
	}
}
