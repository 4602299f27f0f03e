package memstore_test

import (
	"testing"

	"github.com/picomq/caddy-picomq/internal/memstore"
	"github.com/picomq/caddy-picomq/segment"
	"github.com/picomq/caddy-picomq/segment/storetest"
)

// The unit tests' store keeps the contract the real backends keep, so
// that what they show about the engine holds on those.
func TestContract(t *testing.T) {
	storetest.Run(t, func(t *testing.T) segment.Store { return memstore.New() })
}
