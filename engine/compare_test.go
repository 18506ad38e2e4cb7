package engine

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

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
	ref := FromF(KindBF16, []float32{1, 2, 3, 4, 5, 6}, 2, 3)
	gpu := ref.Clone()
	gpu.F[5] = quant.BF16Next(6, 1) // 6 + 2^-5: one bf16 ulp above 6
	m := CompareFloat(ref, gpu, StageTol{Mode: ModeULP}, true)
	if m.Mismatch != 1 || m.MaxULP != 1 || m.ULPOver != 1 || m.MaxAbs != 0.03125 || len(m.MaxAbsAt) != 2 || m.MaxAbsAt[0] != 1 || m.MaxAbsAt[1] != 2 {
		t.Fatalf("metrics %+v", m)
	}
	if ok, _ := (StageTol{Mode: ModeULP, MaxULP: 1}).Judge(m, true); !ok {
		t.Error("1 ulp must pass max_ulp 1")
	}
	if ok, why := (StageTol{Mode: ModeULP}).Judge(m, true); ok || !strings.Contains(why, "1 bf16 ulps") {
		t.Errorf("1 ulp must fail max_ulp 0: %q", why)
	}
	// RoPE stages without the GPU's table get max_ulp_no_gpu_table.
	rope := StageTol{Mode: ModeULP, MaxULP: 0, MaxULPNoTable: 1}
	if ok, _ := rope.Judge(CompareFloat(ref, gpu, rope, false), false); !ok {
		t.Error("RoPE stage without GPU table must allow 1 ulp")
	}
	gpu.F[1] = float32(math.NaN())
	m = CompareFloat(ref, gpu, StageTol{Mode: ModeClose, Abs: 1, Rel: 1, Cos: 1}, true)
	if m.GPUNaN != 1 || len(m.NonFiniteRows) != 1 || m.NonFiniteRows[0] != 0 {
		t.Fatalf("NaN pattern %+v", m)
	}
	if ok, why := (StageTol{Mode: ModeClose, Abs: 1, Rel: 1, Cos: 1}).Judge(m, true); ok || !strings.Contains(why, "NaN") {
		t.Errorf("a GPU NaN must fail whatever the tolerance: %q", why)
	}
}

// TestCloseMode: FlashMLA's rule, an element passes on abs OR rel.
func TestCloseMode(t *testing.T) {
	st := DefaultTolerance().For("o") // abs 1e-3, rel 2.01/128, cos 5e-6
	ref := FromF(KindBF16, []float32{100, 0.0001}, 2)
	gpu := FromF(KindBF16, []float32{101, 0.0009}, 2) // rel 1% (< 1.57%) and abs 8e-4 (< 1e-3)
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
	if st := tol.For("u"); st.Mode != ModeULP || st.MaxULP != 3 {
		t.Errorf("u: %+v", st)
	}
	if st := tol.For("no_such_stage"); st.Mode != ModeClose {
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
