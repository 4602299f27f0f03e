//go:build unix && !linux

package testenv

import "syscall"

// serverProcAttr puts a server in a process group of its own, which Stop
// kills whole. Only Linux kills it with the test binary (Pdeathsig);
// elsewhere a test binary killed outright leaves it running.
func serverProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
