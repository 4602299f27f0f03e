// Package storetest is the contract test suite every segment.Store backend
// must pass: S3's semantics for plain, create-only and compare-and-swap
// writes, ranged reads, listings in byte order, and bulk deletes.
package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/picomq/caddy-picomq/segment"
)

// Run runs the contract suite. open must return an empty store, a new one
// on every call, and release it when t ends.
func Run(t *testing.T, open func(t *testing.T) segment.Store) {
	t.Helper()
	tests := []struct {
		name string
		fn   func(t *testing.T, s segment.Store)
	}{
		{"PutGet", testPutGet},
		{"RangedGet", testRangedGet},
		{"Overwrite", testOverwrite},
		{"Missing", testMissing},
		{"GetBuffer", testGetBuffer},
		{"IfNoneMatch", testIfNoneMatch},
		{"IfMatch", testIfMatch},
		{"ListOrder", testListOrder},
		{"ListPrefix", testListPrefix},
		{"ListStartAfter", testListStartAfter},
		{"ListPaging", testListPaging},
		{"ListInfo", testListInfo},
		{"DeleteMany", testDeleteMany},
		{"DeleteBatches", testDeleteBatches},
		{"DeleteAndRecreate", testDeleteAndRecreate},
		{"DeleteIfMatch", testDeleteIfMatch},
		{"RaceIfNoneMatch", testRaceIfNoneMatch},
		{"RaceIfMatchCounter", testRaceIfMatchCounter},
		{"RacePutDeleteSameFolder", testRacePutDelete},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.fn(t, open(t))
		})
	}
}

func ctxFor(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func mustPut(t *testing.T, s segment.Store, key string, data []byte, opts segment.PutOptions) string {
	t.Helper()
	etag, err := s.Put(ctxFor(t), key, data, opts)
	if err != nil {
		t.Fatalf("Put(%q, %+v): %v", key, opts, err)
	}
	if etag == "" {
		t.Fatalf("Put(%q): empty ETag", key)
	}
	return etag
}

func mustGet(t *testing.T, s segment.Store, key string) ([]byte, string) {
	t.Helper()
	data, etag, err := s.Get(ctxFor(t), key, 0, -1)
	if err != nil {
		t.Fatalf("Get(%q): %v", key, err)
	}
	return data, etag
}

func listAll(t *testing.T, s segment.Store, prefix string) []string {
	t.Helper()
	var keys []string
	after := ""
	for {
		objs, more, err := s.List(ctxFor(t), prefix, after, 1000)
		if err != nil {
			t.Fatalf("List(%q, %q): %v", prefix, after, err)
		}
		for _, o := range objs {
			keys = append(keys, o.Key)
		}
		if !more {
			return keys
		}
		if len(objs) == 0 {
			t.Fatalf("List(%q, %q): more with no objects", prefix, after)
		}
		after = objs[len(objs)-1].Key
	}
}

func testPutGet(t *testing.T, s segment.Store) {
	big := bytes.Repeat([]byte("0123456789abcdef"), 64<<10) // 1 MiB
	cases := []struct {
		key  string
		data []byte
	}{
		{"k", []byte("hello")},
		{"empty", []byte{}},
		{"deep/er/and/deeper/key", []byte("deep")},
		{"big/object", big},
		{"binary", []byte{0, 1, 2, 0xff, '\n', 0}},
		{"odd chars/ -_~+=,;@é", []byte("odd")},
	}
	etags := map[string]string{}
	for _, c := range cases {
		etags[c.key] = mustPut(t, s, c.key, c.data, segment.PutOptions{})
	}
	for _, c := range cases {
		got, etag := mustGet(t, s, c.key)
		if !bytes.Equal(got, c.data) {
			t.Errorf("Get(%q) = %d bytes, want %d", c.key, len(got), len(c.data))
		}
		if etag != etags[c.key] {
			t.Errorf("Get(%q) ETag = %s, Put returned %s", c.key, etag, etags[c.key])
		}
	}
	if etags["k"] == etags["binary"] {
		t.Errorf("different contents share ETag %s", etags["k"])
	}
	// Same content, same ETag: it is a content hash.
	if e := mustPut(t, s, "k2", []byte("hello"), segment.PutOptions{}); e != etags["k"] {
		t.Errorf("ETag of equal content: %s vs %s", e, etags["k"])
	}
}

func testRangedGet(t *testing.T, s segment.Store) {
	data := []byte("0123456789")
	etag := mustPut(t, s, "r/obj", data, segment.PutOptions{})
	mustPut(t, s, "r/empty", nil, segment.PutOptions{})
	cases := []struct {
		key            string
		offset, length int64
		want           string
	}{
		{"r/obj", 0, -1, "0123456789"},
		{"r/obj", 0, 10, "0123456789"},
		{"r/obj", 0, 3, "012"},
		{"r/obj", 2, 3, "234"},
		{"r/obj", 7, -1, "789"},
		{"r/obj", 9, 1, "9"},
		{"r/obj", 8, 100, "89"},
		{"r/obj", 4, 0, ""},
		{"r/obj", 10, -1, ""},
		{"r/obj", 10, 5, ""},
		{"r/obj", 50, 5, ""},
		{"r/empty", 0, -1, ""},
		{"r/empty", 0, 10, ""},
		{"r/empty", 3, -1, ""},
	}
	for _, c := range cases {
		got, e, err := s.Get(ctxFor(t), c.key, c.offset, c.length)
		if err != nil {
			t.Errorf("Get(%q, %d, %d): %v", c.key, c.offset, c.length, err)
			continue
		}
		if string(got) != c.want {
			t.Errorf("Get(%q, %d, %d) = %q, want %q", c.key, c.offset, c.length, got, c.want)
		}
		if c.key == "r/obj" && e != etag {
			t.Errorf("Get(%q, %d, %d) ETag = %s, want %s (the whole object's)", c.key, c.offset, c.length, e, etag)
		}
		if e == "" {
			t.Errorf("Get(%q, %d, %d): empty ETag", c.key, c.offset, c.length)
		}
	}
	for _, c := range []struct{ offset, length int64 }{{0, -1}, {3, 2}, {0, 0}, {20, 1}} {
		if _, _, err := s.Get(ctxFor(t), "r/missing", c.offset, c.length); !errors.Is(err, segment.ErrNotFound) {
			t.Errorf("Get(missing, %d, %d) error = %v, want ErrNotFound", c.offset, c.length, err)
		}
	}
}

func testOverwrite(t *testing.T, s segment.Store) {
	e1 := mustPut(t, s, "o/key", []byte("first version"), segment.PutOptions{})
	e2 := mustPut(t, s, "o/key", []byte("second"), segment.PutOptions{})
	if e1 == e2 {
		t.Fatalf("overwrite kept ETag %s", e1)
	}
	got, etag := mustGet(t, s, "o/key")
	if string(got) != "second" || etag != e2 {
		t.Fatalf("Get = %q %s, want %q %s", got, etag, "second", e2)
	}
	if keys := listAll(t, s, ""); !slices.Equal(keys, []string{"o/key"}) {
		t.Fatalf("List = %q", keys)
	}
}

func testMissing(t *testing.T, s segment.Store) {
	mustPut(t, s, "dir/sub/x", []byte("x"), segment.PutOptions{})
	for _, key := range []string{"nothing", "dir/nothing", "nodir/x", "dir/sub/x/y", "dir", "dir/sub"} {
		if _, _, err := s.Get(ctxFor(t), key, 0, -1); !errors.Is(err, segment.ErrNotFound) {
			t.Errorf("Get(%q) error = %v, want ErrNotFound", key, err)
		}
	}
	objs, more, err := s.List(ctxFor(t), "nothing/", "", 10)
	if err != nil || len(objs) != 0 || more {
		t.Errorf("List(nothing/) = %v, %v, %v; want empty", objs, more, err)
	}
}

// testGetBuffer: a store that reads into its caller's buffers asks for
// one of the object's size and fills it; a missing key is ErrNotFound.
// Stores without GetBuffer skip nothing here: they have no such contract.
func testGetBuffer(t *testing.T, s segment.Store) {
	bg, ok := s.(segment.BufferGetter)
	if !ok {
		return
	}
	data := bytes.Repeat([]byte("0123456789abcdef"), 5000)
	mustPut(t, s, "buf/x", data, segment.PutOptions{})
	var asked []int
	alloc := func(n int) []byte {
		asked = append(asked, n)
		return make([]byte, n, n+100)
	}
	got, err := bg.GetBuffer(ctxFor(t), "buf/x", alloc)
	if err != nil {
		t.Fatalf("GetBuffer: %v", err)
	}
	if !bytes.Equal(got, data) {
		t.Fatalf("GetBuffer returned %d bytes, want the %d put", len(got), len(data))
	}
	if len(asked) != 1 || asked[0] != len(data) || cap(got) != len(data)+100 {
		t.Fatalf("asked for buffers of %v bytes, returned one of cap %d; want one of %d, the one allocated", asked, cap(got), len(data))
	}
	if _, err := bg.GetBuffer(ctxFor(t), "buf/nothing", alloc); !errors.Is(err, segment.ErrNotFound) {
		t.Fatalf("GetBuffer of a missing key: %v, want ErrNotFound", err)
	}
}

func testIfNoneMatch(t *testing.T, s segment.Store) {
	ctx := ctxFor(t)
	create := segment.PutOptions{IfNoneMatch: true}
	etag := mustPut(t, s, "inm/new", []byte("one"), create)
	_, err := s.Put(ctx, "inm/new", []byte("two"), create)
	if !errors.Is(err, segment.ErrPreconditionFailed) {
		t.Fatalf("second create: error = %v, want ErrPreconditionFailed", err)
	}
	got, e := mustGet(t, s, "inm/new")
	if string(got) != "one" || e != etag {
		t.Fatalf("after the failed create: %q %s, want %q %s", got, e, "one", etag)
	}
	// A create-only write of a fresh key in a fresh folder, and of one
	// beside an existing object.
	mustPut(t, s, "inm/deep/fresh/key", []byte("x"), create)
	mustPut(t, s, "inm/new2", []byte("x"), create)
	// After a delete the key can be created again.
	if err := s.Delete(ctx, []string{"inm/new"}); err != nil {
		t.Fatal(err)
	}
	mustPut(t, s, "inm/new", []byte("three"), create)
	if got, _ := mustGet(t, s, "inm/new"); string(got) != "three" {
		t.Fatalf("re-created = %q", got)
	}
}

func testIfMatch(t *testing.T, s segment.Store) {
	ctx := ctxFor(t)
	e1 := mustPut(t, s, "im/key", []byte("v1"), segment.PutOptions{})
	e2 := mustPut(t, s, "im/key", []byte("v2"), segment.PutOptions{IfMatch: e1})
	if e2 == e1 {
		t.Fatal("compare-and-swap kept the ETag")
	}
	// e1 is stale now.
	if _, err := s.Put(ctx, "im/key", []byte("v3"), segment.PutOptions{IfMatch: e1}); !errors.Is(err, segment.ErrPreconditionFailed) {
		t.Fatalf("stale ETag: error = %v, want ErrPreconditionFailed", err)
	}
	if _, err := s.Put(ctx, "im/key", []byte("v3"), segment.PutOptions{IfMatch: `"0123456789abcdef0123456789abcdef"`}); !errors.Is(err, segment.ErrPreconditionFailed) {
		t.Fatalf("made-up ETag: error = %v, want ErrPreconditionFailed", err)
	}
	got, e := mustGet(t, s, "im/key")
	if string(got) != "v2" || e != e2 {
		t.Fatalf("after failed swaps: %q %s, want v2 %s", got, e, e2)
	}
	// On a missing key the condition is false.
	if _, err := s.Put(ctx, "im/missing", []byte("x"), segment.PutOptions{IfMatch: e2}); !errors.Is(err, segment.ErrPreconditionFailed) {
		t.Fatalf("IfMatch on a missing key: error = %v, want ErrPreconditionFailed", err)
	}
	if _, _, err := s.Get(ctx, "im/missing", 0, -1); !errors.Is(err, segment.ErrNotFound) {
		t.Fatalf("failed IfMatch created the key: %v", err)
	}
	// The ETag from a listing works as well.
	objs, _, err := s.List(ctx, "im/", "", 10)
	if err != nil || len(objs) != 1 {
		t.Fatalf("List = %v, %v", objs, err)
	}
	mustPut(t, s, "im/key", []byte("v4"), segment.PutOptions{IfMatch: objs[0].ETag})
}

// trickyKeys sort differently as strings than a folder-by-folder walk
// sorted by name would visit them: '.' (0x2e) and '-' (0x2d) sort before
// '/' (0x2f), '0' after it.
var trickyKeys = []string{
	"a-",
	"a.c",
	"a/b",
	"a/c/d/e",
	"a/c/d.x",
	"a/c/d/f",
	"a/c/d0",
	"a/c/e",
	"a0",
	"ab/c",
	"b",
	"b/x/y/z",
	"c!",
	"c/d",
	"z",
}

func putKeys(t *testing.T, s segment.Store, keys []string) {
	t.Helper()
	for i, k := range keys {
		mustPut(t, s, k, []byte("value of "+k+" "+strconv.Itoa(i)), segment.PutOptions{})
	}
}

func sortedCopy(keys []string) []string {
	out := slices.Clone(keys)
	slices.Sort(out)
	return out
}

func testListOrder(t *testing.T, s segment.Store) {
	keys := slices.Clone(trickyKeys)
	// "b" beside "b/x/y/z" would be an object and a folder at once; drop
	// it: the Store contract excludes that.
	keys = slices.DeleteFunc(keys, func(k string) bool { return k == "b" })
	// Put them in reverse order so no backend gets the order for free.
	rev := slices.Clone(keys)
	slices.Reverse(rev)
	putKeys(t, s, rev)
	want := sortedCopy(keys)
	if got := listAll(t, s, ""); !slices.Equal(got, want) {
		t.Fatalf("List = %q\nwant   %q", got, want)
	}
}

func testListPrefix(t *testing.T, s segment.Store) {
	keys := slices.DeleteFunc(slices.Clone(trickyKeys), func(k string) bool { return k == "b" })
	putKeys(t, s, keys)
	all := sortedCopy(keys)
	for _, prefix := range []string{"", "a", "a/", "a/c", "a/c/", "a/c/d", "a/c/d/", "a/c/d.", "a/c/d/e", "a0", "ab", "b", "b/x/y/", "c", "c/", "nothing", "a/b/", "zz"} {
		var want []string
		for _, k := range all {
			if len(k) >= len(prefix) && k[:len(prefix)] == prefix {
				want = append(want, k)
			}
		}
		if got := listAll(t, s, prefix); !slices.Equal(got, want) {
			t.Errorf("List(prefix %q) = %q, want %q", prefix, got, want)
		}
	}
}

func testListStartAfter(t *testing.T, s segment.Store) {
	keys := slices.DeleteFunc(slices.Clone(trickyKeys), func(k string) bool { return k == "b" })
	putKeys(t, s, keys)
	all := sortedCopy(keys)
	cases := []struct{ prefix, after string }{
		{"", "a/b"},
		{"", "a."},
		{"", "a/"},
		{"", "a/c"},
		{"", "a/c/d"},
		{"", "a/c/d/"},
		{"", "a/c/d/e"},
		{"", "a/c/d/f"},
		{"", "a/c/d00"},
		{"", "a/c/d0"},
		{"", "a0"},
		{"", "`"}, // before every key
		{"", "b/x"},
		{"", "z"},
		{"", "zz"},
		{"a/", "a/c/d"},
		{"a/c", "a/c/d/e"},
		{"a/c/", ""},
		{"c", "a"},
		{"a", "b"},
	}
	for _, c := range cases {
		var want []string
		for _, k := range all {
			if k > c.after && len(k) >= len(c.prefix) && k[:len(c.prefix)] == c.prefix {
				want = append(want, k)
			}
		}
		objs, more, err := s.List(ctxFor(t), c.prefix, c.after, 1000)
		if err != nil {
			t.Errorf("List(%q, after %q): %v", c.prefix, c.after, err)
			continue
		}
		var got []string
		for _, o := range objs {
			got = append(got, o.Key)
		}
		if !slices.Equal(got, want) || more {
			t.Errorf("List(%q, after %q) = %q more=%v, want %q", c.prefix, c.after, got, more, want)
		}
	}
}

func testListPaging(t *testing.T, s segment.Store) {
	keys := slices.DeleteFunc(slices.Clone(trickyKeys), func(k string) bool { return k == "b" })
	putKeys(t, s, keys)
	all := sortedCopy(keys)
	for _, max := range []int{1, 2, 3, 5, len(all) - 1, len(all), len(all) + 1} {
		var got []string
		after := ""
		for pages := 0; ; pages++ {
			if pages > len(all)+1 {
				t.Fatalf("max %d: too many pages", max)
			}
			objs, more, err := s.List(ctxFor(t), "", after, max)
			if err != nil {
				t.Fatalf("List(max %d, after %q): %v", max, after, err)
			}
			if len(objs) > max {
				t.Fatalf("List(max %d) returned %d", max, len(objs))
			}
			if more && len(objs) != max {
				t.Fatalf("List(max %d, after %q): %d objects and more", max, after, len(objs))
			}
			for _, o := range objs {
				got = append(got, o.Key)
			}
			if !more {
				break
			}
			after = objs[len(objs)-1].Key
		}
		if !slices.Equal(got, all) {
			t.Errorf("paging with max %d = %q, want %q", max, got, all)
		}
	}
	// more is exact: a full page that ends at the last key says no more.
	objs, more, err := s.List(ctxFor(t), "", "", len(all))
	if err != nil || len(objs) != len(all) || more {
		t.Errorf("List(max = count) = %d objects, more=%v, %v", len(objs), more, err)
	}
	objs, more, err = s.List(ctxFor(t), "a/c/", "", 2)
	if err != nil || len(objs) != 2 || !more || objs[0].Key != "a/c/d.x" || objs[1].Key != "a/c/d/e" {
		t.Errorf("List(a/c/, max 2) = %v, more=%v, %v", objs, more, err)
	}
}

func testListInfo(t *testing.T, s segment.Store) {
	e1 := mustPut(t, s, "info/one", []byte("12345"), segment.PutOptions{})
	e2 := mustPut(t, s, "info/two", []byte{}, segment.PutOptions{})
	objs, more, err := s.List(ctxFor(t), "info/", "", 10)
	if err != nil || more {
		t.Fatalf("List = %v, %v", more, err)
	}
	want := []segment.ObjectInfo{{Key: "info/one", Size: 5, ETag: e1}, {Key: "info/two", Size: 0, ETag: e2}}
	if !slices.Equal(objs, want) {
		t.Fatalf("List = %+v, want %+v", objs, want)
	}
}

func testDeleteMany(t *testing.T, s segment.Store) {
	ctx := ctxFor(t)
	var keys []string
	for i := range 30 {
		keys = append(keys, fmt.Sprintf("del/%d/%02d/obj", i%3, i))
	}
	keys = append(keys, "del-flat", "keep/me")
	putKeys(t, s, keys)
	victims := append(slices.Clone(keys[:len(keys)-1]), "del/missing", "never/was/here", "del/0/00/obj")
	if err := s.Delete(ctx, victims); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if got := listAll(t, s, ""); !slices.Equal(got, []string{"keep/me"}) {
		t.Fatalf("after Delete, List = %q", got)
	}
	for _, k := range keys[:5] {
		if _, _, err := s.Get(ctx, k, 0, -1); !errors.Is(err, segment.ErrNotFound) {
			t.Fatalf("Get(%q) after Delete: %v", k, err)
		}
	}
	// Deleting nothing, and deleting again, are fine.
	if err := s.Delete(ctx, nil); err != nil {
		t.Fatalf("Delete(nil): %v", err)
	}
	if err := s.Delete(ctx, victims); err != nil {
		t.Fatalf("Delete again: %v", err)
	}
}

// testDeleteBatches deletes more keys than one S3 request carries.
func testDeleteBatches(t *testing.T, s segment.Store) {
	ctx := ctxFor(t)
	var keys []string
	for i := range 2100 {
		keys = append(keys, fmt.Sprintf("batch/missing-%04d", i))
	}
	real := []string{"batch/real-a", "batch/x/real-b", "batch/real-c"}
	putKeys(t, s, real)
	keys[5] = real[0]
	keys[1500] = real[1]
	keys[2099] = real[2]
	if err := s.Delete(ctx, keys); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if got := listAll(t, s, "batch/"); len(got) != 0 {
		t.Fatalf("after Delete, List = %q", got)
	}
}

func testDeleteAndRecreate(t *testing.T, s segment.Store) {
	ctx := ctxFor(t)
	mustPut(t, s, "re/a/b/c", []byte("1"), segment.PutOptions{})
	if err := s.Delete(ctx, []string{"re/a/b/c"}); err != nil {
		t.Fatal(err)
	}
	// Now "re/a/b" may be a key: nothing is left under it.
	mustPut(t, s, "re/a/b", []byte("2"), segment.PutOptions{IfNoneMatch: true})
	if err := s.Delete(ctx, []string{"re/a/b"}); err != nil {
		t.Fatal(err)
	}
	mustPut(t, s, "re/a/b/c", []byte("3"), segment.PutOptions{})
	if got, _ := mustGet(t, s, "re/a/b/c"); string(got) != "3" {
		t.Fatalf("Get = %q", got)
	}
	if got := listAll(t, s, "re"); !slices.Equal(got, []string{"re/a/b/c"}) {
		t.Fatalf("List = %q", got)
	}
}

const racers = 16

// testDeleteIfMatch checks the conditional delete: a stale ETag removes
// nothing, the current one removes the key, and a missing key is no error.
func testDeleteIfMatch(t *testing.T, s segment.Store) {
	ctx := ctxFor(t)
	e1 := mustPut(t, s, "dim/sub/key", []byte("v1"), segment.PutOptions{})
	e2 := mustPut(t, s, "dim/sub/key", []byte("v2"), segment.PutOptions{})
	mustPut(t, s, "dim/other", []byte("o"), segment.PutOptions{})
	for _, stale := range []string{e1, `"0123456789abcdef0123456789abcdef"`} {
		if err := s.DeleteIfMatch(ctx, "dim/sub/key", stale); !errors.Is(err, segment.ErrPreconditionFailed) {
			t.Fatalf("DeleteIfMatch(%s) over %s: error = %v, want ErrPreconditionFailed", stale, e2, err)
		}
		if got, _ := mustGet(t, s, "dim/sub/key"); string(got) != "v2" {
			t.Fatalf("after a refused delete: %q, want v2", got)
		}
	}
	if err := s.DeleteIfMatch(ctx, "dim/sub/key", e2); err != nil {
		t.Fatalf("DeleteIfMatch with the current ETag: %v", err)
	}
	if _, _, err := s.Get(ctx, "dim/sub/key", 0, -1); !errors.Is(err, segment.ErrNotFound) {
		t.Fatalf("Get after the delete: %v, want ErrNotFound", err)
	}
	// Repeated, as a retry whose first attempt landed would be.
	if err := s.DeleteIfMatch(ctx, "dim/sub/key", e2); err != nil {
		t.Fatalf("DeleteIfMatch of a missing key: %v", err)
	}
	// The folder it emptied takes keys again; the neighbour is untouched.
	e3 := mustPut(t, s, "dim/sub/key", []byte("v3"), segment.PutOptions{IfNoneMatch: true})
	if err := s.DeleteIfMatch(ctx, "dim/sub/key", e2); !errors.Is(err, segment.ErrPreconditionFailed) {
		t.Fatalf("late delete over a recreated key: error = %v, want ErrPreconditionFailed", err)
	}
	if got := listAll(t, s, "dim/"); !slices.Equal(got, []string{"dim/other", "dim/sub/key"}) {
		t.Fatalf("List = %q", got)
	}
	// The ETag from a listing works as well.
	objs, _, err := s.List(ctx, "dim/sub/", "", 10)
	if err != nil || len(objs) != 1 || !sameETag(objs[0].ETag, e3) {
		t.Fatalf("List = %v, %v; want one object with ETag %s", objs, err, e3)
	}
	if err := s.DeleteIfMatch(ctx, "dim/sub/key", objs[0].ETag); err != nil {
		t.Fatalf("DeleteIfMatch with the listed ETag: %v", err)
	}
	if got := listAll(t, s, "dim/"); !slices.Equal(got, []string{"dim/other"}) {
		t.Fatalf("List after the deletes = %q", got)
	}
}

func sameETag(a, b string) bool {
	return strings.Trim(a, `"`) == strings.Trim(b, `"`)
}

func testRaceIfNoneMatch(t *testing.T, s segment.Store) {
	ctx := ctxFor(t)
	for round := range 10 {
		key := fmt.Sprintf("race/%d/winner", round)
		var wg sync.WaitGroup
		start := make(chan struct{})
		errs := make([]error, racers)
		for i := range racers {
			wg.Go(func() {
				<-start
				_, errs[i] = s.Put(ctx, key, []byte("writer "+strconv.Itoa(i)), segment.PutOptions{IfNoneMatch: true})
			})
		}
		close(start)
		wg.Wait()
		winner := -1
		for i, err := range errs {
			switch {
			case err == nil:
				if winner >= 0 {
					t.Fatalf("round %d: writers %d and %d both created %s", round, winner, i, key)
				}
				winner = i
			case !errors.Is(err, segment.ErrPreconditionFailed):
				t.Fatalf("round %d: writer %d: %v", round, i, err)
			}
		}
		if winner < 0 {
			t.Fatalf("round %d: no writer won", round)
		}
		if got, _ := mustGet(t, s, key); string(got) != "writer "+strconv.Itoa(winner) {
			t.Fatalf("round %d: %s = %q, winner was %d", round, key, got, winner)
		}
	}
}

func testRaceIfMatchCounter(t *testing.T, s segment.Store) {
	ctx := ctxFor(t)
	const perRacer = 8
	const key = "cas/counter"
	mustPut(t, s, key, []byte("0"), segment.PutOptions{IfNoneMatch: true})
	var wg sync.WaitGroup
	errs := make([]error, racers)
	conflicts := make([]int, racers)
	for i := range racers {
		wg.Go(func() {
			for done := 0; done < perRacer; {
				data, etag, err := s.Get(ctx, key, 0, -1)
				if err != nil {
					errs[i] = err
					return
				}
				n, err := strconv.Atoi(string(data))
				if err != nil {
					errs[i] = fmt.Errorf("counter %q: %w", data, err)
					return
				}
				_, err = s.Put(ctx, key, []byte(strconv.Itoa(n+1)), segment.PutOptions{IfMatch: etag})
				switch {
				case err == nil:
					done++
				case errors.Is(err, segment.ErrPreconditionFailed):
					conflicts[i]++
				default:
					errs[i] = err
					return
				}
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("racer %d: %v", i, err)
		}
	}
	got, _ := mustGet(t, s, key)
	if string(got) != strconv.Itoa(racers*perRacer) {
		t.Fatalf("counter = %s, want %d (lost updates)", got, racers*perRacer)
	}
	total := 0
	for _, c := range conflicts {
		total += c
	}
	t.Logf("%d increments, %d compare-and-swap conflicts", racers*perRacer, total)
}

// testRacePutDelete writes and deletes keys in one folder from many
// goroutines at once: a backend that prunes empty folders must not lose a
// write to a folder pruned under it.
func testRacePutDelete(t *testing.T, s segment.Store) {
	ctx := ctxFor(t)
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range 8 {
		wg.Go(func() {
			for j := range 10 {
				key := fmt.Sprintf("pd/shared/sub/%d-%d", i, j)
				if _, err := s.Put(ctx, key, []byte("x"), segment.PutOptions{IfNoneMatch: j%2 == 0}); err != nil {
					errs[i] = err
					return
				}
				if _, _, err := s.Get(ctx, key, 0, -1); err != nil {
					errs[i] = fmt.Errorf("get %s right after put: %w", key, err)
					return
				}
				if err := s.Delete(ctx, []string{key}); err != nil {
					errs[i] = err
					return
				}
			}
			// Leave one key per goroutine behind.
			_, errs[i] = s.Put(ctx, fmt.Sprintf("pd/shared/sub/keep-%d", i), []byte("k"), segment.PutOptions{})
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("goroutine %d: %v", i, err)
		}
	}
	if got := listAll(t, s, "pd/"); len(got) != 8 {
		t.Fatalf("List = %q, want the 8 kept keys", got)
	}
}
