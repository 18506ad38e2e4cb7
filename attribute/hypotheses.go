package attribute

import (
	"fmt"
	"math"
	"slices"

	"sparsemla/attention"
	"sparsemla/engine"
	"sparsemla/indexer"
	"sparsemla/quant"
)

// registry maps a stage to its hypotheses, in the order they are tried.
var registry = map[string][]Hypothesis{}

func add(stage string, hs ...Hypothesis) { registry[stage] = append(registry[stage], hs...) }

func init() {
	for _, s := range []fp8Stage{
		{"q_a", "x", func(w *engine.LayerWeights) *attention.FP8Weight { return w.WqA }},
		{"q_b", "cq", func(w *engine.LayerWeights) *attention.FP8Weight { return w.WqB }},
		{"kv_raw", "x", func(w *engine.LayerWeights) *attention.FP8Weight { return w.Wkv }},
		{"iq_b", "cq", func(w *engine.LayerWeights) *attention.FP8Weight {
			if w.Indexer == nil {
				return nil
			}
			return w.Indexer.WqB
		}},
		{"y", "u", func(w *engine.LayerWeights) *attention.FP8Weight { return w.WoB }},
	} {
		add(s.stage, fp8Hypotheses(s)...)
	}
	add("cq", normHypothesis("q_a", func(c *Call) []float32 { return c.Ctx.W.QNorm }))
	add("kv_normed", normHypothesis("kv_raw", func(c *Call) []float32 { return c.Ctx.W.KVNorm }))
	for _, p := range []string{"cmp_", "icmp_"} {
		idx := p == "icmp_"
		add(p+"normed", normHypothesis(p+"pooled", func(c *Call) []float32 { return compressor(c, idx).Norm }),
			fp32PooledNorm(p, idx))
		add(p+"a", bf16Project(p, idx, true))
		add(p+"b", bf16Project(p, idx, false))
		add(p+"roped", ropeHypotheses(p+"roped")...)
		add(p+"roped", cmpRopePos(p, idx, "the emission position p instead of the group's first token j·r", func(j, r, p int64) int64 { return p }),
			cmpRopePos(p, idx, "position j (the row index) instead of j·r", func(j, r, p int64) int64 { return j }))
	}
	add("q_pe_prerope", headNormF32("q_pe_prerope"))
	add("q", headNormF32("q"))
	for _, s := range []string{"q", "kv_roped", "iq_roped", "o_inv"} {
		add(s, ropeHypotheses(s)...)
		add(s, ropePosition(s, -1), ropePosition(s, +1))
	}
	add("o_inv", Hypothesis{Name: "no-inverse-rope", Desc: "o_inv = o: the inverse RoPE of the attention output left out",
		run: func(c *Call) (engine.Tensor, error) { return copyIn(c, "o") }})
	add("o_inv", Hypothesis{Name: "vllm-fp8-o_inv", Desc: "o_inv as vLLM's fused_inv_rope_fp8_quant stores it: the inverse RoPE in fp32 (not rounded to bf16), then FP8 per 128 dims, rope dims included, s = 2^ceil(log2(max(amax, 1e-10)·(1/448))) — vLLM's FP8 quantisation of the attention output before its FP8 wo_a (spec §9.11), not a bug",
		run: vllmFP8OInv})
	add("kv_roped", Hypothesis{Name: "no-rope", Desc: "kv_roped = kv_normed: RoPE not applied to the window K",
		run: func(c *Call) (engine.Tensor, error) { return copyIn(c, "kv_normed") }})
	add("iq_roped", Hypothesis{Name: "no-rope", Desc: "iq_roped = iq_b: RoPE not applied to the indexer query",
		run: func(c *Call) (engine.Tensor, error) { return copyIn(c, "iq_b") }})
	add("kv", fq8Hypotheses("kv_roped")...)
	add("cmp_row", fq8Hypotheses("cmp_roped")...)
	add("iq_had", Hypothesis{Name: "no-hadamard", Desc: "iq_had = iq_roped: no Hadamard rotation of the indexer query (vLLM's indexer, spec §8.3)",
		run: func(c *Call) (engine.Tensor, error) { return copyIn(c, "iq_roped") }})
	add("icmp_had", Hypothesis{Name: "no-hadamard", Desc: "icmp_had = icmp_roped: no Hadamard rotation of the index key (vLLM's indexer cache writers, spec §8.3)",
		run: func(c *Call) (engine.Tensor, error) { return copyIn(c, "icmp_roped") }})
	add("iq", fq4Hypotheses("iq_had")...)
	add("icmp_row", fq4Hypotheses("icmp_had")...)
	add("index_score",
		Hypothesis{Name: "fp32-products", Desc: "index_score = bf16(Σ_h ReLU(qk)·w) with the products kept in fp32 (an fp32 einsum over heads)",
			run: func(c *Call) (engine.Tensor, error) { return scoreForm(c, indexer.IndexScoreNoProductRound) }},
		Hypothesis{Name: "fp32-scorer", Desc: "index_score in fp32 throughout, no bf16 rounding (fp32 logits fed to top-k)",
			run: func(c *Call) (engine.Tensor, error) { return scoreForm(c, indexer.IndexScoreF32) }})
	add("o", attentionHypotheses()...)
	add("u", Hypothesis{Name: "fp8-wo_a", Desc: "o_inv FP8-quantised per 128 (rope dims included, amax floor 1e-10) before wo_a (vLLM fused_inv_rope_fp8_quant, spec §9.11)",
		run: fp8WoA})
	add("kv_cache", cacheWriteHypotheses()...)
	add("topk_idxs",
		Hypothesis{Name: "v4.1-window-order", Desc: "the window part with its -1 padding first (the V4.1 layout, spec §11 item 9)", run: windowPadFirst},
		Hypothesis{Name: "window-slot-order", Desc: "the window part in ring-slot order 0..W-1 instead of oldest to newest", run: windowSlotOrder})
}

// ---- helpers ----

func inF(c *Call, name string) ([]float32, error) {
	t, ok := c.get(name)
	if !ok {
		return nil, fmt.Errorf("needs %s, which is not available", name)
	}
	if !t.Kind.IsFloat() {
		return nil, fmt.Errorf("%s is not a float tensor", name)
	}
	return t.F, nil
}

// like wraps data as a tensor of the reference's kind and shape.
func like(c *Call, data []float32) (engine.Tensor, error) {
	if len(data) != c.Ref.Len() {
		return engine.Tensor{}, fmt.Errorf("gives %d values, the stage has %d", len(data), c.Ref.Len())
	}
	return engine.FromF(c.Ref.Kind, data, c.Ref.Shape...), nil
}

func copyIn(c *Call, name string) (engine.Tensor, error) {
	v, err := inF(c, name)
	if err != nil {
		return engine.Tensor{}, err
	}
	return like(c, append([]float32(nil), v...))
}

// withCtx runs the stage's own Compute with a modified copy of the context.
func withCtx(c *Call, mod func(*engine.StepContext) error) (engine.Tensor, error) {
	ctx := *c.Ctx
	if err := mod(&ctx); err != nil {
		return engine.Tensor{}, err
	}
	return c.Def.Compute(&ctx, c.In)
}

func compressor(c *Call, idx bool) *attention.Compressor {
	if idx {
		if c.Ctx.W.Indexer == nil {
			return nil
		}
		return c.Ctx.W.Indexer.Compressor
	}
	return c.Ctx.W.Compressor
}

// ---- FP8 linears ----

type fp8Stage struct {
	stage, input string
	weight       func(*engine.LayerWeights) *attention.FP8Weight
}

func fp8Hypotheses(s fp8Stage) []Hypothesis {
	lin := func(name, desc string, f func(y, x []float32, w *attention.FP8Weight)) Hypothesis {
		return Hypothesis{Name: name, Desc: desc, run: func(c *Call) (engine.Tensor, error) {
			w := s.weight(c.Ctx.W)
			if w == nil {
				return engine.Tensor{}, fmt.Errorf("no %s weight in this layer", s.stage)
			}
			x, err := inF(c, s.input)
			if err != nil {
				return engine.Tensor{}, err
			}
			y := make([]float32, w.Rows)
			f(y, x, w)
			return like(c, y)
		}}
	}
	rule := func(r quant.ScaleRule, floor float32) func(y, x []float32, w *attention.FP8Weight) {
		return func(y, x []float32, w *attention.FP8Weight) { attention.FP8LinearActRule(y, x, w, r, floor) }
	}
	return []Hypothesis{
		lin("weight-only-fp8", "a bf16 GEMM on the dequantised FP8 weight, the activation not quantised (W8A16)", attention.FP8LinearBF16),
		lin("act-scale-log2ceil-1e-8", "activation scales 2^ceil(log2(max(amax, 1e-8)/448)) (SGLang's floor)", rule(quant.ScaleLog2Ceil, 1e-8)),
		lin("act-scale-flashmla", "activation scales 2^ceil(log2(max(amax/448, 1e-4))) (FlashMLA's test quantiser)", rule(quant.ScaleFlashMLA, quant.FP8AmaxFloor)),
		lin("act-scale-roundlog2", "activation scales 2^round(log2(amax/448)) (values can saturate)", rule(quant.ScaleRoundLog2, quant.FP8AmaxFloor)),
	}
}

// ---- norms ----

func normHypothesis(input string, weight func(*Call) []float32) Hypothesis {
	return Hypothesis{Name: "hf-rmsnorm", Desc: "RMSNorm with the normalised value rounded to bf16 before the weight (Hugging Face style)",
		run: func(c *Call) (engine.Tensor, error) {
			x, err := inF(c, input)
			if err != nil {
				return engine.Tensor{}, err
			}
			w := weight(c)
			if len(w) != len(x) {
				return engine.Tensor{}, fmt.Errorf("norm weight of %d values for %d inputs", len(w), len(x))
			}
			y := make([]float32, len(x))
			attention.RMSNormHF(y, x, w, float32(c.Ctx.Cfg.NormEps))
			return like(c, y)
		}}
}

func headNormF32(stage string) Hypothesis {
	return Hypothesis{Name: "fp32-head-norm", Desc: "the per-head query norm in fp32 with one bf16 rounding, not every op in bf16",
		run: func(c *Call) (engine.Tensor, error) {
			qb, err := inF(c, "q_b")
			if err != nil {
				return engine.Tensor{}, err
			}
			cfg := c.Ctx.Cfg
			H, D, rd := cfg.NHeads, cfg.HeadDim, cfg.RopeHeadDim
			q := append([]float32(nil), qb...)
			attention.HeadRMSF32(q, D, float32(cfg.NormEps))
			if stage == "q_pe_prerope" {
				var pe []float32
				for h := 0; h < H; h++ {
					pe = append(pe, q[h*D+D-rd:(h+1)*D]...)
				}
				return like(c, pe)
			}
			pe, err := inF(c, "q_pe_prerope")
			if err != nil {
				return engine.Tensor{}, err
			}
			for h := 0; h < H; h++ {
				dst := q[h*D+D-rd : (h+1)*D]
				copy(dst, pe[h*rd:(h+1)*rd])
				c.Ctx.Rope.Apply(dst, c.Ctx.Pos)
			}
			return like(c, q)
		}}
}

// fp32PooledNorm is vLLM's compressor: RMSNorm of the fp32 pooled row (no
// bf16(row) first), computed from the state before the step and the step's
// projections. Only the ratio-4 state (all 8 rows) is handled.
func fp32PooledNorm(p string, idx bool) Hypothesis {
	return Hypothesis{Name: "fp32-pooled-norm", Desc: "RMSNorm applied to the fp32 pooled row, without its bf16 rounding (vLLM fused_compress_quant_cache, spec §9.11)",
		run: func(c *Call) (engine.Tensor, error) {
			cm := compressor(c, idx)
			if cm == nil {
				return engine.Tensor{}, fmt.Errorf("no compressor in this layer")
			}
			kv, err := inF(c, engine.PrevPrefix+p+"kv_state")
			if err != nil {
				return engine.Tensor{}, err
			}
			sc, err := inF(c, engine.PrevPrefix+p+"score_state")
			if err != nil {
				return engine.Tensor{}, err
			}
			a, err := inF(c, p+"a")
			if err != nil {
				return engine.Tensor{}, err
			}
			b, err := inF(c, p+"b")
			if err != nil {
				return engine.Tensor{}, err
			}
			n := cm.StateRows() * cm.Width()
			if len(kv) != n || len(sc) != n {
				return engine.Tensor{}, fmt.Errorf("needs the full compressor state (%d values), have %d", n, len(kv))
			}
			prev := &attention.CompressorState{KV: kv, Score: sc}
			pooled := make([]float32, cm.HeadDim)
			cm.PoolAtF32(pooled, prev, a, b, c.Ctx.Pos)
			y := make([]float32, cm.HeadDim)
			attention.RMSNorm(y, pooled, cm.Norm, cm.Eps)
			return like(c, y)
		}}
}

func bf16Project(p string, idx, wantA bool) Hypothesis {
	return Hypothesis{Name: "bf16-gemm", Desc: "the compressor projection as a bf16 GEMM (output rounded to bf16) where the reference keeps fp32",
		run: func(c *Call) (engine.Tensor, error) {
			cm := compressor(c, idx)
			if cm == nil {
				return engine.Tensor{}, fmt.Errorf("no compressor in this layer")
			}
			x, err := inF(c, "x")
			if err != nil {
				return engine.Tensor{}, err
			}
			a, b := make([]float32, cm.Width()), make([]float32, cm.Width())
			cm.ProjectBF16(a, b, x)
			if wantA {
				return like(c, a)
			}
			return like(c, b)
		}}
}

// ---- FQ8 / FQ4 ----

func fq8Hypotheses(input string) []Hypothesis {
	h := func(name, desc string, f func(nope, all []float32)) Hypothesis {
		return Hypothesis{Name: name, Desc: desc, run: func(c *Call) (engine.Tensor, error) {
			v, err := inF(c, input)
			if err != nil {
				return engine.Tensor{}, err
			}
			nope := c.Ctx.Cfg.NopeDim()
			if len(v) < nope {
				return engine.Tensor{}, fmt.Errorf("%s has %d values", input, len(v))
			}
			y := slices.Clone(v)
			f(y[:nope], y)
			return like(c, y)
		}}
	}
	rule := func(r quant.ScaleRule, floor float32) func(nope, all []float32) {
		return func(nope, _ []float32) { quant.FQ8Rule(nope, 64, r, floor) }
	}
	return []Hypothesis{
		h("no-fq8", "not FP8-quantised: the bf16 value cached as is (the release-day kernel, spec §9.5)", func(_, _ []float32) {}),
		h("fq8-scale-floor2", "FQ8 with the block scale rounded down to a power of two (2^floor(log2(amax/448)))", func(n, _ []float32) { quant.FQ8Floor2(n, 64) }),
		h("fq8-scale-log2ceil-1e-8", "FQ8 with scale 2^ceil(log2(max(amax, 1e-8)/448)) (SGLang's quant_k_cache floor)", rule(quant.ScaleLog2Ceil, 1e-8)),
		h("fq8-scale-flashmla", "FQ8 with scale 2^ceil(log2(max(amax/448, 1e-4))) (FlashMLA's test quantiser)", rule(quant.ScaleFlashMLA, quant.FP8AmaxFloor)),
		h("fq8-scale-roundlog2", "FQ8 with scale 2^round(log2(amax/448)) (values can saturate)", rule(quant.ScaleRoundLog2, quant.FP8AmaxFloor)),
		h("fq8-all-dims", "FQ8 over all dims, the rope dims included", func(_, all []float32) {
			if len(all)%64 == 0 {
				quant.FQ8(all, 64)
			}
		}),
	}
}

func fq4Hypotheses(input string) []Hypothesis {
	h := func(name, desc string, f func(v []float32)) Hypothesis {
		return Hypothesis{Name: name, Desc: desc, run: func(c *Call) (engine.Tensor, error) {
			v, err := inF(c, input)
			if err != nil {
				return engine.Tensor{}, err
			}
			if len(v)%128 != 0 {
				return engine.Tensor{}, fmt.Errorf("%s has %d values, not whole 128-d vectors", input, len(v))
			}
			y := slices.Clone(v)
			f(y)
			return like(c, y)
		}}
	}
	return []Hypothesis{
		h("no-fq4", "not FP4-quantised: the bf16 value used as is", func([]float32) {}),
		h("fp8-instead-of-fq4", "FP8 with one power-of-two scale per 128-d vector instead of FQ4 (SGLang's act_quant, vLLM's FP8 indexer cache; spec §8.3)",
			func(v []float32) { quant.FQ8Rule(v, 128, quant.ScaleCeil2, quant.FP8AmaxFloor) }),
		h("fq4-scale-roundlog2", "FP4 with block scale 2^round(log2(amax/6)) (SGLang's MXFP4 codec rule, spec §8.4)", func(v []float32) {
			packed, scales := make([]uint8, len(v)/2), make([]uint8, len(v)/32)
			quant.QuantizeFP4(packed, scales, v, 32, quant.ScaleRoundLog2, quant.FP4AmaxFloor)
			quant.DequantizeFP4(v, packed, scales, 32)
		}),
	}
}

// ---- output projection ----

func fp8WoA(c *Call) (engine.Tensor, error) {
	cfg, w := c.Ctx.Cfg, c.Ctx.W
	if w.WoA == nil {
		return engine.Tensor{}, fmt.Errorf("wo_a is held only in its packed form (prepared weights; run with --reference)")
	}
	o, err := inF(c, "o_inv")
	if err != nil {
		return engine.Tensor{}, err
	}
	if len(o)%128 != 0 {
		return engine.Tensor{}, fmt.Errorf("o_inv has %d values, not whole 128-blocks", len(o))
	}
	oq := slices.Clone(o)
	quant.FQ8Rule(oq, 128, quant.ScaleCeil2, 1e-10)
	u := make([]float32, cfg.OGroups*cfg.OLoraRank)
	attention.WoA(u, oq, w.WoA, cfg.OGroups, cfg.OLoraRank)
	return like(c, u)
}

// vllmFP8OInv is vLLM's fused_inv_rope_fp8_quant on the stage's input o
// (every head [D], RoPE on its last 64 dims at p, the layer's table):
//
//	x0' = x0·cos + x1·sin, x1' = x1·cos − x0·sin       (fp32, not rounded)
//	per 128 dims: s = 2^ceil(log2(f32(max(amax, 1e-10)·f32(1/448))))
//	o_inv = E4M3(clamp(x'/s, ±448))·s                 (exact in bf16)
//
// A vLLM user who dumps the dequantised FP8 o_inv is told that the
// difference is vLLM's FP8 quantisation.
func vllmFP8OInv(c *Call) (engine.Tensor, error) {
	o, err := inF(c, "o")
	if err != nil {
		return engine.Tensor{}, err
	}
	D, tb, p := c.Ctx.Cfg.HeadDim, c.Ctx.Rope, c.Ctx.Pos
	nope := D - attention.RopeDims
	if D%128 != 0 || nope < 0 || len(o)%D != 0 || p < 0 || p >= int64(tb.T) {
		return engine.Tensor{}, fmt.Errorf("o of %d values, head dim %d, position %d of a %d-position table", len(o), D, p, tb.T)
	}
	x := slices.Clone(o)
	for h := 0; h < len(x)/D; h++ {
		v := x[h*D+nope : (h+1)*D]
		for i := 0; i < attention.RopePairs; i++ {
			cs, sn := tb.Cos[int(p)*attention.RopePairs+i], tb.Sin[int(p)*attention.RopePairs+i]
			x0, x1 := v[2*i], v[2*i+1]
			v[2*i] = x0*cs + x1*sn
			v[2*i+1] = x1*cs - x0*sn
		}
	}
	for b := 0; b < len(x); b += 128 {
		blk := x[b : b+128]
		var amax float32
		for _, v := range blk {
			amax = max(amax, float32(math.Abs(float64(v))))
		}
		s := float32(math.Ldexp(1, quant.BlockScaleExp(quant.ScaleLog2Ceil, max(amax, 1e-10)*float32(1.0/448), 1, 0)))
		for i, v := range blk {
			blk[i] = quant.DecodeE4M3(quant.EncodeE4M3Sat(v/s)) * s
		}
	}
	return like(c, x)
}
