package replay

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sparsemla/engine"
	"sparsemla/quant"
)

// TestCosDiff: hand-checkable values of 1 − 2⟨x,y⟩/(‖x‖²+‖y‖²).
func TestCosDiff(t *testing.T) {
	cases := []struct {
		x, y []float32
		want float64
	}{
		{[]float32{1, 0}, []float32{1, 0}, 0},                   // identical
		{[]float32{1, 0}, []float32{0, 1}, 1},                   // orthogonal: 1 − 0/2
		{[]float32{1, 2}, []float32{-1, -2}, 2},                 // opposite: 1 − 2·(−5)/10
		{[]float32{2, 0}, []float32{1, 0}, 0.2},                 // 1 − 2·2/(4+1)
		{[]float32{0, 0}, []float32{3, 4}, 0},                   // zero reference: 0 by convention
		{[]float32{1, float32(math.NaN())}, []float32{1, 5}, 0}, // non-finite pairs skipped
	}
	for _, c := range cases {
		if got := CosDiff(c.x, c.y); math.Abs(got-c.want) > 1e-12 {
			t.Errorf("CosDiff(%v, %v) = %g, want %g", c.x, c.y, got, c.want)
		}
	}
}

// TestCompareFloatMetrics checks each metric on a 2x3 tensor with one bf16-ulp
// change at [1 2] and one NaN where the reference is finite at [0 1].
func TestCompareFloatMetrics(t *testing.T) {
	ref := engine.FromF(engine.KindBF16, []float32{1, 2, 3, 4, 5, 6}, 2, 3)
	gpu := ref.Clone()
	gpu.F[5] = quant.BF16Next(6, 1) // 6 + 2^-5: one bf16 ulp above 6
	m := CompareFloat(ref, gpu, StageTol{Mode: TolULP}, true)
	if m.Mismatch != 1 || m.MaxULP != 1 || m.ULPOver != 1 || m.MaxAbs != 0.03125 || len(m.MaxAbsAt) != 2 || m.MaxAbsAt[0] != 1 || m.MaxAbsAt[1] != 2 {
		t.Fatalf("metrics %+v", m)
	}
	if ok, _ := (StageTol{Mode: TolULP, MaxULP: 1}).Judge(m, true); !ok {
		t.Error("1 ulp must pass max_ulp 1")
	}
	if ok, why := (StageTol{Mode: TolULP}).Judge(m, true); ok || !strings.Contains(why, "1 bf16 ulps") {
		t.Errorf("1 ulp must fail max_ulp 0: %q", why)
	}
	// RoPE stages without the GPU's table get max_ulp_no_gpu_table.
	rope := StageTol{Mode: TolULP, MaxULP: 0, MaxULPNoTable: 1}
	if ok, _ := rope.Judge(CompareFloat(ref, gpu, rope, false), false); !ok {
		t.Error("RoPE stage without GPU table must allow 1 ulp")
	}
	gpu.F[1] = float32(math.NaN())
	m = CompareFloat(ref, gpu, StageTol{Mode: TolClose, Abs: 1, Rel: 1, Cos: 1}, true)
	if m.GPUNaN != 1 || len(m.NonFiniteRows) != 1 || m.NonFiniteRows[0] != 0 {
		t.Fatalf("NaN pattern %+v", m)
	}
	if ok, why := (StageTol{Mode: TolClose, Abs: 1, Rel: 1, Cos: 1}).Judge(m, true); ok || !strings.Contains(why, "NaN") {
		t.Errorf("a GPU NaN must fail whatever the tolerance: %q", why)
	}
}

// TestCloseMode: FlashMLA's rule, an element passes on abs OR rel.
func TestCloseMode(t *testing.T) {
	st := DefaultTolerance().For("o") // abs 1e-3, rel 2.01/128, cos 5e-6
	ref := engine.FromF(engine.KindBF16, []float32{100, 0.0001}, 2)
	gpu := engine.FromF(engine.KindBF16, []float32{101, 0.0009}, 2) // rel 1% (< 1.57%) and abs 8e-4 (< 1e-3)
	m := CompareFloat(ref, gpu, st, true)
	if m.CloseFail != 0 {
		t.Fatalf("close_fail %d, want 0", m.CloseFail)
	}
	if ok, why := st.Judge(m, true); ok || !strings.Contains(why, "cos_diff") {
		t.Fatalf("cos_diff 5e-5 must fail 5e-6: %v %q (cos %g)", ok, why, m.CosDiff)
	}
}

func TestToleranceOverrides(t *testing.T) {
	tol := DefaultTolerance()
	dir := t.TempDir()
	good := filepath.Join(dir, "tol.json")
	os.WriteFile(good, []byte(`{"stages": {"u": {"mode": "ulp", "max_ulp": 3}}, "fallback": {"mode": "close", "abs": 1, "cos": 0.1}}`), 0o644)
	if err := tol.LoadToleranceFile(good); err != nil {
		t.Fatal(err)
	}
	if st := tol.For("u"); st.Mode != TolULP || st.MaxULP != 3 {
		t.Errorf("u: %+v", st)
	}
	if st := tol.For("no_such_stage"); st.Mode != TolClose {
		t.Errorf("fallback: %+v", st)
	}
	name, st, err := ParseStageTol("o=close,abs=2e-3,rel=0.02,cos=1e-5")
	if err != nil || name != "o" || st.Abs != 2e-3 || st.Rel != 0.02 || st.Cos != 1e-5 {
		t.Errorf("ParseStageTol: %q %+v %v", name, st, err)
	}
	for _, bad := range []string{`{"stages": {"o": {"mode": "fuzzy"}}}`, `{"stagez": {}}`, `{"stages": {"o": {"mode": "ulp", "maxulp": 2}}}`, `not json`} {
		p := filepath.Join(dir, "bad.json")
		os.WriteFile(p, []byte(bad), 0o644)
		if err := DefaultTolerance().LoadToleranceFile(p); err == nil || !strings.Contains(err.Error(), p) {
			t.Errorf("%s: error %v, want one naming the file", bad, err)
		}
	}
	for _, bad := range []string{"o", "o=fuzzy", "o=close,abs", "o=close,abs=x", "o=ulp,frob=1"} {
		if _, _, err := ParseStageTol(bad); err == nil {
			t.Errorf("ParseStageTol(%q): no error", bad)
		}
	}
}

// An unknown stage name is quoted in the error at most maxQuoted bytes long,
// with its length, and the "did you mean" search skips names whose length
// rules them out (a 1 MiB name once took seconds and echoed 1 MB into the
// error line); a near miss still gets its hint.
func TestToleranceUnknownStageErrors(t *testing.T) {
	long := strings.Repeat("q", 1<<20)
	p := filepath.Join(t.TempDir(), "tol.json")
	os.WriteFile(p, []byte(`{"stages": {"`+long+`": {"mode": "exact"}}}`), 0o644)
	err := DefaultTolerance().LoadToleranceFile(p)
	if err == nil || len(err.Error()) > 400 || !strings.Contains(err.Error(), "(1048576 bytes)") {
		t.Errorf("1 MiB stage name: error of %d bytes, want a short one giving the length", len(fmt.Sprint(err)))
	}
	_, _, err = ParseStageTol(long + "=exact")
	if err == nil || len(err.Error()) > 400 {
		t.Errorf("--tol-stage with a 1 MiB name: error of %d bytes, want a short one", len(fmt.Sprint(err)))
	}
	if _, _, err := ParseStageTol("kv_cachee=exact"); err == nil || !strings.Contains(err.Error(), `did you mean "kv_cache"?`) {
		t.Errorf("near miss: %v, want a hint naming kv_cache", err)
	}
}

// compareFloatPlain is CompareFloat as first written (two passes, no short
// path for identical pairs), kept to test the one-pass form against.
func compareFloatPlain(ref, gpu engine.Tensor, tol StageTol, gpuTable bool) Metrics {
	if !engine.SameShape(ref.Shape, gpu.Shape) {
		panic("replay: CompareFloat shape mismatch")
	}
	m := Metrics{N: len(ref.F)}
	var sumAbs float64
	nFinite := 0
	first := -1
	maxAt := -1
	ulpAt := -1
	nfRows := map[int]bool{}
	rowLen := 1
	if len(ref.Shape) > 1 {
		rowLen = len(ref.F) / max(ref.Shape[0], 1)
	}
	for i := range ref.F {
		x, y := ref.F[i], gpu.F[i]
		xf, yf := finitePlain(x), finitePlain(y)
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
		if u > int64(tol.allowedULP(gpuTable)) {
			m.ULPOver++
		}
		if !tol.elementClose(float64(x), float64(y)) {
			m.CloseFail++
		}
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
	m.CosDiff = CosDiff(ref.F, gpu.F)
	for r := range nfRows {
		m.NonFiniteRows = append(m.NonFiniteRows, r)
	}
	sortInts(m.NonFiniteRows)
	return m
}

func finitePlain(v float32) bool { return !math.IsNaN(float64(v)) && !math.IsInf(float64(v), 0) }

// TestCompareFloatOnePass: CompareFloat gives exactly compareFloatPlain's
// metrics on tensors mixing identical pairs, near and far values, ±0, NaN
// and ±inf (all identical and finite in some), under every tolerance mode (including a close tolerance of 0,
// where even identical elements fail, and a negative ulp allowance).
func TestCompareFloatOnePass(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	special := []float32{0, float32(math.Copysign(0, -1)), float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1)), 1e-30, 3.5}
	tols := []StageTol{
		{Mode: TolExact}, {Mode: TolULP, MaxULP: 1}, {Mode: TolULP, MaxULP: -1},
		{Mode: TolClose, Abs: 1e-3, Rel: 0.02}, {Mode: TolClose},
	}
	for trial := 0; trial < 200; trial++ {
		n := 1 + rng.IntN(300)
		ref, gpu := make([]float32, n), make([]float32, n)
		for i := range ref {
			ref[i] = float32(rng.NormFloat64())
			switch rng.IntN(6) {
			case 0, 1, 2:
				gpu[i] = ref[i]
			case 3:
				gpu[i] = ref[i] * (1 + float32(rng.NormFloat64())*1e-3)
			case 4:
				gpu[i] = special[rng.IntN(len(special))]
			default:
				ref[i] = special[rng.IntN(len(special))]
				gpu[i] = ref[i]
				if rng.IntN(2) == 0 {
					gpu[i] = special[rng.IntN(len(special))]
				}
			}
		}
		if trial%7 == 0 { // all identical
			copy(gpu, ref)
		}
		if trial%7 == 1 { // all identical and finite (CompareFloat's whole-tensor short path)
			for i := range ref {
				ref[i] = []float32{float32(rng.NormFloat64()), 0, float32(math.Copysign(0, -1)), 1e-30}[rng.IntN(4)]
				if trial%2 == 0 {
					ref[i] = ref[i] * 1e-20 // CosDiff's sums below 1e-12
				}
			}
			copy(gpu, ref)
		}
		shape := []int{n}
		if n%4 == 0 {
			shape = []int{4, n / 4}
		}
		a, b := engine.FromF(engine.KindF32, ref, shape...), engine.FromF(engine.KindF32, gpu, shape...)
		for _, tol := range tols {
			for _, table := range []bool{true, false} {
				got, want := CompareFloat(a, b, tol, table), compareFloatPlain(a, b, tol, table)
				gj, _ := json.Marshal(got)
				wj, _ := json.Marshal(want)
				if string(gj) != string(wj) || math.Float64bits(got.CosDiff) != math.Float64bits(want.CosDiff) || math.Float64bits(got.MeanAbs) != math.Float64bits(want.MeanAbs) {
					t.Fatalf("trial %d tol %+v: one pass\n%s\nplain\n%s", trial, tol, gj, wj)
				}
			}
		}
	}
}

// The ulp sentence of a failing ulp stage takes the distance, coordinate and
// values from one element: here the largest absolute error (element 0, a
// large value off by one ulp) and the largest ulp distance (element 2, a
// small value off by 8 ulps) are different elements.
func TestULPReasonOneElement(t *testing.T) {
	ref := engine.FromF(engine.KindBF16, []float32{1024, 1, 0.5, 2}, 4)
	gpu := engine.FromF(engine.KindBF16, []float32{quant.BF16Next(1024, 1), 1, quant.BF16Next(0.5, 8), 2}, 4)
	st := StageTol{Mode: TolULP, MaxULP: 1}
	m := CompareFloat(ref, gpu, st, true)
	if m.MaxULP != 8 || len(m.MaxULPAt) != 1 || m.MaxULPAt[0] != 2 || len(m.MaxAbsAt) != 1 || m.MaxAbsAt[0] != 0 {
		t.Fatalf("max ulp %d at %v, max abs at %v", m.MaxULP, m.MaxULPAt, m.MaxAbsAt)
	}
	ok, why := st.Judge(m, true)
	want := fmt.Sprintf("max 8 bf16 ulps (allowed 1) at [2]: GPU %g, reference 0.5", quant.BF16Next(0.5, 8))
	if ok || why != want {
		t.Fatalf("judge %v %q, want %q", ok, why, want)
	}
}
