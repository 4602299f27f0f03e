package testenv

import "syscall"

// serverProcAttr puts a server in a process group of its own, which Stop
// kills whole; if the test binary dies without running its cleanups, the
// kernel kills the server too.
func serverProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
