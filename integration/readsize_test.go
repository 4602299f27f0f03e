package integration

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
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

// TestReadsCountRecordHeaders: a read's byte bound counts the records'
// headers as well as their bodies. Pico records may carry a megabyte of
// headers and no body; counting bodies only, a Pico read (1 MiB unless
// bytes= asks for up to 4 MiB) answered every record up to its 10,000 in
// one page, and a Durable Streams read held up to 65,536 such records at
// once for a response of a few bytes: each reader could make Caddy hold
// what a stream's writers had stored, not what a page is said to carry.
// Every record still comes back, a page at a time.
func TestReadsCountRecordHeaders(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"compact_interval 1h"}, nil)
	const path = "/readsize/headers"
	const records, headerBytes = 12, 1 << 20
	picoWant(t, "PUT /pico"+path, picoDo(e, http.MethodPut, "/pico"+path, nil, "Content-Type", "application/octet-stream"), http.StatusCreated)
	batch := make([]picoNewRecord, records)
	for i := range batch {
		value := strings.Repeat(string(rune('a'+i)), headerBytes)
		batch[i] = picoNewRecord{headers: [][2]string{{"h", value}}, body: []byte{byte('A' + i)}}
	}
	picoWant(t, "POST a batch", picoDo(e, http.MethodPost, "/pico"+path, picoEncodeBinary(batch), "Content-Type", picoBinaryBatch),
		http.StatusOK, "Pico-Next-Seq", strconv.Itoa(records))

	// One record takes a little over 1 MiB: a page carries one more than
	// fits its bound at most (the first always comes).
	const record = headerBytes + 2
	for _, tc := range []struct {
		query string
		bound int
	}{
		{"", 1 << 20},
		{"&bytes=4194304", 4 << 20},
	} {
		var got []picoReadRecord
		pages := 0
		for seq := 0; seq < records; pages++ {
			if pages > records {
				t.Fatalf("%s: no end after %d pages", tc.query, pages)
			}
			u := fmt.Sprintf("/pico%s?seq=%d&format=binary%s", path, seq, tc.query)
			r := picoDo(e, http.MethodGet, u, nil)
			picoWant(t, "GET "+u, r, http.StatusOK)
			if len(r.Body) > tc.bound+record+64 {
				t.Errorf("GET %s: a page of %d bytes, over its %d-byte bound by more than one record", u, len(r.Body), tc.bound)
			}
			page, err := picoDecodeBinaryRead(r.Body)
			if err != nil || len(page) == 0 {
				t.Fatalf("GET %s: %d records (%v)", u, len(page), err)
			}
			got = append(got, page...)
			seq += len(page)
		}
		t.Logf("Pico reads%s: %d records in %d pages", tc.query, len(got), pages)
		for i, rec := range got {
			if rec.seq != uint64(i) || len(rec.body) != 1 || rec.body[0] != byte('A'+i) || len(rec.headers) != 1 ||
				rec.headers[0][1] != batch[i].headers[0][1] {
				t.Fatalf("record %d read back as seq %d, body %q, %d headers", i, rec.seq, rec.body, len(rec.headers))
			}
		}
	}

	// A Durable Streams response carries the bodies only, but holds the
	// records it read, headers and all, until it is written: 4 MiB of
	// them, three or four records here, not all twelve.
	chunks, _, err := e.readFrom("/ds"+path, "-1")
	if err != nil {
		t.Fatal(err)
	}
	var sizes []int
	for _, c := range chunks {
		sizes = append(sizes, len(c))
		if len(c) > (4<<20)/headerBytes+1 {
			t.Errorf("a Durable Streams response carried %d records of a megabyte each", len(c))
		}
	}
	t.Logf("Durable Streams reads: records per response %v", sizes)
	if all := bytes.Join(chunks, nil); string(all) != "ABCDEFGHIJKL" {
		t.Errorf("Durable Streams read %q, want ABCDEFGHIJKL", all)
	}
}
