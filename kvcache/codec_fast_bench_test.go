//go:build linux

package kvcache

import (
	"math/rand/v2"
	"runtime"
	"syscall"
	"testing"
)

// BenchmarkDecodePageCPU is BenchmarkDecodePage's v4-model1 page (fast
// decoders) on the benchmark's goroutine locked to its thread, reporting
// page bytes per second of that thread's CPU time (MB/s-cpu) beside the
// wall-clock figure: on a machine shared with other work the CPU-time figure
// is what the decoder costs (target ≥ 2000 MB/s on one core).
func BenchmarkDecodePageCPU(b *testing.B) {
	rng := rand.New(rand.NewPCG(41, 42))
	f := MustFormat(LayoutV4Model1, 0, 64)
	page := make([]byte, f.PageBytes())
	f.EncodePage(page, randRows(rng, 64, f.Dim), RefScaling(LayoutV4Model1))
	dst := make([]float32, 64*f.Dim)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cpu := func() float64 {
		var ru syscall.Rusage
		const rusageThread = 1 // RUSAGE_THREAD
		if err := syscall.Getrusage(rusageThread, &ru); err != nil {
			b.Fatal(err)
		}
		return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
	}
	b.SetBytes(int64(f.PageBytes()))
	c0, n := cpu(), 0
	for b.Loop() {
		f.DecodePage(dst, page)
		n++
	}
	if c := cpu() - c0; c > 0 {
		b.ReportMetric(float64(f.PageBytes())*float64(n)/c/1e6, "MB/s-cpu")
	}
}
