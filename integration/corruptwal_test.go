package integration

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"sort"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/picomq/caddy-picomq/segment"
)

// TestCorruptWALObjectDoesNotWedgeWriter: an object that fails its checksum
// sits at the key of the node's next WAL upload. The upload fails (the key
// is taken), and the seal that settles it reads the object back and cannot
// decode it. That used to leave the WAL writer broken for good: the one
// append behind the upload failed, and so did every later append on the
// node, until a restart. Now the seal takes the corrupt object's place and
// the writer goes on in a new namespace; the appends after it are
// acknowledged, and the stream reads back what was acknowledged.
func TestCorruptWALObjectDoesNotWedgeWriter(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := fhStart(t, fhOptions{Directives: []string{"compact_interval 1h"}})
	const path, ct = "/corrupt/wal", "text/plain"
	e.create(path, ct)
	want := []byte("acked-0;")
	e.append(path, ct, want)

	// The writer's next upload goes to the key after the newest one.
	wal := e.mustList("wal/")
	if len(wal) == 0 {
		t.Fatal("no WAL object after an acknowledged append")
	}
	sort.Slice(wal, func(i, j int) bool { return wal[i].Key < wal[j].Key })
	var ns, seq uint64
	if _, err := fmt.Sscanf(wal[len(wal)-1].Key, "wal/%016x/%016x", &ns, &seq); err != nil {
		t.Fatalf("WAL key %q: %v", wal[len(wal)-1].Key, err)
	}
	key := segment.WALKey(ns, seq+1)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err := e.v.Client().PutObject(ctx, &s3.PutObjectInput{
		Bucket: aws.String(e.bucket), Key: aws.String(fhPrefix + key),
		Body: bytes.NewReader([]byte("PMQW\x01 a torn object that fails its checksum")),
	})
	if err != nil {
		t.Fatalf("plant %s: %v", key, err)
	}

	// The append whose upload meets the object fails: its batch never
	// landed. What matters is the ones after it.
	resp := e.must(fhReq{Method: http.MethodPost, Path: path, Header: map[string]string{"Content-Type": ct}, Body: []byte("lost;")})
	if resp.Status/100 == 2 {
		t.Fatalf("the append uploaded to a taken key was acknowledged: %s", resp)
	}
	t.Logf("the append that met the corrupt object: %s", resp)

	var last fhResp
	err = fhWaitFor(30*time.Second, 50*time.Millisecond, func() error {
		last = e.must(fhReq{Method: http.MethodPost, Path: path, Header: map[string]string{"Content-Type": ct}, Body: []byte("acked-1;")})
		if last.Status/100 != 2 {
			return fmt.Errorf("append: %s", last)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("the node took no append for 30 s after a corrupt WAL object: %v", err)
	}
	want = append(want, "acked-1;"...)
	got, _, err := e.readBytes(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("the stream reads %q, want %q", got, want)
	}
	body, err := e.get(key)
	if err != nil {
		t.Fatal(err)
	}
	if obj, err := segment.DecodeWAL(body); err != nil || !obj.Sealed {
		t.Fatalf("%s holds %q (decode: %v), want a seal: a replay must stop there", key, body, err)
	}
}
