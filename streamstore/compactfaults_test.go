package streamstore

import (
	"context"
	"fmt"
	"strings"
	"testing"
)

func TestWindowBeforeAPackLeavesTheStream(t *testing.T) {
	ctx := context.Background()
	st := newHookedStore()
	e := startEngine(t, st, Config{})
	for _, n := range []string{"/big", "/small"} {
		if _, _, err := e.Create(ctx, n, CreateRequest{ContentType: "text/plain"}); err != nil {
			t.Fatal(err)
		}
	}
	body := strings.Repeat("x", 200<<10) // inline, not a blob
	for range 170 {                      // 34 MiB: past lostWindowBytes
		mustAppend(t, e, "/big", AppendRequest{Records: recs(body)})
	}
	mustAppend(t, e, "/small", AppendRequest{Records: recs("a1")})
	big, _ := e.Head(ctx, "/big")
	st.setHook(func(op, key string) error {
		if op == "PUT" && strings.HasPrefix(key, dataPrefix(big.ID)) {
			return fmt.Errorf("injected: PUT %s failed", key)
		}
		return nil
	})
	if err := e.Compact(ctx); err == nil {
		t.Fatal("the compaction whose fold failed reported success")
	}
	st.setHook(nil)
	t.Logf("after the failed compaction: packs %v, /small has %d pack run(s)", st.Keys("pack/"), packRuns(e, "/small"))
	dropCache(e) // appends would push the failed fold's runs out
	todo, end := e.allStreams(), e.commitPos()
	t.Logf("windows of the next compaction: %d", len(e.lostWindows(todo, end)))
	func() {
		defer func() {
			if r := recover(); r != nil {
				t.Fatalf("the next compaction panicked: %v", r)
			}
		}()
		if err := e.Compact(ctx); err != nil {
			t.Fatalf("the next compaction: %v", err)
		}
	}()
	if got := fmt.Sprint(readAll(t, e, "/small")); got != "[a1]" {
		t.Fatalf("/small reads %s", got)
	}
}
