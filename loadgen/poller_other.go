//go:build !linux

package loadgen

import (
	"context"
	"errors"
)

// poller is Linux-only; elsewhere each feed reads on its own goroutine.
type poller struct{}

func newPoller() (*poller, error) { return nil, errors.ErrUnsupported }

func (p *poller) add(f *rawFeed) error { return errors.ErrUnsupported }

func (p *poller) run(ctx context.Context) {}
