package engine

// Kind is the element type a stage tensor has in the official code. Values are
// held widened in memory: float kinds as float32 (every bf16 value is exactly an
// fp32), integer kinds as int64.
type Kind uint8

const (
	KindF32  Kind = iota // fp32
	KindBF16             // bfloat16 (values in F are exactly representable in bf16)
	KindI32              // int32 (index lists)
	KindI64              // int64 (top-k indices, positions)
)

// String is the dtype name used in dumps and reports.
func (k Kind) String() string {
	switch k {
	case KindF32:
		return "f32"
	case KindBF16:
		return "bf16"
	case KindI32:
		return "i32"
	case KindI64:
		return "i64"
	}
	return "unknown"
}

// IsFloat reports whether values live in Tensor.F.
func (k Kind) IsFloat() bool { return k == KindF32 || k == KindBF16 }

// Tensor is one stage value in memory, row-major with the innermost axis last
// (PyTorch order, batch and sequence dims of size 1 removed).
type Tensor struct {
	Kind  Kind
	Shape []int
	F     []float32 // float kinds
	I     []int64   // integer kinds
}

// Len is the number of elements the shape names.
func (t Tensor) Len() int {
	n := 1
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// NewF returns a float tensor of the given kind and shape, zero-filled.
func NewF(k Kind, shape ...int) Tensor {
	t := Tensor{Kind: k, Shape: append([]int(nil), shape...)}
	t.F = make([]float32, t.Len())
	return t
}

// FromF wraps data (not copied) as a float tensor of the given kind and shape.
func FromF(k Kind, data []float32, shape ...int) Tensor {
	t := Tensor{Kind: k, Shape: append([]int(nil), shape...), F: data}
	if t.Len() != len(data) {
		panic("engine: FromF shape does not match data length")
	}
	return t
}

// FromI wraps data (not copied) as an integer tensor of the given kind and shape.
func FromI(k Kind, data []int64, shape ...int) Tensor {
	t := Tensor{Kind: k, Shape: append([]int(nil), shape...), I: data}
	if t.Len() != len(data) {
		panic("engine: FromI shape does not match data length")
	}
	return t
}

// Clone returns a deep copy.
func (t Tensor) Clone() Tensor {
	c := Tensor{Kind: t.Kind, Shape: append([]int(nil), t.Shape...)}
	if t.F != nil {
		c.F = append([]float32(nil), t.F...)
	}
	if t.I != nil {
		c.I = append([]int64(nil), t.I...)
	}
	return c
}

// Coord converts a flat row-major index into a coordinate of shape.
func Coord(shape []int, flat int) []int {
	c := make([]int, len(shape))
	for i := len(shape) - 1; i >= 0; i-- {
		if shape[i] > 0 {
			c[i] = flat % shape[i]
			flat /= shape[i]
		}
	}
	return c
}

// SameShape reports whether a and b have identical shapes.
func SameShape(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
