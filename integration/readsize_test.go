package integration

import (
	"bytes"
	"testing"
)

// TestCatchUpResponsesCarry4MiB: a Durable Streams catch-up read answers
// with up to 4 MiB of records per response, so a reader of 1 MiB records
// pays one round trip per four of them; a record larger than that is split
// across responses at the cap.
func TestCatchUpResponsesCarry4MiB(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1h"}})
	const ct = "application/octet-stream"
	const path = "/readsize/s"
	e.create(path, ct)
	var written [][]byte
	for i := range 10 {
		b := fhRandomRecords(uint64(1300+i), 1, 1<<20)[0]
		e.append(path, ct, b)
		written = append(written, b)
	}
	big := fhRandomRecords(1400, 1, 5<<20)[0]
	e.append(path, ct, big)
	written = append(written, big)

	chunks, _, err := e.readFrom(path, "-1")
	if err != nil {
		t.Fatal(err)
	}
	var sizes []int
	for _, c := range chunks {
		sizes = append(sizes, len(c))
	}
	t.Logf("response sizes: %v", sizes)
	want := []int{4 << 20, 4 << 20, 2 << 20, 4 << 20, 1 << 20}
	if len(sizes) != len(want) {
		t.Fatalf("%d responses of %v bytes; want %d of %v", len(sizes), sizes, len(want), want)
	}
	for i := range want {
		if sizes[i] != want[i] {
			t.Errorf("response %d carried %d bytes; want %d", i, sizes[i], want[i])
		}
	}
	if got, all := bytes.Join(chunks, nil), bytes.Join(written, nil); !bytes.Equal(got, all) {
		t.Errorf("read %d bytes, want the %d written (equal prefix %d)", len(got), len(all), fhCommonPrefix(got, all))
	}
}
