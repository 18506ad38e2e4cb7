//go:build amd64

// Command prefetchread measures the streaming read of one core (and of N
// cores) with each software prefetch: none, PREFETCHT0, T1, T2 and NTA at
// 1-32 KiB ahead, and a near T0 with a far T2 or T1 (16-64 KiB). It asks
// whether a prefetch kind or distance lifts what one core reads, which
// bounds the one-thread decode step's FP8 GEMVs (bench/README.md, round
// 12). Each variant reads the same 1 GiB buffer (split among the threads,
// each locked to its OS thread); medians of -reps rounds, variants
// interleaved within a round:
//
//	go run ./bench/prefetchread -mib 1024 -reps 5 -threads 1,2,8,16
package main
