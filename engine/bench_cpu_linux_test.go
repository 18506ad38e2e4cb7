package engine

import (
	"os"
	"strconv"
	"strings"
	"syscall"
)

// processCPU returns the CPU time (user + system, seconds) of the whole
// process: a step benchmark divides it by the wall-clock time to report how
// many cores the step kept busy (cores), which tells a step that leaves cores
// idle (a scheduling problem) from one whose work grew.
func processCPU() (float64, bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9, true
}

// systemCPU returns, from /proc/stat, the seconds all CPUs of the machine
// have spent busy (user, nice, system, irq, softirq: every process, this one
// included) and stolen by the hypervisor (steal: time a virtual CPU wanted to
// run and the host ran something else). The step benchmarks report them per
// wall second (syscores, stealcores) beside their own cores, so that a step
// the machine starved (other work, a hypervisor's cap) tells from one that
// left cores idle. ok is false where /proc/stat is missing or unreadable.
func systemCPU() (busy, steal float64, ok bool) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, false
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return 0, 0, false
	}
	var v [8]float64
	for i := range v {
		n, err := strconv.ParseUint(f[i+1], 10, 64)
		if err != nil {
			return 0, 0, false
		}
		v[i] = float64(n) / 100 // USER_HZ, 100 on Linux
	}
	// user nice system idle iowait irq softirq steal
	return v[0] + v[1] + v[2] + v[5] + v[6], v[7], true
}
