//go:build amd64 && !purego

package moe

import "sparsemla/attention"

//go:generate python3 fp4_fast_amd64_gen.py

// fp4Rows32AVX2 is the AVX2 kernel of FP4LinearFast (fp4_fast_amd64.s: its
// contract is there).
//
//go:noescape
func fp4Rows32AVX2(acc *float32, codes *uint8, scales *uint8, idx *int32, qx *float32, ea *int32, stat *int32, nb int, tmp *uint32)

// hasFP4Asm: the CPU and OS run AVX2 and FMA (attention's CPUID check).
var hasFP4Asm = attention.HasAssembly()

func fp4Rows32(acc *float32, codes *uint8, scales *uint8, idx *int32, qx *float32, ea *int32, stat *int32, nb int, tmp *[256]uint32) {
	fp4Rows32AVX2(acc, codes, scales, idx, qx, ea, stat, nb, &tmp[0])
}

// fp4GetMXCSR and fp4SetMXCSR read and write the calling thread's SSE
// control register (the tests set denormals-are-zero and flush-to-zero).
func fp4GetMXCSR() uint32
func fp4SetMXCSR(v uint32)
