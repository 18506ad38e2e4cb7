package attention

import "syscall"

// threadCPU returns the CPU time (user + system, seconds) of the calling OS
// thread, for benchmarks that lock their goroutine to it: on a machine shared
// with other work it measures what the kernel costs, not how long the OS let
// it run.
func threadCPU() (float64, bool) {
	var ru syscall.Rusage
	const rusageThread = 1 // RUSAGE_THREAD
	if err := syscall.Getrusage(rusageThread, &ru); err != nil {
		return 0, false
	}
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9, true
}
