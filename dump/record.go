package dump

import (
	"encoding/binary"
	"fmt"
	"math"

	"sparsemla/quant"
	"sparsemla/userfile"
)

// Global is the layer number of records that belong to no layer (pos, tok,
// logits, RoPE tables).
const Global = -1

// NoStep marks a record that belongs to no decode step (weights, tables).
const NoStep = -1

// MaxKeyString bounds, in bytes, a key's request and stage names and a
// prefix hit's request and source. Real ones are a few dozen bytes; the
// bound keeps every message that names a key short, whatever a file holds.
const MaxKeyString = 1024

// checkName refuses a name (what: "request", "stage", "source") longer than
// MaxKeyString.
func checkName(what, s string) error {
	if len(s) > MaxKeyString {
		return fmt.Errorf("%s name %s is over %d bytes", what, userfile.Quote(s), MaxKeyString)
	}
	return nil
}

// checkStrings refuses a request or stage name longer than MaxKeyString.
func (k Key) checkStrings() error {
	if err := checkName("request", k.Request); err != nil {
		return err
	}
	return checkName("stage", k.Stage)
}

// Key names one tensor of a replay: request, decode step (the absolute
// position p of the token decoded), layer ([Global] = -1 for none) and the
// canonical stage name (see [Stages]).
type Key struct {
	Request string `msgpack:"request"`
	Step    int    `msgpack:"step"`
	Layer   int    `msgpack:"layer"`
	Stage   string `msgpack:"stage"`
}

// String prints the key as request/step/layer/stage, e.g. "r0/p7/L2/kv".
func (k Key) String() string {
	req := k.Request
	if req == "" {
		req = "-"
	}
	step := "p-"
	if k.Step != NoStep {
		step = fmt.Sprintf("p%d", k.Step)
	}
	layer := "G"
	if k.Layer != Global {
		layer = fmt.Sprintf("L%d", k.Layer)
	}
	return req + "/" + step + "/" + layer + "/" + k.Stage
}

// Kind says what a record holds.
type Kind uint8

const (
	// KindStage is the value of a stage computed during decode step Key.Step.
	KindStage Kind = iota
	// KindState is cache or compressor state a replay starts from. Its
	// Key.Step is the step it is valid AFTER (the step before the first
	// replayed one, or the last prefill position S-1), so a replay that starts
	// at step p loads the state records with Step = p-1.
	KindState
	// KindTable is a table the GPU built (RoPE cos/sin, ...), Step = NoStep.
	KindTable
	// KindPage is raw KV page bytes (see Record.Page).
	KindPage
	// KindWeight is a model parameter (name in Record.Name).
	KindWeight
	numKinds
)

var kindNames = [numKinds]string{"stage", "state", "table", "page", "weight"}

func (k Kind) String() string {
	if k < numKinds {
		return kindNames[k]
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// ParseKind is the inverse of Kind.String.
func ParseKind(s string) (Kind, bool) {
	for k, n := range kindNames {
		if n == s {
			return Kind(k), true
		}
	}
	return 0, false
}

// PageInfo describes a KV page record: which layout its bytes follow and the
// block table that maps the request's logical blocks to physical pages.
type PageInfo struct {
	Layout     string `msgpack:"layout"`      // one of the Layout* constants
	PageID     int    `msgpack:"page_id"`     // physical page number of this record
	BlockSize  int    `msgpack:"block_size"`  // tokens per page
	BlockTable []int  `msgpack:"block_table"` // logical block -> physical page, for Key.Request
}

// KV page layout ids (bytes per token; spec tools-and-formats.md §2.1).
const (
	LayoutV4Model1   = "v4-model1"   // 584 B/token: 448 e4m3 + 64 bf16 rope + 7 ue8m0 scales + pad
	LayoutV32        = "v32"         // 656 B/token: 512 e4m3 + 4 f32 scales + 64 bf16 rope
	LayoutIndexerFP8 = "indexer-fp8" // 132 B/token: 128 e4m3 + 1 f32 scale
	LayoutMXFP4      = "mxfp4"       // 68 B/token: 64 packed fp4 + 4 ue8m0 scales
	LayoutBF16       = "bf16"        // 1024 B/token: 512 bf16
)

// Record is one tensor: its key, where it came from, and its raw little-endian
// bytes. Data is row-major with the innermost axis last (PyTorch order).
type Record struct {
	Key
	Kind  Kind
	Name  string // name in the source file (safetensors key, npz member, official weight name)
	DType DType
	Shape []int
	Data  []byte
	Page  *PageInfo // KindPage only
}

// Len is the number of elements the shape names (panics on a negative
// dimension; records from readers are validated).
func (r *Record) Len() int {
	n, err := NumElements(r.Shape)
	if err != nil {
		panic("dump: Record.Len: " + err.Error())
	}
	return int(n)
}

// Check verifies that the dtype is valid and the shape agrees with len(Data).
func (r *Record) Check() error {
	if err := r.Key.checkStrings(); err != nil {
		return err
	}
	if !r.DType.Valid() {
		return fmt.Errorf("invalid dtype %d", uint8(r.DType))
	}
	n, err := NumElements(r.Shape)
	if err != nil {
		return err
	}
	want, err := r.DType.ByteLen(n)
	if err != nil {
		return fmt.Errorf("shape %s %s: %w", userfile.Dims(r.Shape), r.DType, err)
	}
	if want != int64(len(r.Data)) {
		return fmt.Errorf("shape %s %s needs %d bytes, record has %d", userfile.Dims(r.Shape), r.DType, want, len(r.Data))
	}
	return nil
}

// Float32 decodes a float record (f32, f64, bf16, f16, e4m3, e5m2, e8m0, fp4)
// to fp32 values. bf16, f16 and the fp8/fp4 formats widen exactly; f64 is
// rounded to nearest fp32. Integer dtypes are an error (use Int64).
func (r *Record) Float32() ([]float32, error) {
	if err := r.Check(); err != nil {
		return nil, fmt.Errorf("dump: %s: %w", r.label(), err)
	}
	if !r.DType.IsFloat() {
		return nil, fmt.Errorf("dump: %s: dtype %s is not a float type", r.label(), r.DType)
	}
	out := make([]float32, r.Len())
	decodeFloat(out, r.DType, r.Data)
	return out, nil
}

// decodeFloat widens the raw bytes b of float dtype d into dst (len(dst)
// elements).
func decodeFloat(dst []float32, d DType, b []byte) {
	le := binary.LittleEndian
	switch d {
	case F32:
		// Four elements a turn (here and for bf16): under the fuzzer's
		// instrumentation every loop test is a call.
		b = b[:4*len(dst)] // one bounds check for the loop
		i := 0
		for ; i+4 <= len(dst); i += 4 {
			d4, b16 := dst[i:i+4:i+4], b[4*i:4*i+16:4*i+16]
			d4[0] = math.Float32frombits(le.Uint32(b16[0:]))
			d4[1] = math.Float32frombits(le.Uint32(b16[4:]))
			d4[2] = math.Float32frombits(le.Uint32(b16[8:]))
			d4[3] = math.Float32frombits(le.Uint32(b16[12:]))
		}
		for ; i < len(dst); i++ {
			dst[i] = math.Float32frombits(le.Uint32(b[4*i:]))
		}
	case F64:
		for i := range dst {
			dst[i] = float32(math.Float64frombits(le.Uint64(b[8*i:])))
		}
	case BF16:
		b = b[:2*len(dst)]
		i := 0
		for ; i+4 <= len(dst); i += 4 {
			d4, b8 := dst[i:i+4:i+4], b[2*i:2*i+8:2*i+8]
			d4[0] = quant.BF16ToF32(uint16(b8[0]) | uint16(b8[1])<<8)
			d4[1] = quant.BF16ToF32(uint16(b8[2]) | uint16(b8[3])<<8)
			d4[2] = quant.BF16ToF32(uint16(b8[4]) | uint16(b8[5])<<8)
			d4[3] = quant.BF16ToF32(uint16(b8[6]) | uint16(b8[7])<<8)
		}
		for ; i < len(dst); i++ {
			dst[i] = quant.BF16ToF32(uint16(b[2*i]) | uint16(b[2*i+1])<<8)
		}
	case F16:
		for i := range dst {
			dst[i] = quant.F16ToF32(le.Uint16(b[2*i:]))
		}
	case E4M3:
		for i := range dst {
			dst[i] = quant.DecodeE4M3(b[i])
		}
	case E5M2:
		for i := range dst {
			dst[i] = quant.DecodeE5M2(b[i])
		}
	case E8M0:
		for i := range dst {
			dst[i] = quant.DecodeUE8M0(b[i])
		}
	case FP4:
		for i := range dst {
			c := b[i/2]
			if i%2 == 1 {
				c >>= 4
			}
			dst[i] = quant.DecodeE2M1(c & 0xf)
		}
	default:
		panic("dump: decodeFloat of a non-float dtype")
	}
}

// Int64 decodes an integer record (i8, i16, i32, i64, u8, u16, u32, u64,
// bool) to int64 (u64 wraps).
// Float dtypes are an error (use Float32).
func (r *Record) Int64() ([]int64, error) {
	if err := r.Check(); err != nil {
		return nil, fmt.Errorf("dump: %s: %w", r.label(), err)
	}
	if !r.DType.IsInt() {
		return nil, fmt.Errorf("dump: %s: dtype %s is not an integer type", r.label(), r.DType)
	}
	out := make([]int64, r.Len())
	decodeInt(out, r.DType, r.Data)
	return out, nil
}

func decodeInt(dst []int64, d DType, b []byte) {
	le := binary.LittleEndian
	switch d {
	case I8:
		for i := range dst {
			dst[i] = int64(int8(b[i]))
		}
	case U8, Bool:
		for i := range dst {
			dst[i] = int64(b[i])
		}
	case I16:
		for i := range dst {
			dst[i] = int64(int16(le.Uint16(b[2*i:])))
		}
	case U16:
		for i := range dst {
			dst[i] = int64(le.Uint16(b[2*i:]))
		}
	case U32:
		for i := range dst {
			dst[i] = int64(le.Uint32(b[4*i:]))
		}
	case U64:
		for i := range dst {
			dst[i] = int64(le.Uint64(b[8*i:]))
		}
	case I32:
		for i := range dst {
			dst[i] = int64(int32(le.Uint32(b[4*i:])))
		}
	case I64:
		for i := range dst {
			dst[i] = int64(le.Uint64(b[8*i:]))
		}
	default:
		panic("dump: decodeInt of a non-integer dtype")
	}
}

func (r *Record) label() string {
	if r.Name != "" && r.Stage == "" {
		return userfile.Clip(r.Name)
	}
	if r.Name != "" && r.Name != r.Stage {
		return clipKey(r.Key) + " (" + userfile.Clip(r.Name) + ")"
	}
	return clipKey(r.Key)
}

// clipKey is k.String() for an error message: its request and stage (from
// the input, up to a frame's megabyte of meta) cut by userfile.Clip, so a
// normal key prints as k.String() does.
func clipKey(k Key) string {
	k.Request, k.Stage = userfile.Clip(k.Request), userfile.Clip(k.Stage)
	return k.String()
}

// Stats are summary statistics of a record's values.
type Stats struct {
	N        int64
	Min, Max float64 // over finite values; NaN when there are none
	Mean     float64 // over finite values
	NaN, Inf int64
}

// Stats computes min/max/mean and NaN/inf counts without allocating a copy of
// the values. The record must pass Check.
func (r *Record) Stats() (Stats, error) {
	if err := r.Check(); err != nil {
		return Stats{}, fmt.Errorf("dump: %s: %w", r.label(), err)
	}
	s := Stats{Min: math.Inf(1), Max: math.Inf(-1)}
	var sum float64
	var finite int64
	add := func(v float64) {
		s.N++
		switch {
		case math.IsNaN(v):
			s.NaN++
		case math.IsInf(v, 0):
			s.Inf++
		default:
			finite++
			sum += v
			s.Min = math.Min(s.Min, v)
			s.Max = math.Max(s.Max, v)
		}
	}
	n := r.Len()
	var buf [256]float32
	var ibuf [256]int64
	for i := 0; i < n; i += len(buf) {
		m := min(len(buf), n-i)
		if r.DType.IsFloat() {
			lo, hi := byteRange(r.DType, i, m)
			chunk := buf[:m]
			if r.DType == FP4 {
				// i is a multiple of 256, so the chunk starts on a byte boundary.
				decodeFloat(chunk, FP4, r.Data[lo:hi])
			} else {
				decodeFloat(chunk, r.DType, r.Data[lo:hi])
			}
			for _, v := range chunk {
				add(float64(v))
			}
		} else {
			lo, hi := byteRange(r.DType, i, m)
			chunk := ibuf[:m]
			decodeInt(chunk, r.DType, r.Data[lo:hi])
			for _, v := range chunk {
				add(float64(v))
			}
		}
	}
	if finite > 0 {
		s.Mean = sum / float64(finite)
	} else {
		s.Min, s.Max, s.Mean = math.NaN(), math.NaN(), math.NaN()
	}
	return s, nil
}

// byteRange returns the byte span of m elements starting at element i.
func byteRange(d DType, i, m int) (lo, hi int) {
	bits := d.Bits()
	lo = i * bits / 8
	hi = (i*bits + m*bits + 7) / 8
	return lo, hi
}
