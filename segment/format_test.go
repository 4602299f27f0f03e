package segment_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
)

// The format object: created in an empty bucket, moved on from the version
// before packs (which a build without packs must then refuse), and a
// version this build does not know is refused with the reason.
func TestCheckFormat(t *testing.T) {
	for _, tc := range []struct {
		name    string
		before  string // "" when the bucket has no format object
		others  bool   // the bucket holds a manifest
		after   int
		refused string
	}{
		{name: "empty bucket", before: "", after: segment.FormatVersion},
		{name: "current", before: `{"picomq_format":4}`, after: 4},
		{name: "before create entries", before: `{"picomq_format":3}`, after: 4},
		{name: "before repacks", before: `{"picomq_format":2}`, after: 4},
		{name: "before packs", before: `{"picomq_format":1}`, after: 4},
		{name: "newer", before: `{"picomq_format":5}`, after: 5, refused: "format version 5"},
		{name: "not ours", before: `{"other":1}`, refused: "version 0"},
		// A manifest without a format object: the format object was lost
		// or left out of a copy. It used to be created as this build's,
		// over storage a newer build may have laid out.
		{name: "lost", others: true, refused: "no format object"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := memstore.New()
			if tc.before != "" {
				if _, err := st.Put(ctx, "format", []byte(tc.before), segment.PutOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			if tc.others {
				if _, err := st.Put(ctx, "manifest", []byte(`{"version":1,"next_namespace":7}`), segment.PutOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			err := segment.CheckFormat(ctx, st)
			if tc.refused != "" {
				if err == nil || !strings.Contains(err.Error(), tc.refused) {
					t.Fatalf("CheckFormat over %s: %v; want a refusal naming %q", tc.before, err, tc.refused)
				}
				if data, _, gerr := st.Get(ctx, "format", 0, -1); string(data) != tc.before && gerr == nil {
					t.Fatalf("the refusal left format object %s; want %q", data, tc.before)
				}
				return
			}
			if err != nil {
				t.Fatalf("CheckFormat over %q: %v", tc.before, err)
			}
			data, _, err := st.Get(ctx, "format", 0, -1)
			if err != nil {
				t.Fatal(err)
			}
			var f struct {
				Format int `json:"picomq_format"`
			}
			if err := json.Unmarshal(data, &f); err != nil || f.Format != tc.after {
				t.Fatalf("format object after CheckFormat over %q: %s (%v); want version %d", tc.before, data, err, tc.after)
			}
		})
	}
}
