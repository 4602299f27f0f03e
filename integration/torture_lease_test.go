package integration

// The two-node torture's short events (a cut-off shorter than a lease,
// faults on both nodes' proxies) must not hand the storage to the standby
// while the holder's lease is live. Whether it was live is a fact of the
// lease object, which the holder rewrites at every renewal: leaseWatch
// reads it straight from versitygw, past both proxies and their faults, and
// judgeTakeover tells a takeover after a lapse (a renewal that did not land
// in time, which the engine allows) from a takeover of a live lease (a
// second writer).

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
)

// leaseSeen is one reading of the lease object.
type leaseSeen struct {
	at      time.Time // when the reading was answered
	node    string
	expires time.Time
}

// readLease reads the lease object of bucket, past any proxy.
func readLease(ctx context.Context, cli *s3.Client, bucket string) (leaseSeen, error) {
	out, err := cli.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(bucket), Key: aws.String(fhLeaseKey)})
	if err != nil {
		return leaseSeen{}, fmt.Errorf("get the lease object: %w", err)
	}
	defer out.Body.Close()
	raw, err := io.ReadAll(out.Body)
	if err != nil {
		return leaseSeen{}, fmt.Errorf("read the lease object: %w", err)
	}
	return parseLease(raw)
}

// parseLease decodes a lease object as its holder wrote it (a lease given
// back expires at the Unix epoch, its expiry written as 0).
func parseLease(raw []byte) (leaseSeen, error) {
	var body struct {
		Node      string `json:"node"`
		ExpiresAt int64  `json:"expires_at_ms"`
	}
	if err := json.Unmarshal(raw, &body); err != nil {
		return leaseSeen{}, fmt.Errorf("lease object %q: %w", raw, err)
	}
	return leaseSeen{at: time.Now(), node: body.Node, expires: time.UnixMilli(body.ExpiresAt)}, nil
}

// leaseWatch reads the lease object every 50 ms until end. A lapse lasts
// at least the standby's margin past the expiry (100 ms and more), so a
// reading falls into nearly every one.
type leaseWatch struct {
	stop chan struct{}
	done chan struct{}
	mu   sync.Mutex
	seen []leaseSeen
}

// watchLease starts a watch whose first reading is taken before it
// returns, so that it names the holder at the start.
func watchLease(t *testing.T, cli *s3.Client, bucket string) *leaseWatch {
	t.Helper()
	w := &leaseWatch{stop: make(chan struct{}), done: make(chan struct{})}
	var first leaseSeen
	var err error
	for range 20 {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		first, err = readLease(ctx, cli, bucket)
		cancel()
		if err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("the lease watch's first reading: %v", err)
	}
	w.seen = []leaseSeen{first}
	go func() {
		defer close(w.done)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-w.stop:
				return
			case <-tick.C:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			s, err := readLease(ctx, cli, bucket)
			cancel()
			if err != nil {
				continue // versitygw busy: the next reading
			}
			w.mu.Lock()
			w.seen = append(w.seen, s)
			w.mu.Unlock()
		}
	}()
	return w
}

// end stops the watch and returns its readings, oldest first.
func (w *leaseWatch) end() []leaseSeen {
	close(w.stop)
	<-w.done
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.seen
}

// takeoverVerdict is what the readings of a lease watch say.
type takeoverVerdict struct {
	taken  bool   // another node wrote the lease
	lapsed bool   // the holder's last expiry seen was past before the other node's lease began
	detail string // the times, for the log
}

// judgeTakeover reads the watch's readings: the first one names the
// holder. Another node takes a lease only after reading it expired, and
// writes its own expiry as the start of its write plus ttl: a takeover is
// sound when the holder's latest expiry seen is no later than that start.
// (A holder's write that the watch missed could only make its expiry
// later, never sounder: the verdict errs towards accepting.) The
// millisecond of the lease's encoding is the tolerance.
func judgeTakeover(seen []leaseSeen, ttl time.Duration) takeoverVerdict {
	if len(seen) == 0 {
		return takeoverVerdict{}
	}
	holder := seen[0].node
	last := seen[0].expires
	for _, s := range seen {
		if s.node == holder {
			if s.expires.After(last) {
				last = s.expires
			}
			continue
		}
		began := s.expires.Add(-ttl)
		return takeoverVerdict{
			taken:  true,
			lapsed: !last.After(began.Add(time.Millisecond)),
			detail: fmt.Sprintf("node %s's lease seen expiring at %s at the latest; node %s's lease began at %s (%+dms)",
				holder, last.Format("15:04:05.000"), s.node, began.Format("15:04:05.000"), began.Sub(last).Milliseconds()),
		}
	}
	return takeoverVerdict{detail: fmt.Sprintf("node %s held the lease throughout", holder)}
}

func TestJudgeTakeover(t *testing.T) {
	base := time.UnixMilli(1_000_000)
	ttl := 3 * time.Second
	at := func(ms int) time.Time { return base.Add(time.Duration(ms) * time.Millisecond) }
	tests := []struct {
		name          string
		seen          []leaseSeen
		taken, lapsed bool
	}{
		{"no readings", nil, false, false},
		{"renewed throughout", []leaseSeen{
			{node: "a", expires: at(3000)}, {node: "a", expires: at(4000)}, {node: "a", expires: at(5000)},
		}, false, false},
		{"taken after the lapse", []leaseSeen{
			{node: "a", expires: at(3000)}, {node: "b", expires: at(3100).Add(ttl)},
		}, true, true},
		{"taken at the very millisecond", []leaseSeen{
			{node: "a", expires: at(3000)}, {node: "b", expires: at(3001).Add(ttl)},
		}, true, true},
		{"taken while live", []leaseSeen{
			{node: "a", expires: at(3000)}, {node: "a", expires: at(4000)}, {node: "b", expires: at(3500).Add(ttl)},
		}, true, false},
		{"the holder's later renewal counts, not its first", []leaseSeen{
			{node: "a", expires: at(3000)}, {node: "a", expires: at(6000)}, {node: "b", expires: at(3200).Add(ttl)},
		}, true, false},
		{"an older reading after a newer one does not hide the newer", []leaseSeen{
			{node: "a", expires: at(6000)}, {node: "a", expires: at(3000)}, {node: "b", expires: at(4000).Add(ttl)},
		}, true, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			v := judgeTakeover(tc.seen, ttl)
			if v.taken != tc.taken || v.lapsed != tc.lapsed {
				t.Errorf("taken %v lapsed %v (%s), want taken %v lapsed %v", v.taken, v.lapsed, v.detail, tc.taken, tc.lapsed)
			}
		})
	}
}
