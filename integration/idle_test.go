package integration

import (
	"bytes"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"
)

// TestBurstOfIdleStreamsLeavesMemory: a thousand streams written once and
// then left alone leave memory about a sweep after they go idle (30 s),
// folded into data objects by a compaction the sweep starts, although
// compact_interval is an hour; then every one reads back byte-exact.
func TestBurstOfIdleStreamsLeavesMemory(t *testing.T) {
	t.Parallel() // waits on timers most of its run: beside the other such tests, not after them
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	const streams = 1000
	const contentType = "application/octet-stream"
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1h"}})
	paths := make([]string, streams)
	bodies := fhRandomRecords(9100, streams, 300)
	var wg sync.WaitGroup
	errs := make(chan error, streams)
	sem := make(chan struct{}, 32)
	for i := range paths {
		paths[i] = fmt.Sprintf("/burst/s%04d", i)
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			for _, r := range []fhReq{
				{Method: http.MethodPut, Path: paths[i], Header: map[string]string{"Content-Type": contentType}},
				{Method: http.MethodPost, Path: paths[i], Header: map[string]string{"Content-Type": contentType}, Body: bodies[i]},
			} {
				resp, err := e.send(r)
				if err != nil {
					errs <- err
					return
				}
				if resp.Status/100 != 2 {
					errs <- fmt.Errorf("%s %s: %s", r.Method, r.Path, resp)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	written := time.Now()
	if held := mMust(t, e.caddy.AdminAddr()).sum("picomq_streams_in_memory"); held < streams {
		t.Fatalf("%v streams in memory right after writing %d", held, streams)
	}

	// 30 s to go idle, up to 10 s to the next sweep, and the fold.
	var folds float64
	err := fhWaitFor(75*time.Second, 500*time.Millisecond, func() error {
		m := mMust(t, e.caddy.AdminAddr())
		folds = m.sum("picomq_compaction_folds_total")
		if held := m.sum("picomq_streams_in_memory"); held != 0 {
			return fmt.Errorf("%v of %d idle streams still in memory %s after the last write, %v folded",
				held, streams, time.Since(written).Round(time.Second), folds)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("all %d streams out of memory %s after the last write, %v folds", streams, time.Since(written).Round(time.Second), folds)
	if folds < streams {
		t.Fatalf("%v folds for %d streams that left memory", folds, streams)
	}
	if data := e.mustList("data/"); len(data) < streams {
		t.Fatalf("%d data objects for %d folded streams", len(data), streams)
	}
	// Read back as they were written, 32 at a time.
	readErrs := make(chan error, streams)
	for i, p := range paths {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			got, _, err := e.readBytes(p)
			switch {
			case err != nil:
				readErrs <- err
			case !bytes.Equal(got, bodies[i]):
				readErrs <- fmt.Errorf("%s read back %d bytes, want the %d appended (first difference at %d)",
					p, len(got), len(bodies[i]), firstDiff(got, bodies[i]))
			}
		})
	}
	wg.Wait()
	close(readErrs)
	for err := range readErrs {
		t.Error(err)
	}
}
