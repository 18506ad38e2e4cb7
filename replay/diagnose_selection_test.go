package replay

import (
	"strings"
	"testing"

	"sparsemla/engine"
)

// TestDiagnoseSelectionDefects: a GPU top-k list that is not a set of valid
// rows (a row named twice, as the topk-off-by-one fault can make it, or a
// row past Tc) is described as such, not as "selected rows [] and left out
// [0]".
func TestDiagnoseSelectionDefects(t *testing.T) {
	cfg, err := engine.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	scores := engine.FromF(engine.KindBF16, []float32{0.5, 0.25, 2, -1, 0.75}, 5)
	for _, c := range []struct {
		stage string
		gpu   []int64
		want  []string
	}{
		{"index_topk", []int64{2, 4, 4}, []string{"not a set of 3 valid rows", "names row 4 twice (entries 1 and 2)", "left out: [0 (score 0.5)]"}},
		{"index_topk", []int64{2, 9, 0}, []string{"entry 1 names row 9, outside the 5 index rows 0..4", "[9]", "left out: [4 (score 0.75)]"}},
		{"index_sel", []int64{int64(cfg.WindowSize) + 2, int64(cfg.WindowSize) + 2, int64(cfg.WindowSize) + 2}, []string{"names row 2 3 times (entries [0 1 2])"}},
	} {
		gpu := engine.FromI(engine.KindI64, c.gpu, len(c.gpu))
		ref := engine.FromI(engine.KindI64, []int64{2, 4, 0}, 3)
		sr := StageResult{Stage: c.stage, Inputs: []InputInfo{{Name: "index_score", From: FromDump, Status: "matched"}}}
		in := map[string]engine.Tensor{"index_score": scores}
		judgeSet(&sr, ref, gpu, in, cfg.WindowSize)
		if sr.Status != StatusFail {
			t.Fatalf("%s %v: status %s", c.stage, c.gpu, sr.Status)
		}
		div := &Divergence{}
		diagnoseSelection(DiagnoseInput{Model: &engine.Model{Cfg: cfg}, Result: sr, GPU: gpu, In: in}, div)
		for _, w := range c.want {
			if !strings.Contains(div.Why, w) {
				t.Errorf("%s %v: why lacks %q:\n%s", c.stage, c.gpu, w, div.Why)
			}
		}
		if strings.Contains(div.Why, "selected rows []") {
			t.Errorf("%s %v: %s", c.stage, c.gpu, div.Why)
		}
	}
}
