package integration

import (
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// TestLeaseRenewalWithLostAnswer: a renewal of the storage lease lands in
// the bucket but every answer to it is lost (the connection resets after
// each attempt went out), so the renewal fails with the lease object no
// longer the one the node last knew. The next renewal must recognise the
// node's own write there, not take it for another node's takeover and
// refuse every append from then on.
func TestLeaseRenewalWithLostAnswer(t *testing.T) {
	t.Parallel() // waits on timers most of its run: beside the other such tests, not after them
	const text = "text/plain"
	e := fhStart(t, fhOptions{Optional: []string{"compact_interval 1h"}})
	e.create("/lease/s", text)
	e.append("/lease/s", text, []byte("before;"))

	before := e.proxy.Counts()
	// As many as the store's attempts at one PUT: the whole renewal fails.
	const attempts = 5
	remove := e.proxy.AddFault(testenv.Fault{Op: testenv.OpPut, KeyContains: "lease", Reset: true, AfterForward: true, Times: attempts})
	defer remove()
	// Renewals come every third of the lease's 30 s.
	deadline := time.Now().Add(25 * time.Second)
	for e.proxy.Counts().Faults < before.Faults+attempts {
		if time.Now().After(deadline) {
			t.Fatal("no lease renewal within 25 s")
		}
		time.Sleep(100 * time.Millisecond)
	}
	// A failed renewal is tried again a second later: the appends wait
	// for that retry, which must find the node's own write, not a
	// takeover (a fixed pause let a late retry come after them).
	leasePuts := func() int { return e.proxy.Counts().Containing(testenv.OpPut, "lease") }
	failed := leasePuts()
	if err := fhWaitFor(15*time.Second, 50*time.Millisecond, func() error {
		if leasePuts() == failed {
			return errors.New("no renewal since the failed one")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		r := e.must(fhReq{Method: http.MethodPost, Path: "/lease/s", Header: map[string]string{"Content-Type": text}, Body: []byte("after;")})
		if r.Status/100 != 2 {
			t.Fatalf("append %d after a lease renewal whose answer was lost: %s", i, r)
		}
		time.Sleep(200 * time.Millisecond)
	}
	got, _, err := e.readBytes("/lease/s")
	if want := "before;after;after;after;after;after;"; err != nil || string(got) != want {
		t.Errorf("stream reads %q (%v), want %q", got, err, want)
	}
}
