package integration

import (
	"fmt"
	"sync"
	"testing"
)

// Pico stamps each append max(now, previous + 1), so that timestamps never
// go back within a stream. A burst of appends in one flush stamps the last
// ones ahead of the clock, and a fork made then (through Durable Streams)
// inherits them: its own records go on from them, not from the clock,
// those of its first append as well as those its create carried.
func TestForkTimestampsGoOnFromItsSource(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"compact_interval 1h"}, nil)
	for _, inCreate := range []bool{false, true} {
		src := fmt.Sprintf("/ts/%v/src", inCreate)
		fork := fmt.Sprintf("/ts/%v/fork", inCreate)
		picoWant(t, "create", picoDo(e, "PUT", "/pico"+src, nil, "Content-Type", "text/plain"), 201)
		const n = 300
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if r := picoDo(e, "POST", "/pico"+src, []byte(fmt.Sprint(i)), "Content-Type", "text/plain"); r.Status != 200 {
					t.Errorf("append %d: %s", i, r)
				}
			}()
		}
		wg.Wait()
		if inCreate {
			picoWant(t, "fork with a body", picoDo(e, "PUT", "/ds"+fork, []byte("own"),
				"Stream-Forked-From", "/ds"+src, "Content-Type", "text/plain"), 201)
		} else {
			picoWant(t, "fork", picoDo(e, "PUT", "/ds"+fork, nil, "Stream-Forked-From", "/ds"+src), 201)
			picoWant(t, "the fork's own append", picoDo(e, "POST", "/pico"+fork, []byte("own"), "Content-Type", "text/plain"), 200)
		}
		recs := picoRecords(t, picoDo(e, "GET", "/pico"+fork+"?seq=0", nil))
		if len(recs) != n+1 {
			t.Fatalf("%s reads %d records, want %d", fork, len(recs), n+1)
		}
		for i := 1; i < len(recs); i++ {
			if recs[i].Timestamp < recs[i-1].Timestamp {
				t.Errorf("%s: record %d is stamped %d, the one before it %d: back in time", fork, i, recs[i].Timestamp, recs[i-1].Timestamp)
			}
		}
	}
}
