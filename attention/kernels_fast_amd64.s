//go:build amd64 && !purego

#include "textflag.h"

// Kernels of the fast paths (contracts in linear_fast.go and sparse_fast.go).
// Every kernel keeps one lane per output (a weight row, a head, a dim), and
// each lane does the reference's fp32 operations in the reference's order: a
// rounded product then a rounded sum (VMULPS, VADDPS), k ascending. The FP8
// kernels fuse the two (VFMADD231PS) because their products are exact (see
// CODES8), which makes the fused result the same bits. So a lane's result is
// bit-identical to the scalar reference loop.

// func cpuid(eaxArg, ecxArg uint32) (eax, ebx, ecx, edx uint32)
TEXT ·cpuid(SB), NOSPLIT, $0-24
	MOVL eaxArg+0(FP), AX
	MOVL ecxArg+4(FP), CX
	CPUID
	MOVL AX, eax+8(FP)
	MOVL BX, ebx+12(FP)
	MOVL CX, ecx+16(FP)
	MOVL DX, edx+20(FP)
	RET

// func xgetbv0() (eax, edx uint32)
TEXT ·xgetbv0(SB), NOSPLIT, $0-8
	MOVL $0, CX
	XGETBV
	MOVL AX, eax+0(FP)
	MOVL DX, edx+4(FP)
	RET

// CODES8 widens 8 E4M3 codes at off(SI) straight to fp32 bits
// sign<<31 | (code&0x7f)<<20 — the sign-extended code shifted left by 20,
// masked with 0x87F00000 (Y15) — which is E4M3(code)·2^-120 exactly: normal
// codes become normal fp32 values with exponent field eeee, subnormal codes
// fp32 subnormals. It accumulates x·v into acc, x broadcast in Y8. The
// callers scale x so that every product x·v is a normal fp32 value; with at
// most 12 significant bits (x an E4M3 or bf16 value times a power of two, v
// E4M3) it is then exact, and the fused multiply-add rounds once, exactly like
// the reference's product-then-sum.
#define CODES8(off, acc) \
	VPMOVSXBD off(SI), Y9; \
	VPSLLD $20, Y9, Y9; \
	VPAND Y15, Y9, Y9; \
	VFMADD231PS Y8, Y9, acc

#define CODES64 \
	CODES8(0, Y0); \
	CODES8(8, Y1); \
	CODES8(16, Y2); \
	CODES8(24, Y3); \
	CODES8(32, Y4); \
	CODES8(40, Y5); \
	CODES8(48, Y6); \
	CODES8(56, Y7)

// ACCBLK folds one 128-column block: acc[off] += blk·s.
#define ACCBLK(off, blk) \
	VMULPS Y8, blk, blk; \
	VADDPS off(DI), blk, blk; \
	VMOVUPS blk, off(DI)

// func fp8Panel64AVX2(y *float32, codes *uint8, x *float32, scl *float32, nkb, kb int)
//
// y[0:64] = Σ_b scl[b] · Σ_{k in block b} (x[k]·2^100)·v[k][lane]   (v = E4M3·2^-120)
// in fp32, blocks of kb columns; codes is [nkb·kb][64] bytes, x [nkb·kb],
// scl [nkb].
TEXT ·fp8Panel64AVX2(SB), NOSPLIT, $0-48
	MOVQ y+0(FP), DI
	MOVQ codes+8(FP), SI
	MOVQ x+16(FP), DX
	MOVQ scl+24(FP), R8
	MOVQ nkb+32(FP), CX
	MOVQ kb+40(FP), R9
	MOVL $0x87F00000, AX
	MOVD AX, X15
	VPBROADCASTD X15, Y15
	MOVL $0x71800000, AX // 2^100
	MOVD AX, X14
	VPBROADCASTD X14, Y14
	VXORPS Y0, Y0, Y0
	VMOVUPS Y0, 0(DI)
	VMOVUPS Y0, 32(DI)
	VMOVUPS Y0, 64(DI)
	VMOVUPS Y0, 96(DI)
	VMOVUPS Y0, 128(DI)
	VMOVUPS Y0, 160(DI)
	VMOVUPS Y0, 192(DI)
	VMOVUPS Y0, 224(DI)

fp8block:
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	VXORPS Y4, Y4, Y4
	VXORPS Y5, Y5, Y5
	VXORPS Y6, Y6, Y6
	VXORPS Y7, Y7, Y7
	MOVQ R9, BX

fp8k:
	VBROADCASTSS (DX), Y8
	VMULPS Y14, Y8, Y8
	CODES64
	ADDQ $64, SI
	ADDQ $4, DX
	DECQ BX
	JNZ  fp8k

	VBROADCASTSS (R8), Y8
	ACCBLK(0, Y0)
	ACCBLK(32, Y1)
	ACCBLK(64, Y2)
	ACCBLK(96, Y3)
	ACCBLK(128, Y4)
	ACCBLK(160, Y5)
	ACCBLK(192, Y6)
	ACCBLK(224, Y7)
	ADDQ $4, R8
	DECQ CX
	JNZ  fp8block
	VZEROUPPER
	RET

// func fp8PlainPanel64AVX2(y *float32, codes *uint8, x *float32, scl *float32, nkb int)
//
// y[0:64] = Σ_k (x[k]·scl[k/128])·v[k][lane]   one fp32 sum over all k
// (v = E4M3·2^-120, so (x[k]·scl[b])·v = x[k]·W[n,k] when scl[b] = 2^(e_b+120));
// codes is [nkb·128][64] bytes, x [nkb·128], scl [nkb].
TEXT ·fp8PlainPanel64AVX2(SB), NOSPLIT, $0-40
	MOVQ y+0(FP), DI
	MOVQ codes+8(FP), SI
	MOVQ x+16(FP), DX
	MOVQ scl+24(FP), R8
	MOVQ nkb+32(FP), CX
	MOVL $0x87F00000, AX
	MOVD AX, X15
	VPBROADCASTD X15, Y15
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	VXORPS Y4, Y4, Y4
	VXORPS Y5, Y5, Y5
	VXORPS Y6, Y6, Y6
	VXORPS Y7, Y7, Y7

plainblock:
	VBROADCASTSS (R8), Y14
	MOVQ $128, BX

plaink:
	VBROADCASTSS (DX), Y8
	VMULPS Y14, Y8, Y8
	CODES64
	ADDQ $64, SI
	ADDQ $4, DX
	DECQ BX
	JNZ  plaink
	ADDQ $4, R8
	DECQ CX
	JNZ  plainblock

	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	VMOVUPS Y4, 128(DI)
	VMOVUPS Y5, 160(DI)
	VMOVUPS Y6, 192(DI)
	VMOVUPS Y7, 224(DI)
	VZEROUPPER
	RET

// BF16X8 widens 8 bf16 weights at off(SI) and accumulates x·w into acc.
#define BF16X8(off, acc) \
	VPMOVZXWD off(SI), Y9; \
	VPSLLD $16, Y9, Y9; \
	VMULPS Y8, Y9, Y9; \
	VADDPS Y9, acc, acc

// func bf16Panel64AVX2(y *float32, w *uint16, x *float32, k int)
//
// y[lane] = Σ_k x[k]·w[k][lane], w [k][64] bf16 bits.
TEXT ·bf16Panel64AVX2(SB), NOSPLIT, $0-32
	MOVQ y+0(FP), DI
	MOVQ w+8(FP), SI
	MOVQ x+16(FP), DX
	MOVQ k+24(FP), CX
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	VXORPS Y4, Y4, Y4
	VXORPS Y5, Y5, Y5
	VXORPS Y6, Y6, Y6
	VXORPS Y7, Y7, Y7

bf16k:
	VBROADCASTSS (DX), Y8
	BF16X8(0, Y0)
	BF16X8(16, Y1)
	BF16X8(32, Y2)
	BF16X8(48, Y3)
	BF16X8(64, Y4)
	BF16X8(80, Y5)
	BF16X8(96, Y6)
	BF16X8(112, Y7)
	ADDQ $128, SI
	ADDQ $4, DX
	DECQ CX
	JNZ  bf16k

	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	VMOVUPS Y4, 128(DI)
	VMOVUPS Y5, 160(DI)
	VMOVUPS Y6, 192(DI)
	VMOVUPS Y7, 224(DI)
	VZEROUPPER
	RET

// F32X8 accumulates x·w[off] into acc.
#define F32X8(off, acc) \
	VMULPS off(SI), Y8, Y9; \
	VADDPS Y9, acc, acc

// func f32Panel64AVX2(y *float32, w *float32, x *float32, k int)
//
// y[lane] = Σ_k x[k]·w[k][lane], w [k][64] fp32. Also the head-lane dot
// product of attention: w = q transposed [d][64], x = one key row.
TEXT ·f32Panel64AVX2(SB), NOSPLIT, $0-32
	MOVQ y+0(FP), DI
	MOVQ w+8(FP), SI
	MOVQ x+16(FP), DX
	MOVQ k+24(FP), CX
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	VXORPS Y4, Y4, Y4
	VXORPS Y5, Y5, Y5
	VXORPS Y6, Y6, Y6
	VXORPS Y7, Y7, Y7

f32k:
	VBROADCASTSS (DX), Y8
	F32X8(0, Y0)
	F32X8(32, Y1)
	F32X8(64, Y2)
	F32X8(96, Y3)
	F32X8(128, Y4)
	F32X8(160, Y5)
	F32X8(192, Y6)
	F32X8(224, Y7)
	ADDQ $256, SI
	ADDQ $4, DX
	DECQ CX
	JNZ  f32k

	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	VMOVUPS Y4, 128(DI)
	VMOVUPS Y5, 160(DI)
	VMOVUPS Y6, 192(DI)
	VMOVUPS Y7, 224(DI)
	VZEROUPPER
	RET

// BF16R rounds the 8 fp32 lanes of r to bf16 (nearest, ties to even) with
// integer arithmetic: r += 0x7FFF + ((r >> 16) & 1); r &= 0xFFFF0000. Finite
// values and infinities round as quant.BF16Round; NaNs may turn into
// infinities (callers redo non-finite results with the reference). Uses Y9,
// Y12 (= 0x7FFF), Y13 (= 1), Y14 (= 0xFFFF0000).
#define BF16R(r) \
	VPSRLD $16, r, Y9; \
	VPAND Y13, Y9, Y9; \
	VPADDD Y12, Y9, Y9; \
	VPADDD Y9, r, r; \
	VPAND Y14, r, r

// TERM8 turns 8 head dot products in acc into the score terms
// bf16(max(bf16(acc), 0)·w[off]), stored at off(R9).
#define TERM8(off, acc) \
	BF16R(acc); \
	VXORPS Y10, Y10, Y10; \
	VMAXPS acc, Y10, acc; \
	VMULPS off(R8), acc, acc; \
	BF16R(acc); \
	VMOVUPS acc, off(R9)

// func indexScore64AVX2(sums *float32, icache *float32, iqT *float32, w *float32, terms *float32, rows int)
//
// For each of rows index keys j (icache [rows][128]): qk[h] = Σ_k icache[j][k]·iqT[k][h]
// for the 64 heads, then sums[j] = Σ_h bf16(max(bf16(qk[h]), 0)·w[h]) in fp32,
// h ascending (not yet rounded). terms is a 64-float scratch.
TEXT ·indexScore64AVX2(SB), NOSPLIT, $0-48
	MOVQ sums+0(FP), DI
	MOVQ icache+8(FP), DX
	MOVQ iqT+16(FP), R10
	MOVQ w+24(FP), R8
	MOVQ terms+32(FP), R9
	MOVQ rows+40(FP), R11
	MOVL $0x7FFF, AX
	MOVD AX, X12
	VPBROADCASTD X12, Y12
	MOVL $1, AX
	MOVD AX, X13
	VPBROADCASTD X13, Y13
	MOVL $0xFFFF0000, AX
	MOVD AX, X14
	VPBROADCASTD X14, Y14

idxrow:
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	VXORPS Y4, Y4, Y4
	VXORPS Y5, Y5, Y5
	VXORPS Y6, Y6, Y6
	VXORPS Y7, Y7, Y7
	MOVQ R10, SI
	MOVQ $128, CX

idxk:
	VBROADCASTSS (DX), Y8
	F32X8(0, Y0)
	F32X8(32, Y1)
	F32X8(64, Y2)
	F32X8(96, Y3)
	F32X8(128, Y4)
	F32X8(160, Y5)
	F32X8(192, Y6)
	F32X8(224, Y7)
	ADDQ $256, SI
	ADDQ $4, DX
	DECQ CX
	JNZ  idxk

	TERM8(0, Y0)
	TERM8(32, Y1)
	TERM8(64, Y2)
	TERM8(96, Y3)
	TERM8(128, Y4)
	TERM8(160, Y5)
	TERM8(192, Y6)
	TERM8(224, Y7)

	// sum the 64 terms in head order
	VXORPS X0, X0, X0
	MOVQ R9, SI
	MOVQ $64, CX

idxsum:
	VADDSS (SI), X0, X0
	ADDQ $4, SI
	DECQ CX
	JNZ  idxsum
	VMOVSS X0, (DI)
	ADDQ $4, DI
	DECQ R11
	JNZ  idxrow
	VZEROUPPER
	RET

// PV8 accumulates p·row[off] into acc (p broadcast in Y8, row at SI).
#define PV8(off, acc) \
	VMULPS off(SI), Y8, Y9; \
	VADDPS Y9, acc, acc

// func pvChunkAVX2(acc *float32, rows **float32, p *float32, n int, alpha float32, d int)
//
// acc[k] = acc[k]·alpha, then for i < n: acc[k] += p[i]·rows[i][k], for every
// k < d (d a multiple of 64), i ascending per k.
TEXT ·pvChunkAVX2(SB), NOSPLIT, $0-48
	MOVQ acc+0(FP), DI
	MOVQ rows+8(FP), R8
	MOVQ p+16(FP), R9
	MOVQ n+24(FP), R10
	VBROADCASTSS alpha+32(FP), Y15
	MOVQ d+40(FP), R11
	XORQ R12, R12

pvblock:
	VMULPS 0(DI), Y15, Y0
	VMULPS 32(DI), Y15, Y1
	VMULPS 64(DI), Y15, Y2
	VMULPS 96(DI), Y15, Y3
	VMULPS 128(DI), Y15, Y4
	VMULPS 160(DI), Y15, Y5
	VMULPS 192(DI), Y15, Y6
	VMULPS 224(DI), Y15, Y7
	XORQ BX, BX
	TESTQ R10, R10
	JZ   pvstore

pvrow:
	MOVQ (R8)(BX*8), SI
	ADDQ R12, SI
	VBROADCASTSS (R9)(BX*4), Y8
	PV8(0, Y0)
	PV8(32, Y1)
	PV8(64, Y2)
	PV8(96, Y3)
	PV8(128, Y4)
	PV8(160, Y5)
	PV8(192, Y6)
	PV8(224, Y7)
	INCQ BX
	CMPQ BX, R10
	JNE  pvrow

pvstore:
	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	VMOVUPS Y4, 128(DI)
	VMOVUPS Y5, 160(DI)
	VMOVUPS Y6, 192(DI)
	VMOVUPS Y7, 224(DI)
	ADDQ $256, DI
	ADDQ $256, R12
	SUBQ $64, R11
	JNZ  pvblock
	VZEROUPPER
	RET
