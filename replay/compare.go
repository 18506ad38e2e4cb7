package replay

import (
	"fmt"
	"math"

	"sparsemla/engine"
	"sparsemla/quant"
)

// Metrics are the numbers one comparison of a reference tensor with a GPU tensor
// produces. Every field is computed for every comparison (the tolerance decides
// which of them gate the verdict), so a report can always show them all.
//
// Coordinates are row-major indices into the tensor's shape (PyTorch order).
type Metrics struct {
	N        int   `json:"n"`                   // elements compared
	Mismatch int   `json:"mismatch"`            // elements that are not equal (±0 equal, NaN equals NaN)
	First    []int `json:"first,omitempty"`     // coordinate of the first unequal element
	FirstRef *F64  `json:"first_ref,omitempty"` // reference value there
	FirstGPU *F64  `json:"first_gpu,omitempty"` // GPU value there

	// Float tensors only.
	MaxAbs    float64 `json:"max_abs"`              // max |gpu - ref| over finite pairs
	MaxAbsAt  []int   `json:"max_abs_at,omitempty"` // its coordinate
	MaxAbsRef F64     `json:"max_abs_ref"`          // reference value there
	MaxAbsGPU F64     `json:"max_abs_gpu"`          // GPU value there
	MeanAbs   float64 `json:"mean_abs"`             // mean |gpu - ref| over finite pairs
	CosDiff   float64 `json:"cos_diff"`             // 1 - 2<x,y>/(|x|²+|y|²), fp64, 0 for two zero tensors
	MaxULP    int64   `json:"max_ulp"`              // max bf16 ulp distance over finite pairs
	MaxULPAt  []int   `json:"max_ulp_at,omitempty"` // its coordinate (the first element with that distance)
	MaxULPRef F64     `json:"max_ulp_ref"`          // reference value there
	MaxULPGPU F64     `json:"max_ulp_gpu"`          // GPU value there
	ULPOver   int     `json:"ulp_over"`             // elements whose ulp distance exceeds the stage's allowance
	CloseFail int     `json:"close_fail"`           // elements failing abs-or-rel (close mode)

	// Non-finite patterns (FlashMLA compares them before anything else).
	RefNaN int `json:"ref_nan"`
	GPUNaN int `json:"gpu_nan"`
	RefInf int `json:"ref_inf"`
	GPUInf int `json:"gpu_inf"`
	// NonFiniteRows lists the leading-axis indices (heads, rows) where the GPU
	// has NaN/inf and the reference does not, or the other way round (at most 16).
	NonFiniteRows []int `json:"nonfinite_rows,omitempty"`
}

// F64 is a float64 that survives JSON when it is NaN or ±inf (as the strings
// "NaN", "+Inf", "-Inf"); finite values are plain JSON numbers.
type F64 float64

// MarshalJSON writes finite values as numbers and the rest as strings.
func (f F64) MarshalJSON() ([]byte, error) {
	v := float64(f)
	switch {
	case math.IsNaN(v):
		return []byte(`"NaN"`), nil
	case math.IsInf(v, 1):
		return []byte(`"+Inf"`), nil
	case math.IsInf(v, -1):
		return []byte(`"-Inf"`), nil
	}
	return []byte(fmt.Sprintf("%g", v)), nil
}

// UnmarshalJSON reads what MarshalJSON writes.
func (f *F64) UnmarshalJSON(b []byte) error {
	switch string(b) {
	case `"NaN"`:
		*f = F64(math.NaN())
		return nil
	case `"+Inf"`:
		*f = F64(math.Inf(1))
		return nil
	case `"-Inf"`:
		*f = F64(math.Inf(-1))
		return nil
	}
	var v float64
	if _, err := fmt.Sscan(string(b), &v); err != nil {
		return fmt.Errorf("replay: bad number %s", b)
	}
	*f = F64(v)
	return nil
}

// CosDiff is the DeepGEMM/FlashMLA similarity distance
//
//	cos_diff = 1 - 2·Σ x_i·y_i / (Σ x_i² + Σ y_i²)
//
// accumulated in fp64 in index order. It is 0 for equal tensors, 1 for orthogonal
// ones and 2 for y = -x. When the reference is (almost) zero (Σ x² < 1e-12) it is 0,
// as in FlashMLA's get_cos_diff. Non-finite pairs are skipped.
func CosDiff(ref, gpu []float32) float64 {
	if len(ref) != len(gpu) {
		panic("replay: CosDiff length mismatch")
	}
	var xy, xx, yy float64
	for i := range ref {
		x, y := float64(ref[i]), float64(gpu[i])
		if math.IsNaN(x) || math.IsNaN(y) || math.IsInf(x, 0) || math.IsInf(y, 0) {
			continue
		}
		xy += x * y
		xx += x * x
		yy += y * y
	}
	if xx < 1e-12 {
		return 0
	}
	return 1 - 2*xy/(xx+yy)
}

// finite reports whether v is neither NaN nor ±inf (exponent not all ones).
func finite(v float32) bool { return math.Float32bits(v)&0x7F800000 != 0x7F800000 }

// equalValue is value equality with ±0 equal and NaN equal to NaN (the two
// patterns are compared separately).
func equalValue(a, b float32) bool {
	if a != a || b != b {
		return a != a && b != b
	}
	return a == b
}

// identicalFinite reports whether a and b (same length) hold the same
// bits, all finite, and returns Σ f64(a_i)² in index order (CosDiff's sums
// of such a pair: x·y = x·x = y·y). It is branch-free per element (a
// bitwise OR of the differences, a count of all-ones exponents) and takes
// four elements a turn: under the fuzzer's instrumentation, where every
// comparison is a call, it is several times cheaper than CompareFloat's
// loop, and most compared tensors of a replay are identical.
func identicalFinite(a, b []float32) (bool, float64) {
	b = b[:len(a)]
	var diff, nonFinite uint32
	var ss float64
	bits := func(x, y float32) {
		xb := math.Float32bits(x)
		diff |= xb ^ math.Float32bits(y)
		nonFinite += (xb>>23&0xFF + 1) >> 8 // 1 for exponent 0xFF
	}
	i := 0
	for ; i+4 <= len(a); i += 4 {
		a4, b4 := a[i:i+4:i+4], b[i:i+4:i+4]
		bits(a4[0], b4[0])
		bits(a4[1], b4[1])
		bits(a4[2], b4[2])
		bits(a4[3], b4[3])
		x0, x1, x2, x3 := float64(a4[0]), float64(a4[1]), float64(a4[2]), float64(a4[3])
		ss += x0 * x0
		ss += x1 * x1
		ss += x2 * x2
		ss += x3 * x3
	}
	for ; i < len(a); i++ {
		bits(a[i], b[i])
		x := float64(a[i])
		ss += x * x
	}
	return diff == 0 && nonFinite == 0, ss
}

// CompareFloat measures gpu against ref (same shape, float kinds) under tol. It
// never fails; the verdict is Tolerance.Judge's.
//
// One pass over the elements. A pair with the same finite bits (most pairs
// of a replay) takes a short path with the same effect as the full one: d = 0,
// ulp distance 0, the close test of d = 0 (decided once), and its terms of
// CosDiff's sums in the same order.
func CompareFloat(ref, gpu engine.Tensor, tol StageTol, gpuTable bool) Metrics {
	if !engine.SameShape(ref.Shape, gpu.Shape) {
		panic("replay: CompareFloat shape mismatch")
	}
	m := Metrics{N: len(ref.F)}
	var sumAbs float64
	var xy, xx, yy float64 // CosDiff's sums over finite pairs, index order
	nFinite := 0
	first := -1
	maxAt := -1
	ulpAt := -1 // element of MaxULP
	nfRows := map[int]bool{}
	rowLen := 1
	if len(ref.Shape) > 1 {
		rowLen = len(ref.F) / max(ref.Shape[0], 1)
	}
	allowed := int64(tol.allowedULP(gpuTable))
	equalULPOver := 0 > allowed          // an identical pair is 0 ulps apart
	equalClose := tol.elementClose(0, 0) // elementClose of d = 0 does not depend on the value
	gf := gpu.F[:len(ref.F)]
	if same, ss := identicalFinite(ref.F, gf); same {
		// Every pair has the same finite bits: the loop below would take
		// its short path for each, with x·y = x·x = y·y.
		if equalULPOver {
			m.ULPOver = len(ref.F)
		}
		if !equalClose {
			m.CloseFail = len(ref.F)
		}
		if ss >= 1e-12 { // MeanAbs and MaxAbs stay 0
			m.CosDiff = 1 - 2*ss/(ss+ss)
		}
		return m
	}
	for i, x := range ref.F {
		y := gf[i]
		if xb := math.Float32bits(x); xb == math.Float32bits(y) && xb&0x7F800000 != 0x7F800000 {
			// identical finite pair: d = 0 adds nothing to sumAbs
			nFinite++
			if maxAt < 0 {
				maxAt = i // MaxAbs stays 0
			}
			if equalULPOver {
				m.ULPOver++
			}
			if !equalClose {
				m.CloseFail++
			}
			x, y := float64(x), float64(y)
			xy += x * y
			xx += x * x
			yy += y * y
			continue
		}
		xf, yf := finite(x), finite(y)
		if x != x {
			m.RefNaN++
		} else if !xf {
			m.RefInf++
		}
		if y != y {
			m.GPUNaN++
		} else if !yf {
			m.GPUInf++
		}
		if !equalValue(x, y) {
			m.Mismatch++
			if first < 0 {
				first = i
			}
		}
		if xf != yf || (!xf && !equalValue(x, y)) {
			if len(nfRows) < 16 && len(ref.Shape) > 0 {
				nfRows[i/max(rowLen, 1)] = true
			}
			continue
		}
		if !xf {
			continue
		}
		d := math.Abs(float64(y) - float64(x))
		sumAbs += d
		nFinite++
		if maxAt < 0 || d > m.MaxAbs {
			m.MaxAbs = d
			maxAt = i
		}
		u := int64(quant.BF16ULPDistance(x, y))
		if u > m.MaxULP {
			m.MaxULP = u
			ulpAt = i
		}
		if u > allowed {
			m.ULPOver++
		}
		if !tol.elementClose(float64(x), float64(y)) {
			m.CloseFail++
		}
		xd, yd := float64(x), float64(y)
		xy += xd * yd
		xx += xd * xd
		yy += yd * yd
	}
	if nFinite > 0 {
		m.MeanAbs = sumAbs / float64(nFinite)
	}
	if maxAt >= 0 && m.MaxAbs > 0 {
		m.MaxAbsAt = engine.Coord(ref.Shape, maxAt)
		m.MaxAbsRef = F64(ref.F[maxAt])
		m.MaxAbsGPU = F64(gpu.F[maxAt])
	}
	if ulpAt >= 0 {
		m.MaxULPAt = engine.Coord(ref.Shape, ulpAt)
		m.MaxULPRef, m.MaxULPGPU = F64(ref.F[ulpAt]), F64(gpu.F[ulpAt])
	}
	if first >= 0 {
		m.First = engine.Coord(ref.Shape, first)
		r, g := F64(ref.F[first]), F64(gpu.F[first])
		m.FirstRef, m.FirstGPU = &r, &g
	}
	if xx >= 1e-12 { // CosDiff(ref.F, gpu.F), from the same sums
		m.CosDiff = 1 - 2*xy/(xx+yy)
	}
	for r := range nfRows {
		m.NonFiniteRows = append(m.NonFiniteRows, r)
	}
	sortInts(m.NonFiniteRows)
	return m
}

// CompareInt measures two integer tensors element by element (exact).
func CompareInt(ref, gpu engine.Tensor) Metrics {
	if !engine.SameShape(ref.Shape, gpu.Shape) {
		panic("replay: CompareInt shape mismatch")
	}
	m := Metrics{N: len(ref.I)}
	for i := range ref.I {
		if ref.I[i] != gpu.I[i] {
			m.Mismatch++
			if m.First == nil {
				m.First = engine.Coord(ref.Shape, i)
				r, g := F64(ref.I[i]), F64(gpu.I[i])
				m.FirstRef, m.FirstGPU = &r, &g
			}
			d := math.Abs(float64(gpu.I[i] - ref.I[i]))
			if d > m.MaxAbs {
				m.MaxAbs = d
				m.MaxAbsAt = engine.Coord(ref.Shape, i)
				m.MaxAbsRef, m.MaxAbsGPU = F64(ref.I[i]), F64(gpu.I[i])
			}
		}
	}
	return m
}

// sortInts is an insertion sort (the lists are short) that keeps this file free
// of a sort import for one call.
func sortInts(v []int) {
	for i := 1; i < len(v); i++ {
		for j := i; j > 0 && v[j] < v[j-1]; j-- {
			v[j], v[j-1] = v[j-1], v[j]
		}
	}
}

// RowDiff lists the leading-axis rows (e.g. cache rows, heads) in which ref and
// gpu differ at all, in ascending order, at most limit of them (limit <= 0: all).
// Tensors of different shapes, or of which one is float and the other
// integer (a GPU record of another dtype), or whose values do not fill
// their shape, have no rows to compare: nil.
func RowDiff(ref, gpu engine.Tensor, limit int) []int {
	if !engine.SameShape(ref.Shape, gpu.Shape) || len(ref.Shape) == 0 || ref.Shape[0] == 0 {
		return nil
	}
	n := ref.Len()
	if ref.Kind.IsFloat() != gpu.Kind.IsFloat() ||
		(ref.Kind.IsFloat() && (len(ref.F) < n || len(gpu.F) < n)) ||
		(!ref.Kind.IsFloat() && (len(ref.I) < n || len(gpu.I) < n)) {
		return nil
	}
	rows := ref.Shape[0]
	w := n / rows
	var out []int
	for r := 0; r < rows; r++ {
		for k := r * w; k < (r+1)*w; k++ {
			var eq bool
			if ref.Kind.IsFloat() {
				eq = equalValue(ref.F[k], gpu.F[k])
			} else {
				eq = ref.I[k] == gpu.I[k]
			}
			if !eq {
				out = append(out, r)
				break
			}
		}
		if limit > 0 && len(out) >= limit {
			break
		}
	}
	return out
}
