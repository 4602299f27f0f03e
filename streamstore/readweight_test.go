package streamstore

import (
	"context"
	"strings"
	"testing"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

// TestReadBoundCountsHeaders: MaxBytes weighs a record's headers with its
// body, so records of large headers and small bodies fill a read as their
// size says; counting bodies only, the read below took all ten.
func TestReadBoundCountsHeaders(t *testing.T) {
	e := startEngine(t, memstore.New(), Config{})
	ctx := context.Background()
	const name = "/rw/s"
	var in []NewRecord
	for range 10 {
		in = append(in, NewRecord{Headers: []Header{{Name: "k", Value: strings.Repeat("v", 999)}}, Body: []byte("0123456789")})
	}
	if _, _, err := e.Create(ctx, name, CreateRequest{ContentType: "application/octet-stream", Records: in}); err != nil {
		t.Fatal(err)
	}
	weight := ReadWeight(in[0].Headers, len(in[0].Body))
	if weight != 1010 {
		t.Fatalf("ReadWeight of a record of 1000 header bytes and a 10-byte body: %d, want 1010", weight)
	}
	for _, tc := range []struct {
		maxBytes, want int
	}{
		{1, 1}, // the first record comes whatever it weighs
		{weight, 1},
		{2*weight - 1, 1},
		{2 * weight, 2},
		{5*weight + 10, 5},
		{0, 10}, // no bound
		{1 << 20, 10},
	} {
		res, err := e.Read(ctx, name, ReadRequest{Seq: 0, MaxBytes: tc.maxBytes})
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Records) != tc.want {
			t.Errorf("a read of MaxBytes %d: %d records, want %d", tc.maxBytes, len(res.Records), tc.want)
		}
		res.Release()
	}
}
