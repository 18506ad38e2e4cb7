//go:build amd64 && !purego

package attention

// Assembly kernels (kernels_fast_amd64.s; the VNNI ones in index_vnni_amd64.s,
// written by internal/vnnigen). Their contracts are in the .s files and
// linear_fast.go, linear_fast_fp8.go / sparse_fast.go / sparse_fast_vnni.go.

func cpuid(eaxArg, ecxArg uint32) (eax, ebx, ecx, edx uint32)
func xgetbv0() (eax, edx uint32)

//go:noescape
func fp8Panel64AVX2(y *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int)

//go:noescape
func bf16Panel64AVX2(y *float32, w *uint16, x *float32, k int)

//go:noescape
func f32Panel64AVX2(y *float32, w *float32, x *float32, k int)

//go:noescape
func indexTerms64AVX2(terms *float32, icache *float32, iqT *float32, w *float32, rows int)

//go:noescape
func indexSum64(sums *float32, terms *float32, rows int)

//go:noescape
func indexTerms64AVX512(terms *float32, icache *float32, iqT *float32, w *float32, rows int)

//go:noescape
func exp32x8AVX512(dst *float32, src *float32, n int, window int64) (bad uint64)

//go:noescape
func vnniPackRows(recs *byte, src *float32, rows int, limit int) (done uint64)

//go:noescape
func vnniVerifyRows(recs *byte, src *float32, rows int, limit int) (done uint64)

//go:noescape
func indexTerms64VNNI(terms *float32, recs *byte, q *vnniQuery, done uint64, rows int)

//go:noescape
func pvChunkAVX2(acc *float32, rows **float32, p *float32, n int, alpha float32, d int)

// detectAVX2 reports whether the CPU and OS support the instructions the
// kernels use: AVX, AVX2 and FMA, with YMM state enabled.
func detectAVX2() bool {
	maxLeaf, _, _, _ := cpuid(0, 0)
	if maxLeaf < 7 {
		return false
	}
	_, _, ecx1, _ := cpuid(1, 0)
	const fma, osxsave, avx = 1 << 12, 1 << 27, 1 << 28
	if ecx1&fma == 0 || ecx1&osxsave == 0 || ecx1&avx == 0 {
		return false
	}
	if xcr0, _ := xgetbv0(); xcr0&6 != 6 { // XMM and YMM state saved by the OS
		return false
	}
	_, ebx7, _, _ := cpuid(7, 0)
	return ebx7&(1<<5) != 0 // AVX2
}

var hasAVX2 = detectAVX2()

// detectAVX512 reports whether the CPU and OS support AVX-512F and AVX-512BW
// (the byte and word operations of the FP8 kernels' AVX-512 forms) with the
// opmask and all 32 ZMM registers' state enabled.
func detectAVX512() bool {
	if !hasAVX2 {
		return false
	}
	if xcr0, _ := xgetbv0(); xcr0&0xe6 != 0xe6 { // XMM, YMM, opmask, ZMM0-15 upper halves, ZMM16-31
		return false
	}
	_, ebx7, _, _ := cpuid(7, 0)
	return ebx7&(1<<16) != 0 && ebx7&(1<<30) != 0 // AVX512F, AVX512BW
}

var hasAVX512 = detectAVX512()

// hasVBMI: the CPU has AVX-512 VBMI (VPERMI2B, VPERMT2B) besides
// detectAVX512's features.
var hasVBMI = func() bool {
	if !hasAVX512 {
		return false
	}
	_, _, ecx7, _ := cpuid(7, 0)
	return ecx7&(1<<1) != 0
}()

// hasVNNI: the CPU has AVX-512 VNNI (VPDPBUSD) besides detectAVX512's
// features (and AVX-512 F's VGETEXPPS, VSCALEFPS).
var hasVNNI = func() bool {
	if !hasAVX512 {
		return false
	}
	_, _, ecx7, _ := cpuid(7, 0)
	return ecx7&(1<<11) != 0
}()

// fp8VBMI, read by the AVX-512 FP8 kernels (1 or 0), selects DEC64V (VBMI
// permutes) or DEC64Z for the panel rows with a subnormal code: the same
// words, so the same bits. It is 1 where the CPU has VBMI; the tests run
// both, and SPARSEMLA_VBMI=0 keeps DEC64Z in a benchmark run. It may be 1
// only where hasVBMI.
var fp8VBMI = boolByte(hasVBMI)

// fp8Prefetch is how far ahead (bytes) the FP8 panel kernels prefetch their
// codes: PREFETCHT0 once per 64-byte panel row, 64 rows ahead (a prefetch
// changes no result; past the end of a weight it is a no-op). On the GPU
// host's 16-core Xeon 2 KiB took the checkpoint GEMVs at 2 threads from
// 52-72 % of the streaming read to 61-114 % (wq_b 10.8 → 18.6-18.9 GB/s)
// and at 16 from 46-77 % to 48-96 % (bench/README.md); the hardware
// prefetchers alone kept too few lines in flight per core. 4 KiB then
// gained 3-6 points at 16 threads on the small weights (wq_a 89-91 → 95-97
// %, wkv 70-73 → 75-76 %, wq_a+wkv 85-87 → 87-89 %; two alternations in one
// host process each) and changed nothing measurable on this 2-core Zen 4.
// 8 KiB (round 9), alternated with 4 KiB in one process, 30 rounds of 100
// calls: on the 2-core Zen 5 VM at 2 threads, wkv and wq_a 3-10 % less time a
// call in each of six runs (checkpoint wq_a 95.3 → 90.3 µs); on a GPU host
// instance at 16 threads, 3 of 4 small-weight cases faster in each of three
// runs (checkpoint wkv 50.8 → 48.7, 46.5 → 42.9, 100.1 → 84.1 µs; uniform
// wq_a within ±3 %), at 8 and 2 threads within ±4 %. 16 KiB was slower than
// 8 at 16 threads. 0 prefetches the row being read: no effect.
var fp8Prefetch = 8192

// bf16Prefetch is the bf16 panel kernels' prefetch distance (bytes): 4 KiB,
// the FP8 kernels' distance until round 9, at which their prefetch was
// measured (bench/README.md, round 7, item 5); 8 KiB has not been measured
// on them.
var bf16Prefetch = 4096

//go:noescape
func fp8PlainPanel64AVX2(y *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int)

//go:noescape
func fp8Terms64AVX2(t *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int)

//go:noescape
func sumTerms64AVX2(y *float32, t *float32, n int)

//go:noescape
func loadReadAVX2(p *byte, n int) uint64

//go:noescape
func fp8Widen64AVX2(v *float32, codes *uint8)

// The AVX-512 forms of the FP8 kernels: the same contracts and bits as the
// AVX2 forms above (the same lane layout, fp8LaneRow), on 16-lane registers.

//go:noescape
func fp8Panel64AVX512(y *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int)

//go:noescape
func fp8Terms64AVX512(t *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int)

//go:noescape
func bf16Panel64AVX512(y *float32, w *uint16, x *float32, k int)

//go:noescape
func f32Panel64AVX512(y *float32, w *float32, x *float32, k int)

//go:noescape
func f32Panel64x4AVX512(ys *[4]*float32, w *float32, xs *[4]*float32, k int)

//go:noescape
func pvChunk2AVX512(acc0, acc1 *float32, rows **float32, p0, p1 *float32, n int, alpha0, alpha1 float32)

//go:noescape
func pvChunkAVX512(acc *float32, rows **float32, p *float32, n int, alpha float32, d int)

//go:noescape
func fp8PlainPanel64AVX512(y *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int)

// getMXCSR and setMXCSR read and write the SSE control register of the
// calling thread (the tests run the kernels with denormals-are-zero and
// flush-to-zero set, which changes the result of any subnormal operand or
// result).
func getMXCSR() uint32
func setMXCSR(v uint32)

//go:noescape
func absMaxBitsAVX2(x *float32, n int) uint32

//go:noescape
func plainRangeAVX2(v *float32, n int) (lom, him, low uint32)

//go:noescape
func quantBlockAVX2(out, xs *float32, x *float32, inv float32, n int)
