package attribute

import (
	"fmt"
	"slices"
	"strings"

	"sparsemla/attention"
	"sparsemla/engine"
	"sparsemla/indexer"
	"sparsemla/kvcache"
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

// ---- RoPE ----

// ropeHypotheses runs the stage with each known wrong RoPE table (built
// only over the positions a decode step reads), and with the NeoX pairing.
func ropeHypotheses(stage string) []Hypothesis {
	var out []Hypothesis
	// The table hypotheses depend on the layer; they are built at run time
	// under one name per kind of table.
	for _, kind := range ropeKinds {
		out = append(out, Hypothesis{Name: "rope-table: " + kind.name, Desc: "RoPE with a wrong table: " + kind.name,
			run: func(c *Call) (engine.Tensor, error) {
				h, ok := ropeTableHypothesis(c, kind)
				if !ok {
					return engine.Tensor{}, fmt.Errorf("no %q table differs from the reference's for this layer", kind.name)
				}
				T := int(c.Ctx.Pos) + 2
				return withCtx(c, func(ctx *engine.StepContext) error {
					ctx.Rope = attention.NewRopeTableFreqs(h.Freqs, T, h.Name)
					return nil
				})
			}})
	}
	out = append(out, Hypothesis{Name: "rope-neox", Desc: "RoPE pairs (i, i+32) (rotate_half, GPT-NeoX) instead of interleaved (2i, 2i+1)",
		run: func(c *Call) (engine.Tensor, error) { return ropeNeoX(c, stage) }})
	return out
}

// ropeKinds name the tables of attention.RopeHypotheses tried at a RoPE
// stage: exact names, or name prefixes (prefix true) for the entries whose
// name carries the config's own value.
var ropeKinds = func() []ropeKind {
	k := []ropeKind{{"bf16 inv_freq", false}, {"no YaRN", false}, {"linear interpolation", true}}
	for _, f := range []string{"4", "8", "16", "32", "40"} {
		k = append(k, ropeKind{"YaRN with rope_factor " + f, false})
	}
	for _, L := range []string{"4096", "8192", "32768", "65536", "163840"} {
		k = append(k, ropeKind{"YaRN with original_seq_len " + L, false})
	}
	return append(k, ropeKind{"YaRN applied", true}, ropeKind{"base", true})
}()

type ropeKind struct {
	name   string
	prefix bool
}

// ropeTableHypothesis is the hypothesis of the layer's list named kind.
func ropeTableHypothesis(c *Call, kind ropeKind) (attention.RopeHypothesis, bool) {
	cfg := c.Ctx.Cfg
	p := cfg.RopeParams(c.Ctx.Layer)
	other := cfg.RopeTheta
	if cfg.Ratio(c.Ctx.Layer) == 0 {
		other = cfg.CompressRopeTheta
	}
	yarn := attention.RopeParams{Base: cfg.CompressRopeTheta, OriginalSeqLen: cfg.OriginalSeqLen, Factor: cfg.RopeFactor, BetaFast: cfg.BetaFast, BetaSlow: cfg.BetaSlow}
	for _, h := range attention.RopeHypotheses(p, other, yarn) {
		if h.Name == kind.name || (kind.prefix && strings.HasPrefix(h.Name, kind.name)) {
			return h, true
		}
	}
	return attention.RopeHypothesis{}, false
}

func ropePosition(stage string, off int64) Hypothesis {
	return Hypothesis{Name: fmt.Sprintf("rope-position p%+d", off), Desc: fmt.Sprintf("RoPE at position p%+d instead of p", off),
		run: func(c *Call) (engine.Tensor, error) {
			return withCtx(c, func(ctx *engine.StepContext) error {
				ctx.Pos += off
				if ctx.Pos < 0 || ctx.Pos >= int64(ctx.Rope.T) {
					return fmt.Errorf("position %d outside the RoPE table", ctx.Pos)
				}
				return nil
			})
		}}
}

// ropeNeoX recomputes the stage's rotation with the NeoX pairing.
func ropeNeoX(c *Call, stage string) (engine.Tensor, error) {
	cfg, ctx := c.Ctx.Cfg, c.Ctx
	rot := func(v []float32, d int, pos int64, inverse bool) {
		for h := 0; h < len(v)/d; h++ {
			ctx.Rope.ApplyRopeHalf(v[h*d+d-attention.RopeDims:(h+1)*d], pos, inverse)
		}
	}
	switch stage {
	case "kv_roped":
		v, err := inF(c, "kv_normed")
		if err != nil {
			return engine.Tensor{}, err
		}
		y := slices.Clone(v)
		rot(y, cfg.HeadDim, ctx.Pos, false)
		return like(c, y)
	case "iq_roped":
		v, err := inF(c, "iq_b")
		if err != nil {
			return engine.Tensor{}, err
		}
		y := slices.Clone(v)
		rot(y, cfg.IndexHeadDim, ctx.Pos, false)
		return like(c, y)
	case "o_inv":
		v, err := inF(c, "o")
		if err != nil {
			return engine.Tensor{}, err
		}
		y := slices.Clone(v)
		rot(y, cfg.HeadDim, ctx.Pos, true)
		return like(c, y)
	case "q":
		// The nope part is the reference's (from the stage itself); only the
		// rotation of q_pe_prerope changes.
		pe, err := inF(c, "q_pe_prerope")
		if err != nil {
			return engine.Tensor{}, err
		}
		y := slices.Clone(c.Ref.F)
		H, D, rd := cfg.NHeads, cfg.HeadDim, cfg.RopeHeadDim
		for h := 0; h < H; h++ {
			dst := y[h*D+D-rd : (h+1)*D]
			copy(dst, pe[h*rd:(h+1)*rd])
			ctx.Rope.ApplyRopeHalf(dst, ctx.Pos, false)
		}
		return like(c, y)
	case "cmp_roped", "icmp_roped":
		p := strings.TrimSuffix(stage, "roped")
		cm := compressor(c, p == "icmp_")
		v, err := inF(c, p+"normed")
		if err != nil || cm == nil {
			return engine.Tensor{}, fmt.Errorf("needs %snormed and the compressor", p)
		}
		y := slices.Clone(v)
		j := int64(attention.EmittedRow(ctx.Pos, cm.Ratio))
		ctx.Rope.ApplyRopeHalf(y[len(y)-attention.RopeDims:], j*int64(cm.Ratio), false)
		return like(c, y)
	}
	return engine.Tensor{}, fmt.Errorf("no NeoX form for stage %s", stage)
}

func cmpRopePos(p string, idx bool, what string, pos func(j, r, p int64) int64) Hypothesis {
	return Hypothesis{Name: "rope-row-position: " + strings.Fields(what)[1], Desc: "the compressed row rotated at " + what,
		run: func(c *Call) (engine.Tensor, error) {
			cm := compressor(c, idx)
			if cm == nil {
				return engine.Tensor{}, fmt.Errorf("no compressor in this layer")
			}
			v, err := inF(c, p+"normed")
			if err != nil {
				return engine.Tensor{}, err
			}
			r := int64(cm.Ratio)
			j := int64(attention.EmittedRow(c.Ctx.Pos, cm.Ratio))
			at := pos(j, r, c.Ctx.Pos)
			if at < 0 || at >= int64(c.Ctx.Rope.T) {
				return engine.Tensor{}, fmt.Errorf("position %d outside the RoPE table", at)
			}
			y := slices.Clone(v)
			c.Ctx.Rope.ApplyRope(y[len(y)-attention.RopeDims:], at, false)
			return like(c, y)
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

// ---- indexer scores ----

func scoreForm(c *Call, f func(score, qk, w []float32)) (engine.Tensor, error) {
	qk, err := inF(c, "index_qk")
	if err != nil {
		return engine.Tensor{}, err
	}
	w, err := inF(c, "iw")
	if err != nil {
		return engine.Tensor{}, err
	}
	if len(w) == 0 || len(qk)%len(w) != 0 {
		return engine.Tensor{}, fmt.Errorf("index_qk of %d values for %d heads", len(qk), len(w))
	}
	s := make([]float32, len(qk)/len(w))
	f(s, qk, w)
	return engine.FromF(engine.KindF32, s, c.Ref.Shape...), nil
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

// ---- attention ----

func attnInputs(c *Call) (q, kv []float32, rows int, idx []int32, err error) {
	cfg := c.Ctx.Cfg
	q, err = inF(c, "q")
	if err != nil {
		return
	}
	kt, ok := c.get("kv_cache")
	if !ok || !kt.Kind.IsFloat() || len(kt.Shape) != 2 || kt.Shape[1] != cfg.HeadDim {
		err = fmt.Errorf("needs kv_cache [rows, %d]", cfg.HeadDim)
		return
	}
	kv, rows = kt.F, kt.Shape[0]
	it, ok := c.get("topk_idxs")
	if !ok || it.Kind.IsFloat() {
		err = fmt.Errorf("needs topk_idxs")
		return
	}
	idx = make([]int32, len(it.I))
	for i, v := range it.I {
		if v < -1 || v >= int64(rows) {
			err = fmt.Errorf("topk_idxs[%d] = %d outside the %d cache rows", i, v, rows)
			return
		}
		idx[i] = int32(v)
	}
	return
}

func attnRun(name, desc string, f func(c *Call, o, q, kv []float32, rows int, idx []int32) error) Hypothesis {
	return Hypothesis{Name: name, Desc: desc, run: func(c *Call) (engine.Tensor, error) {
		q, kv, rows, idx, err := attnInputs(c)
		if err != nil {
			return engine.Tensor{}, err
		}
		o := make([]float32, len(q))
		if err := f(c, o, q, kv, rows, idx); err != nil {
			return engine.Tensor{}, err
		}
		return like(c, o)
	}}
}

type attnFn func(o, q, kv []float32, d int, idx []int32, sink []float32, scale float32)

func plainAttn(name, desc string, f attnFn) Hypothesis {
	return attnRun(name, desc, func(c *Call, o, q, kv []float32, _ int, idx []int32) error {
		f(o, q, kv, c.Ctx.Cfg.HeadDim, idx, c.Ctx.W.AttnSink, c.Ctx.Cfg.SoftmaxScale())
		return nil
	})
}

// partials computes the split-K partials over the dumped split_bounds, or
// over attention.HalfSplit of the list when the dump has none.
func partials(c *Call, q, kv []float32, idx []int32) ([]attention.Partial, []int64, error) {
	var bounds []int64
	if bt, ok := c.get("split_bounds"); ok && !bt.Kind.IsFloat() {
		bounds = bt.I
	} else {
		bounds = attention.HalfSplit(idx)
	}
	if len(bounds) < 3 || bounds[0] != 0 || bounds[len(bounds)-1] != int64(len(idx)) {
		return nil, nil, fmt.Errorf("no split of the %d-entry index list into two or more pieces (split_bounds %v)", len(idx), bounds)
	}
	var parts []attention.Partial
	for s := 0; s+1 < len(bounds); s++ {
		if bounds[s+1] < bounds[s] {
			return nil, nil, fmt.Errorf("split_bounds %v not ascending", bounds)
		}
		parts = append(parts, attention.SparseAttnPartial(q, kv, c.Ctx.Cfg.HeadDim, idx[bounds[s]:bounds[s+1]], c.Ctx.Cfg.SoftmaxScale()))
	}
	return parts, bounds, nil
}

func mergeHyp(name, desc string, f func(c *Call, o []float32, parts []attention.Partial) error) Hypothesis {
	return attnRun(name, desc, func(c *Call, o, q, kv []float32, _ int, idx []int32) error {
		parts, _, err := partials(c, q, kv, idx)
		if err != nil {
			return err
		}
		return f(c, o, parts)
	})
}

func attentionHypotheses() []Hypothesis {
	hs := []Hypothesis{
		plainAttn("bf16-logits", "logits q·K held in bf16 (bf16 GEMM, scaled in bf16), fp32 softmax", attention.SparseAttnBF16Logits),
		plainAttn("bf16-softmax", "fp32 logits, softmax output rounded to bf16 before P·V", attention.SparseAttnBF16Softmax),
		plainAttn("bf16-logits-softmax", "bf16 logits and bf16 softmax output (Hugging Face eager attention on bf16 tensors)", attention.SparseAttnBF16LogitsSoftmax),
		plainAttn("fp32-p", "P kept in fp32 for P·V (two-pass softmax, no bf16(P))", func(o, q, kv []float32, d int, idx []int32, sink []float32, scale float32) {
			attention.SparseAttnTwoPass(o, q, kv, d, idx, sink, scale)
		}),
		attnRun("no-sink", "the attention sink left out of the softmax denominator", func(c *Call, o, q, kv []float32, _ int, idx []int32) error {
			attention.SparseAttnNoSink(o, q, kv, c.Ctx.Cfg.HeadDim, idx, c.Ctx.Cfg.SoftmaxScale())
			return nil
		}),
		attnRun("neg-index-last-row", "-1 entries gathered as the last cache row (a negative index into the cache)", func(c *Call, o, q, kv []float32, rows int, idx []int32) error {
			return remapped(c, o, q, kv, idx, int32(rows-1))
		}),
		attnRun("neg-index-row0", "-1 entries gathered as cache row 0", func(c *Call, o, q, kv []float32, rows int, idx []int32) error {
			return remapped(c, o, q, kv, idx, 0)
		}),
		mergeHyp("splitk-no-sink", "split-K combine without the sink term in the total LSE", func(c *Call, o []float32, parts []attention.Partial) error {
			attention.MergePartialsNoSink(o, parts, c.Ctx.Cfg.HeadDim)
			return nil
		}),
		mergeHyp("splitk-base-e", "split-K combine weighting base-2 LSEs with e^x instead of 2^x", func(c *Call, o []float32, parts []attention.Partial) error {
			attention.MergePartialsBaseE(o, parts, c.Ctx.W.AttnSink, c.Ctx.Cfg.HeadDim)
			return nil
		}),
		mergeHyp("splitk-no-total", "split-K combine normalised by the largest split's LSE, not the total (weights do not sum to 1, no sink)", func(c *Call, o []float32, parts []attention.Partial) error {
			attention.MergePartialsNoTotal(o, parts, c.Ctx.W.AttnSink, c.Ctx.Cfg.HeadDim)
			return nil
		}),
	}
	for s := 0; s < maxSplits; s++ {
		hs = append(hs, mergeHyp(fmt.Sprintf("splitk-unscaled-split-%d", s), fmt.Sprintf("split-K combine adding split %d without its rescaling 2^(LSE2 - L)", s),
			func(c *Call, o []float32, parts []attention.Partial) error {
				if s >= len(parts) {
					return fmt.Errorf("the list has %d splits", len(parts))
				}
				attention.MergePartialsUnscaled(o, parts, c.Ctx.W.AttnSink, c.Ctx.Cfg.HeadDim, s)
				return nil
			}))
	}
	return hs
}

// maxSplits bounds the per-split hypotheses (FlashMLA uses a handful of splits per head group).
const maxSplits = 8

func remapped(c *Call, o, q, kv []float32, idx []int32, to int32) error {
	if !slices.Contains(idx, -1) {
		return fmt.Errorf("the index list has no -1 entries")
	}
	m := slices.Clone(idx)
	for i, v := range m {
		if v < 0 {
			m[i] = to
		}
	}
	attention.SparseAttn(o, q, kv, c.Ctx.Cfg.HeadDim, m, c.Ctx.W.AttnSink, c.Ctx.Cfg.SoftmaxScale())
	return nil
}

// ---- cache writes ----

func cacheWriteHypotheses() []Hypothesis {
	var hs []Hypothesis
	for i, h := range kvcache.WindowWriteHypotheses() {
		name := []string{"window-slot p-1", "window-slot p+1", "window-not-written", "window-double-write p,p-1", "window-double-write p,p+1"}[i]
		hs = append(hs, Hypothesis{Name: name, Desc: h.Name, run: func(c *Call) (engine.Tensor, error) {
			return cacheWith(c, h.Write, false)
		}})
	}
	hs = append(hs, Hypothesis{Name: "compressed-row-not-written", Desc: "the compressed row due at this emission step left zero (written late or not at all)",
		run: func(c *Call) (engine.Tensor, error) { return cacheWith(c, kvcache.WindowWrite, true) }})
	return hs
}

// cacheWith is the kv_cache after the step with the window written by
// write and, at an emission step, the compressed row appended (zero when
// zeroRow).
func cacheWith(c *Call, write func(prev []float32, d, W int, kv []float32, p int64) []float32, zeroRow bool) (engine.Tensor, error) {
	cfg := c.Ctx.Cfg
	D, W := cfg.HeadDim, cfg.WindowSize
	pt, ok := c.get(engine.PrevPrefix + "kv_cache")
	if !ok || !pt.Kind.IsFloat() || len(pt.Shape) != 2 || pt.Shape[1] != D || pt.Shape[0] < W {
		return engine.Tensor{}, fmt.Errorf("needs prev:kv_cache [rows ≥ %d, %d]", W, D)
	}
	kv, err := inF(c, "kv")
	if err != nil || len(kv) != D {
		return engine.Tensor{}, fmt.Errorf("needs kv [%d]", D)
	}
	r := cfg.Ratio(c.Ctx.Layer)
	emit := attention.EmitsRow(c.Ctx.Pos, r)
	if zeroRow && !emit {
		return engine.Tensor{}, fmt.Errorf("step %d emits no compressed row", c.Ctx.Pos)
	}
	out := write(pt.F, D, W, kv, c.Ctx.Pos)
	if emit {
		row := make([]float32, D)
		if !zeroRow {
			cr, err := inF(c, "cmp_row")
			if err != nil || len(cr) != D {
				return engine.Tensor{}, fmt.Errorf("needs cmp_row [%d]", D)
			}
			copy(row, cr)
		}
		out = append(out, row...)
	}
	return engine.FromF(c.Ref.Kind, out, len(out)/D, D), nil
}

// ---- index list ----

func windowPadFirst(c *Call) (engine.Tensor, error) {
	W := c.Ctx.Cfg.WindowSize
	if len(c.Ref.I) < W {
		return engine.Tensor{}, fmt.Errorf("index list shorter than the window")
	}
	out := slices.Clone(c.Ref.I)
	var valid, pad []int64
	for _, v := range out[:W] {
		if v < 0 {
			pad = append(pad, v)
		} else {
			valid = append(valid, v)
		}
	}
	if len(pad) == 0 {
		return engine.Tensor{}, fmt.Errorf("the window part has no -1 padding at step %d", c.Ctx.Pos)
	}
	copy(out, append(pad, valid...))
	return engine.FromI(c.Ref.Kind, out, c.Ref.Shape...), nil
}

func windowSlotOrder(c *Call) (engine.Tensor, error) {
	W := c.Ctx.Cfg.WindowSize
	if len(c.Ref.I) < W {
		return engine.Tensor{}, fmt.Errorf("index list shorter than the window")
	}
	out := slices.Clone(c.Ref.I)
	var valid []int64
	pads := 0
	for _, v := range out[:W] {
		if v < 0 {
			pads++
		} else {
			valid = append(valid, v)
		}
	}
	slices.Sort(valid)
	for i := range out[:W] {
		if i < len(valid) {
			out[i] = valid[i]
		} else {
			out[i] = -1
		}
	}
	if slices.Equal(out, c.Ref.I) {
		return engine.Tensor{}, fmt.Errorf("the window part is already in slot order at step %d", c.Ctx.Pos)
	}
	return engine.FromI(c.Ref.Kind, out, c.Ref.Shape...), nil
}
