package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
)

// TestLateMarkerAfterATrimIntoItsBlob: a batch large enough for a blob is
// folded (its marker names the blob), then trimmed into: the trim rewrites
// the kept records as a data object and deletes the marker and the blob.
// A PUT of the marker held up on its way (a timed-out attempt whose retry
// wrote it, or a replaced process's fold) can land after that, naming the
// deleted blob; it sorts before the rewritten object. Every read of the
// seqs it covered failed with a 5xx until a later trim passed the blob.
// Here the late landing is the marker written again straight into
// versitygw, and Caddy restarts so that its reads list the data objects.
func TestLateMarkerAfterATrimIntoItsBlob(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Caddy on versitygw")
	}
	e := picoStart(t, []string{"compact_interval 300ms"}, nil)
	const name = "/pico/late/marker"
	if r := e.must(fhReq{Method: http.MethodPut, Path: name, Header: map[string]string{"Content-Type": textPlain}}); r.Status != http.StatusCreated {
		t.Fatalf("create: %s", r)
	}
	// Five records of 60 KiB in one batch: one blob, seqs [0, 5).
	var bodies []string
	var batch struct {
		Records []map[string]string `json:"records"`
	}
	for i := range 5 {
		b := strings.Repeat(string(rune('a'+i)), 60<<10)
		bodies = append(bodies, b)
		batch.Records = append(batch.Records, map[string]string{"body": b})
	}
	body, _ := json.Marshal(batch)
	if r := e.must(fhReq{Method: http.MethodPost, Path: name, Header: map[string]string{"Content-Type": picoJSONBatch}, Body: body}); r.Status != http.StatusOK {
		t.Fatalf("batch: %s", r)
	}
	var marker string
	if err := fhWaitFor(20*time.Second, 100*time.Millisecond, func() error {
		for _, o := range e.mustList("data/") {
			if strings.Count(o.Key[strings.LastIndexByte(o.Key, '/')+1:], ".") == 2 {
				marker = o.Key
				return nil
			}
		}
		return fmt.Errorf("no blob marker yet among %v", e.mustList("data/"))
	}); err != nil {
		t.Fatal(err)
	}

	const trim = 2
	if r := e.must(fhReq{Method: http.MethodPost, Path: name, Header: map[string]string{"Pico-Trim-Seq": fmt.Sprint(trim)}}); r.Status != http.StatusOK {
		t.Fatalf("trim: %s", r)
	}
	if err := fhWaitFor(20*time.Second, 100*time.Millisecond, func() error {
		if objs := e.mustList("data/"); len(objs) != 1 || objs[0].Key == marker {
			return fmt.Errorf("data objects %v: the trim is not done", objs)
		}
		if blobs := e.mustList("blob/"); len(blobs) != 0 {
			return fmt.Errorf("blobs %v left", blobs)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := e.v.Client().PutObject(ctx, &s3.PutObjectInput{
		Bucket: aws.String(e.bucket), Key: aws.String(fhPrefix + marker), Body: bytes.NewReader(nil),
	}); err != nil {
		t.Fatalf("the late marker: %v", err)
	}
	e.caddy.Restart()
	e.client.CloseIdleConnections()

	for from := uint64(trim); from < 5; from++ {
		r := e.must(fhReq{Method: http.MethodGet, Path: fmt.Sprintf("%s?seq=%d&format=json", name, from)})
		if r.Status != http.StatusOK {
			t.Fatalf("read from %d after the late marker: %s", from, r)
		}
		var recs []struct {
			Seq  uint64 `json:"seq"`
			Body string `json:"body"`
		}
		if err := json.Unmarshal(r.Body, &recs); err != nil {
			t.Fatalf("read from %d: %v", from, err)
		}
		if len(recs) == 0 || recs[0].Seq != from {
			t.Fatalf("read from %d: %s", from, r)
		}
		for _, rec := range recs {
			if rec.Body != bodies[rec.Seq] {
				t.Fatalf("read from %d: record %d has %d bytes of %q", from, rec.Seq, len(rec.Body), rec.Body[:1])
			}
		}
	}
}
