package loadgen

import (
	"context"
	"errors"
)

func (r *runner) runSSE(ctx context.Context) (*Result, error) { return nil, errors.New("sse: not yet") }
func (r *runner) runRead(ctx context.Context) (*Result, error) {
	return nil, errors.New("read: not yet")
}
func (r *runner) runPopulate(ctx context.Context) (*Result, error) {
	return nil, errors.New("populate: not yet")
}
func (r *runner) runVerify(ctx context.Context) (*Result, error) {
	return nil, errors.New("verify: not yet")
}
