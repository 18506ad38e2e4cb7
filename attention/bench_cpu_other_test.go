//go:build !linux

package attention

// threadCPU is unavailable off Linux: the in-cache benchmark then reports
// wall-clock figures only.
func threadCPU() (float64, bool) { return 0, false }
