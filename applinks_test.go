package picomq

import (
	"errors"
	"strings"
	"testing"

	"go.uber.org/zap/zaptest"

	"github.com/picomq/caddy-picomq/internal/memstore"
)

// noLinksStore is a store whose directory's file system has no hard
// links, as a file:// store on FAT would report.
type noLinksStore struct{ *memstore.Store }

func (noLinksStore) CheckLinks() error {
	return errors.New("segment: the file system of /mnt/usb does not support hard links (link: operation not permitted)")
}

// A store that can never take a write fails the start, even at boot
// (background), with its reason: it is not retried in the background
// with every request answered 503 meanwhile.
func TestStartRefusesStoreWithoutHardLinks(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	ref := newEngineRef("file:///mnt/usb", noLinksStore{memstore.New()}, testSettings(), newLogFollower(zaptest.NewLogger(t)))
	t.Cleanup(func() { _ = ref.Destruct() })
	err := ref.start(true)
	if err == nil || !strings.Contains(err.Error(), "does not support hard links") {
		t.Fatalf("start: %v, want the hard links' reason", err)
	}
	select {
	case <-ref.retrying:
		t.Fatal("the start is retried in the background")
	default:
	}
}
