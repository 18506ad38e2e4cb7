package dump

import (
	"fmt"
	"strings"

	"sparsemla/userfile"
)

// DType is the element type of a record's raw little-endian bytes.
type DType uint8

// The element types a dump can hold. The zero value is invalid so that a
// record decoded without a dtype is caught.
const (
	Invalid DType = iota
	F32           // IEEE binary32
	F64           // IEEE binary64
	BF16          // bfloat16 (upper half of a binary32)
	F16           // IEEE binary16
	E4M3          // FP8 E4M3FN (OCP), torch.float8_e4m3fn
	E5M2          // FP8 E5M2, torch.float8_e5m2
	E8M0          // UE8M0 power-of-two scale byte, torch.float8_e8m0fnu: 2^(b-127), 0xFF = NaN
	FP4           // FP4 E2M1, two codes per byte, even element in the low nibble (float4_e2m1fn_x2)
	I8            // int8
	I16           // int16
	I32           // int32
	I64           // int64
	U8            // uint8, also raw bytes (KV pages, scale bytes stored as U8)
	Bool          // one byte, 0 or 1
	U16           // uint16 (also bf16 bits saved by numpy; see the name-map dtype override)
	U32           // uint32
	U64           // uint64 (decoded to int64 with two's-complement wrap)
	numDTypes
)

type dtypeInfo struct {
	name   string // native dump name
	st     string // safetensors name ("" = not a safetensors dtype)
	bits   int    // bits per element
	float  bool   // decodes to float32
	signed bool
}

var dtypeTable = [numDTypes]dtypeInfo{
	Invalid: {name: "invalid"},
	F32:     {name: "f32", st: "F32", bits: 32, float: true},
	F64:     {name: "f64", st: "F64", bits: 64, float: true},
	BF16:    {name: "bf16", st: "BF16", bits: 16, float: true},
	F16:     {name: "f16", st: "F16", bits: 16, float: true},
	E4M3:    {name: "e4m3", st: "F8_E4M3", bits: 8, float: true},
	E5M2:    {name: "e5m2", st: "F8_E5M2", bits: 8, float: true},
	E8M0:    {name: "e8m0", st: "F8_E8M0", bits: 8, float: true},
	FP4:     {name: "fp4", st: "F4", bits: 4, float: true},
	I8:      {name: "i8", st: "I8", bits: 8, signed: true},
	I16:     {name: "i16", st: "I16", bits: 16, signed: true},
	I32:     {name: "i32", st: "I32", bits: 32, signed: true},
	I64:     {name: "i64", st: "I64", bits: 64, signed: true},
	U8:      {name: "u8", st: "U8", bits: 8},
	Bool:    {name: "bool", st: "BOOL", bits: 8},
	U16:     {name: "u16", st: "U16", bits: 16},
	U32:     {name: "u32", st: "U32", bits: 32},
	U64:     {name: "u64", st: "U64", bits: 64},
}

// String is the native dump name of the dtype (f32, bf16, e4m3, ...).
func (d DType) String() string {
	if d >= numDTypes {
		return fmt.Sprintf("dtype(%d)", uint8(d))
	}
	return dtypeTable[d].name
}

// Valid reports whether d is one of the defined element types.
func (d DType) Valid() bool { return d > Invalid && d < numDTypes }

// IsFloat reports whether the dtype decodes with [Record.Float32].
func (d DType) IsFloat() bool { return d.Valid() && dtypeTable[d].float }

// IsInt reports whether the dtype decodes with [Record.Int64] (integers, u8, bool).
func (d DType) IsInt() bool { return d.Valid() && !dtypeTable[d].float }

// Bits is the storage size of one element in bits (4 for FP4).
func (d DType) Bits() int {
	if !d.Valid() {
		return 0
	}
	return dtypeTable[d].bits
}

// SafetensorsName is the dtype string safetensors headers use ("F8_E4M3", ...).
func (d DType) SafetensorsName() string {
	if !d.Valid() {
		return ""
	}
	return dtypeTable[d].st
}

// dtypeNames maps the native names and the lower-case safetensors names to
// their dtype (the first in table order, as ParseDType's table scan did).
var dtypeNames = func() map[string]DType {
	m := map[string]DType{}
	for d := numDTypes - 1; d >= F32; d-- {
		m[strings.ToLower(dtypeTable[d].st)] = d
		m[dtypeTable[d].name] = d
	}
	return m
}()

// ParseDType accepts a native name (f32, bf16, e4m3, ...), a safetensors name
// (F32, BF16, F8_E4M3, ...), or a torch/numpy spelling (float32, bfloat16,
// float8_e4m3fn, float8_e8m0fnu, int64, uint8, ...). Case is ignored.
func ParseDType(s string) (DType, bool) {
	l := strings.ToLower(strings.TrimPrefix(strings.TrimSpace(s), "torch."))
	if d, ok := dtypeNames[l]; ok {
		return d, true
	}
	switch l {
	case "float32", "float", "<f4":
		return F32, true
	case "float64", "double", "<f8":
		return F64, true
	case "bfloat16":
		return BF16, true
	case "float16", "half", "<f2":
		return F16, true
	case "float8_e4m3fn", "f8_e4m3fn", "fp8_e4m3", "e4m3fn":
		return E4M3, true
	case "float8_e5m2", "fp8_e5m2":
		return E5M2, true
	case "float8_e8m0fnu", "ue8m0", "f8_e8m0fnu":
		return E8M0, true
	case "float4_e2m1fn_x2", "e2m1", "mxfp4", "fp4_e2m1":
		return FP4, true
	case "int8", "|i1":
		return I8, true
	case "int16", "<i2":
		return I16, true
	case "int32", "int", "<i4":
		return I32, true
	case "int64", "long", "<i8":
		return I64, true
	case "uint8", "byte", "|u1":
		return U8, true
	case "|b1", "bool_":
		return Bool, true
	case "uint16", "<u2":
		return U16, true
	case "uint32", "<u4":
		return U32, true
	case "uint64", "<u8":
		return U64, true
	}
	return Invalid, false
}

// ByteLen returns the number of bytes n elements of d occupy, or an error when
// n is negative, the size overflows, or (FP4) n is odd.
func (d DType) ByteLen(n int64) (int64, error) {
	if !d.Valid() {
		return 0, fmt.Errorf("invalid dtype %d", uint8(d))
	}
	if n < 0 {
		return 0, fmt.Errorf("negative element count %d", n)
	}
	bits := int64(dtypeTable[d].bits)
	if bits == 4 {
		if n%2 != 0 {
			return 0, fmt.Errorf("fp4 element count %d is odd (two codes per byte)", n)
		}
		return n / 2, nil
	}
	b := bits / 8
	if n > (1<<62)/b {
		return 0, fmt.Errorf("element count %d overflows the byte size", n)
	}
	return n * b, nil
}

// NumElements returns the product of shape, or an error when a dimension is
// negative or the product exceeds 2^62 (so that a header cannot make us
// compute a wrapped size).
func NumElements(shape []int) (int64, error) {
	n := int64(1)
	for i, d := range shape {
		if d < 0 {
			return 0, fmt.Errorf("dimension %d is negative (%d)", i, d)
		}
		if d != 0 && n > (1<<62)/int64(d) {
			return 0, fmt.Errorf("shape %s: element count overflows", userfile.Dims(shape))
		}
		n *= int64(d)
	}
	return n, nil
}
