package engine

import (
	"fmt"
	"math"
	"math/rand/v2"

	"sparsemla/attention"
	"sparsemla/moe"
	"sparsemla/quant"
)

// The whole DeepSeek-V4.1 decode step (Transformer.forward + Block.forward of
// V41-M, one token at position p with id tok):
//
//	h          = (e, …, e), e = embed.weight[tok]              [hc][dim] bf16
//	pre_mix    = [1, 0, …, 0]                                   make_identity_pre_mix
//	per layer l = 0 … n_layers−1:
//	  h_in = h, pre_mix_in = pre_mix
//	  hc_attn_* = hc_mixes(h_in) …  attn_norm_in = hc_pre(h_in, pre_mix_in), x = attn_norm(·)
//	  … the attention sub-layer (V41Stages, with the shared runtime) … y
//	  h_mid = hc_post(y, h_in, hc_attn_post, hc_attn_comb)
//	  hc_ffn_* = hc_mixes(h_mid) …  ffn_norm_in = hc_pre(h_mid, hc_attn_pre), ffn_in = ffn_norm(·)
//	  moe_indices, moe_weights = Gate(ffn_in); ffn_out = MoE(ffn_in)   (moe.V41MoE)
//	  h_out = hc_post(ffn_out, h_mid, hc_ffn_post, hc_ffn_comb)
//	  h = h_out, pre_mix = hc_ffn_pre
//	head_pre_mix = pre_mix
//	head_in    = hc_pre(h, head_pre_mix)                           (the last layer's hc_pre; no hc_head_fn)
//	head_x     = norm(head_in)
//	logits     = head · f32(head_x)                            [vocab] fp32
//	next_token = argmax(logits)                                greedy (sample with temperature 0)
//
// V41WholeStages lists a layer's stages in that order; V41Step runs them
// when the model is whole (V41Model.Whole). Engram (engram_layer_ids), the
// vision path and DSpark stages are not modelled: a whole step refuses a
// config with Engram layers or vision.

// BelowPrefix marks an input that is a stage of the layer below in the same
// step ("below:h_out", "below:hc_ffn_pre").
const BelowPrefix = "below:"

// Whole reports whether m holds the whole model: head weights (embed,
// norm, head) and every layer's block and MoE weights.
func (m *V41Model) Whole() bool {
	if m.Head == nil || m.Head.Embed == nil {
		return false
	}
	for _, w := range m.Layers {
		if w == nil || w.Block == nil || w.MoE == nil {
			return false
		}
	}
	return true
}

// v41WholeCheck refuses the parts of a V4.1 config the whole step does not
// model.
func v41WholeCheck(cfg *Config) error {
	if len(cfg.EngramLayerIDs) > 0 {
		return fmt.Errorf("engine: the V4.1 whole step does not model Engram (engram_layer_ids %v)", cfg.EngramLayerIDs)
	}
	if cfg.VisionNLayers > 0 {
		return fmt.Errorf("engine: the V4.1 whole step does not model the vision path (vision_n_layers %d; gate.bias_vl)", cfg.VisionNLayers)
	}
	return nil
}

// V41WholeStages lists layer l's stages of the whole decode step in the
// order Block.forward runs them: h_in and pre_mix_in (layer 0: the
// embedding and the one-hot pre-mix; later layers: the layer below's h_out
// and hc_ffn_pre), the attention site, the attention sub-layer (V41Stages),
// the FFN site, the MoE, h_out, and after the last layer the head (global
// stages head_in, head_x, logits, next_token).
func V41WholeStages(cfg *Config, l int, pos int64) []V41StageDef {
	var defs []V41StageDef
	add := func(name, eq string, f func(*V41Context, map[string]Tensor) (Tensor, error), in ...string) {
		defs = append(defs, V41StageDef{Name: name, Inputs: in, Equation: eq, Compute: f})
	}
	wrap := func(d V41BlockStageDef) V41StageDef {
		f := d.Compute
		return V41StageDef{Name: d.Name, Inputs: d.Inputs, Equation: d.Equation, Compute: func(c *V41Context, in map[string]Tensor) (Tensor, error) {
			return f(c.Cfg, c.W.Block, in)
		}}
	}
	if l == 0 {
		defs = append(defs, V41StageDef{Name: "embed", Inputs: []string{GlobalPrefix + "tok"}, Global: true,
			Equation: "embed = embed.weight[tok]  (bf16 [dim])", Compute: v41Embed})
		add("h_in", "h_in = (embed, …, embed)  (hc_mult copies: h.unsqueeze(2).repeat)", v41Expand, "embed")
		add("pre_mix_in", "pre_mix_in = [1, 0, …, 0]  (make_identity_pre_mix)", v41IdentityStage)
	} else {
		add("h_in", fmt.Sprintf("h_in = h_out of layer %d", l-1), v41Pass(BelowPrefix+"h_out"), BelowPrefix+"h_out")
		add("pre_mix_in", fmt.Sprintf("pre_mix_in = pre_mix_out of layer %d  (its hc_ffn_pre: pipelined mHC)", l-1), v41Pass(BelowPrefix+"pre_mix_out"), BelowPrefix+"pre_mix_out")
	}
	a, mid, f := V41BlockStages(cfg)
	for _, d := range a {
		defs = append(defs, wrap(d))
	}
	defs = append(defs, V41Stages(cfg, l, pos)...)
	for _, d := range mid {
		defs = append(defs, wrap(d))
	}
	temp := "gate_temp = " + fmt.Sprint(v41GateTemp(cfg))
	add("moe_indices", "moe_indices = topk("+cfg.ScoreFunc+"(W_g · f32(ffn_in) / gate_temp) + bias, k)  ("+temp+"; descending, lower id first among ties)", v41MoEIndices, "ffn_in")
	add("moe_weights", "moe_weights = s[moe_indices] / (Σ s[moe_indices] + 1e-20) · route_scale  (s the unbiased scores; the division when norm_topk_prob and k > 1, softmax too)", v41MoEWeights, "ffn_in", "moe_indices")
	add("moe_expert_out", "moe_expert_out[t] = Expert_{moe_indices[t]}(ffn_in, moe_weights[t])  (bf16 [k][dim], slot order; FP4, activations per 32, swiglu_limit)", v41ExpertOut, "ffn_in", "moe_indices", "moe_weights")
	add("moe_shared_out", "moe_shared_out = Shared(ffn_in)  (FP8 32×32, swiglu_limit too)", v41SharedOut, "ffn_in")
	add("ffn_out", "ffn_out = bf16(Σ_{e in moe_indices, ascending e} moe_expert_out[slot of e] + moe_shared_out)  (fp32 sum, MoE.forward's expert-id loop)", v41FFNOut, "moe_indices", "moe_expert_out", "moe_shared_out")
	for _, d := range f {
		defs = append(defs, wrap(d))
	}
	if l == cfg.NLayers-1 {
		defs = append(defs, V41StageDef{Name: "head_pre_mix", Inputs: []string{"pre_mix_out"}, Global: true,
			Equation: "head_pre_mix = pre_mix_out of the last layer  (the pre_mix the tail collapses with)", Compute: v41Pass("pre_mix_out")})
		for _, d := range V41HeadStages() {
			hf := d.Compute
			in := d.Inputs
			if d.Name == "head_in" {
				in = []string{"h_out", "head_pre_mix"}
				hf = func(cfg *Config, w *V41HeadWeights, m map[string]Tensor) (Tensor, error) {
					return v41Collapse("h_out", "head_pre_mix")(cfg, nil, m)
				}
			}
			eq := d.Equation
			if d.Name == "head_in" {
				eq = "head_in = bf16(Σ_j head_pre_mix[j] · h_out[j])  (the last block's hc_pre with the last hc_ffn_pre; no hc_head_fn in V4.1)"
			}
			defs = append(defs, V41StageDef{Name: d.Name, Inputs: in, Equation: eq, Global: true,
				Compute: func(c *V41Context, m map[string]Tensor) (Tensor, error) { return hf(c.Cfg, c.Head, m) }})
		}
		defs = append(defs, V41StageDef{Name: "next_token", Inputs: []string{"logits"}, Global: true,
			Equation: "next_token = argmax(logits)  (greedy: sample with temperature 0; the lowest id among equal maxima)", Compute: v41Argmax})
	}
	return defs
}

// V41LayerStages is the stage list V41Step runs for layer l of m: the whole
// layer when m is whole, else the attention sub-layer (V41Stages).
func V41LayerStages(m *V41Model, l int, pos int64) []V41StageDef {
	if m.Whole() {
		return V41WholeStages(m.Cfg, l, pos)
	}
	return V41Stages(m.Cfg, l, pos)
}

func v41GateTemp(cfg *Config) float64 {
	if cfg.GateTemp > 0 {
		return cfg.GateTemp
	}
	return 1 // ModelArgs.gate_temp default
}

func v41NormTopK(cfg *Config) bool { return cfg.NormTopKProb == nil || *cfg.NormTopKProb }

func v41Embed(c *V41Context, in map[string]Tensor) (Tensor, error) {
	tok, err := inTok(in)
	if err != nil {
		return Tensor{}, err
	}
	hw, dim := c.Head, c.Cfg.Dim
	if hw == nil || hw.Vocab <= 0 || len(hw.Embed) != hw.Vocab*dim {
		return Tensor{}, fmt.Errorf("no embedding weights (embed.weight [vocab][%d])", dim)
	}
	if tok < 0 || tok >= int64(hw.Vocab) {
		return Tensor{}, fmt.Errorf("token id %d outside the vocabulary [0, %d)", tok, hw.Vocab)
	}
	return bf16T(append([]float32(nil), hw.Embed[int(tok)*dim:int(tok+1)*dim]...), dim), nil
}

func v41Expand(c *V41Context, in map[string]Tensor) (Tensor, error) {
	e, err := inF(in, "embed", c.Cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	h := make([]float32, 0, c.Cfg.HCMult*c.Cfg.Dim)
	for j := 0; j < c.Cfg.HCMult; j++ {
		h = append(h, e...)
	}
	return bf16T(h, c.Cfg.HCMult, c.Cfg.Dim), nil
}

func v41ExpertOut(c *V41Context, in map[string]Tensor) (Tensor, error) {
	m, err := v41MoEOf(c)
	if err != nil {
		return Tensor{}, err
	}
	return V41ExpertOutWith(c, m, in)
}

// V41ExpertOutWith is moe_expert_out computed with the MoE m (the layer's
// own or a variant of it) from ffn_in, moe_indices and moe_weights.
func V41ExpertOutWith(c *V41Context, m *moe.V41MoE, in map[string]Tensor) (Tensor, error) {
	x, err := inF(in, "ffn_in", c.Cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	idx, err := v41Routed(m, in)
	if err != nil {
		return Tensor{}, err
	}
	w, err := inF(in, "moe_weights", len(idx))
	if err != nil {
		return Tensor{}, err
	}
	out := make([]float32, len(idx)*len(x))
	for t, e := range idx {
		if int(e) >= len(m.Experts) || m.Experts[e] == nil {
			return Tensor{}, fmt.Errorf("routed expert %d has no weights", e)
		}
		m.Experts[e].Forward(out[t*len(x):(t+1)*len(x)], x, w[t], m.SwigluLimit)
	}
	return bf16T(out, len(idx), len(x)), nil
}

func v41SharedOut(c *V41Context, in map[string]Tensor) (Tensor, error) {
	m, err := v41MoEOf(c)
	if err != nil {
		return Tensor{}, err
	}
	return V41SharedOutWith(c, m, in)
}

// V41SharedOutWith is moe_shared_out computed with the MoE m.
func V41SharedOutWith(c *V41Context, m *moe.V41MoE, in map[string]Tensor) (Tensor, error) {
	if m.Shared == nil {
		return Tensor{}, fmt.Errorf("layer %d has no shared expert", c.Layer)
	}
	x, err := inF(in, "ffn_in", c.Cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	out := make([]float32, len(x))
	m.Shared.Forward(out, x, m.SharedLimit)
	return bf16T(out, len(out)), nil
}

func v41IdentityStage(c *V41Context, _ map[string]Tensor) (Tensor, error) {
	return FromF(KindF32, V41IdentityPreMix(c.Cfg.HCMult), c.Cfg.HCMult), nil
}

func v41Pass(name string) func(*V41Context, map[string]Tensor) (Tensor, error) {
	return func(_ *V41Context, in map[string]Tensor) (Tensor, error) {
		t, ok := in[name]
		if !ok {
			return Tensor{}, fmt.Errorf("missing input %s", name)
		}
		return t.Clone(), nil
	}
}

func v41MoEOf(c *V41Context) (*moe.V41MoE, error) {
	if c.W == nil || c.W.MoE == nil {
		return nil, fmt.Errorf("layer %d has no MoE weights (ffn.*)", c.Layer)
	}
	return c.W.MoE, nil
}

// v41Scores is the gate's score vector of ffn_in.
func v41Scores(c *V41Context, in map[string]Tensor) (*moe.V41MoE, []float32, error) {
	m, err := v41MoEOf(c)
	if err != nil {
		return nil, nil, err
	}
	if err := m.Gate.Check(); err != nil {
		return nil, nil, err
	}
	x, err := inF(in, "ffn_in", c.Cfg.Dim)
	if err != nil {
		return nil, nil, err
	}
	s := make([]float32, m.Gate.Experts)
	m.Gate.Scores(s, x)
	return m, s, nil
}

func v41MoEIndices(c *V41Context, in map[string]Tensor) (Tensor, error) {
	m, s, err := v41Scores(c, in)
	if err != nil {
		return Tensor{}, err
	}
	r := m.Gate.RouteScores(s)
	idx := make([]int64, len(r.Indices))
	for i, e := range r.Indices {
		idx[i] = int64(e)
	}
	return FromI(KindI64, idx, len(idx)), nil
}

// v41Routed is moe_indices as expert ids of m.
func v41Routed(m *moe.V41MoE, in map[string]Tensor) ([]int32, error) {
	t, err := inI(in, "moe_indices")
	if err != nil {
		return nil, err
	}
	if len(t) != m.Gate.TopK {
		return nil, fmt.Errorf("moe_indices has %d entries, want k = %d", len(t), m.Gate.TopK)
	}
	idx := make([]int32, len(t))
	for i, e := range t {
		if e < 0 || e >= int64(m.Gate.Experts) {
			return nil, fmt.Errorf("moe_indices[%d] = %d is not an expert of %d", i, e, m.Gate.Experts)
		}
		idx[i] = int32(e)
	}
	return idx, nil
}

func v41MoEWeights(c *V41Context, in map[string]Tensor) (Tensor, error) {
	m, s, err := v41Scores(c, in)
	if err != nil {
		return Tensor{}, err
	}
	idx, err := v41Routed(m, in)
	if err != nil {
		return Tensor{}, err
	}
	w := moe.V41RouteWeights(s, idx, m.Gate.NormTopK, m.Gate.RouteScale)
	return FromF(KindF32, w, len(w)), nil
}

func v41FFNOut(c *V41Context, in map[string]Tensor) (Tensor, error) {
	m, err := v41MoEOf(c)
	if err != nil {
		return Tensor{}, err
	}
	idx, err := v41Routed(m, in)
	if err != nil {
		return Tensor{}, err
	}
	dim := c.Cfg.Dim
	eo, err := inF(in, "moe_expert_out", len(idx)*dim)
	if err != nil {
		return Tensor{}, err
	}
	so, err := inF(in, "moe_shared_out", dim)
	if err != nil {
		return Tensor{}, err
	}
	out, err := moe.CombineOutputs(idx, eo, so, m.Gate.Experts)
	if err != nil {
		return Tensor{}, err
	}
	return bf16T(out, dim), nil
}

func v41Argmax(_ *V41Context, in map[string]Tensor) (Tensor, error) {
	l, ok := in["logits"]
	if !ok || len(l.F) == 0 {
		return Tensor{}, fmt.Errorf("no logits")
	}
	best := 0
	for i, v := range l.F {
		if v > l.F[best] || (v != v && l.F[best] == l.F[best]) {
			best = i // torch.argmax: NaN is the maximum
		}
	}
	return FromI(KindI64, []int64{int64(best)}, 1), nil
}

// V41MoEFromConfig is the MoE of a V4.1 layer with the config's router
// settings and no weights yet.
func V41MoEFromConfig(cfg *Config) (*moe.V41MoE, error) {
	f, err := moe.ParseScoreFunc(cfg.ScoreFunc)
	if err != nil {
		return nil, err
	}
	lim := float32(cfg.SwigluLimit)
	return &moe.V41MoE{Gate: moe.V41Gate{Experts: cfg.NRoutedExperts, TopK: cfg.NActivatedExperts, Dim: cfg.Dim, Func: f,
		Temp: float32(v41GateTemp(cfg)), NormTopK: v41NormTopK(cfg), RouteScale: float32(cfg.RouteScale)},
		SwigluLimit: lim, SharedLimit: lim}, nil
}

// RandomV41MoE draws layer l's MoE from seed, for tests and synthetic
// dumps: gate.weight bf16(N(0, 1/dim)), gate.bias N(0, 0.05²); routed
// experts FP4 with random codes, w1/w3 scales 2^−3 … 2^0 and w2 scales
// 2^−8 … 2^−6 (so that gate and up reach swiglu_limit = 10 on some
// channels and the clamp acts); the shared expert FP8 32×32 from
// N(0, 4/dim) for w1/w3 and N(0, 1/(16·inter)) for w2.
func RandomV41MoE(cfg *Config, l int, seed uint64) *moe.V41MoE {
	m, err := V41MoEFromConfig(cfg)
	if err != nil {
		panic("engine: RandomV41MoE: " + err.Error())
	}
	r := rand.New(rand.NewPCG(seed^0x41e0e, uint64(l)<<32|0xe0e))
	E, dim, inter := cfg.NRoutedExperts, cfg.Dim, cfg.MoEInterDim
	m.Gate.Weight, m.Gate.Bias = make([]float32, E*dim), make([]float32, E)
	for i := range m.Gate.Weight {
		m.Gate.Weight[i] = quant.BF16Round(float32(r.NormFloat64() / float64(dim)))
	}
	for i := range m.Gate.Bias {
		m.Gate.Bias[i] = float32(0.05 * r.NormFloat64())
	}
	fp4 := func(rows, cols int, e0 uint8) *moe.FP4Weight {
		w := moe.RandomV41FP4Weight(r, rows, cols)
		for i := range w.Scale {
			w.Scale[i] = w.Scale[i] - 120 + e0 // 2^(e0−127) … 2^(e0−123)
		}
		return w
	}
	for e := 0; e < E; e++ {
		m.Experts = append(m.Experts, &moe.V41Expert{W1: fp4(inter, dim, 122), W2: fp4(dim, inter, 116), W3: fp4(inter, dim, 122)})
	}
	fp8 := func(rows, cols int, sd float64) *attention.V41FP8Weight {
		w := make([]float32, rows*cols)
		for i := range w {
			w[i] = float32(sd * r.NormFloat64())
		}
		return attention.QuantizeV41FP8Weight(w, rows, cols)
	}
	m.Shared = &moe.V41Shared{W1: fp8(inter, dim, 2/math.Sqrt(float64(dim))), W2: fp8(dim, inter, 0.25/math.Sqrt(float64(inter))), W3: fp8(inter, dim, 2/math.Sqrt(float64(dim)))}
	return m
}

// RandomV41HeadWeights draws embed.weight bf16(N(0, 1)), norm.weight
// bf16(1 + N(0, 0.1²)) and head.weight bf16(N(0, 1/dim)) from seed.
func RandomV41HeadWeights(cfg *Config, seed uint64) *V41HeadWeights {
	r := rand.New(rand.NewPCG(seed^0x41ead, 0xead))
	V, dim := cfg.VocabSize, cfg.Dim
	hw := &V41HeadWeights{Vocab: V, Embed: make([]float32, V*dim), Norm: make([]float32, dim), Head: make([]float32, V*dim)}
	for i := range hw.Embed {
		hw.Embed[i] = quant.BF16Round(float32(r.NormFloat64()))
	}
	for i := range hw.Norm {
		hw.Norm[i] = quant.BF16Round(float32(1 + 0.1*r.NormFloat64()))
	}
	for i := range hw.Head {
		hw.Head[i] = quant.BF16Round(float32(r.NormFloat64() / math.Sqrt(float64(dim))))
	}
	return hw
}

// NewRandomV41WholeModel is NewRandomV41Model with every layer's block and
// MoE weights and the head: a whole model (V41Model.Whole).
func NewRandomV41WholeModel(cfg *Config, seed uint64, T int) *V41Model {
	m := NewRandomV41Model(cfg, seed, T)
	for l, w := range m.Layers {
		w.Block = RandomV41BlockWeights(cfg, l, seed)
		w.MoE = RandomV41MoE(cfg, l, seed)
	}
	m.Head = RandomV41HeadWeights(cfg, seed)
	return m
}

// V41FFNSize is the number of weight values one layer's MoE holds (the
// routed experts' FP4 codes counted once each): for refusing synthetic
// models too large to draw.
func V41FFNSize(cfg *Config) int64 {
	return int64(cfg.NRoutedExperts+1) * 3 * int64(cfg.Dim) * int64(cfg.MoEInterDim)
}
