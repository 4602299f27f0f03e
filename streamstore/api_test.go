package streamstore

import (
	"errors"
	"strings"
	"testing"
)

func TestValidateName(t *testing.T) {
	tests := []struct {
		name string
		ok   bool
	}{
		{"/a", true},
		{"/a/b/c", true},
		{"/with space/ünïcode/x.y", true},
		{"/a/..b/c..", true},
		{"/" + strings.Repeat("x", MaxNameLength-1), true},
		{"", false},
		{"/", false},
		{"a/b", false},
		{"//a", false},
		{"/a//b", false},
		{"/a/", false},
		{"/a/./b", false},
		{"/a/../b", false},
		{"/..", false},
		{"/a/b\x00c", false},
		{"/a\xffb", false},
		{"/a/\xc3\x28", false},
		{"/a/\xed\xa0\x80", false}, // a UTF-16 surrogate
		{"/\u00e9t\u00e9/\u65e5\u672c", true},
		{"/" + strings.Repeat("x", MaxNameLength), false},
	}
	for _, tt := range tests {
		err := ValidateName(tt.name)
		if (err == nil) != tt.ok {
			t.Errorf("ValidateName(%q) = %v, want ok %v", tt.name, err, tt.ok)
		}
		if err != nil && !errors.Is(err, ErrBadRequest) {
			t.Errorf("ValidateName(%q) = %v, not a bad request", tt.name, err)
		}
	}
}

func BenchmarkValidateName(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		if err := ValidateName("/tenant-17/orders/eu-west/2026/stream-000123"); err != nil {
			b.Fatal(err)
		}
	}
}
