package loadgen

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// procAvailable reports whether this system has Linux's /proc, where the
// processes' CPU times and resident memory come from. Elsewhere (macOS,
// Windows) the bench measures requests only.
var procAvailable = sync.OnceValue(func() bool {
	_, err := os.Stat("/proc/self/stat")
	return err == nil
})

// clockTicks is the kernel's USER_HZ, the unit of utime and stime in
// /proc/PID/stat: read from the auxiliary vector (AT_CLKTCK) without cgo,
// 100 (Linux's value everywhere in practice) if that fails.
var clockTicks = sync.OnceValue(func() float64 {
	b, err := os.ReadFile("/proc/self/auxv")
	if err != nil {
		return 100
	}
	const atClkTck = 17
	for len(b) >= 16 {
		k, v := binary.NativeEndian.Uint64(b), binary.NativeEndian.Uint64(b[8:])
		if k == atClkTck && v > 0 {
			return float64(v)
		}
		if k == 0 {
			break
		}
		b = b[16:]
	}
	return 100
})

// ProcCPU returns the CPU time (user + system) process pid has used so far,
// from /proc/PID/stat.
func ProcCPU(pid int) (time.Duration, error) {
	st, err := procStat(pid)
	return st.cpu, err
}

// procCounters are the counters read from one /proc/PID/stat.
type procCounters struct {
	cpu    time.Duration
	minflt uint64
}

func procStat(pid int) (procCounters, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procCounters{}, err
	}
	// The command name (field 2) is in parentheses and may hold spaces and
	// parentheses itself, so fields are counted from the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procCounters{}, fmt.Errorf("/proc/%d/stat: no ')' in %q", pid, b)
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state); minflt is field 10, utime and stime are
	// fields 14 and 15.
	if len(f) < 13 {
		return procCounters{}, fmt.Errorf("/proc/%d/stat: only %d fields after the name", pid, len(f))
	}
	mf, err0 := strconv.ParseUint(f[7], 10, 64)
	ut, err1 := strconv.ParseUint(f[11], 10, 64)
	st, err2 := strconv.ParseUint(f[12], 10, 64)
	if err0 != nil || err1 != nil || err2 != nil {
		return procCounters{}, fmt.Errorf("/proc/%d/stat: bad minflt %q, utime %q or stime %q", pid, f[7], f[11], f[12])
	}
	return procCounters{cpu: time.Duration(float64(ut+st) / clockTicks() * float64(time.Second)), minflt: mf}, nil
}

// ProcRSS returns the resident set size (VmRSS) of process pid in bytes,
// from /proc/PID/status.
func ProcRSS(pid int) (int64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, err
	}
	for line := range strings.Lines(string(b)) {
		rest, ok := strings.CutPrefix(line, "VmRSS:")
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) != 2 || f[1] != "kB" {
			return 0, fmt.Errorf("/proc/%d/status: unexpected VmRSS line %q", pid, strings.TrimSpace(line))
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/%d/status: %v", pid, err)
		}
		return kb << 10, nil
	}
	return 0, fmt.Errorf("/proc/%d/status has no VmRSS (a kernel thread or a zombie?)", pid)
}

// procWatch accounts for a set of processes over the measured window:
// CPU time and page faults at start and end, and RSS sampled once a second
// in between.
type procWatch struct {
	procs    []NamedPID
	rss      func(pid int) (int64, error) // ProcRSS; tests count calls
	start    []procCounters
	peak     []int64
	mu       sync.Mutex
	stop     chan struct{}
	finished chan struct{}
}

// startProcWatch reads the starting CPU times; a process that cannot be
// read is an error, since its figures would be missing silently otherwise.
func startProcWatch(procs []NamedPID) (*procWatch, error) {
	return startProcWatchRSS(procs, ProcRSS)
}

// startProcWatchRSS is startProcWatch with the RSS read by rss.
func startProcWatchRSS(procs []NamedPID, rss func(pid int) (int64, error)) (*procWatch, error) {
	w := &procWatch{procs: procs, rss: rss, start: make([]procCounters, len(procs)), peak: make([]int64, len(procs)),
		stop: make(chan struct{}), finished: make(chan struct{})}
	for i, p := range procs {
		st, err := procStat(p.PID)
		if err != nil {
			return nil, fmt.Errorf("process %s (pid %d): %w", p.Name, p.PID, err)
		}
		w.start[i] = st
	}
	w.sample()
	go func() {
		defer close(w.finished)
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-w.stop:
				return
			case <-t.C:
				w.sample()
			}
		}
	}()
	return w, nil
}

func (w *procWatch) sample() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for i, p := range w.procs {
		if rss, err := w.rss(p.PID); err == nil {
			w.peak[i] = max(w.peak[i], rss)
		}
	}
}

// finish reads the final CPU times, page faults and RSS. A process that has gone away
// meanwhile gets what was sampled before and an error.
func (w *procWatch) finish() ([]Process, error) {
	close(w.stop)
	<-w.finished
	var firstErr error
	out := make([]Process, len(w.procs))
	for i, p := range w.procs {
		out[i] = Process{Name: p.Name, PID: p.PID, PeakRSSMiB: mib(w.peak[i])}
		st, err := procStat(p.PID)
		if err == nil {
			out[i].CPUS = (st.cpu - w.start[i].cpu).Seconds()
			out[i].MinorFaults = st.minflt - w.start[i].minflt
			var rss int64
			if rss, err = w.rss(p.PID); err == nil {
				// The final read is a sample too: taken apart from the
				// peak's, it could be the larger, and the peak less than
				// the end.
				out[i].RSSMiB = mib(rss)
				out[i].PeakRSSMiB = mib(max(w.peak[i], rss))
			}
		}
		if err != nil && firstErr == nil {
			firstErr = fmt.Errorf("process %s (pid %d) at the end of the window: %w", p.Name, p.PID, err)
		}
	}
	return out, firstErr
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }
