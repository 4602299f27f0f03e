package picomq

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/picomq/caddy-picomq/segment"
	"github.com/picomq/caddy-picomq/streamstore"
)

// atTail decides the upToDate of the control event an SSE feed gets when
// the server shuts down: only a feed that has every record of its stream
// is told it is up to date, not one the hub left behind records that
// landed during its last pass.
func TestAtTail(t *testing.T) {
	ctx := context.Background()
	store, err := segment.Open("file://"+t.TempDir(), segment.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	eng := streamstore.New(store, streamstore.Config{NodeID: "test-node", FlushInterval: time.Millisecond}, zaptest.NewLogger(t))
	if err := eng.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close(context.Background()) })
	info, _, err := eng.Create(ctx, "/s", streamstore.CreateRequest{ContentType: "text/plain"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := eng.Append(ctx, "/s", streamstore.AppendRequest{Records: []streamstore.NewRecord{{Body: []byte("a")}, {Body: []byte("b")}}}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, stream, id string
		pos              position
		want             bool
	}{
		{"at the tail", "/s", info.ID, position{seq: 2}, true},
		{"a record short of it", "/s", info.ID, position{seq: 1}, false},
		{"inside the last record", "/s", info.ID, position{seq: 1, off: 1}, false},
		{"another stream under the name", "/s", "other-id", position{seq: 2}, false},
		{"no stream", "/none", info.ID, position{seq: 0}, false},
	} {
		if got := atTail(ctx, eng, tc.stream, tc.id, tc.pos); got != tc.want {
			t.Errorf("%s: atTail %v, want %v", tc.name, got, tc.want)
		}
	}
}
