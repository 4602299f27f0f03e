package integration

import (
	"bytes"
	"encoding/json"
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

// TestCatchUpOfTinyRecordsIsBoundedInMemory: a catch-up response's 4 MiB
// bounds the records it holds in memory too, not only their bodies. A
// response of one-byte JSON messages carries at most 4 MiB / 64 of them
// (a record is 64 bytes in memory before its body); counting bodies only,
// one response held every record up to the tail (four million one-byte
// records: 256 MiB for one read).
func TestCatchUpOfTinyRecordsIsBoundedInMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1h"}})
	const ct = "application/json"
	const path = "/readsize/tiny"
	e.create(path, ct)
	const appends, perAppend = 5, 20_000
	body := digitMessages(perAppend)
	for range appends {
		e.append(path, ct, body)
	}

	chunks, _, err := e.readFrom(path, "-1")
	if err != nil {
		t.Fatal(err)
	}
	const most = (4 << 20) / 64
	var counts []int
	total := 0
	for i, c := range chunks {
		var msgs []json.RawMessage
		if err := json.Unmarshal(c, &msgs); err != nil {
			t.Fatalf("response %d is not a JSON array: %v", i, err)
		}
		for j, m := range msgs {
			if want := string(rune('0' + (total+j)%10)); string(m) != want {
				t.Fatalf("message %d is %s, want %s", total+j, m, want)
			}
		}
		counts = append(counts, len(msgs))
		total += len(msgs)
	}
	t.Logf("%d one-byte messages in responses of %v", appends*perAppend, counts)
	if total != appends*perAppend {
		t.Fatalf("read %d messages, want %d", total, appends*perAppend)
	}
	for i, n := range counts {
		if n > most {
			t.Errorf("response %d carried %d one-byte messages, more than the %d whose Records take 4 MiB", i, n, most)
		}
	}
}
