//go:build linux

package main

import (
	"bufio"
	"context"
	"math"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/picomq/caddy-picomq/internal/testenv"
)

// machine gathers what the report says about where it ran.
func machine(ctx context.Context, root string) machineInfo {
	mi := machineInfo{Cores: runtime.NumCPU(), Date: time.Now(), CPU: "unknown"}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				mi.CPU = strings.TrimSpace(v)
				break
			}
		}
		f.Close()
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if rest, ok := strings.CutPrefix(line, "MemTotal:"); ok {
				if f := strings.Fields(rest); len(f) > 0 {
					kb, _ := strconv.ParseFloat(f[0], 64)
					mi.MemGiB = kb / (1 << 20)
				}
			}
		}
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		mi.Kernel = "Linux " + strings.TrimSpace(string(b))
	}
	mi.Go = output(ctx, root, "go", "version")
	if mi.Go == "" {
		mi.Go = runtime.Version()
	}
	mi.Versity = testenv.VersityVersion
	if bin, err := testenv.VersityBinary(ctx); err == nil {
		// A `go install`ed versitygw says "git" for --version; the module
		// version is in its build info.
		for _, line := range strings.Split(output(ctx, root, "go", "version", "-m", bin), "\n") {
			f := strings.Fields(line)
			if len(f) >= 3 && f[0] == "mod" && f[1] == "github.com/versity/versitygw" {
				mi.Versity = f[2]
			}
		}
	}
	mi.Node = output(ctx, root, "node", "--version")
	if mi.Node == "" {
		mi.Node = "not installed"
	}
	mi.PageFault, mi.PageKiB = pageFaultCost(), os.Getpagesize()>>10
	mi.Commit = output(ctx, root, "git", "rev-parse", "--short=12", "HEAD")
	if mi.Commit == "" {
		mi.Commit = "unknown"
	} else if output(ctx, root, "git", "status", "--porcelain", "--untracked-files=no") != "" {
		mi.Commit += " (with uncommitted changes)"
	}
	return mi
}

func output(ctx context.Context, dir, name string, args ...string) string {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	b, err := cmd.Output()
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// cpuShort is the machine in a few words, for the chart's title.
func (mi machineInfo) cpuShort() string {
	return strconv.Itoa(mi.Cores) + " cores (" + mi.CPU + ")"
}

// loadAvg is the 1-minute load average from /proc/loadavg.
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return ""
	}
	return f[0]
}

// cpuTimes are the machine's CPU time counters from the first line of
// /proc/stat, in clock ticks: all of them, and steal, the time a
// hypervisor spent running other guests while one of this machine's
// processors had work to do. On a shared host steal comes and goes with
// the neighbours' load and slows every process here alike; a row measured
// under it is slower than the same code on the same machine at a quiet
// hour, so the report gives it beside each row.
type cpuTimes struct{ total, steal uint64 }

// readCPUTimes reads the counters; false where /proc/stat has none.
func readCPUTimes() (cpuTimes, bool) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuTimes{}, false
	}
	line, _, _ := strings.Cut(string(b), "\n")
	return parseCPUTimes(line)
}

// parseCPUTimes reads the aggregate "cpu" line of /proc/stat: user, nice,
// system, idle, iowait, irq, softirq and steal (guest time is counted in
// user already, so the sum stops at steal).
func parseCPUTimes(line string) (cpuTimes, bool) {
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return cpuTimes{}, false
	}
	var t cpuTimes
	for i, v := range f[1:9] {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return cpuTimes{}, false
		}
		t.total += n
		if i == 7 {
			t.steal = n
		}
	}
	return t, true
}

// stealPercent is the share of CPU time stolen between two readings, as a
// percentage; NaN when it cannot be told.
func stealPercent(from, to cpuTimes) float64 {
	if to.total <= from.total || to.steal < from.steal {
		return math.NaN()
	}
	return 100 * float64(to.steal-from.steal) / float64(to.total-from.total)
}

// faultProbeMiB is how much fresh memory pageFaultCost writes to.
const faultProbeMiB = 64

// pageFaultCost maps faultProbeMiB of new memory, writes one byte to each
// page and returns the time per page, the best of three passes; 0 if the
// memory cannot be mapped. On a virtual machine a fault may cost ten times
// what it costs on bare metal, and a freshly started process pays it for
// every page it touches first (row 7).
func pageFaultCost() time.Duration {
	const size = faultProbeMiB << 20
	page := os.Getpagesize()
	var best time.Duration
	for range 3 {
		mem, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
		if err != nil {
			return 0
		}
		t := time.Now()
		for i := 0; i < size; i += page {
			mem[i] = 1
		}
		d := time.Since(t) / time.Duration(size/page)
		syscall.Munmap(mem)
		if best == 0 || d < best {
			best = d
		}
	}
	return best
}
