// Command freshpage measures what a fresh heap buffer costs against a
// reused one: with the GC off (as in a decode loop whose weights keep the
// heap goal far away), each make() of a large-enough slice is memory the
// process has not touched, and its first writes take page faults.
//
//	go run ./bench/freshpage -bytes 32768 -n 20000
//
// It prints µs per fresh buffer (written at every 64th byte), per 4 KiB of
// it, and per reused buffer (cleared, then written the same way).
package main

import (
	"flag"
	"fmt"
	"os"
	"runtime/debug"
	"time"
)

var sink []float32

func main() {
	size := flag.Int("bytes", 32768, "buffer size in bytes (a multiple of 4)")
	n := flag.Int("n", 20000, "buffers")
	flag.Parse()
	if *size < 4 || *size%4 != 0 || *n < 1 || int64(*size)*int64(*n) > 8<<30 {
		fmt.Fprintln(os.Stderr, "freshpage: -bytes must be a positive multiple of 4, -n positive, bytes·n at most 8 GiB")
		os.Exit(2)
	}
	debug.SetGCPercent(-1)
	vals := *size / 4
	t0 := time.Now()
	for range *n {
		b := make([]float32, vals)
		for j := 0; j < len(b); j += 16 {
			b[j] = 1
		}
		sink = b
	}
	fresh := time.Since(t0).Seconds() / float64(*n) * 1e6
	reuse := make([]float32, vals)
	t1 := time.Now()
	for range *n {
		clear(reuse)
		for j := 0; j < len(reuse); j += 16 {
			reuse[j] = 1
		}
	}
	reused := time.Since(t1).Seconds() / float64(*n) * 1e6
	fmt.Printf("%d B: fresh %.2f µs (%.2f µs per 4 KiB), reused %.2f µs\n", *size, fresh, fresh/(float64(*size)/4096), reused)
}
