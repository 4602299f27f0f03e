package integration

import (
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// subAckWorker is a pull-wake subscription with its wake claimed: the
// path of its ack endpoint, a heartbeat body and the claim's token.
type subAckWorker struct{ ack, body, token string }

// subAckSetup creates n pull-wake subscriptions under /r/, each following
// a stream of its own with a record in it, and claims the wake of each.
func subAckSetup(tb testing.TB, e *fhEnv, n int) []subAckWorker {
	tb.Helper()
	e.create("/r/wake", "application/json")
	ws := make([]subAckWorker, 0, n)
	for i := range n {
		id := "s" + strconv.Itoa(i)
		sub := "/r/__ds/subscriptions/" + id
		stream := "events/" + strconv.Itoa(i)
		if st, v := e.subCall("PUT", sub, `{"type":"pull-wake","streams":["`+stream+`"],"wake_stream":"wake","lease_ttl_ms":600000}`); st != http.StatusCreated {
			tb.Fatalf("create subscription %s: %d %v", id, st, v)
		}
		e.create("/r/"+stream, "application/json")
		e.append("/r/"+stream, "application/json", []byte(`{"n":1}`))
		var claim map[string]any
		// The append's note reaches the subscription in the background.
		if err := fhWaitFor(15*time.Second, 20*time.Millisecond, func() error {
			st, v := e.subCall("POST", sub+"/claim", `{"worker":"w`+id+`"}`)
			if st != http.StatusOK {
				return fmt.Errorf("claim: %d %v", st, v)
			}
			claim = v
			return nil
		}); err != nil {
			tb.Fatalf("subscription %s: %v", id, err)
		}
		ws = append(ws, subAckWorker{
			ack:   sub + "/ack",
			body:  `{"wake_id":"` + claim["wake_id"].(string) + `","generation":` + strconv.Itoa(int(claim["generation"].(float64))) + `}`,
			token: claim["token"].(string),
		})
	}
	return ws
}

// BenchmarkSubscriptionAcks measures heartbeat acks through Caddy on
// versitygw, with the S3 proxy adding 25 ms to every request, by 1, 8 and
// 32 workers, each holding the wake of a subscription of its own and
// acking in a loop. One benchmark op is one ack; every ack writes its
// subscription's document. Each subscription's document is written
// outside the manager's lock, by one writer at a time, so the acks of
// different subscriptions go to the bucket side by side: with 150 acks,
// 34, 240 and 489 acks/s in total (median 29, 31 and 56 ms), where
// writing under the one lock gave 33, 34 and 34 acks/s (median 30, 233
// and 951 ms). One worker stays near 1/(25 ms + the PUT's own time). Run
// it with e.g.
//
//	go test ./integration -run '^$' -bench SubscriptionAcks -benchtime 100x
func BenchmarkSubscriptionAcks(b *testing.B) {
	e := fhStart(b, fhOptions{})
	all := subAckSetup(b, e, 32)
	e.proxy.SetLatency(25*time.Millisecond, 0)
	client := &http.Client{Timeout: time.Minute, Transport: &http.Transport{MaxIdleConnsPerHost: len(all)}}
	b.Cleanup(client.CloseIdleConnections)
	for _, n := range []int{1, 8, 32} {
		b.Run(fmt.Sprintf("subs=%d", n), func(b *testing.B) {
			var next atomic.Int64
			var mu sync.Mutex
			var failures []string
			var latency []time.Duration
			var wg sync.WaitGroup
			b.ResetTimer()
			start := time.Now()
			for _, w := range all[:n] {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for next.Add(1) <= int64(b.N) {
						r, err := fhSend(client, e.caddy.URL(), fhReq{Method: http.MethodPost, Path: w.ack, Body: []byte(w.body),
							Header: map[string]string{"Content-Type": "application/json", "Authorization": "Bearer " + w.token}})
						mu.Lock()
						latency = append(latency, r.Took)
						if err != nil || r.Status != http.StatusOK {
							failures = append(failures, fmt.Sprintf("%s: %v %v", w.ack, r, err))
						}
						mu.Unlock()
					}
				}()
			}
			wg.Wait()
			elapsed := time.Since(start)
			b.StopTimer()
			if len(failures) > 0 {
				b.Fatalf("%d of %d acks failed, first: %s", len(failures), b.N, failures[0])
			}
			slices.Sort(latency)
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "acks/s")
			b.ReportMetric(float64(fhPercentile(latency, 50))/1e6, "p50-ms")
		})
	}
}
