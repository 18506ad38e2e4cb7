//go:build !amd64 || purego

package moe

const hasFP4Asm = false

func fp4Rows32(acc *float32, codes *uint8, scales *uint8, idx *int32, qx *float32, ea *int32, stat *int32, nb int, tmp *[256]uint32) {
	panic("moe: fp4Rows32 without the assembly")
}

func fp4GetMXCSR() uint32  { return 0 }
func fp4SetMXCSR(v uint32) {}
