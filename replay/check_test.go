package replay

import (
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
)

// TestCheckRecordShape: the dumped shapes a config fixes are checked against
// it, and each refusal names the config value at stake.
func TestCheckRecordShape(t *testing.T) {
	cfg, err := engine.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	W, D := cfg.WindowSize, cfg.HeadDim
	layerOf := func(r int) int {
		for l, x := range cfg.CompressRatios {
			if x == r {
				return l
			}
		}
		t.Fatalf("tiny has no ratio-%d layer (%v)", r, cfg.CompressRatios)
		return -1
	}
	l0, l4, l128 := layerOf(0), layerOf(4), layerOf(128)
	ent := func(l, step int, stage string, shape ...int) *dump.Entry {
		return &dump.Entry{Key: dump.Key{Step: step, Layer: l, Stage: stage}, Kind: dump.KindStage, Shape: shape}
	}
	ok := []*dump.Entry{
		ent(l0, 9, "kv_cache", W, D),
		ent(l4, 9, "kv_cache", W+2, D), // (9+1) div 4 = 2 rows
		ent(l4, 9, "kv_cache", W+1, D), // one emitted late: diagnosed by the replay, not refused
		ent(l128, 9, "kv_cache", W, D),
		ent(l4, 9, "icache", 2, cfg.IndexHeadDim),
		ent(l0, 9, "q", cfg.NHeads, D),
		ent(l4, 9, "index_topk", 2),
		ent(l0, 9, "topk_idxs", W),
	}
	for _, e := range ok {
		if err := checkRecordShape(cfg, e); err != nil {
			t.Errorf("%s %v: %v", e.Key, e.Shape, err)
		}
	}
	bad := []struct {
		e    *dump.Entry
		want string
	}{
		{ent(l0, 9, "kv_cache", 2*W, D), "window_size"},
		{ent(l4, 9, "kv_cache", W+3, D), "(9+1) div 4"},
		{ent(l128, 9, "kv_cache", W-1, D), "window_size"},
		{ent(l0, 9, "q", cfg.NHeads/2, D), "n_heads"},
		{ent(l0, 9, "cmp_kv_state", 1, D), "window-only layer"},
		{ent(l128, 9, "index_score", 3), "indexer"},
		{ent(l4, 9, "icache", 3, cfg.IndexHeadDim), "(s+1) div 4"},
	}
	for _, b := range bad {
		err := checkRecordShape(cfg, b.e)
		if err == nil || !strings.Contains(err.Error(), b.want) {
			t.Errorf("%s %v: err %v, want one naming %q", b.e.Key, b.e.Shape, err, b.want)
		}
	}
}

// TestDiagnoseIndexListWindowOnly: a topk_idxs divergence on a window-only
// layer is described without a compress ratio (it once read "Tc = (p+1) div
// 0").
func TestDiagnoseIndexListWindowOnly(t *testing.T) {
	cfg, err := engine.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	W := cfg.WindowSize
	l := -1
	for i, r := range cfg.CompressRatios {
		if r == 0 {
			l = i
			break
		}
	}
	ref := make([]int64, W)
	gpu := make([]int64, W+2)
	for i := range ref {
		ref[i], gpu[i] = int64(i), int64(i)
	}
	gpu[W], gpu[W+1] = int64(W), int64(W+1)
	div := &Divergence{}
	diagnoseIndexList(DiagnoseInput{Model: &engine.Model{Cfg: cfg},
		Result: StageResult{Step: 9, Layer: l, Stage: "topk_idxs", Reason: "index list of 130 entries"},
		Ref:    engine.FromI(engine.KindI32, ref, W), GPU: engine.FromI(engine.KindI32, gpu, W+2)}, div)
	if strings.Contains(div.Why, "div 0") || !strings.Contains(div.Why, "window-only") {
		t.Errorf("why: %s", div.Why)
	}
}
