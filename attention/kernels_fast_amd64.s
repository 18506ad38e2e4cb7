//go:build amd64 && !purego

#include "textflag.h"
#include "kernels_amd64.h"

// Kernels of the fast paths (contracts in linear_fast.go and sparse_fast.go).
// Every kernel keeps one lane per output (a weight row, a head, a dim), and
// each lane does the reference's fp32 operations in the reference's order: a
// rounded product then a rounded sum (VMULPS, VADDPS), k ascending. The FP8
// kernels fuse the two (VFMADD231PS) because their products are exact (see
// DEC32), which makes the fused result the same bits. So a lane's result is
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

// The FP8 kernels widen E4M3 codes to fp32 without ever producing an fp32
// subnormal: every finite code c becomes the normal fp32 value (or ±0)
//
//	v(c) = E4M3(c)·2^-104
//
// (fp8WidenBits in linear_fast_fp8.go is the same computation in Go, and
// TestFP8WidenAllCodes checks all 256 codes against it and against
// quant.DecodeE4M3). For a normal code (c7 = c&0x7F ≥ 8) the fp32 field
// exponent·8+mantissa is f = c7+128 (exponent e+16, the code's 3 mantissa
// bits); the 8 subnormal codes c7 = m < 8 need f = m+128−K[m] with
// K = {128, 17, 10, 7, 4, 3, 2, 1} (m·2^-113 normalised; m = 0 gives +0/−0).
// DEC32 does this on 32 code bytes at once, with one 9-entry byte table
// T[i] = f(i) − i (T[8] = 128, the normal codes' offset):
//
//	t   = c&0x7F
//	f   = t + pshufb(DTAB, min(t, 8))    the field, 0..254
//	h   = sign(c)·0x08                   ((c>>4)&0x08)
//
// and forms the 16-bit words (h<<8|f)<<4: the upper half of the fp32 bit
// pattern of v(c) (sign → bit 31, f → bits 20..27). (The plain shift of
// OLD16 below, E4M3·2^-120, makes the subnormal codes fp32 subnormals, on
// which Intel cores take microcode assists: it is used only for rows
// without subnormal codes.)
//
// Lane layout. Both widenings work on 16 codes (one row of a 16-row group g
// of the panel's 64) as 16 words, two per dword: dword i holds the words of
// rows 16g+2i (low half) and 16g+2i+1 (high half). The high word is the fp32
// value after a mask, the low one after a 16-bit shift left, so no lane
// needs its own widening instruction (the previous form spent one
// VPMOVSXBD or VPMOVZXWD and one shift per 8 codes). Accumulator 2g holds
// rows 16g+2i in lane i, accumulator 2g+1 rows 16g+2i+1: y[8a+i] is row
// 16(a/2)+2i+a%2 (fp8LaneRow in kernels_fast_amd64.go); every kernel here
// uses that layout, and the Go side maps it back.

DATA fp8dtab<>+0(SB)/8, $0x7f7e7d7c79766f00
DATA fp8dtab<>+8(SB)/8, $0x0000000000000080
DATA fp8dtab<>+16(SB)/8, $0x7f7e7d7c79766f00
DATA fp8dtab<>+24(SB)/8, $0x0000000000000080
GLOBL fp8dtab<>(SB), RODATA|NOPTR, $32

DATA fp8c7f<>+0(SB)/8, $0x7f7f7f7f7f7f7f7f
DATA fp8c7f<>+8(SB)/8, $0x7f7f7f7f7f7f7f7f
DATA fp8c7f<>+16(SB)/8, $0x7f7f7f7f7f7f7f7f
DATA fp8c7f<>+24(SB)/8, $0x7f7f7f7f7f7f7f7f
GLOBL fp8c7f<>(SB), RODATA|NOPTR, $32

DATA fp8c08<>+0(SB)/8, $0x0808080808080808
DATA fp8c08<>+8(SB)/8, $0x0808080808080808
DATA fp8c08<>+16(SB)/8, $0x0808080808080808
DATA fp8c08<>+24(SB)/8, $0x0808080808080808
GLOBL fp8c08<>(SB), RODATA|NOPTR, $32

DATA fp8hiword<>+0(SB)/8, $0xffff0000ffff0000
DATA fp8hiword<>+8(SB)/8, $0xffff0000ffff0000
DATA fp8hiword<>+16(SB)/8, $0xffff0000ffff0000
DATA fp8hiword<>+24(SB)/8, $0xffff0000ffff0000
GLOBL fp8hiword<>(SB), RODATA|NOPTR, $32

// FP8CONSTS loads the DEC32 constants: Y15 = 0x7F, Y14 = 0x08, Y13 = DTAB,
// Y12 = 0xFFFF0000.
#define FP8CONSTS \
	VMOVDQU fp8c7f<>(SB), Y15; \
	VMOVDQU fp8c08<>(SB), Y14; \
	VMOVDQU fp8dtab<>(SB), Y13; \
	VMOVDQU fp8hiword<>(SB), Y12

// DEC32 widens the 32 codes at off(SI) of a row with a subnormal code to
// v(c) and accumulates x·v (x broadcast in Y8) into e0, o0 (rows 16g+2i and
// 16g+2i+1 of the first 16-row group g of the 32) and e1, o1 (the next
// group). PackFP8 stores such a row's codes with the qwords 1 and 2 of each
// 32 swapped (fp8StoredLane), so that the per-128-bit-lane byte unpacks
// give rows 0-15 (low unpack) and 16-31 (high) without a cross-lane
// permute (a VPERMQ here cost a quarter of the kernel's speed on Zen 3).
// The high word of a dword is the odd row's fp32 value after a mask, the
// low word the even row's after a 16-bit shift. The callers scale x so that
// every product x·v is a normal fp32 value; with at most 12 significant bits
// (x an E4M3 or bf16 value times a power of two, v E4M3 times one) it is
// then exact, and the fused multiply-add rounds once, exactly like the
// reference's product-then-sum. Uses Y9, Y10, Y11. (DEC32WORDS leaves the
// words of the two groups in Y10 and Y11.)
#define DEC32WORDS(off) \
	VMOVDQU off(SI), Y9; \
	VPAND Y15, Y9, Y10; \
	VPMINUB Y14, Y10, Y11; \
	VPSHUFB Y11, Y13, Y11; \
	VPADDB Y11, Y10, Y10; \
	VPSRLW $4, Y9, Y9; \
	VPAND Y14, Y9, Y9; \
	VPUNPCKHBW Y9, Y10, Y11; \
	VPUNPCKLBW Y9, Y10, Y10; \
	VPSLLW $4, Y10, Y10; \
	VPSLLW $4, Y11, Y11

#define DEC32(off, e0, o0, e1, o1) \
	DEC32WORDS(off); \
	VPAND Y12, Y10, Y9; \
	VPSLLD $16, Y10, Y10; \
	VFMADD231PS Y8, Y9, o0; \
	VFMADD231PS Y8, Y10, e0; \
	VPAND Y12, Y11, Y9; \
	VPSLLD $16, Y11, Y11; \
	VFMADD231PS Y8, Y9, o1; \
	VFMADD231PS Y8, Y11, e1

// CODES64 accumulates the 64 lanes of one panel row with a subnormal code
// (DEC32 twice; Y11, OLD16's mask, is restored after).
#define CODES64 \
	DEC32(0, Y0, Y1, Y2, Y3); \
	DEC32(32, Y4, Y5, Y6, Y7); \
	VMOVDQU fp8oldmask<>(SB), Y11

// ACCBLK folds one 128-column block: acc[off] += blk·s (s in Y9).
#define ACCBLK(off, blk) \
	VMULPS Y9, blk, blk; \
	VADDPS off(DI), blk, blk; \
	VMOVUPS blk, off(DI)

// STBLK stores one block's term: t[off] = blk·s (s in Y9).
#define STBLK(off, blk) \
	VMULPS Y9, blk, blk; \
	VMOVUPS blk, off(DI)

#define ZERO8 \
	VXORPS Y0, Y0, Y0; \
	VXORPS Y1, Y1, Y1; \
	VXORPS Y2, Y2, Y2; \
	VXORPS Y3, Y3, Y3; \
	VXORPS Y4, Y4, Y4; \
	VXORPS Y5, Y5, Y5; \
	VXORPS Y6, Y6, Y6; \
	VXORPS Y7, Y7, Y7

#define STORE8 \
	VMOVUPS Y0, 0(DI); \
	VMOVUPS Y1, 32(DI); \
	VMOVUPS Y2, 64(DI); \
	VMOVUPS Y3, 96(DI); \
	VMOVUPS Y4, 128(DI); \
	VMOVUPS Y5, 160(DI); \
	VMOVUPS Y6, 192(DI); \
	VMOVUPS Y7, 224(DI)

// The kernels below take a row flag bitmap sub (FP8Panels.Sub: one bit per
// panel row k, set when one of its 64 codes is a nonzero E4M3 subnormal) and
// widen each panel row one of two ways, both without fp32 subnormals:
//  - a row without subnormal codes (every code normal or ±0) through OLD16,
//    the plain shift sign<<31 | (code&0x7F)<<20 = E4M3·2^-120, with x 2^16
//    times the other path's (the same products x·v);
//  - a row with one through DEC32 (E4M3·2^-104, above).
// The blockwise kernels (fp8Panel64AVX2, fp8Terms64AVX2) take x in the
// first row kind's scale, the common one, and multiply the broadcast by
// 2^-16 for the second; the plain one multiplies each row's x by its
// block's scale anyway and keeps both scales of it.
// The two give the same products, so a row's path changes no bit; it only
// costs: DEC32 takes about 1.4× OLD16's time on Zen 3 (in cache, one core:
// 13-14 against 19 GB/s of codes), so a weight whose every row holds a
// subnormal code (the worst case) runs at most that much slower than a
// checkpoint's, where almost no row does, and out of memory at 2 threads
// both are bound by the memory (bench/README.md, round 6).

DATA fp8oldmask<>+0(SB)/8, $0x87f0000087f00000
DATA fp8oldmask<>+8(SB)/8, $0x87f0000087f00000
DATA fp8oldmask<>+16(SB)/8, $0x87f0000087f00000
DATA fp8oldmask<>+24(SB)/8, $0x87f0000087f00000
GLOBL fp8oldmask<>(SB), RODATA|NOPTR, $32

DATA fp8twom16<>+0(SB)/8, $0x3780000037800000
DATA fp8twom16<>+8(SB)/8, $0x3780000037800000
DATA fp8twom16<>+16(SB)/8, $0x3780000037800000
DATA fp8twom16<>+24(SB)/8, $0x3780000037800000
GLOBL fp8twom16<>(SB), RODATA|NOPTR, $32

DATA fp8two16<>+0(SB)/8, $0x4780000047800000
DATA fp8two16<>+8(SB)/8, $0x4780000047800000
DATA fp8two16<>+16(SB)/8, $0x4780000047800000
DATA fp8two16<>+24(SB)/8, $0x4780000047800000
GLOBL fp8two16<>(SB), RODATA|NOPTR, $32

// OLD16 widens 16 codes of a row without subnormal codes at off(SI) to
// E4M3·2^-120 (normal or ±0) and accumulates x·v into even (rows 2i) and
// odd (rows 2i+1) (x in Y8, the mask 0x87F00000 in Y11): the sign-extended
// word c shifted left by 4 holds the sign in bits 15..11 and c&0x7F in bits
// 10..4, so a dword's high word masked with 0x87F00000 is the fp32 bit
// pattern sign<<31 | (c&0x7F)<<20, and its low word likewise after a shift
// by 16.
#define OLD16(off, even, odd) \
	VPMOVSXBW off(SI), Y9; \
	VPSLLW $4, Y9, Y9; \
	VPAND Y11, Y9, Y10; \
	VPSLLD $16, Y9, Y9; \
	VPAND Y11, Y9, Y9; \
	VFMADD231PS Y8, Y10, odd; \
	VFMADD231PS Y8, Y9, even

#define OLD64 \
	OLD16(0, Y0, Y1); \
	OLD16(16, Y2, Y3); \
	OLD16(32, Y4, Y5); \
	OLD16(48, Y6, Y7)

// func fp8Panel64AVX2(y *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int)
//
// y[0:64] = Σ_b scl[b] · Σ_{k in block b} x[k]·v[k][lane]   (v = E4M3·2^-104)
// in fp32, blocks of 128 columns, the block terms added in b order onto
// +0; codes is [nkb·128][64] bytes, x [nkb·128] (the caller's qx·2^100:
// the rows without subnormal codes use it as it is, the others times 2^-16),
// scl [nkb], sub [2·nkb] (the rows' subnormal flags).
TEXT ·fp8Panel64AVX2(SB), NOSPLIT, $0-48
	MOVQ y+0(FP), DI
	MOVQ codes+8(FP), SI
	MOVQ x+16(FP), DX
	MOVQ scl+24(FP), R8
	MOVQ sub+32(FP), R11
	MOVQ nkb+40(FP), CX
	MOVQ ·fp8Prefetch(SB), R13 // prefetch distance in bytes (kernels_fast_amd64.go)
	FP8CONSTS
	VMOVDQU fp8oldmask<>(SB), Y11
	ZERO8
	STORE8

fp8block:
	ZERO8
	MOVQ $2, R10

fp8word:
	MOVQ (R11), R12
	ADDQ $8, R11
	MOVQ $64, BX

fp8k:
	PREFETCHT0 (SI)(R13*1)
	SHRQ $1, R12
	JCS  fp8slow
	VBROADCASTSS (DX), Y8
	OLD64

fp8next:
	ADDQ $64, SI
	ADDQ $4, DX
	DECQ BX
	JNZ  fp8k
	DECQ R10
	JNZ  fp8word
	JMP  fp8blockend

fp8slow:
	VBROADCASTSS (DX), Y8
	VMULPS fp8twom16<>(SB), Y8, Y8
	CODES64
	JMP  fp8next

fp8blockend:

	VBROADCASTSS (R8), Y9
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

// func fp8Terms64AVX2(t *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int)
//
// t[b][0:64] = scl[b] · Σ_{k in block b} x[k]·v[k][lane] for each of the nkb
// blocks (the block terms of fp8Panel64AVX2, not yet added): t is [nkb][64].
TEXT ·fp8Terms64AVX2(SB), NOSPLIT, $0-48
	MOVQ t+0(FP), DI
	MOVQ codes+8(FP), SI
	MOVQ x+16(FP), DX
	MOVQ scl+24(FP), R8
	MOVQ sub+32(FP), R11
	MOVQ nkb+40(FP), CX
	MOVQ ·fp8Prefetch(SB), R13 // prefetch distance in bytes (kernels_fast_amd64.go)
	FP8CONSTS
	VMOVDQU fp8oldmask<>(SB), Y11

termblock:
	ZERO8
	MOVQ $2, R10

termword:
	MOVQ (R11), R12
	ADDQ $8, R11
	MOVQ $64, BX

termk:
	PREFETCHT0 (SI)(R13*1)
	SHRQ $1, R12
	JCS  termslow
	VBROADCASTSS (DX), Y8
	OLD64

termnext:
	ADDQ $64, SI
	ADDQ $4, DX
	DECQ BX
	JNZ  termk
	DECQ R10
	JNZ  termword
	JMP  termblockend

termslow:
	VBROADCASTSS (DX), Y8
	VMULPS fp8twom16<>(SB), Y8, Y8
	CODES64
	JMP  termnext

termblockend:

	VBROADCASTSS (R8), Y9
	STBLK(0, Y0)
	STBLK(32, Y1)
	STBLK(64, Y2)
	STBLK(96, Y3)
	STBLK(128, Y4)
	STBLK(160, Y5)
	STBLK(192, Y6)
	STBLK(224, Y7)
	ADDQ $256, DI
	ADDQ $4, R8
	DECQ CX
	JNZ  termblock
	VZEROUPPER
	RET

// func sumTerms64AVX2(y *float32, t *float32, n int)
//
// y[lane] = Σ_{b<n} t[b][lane] in fp32, b ascending, from +0 (the order of
// the reference's acc += blk·s); t is [n][64], n ≥ 1.
TEXT ·sumTerms64AVX2(SB), NOSPLIT, $0-24
	MOVQ y+0(FP), DI
	MOVQ t+8(FP), SI
	MOVQ n+16(FP), CX
	ZERO8

sumb:
	VADDPS 0(SI), Y0, Y0
	VADDPS 32(SI), Y1, Y1
	VADDPS 64(SI), Y2, Y2
	VADDPS 96(SI), Y3, Y3
	VADDPS 128(SI), Y4, Y4
	VADDPS 160(SI), Y5, Y5
	VADDPS 192(SI), Y6, Y6
	VADDPS 224(SI), Y7, Y7
	ADDQ $256, SI
	DECQ CX
	JNZ  sumb
	STORE8
	VZEROUPPER
	RET

// func fp8PlainPanel64AVX2(y *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int)
//
// y[0:64] = Σ_k (x[k]·scl[k/128])·v[k][lane]   one fp32 sum over all k
// (v = E4M3·2^-104, so (x[k]·scl[b])·v = x[k]·W[n,k] when scl[b] = 2^(e_b+104));
// codes is [nkb·128][64] bytes, x [nkb·128], scl [nkb], sub [2·nkb].
TEXT ·fp8PlainPanel64AVX2(SB), NOSPLIT, $192-48
	MOVQ y+0(FP), DI
	MOVQ codes+8(FP), SI
	MOVQ x+16(FP), DX
	MOVQ scl+24(FP), R8
	MOVQ sub+32(FP), R11
	MOVQ nkb+40(FP), CX
	MOVQ ·fp8Prefetch(SB), R13 // prefetch distance in bytes (kernels_fast_amd64.go)
	FP8CONSTS
	VMOVDQU fp8oldmask<>(SB), Y11
	ZERO8

plainblock:
	VBROADCASTSS (R8), Y9
	VMOVDQU Y9, 160(SP) // the block's scale, for the rows with subnormal codes
	VMULPS fp8two16<>(SB), Y9, Y9
	VMOVDQU Y9, 128(SP) // the block's scale times 2^16, for the rows without subnormal codes
	MOVQ $2, R10

plainword:
	MOVQ (R11), R12
	ADDQ $8, R11
	MOVQ $64, BX

plaink:
	PREFETCHT0 (SI)(R13*1)
	SHRQ $1, R12
	JCS  plainslow
	VBROADCASTSS (DX), Y8
	VMULPS 128(SP), Y8, Y8
	OLD64

plainnext:
	ADDQ $64, SI
	ADDQ $4, DX
	DECQ BX
	JNZ  plaink
	DECQ R10
	JNZ  plainword
	ADDQ $4, R8
	DECQ CX
	JNZ  plainblock
	STORE8
	VZEROUPPER
	RET

plainslow:
	VBROADCASTSS (DX), Y8
	VMULPS 160(SP), Y8, Y8
	CODES64
	JMP  plainnext

// func fp8Widen64AVX2(v *float32, codes *uint8)
//
// v[p] = the fp32 value the FP8 kernels use for the code of panel row
// fp8LaneRow[p] in a row with a subnormal code, 64 lanes in the kernels'
// layout, codes being the 64 bytes as PackFP8 stores such a row
// (fp8StoredLane): DEC32 without the multiply-add, for the tests.
TEXT ·fp8Widen64AVX2(SB), NOSPLIT, $0-16
	MOVQ v+0(FP), DI
	MOVQ codes+8(FP), SI
	FP8CONSTS
	DEC32WORDS(0)
	VPAND Y12, Y10, Y1
	VPSLLD $16, Y10, Y0
	VPAND Y12, Y11, Y3
	VPSLLD $16, Y11, Y2
	DEC32WORDS(32)
	VPAND Y12, Y10, Y5
	VPSLLD $16, Y10, Y4
	VPAND Y12, Y11, Y7
	VPSLLD $16, Y11, Y6
	STORE8
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
// y[lane] = Σ_k x[k]·w[k][lane], w [k][64] bf16 bits. It prefetches the
// weight bf16Prefetch bytes ahead, both cache lines of each 128-byte row
// (as the FP8 kernels: the hardware prefetchers alone kept too few lines
// in flight for one core to stream).
TEXT ·bf16Panel64AVX2(SB), NOSPLIT, $0-32
	MOVQ y+0(FP), DI
	MOVQ w+8(FP), SI
	MOVQ x+16(FP), DX
	MOVQ k+24(FP), CX
	MOVQ ·bf16Prefetch(SB), R13 // prefetch distance in bytes (kernels_fast_amd64.go)
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	VXORPS Y4, Y4, Y4
	VXORPS Y5, Y5, Y5
	VXORPS Y6, Y6, Y6
	VXORPS Y7, Y7, Y7

bf16k:
	PREFETCHT0 (SI)(R13*1)
	PREFETCHT0 64(SI)(R13*1)
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
// bf16(max(bf16(acc), 0)·w[off]), stored at off(BX).
#define TERM8(off, acc) \
	BF16R(acc); \
	VXORPS Y10, Y10, Y10; \
	VMAXPS acc, Y10, acc; \
	VMULPS off(R8), acc, acc; \
	BF16R(acc); \
	VMOVUPS acc, off(BX)

// func indexTerms64AVX2(terms *float32, icache *float32, iqT *float32, w *float32, rows int)
//
// For each of rows ≤ 8 index keys j (icache [rows][128]): qk[h] = Σ_k
// icache[j][k]·iqT[k][h] for the 64 heads (fp32, k ascending), and the
// score terms terms[j][h] = bf16(max(bf16(qk[h]), 0)·w[h]); terms is
// [8][64]. indexSum64 then adds each row's terms.
TEXT ·indexTerms64AVX2(SB), NOSPLIT, $0-40
	MOVQ terms+0(FP), BX
	MOVQ icache+8(FP), DX
	MOVQ iqT+16(FP), R10
	MOVQ w+24(FP), R8
	MOVQ rows+32(FP), R13
	MOVL $0x7FFF, AX
	VMOVD AX, X12
	VPBROADCASTD X12, Y12
	MOVL $1, AX
	VMOVD AX, X13
	VPBROADCASTD X13, Y13
	MOVL $0xFFFF0000, AX
	VMOVD AX, X14
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
	ADDQ $256, BX
	DECQ R13
	JNZ  idxrow
	VZEROUPPER
	RET

// func indexSum64(sums *float32, terms *float32, rows int)
//
// sums[j] = Σ_h terms[j][h] in fp32, h ascending from +0, for rows ≤ 8
// (terms [8][64]). A row's sum is a chain of 64 dependent adds, as long as
// its 64×128 multiply-adds at full FMA throughput; 8 rows are summed as 8
// independent chains, one add of each per head, so that the adds' latency
// overlaps (fewer rows, the last group of a task, one after another).
TEXT ·indexSum64(SB), NOSPLIT, $0-24
	MOVQ sums+0(FP), DI
	MOVQ terms+8(FP), SI
	MOVQ rows+16(FP), R12
	MOVQ $64, CX
	CMPQ R12, $8
	JNE  sumserial
	VXORPS X0, X0, X0
	VXORPS X1, X1, X1
	VXORPS X2, X2, X2
	VXORPS X3, X3, X3
	VXORPS X4, X4, X4
	VXORPS X5, X5, X5
	VXORPS X6, X6, X6
	VXORPS X7, X7, X7

sum8:
	VADDSS 0(SI), X0, X0
	VADDSS 256(SI), X1, X1
	VADDSS 512(SI), X2, X2
	VADDSS 768(SI), X3, X3
	VADDSS 1024(SI), X4, X4
	VADDSS 1280(SI), X5, X5
	VADDSS 1536(SI), X6, X6
	VADDSS 1792(SI), X7, X7
	ADDQ $4, SI
	DECQ CX
	JNZ  sum8
	VMOVSS X0, 0(DI)
	VMOVSS X1, 4(DI)
	VMOVSS X2, 8(DI)
	VMOVSS X3, 12(DI)
	VMOVSS X4, 16(DI)
	VMOVSS X5, 20(DI)
	VMOVSS X6, 24(DI)
	VMOVSS X7, 28(DI)
	RET

sumserial:
	VXORPS X0, X0, X0
	MOVQ $64, CX

sumrow:
	VADDSS (SI), X0, X0
	ADDQ $4, SI
	DECQ CX
	JNZ  sumrow
	VMOVSS X0, (DI)
	ADDQ $4, DI
	DECQ R12
	JNZ  sumserial
	RET

// BF16RZ and TERM16, the 16-lane forms of BF16R and TERM8, TERM64 (a key's
// 64 heads) and TERM16CONSTS (their constants) are in kernels_amd64.h:
// index_vnni_amd64.s uses them too.

// func indexTerms64AVX512(terms *float32, icache *float32, iqT *float32, w *float32, rows int)
//
// indexTerms64AVX2 with 512-bit vectors, the same operations in the same
// order per head (so the same bits): a ZMM register holds 16 heads, and the
// rows go in fours (then a pair, then one) that share the iqT loads, so
// that 16 accumulators keep both FMA ports busy with half the loads per
// multiply-add of a pair (a core with two 512-bit FMA units, as the GPU host's
// Xeon, then does twice the AVX2 kernel's multiply-adds per cycle; Zen 4
// splits each 512-bit operation in two). rows ≤ 8, terms [8][64].
TEXT ·indexTerms64AVX512(SB), NOSPLIT, $0-40
	MOVQ terms+0(FP), BX
	MOVQ icache+8(FP), DX
	MOVQ iqT+16(FP), R10
	MOVQ w+24(FP), R8
	MOVQ rows+32(FP), R13
	TERM16CONSTS

zquad:
	CMPQ R13, $4
	JLT  zpair
	// rows a-d (at DX, DX+512, DX+1024, DX+1536): accumulators Z16-Z19,
	// Z20-Z23, Z24-Z27, Z28-Z31, sharing each k's iqT loads (Z4-Z7)
	VPXORD Z16, Z16, Z16
	VPXORD Z17, Z17, Z17
	VPXORD Z18, Z18, Z18
	VPXORD Z19, Z19, Z19
	VPXORD Z20, Z20, Z20
	VPXORD Z21, Z21, Z21
	VPXORD Z22, Z22, Z22
	VPXORD Z23, Z23, Z23
	VPXORD Z24, Z24, Z24
	VPXORD Z25, Z25, Z25
	VPXORD Z26, Z26, Z26
	VPXORD Z27, Z27, Z27
	VPXORD Z28, Z28, Z28
	VPXORD Z29, Z29, Z29
	VPXORD Z30, Z30, Z30
	VPXORD Z31, Z31, Z31
	MOVQ R10, SI
	MOVQ $128, CX

zk4:
	VMOVUPS 0(SI), Z4
	VMOVUPS 64(SI), Z5
	VMOVUPS 128(SI), Z6
	VMOVUPS 192(SI), Z7
	VBROADCASTSS (DX), Z8
	VFMADD231PS Z4, Z8, Z16
	VFMADD231PS Z5, Z8, Z17
	VFMADD231PS Z6, Z8, Z18
	VFMADD231PS Z7, Z8, Z19
	VBROADCASTSS 512(DX), Z11
	VFMADD231PS Z4, Z11, Z20
	VFMADD231PS Z5, Z11, Z21
	VFMADD231PS Z6, Z11, Z22
	VFMADD231PS Z7, Z11, Z23
	VBROADCASTSS 1024(DX), Z15
	VFMADD231PS Z4, Z15, Z24
	VFMADD231PS Z5, Z15, Z25
	VFMADD231PS Z6, Z15, Z26
	VFMADD231PS Z7, Z15, Z27
	VBROADCASTSS 1536(DX), Z1
	VFMADD231PS Z4, Z1, Z28
	VFMADD231PS Z5, Z1, Z29
	VFMADD231PS Z6, Z1, Z30
	VFMADD231PS Z7, Z1, Z31
	ADDQ $256, SI
	ADDQ $4, DX
	DECQ CX
	JNZ  zk4
	ADDQ $1536, DX // past rows b-d too

	TERM64(Z16, Z17, Z18, Z19)
	ADDQ $256, BX
	TERM64(Z20, Z21, Z22, Z23)
	ADDQ $256, BX
	TERM64(Z24, Z25, Z26, Z27)
	ADDQ $256, BX
	TERM64(Z28, Z29, Z30, Z31)
	ADDQ $256, BX
	SUBQ $4, R13
	JNZ  zquad
	VZEROUPPER
	RET

zpair:
	CMPQ R13, $2
	JLT  zone
	// rows a (at DX) and b (at DX+512): accumulators Z0-Z3 and Z4-Z7
	VPXORD Z0, Z0, Z0
	VPXORD Z1, Z1, Z1
	VPXORD Z2, Z2, Z2
	VPXORD Z3, Z3, Z3
	VPXORD Z4, Z4, Z4
	VPXORD Z5, Z5, Z5
	VPXORD Z6, Z6, Z6
	VPXORD Z7, Z7, Z7
	MOVQ R10, SI
	MOVQ $128, CX

zk2:
	VBROADCASTSS (DX), Z8
	VBROADCASTSS 512(DX), Z11
	VMOVUPS 0(SI), Z15
	VMOVUPS 64(SI), Z16
	VMOVUPS 128(SI), Z17
	VMOVUPS 192(SI), Z18
	VFMADD231PS Z15, Z8, Z0
	VFMADD231PS Z15, Z11, Z4
	VFMADD231PS Z16, Z8, Z1
	VFMADD231PS Z16, Z11, Z5
	VFMADD231PS Z17, Z8, Z2
	VFMADD231PS Z17, Z11, Z6
	VFMADD231PS Z18, Z8, Z3
	VFMADD231PS Z18, Z11, Z7
	ADDQ $256, SI
	ADDQ $4, DX
	DECQ CX
	JNZ  zk2
	ADDQ $512, DX // past row b too

	TERM64(Z0, Z1, Z2, Z3)
	ADDQ $256, BX
	TERM64(Z4, Z5, Z6, Z7)
	ADDQ $256, BX
	SUBQ $2, R13
	JNZ  zpair
	VZEROUPPER
	RET

zone:
	// the last row when rows is odd
	VPXORD Z0, Z0, Z0
	VPXORD Z1, Z1, Z1
	VPXORD Z2, Z2, Z2
	VPXORD Z3, Z3, Z3
	MOVQ R10, SI
	MOVQ $128, CX

zk1:
	VBROADCASTSS (DX), Z8
	VFMADD231PS 0(SI), Z8, Z0
	VFMADD231PS 64(SI), Z8, Z1
	VFMADD231PS 128(SI), Z8, Z2
	VFMADD231PS 192(SI), Z8, Z3
	ADDQ $256, SI
	ADDQ $4, DX
	DECQ CX
	JNZ  zk1

	TERM64(Z0, Z1, Z2, Z3)
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

// func getMXCSR() uint32
TEXT ·getMXCSR(SB), NOSPLIT, $0-4
	STMXCSR ret+0(FP)
	RET

// func setMXCSR(v uint32)
TEXT ·setMXCSR(SB), NOSPLIT, $0-4
	LDMXCSR v+0(FP)
	RET

// func absMaxBitsAVX2(x *float32, n int) uint32
//
// max over i < n (a multiple of 8) of bits(x[i]) & 0x7FFFFFFF: the
// reference's block amax, as bits (quantizeActFast).
TEXT ·absMaxBitsAVX2(SB), NOSPLIT, $0-20
	MOVQ x+0(FP), SI
	MOVQ n+8(FP), CX
	SHRQ $3, CX
	MOVL $0x7fffffff, AX
	VMOVD AX, X1
	VPBROADCASTD X1, Y1
	VPXOR Y8, Y8, Y8

amaxloop:
	VPAND (SI), Y1, Y9
	VPMAXUD Y9, Y8, Y8
	ADDQ $32, SI
	DECQ CX
	JNZ  amaxloop
	VEXTRACTI128 $1, Y8, X9
	VPMAXUD X9, X8, X8
	VPSHUFD $0x4e, X8, X9
	VPMAXUD X9, X8, X8
	VPSHUFD $0xb1, X8, X9
	VPMAXUD X9, X8, X8
	VMOVD X8, AX
	MOVL AX, ret+16(FP)
	VZEROUPPER
	RET

// func quantBlockAVX2(out, xs *float32, x *float32, inv float32, n int)
//
// out[i] = E4M3(clamp(x[i]·inv, ±448)) as fp32 and xs[i] = out[i]·2^100,
// i < n (a multiple of 8): quantBlockFast on 8 lanes — the product's
// magnitude bits clamped to 448, rounded to 3 mantissa bits (nearest even
// on the bits), or, below 2^-6, rounded to the 2^-9 grid by an fp32 add and
// subtract of 2^14; the sign put back.
TEXT ·quantBlockAVX2(SB), NOSPLIT, $0-40
	MOVQ out+0(FP), DI
	MOVQ xs+8(FP), DX
	MOVQ x+16(FP), SI
	VBROADCASTSS inv+24(FP), Y0
	MOVQ n+32(FP), CX
	MOVL $0x71800000, AX // 2^100
	VMOVD AX, X15
	VPBROADCASTD X15, Y15
	SHRQ $3, CX
	MOVL $0x7fffffff, AX
	VMOVD AX, X1
	VPBROADCASTD X1, Y1
	MOVL $0x43e00000, AX
	VMOVD AX, X2
	VPBROADCASTD X2, Y2
	MOVL $0x7ffff, AX
	VMOVD AX, X3
	VPBROADCASTD X3, Y3
	MOVL $1, AX
	VMOVD AX, X4
	VPBROADCASTD X4, Y4
	MOVL $0xfff00000, AX
	VMOVD AX, X5
	VPBROADCASTD X5, Y5
	MOVL $0x3c800000, AX
	VMOVD AX, X6
	VPBROADCASTD X6, Y6
	MOVL $0x46800000, AX // 2^14
	VMOVD AX, X7
	VPBROADCASTD X7, Y7

qloop:
	VMULPS (SI), Y0, Y8
	VPAND Y1, Y8, Y9
	VPMINUD Y2, Y9, Y9
	VPSRLD $20, Y9, Y10
	VPAND Y4, Y10, Y10
	VPADDD Y3, Y9, Y11
	VPADDD Y10, Y11, Y11
	VPAND Y5, Y11, Y11
	VADDPS Y7, Y9, Y12
	VSUBPS Y7, Y12, Y12
	VPCMPGTD Y9, Y6, Y13
	VPBLENDVB Y13, Y12, Y11, Y11
	VPANDN Y8, Y1, Y14
	VPOR Y14, Y11, Y11
	VMOVUPS Y11, (DI)
	VMULPS Y15, Y11, Y11
	VMOVUPS Y11, (DX)
	ADDQ $32, SI
	ADDQ $32, DI
	ADDQ $32, DX
	DECQ CX
	JNZ  qloop
	VZEROUPPER
	RET

// The AVX-512 forms of the FP8 kernels (fp8Panel64AVX512, fp8Terms64AVX512,
// fp8PlainPanel64AVX512): the same widenings, the same products and sums in
// the same order per lane, on 16-lane ZMM registers, so the same bits as
// their AVX2 forms. A ZMM accumulator holds two of the AVX2 kernels' eight:
//
//	Z0 = [a0 | a2]   Z1 = [a1 | a3]   Z2 = [a4 | a6]   Z3 = [a5 | a7]
//
// (a = the AVX2 accumulator, lane i of a holding row 16(a/2)+2i+a%2): a
// VPMOVSXBW of 32 codes puts rows 2i and 2i+1 in dword i (i < 16), so its
// even rows are [a0 | a2] and its odd ones [a1 | a3]. The stores put them
// back in the AVX2 order (VSHUFF64X2), so y's lane layout is fp8LaneRow's
// for both forms. Rows with a subnormal code go through DEC64V (VBMI byte
// permutes, where the CPU has them) or DEC64Z, DEC32's arithmetic on 64
// codes. Registers: Z8 x broadcast, Z9-Z11 and Z18 scratch,
// Z13-Z15 DEC64Z's constants, Z25-Z31 DEC64V's, Z12 = 0xFFFF0000, Z16 = OLD16's mask
// 0x87F00000, Z17 = 2^-16, Z18-Z21 the stores' reordered accumulators. The
// byte and word operations need AVX-512BW besides AVX-512F (detectAVX512).

// DEC64V's tables (AVX-512 VBMI): for a code magnitude t = c&0x7F with
// field f (DEC32's t + DTAB[min(t, 8)]), fp8vlo[t] = (f<<4)&0xFF and
// fp8vhi[t] = f>>4, the low and high bytes of the word (h<<8|f)<<4 less the
// sign; fp8vidx interleaves them into the words of rows 0-31 (its first 64
// bytes) and 32-63 (the next 64): byte 2r picks fp8vlo's byte of row r at
// the row's stored position (fp8StoredLane), byte 2r+1 the same position of
// fp8vhi (+64, VPERMT2B's second table).
DATA fp8vlo<>+0(SB)/8, $0x60402000c0800000
DATA fp8vlo<>+8(SB)/8, $0xf0e0d0c0b0a09080
DATA fp8vlo<>+16(SB)/8, $0x7060504030201000
DATA fp8vlo<>+24(SB)/8, $0xf0e0d0c0b0a09080
DATA fp8vlo<>+32(SB)/8, $0x7060504030201000
DATA fp8vlo<>+40(SB)/8, $0xf0e0d0c0b0a09080
DATA fp8vlo<>+48(SB)/8, $0x7060504030201000
DATA fp8vlo<>+56(SB)/8, $0xf0e0d0c0b0a09080
DATA fp8vlo<>+64(SB)/8, $0x7060504030201000
DATA fp8vlo<>+72(SB)/8, $0xf0e0d0c0b0a09080
DATA fp8vlo<>+80(SB)/8, $0x7060504030201000
DATA fp8vlo<>+88(SB)/8, $0xf0e0d0c0b0a09080
DATA fp8vlo<>+96(SB)/8, $0x7060504030201000
DATA fp8vlo<>+104(SB)/8, $0xf0e0d0c0b0a09080
DATA fp8vlo<>+112(SB)/8, $0x7060504030201000
DATA fp8vlo<>+120(SB)/8, $0xf0e0d0c0b0a09080
GLOBL fp8vlo<>(SB), RODATA|NOPTR, $128
DATA fp8vhi<>+0(SB)/8, $0x0808080807070700
DATA fp8vhi<>+8(SB)/8, $0x0808080808080808
DATA fp8vhi<>+16(SB)/8, $0x0909090909090909
DATA fp8vhi<>+24(SB)/8, $0x0909090909090909
DATA fp8vhi<>+32(SB)/8, $0x0a0a0a0a0a0a0a0a
DATA fp8vhi<>+40(SB)/8, $0x0a0a0a0a0a0a0a0a
DATA fp8vhi<>+48(SB)/8, $0x0b0b0b0b0b0b0b0b
DATA fp8vhi<>+56(SB)/8, $0x0b0b0b0b0b0b0b0b
DATA fp8vhi<>+64(SB)/8, $0x0c0c0c0c0c0c0c0c
DATA fp8vhi<>+72(SB)/8, $0x0c0c0c0c0c0c0c0c
DATA fp8vhi<>+80(SB)/8, $0x0d0d0d0d0d0d0d0d
DATA fp8vhi<>+88(SB)/8, $0x0d0d0d0d0d0d0d0d
DATA fp8vhi<>+96(SB)/8, $0x0e0e0e0e0e0e0e0e
DATA fp8vhi<>+104(SB)/8, $0x0e0e0e0e0e0e0e0e
DATA fp8vhi<>+112(SB)/8, $0x0f0f0f0f0f0f0f0f
DATA fp8vhi<>+120(SB)/8, $0x0f0f0f0f0f0f0f0f
GLOBL fp8vhi<>(SB), RODATA|NOPTR, $128
DATA fp8vidx<>+0(SB)/8, $0x4303420241014000
DATA fp8vidx<>+8(SB)/8, $0x4707460645054404
DATA fp8vidx<>+16(SB)/8, $0x5313521251115010
DATA fp8vidx<>+24(SB)/8, $0x5717561655155414
DATA fp8vidx<>+32(SB)/8, $0x4b0b4a0a49094808
DATA fp8vidx<>+40(SB)/8, $0x4f0f4e0e4d0d4c0c
DATA fp8vidx<>+48(SB)/8, $0x5b1b5a1a59195818
DATA fp8vidx<>+56(SB)/8, $0x5f1f5e1e5d1d5c1c
DATA fp8vidx<>+64(SB)/8, $0x6323622261216020
DATA fp8vidx<>+72(SB)/8, $0x6727662665256424
DATA fp8vidx<>+80(SB)/8, $0x7333723271317030
DATA fp8vidx<>+88(SB)/8, $0x7737763675357434
DATA fp8vidx<>+96(SB)/8, $0x6b2b6a2a69296828
DATA fp8vidx<>+104(SB)/8, $0x6f2f6e2e6d2d6c2c
DATA fp8vidx<>+112(SB)/8, $0x7b3b7a3a79397838
DATA fp8vidx<>+120(SB)/8, $0x7f3f7e3e7d3d7c3c
GLOBL fp8vidx<>(SB), RODATA|NOPTR, $128
DATA fp8c80<>+0(SB)/4, $0x80808080
GLOBL fp8c80<>(SB), RODATA|NOPTR, $4

#define FP8CONSTS512 \
	VPBROADCASTD fp8c7f<>(SB), Z15; \
	VPBROADCASTD fp8c08<>(SB), Z14; \
	VBROADCASTI32X4 fp8dtab<>(SB), Z13; \
	VPBROADCASTD fp8hiword<>(SB), Z12; \
	VPBROADCASTD fp8oldmask<>(SB), Z16; \
	VPBROADCASTD fp8twom16<>(SB), Z17; \
	VMOVDQU64 fp8vlo<>+0(SB), Z25; \
	VMOVDQU64 fp8vlo<>+64(SB), Z26; \
	VMOVDQU64 fp8vhi<>+0(SB), Z27; \
	VMOVDQU64 fp8vhi<>+64(SB), Z28; \
	VMOVDQU64 fp8vidx<>+0(SB), Z29; \
	VMOVDQU64 fp8vidx<>+64(SB), Z30; \
	VPBROADCASTD fp8c80<>(SB), Z31

// OLD32Z is OLD16 on 32 codes: even rows into even, odd rows into odd.
#define OLD32Z(off, even, odd) \
	VPMOVSXBW off(SI), Z9; \
	VPSLLW $4, Z9, Z9; \
	VPANDD Z16, Z9, Z10; \
	VPSLLD $16, Z9, Z9; \
	VPANDD Z16, Z9, Z9; \
	VFMADD231PS Z8, Z10, odd; \
	VFMADD231PS Z8, Z9, even

#define OLD64Z \
	OLD32Z(0, Z0, Z1); \
	OLD32Z(32, Z2, Z3)

// DEC64Z is DEC32 on the 64 codes of a row with a subnormal code, on ZMM
// registers (AVX-512BW byte operations; Z13 = DTAB in each 128-bit lane,
// Z14 = 0x08, Z15 = 0x7F in each byte): the field bytes f and the sign bytes
// h as in DEC32WORDS, then the per-128-bit-lane byte unpacks of the stored
// order [q0 q2 q1 q3 | q4 q6 q5 q7] (qj = rows 8j..8j+7, fp8StoredLane) give
// the words of rows [0-15 | 32-47] (low) and [16-31 | 48-63] (high), and two
// VSHUFI64X2 put them as [0-15 | 16-31] and [32-47 | 48-63]: the layouts of
// OLD32Z's two halves. Uses Z9, Z10, Z11, Z18.
#define DEC64Z \
	VMOVDQU64 (SI), Z9; \
	VPANDD Z15, Z9, Z10; \
	VPMINUB Z14, Z10, Z11; \
	VPSHUFB Z11, Z13, Z11; \
	VPADDB Z11, Z10, Z10; \
	VPSRLW $4, Z9, Z9; \
	VPANDD Z14, Z9, Z9; \
	VPUNPCKHBW Z9, Z10, Z11; \
	VPUNPCKLBW Z9, Z10, Z10; \
	VPSLLW $4, Z10, Z10; \
	VPSLLW $4, Z11, Z11; \
	VSHUFI64X2 $0x44, Z11, Z10, Z18; \
	VSHUFI64X2 $0xEE, Z11, Z10, Z10; \
	VPANDD Z12, Z18, Z9; \
	VPSLLD $16, Z18, Z18; \
	VFMADD231PS Z8, Z9, Z1; \
	VFMADD231PS Z8, Z18, Z0; \
	VPANDD Z12, Z10, Z9; \
	VPSLLD $16, Z10, Z10; \
	VFMADD231PS Z8, Z9, Z3; \
	VFMADD231PS Z8, Z10, Z2

// DEC64V is DEC64Z with AVX-512 VBMI byte permutes (run when fp8VBMI is
// set; kernels_fast_amd64.go): the same words, fewer operations. Two
// VPERMI2B look up each code's low and high word bytes by its magnitude
// (fp8vlo, fp8vhi in Z25-Z28; bit 7, the sign, is not an index bit), a
// VPTERNLOGD ORs the code's sign bit into the high byte (Z31 = 0x80), and two
// VPERMT2B (indices fp8vidx in Z29, Z30) interleave the bytes into the words
// of rows [0-31] and [32-63] in OLD32Z's layout — the unpacks, the shifts and
// the VSHUFI64X2 of DEC64Z in two operations: 16 instructions a row
// against 21. One core in cache, every row with a subnormal code (uniform or
// all-subnormal codes): 28-30 → 36 GB/s-cpu on the 2-core Zen 5 VM, 8.1-9.9
// → 9.2-12.7 on the GPU host's Xeon (bench/README.md, round 9); checkpoint
// codes, where few rows take it, 42-44. Uses Z9, Z10, Z11, Z18.
#define DEC64V \
	VMOVDQU64 (SI), Z9; \
	VMOVDQU64 (SI), Z10; \
	VPERMI2B Z26, Z25, Z9; \
	VPERMI2B Z28, Z27, Z10; \
	VPTERNLOGD $0xF8, (SI), Z31, Z10; \
	VMOVDQA64 Z9, Z11; \
	VPERMT2B Z10, Z29, Z9; \
	VPERMT2B Z10, Z30, Z11; \
	VPANDD Z12, Z9, Z18; \
	VPSLLD $16, Z9, Z9; \
	VFMADD231PS Z8, Z18, Z1; \
	VFMADD231PS Z8, Z9, Z0; \
	VPANDD Z12, Z11, Z18; \
	VPSLLD $16, Z11, Z11; \
	VFMADD231PS Z8, Z18, Z3; \
	VFMADD231PS Z8, Z11, Z2

#define ZERO4Z \
	VPXORD Z0, Z0, Z0; \
	VPXORD Z1, Z1, Z1; \
	VPXORD Z2, Z2, Z2; \
	VPXORD Z3, Z3, Z3

// INORDERZ puts the accumulators in the AVX2 order: Z18 = [a0 | a1], Z19 =
// [a2 | a3], Z20 = [a4 | a5], Z21 = [a6 | a7].
#define INORDERZ \
	VSHUFF64X2 $0x44, Z1, Z0, Z18; \
	VSHUFF64X2 $0xEE, Z1, Z0, Z19; \
	VSHUFF64X2 $0x44, Z3, Z2, Z20; \
	VSHUFF64X2 $0xEE, Z3, Z2, Z21

// ACCBLKZ folds one block (acc[off] += blk·s, s in Z9).
#define ACCBLKZ(off, blk) \
	VMULPS Z9, blk, blk; \
	VADDPS off(DI), blk, blk; \
	VMOVUPS blk, off(DI)

// STBLKZ stores one block's term (t[off] = blk·s, s in Z9).
#define STBLKZ(off, blk) \
	VMULPS Z9, blk, blk; \
	VMOVUPS blk, off(DI)

// func fp8Panel64AVX512(y *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int)
//
// fp8Panel64AVX2 on ZMM registers: the same contract and bits.
TEXT ·fp8Panel64AVX512(SB), NOSPLIT, $0-48
	MOVQ y+0(FP), DI
	MOVQ codes+8(FP), SI
	MOVQ x+16(FP), DX
	MOVQ scl+24(FP), R8
	MOVQ sub+32(FP), R11
	MOVQ nkb+40(FP), CX
	MOVQ ·fp8Prefetch(SB), R13
	FP8CONSTS512
	VPXORD Z9, Z9, Z9
	VMOVUPS Z9, 0(DI)
	VMOVUPS Z9, 64(DI)
	VMOVUPS Z9, 128(DI)
	VMOVUPS Z9, 192(DI)

zfp8block:
	ZERO4Z
	MOVQ $2, R10

zfp8word:
	MOVQ (R11), R12
	ADDQ $8, R11
	MOVQ $64, BX

zfp8k:
	PREFETCHT0 (SI)(R13*1)
	SHRQ $1, R12
	JCS  zfp8slow
	VBROADCASTSS (DX), Z8
	OLD64Z

zfp8next:
	ADDQ $64, SI
	ADDQ $4, DX
	DECQ BX
	JNZ  zfp8k
	DECQ R10
	JNZ  zfp8word

	VBROADCASTSS (R8), Z9
	INORDERZ
	ACCBLKZ(0, Z18)
	ACCBLKZ(64, Z19)
	ACCBLKZ(128, Z20)
	ACCBLKZ(192, Z21)
	ADDQ $4, R8
	DECQ CX
	JNZ  zfp8block
	VZEROUPPER
	RET

zfp8slow:
	VBROADCASTSS (DX), Z8
	VMULPS Z17, Z8, Z8
	CMPB ·fp8VBMI(SB), $0
	JEQ  zfp8slowz
	DEC64V
	JMP  zfp8next

zfp8slowz:
	DEC64Z
	JMP  zfp8next

// func fp8Terms64AVX512(t *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int)
//
// fp8Terms64AVX2 on ZMM registers: the same contract and bits.
TEXT ·fp8Terms64AVX512(SB), NOSPLIT, $0-48
	MOVQ t+0(FP), DI
	MOVQ codes+8(FP), SI
	MOVQ x+16(FP), DX
	MOVQ scl+24(FP), R8
	MOVQ sub+32(FP), R11
	MOVQ nkb+40(FP), CX
	MOVQ ·fp8Prefetch(SB), R13
	FP8CONSTS512

ztermblock:
	ZERO4Z
	MOVQ $2, R10

ztermword:
	MOVQ (R11), R12
	ADDQ $8, R11
	MOVQ $64, BX

ztermk:
	PREFETCHT0 (SI)(R13*1)
	SHRQ $1, R12
	JCS  ztermslow
	VBROADCASTSS (DX), Z8
	OLD64Z

ztermnext:
	ADDQ $64, SI
	ADDQ $4, DX
	DECQ BX
	JNZ  ztermk
	DECQ R10
	JNZ  ztermword

	VBROADCASTSS (R8), Z9
	INORDERZ
	STBLKZ(0, Z18)
	STBLKZ(64, Z19)
	STBLKZ(128, Z20)
	STBLKZ(192, Z21)
	ADDQ $256, DI
	ADDQ $4, R8
	DECQ CX
	JNZ  ztermblock
	VZEROUPPER
	RET

ztermslow:
	VBROADCASTSS (DX), Z8
	VMULPS Z17, Z8, Z8
	CMPB ·fp8VBMI(SB), $0
	JEQ  ztermslowz
	DEC64V
	JMP  ztermnext

ztermslowz:
	DEC64Z
	JMP  ztermnext

// func fp8PlainPanel64AVX512(y *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int)
//
// fp8PlainPanel64AVX2 on ZMM registers: the same contract and bits (Z22 =
// the block's scale, for the rows with subnormal codes; Z23 = it times
// 2^16, for the others; Z24 = 2^16).
TEXT ·fp8PlainPanel64AVX512(SB), NOSPLIT, $0-48
	MOVQ y+0(FP), DI
	MOVQ codes+8(FP), SI
	MOVQ x+16(FP), DX
	MOVQ scl+24(FP), R8
	MOVQ sub+32(FP), R11
	MOVQ nkb+40(FP), CX
	MOVQ ·fp8Prefetch(SB), R13
	FP8CONSTS512
	VPBROADCASTD fp8two16<>(SB), Z24
	ZERO4Z

zplainblock:
	VBROADCASTSS (R8), Z22
	VMULPS Z22, Z24, Z23
	MOVQ $2, R10

zplainword:
	MOVQ (R11), R12
	ADDQ $8, R11
	MOVQ $64, BX

zplaink:
	PREFETCHT0 (SI)(R13*1)
	SHRQ $1, R12
	JCS  zplainslow
	VBROADCASTSS (DX), Z8
	VMULPS Z23, Z8, Z8
	OLD64Z

zplainnext:
	ADDQ $64, SI
	ADDQ $4, DX
	DECQ BX
	JNZ  zplaink
	DECQ R10
	JNZ  zplainword
	ADDQ $4, R8
	DECQ CX
	JNZ  zplainblock
	INORDERZ
	VMOVUPS Z18, 0(DI)
	VMOVUPS Z19, 64(DI)
	VMOVUPS Z20, 128(DI)
	VMOVUPS Z21, 192(DI)
	VZEROUPPER
	RET

zplainslow:
	VBROADCASTSS (DX), Z8
	VMULPS Z22, Z8, Z8
	CMPB ·fp8VBMI(SB), $0
	JEQ  zplainslowz
	DEC64V
	JMP  zplainnext

zplainslowz:
	DEC64Z
	JMP  zplainnext

// The AVX-512 forms of the bf16/fp32 panel kernels and of the P·V update:
// the same contracts as their AVX2 forms (bf16Panel64AVX2, f32Panel64AVX2,
// pvChunkAVX2), each ZMM accumulator holding 16 consecutive lanes (two of
// the AVX2 kernels' accumulators, in memory order), and the same separate
// multiply and add per lane, in the same order: the same bits.

// BF16X16 widens 16 bf16 weights at off(SI) and accumulates x·w into acc.
#define BF16X16(off, acc) \
	VPMOVZXWD off(SI), Z9; \
	VPSLLD $16, Z9, Z9; \
	VMULPS Z8, Z9, Z9; \
	VADDPS Z9, acc, acc

#define STORE4Z \
	VMOVUPS Z0, 0(DI); \
	VMOVUPS Z1, 64(DI); \
	VMOVUPS Z2, 128(DI); \
	VMOVUPS Z3, 192(DI)

// func bf16Panel64AVX512(y *float32, w *uint16, x *float32, k int)
TEXT ·bf16Panel64AVX512(SB), NOSPLIT, $0-32
	MOVQ y+0(FP), DI
	MOVQ w+8(FP), SI
	MOVQ x+16(FP), DX
	MOVQ k+24(FP), CX
	MOVQ ·bf16Prefetch(SB), R13
	ZERO4Z

zbf16k:
	PREFETCHT0 (SI)(R13*1)
	PREFETCHT0 64(SI)(R13*1)
	VBROADCASTSS (DX), Z8
	BF16X16(0, Z0)
	BF16X16(32, Z1)
	BF16X16(64, Z2)
	BF16X16(96, Z3)
	ADDQ $128, SI
	ADDQ $4, DX
	DECQ CX
	JNZ  zbf16k
	STORE4Z
	VZEROUPPER
	RET

// F32X16 accumulates x·w[off] into acc.
#define F32X16(off, acc) \
	VMULPS off(SI), Z8, Z9; \
	VADDPS Z9, acc, acc

// func f32Panel64AVX512(y *float32, w *float32, x *float32, k int)
TEXT ·f32Panel64AVX512(SB), NOSPLIT, $0-32
	MOVQ y+0(FP), DI
	MOVQ w+8(FP), SI
	MOVQ x+16(FP), DX
	MOVQ k+24(FP), CX
	ZERO4Z

zf32k:
	VBROADCASTSS (DX), Z8
	F32X16(0, Z0)
	F32X16(64, Z1)
	F32X16(128, Z2)
	F32X16(192, Z3)
	ADDQ $256, SI
	ADDQ $4, DX
	DECQ CX
	JNZ  zf32k
	STORE4Z
	VZEROUPPER
	RET

// func f32Panel64x4AVX512(ys *[4]*float32, w *float32, xs *[4]*float32, k int)
//
// f32Panel64AVX512 on four x vectors at once: ys[r][lane] = Σ_k
// xs[r][k]·w[k][lane] for r = 0..3, each lane's products and adds in the
// same order and operand order as f32Panel64AVX512 (so the same bits). The
// four keys share each k's four loads of w: attention's q panel (512 × 64
// fp32, 128 KiB) is read from L2 once per four keys instead of once per
// key, and the 16 accumulators (Z16-Z31) give the adds' latency chains
// room on both vector ports.
TEXT ·f32Panel64x4AVX512(SB), NOSPLIT, $0-32
	MOVQ w+8(FP), SI
	MOVQ xs+16(FP), AX
	MOVQ 0(AX), R8
	MOVQ 8(AX), R9
	MOVQ 16(AX), R10
	MOVQ 24(AX), R11
	MOVQ k+24(FP), CX
	VPXORD Z16, Z16, Z16
	VPXORD Z17, Z17, Z17
	VPXORD Z18, Z18, Z18
	VPXORD Z19, Z19, Z19
	VPXORD Z20, Z20, Z20
	VPXORD Z21, Z21, Z21
	VPXORD Z22, Z22, Z22
	VPXORD Z23, Z23, Z23
	VPXORD Z24, Z24, Z24
	VPXORD Z25, Z25, Z25
	VPXORD Z26, Z26, Z26
	VPXORD Z27, Z27, Z27
	VPXORD Z28, Z28, Z28
	VPXORD Z29, Z29, Z29
	VPXORD Z30, Z30, Z30
	VPXORD Z31, Z31, Z31

zf32k4:
	VMOVUPS 0(SI), Z4
	VMOVUPS 64(SI), Z5
	VMOVUPS 128(SI), Z6
	VMOVUPS 192(SI), Z7
	VBROADCASTSS (R8), Z8
	VBROADCASTSS (R9), Z9
	VBROADCASTSS (R10), Z10
	VBROADCASTSS (R11), Z11
	VMULPS Z4, Z8, Z0
	VADDPS Z0, Z16, Z16
	VMULPS Z5, Z8, Z1
	VADDPS Z1, Z17, Z17
	VMULPS Z6, Z8, Z2
	VADDPS Z2, Z18, Z18
	VMULPS Z7, Z8, Z3
	VADDPS Z3, Z19, Z19
	VMULPS Z4, Z9, Z12
	VADDPS Z12, Z20, Z20
	VMULPS Z5, Z9, Z13
	VADDPS Z13, Z21, Z21
	VMULPS Z6, Z9, Z14
	VADDPS Z14, Z22, Z22
	VMULPS Z7, Z9, Z15
	VADDPS Z15, Z23, Z23
	VMULPS Z4, Z10, Z0
	VADDPS Z0, Z24, Z24
	VMULPS Z5, Z10, Z1
	VADDPS Z1, Z25, Z25
	VMULPS Z6, Z10, Z2
	VADDPS Z2, Z26, Z26
	VMULPS Z7, Z10, Z3
	VADDPS Z3, Z27, Z27
	VMULPS Z4, Z11, Z12
	VADDPS Z12, Z28, Z28
	VMULPS Z5, Z11, Z13
	VADDPS Z13, Z29, Z29
	VMULPS Z6, Z11, Z14
	VADDPS Z14, Z30, Z30
	VMULPS Z7, Z11, Z15
	VADDPS Z15, Z31, Z31
	ADDQ $256, SI
	ADDQ $4, R8
	ADDQ $4, R9
	ADDQ $4, R10
	ADDQ $4, R11
	DECQ CX
	JNZ  zf32k4
	MOVQ ys+0(FP), AX
	MOVQ 0(AX), DI
	VMOVUPS Z16, 0(DI)
	VMOVUPS Z17, 64(DI)
	VMOVUPS Z18, 128(DI)
	VMOVUPS Z19, 192(DI)
	MOVQ 8(AX), DI
	VMOVUPS Z20, 0(DI)
	VMOVUPS Z21, 64(DI)
	VMOVUPS Z22, 128(DI)
	VMOVUPS Z23, 192(DI)
	MOVQ 16(AX), DI
	VMOVUPS Z24, 0(DI)
	VMOVUPS Z25, 64(DI)
	VMOVUPS Z26, 128(DI)
	VMOVUPS Z27, 192(DI)
	MOVQ 24(AX), DI
	VMOVUPS Z28, 0(DI)
	VMOVUPS Z29, 64(DI)
	VMOVUPS Z30, 128(DI)
	VMOVUPS Z31, 192(DI)
	VZEROUPPER
	RET

// func pvChunkAVX512(acc *float32, rows **float32, p *float32, n int, alpha float32, d int)
TEXT ·pvChunkAVX512(SB), NOSPLIT, $0-48
	MOVQ acc+0(FP), DI
	MOVQ rows+8(FP), R8
	MOVQ p+16(FP), R9
	MOVQ n+24(FP), R10
	VBROADCASTSS alpha+32(FP), Z15
	MOVQ d+40(FP), R11
	XORQ R12, R12

zpvblock:
	VMULPS 0(DI), Z15, Z0
	VMULPS 64(DI), Z15, Z1
	VMULPS 128(DI), Z15, Z2
	VMULPS 192(DI), Z15, Z3
	XORQ BX, BX
	TESTQ R10, R10
	JZ   zpvstore

zpvrow:
	MOVQ (R8)(BX*8), SI
	ADDQ R12, SI
	VBROADCASTSS (R9)(BX*4), Z8
	F32X16(0, Z0)
	F32X16(64, Z1)
	F32X16(128, Z2)
	F32X16(192, Z3)
	INCQ BX
	CMPQ BX, R10
	JNE  zpvrow

zpvstore:
	STORE4Z
	ADDQ $256, DI
	ADDQ $256, R12
	SUBQ $64, R11
	JNZ  zpvblock
	VZEROUPPER
	RET

// func plainRangeAVX2(v *float32, n int) (lom, him, low uint32)
//
// Over i < n (a multiple of 8), with a = bits(v[i]) & 0x7FFFFFFF: lom = min
// (a − 1) (unsigned: a zero wraps to 0xFFFFFFFF), him = max a (unsigned),
// low = OR a (plainBlockRange's integer loop, 8 lanes at a time).
TEXT ·plainRangeAVX2(SB), NOSPLIT, $0-28
	MOVQ v+0(FP), SI
	MOVQ n+8(FP), CX
	SHRQ $3, CX
	MOVL $0x7fffffff, AX
	VMOVD AX, X1
	VPBROADCASTD X1, Y1
	VPCMPEQD Y2, Y2, Y2 // −1 in every lane
	VPXOR Y3, Y3, Y3    // OR of a
	VPXOR Y4, Y4, Y4    // max a
	VMOVDQU Y2, Y5      // min (a − 1)

rangeloop:
	VPAND (SI), Y1, Y0
	VPOR Y0, Y3, Y3
	VPMAXUD Y0, Y4, Y4
	VPADDD Y2, Y0, Y0
	VPMINUD Y0, Y5, Y5
	ADDQ $32, SI
	DECQ CX
	JNZ  rangeloop
	VEXTRACTI128 $1, Y3, X0
	VPOR X0, X3, X3
	VPSHUFD $0x4e, X3, X0
	VPOR X0, X3, X3
	VPSHUFD $0xb1, X3, X0
	VPOR X0, X3, X3
	VEXTRACTI128 $1, Y4, X0
	VPMAXUD X0, X4, X4
	VPSHUFD $0x4e, X4, X0
	VPMAXUD X0, X4, X4
	VPSHUFD $0xb1, X4, X0
	VPMAXUD X0, X4, X4
	VEXTRACTI128 $1, Y5, X0
	VPMINUD X0, X5, X5
	VPSHUFD $0x4e, X5, X0
	VPMINUD X0, X5, X5
	VPSHUFD $0xb1, X5, X0
	VPMINUD X0, X5, X5
	VMOVD X5, AX
	MOVL AX, lom+16(FP)
	VMOVD X4, AX
	MOVL AX, him+20(FP)
	VMOVD X3, AX
	MOVL AX, low+24(FP)
	VZEROUPPER
	RET

// vnniPackRows, indexTerms64VNNI and vnniVerifyRows, the integer kernels
// of the index scores, are in index_vnni_amd64.s, which internal/vnnigen
// writes (go generate ./attention).

// exptab: log2e, ln2 in two parts (ln2hi has 42 significant bits, so n·ln2hi
// is exact for |n| < 2^11), the domain bounds, the float32 rounding
// midpoint's low 29 bits and their mask, then 1/k! for k = 0 … 11.
DATA exptab<>+0(SB)/8, $0x3ff71547652b82fe  // log2 e
DATA exptab<>+8(SB)/8, $0x3fe62e42fefa3800  // ln2hi
DATA exptab<>+16(SB)/8, $0x3d2ef35793c76730 // ln2lo
DATA exptab<>+24(SB)/8, $0xc055d33333333333 // −87.3
DATA exptab<>+32(SB)/8, $0x4056000000000000 // 88
DATA exptab<>+40(SB)/8, $0x000000001fffffff // low 29 bits
DATA exptab<>+48(SB)/8, $0x0000000010000000 // a float32 rounding midpoint's low 29 bits
DATA exptab<>+56(SB)/8, $0x3ff0000000000000 // 1/0!
DATA exptab<>+64(SB)/8, $0x3ff0000000000000 // 1/1!
DATA exptab<>+72(SB)/8, $0x3fe0000000000000 // 1/2!
DATA exptab<>+80(SB)/8, $0x3fc5555555555555 // 1/3!
DATA exptab<>+88(SB)/8, $0x3fa5555555555555 // 1/4!
DATA exptab<>+96(SB)/8, $0x3f81111111111111 // 1/5!
DATA exptab<>+104(SB)/8, $0x3f56c16c16c16c17 // 1/6!
DATA exptab<>+112(SB)/8, $0x3f2a01a01a01a01a // 1/7!
DATA exptab<>+120(SB)/8, $0x3efa01a01a01a01a // 1/8!
DATA exptab<>+128(SB)/8, $0x3ec71de3a556c734 // 1/9!
DATA exptab<>+136(SB)/8, $0x3e927e4fb7789f5c // 1/10!
DATA exptab<>+144(SB)/8, $0x3e5ae64567f544e4 // 1/11!
GLOBL exptab<>(SB), RODATA|NOPTR, $152

// func exp32x8AVX512(dst *float32, src *float32, n int, window int64) (bad uint64)
//
// dst[i] = float32(e^src[i]) for n = 8k ≤ 64 values, eight at a time in
// float64: n = round(x·log2 e), r = x − n·ln2 (|r| ≤ 0.35, exact to about
// 2^-55), e^r by its Taylor polynomial to degree 11 (truncation < 2^-47),
// then ·2^n. Its relative error is well under 2^-44, within 2^8 ulps of the
// exact value, and math.Exp's is under one ulp: the two round to the same
// float32 unless a float32 rounding midpoint lies between them. Lanes whose
// result is within window ulps of a midpoint (its low 29 bits within window
// of 2^28), and lanes outside [−87.3, 88] (where the float32 would be
// subnormal or overflow; NaN) are marked in bad (bit i for dst[i]) for the
// caller to compute with math.Exp; the others are float32(math.Exp(x))
// exactly (expFast; TestExpFast, exhaustive with SPARSEMLA_EXHAUSTIVE=1).
TEXT ·exp32x8AVX512(SB), NOSPLIT, $0-40
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), R13
	VPBROADCASTQ window+24(FP), Z31
	VBROADCASTSD exptab<>+0(SB), Z16
	VBROADCASTSD exptab<>+8(SB), Z17
	VBROADCASTSD exptab<>+16(SB), Z18
	VBROADCASTSD exptab<>+24(SB), Z19
	VBROADCASTSD exptab<>+32(SB), Z20
	VBROADCASTSD exptab<>+40(SB), Z21
	VBROADCASTSD exptab<>+48(SB), Z22
	VBROADCASTSD exptab<>+56(SB), Z4
	VBROADCASTSD exptab<>+64(SB), Z5
	VBROADCASTSD exptab<>+72(SB), Z6
	VBROADCASTSD exptab<>+80(SB), Z7
	VBROADCASTSD exptab<>+88(SB), Z8
	VBROADCASTSD exptab<>+96(SB), Z9
	VBROADCASTSD exptab<>+104(SB), Z10
	VBROADCASTSD exptab<>+112(SB), Z11
	VBROADCASTSD exptab<>+120(SB), Z12
	VBROADCASTSD exptab<>+128(SB), Z13
	VBROADCASTSD exptab<>+136(SB), Z14
	VBROADCASTSD exptab<>+144(SB), Z15
	XORQ R12, R12
	XORQ CX, CX

eloop:
	VCVTPS2PD (SI), Z0
	VMULPD Z16, Z0, Z1
	VRNDSCALEPD $0, Z1, Z1
	VMOVAPD Z0, Z2
	VFNMADD231PD Z17, Z1, Z2
	VFNMADD231PD Z18, Z1, Z2
	VMOVAPD Z15, Z3
	VFMADD213PD Z14, Z2, Z3
	VFMADD213PD Z13, Z2, Z3
	VFMADD213PD Z12, Z2, Z3
	VFMADD213PD Z11, Z2, Z3
	VFMADD213PD Z10, Z2, Z3
	VFMADD213PD Z9, Z2, Z3
	VFMADD213PD Z8, Z2, Z3
	VFMADD213PD Z7, Z2, Z3
	VFMADD213PD Z6, Z2, Z3
	VFMADD213PD Z5, Z2, Z3
	VFMADD213PD Z4, Z2, Z3
	VSCALEFPD Z1, Z3, Z3
	// good lanes: −87.3 ≤ x ≤ 88 (false for NaN) and the result's low 29
	// bits farther than window from 2^28
	VCMPPD $0x1D, Z19, Z0, K1
	VCMPPD $0x12, Z20, Z0, K2
	KANDB K2, K1, K1
	VPANDQ Z21, Z3, Z23
	VPSUBQ Z22, Z23, Z23
	VPABSQ Z23, Z23
	VPCMPQ $6, Z31, Z23, K3
	KANDB K3, K1, K1
	KNOTB K1, K1
	KMOVB K1, AX
	SHLQ CX, AX
	ORQ  AX, R12
	VCVTPD2PS Z3, Y24
	VMOVUPS Y24, (DI)
	ADDQ $32, SI
	ADDQ $32, DI
	ADDQ $8, CX
	SUBQ $8, R13
	JNZ  eloop
	MOVQ R12, bad+32(FP)
	VZEROUPPER
	RET

// func pvChunk2AVX512(acc0, acc1 *float32, rows **float32, p0, p1 *float32, n int, alpha0, alpha1 float32)
//
// pvChunkAVX512 for two heads and one 64-dim tile (d = 64): acc_h[k] =
// acc_h[k]·α_h, then acc_h[k] += p_h[i]·rows[i][k] for i < n, each head's
// operations in pvChunkAVX512's order and operand order (so the same bits).
// Each row's tile is loaded once for both heads, and the 8 accumulators
// (Z0-Z7) give the adds' latency chains room.
TEXT ·pvChunk2AVX512(SB), NOSPLIT, $0-56
	MOVQ acc0+0(FP), DI
	MOVQ acc1+8(FP), DX
	MOVQ rows+16(FP), R8
	MOVQ p0+24(FP), R9
	MOVQ p1+32(FP), R10
	MOVQ n+40(FP), R11
	VBROADCASTSS alpha0+48(FP), Z14
	VBROADCASTSS alpha1+52(FP), Z15
	VMULPS 0(DI), Z14, Z0
	VMULPS 64(DI), Z14, Z1
	VMULPS 128(DI), Z14, Z2
	VMULPS 192(DI), Z14, Z3
	VMULPS 0(DX), Z15, Z4
	VMULPS 64(DX), Z15, Z5
	VMULPS 128(DX), Z15, Z6
	VMULPS 192(DX), Z15, Z7
	XORQ BX, BX
	TESTQ R11, R11
	JZ   zpv2store

zpv2row:
	MOVQ (R8)(BX*8), SI
	VMOVUPS 0(SI), Z16
	VMOVUPS 64(SI), Z17
	VMOVUPS 128(SI), Z18
	VMOVUPS 192(SI), Z19
	VBROADCASTSS (R9)(BX*4), Z8
	VBROADCASTSS (R10)(BX*4), Z9
	VMULPS Z16, Z8, Z20
	VADDPS Z20, Z0, Z0
	VMULPS Z17, Z8, Z21
	VADDPS Z21, Z1, Z1
	VMULPS Z18, Z8, Z22
	VADDPS Z22, Z2, Z2
	VMULPS Z19, Z8, Z23
	VADDPS Z23, Z3, Z3
	VMULPS Z16, Z9, Z24
	VADDPS Z24, Z4, Z4
	VMULPS Z17, Z9, Z25
	VADDPS Z25, Z5, Z5
	VMULPS Z18, Z9, Z26
	VADDPS Z26, Z6, Z6
	VMULPS Z19, Z9, Z27
	VADDPS Z27, Z7, Z7
	INCQ BX
	CMPQ BX, R11
	JNE  zpv2row

zpv2store:
	VMOVUPS Z0, 0(DI)
	VMOVUPS Z1, 64(DI)
	VMOVUPS Z2, 128(DI)
	VMOVUPS Z3, 192(DI)
	VMOVUPS Z4, 0(DX)
	VMOVUPS Z5, 64(DX)
	VMOVUPS Z6, 128(DX)
	VMOVUPS Z7, 192(DX)
	VZEROUPPER
	RET

// func loadReadAVX2(p *byte, n int) uint64
//
// Reads n bytes (a multiple of 256) at p with 32-byte vector loads, four
// independent chains ORed, and returns the OR of everything read (folded to
// 64 bits, so that nothing can be skipped): the benchmarks' second
// streaming-read floor (bench_fast_test.go, poolLoad). bytes.IndexByte,
// the first, spends a compare and a mask move on every 32 bytes and reads
// 4-6 % slower on one and two cores of the 2-core Zen 5 VM
// (bench/README.md, round 17).
TEXT ·loadReadAVX2(SB), NOSPLIT, $0-24
	MOVQ p+0(FP), SI
	MOVQ n+8(FP), CX
	SHRQ $8, CX
	VPXOR Y0, Y0, Y0
	VPXOR Y1, Y1, Y1
	VPXOR Y2, Y2, Y2
	VPXOR Y3, Y3, Y3
	TESTQ CX, CX
	JZ   ldone

lloop:
	VPOR 0(SI), Y0, Y0
	VPOR 32(SI), Y1, Y1
	VPOR 64(SI), Y2, Y2
	VPOR 96(SI), Y3, Y3
	VPOR 128(SI), Y0, Y0
	VPOR 160(SI), Y1, Y1
	VPOR 192(SI), Y2, Y2
	VPOR 224(SI), Y3, Y3
	ADDQ $256, SI
	DECQ CX
	JNZ  lloop

ldone:
	VPOR Y1, Y0, Y0
	VPOR Y3, Y2, Y2
	VPOR Y2, Y0, Y0
	VEXTRACTI128 $1, Y0, X1
	VPOR X1, X0, X0
	VPSRLDQ $8, X0, X1
	VPOR X1, X0, X0
	VMOVQ X0, AX
	MOVQ AX, ret+16(FP)
	VZEROUPPER
	RET
