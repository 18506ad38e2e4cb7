//go:build !linux

package engine

// processCPU is unavailable off Linux: the step benchmarks then report
// wall-clock figures only.
func processCPU() (float64, bool) { return 0, false }

// systemCPU is unavailable off Linux.
func systemCPU() (busy, steal float64, ok bool) { return 0, 0, false }
