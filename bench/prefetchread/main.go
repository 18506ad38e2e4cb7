//go:build amd64

package main

import (
	"flag"
	"fmt"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

func readNone(p *byte, n, dist, far int) uint64
func readT0(p *byte, n, dist, far int) uint64
func readT1(p *byte, n, dist, far int) uint64
func readT2(p *byte, n, dist, far int) uint64
func readNTA(p *byte, n, dist, far int) uint64
func readT0T2(p *byte, n, dist, far int) uint64
func readT0T1(p *byte, n, dist, far int) uint64

type variant struct {
	name      string
	f         func(*byte, int, int, int) uint64
	dist, far int
}

var sink uint64

func main() {
	size := flag.Int("mib", 1024, "buffer MiB (1 to 65536)")
	reps := flag.Int("reps", 5, "rounds")
	threads := flag.String("threads", "1,2,8,16", "thread counts")
	flag.Parse()
	if *size < 1 || *size > 1<<16 {
		fmt.Fprintln(os.Stderr, "prefetchread: -mib must be 1 to 65536")
		os.Exit(2)
	}
	buf := make([]byte, *size<<20)
	for i := range buf {
		buf[i] = byte(i*7 + i>>12)
	}
	var vs []variant
	vs = append(vs, variant{"none", readNone, 0, 0})
	for _, d := range []int{1, 2, 4, 8, 16, 32} {
		vs = append(vs, variant{fmt.Sprintf("T0@%dK", d), readT0, d << 10, 0})
		vs = append(vs, variant{fmt.Sprintf("T1@%dK", d), readT1, d << 10, 0})
		vs = append(vs, variant{fmt.Sprintf("T2@%dK", d), readT2, d << 10, 0})
	}
	for _, d := range []int{4, 8} {
		vs = append(vs, variant{fmt.Sprintf("NTA@%dK", d), readNTA, d << 10, 0})
	}
	for _, f := range []int{16, 32, 64} {
		vs = append(vs, variant{fmt.Sprintf("T0@4K+T2@%dK", f), readT0T2, 4 << 10, f << 10})
		vs = append(vs, variant{fmt.Sprintf("T0@8K+T2@%dK", f), readT0T2, 8 << 10, f << 10})
		vs = append(vs, variant{fmt.Sprintf("T0@4K+T1@%dK", f), readT0T1, 4 << 10, f << 10})
	}
	var tcs []int
	for _, s := range strings.Split(*threads, ",") {
		t, err := strconv.Atoi(s)
		// each thread reads at least 1 MiB beyond the farthest prefetch
		if err != nil || t < 1 || *size/t < 2 {
			fmt.Fprintf(os.Stderr, "prefetchread: -threads %q: want thread counts from 1 to -mib/2\n", *threads)
			os.Exit(2)
		}
		tcs = append(tcs, t)
	}
	if *reps < 1 {
		fmt.Fprintln(os.Stderr, "prefetchread: -reps must be at least 1")
		os.Exit(2)
	}
	for _, t := range tcs {
		runtime.GOMAXPROCS(t)
		res := map[string][]float64{}
		for r := 0; r < *reps; r++ {
			for _, v := range vs {
				gbs := run(buf, v, t)
				res[v.name] = append(res[v.name], gbs)
			}
		}
		for _, v := range vs {
			x := res[v.name]
			sort.Float64s(x)
			fmt.Printf("threads=%d %-16s median %6.2f GB/s  (min %6.2f max %6.2f)\n", t, v.name, x[len(x)/2], x[0], x[len(x)-1])
		}
	}
	fmt.Fprintln(os.Stderr, sink)
}

// run reads the buffer split among t goroutines, each locked to its OS
// thread (the pages were touched when the buffer was filled), and returns
// GB/s.
func run(buf []byte, v variant, t int) float64 {
	n := len(buf) / t &^ 4095
	m := (n - v.far - v.dist - 4096) &^ 255 // bytes each thread reads: whole 256-byte steps, every prefetch inside its part
	var wg sync.WaitGroup
	start := make(chan struct{})
	var mu sync.Mutex
	for w := 0; w < t; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			<-start
			s := v.f(&buf[w*n], m, v.dist, v.far)
			mu.Lock()
			sink ^= s
			mu.Unlock()
		}(w)
	}
	time.Sleep(2 * time.Millisecond)
	t0 := time.Now()
	close(start)
	wg.Wait()
	el := time.Since(t0).Seconds()
	return float64(t*m) / el / 1e9
}
