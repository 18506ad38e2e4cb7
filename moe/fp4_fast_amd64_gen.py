# Generates fp4_fast_amd64.s (go generate ./moe): the AVX2 FP4 kernel, fully
# unrolled over the 8 columns of a dword and the 4 row groups.
L=[]
a=L.append
a('//go:build amd64 && !purego')
a('')
a('#include "textflag.h"')
a('')
a('// fp4mag[m] = bits(E2M1 magnitude m: 0, 0.5, 1, 1.5, 2, 3, 4, 6) XOR m<<28:')
a('// the kernel XORs the table entry with the nibble shifted to bits 28..31')
a('// (magnitude m at 28..30, the sign at 31), which cancels m<<28 and leaves')
a('// the signed value. fp4sign: the fp32 sign bit; fp4byte: the byte mask.')
vals=[0x00000000,0x3F000000,0x3F800000,0x3FC00000,0x40000000,0x40400000,0x40800000,0x40C00000]
for i,v in enumerate(vals):
    a('DATA fp4mag<>+%d(SB)/4, $0x%08X' % (4*i, v ^ (i << 28)))
a('GLOBL fp4mag<>(SB), RODATA|NOPTR, $32')
for i in range(8):
    a('DATA fp4sign<>+%d(SB)/4, $0x80000000' % (4*i))
a('GLOBL fp4sign<>(SB), RODATA|NOPTR, $32')
for i in range(8):
    a('DATA fp4byte<>+%d(SB)/4, $0x000000FF' % (4*i))
a('GLOBL fp4byte<>(SB), RODATA|NOPTR, $32')
a('')
a('''// func fp4Rows32AVX2(acc *float32, codes *uint8, scales *uint8, idx *int32, qx *float32, ea *int32, stat *int32, nb int, tmp *uint32)
//
// 32 rows of FP4Linear, row r = 8g + d in lane d of group g (g < 4), each
// lane one row summed exactly as the reference: per 32-column block b the
// products qx[k]·E2M1(code[r][k]) (exact in fp32, multiples of 2^-10) are
// added k ascending (VFMADD231PS: the product is exact, so the fused add
// rounds as the reference's add), the block sum is multiplied by the power
// of two 2^(ew[r][b] + ea[b] - 127) (built from the scale byte and the
// activation exponent; equal to the reference's two exact scalings while
// both stay normal, which the caller checks from stat) and added into
// acc[r] (b ascending). The codes are read from the checkpoint's row-major
// layout: codes points at row 0, idx[0:32] holds the byte offsets of the 32
// rows, idx[32:64] the offsets of their scale rows from scales. At each
// block the 16 code bytes of every row are loaded and transposed (8 rows ×
// 4 dwords → 4 dwords × 8 rows, VUNPCK*) into tmp[0:128] ([4 dwords][4
// groups][8]), and every 16 blocks the rows' next 16 scale bytes into
// tmp[128:256]; nb must be a multiple of 16 (no load leaves a row).
// stat[0:32] / [32:64] / [64:96] receive per row min / max of ew + ea and
// max of ew (the caller initialises them).
TEXT ·fp4Rows32AVX2(SB), NOSPLIT, $0-72
	MOVQ acc+0(FP), DI
	MOVQ codes+8(FP), CX
	MOVQ scales+16(FP), SI
	MOVQ idx+24(FP), R8
	MOVQ qx+32(FP), DX
	MOVQ ea+40(FP), R9
	MOVQ stat+48(FP), R10
	VMOVDQU fp4mag<>(SB), Y12
	XORQ BX, BX            // block b
block:
	MOVQ tmp+64(FP), R11
	TESTQ $15, BX
	JNZ codes
	// every 16th block: the 32 rows' next 16 scale bytes, transposed into
	// tmp[128:256] ([4 dwords][4 groups][8 rows], dword j = blocks b+4j … b+4j+3)
	LEAQ (SI)(BX*1), R12''')
for g in range(4):
    for i in range(4):
        r=8*g+i
        a('\tMOVLQSX %d(R8), AX' % (128+4*r))
        a('\tMOVLQSX %d(R8), R13' % (128+4*(r+4)))
        a('\tVMOVDQU (R12)(AX*1), X%d' % i)
        a('\tVINSERTI128 $1, (R12)(R13*1), Y%d, Y%d' % (i,i))
    a('\tVUNPCKLPS Y1, Y0, Y4')
    a('\tVUNPCKHPS Y1, Y0, Y5')
    a('\tVUNPCKLPS Y3, Y2, Y6')
    a('\tVUNPCKHPS Y3, Y2, Y7')
    a('\tVUNPCKLPD Y6, Y4, Y8')
    a('\tVUNPCKHPD Y6, Y4, Y9')
    a('\tVUNPCKLPD Y7, Y5, Y10')
    a('\tVUNPCKHPD Y7, Y5, Y11')
    for q,reg in enumerate(['Y8','Y9','Y10','Y11']):
        a('\tVMOVDQU %s, %d(R11)' % (reg, 512+(q*4+g)*32))
a('''codes:''')
# transpose phase for each group
for g in range(4):
    regs=['Y0','Y1','Y2','Y3']
    for i in range(4):
        r=8*g+i
        a('\tMOVLQSX %d(R8), AX' % (4*r))
        a('\tMOVLQSX %d(R8), R13' % (4*(r+4)))
        a('\tVMOVDQU (CX)(AX*1), X%d' % i)
        a('\tVINSERTI128 $1, (CX)(R13*1), Y%d, Y%d' % (i,i))
    a('\tVUNPCKLPS Y1, Y0, Y4')
    a('\tVUNPCKHPS Y1, Y0, Y5')
    a('\tVUNPCKLPS Y3, Y2, Y6')
    a('\tVUNPCKHPS Y3, Y2, Y7')
    a('\tVUNPCKLPD Y6, Y4, Y8')
    a('\tVUNPCKHPD Y6, Y4, Y9')
    a('\tVUNPCKLPD Y7, Y5, Y10')
    a('\tVUNPCKHPD Y7, Y5, Y11')
    for q,reg in enumerate(['Y8','Y9','Y10','Y11']):
        a('\tVMOVDQU %s, %d(R11)' % (reg, (q*4+g)*32))
a('''	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	MOVQ $4, R12           // 4 dwords (8 columns each) per block
quad:''')
for g in range(4):
    a('\tVMOVDQU %d(R11), Y%d' % (32*g, 4+g))
for i in range(8):
    a('\tVBROADCASTSS %d(DX), Y8' % (4*i))
    for g in range(4):
        G='Y%d'%(4+g)
        if i==0:
            a('\tVPERMPS Y12, %s, Y10' % G)
        else:
            a('\tVPSRLD $%d, %s, Y9' % (4*i, G))
            a('\tVPERMPS Y12, Y9, Y10')
        a('\tVPSLLD $28, %s, Y11' % (G if i==0 else 'Y9'))
        a('\tVXORPS Y11, Y10, Y10')
        a('\tVFMADD231PS Y10, Y8, Y%d' % g)
a('''	ADDQ $128, R11
	ADDQ $32, DX
	DECQ R12
	JNZ quad
	ADDQ $16, CX
	// block end: factor 2^(ew + ea - 127) per row, acc += blk · factor
	MOVQ BX, R13
	ANDQ $12, R13
	SHLQ $5, R13           // ((b mod 16) div 4) · 128
	ADDQ tmp+64(FP), R13
	MOVQ BX, AX
	ANDQ $3, AX
	SHLQ $3, AX
	VMOVQ AX, X14          // shift of byte b&3 in that dword
	VPBROADCASTD (R9)(BX*4), Y15''')
for g in range(4):
    for i in range(8):
        r=8*g+i
        # scalar gather of the 8 rows' scale dwords
    a('\tVMOVDQU %d(R13), Y9' % (512+32*g))
    a('\tVPSRLD X14, Y9, Y9')
    a('\tVPAND fp4byte<>(SB), Y9, Y9')
    a('\tVPMAXSD %d(R10), Y9, Y10' % (256+32*g))
    a('\tVMOVDQU Y10, %d(R10)' % (256+32*g))
    a('\tVPADDD Y15, Y9, Y9')
    a('\tVPMINSD %d(R10), Y9, Y10' % (32*g))
    a('\tVMOVDQU Y10, %d(R10)' % (32*g))
    a('\tVPMAXSD %d(R10), Y9, Y10' % (128+32*g))
    a('\tVMOVDQU Y10, %d(R10)' % (128+32*g))
    a('\tVPSLLD $23, Y9, Y9')
    a('\tVMULPS Y9, Y%d, Y%d' % (g,g))
    a('\tVADDPS %d(DI), Y%d, Y%d' % (32*g,g,g))
    a('\tVMOVUPS Y%d, %d(DI)' % (g,32*g))
a('''	INCQ BX
	CMPQ BX, nb+56(FP)
	JLT block
	VZEROUPPER
	RET

// func fp4GetMXCSR() uint32
TEXT ·fp4GetMXCSR(SB), NOSPLIT, $0-4
	STMXCSR ret+0(FP)
	RET

// func fp4SetMXCSR(v uint32)
TEXT ·fp4SetMXCSR(SB), NOSPLIT, $0-4
	LDMXCSR v+0(FP)
	RET
''')
open('fp4_fast_amd64.s','w').write('\n'.join(L))
