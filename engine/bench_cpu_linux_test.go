package engine

import "syscall"

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
