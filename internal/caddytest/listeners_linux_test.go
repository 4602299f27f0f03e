package caddytest

import (
	"context"
	"net"
	"syscall"
	"testing"
)

// soReusePort is SO_REUSEPORT on Linux, which package syscall leaves out.
const soReusePort = 0xf

// TestListenersSeesASharedPort binds two SO_REUSEPORT listeners to one
// port, as Caddy and another process would, and expects listeners to
// count both.
func TestListenersSeesASharedPort(t *testing.T) {
	lc := net.ListenConfig{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, soReusePort, 1)
		})
		if err != nil {
			return err
		}
		return serr
	}}
	ctx := context.Background()
	a, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	port := a.Addr().(*net.TCPAddr).Port
	if n, ok := listeners(port); !ok || n != 1 {
		t.Fatalf("listeners(%d) with one listener = %d, %v", port, n, ok)
	}
	b, err := lc.Listen(ctx, "tcp", a.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if n, ok := listeners(port); !ok || n != 2 {
		t.Fatalf("listeners(%d) with two listeners = %d, %v; want 2", port, n, ok)
	}
}
