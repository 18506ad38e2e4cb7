package engine

import (
	"fmt"
	"math"
	"math/rand/v2"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/moe"
	"sparsemla/quant"
)

// The V3.2 layer around its attention (deepseek-ai/DeepSeek-V3.2-Exp
// inference/model.py at 8631a81: Block.forward V32-M:839-852, RMSNorm with a
// residual V32-M:286-306, MLP V32-M:611-643, Gate V32-M:646-709, Expert
// V32-M:712-744, MoE V32-M:747-804, Transformer.forward V32-M:895-919).
//
// The residual stream is a pair (x, residual): each RMSNorm adds its two
// bf16 inputs in fp32, normalises that fp32 sum (not its bf16 rounding) and
// returns the bf16 sum as the new residual:
//
//	s          = f32(x) + f32(residual)                         fp32
//	norm(x, r) = bf16(w ⊙ (s · rsqrt(mean(s²) + eps))),  residual' = bf16(s)
//
// so a layer L with Block inputs x_in (the previous layer's ffn_out, the
// embedding row on layer 0) and res_in (the previous h_mid; none on layer 0) is
//
//	h_in    = bf16(f32(x_in) + f32(res_in))                    layer 0: h_in = x_in
//	x       = norm(x_in, res_in) with attn_norm                 layer 0: bf16(attn_norm ⊙ RMSNorm(x_in))
//	… attention (V32Stages) … y
//	h_mid   = bf16(f32(y) + f32(h_in))
//	ffn_in  = norm(y, h_in) with ffn_norm
//	ffn_out = MLP(ffn_in)                                       layer < n_dense_layers
//	        = bf16(Σ_{e ascending} f32(Expert_e(ffn_in)) · w_e + f32(Shared(ffn_in)))   MoE
//	logits  = head · f32(norm(ffn_out, h_mid) with norm)        last layer, fp32
//
// MLP / Expert / Shared(x) = FP8Lin(w2, bf16(silu(f32(FP8Lin(w1, x))) · f32(FP8Lin(w3, x)))),
// every FP8Lin the act_quant + fp8_gemm of attention.FP8Linear (bf16 out).

// V32FFNWeights are a V3.2 layer's parameters outside the attention
// (layers.L.* of the checkpoint):
//
//	AttnNorm, FFNNorm  fp32 [dim]                  attn_norm.weight, ffn_norm.weight
//	Dense              MLP, inter_dim              ffn.w1/w2/w3 (layer < n_dense_layers)
//	Gate               moe.Gate [E][dim] bf16      ffn.gate.weight, ffn.gate.bias (fp32 [E]; the official Gate has one only at dim 7168, V32-M:675; read wherever the checkpoint holds it)
//	Experts            [E] MLP, moe_inter_dim      ffn.experts.e.w1/w2/w3
//	Shared             MLP, n_shared·moe_inter_dim ffn.shared_experts.w1/w2/w3
//	Norm, Head         fp32 [dim], fp32 [vocab][dim] norm.weight, head.weight (last layer only; nil elsewhere)
//	Embed              bf16 [vocab][dim]            embed.weight (layer 0 only, where the checkpoint holds it)
type V32FFNWeights struct {
	AttnNorm, FFNNorm []float32
	Dense             *V32MLP
	Gate              *moe.Gate
	Experts           []*V32MLP
	Shared            *V32MLP
	Norm, Head        []float32
	Embed             []float32
}

// V32MLP is MLP / Expert with FP8 weights: w1, w3 [inter][dim], w2 [dim][inter].
type V32MLP struct{ W1, W2, W3 *attention.FP8Weight }

// Forward is MLP.forward / Expert.forward (V32-M:643, 744) on one token:
//
//	out = FP8Lin(w2, bf16(silu(f32(FP8Lin(w1, x))) · f32(FP8Lin(w3, x))))
//
// x [dim] bf16 values; out [dim] bf16 values.
func (m *V32MLP) Forward(out, x []float32) { m.forward(out, x, nil) }

// bf16Silu is bf16(silu(g) · u) (fp32 product).
func bf16Silu(g, u float32) float32 { return quant.BF16Round(moe.Silu(g) * u) }

// bf16Sum is bf16(a + b) (fp32 sum).
func bf16Sum(a, b float32) float32 { return quant.BF16Round(a + b) }

// GateUpSwapped is m with w1 (gate) and w3 (up) exchanged: out =
// FP8Lin(w2, bf16(silu(w3·x) · (w1·x))), what a checkpoint name map that
// swaps gate_proj and up_proj computes.
func (m *V32MLP) GateUpSwapped() *V32MLP { return &V32MLP{W1: m.W3, W2: m.W2, W3: m.W1} }

// V32AddNorm is RMSNorm.forward with a residual (V32-M:302-306): s =
// f32(x) + f32(res) (res nil: s = x, no residual), normed = bf16(w ⊙ (s ·
// rsqrt(mean(s²) + eps))), h = bf16(s). normed and h have len(x) elements.
func V32AddNorm(normed, h, x, res, w []float32, eps float32) {
	s := append([]float32(nil), x...)
	for i := range res {
		s[i] += res[i]
	}
	attention.RMSNorm(normed, s, w, eps)
	for i, v := range s {
		h[i] = quant.BF16Round(v)
	}
}

// V32MoE is MoE.forward (V32-M:786-804) for one token: y starts at fp32
// zero; for each routed expert e in ascending id order y += f32(Expert_e(x))
// · w_e (fp32 product and sum); then y += f32(Shared(x)); out = bf16(y).
// r holds the route (moe.Gate.GroupedRoute). out [dim]. shared nil leaves
// the shared expert out (y rounded alone; a diagnosis hypothesis).
func V32MoE(out, x []float32, r moe.Route, experts []*V32MLP, shared *V32MLP) {
	v32MoE(out, x, r, experts, shared, nil)
}

// V32BlockStages are BlockStages for a V3.2 layer: the attention stages
// (V32Stages) alone when the weights hold no FFN part (w.V32.FFN nil: a
// checkpoint or golden of the attention only), else the whole layer as the
// comment above lists it, with the leaf inputs x_in and (layer > 0) res_in,
// the Block.forward arguments.
func V32BlockStages(cfg *Config, layer int, pos int64, w *LayerWeights) []StageDef {
	attn := V32Stages(cfg, layer, pos)
	if w == nil || w.V32 == nil || w.V32.FFN == nil {
		return attn
	}
	var defs []StageDef
	add := func(name, eq string, compute func(*StepContext, map[string]Tensor) (Tensor, error), inputs ...string) {
		defs = append(defs, StageDef{Name: name, Inputs: inputs, Equation: eq, Compute: compute})
	}
	if layer == 0 {
		add("x", "x = bf16(attn_norm ⊙ RMSNorm(f32(x_in)))  (layer 0: no residual yet; h_in = x_in)", v32NormStage("x_in", "", "attn", false), "x_in")
	} else {
		add("h_in", "h_in = bf16(f32(x_in) + f32(res_in))", v32NormStage("x_in", "res_in", "attn", true), "x_in", "res_in")
		add("x", "x = bf16(attn_norm ⊙ RMSNorm(s)),  s = f32(x_in) + f32(res_in)  (the fp32 sum, not h_in)", v32NormStage("x_in", "res_in", "attn", false), "x_in", "res_in")
	}
	defs = append(defs, attn...)
	hIn := "h_in"
	if layer == 0 {
		hIn = "x_in"
	}
	add("h_mid", "h_mid = bf16(f32(y) + f32(h_in))", v32NormStage("y", hIn, "ffn", true), "y", hIn)
	add("ffn_in", "ffn_in = bf16(ffn_norm ⊙ RMSNorm(s)),  s = f32(y) + f32(h_in)", v32NormStage("y", hIn, "ffn", false), "y", hIn)
	if layer < cfg.NDenseLayers {
		add("ffn_out", "ffn_out = MLP(ffn_in) = FP8Lin(w2, bf16(silu(f32(FP8Lin(w1, ffn_in))) · f32(FP8Lin(w3, ffn_in))))  (inter_dim)", v32DenseOut, "ffn_in")
	} else {
		add("moe_indices", fmt.Sprintf("moe_indices = topk(sel, %d), sel = %s(W_g · f32(ffn_in)) + bias; %d groups, keep the top %d by max (no bias) / top-2 sum (bias)",
			cfg.NActivatedExperts, cfg.ScoreFunc, cfg.NExpertGroups, cfg.NLimitedGroups), v32MoEIndices, "ffn_in")
		add("moe_weights", "moe_weights = s[moe_indices] / Σ s[moe_indices] · route_scale  (unbiased scores s; no division under softmax)", v32MoEWeights, "ffn_in", "moe_indices")
		add("ffn_out", "ffn_out = bf16(Σ_{e in moe_indices, ascending} f32(Expert_e(ffn_in)) · w_e + f32(Shared(ffn_in)))  (FP8 experts)", v32MoEOut, "ffn_in", "moe_indices", "moe_weights")
	}
	if layer == cfg.NLayers-1 && w.V32.FFN.Head != nil {
		defs = append(defs, StageDef{Name: "logits", Inputs: []string{"ffn_out", "h_mid"}, Global: true,
			Equation: "logits = head · f32(bf16(norm ⊙ RMSNorm(f32(ffn_out) + f32(h_mid))))  (fp32 head)", Compute: v32Logits})
	}
	return defs
}

func v32FFN(ctx *StepContext) (*V32FFNWeights, error) {
	if ctx.W == nil || ctx.W.V32 == nil || ctx.W.V32.FFN == nil {
		return nil, fmt.Errorf("engine: layer %d has no V3.2 FFN weights (attn_norm, ffn_norm, ffn.*)", ctx.Layer)
	}
	return ctx.W.V32.FFN, nil
}

// v32NormStage computes V32AddNorm(a, b) with attn_norm or ffn_norm and
// returns the residual (sum true) or the normed value.
func v32NormStage(a, b, side string, sum bool) func(*StepContext, map[string]Tensor) (Tensor, error) {
	return func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		f, err := v32FFN(ctx)
		if err != nil {
			return Tensor{}, err
		}
		dim := ctx.Cfg.Dim
		x, err := inF(in, a, dim)
		if err != nil {
			return Tensor{}, err
		}
		var res []float32
		if b != "" {
			if res, err = inF(in, b, dim); err != nil {
				return Tensor{}, err
			}
		}
		w := f.AttnNorm
		if side == "ffn" {
			w = f.FFNNorm
		}
		normed, h := make([]float32, dim), make([]float32, dim)
		V32AddNorm(normed, h, x, res, w, float32(ctx.Cfg.NormEps))
		if sum {
			return bf16T(h, dim), nil
		}
		return bf16T(normed, dim), nil
	}
}

func v32DenseOut(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	f, err := v32FFN(ctx)
	if err != nil {
		return Tensor{}, err
	}
	if f.Dense == nil {
		return Tensor{}, fmt.Errorf("engine: layer %d: no dense MLP weights (ffn.w1/w2/w3)", ctx.Layer)
	}
	x, err := inF(in, "ffn_in", ctx.Cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	out := make([]float32, ctx.Cfg.Dim)
	f.Dense.forward(out, x, ctx.fast())
	return bf16T(out, len(out)), nil
}

func v32Route(ctx *StepContext, in map[string]Tensor) (*V32FFNWeights, []float32, moe.Route, error) {
	f, err := v32FFN(ctx)
	if err != nil {
		return nil, nil, moe.Route{}, err
	}
	if f.Gate == nil {
		return nil, nil, moe.Route{}, fmt.Errorf("engine: layer %d: no MoE weights (ffn.gate, ffn.experts)", ctx.Layer)
	}
	x, err := inF(in, "ffn_in", ctx.Cfg.Dim)
	if err != nil {
		return nil, nil, moe.Route{}, err
	}
	s := make([]float32, f.Gate.Experts)
	f.Gate.Scores(s, x)
	r, err := f.Gate.GroupedRoute(s, ctx.Cfg.NExpertGroups, ctx.Cfg.NLimitedGroups)
	return f, x, r, err
}

func v32MoEIndices(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	_, _, r, err := v32Route(ctx, in)
	if err != nil {
		return Tensor{}, err
	}
	idx := make([]int64, len(r.Indices))
	for i, e := range r.Indices {
		idx[i] = int64(e)
	}
	return FromI(KindI64, idx, len(idx)), nil
}

// v32RouteOf is the route with the given (dumped or computed) indices: the
// weights are the unbiased scores at those experts (moe.RouteWeights).
func v32RouteOf(ctx *StepContext, in map[string]Tensor) (*V32FFNWeights, []float32, moe.Route, error) {
	f, x, r, err := v32Route(ctx, in)
	if err != nil {
		return nil, nil, r, err
	}
	idx, err := inI(in, "moe_indices")
	if err != nil {
		return nil, nil, r, err
	}
	if len(idx) != ctx.Cfg.NActivatedExperts {
		return nil, nil, r, fmt.Errorf("input moe_indices has %d ids, want %d", len(idx), ctx.Cfg.NActivatedExperts)
	}
	r.Indices = make([]int32, len(idx))
	for i, e := range idx {
		if e < 0 || int(e) >= f.Gate.Experts {
			return nil, nil, r, fmt.Errorf("input moe_indices[%d] = %d outside [0, %d)", i, e, f.Gate.Experts)
		}
		r.Indices[i] = int32(e)
	}
	r.Weights = moe.RouteWeights(r.Scores, r.Indices, f.Gate.Func, f.Gate.RouteScale)
	return f, x, r, nil
}

func v32MoEWeights(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	_, _, r, err := v32RouteOf(ctx, in)
	if err != nil {
		return Tensor{}, err
	}
	return FromF(KindF32, r.Weights, len(r.Weights)), nil
}

func v32MoEOut(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	f, x, r, err := v32RouteOf(ctx, in)
	if err != nil {
		return Tensor{}, err
	}
	w, err := inF(in, "moe_weights", len(r.Indices))
	if err != nil {
		return Tensor{}, err
	}
	r.Weights = w
	out := make([]float32, ctx.Cfg.Dim)
	v32MoE(out, x, r, f.Experts, f.Shared, ctx.fast())
	return bf16T(out, len(out)), nil
}

func v32Logits(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	f, err := v32FFN(ctx)
	if err != nil {
		return Tensor{}, err
	}
	dim := ctx.Cfg.Dim
	x, err := inF(in, "ffn_out", dim)
	if err != nil {
		return Tensor{}, err
	}
	res, err := inF(in, "h_mid", dim)
	if err != nil {
		return Tensor{}, err
	}
	normed, h := make([]float32, dim), make([]float32, dim)
	V32AddNorm(normed, h, x, res, f.Norm, float32(ctx.Cfg.NormEps))
	V := len(f.Head) / dim
	logits := make([]float32, V)
	v32F32Lin(ctx.fast(), logits, normed, f.Head, V, dim)
	return FromF(KindF32, logits, V), nil
}

// V32HeadNoNorm is the logits with the final RMSNorm left out: head ·
// f32(bf16(f32(ffn_out) + f32(h_mid))) (fp32 [vocab]), what a GPU whose head
// reads the residual sum instead of norm(ffn_out, h_mid) computes.
func V32HeadNoNorm(f *V32FFNWeights, ffnOut, hMid []float32) Tensor {
	dim := len(ffnOut)
	h := make([]float32, dim)
	for i := range h {
		h[i] = quant.BF16Round(ffnOut[i] + hMid[i])
	}
	V := len(f.Head) / dim
	logits := make([]float32, V)
	attention.F32Linear(logits, h, f.Head, V, dim)
	return FromF(KindF32, logits, V)
}

// V32HeadNormNoWeight is the logits with the final RMSNorm applied without
// its weight norm.weight (every weight 1).
func V32HeadNormNoWeight(f *V32FFNWeights, ffnOut, hMid []float32, eps float32) Tensor {
	dim := len(ffnOut)
	ones := make([]float32, dim)
	for i := range ones {
		ones[i] = 1
	}
	normed, h := make([]float32, dim), make([]float32, dim)
	V32AddNorm(normed, h, ffnOut, hMid, ones, eps)
	V := len(f.Head) / dim
	logits := make([]float32, V)
	attention.F32Linear(logits, normed, f.Head, V, dim)
	return FromF(KindF32, logits, V)
}

// v32MLPShapes names a V3.2 layer's FP8 FFN matrices (under layers.L.ffn.).
func v32MLPShapes(cfg *Config, layer int) []struct {
	name       string
	rows, cols int
} {
	type s = struct {
		name       string
		rows, cols int
	}
	mlp := func(pre string, inter int) []s {
		return []s{{pre + "w1", inter, cfg.Dim}, {pre + "w2", cfg.Dim, inter}, {pre + "w3", inter, cfg.Dim}}
	}
	if layer < cfg.NDenseLayers {
		return mlp("", cfg.InterDim)
	}
	var out []s
	for e := 0; e < cfg.NRoutedExperts; e++ {
		out = append(out, mlp(fmt.Sprintf("experts.%d.", e), cfg.MoEInterDim)...)
	}
	return append(out, mlp("shared_experts.", cfg.NSharedExperts*cfg.MoEInterDim)...)
}

// mlps groups the FP8 slots of v32MLPShapes into the MLPs they form.
func (f *V32FFNWeights) mlps(cfg *Config, layer int) []*V32MLP {
	if layer < cfg.NDenseLayers {
		return []*V32MLP{f.Dense}
	}
	return append(append([]*V32MLP(nil), f.Experts...), f.Shared)
}

func newV32FFN(cfg *Config, layer int) *V32FFNWeights {
	f := &V32FFNWeights{}
	if layer < cfg.NDenseLayers {
		f.Dense = &V32MLP{}
		return f
	}
	f.Experts = make([]*V32MLP, cfg.NRoutedExperts)
	for e := range f.Experts {
		f.Experts[e] = &V32MLP{}
	}
	f.Shared = &V32MLP{}
	return f
}

func (m *V32MLP) slot(i int) **attention.FP8Weight {
	return []**attention.FP8Weight{&m.W1, &m.W2, &m.W3}[i%3]
}

// v32GateBias reports whether the official Gate has a bias: only at dim 7168
// (V32-M:675). A checkpoint of another dim may still carry ffn.gate.bias
// (Hugging Face's V3 / V3.2 gate always has e_score_correction_bias): the
// loader then uses it.
func v32GateBias(cfg *Config) bool { return cfg.Dim == 7168 }

// V32SynthGateBias reports whether a synthetic V3.2 gate
// (RandomV32FFNWeights) has a bias: at dim 7168 as the official Gate, and
// wherever the experts are grouped (n_expert_groups > 1), as in every
// released V3 / V3.2 router that groups (the 671B configs: dim 7168, 8
// groups), so that a small synthetic model exercises the biased group score.
func V32SynthGateBias(cfg *Config) bool { return v32GateBias(cfg) || cfg.NExpertGroups > 1 }

func (cfg *Config) v32Gate(weight, bias []float32) (*moe.Gate, error) {
	f, err := moe.ParseScoreFunc(cfg.ScoreFunc)
	if err != nil {
		return nil, err
	}
	if f == moe.SqrtSoftplus {
		return nil, fmt.Errorf("engine: V3.2 score_func %q: the V3.2 Gate has softmax or sigmoid", cfg.ScoreFunc)
	}
	return &moe.Gate{Experts: cfg.NRoutedExperts, TopK: cfg.NActivatedExperts, Dim: cfg.Dim, Func: f,
		RouteScale: float32(cfg.RouteScale), Weight: weight, Bias: bias}, nil
}

// HasV32FFNWeights reports whether st holds layer l's parameters outside the
// attention (its ffn_norm.weight).
func HasV32FFNWeights(st dump.WeightSource, layer int) bool {
	_, ok := st.Lookup(fmt.Sprintf("layers.%d.ffn_norm.weight", layer))
	return ok
}

// loadV32FFN reads layer l's norms, FFN and (last layer, when present)
// norm.weight and head.weight, every dtype and shape checked.
func loadV32FFN(cfg *Config, layer int, st dump.WeightSource) (*V32FFNWeights, error) {
	f := newV32FFN(cfg, layer)
	wr := &attnWeightReader{cfg: cfg, st: st, pre: fmt.Sprintf("layers.%d.", layer)}
	var err error
	if f.AttnNorm, err = wr.f32("attn_norm.weight", cfg.Dim); err != nil {
		return nil, err
	}
	if f.FFNNorm, err = wr.f32("ffn_norm.weight", cfg.Dim); err != nil {
		return nil, err
	}
	mlps := f.mlps(cfg, layer)
	for i, s := range v32MLPShapes(cfg, layer) {
		if *mlps[i/3].slot(i), err = wr.fp8("ffn."+s.name, s.rows, s.cols); err != nil {
			return nil, err
		}
	}
	if layer >= cfg.NDenseLayers {
		gw, err := wr.f32("ffn.gate.weight", cfg.NRoutedExperts, cfg.Dim)
		if err != nil {
			return nil, err
		}
		var gb []float32
		if _, ok := st.Lookup(fmt.Sprintf("layers.%d.ffn.gate.bias", layer)); ok || v32GateBias(cfg) {
			if gb, err = wr.f32("ffn.gate.bias", cfg.NRoutedExperts); err != nil {
				return nil, err
			}
		}
		if f.Gate, err = cfg.v32Gate(gw, gb); err != nil {
			return nil, err
		}
	}
	if _, ok := st.Lookup("embed.weight"); ok && layer == 0 {
		g := &attnWeightReader{cfg: cfg, st: st}
		if f.Embed, err = g.f32("embed.weight", cfg.VocabSize, cfg.Dim); err != nil {
			return nil, err
		}
	}
	if layer == cfg.NLayers-1 {
		if _, ok := st.Lookup("head.weight"); ok {
			g := &attnWeightReader{cfg: cfg, st: st}
			if f.Norm, err = g.f32("norm.weight", cfg.Dim); err != nil {
				return nil, err
			}
			if f.Head, err = g.f32("head.weight", cfg.VocabSize, cfg.Dim); err != nil {
				return nil, err
			}
		}
	}
	return f, nil
}

// v32FFNRecords are the records of loadV32FFN's tensors (weights file order).
func v32FFNRecords(cfg *Config, layer int, f *V32FFNWeights) []dump.Record {
	pre := fmt.Sprintf("layers.%d.", layer)
	var out []dump.Record
	f32 := func(name string, x []float32, shape ...int) {
		out = append(out, dump.Record{Name: name, DType: dump.F32, Shape: shape, Data: f32Bytes(x)})
	}
	f32(pre+"attn_norm.weight", f.AttnNorm, cfg.Dim)
	f32(pre+"ffn_norm.weight", f.FFNNorm, cfg.Dim)
	mlps := f.mlps(cfg, layer)
	for i, s := range v32MLPShapes(cfg, layer) {
		w := *mlps[i/3].slot(i)
		out = append(out,
			dump.Record{Name: pre + "ffn." + s.name + ".weight", DType: dump.E4M3, Shape: []int{w.Rows, w.Cols}, Data: append([]byte(nil), w.CodesRowMajor()...)},
			dump.Record{Name: pre + "ffn." + s.name + ".scale", DType: dump.U8, Shape: fp8Scale(w.Rows, w.Cols), Data: append([]byte(nil), w.Scale...)})
	}
	if f.Gate != nil {
		out = append(out, dump.Record{Name: pre + "ffn.gate.weight", DType: dump.BF16, Shape: []int{cfg.NRoutedExperts, cfg.Dim}, Data: bf16Bytes(f.Gate.Weight)})
		if f.Gate.Bias != nil {
			f32(pre+"ffn.gate.bias", f.Gate.Bias, cfg.NRoutedExperts)
		}
	}
	if f.Embed != nil {
		out = append(out, dump.Record{Name: "embed.weight", DType: dump.BF16, Shape: []int{cfg.VocabSize, cfg.Dim}, Data: bf16Bytes(f.Embed)})
	}
	if f.Head != nil {
		f32("norm.weight", f.Norm, cfg.Dim)
		out = append(out, dump.Record{Name: "head.weight", DType: dump.BF16, Shape: []int{cfg.VocabSize, cfg.Dim}, Data: bf16Bytes(f.Head)})
	}
	return out
}

// RandomV32FFNWeights makes seeded synthetic V3.2 FFN weights for layer l,
// generated as randomV32LayerWeights does: FP8 matrices bf16(N(0,1)/sqrt(in))
// block-quantised, norms bf16(1 + 0.1·N), gate.weight bf16(N/sqrt(dim)),
// gate.bias (V32SynthGateBias) bf16(0.1·N), on layer 0 embed.weight
// bf16(N(0,1)), and on the last layer norm.weight and head.weight
// bf16(N/sqrt(dim)). One stream per matrix.
func RandomV32FFNWeights(cfg *Config, layer int, seed uint64) *V32FFNWeights {
	f := newV32FFN(cfg, layer)
	mlps := f.mlps(cfg, layer)
	for i, s := range v32MLPShapes(cfg, layer) {
		rng := rand.New(rand.NewPCG(seed, uint64(layer)<<48|uint64(i+1)<<24|0x32ff))
		w := make([]float32, s.rows*s.cols)
		sd := 1 / math.Sqrt(float64(s.cols))
		for j := range w {
			w[j] = quant.BF16Round(float32(rng.NormFloat64() * sd))
		}
		*mlps[i/3].slot(i) = attention.QuantizeFP8Weight(w, s.rows, s.cols)
	}
	rng := rand.New(rand.NewPCG(seed, uint64(layer)<<48|0xfe<<32|0x32))
	vec := func(n int, mean, sd float64) []float32 {
		x := make([]float32, n)
		for i := range x {
			x[i] = quant.BF16Round(float32(mean + sd*rng.NormFloat64()))
		}
		return x
	}
	f.AttnNorm, f.FFNNorm = vec(cfg.Dim, 1, 0.1), vec(cfg.Dim, 1, 0.1)
	if layer >= cfg.NDenseLayers {
		gw := vec(cfg.NRoutedExperts*cfg.Dim, 0, 1/math.Sqrt(float64(cfg.Dim)))
		var gb []float32
		if V32SynthGateBias(cfg) {
			gb = vec(cfg.NRoutedExperts, 0, 0.1)
		}
		g, err := cfg.v32Gate(gw, gb)
		if err != nil {
			panic("engine: RandomV32FFNWeights: " + err.Error())
		}
		f.Gate = g
	}
	if layer == 0 {
		f.Embed = vec(cfg.VocabSize*cfg.Dim, 0, 1)
	}
	if layer == cfg.NLayers-1 {
		f.Norm = vec(cfg.Dim, 1, 0.1)
		f.Head = vec(cfg.VocabSize*cfg.Dim, 0, 1/math.Sqrt(float64(cfg.Dim)))
	}
	return f
}
