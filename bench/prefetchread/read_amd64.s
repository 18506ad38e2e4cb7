//go:build amd64

#include "textflag.h"

// Each func(p *byte, n, dist, far int) uint64 reads n bytes (multiple of 256)
// with 256 bytes per iteration, XOR-folding into Y0..Y3.

#define BODY \
	VPXOR (SI), Y0, Y0 \
	VPXOR 32(SI), Y1, Y1 \
	VPXOR 64(SI), Y2, Y2 \
	VPXOR 96(SI), Y3, Y3 \
	VPXOR 128(SI), Y0, Y0 \
	VPXOR 160(SI), Y1, Y1 \
	VPXOR 192(SI), Y2, Y2 \
	VPXOR 224(SI), Y3, Y3

#define PRO \
	MOVQ p+0(FP), SI \
	MOVQ n+8(FP), CX \
	MOVQ dist+16(FP), R8 \
	MOVQ far+24(FP), R9 \
	VPXOR Y0, Y0, Y0 \
	VPXOR Y1, Y1, Y1 \
	VPXOR Y2, Y2, Y2 \
	VPXOR Y3, Y3, Y3 \
	SHRQ $8, CX

// NEXT ends an iteration: 256 bytes read, loop while any are left.
#define NEXT \
	BODY \
	ADDQ $256, SI \
	DECQ CX \
	JNZ loop

#define EPI \
	VPXOR Y1, Y0, Y0 \
	VPXOR Y3, Y2, Y2 \
	VPXOR Y2, Y0, Y0 \
	VEXTRACTI128 $1, Y0, X1 \
	VPXOR X1, X0, X0 \
	MOVQ X0, AX \
	VZEROUPPER \
	MOVQ AX, ret+32(FP) \
	RET

TEXT ·readNone(SB), NOSPLIT, $0-40
	PRO
loop:
	NEXT
	EPI

#define PF4(op, reg) \
	op 0(SI)(reg*1) \
	op 64(SI)(reg*1) \
	op 128(SI)(reg*1) \
	op 192(SI)(reg*1)

TEXT ·readT0(SB), NOSPLIT, $0-40
	PRO
loop:
	PF4(PREFETCHT0, R8)
	NEXT
	EPI

TEXT ·readT1(SB), NOSPLIT, $0-40
	PRO
loop:
	PF4(PREFETCHT1, R8)
	NEXT
	EPI

TEXT ·readT2(SB), NOSPLIT, $0-40
	PRO
loop:
	PF4(PREFETCHT2, R8)
	NEXT
	EPI

TEXT ·readNTA(SB), NOSPLIT, $0-40
	PRO
loop:
	PF4(PREFETCHNTA, R8)
	NEXT
	EPI

// near T0 at dist and far T2 at far
TEXT ·readT0T2(SB), NOSPLIT, $0-40
	PRO
loop:
	PF4(PREFETCHT0, R8)
	PF4(PREFETCHT2, R9)
	NEXT
	EPI

// near T0 at dist and far T1 at far
TEXT ·readT0T1(SB), NOSPLIT, $0-40
	PRO
loop:
	PF4(PREFETCHT0, R8)
	PF4(PREFETCHT1, R9)
	NEXT
	EPI
