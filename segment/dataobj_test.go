package segment

import (
	"bytes"
	"errors"
	"testing"
)

func TestDecodeDataRejectsDamage(t *testing.T) {
	good := EncodeData([]Record{{Seq: 1, Timestamp: 2, Body: []byte("hello")}})
	tests := []struct {
		name string
		data []byte
	}{
		{"flipped body byte", func() []byte { b := bytes.Clone(good); b[len(b)-6] ^= 1; return b }()},
		{"truncated", good[:len(good)-1]},
		{"wrong magic", append([]byte("PMQX"), good[4:]...)},
		{"empty", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := DecodeData(tt.data); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("err = %v, want ErrCorrupt", err)
			}
		})
	}
}
