package engine

import (
	"math"
	"slices"
	"testing"

	"sparsemla/attention"
	"sparsemla/quant"
)

func v41TinyModel(t *testing.T) (*Config, *V41Model) {
	t.Helper()
	cfg, err := Preset("v41-tiny")
	if err != nil {
		t.Fatal(err)
	}
	return cfg, NewRandomV41Model(cfg, 7, 64)
}

func v41Inputs(cfg *Config, p int64, seed uint64) []Tensor {
	xs := make([]Tensor, cfg.NLayers)
	for l := range xs {
		xs[l] = SyntheticV41Input(cfg, l, p, seed)
	}
	return xs
}

// runV41 decodes positions from..to-1 from the synthetic state at from.
func runV41(t *testing.T, m *V41Model, from, to int64) []*V41StepResult {
	t.Helper()
	st := SyntheticV41State(m, from, 3)
	var out []*V41StepResult
	for p := from; p < to; p++ {
		res, err := V41Step(m, st, v41Inputs(m.Cfg, p, 3), p, nil)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, res)
		st = res.Next
	}
	return out
}

func TestV41ConfigRoles(t *testing.T) {
	cfg, err := Preset("v41-flash")
	if err != nil {
		t.Fatal(err)
	}
	if !cfg.IsV41() || cfg.NormEps != 1e-20 || cfg.Ratio(19) != 2 || cfg.Ratio(20) != 1 {
		t.Fatalf("v41-flash: IsV41 %v eps %g r19 %d r20 %d", cfg.IsV41(), cfg.NormEps, cfg.Ratio(19), cfg.Ratio(20))
	}
	// spec §11 item 1: 3–7 ← 2, 9–13 ← 8, 15–19 ← 14, 21–39 ← 20; index 21–23 ← 20, 25–27 ← 24, 37–39 ← 36.
	for _, c := range []struct{ l, kv, ix int }{{2, 2, 2}, {7, 2, 2}, {9, 8, 8}, {19, 14, 14}, {20, 20, 20}, {23, 20, 20}, {27, 20, 24}, {39, 20, 36}, {1, -1, -1}} {
		if cfg.KVSourceOf(c.l) != c.kv || cfg.IndexSourceOf(c.l) != c.ix {
			t.Errorf("layer %d: KV source %d index source %d, want %d %d", c.l, cfg.KVSourceOf(c.l), cfg.IndexSourceOf(c.l), c.kv, c.ix)
		}
	}
	if cfg.CandidateSource() != 20 || !cfg.UsesCandidates(24) || cfg.UsesCandidates(20) || cfg.UsesCandidates(23) {
		t.Errorf("candidate roles wrong")
	}
	v4, _ := Preset("flash")
	if v4.IsV41() {
		t.Errorf("flash detected as V4.1")
	}
	// An HF-spelled config is detected and validated the same way.
	hf := `{"n_layers": 4, "compress_ratios": [0, 2, 2, 0], "kv_source_layer_ids": [1], "index_source_layer_ids": [1],
	        "index_n_heads": 4, "index_topk": 4, "norm_eps": 1e-20, "dim": 256, "q_lora_rank": 128, "n_heads": 4, "o_groups": 2, "o_lora_rank": 128}`
	c, err := ParseConfig([]byte(hf))
	if err != nil {
		t.Fatal(err)
	}
	if !c.IsV41() || c.KVSourceOf(2) != 1 {
		t.Errorf("HF-spelled V4.1 config: IsV41 %v, KV source of 2 = %d", c.IsV41(), c.KVSourceOf(2))
	}
	for _, bad := range []string{
		`{"n_layers": 4, "compress_ratios": [0, 4, 2, 0], "kv_source_layers": [1], "index_source_layers": [1]}`,
		`{"n_layers": 4, "compress_ratios": [0, 1, 2, 0], "kv_source_layers": [1], "index_source_layers": [1]}`,
		`{"n_layers": 4, "compress_ratios": [0, 2, 2, 0], "kv_source_layers": [2], "index_source_layers": [1, 2]}`,
		`{"n_layers": 4, "compress_ratios": [0, 2, 2, 0], "kv_source_layers": [1], "index_source_layers": [1], "candidate_source_layer": 1, "candidate_topk_blocks": 1, "candidate_block_size": 2, "index_topk": 8}`,
	} {
		if _, err := ParseConfig([]byte(bad)); err == nil {
			t.Errorf("config accepted: %s", bad)
		}
	}
}

func TestV41WindowIdxPaddingFirst(t *testing.T) {
	got := attention.V41WindowIdx(5, 8)
	want := []int32{-1, -1, 0, 1, 2, 3, 4, 5}
	if !slices.Equal(got, want) {
		t.Errorf("V41WindowIdx(5, 8) = %v, want %v", got, want)
	}
	for p := int64(7); p < 40; p++ {
		if !slices.Equal(attention.V41WindowIdx(p, 8), attention.WindowIdx(p, 8)) {
			t.Errorf("p = %d: the full ring differs from V4's order", p)
		}
	}
}

// TestV41Sharing: consumers attend their KV source's rows and use their index
// source's list; the candidate mask of layer 5 restricts layer 7's selection.
func TestV41Sharing(t *testing.T) {
	cfg, m := v41TinyModel(t)
	for _, res := range runV41(t, m, 9, 13) {
		p := res.Next.Next - 1
		S := res.Stages
		win := cfg.WindowSize
		for l := 0; l < cfg.NLayers; l++ {
			r := cfg.Ratio(l)
			kvc := S[l]["kv_cache"]
			if !slices.Equal(kvc.F[:win*cfg.HeadDim], S[l]["window"].F) {
				t.Fatalf("p %d layer %d: kv_cache window part is not the window", p, l)
			}
			if r == 0 {
				continue
			}
			src := cfg.KVSourceOf(l)
			tc := attention.VisibleRows(p, r)
			if !slices.Equal(kvc.F[win*cfg.HeadDim:], S[src]["ckv"].F[:tc*cfg.HeadDim]) {
				t.Fatalf("p %d layer %d: compressed rows are not layer %d's ckv", p, l, src)
			}
			if res.From[l]["ckv"] != src && l != src {
				t.Fatalf("p %d layer %d: read ckv from %d, want %d", p, l, res.From[l]["ckv"], src)
			}
			ix := cfg.IndexSourceOf(l)
			if !slices.Equal(S[l]["topk_idxs"].I[win:], S[ix]["index_sel"].I) {
				t.Fatalf("p %d layer %d: compressed index list is not layer %d's index_sel", p, l, ix)
			}
			sel := S[ix]["index_sel"].I
			if !slices.IsSorted(sel) || len(sel) != min(cfg.IndexTopK, tc) {
				t.Fatalf("p %d layer %d: index_sel %v not ascending or wrong length (Tc %d)", p, l, sel, tc)
			}
		}
		// Layer 7 (r = 1, Tc = p+1 ≥ 10 rows, 3 blocks of 4) selects inside layer 5's mask.
		mask := S[5]["cand_mask"].I
		kept := 0
		for _, v := range mask {
			kept += int(v)
		}
		if kept != cfg.CandidateTopKBlocks*cfg.CandidateBlockSize && kept != len(mask)%cfg.CandidateBlockSize+cfg.CandidateBlockSize {
			t.Fatalf("p %d: candidate mask keeps %d of %d rows", p, kept, len(mask))
		}
		if mask[len(mask)-1] != 1 {
			t.Fatalf("p %d: the newest row's block is not kept", p)
		}
		for _, j := range S[7]["index_sel"].I {
			if mask[j-int64(win)] != 1 {
				t.Fatalf("p %d: layer 7 selected row %d outside layer 5's candidate blocks", p, j-int64(win))
			}
		}
		if _, ok := S[7]["index_score_masked"]; !ok {
			t.Fatalf("layer 7 has no masked score stage")
		}
	}
}

// TestV41Grids: window K on the FQ8/32 grid over all dims, compressed rows on
// the FQ4E4M3/16 grid, index keys on FQ4/32; the r = 2 pooled row matches a
// float64 softmax within one bf16 ulp.
func TestV41Grids(t *testing.T) {
	cfg, m := v41TinyModel(t)
	for _, res := range runV41(t, m, 3, 7) {
		S := res.Stages
		k := append([]float32(nil), S[3]["kv"].F...)
		attention.V41FQ8Window(k)
		if !slices.Equal(k, S[3]["kv"].F) {
			t.Fatalf("window K not on the FQ8/32 grid")
		}
		if row, ok := S[2]["cmp_row"]; ok {
			again := append([]float32(nil), row.F...)
			quant.FQ4E4M3(again, 16)
			if !slices.Equal(again, row.F) {
				t.Fatalf("compressed row not on the FQ4E4M3 grid")
			}
			ik := append([]float32(nil), S[2]["ik_row"].F...)
			quant.FQ4(ik, 32)
			if !slices.Equal(ik, S[2]["ik_row"].F) {
				t.Fatalf("index key not on the FQ4 grid")
			}
			kv, sc, pooled := S[2]["cmp_kv_state"].F, S[2]["cmp_score_state"].F, S[2]["cmp_pooled"].F
			D := cfg.HeadDim
			for c := 0; c < D; c++ {
				m := math.Max(float64(sc[c]), float64(sc[D+c]))
				e0, e1 := math.Exp(float64(sc[c])-m), math.Exp(float64(sc[D+c])-m)
				want := (float64(kv[c])*e0 + float64(kv[D+c])*e1) / (e0 + e1)
				if d := quant.BF16ULPDistance(pooled[c], quant.BF16Round(float32(want))); d > 1 || d < -1 {
					t.Fatalf("pooled[%d] = %g, float64 softmax %g", c, pooled[c], want)
				}
			}
		}
		if _, ok := S[3]["cmp_a"]; ok {
			t.Fatalf("consumer layer 3 runs a compressor")
		}
	}
}

// TestV41IndexKSlot: on a step where layer 2's r = 2 group is open (p even),
// the released model.py (the default) scores layer 2's queries against the
// last published keys (layer 5's), OwnerIndexKeys against layer 2's own.
func TestV41IndexKSlot(t *testing.T) {
	cfg, m := v41TinyModel(t)
	st := SyntheticV41State(m, 10, 3)
	xs := v41Inputs(cfg, 10, 3)
	m.Options.OwnerIndexKeys = true
	own, err := V41Step(m, st, xs, 10, nil)
	if err != nil {
		t.Fatal(err)
	}
	m.Options.OwnerIndexKeys = false
	rel, err := V41Step(m, st, xs, 10, nil)
	if err != nil {
		t.Fatal(err)
	}
	if own.From[2]["icache"] != 2 || rel.From[2]["icache"] != 5 {
		t.Fatalf("layer 2 read index keys of layer %d (owner) and %d (released), want 2 and 5", own.From[2]["icache"], rel.From[2]["icache"])
	}
	if slices.Equal(own.Stages[2]["index_qk"].F, rel.Stages[2]["index_qk"].F) {
		t.Fatalf("the two index-key readings gave the same index_qk")
	}
	// At an emitting step (p odd) layer 2 republishes: both agree on layer 2.
	st11 := own.Next
	m.Options.OwnerIndexKeys = true
	a, err := V41Step(m, st11, v41Inputs(cfg, 11, 3), 11, nil)
	if err != nil {
		t.Fatal(err)
	}
	m.Options.OwnerIndexKeys = false
	b, err := V41Step(m, st11, v41Inputs(cfg, 11, 3), 11, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(a.Stages[2]["index_sel"].I, b.Stages[2]["index_sel"].I) || b.From[2]["icache"] != 2 {
		t.Fatalf("at an emitting step the released slot should hold layer 2's own keys")
	}
}

// TestV41EarlyWindowNoNaN: with −1 padding first, p < 63 starts the list with
// an all-empty chunk; the output stays finite and, all valid keys lying in one
// chunk either way, equals bit for bit the attention over V4's order (−1 last).
func TestV41EarlyWindowNoNaN(t *testing.T) {
	cfg, m := v41TinyModel(t)
	res := runV41(t, m, 2, 3)[0]
	S := res.Stages[0]
	o := S["o"].F
	for i, v := range o {
		if v != v || math.IsInf(float64(v), 0) {
			t.Fatalf("o[%d] = %g at p = 2", i, v)
		}
	}
	idx := attention.WindowIdx(2, cfg.WindowSize) // V4 order: 0, 1, 2, −1, …
	want := make([]float32, len(o))
	attention.SparseAttn(want, S["q"].F, S["kv_cache"].F, cfg.HeadDim, idx, m.Layers[0].AttnSink, cfg.SoftmaxScale())
	if !slices.Equal(o, want) {
		t.Fatalf("V4.1 order and V4 order give different outputs at p = 2")
	}
	nan := make([]float32, len(o))
	v41idx := attention.V41WindowIdx(2, cfg.WindowSize)
	attention.SparseAttn(nan, S["q"].F, S["kv_cache"].F, cfg.HeadDim, v41idx, m.Layers[0].AttnSink, cfg.SoftmaxScale())
	if nan[0] == nan[0] {
		t.Fatalf("the unguarded kernel order on the V4.1 list should give NaN (the guard is what this test checks)")
	}
}

// TestV41NeedsSubset: stepping only V41Needs(l) gives layer l the same stages
// as stepping every layer.
func TestV41NeedsSubset(t *testing.T) {
	cfg, m := v41TinyModel(t)
	want := runV41(t, m, 12, 13)[0].Stages[7]
	need := V41Needs(cfg, 7)
	if !slices.Equal(need, []int{5, 7}) {
		t.Fatalf("V41Needs(7) = %v, want [5 7]", need)
	}
	sub := &V41Model{Cfg: cfg, Layers: make([]*V41LayerWeights, cfg.NLayers), Rope: m.Rope}
	for _, l := range need {
		sub.Layers[l] = m.Layers[l]
	}
	st := SyntheticV41State(sub, 12, 3)
	res, err := V41Step(sub, st, v41Inputs(cfg, 12, 3), 12, nil)
	if err != nil {
		t.Fatal(err)
	}
	for name, tw := range want {
		tg := res.Stages[7][name]
		if !slices.Equal(tw.F, tg.F) || !slices.Equal(tw.I, tg.I) {
			t.Fatalf("stage %s differs between the subset and the whole step", name)
		}
	}
	if res.Stages[3] != nil {
		t.Fatalf("layer 3 was run")
	}
}

// TestV41HypothesesDistinct: every alternative differs from the reference on
// a step where it applies (p = 11: the window still filling, layer 2's r = 2
// group completing), so it can only name a divergence, never a correct value.
func TestV41HypothesesDistinct(t *testing.T) {
	cfg, m := v41TinyModel(t)
	st := SyntheticV41State(m, 11, 3)
	tried := 0
	hook := func(l int, def V41StageDef, in map[string]Tensor, ref Tensor) (Tensor, error) {
		if l != 2 {
			return ref, nil
		}
		for _, h := range V41Hypotheses(def.Name) {
			ctx := &V41Context{Cfg: cfg, Layer: l, Pos: 11, W: m.Layers[l], Rope: m.Rope[l]}
			alt, err := h.Compute(ctx, in)
			if err != nil {
				t.Fatalf("%s: %v", h.Name, err)
			}
			if slices.Equal(alt.F, ref.F) && slices.Equal(alt.I, ref.I) {
				t.Errorf("hypothesis %s of %s equals the reference", h.Name, def.Name)
			}
			tried++
		}
		return ref, nil
	}
	if _, err := V41Step(m, st, v41Inputs(cfg, 11, 3), 11, hook); err != nil {
		t.Fatal(err)
	}
	if tried != 8 {
		t.Errorf("%d hypotheses tried, want 8", tried)
	}
}
