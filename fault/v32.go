package fault

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"

	"sparsemla/attention"
	"sparsemla/engine"
	"sparsemla/moe"
	"sparsemla/quant"
	"sparsemla/replay"
)

// Faults in a V3.2 (DSA) model (engine.V32Stages, engine.V32BlockStages).
// On the attention side three kinds apply:
//
//	splitk-merge     o_latent: the split-K combine of the sparse MLA adds the
//	                 second split's partial without rescaling it by e^(lse_1 − L)
//	                 (FlashMLA's split form; the first split keeps its weight)
//	scale-byte       k_scale_cache: bit 0 of the exponent of one older token's
//	                 index-key scale (a power of two) flips, so that key's
//	                 scores read ×2 or ÷2 (the V3.2 cache's only scales)
//	topk-off-by-one  index_topk: the last entry is a neighbouring token
//
// On the FFN side (the whole layer: synth --whole, or a dump with the
// layer's norms and FFN weights) the V4 whole-step kinds that have a V3.2
// meaning, and two of V3.2's own:
//
//	router-bias             moe_indices: grouped routing without the gate's
//	                        bias (e_score_correction_bias; the group score
//	                        still the top-2 sum): MoE layers whose gate has one
//	router-groups-ignored   moe_indices: top-k of score + bias over all
//	                        experts, the group limit (n_limited_groups of
//	                        n_expert_groups) ignored (V3.2 only)
//	router-unnormalised     moe_weights: the chosen scores × route_scale, not
//	                        divided by their sum (sigmoid gates)
//	shared-gate-up-swapped  ffn_out of a MoE layer: the shared expert with w1
//	                        and w3 exchanged
//	dense-gate-up-swapped   ffn_out of a dense layer (layer < n_dense_layers):
//	                        the MLP with w1 and w3 exchanged (V3.2 only)
//	head-no-norm            logits: head · f32(bf16(ffn_out + h_mid)), the
//	                        final RMSNorm left out (last layer)
//
// Every other kind names a part V3.2 does not have (attention sink, FQ8
// window K, compressor, window list, FP4 experts, swiglu clamp, hash
// routing, hyper-connections) or one the V3.2 injection does not implement
// (stale-prefix pages); checkV32 refuses them in one line. The two V3.2-only
// kinds are refused in V4 models (v32OnlyRefusal).

// The fault kinds only V3.2 has (not in Kinds, which lists V4's; Parse
// accepts both).
const (
	// RouterGroupsIgnored: V3.2's router takes the top-k of score + bias
	// over all experts, ignoring the group limit (the best n_limited_groups
	// of n_expert_groups): moe_indices.
	RouterGroupsIgnored Kind = "router-groups-ignored"
	// DenseGateUp: the dense MLP of a first layer (layer < n_dense_layers)
	// runs with w1 (gate) and w3 (up) exchanged: ffn_out.
	DenseGateUp Kind = "dense-gate-up-swapped"
)

// V32Kinds lists the fault kinds only a V3.2 model has.
func V32Kinds() []Kind { return []Kind{RouterGroupsIgnored, DenseGateUp} }

// v32OnlyRefusal refuses a V3.2-only kind in a V4 model (nil for the others).
func v32OnlyRefusal(f Fault) error {
	switch f.Kind {
	case RouterGroupsIgnored:
		return fmt.Errorf("fault %s: a V3.2 kind: V4's router has no expert groups (top-k of score + bias over all experts, tid2eid on hash layers)", f)
	case DenseGateUp:
		return fmt.Errorf("fault %s: a V3.2 kind: V4 has no dense MLP layers (every layer's FFN is the MoE)", f)
	}
	return nil
}

func (f Fault) v32Stage() string {
	switch f.Kind {
	case SplitKMerge:
		return "o_latent"
	case ScaleByte:
		return "k_scale_cache"
	case TopKOffByOne:
		return "index_topk"
	case RouterBias, RouterGroupsIgnored:
		return "moe_indices"
	case RouterUnnormalised:
		return "moe_weights"
	case SharedGateUp, DenseGateUp:
		return "ffn_out"
	case HeadNoNorm:
		return "logits"
	}
	return ""
}

func (f Fault) v32Diagnosis() string {
	switch f.Kind {
	case SplitKMerge:
		return replay.KindAttention
	case ScaleByte:
		return replay.KindCache
	case TopKOffByOne:
		return replay.KindIndexer
	case RouterBias, RouterGroupsIgnored, RouterUnnormalised:
		return replay.KindRouter
	case SharedGateUp:
		return replay.KindExperts
	case DenseGateUp:
		return replay.KindDenseMLP
	case HeadNoNorm:
		return replay.KindHead
	}
	return ""
}

// checkV32 says whether f can be injected into a V3.2 model at its step
// and layer (what needs the weights, e.g. a gate bias, is checked where the
// fault is applied).
func (f Fault) checkV32(cfg *engine.Config) error {
	no := func(why string) error { return fmt.Errorf("fault %s: not in a V3.2 model: %s", f, why) }
	dense := f.Layer < cfg.NDenseLayers
	switch f.Kind {
	case SplitKMerge, ScaleByte:
		if f.Step < 1 {
			return fmt.Errorf("fault %s: needs an earlier token in the latent cache (step >= 1)", f)
		}
		return nil
	case TopKOffByOne:
		if f.Step+1 <= int64(cfg.IndexTopK) {
			return fmt.Errorf("fault %s: at step %d the indexer selects every one of its %d tokens (top-%d): no unselected neighbour to be off by one to (needs step >= %d)",
				f, f.Step, f.Step+1, cfg.IndexTopK, cfg.IndexTopK)
		}
		return nil
	case RouterBias, RouterGroupsIgnored, RouterUnnormalised, SharedGateUp:
		if dense {
			return fmt.Errorf("fault %s: layer %d is a dense MLP layer (layer < n_dense_layers = %d): no router or shared expert", f, f.Layer, cfg.NDenseLayers)
		}
		if f.Kind == RouterGroupsIgnored && (cfg.NExpertGroups <= 1 || cfg.NLimitedGroups >= cfg.NExpertGroups) {
			return fmt.Errorf("fault %s: n_expert_groups = %d, n_limited_groups = %d: the router keeps every group, so there is no group limit to ignore (a model with one: the 671B config, or synth --config v32-tiny-grouped --whole)", f, cfg.NExpertGroups, cfg.NLimitedGroups)
		}
		if f.Kind == RouterUnnormalised && cfg.ScoreFunc == "softmax" {
			return fmt.Errorf("fault %s: score_func softmax does not normalise the chosen weights: nothing to leave out", f)
		}
		return nil
	case DenseGateUp:
		if !dense {
			return fmt.Errorf("fault %s: layer %d is a MoE layer (layer >= n_dense_layers = %d): no dense MLP", f, f.Layer, cfg.NDenseLayers)
		}
		return nil
	case HeadNoNorm:
		if f.Layer != cfg.NLayers-1 {
			return fmt.Errorf("fault %s: the head runs after the last layer (%d) only", f, cfg.NLayers-1)
		}
		return nil
	case WrongLSE:
		return no("MLA attention has no attention sink, so the combine has no sink term to miss")
	case FP8Scale:
		return no("model.py keeps the latent cache in bf16; there is no FQ8 window K whose scale could be rounded down")
	case CompressorLate:
		return no("V3.2 has no compressor (the indexer ranks every token)")
	case WindowOrder:
		return no("V3.2 has no sliding window, so no window index list")
	case ExpertNibble:
		return no("V3.2's experts are FP8 (no FP4 nibbles)")
	case ExpertScaleBlock:
		return no("V3.2's routed experts are FP8 with one scale per 128×128 block (no FP4 UE8M0 scales per 32 to index per 128)")
	case ExpertNoClamp:
		return no("V3.2's Expert has no swiglu_limit clamp (silu(w1·x)·(w3·x) unclamped)")
	case RouterHashOff:
		return no("V3.2 has no hash layers (every MoE layer routes by score)")
	case HCPostTransposed, HCSplitNoSigmoid:
		return no("V3.2 has no hyper-connections (plain residual adds)")
	case StalePrefix:
		return fmt.Errorf("fault %s: not implemented for V3.2: the stale-page injection knows V4's window ring only", f)
	}
	return no("unknown kind")
}

// v32HasFFN reports whether layer l of m holds the V3.2 weights outside the
// attention (norms, FFN; what a FFN-side fault needs).
func v32HasFFN(m *engine.Model, l int) bool {
	w := m.Weights[l]
	return m.Cfg.V32() && w != nil && w.V32 != nil && w.V32.FFN != nil
}

// corruptV32 applies a V3.2 fault to its stage's value out.
func (j *faultInjector) corruptV32(ctx *engine.StepContext, out engine.Tensor, in map[string]engine.Tensor) (engine.Tensor, error) {
	cfg := ctx.Cfg
	bad := out.Clone()
	switch j.fault.Kind {
	case SplitKMerge:
		H, c, r := cfg.NHeads, cfg.KVLoraRank, cfg.QKRopeHeadDim
		sel := slices.Clone(in["index_topk"].I)
		slices.Sort(sel)
		sel = slices.Compact(sel)
		if len(sel) < 2 {
			return engine.Tensor{}, fmt.Errorf("fault %s: fewer than 2 selected tokens", j.fault)
		}
		kv := in["latent_cache"]
		T := kv.Shape[0]
		parts := [][]int64{sel[:len(sel)/2], sel[len(sel)/2:]}
		var o [2][]float32
		var lse [2][]float64
		for i, part := range parts {
			s, err := attention.V32Scores(in["q_absorbed"].F, in["q_pe"].F, kv.F, H, c, r, T, part, cfg.V32SoftmaxScale())
			if err != nil {
				return engine.Tensor{}, err
			}
			o[i], lse[i] = v32Partial(s, kv.F, H, c, r, T)
		}
		for h := 0; h < H; h++ {
			m := math.Max(lse[0][h], lse[1][h])
			L := m + math.Log(math.Exp(lse[0][h]-m)+math.Exp(lse[1][h]-m))
			w0 := float32(math.Exp(lse[0][h] - L))
			for k := 0; k < c; k++ {
				bad.F[h*c+k] = quant.BF16Round(w0*o[0][h*c+k] + o[1][h*c+k]) // split 1 added with weight 1
			}
		}
		return bad, nil
	case ScaleByte:
		rng := rand.New(rand.NewPCG(j.seed, uint64(j.fault.Step)<<8|uint64(j.fault.Layer)))
		t := rng.IntN(int(j.fault.Step)) // an older token
		b := math.Float32bits(bad.F[t])
		bad.F[t] = math.Float32frombits(b ^ 1<<23) // exponent bit 0: ×2 or ÷2
		return bad, nil
	case RouterBias, RouterGroupsIgnored, RouterUnnormalised, SharedGateUp, DenseGateUp, HeadNoNorm:
		return corruptV32FFN(ctx, j.fault, in)
	}
	return engine.Tensor{}, fmt.Errorf("fault %s: not a V3.2 fault", j.fault)
}

// v32Partial is one split's normalised partial output o_s [H][c] (fp32) and
// its natural-log LSE per head, from masked scores s [H][T].
func v32Partial(s, kv []float32, H, c, r, T int) ([]float32, []float64) {
	o := make([]float32, H*c)
	lse := make([]float64, H)
	for h := 0; h < H; h++ {
		sh := s[h*T : (h+1)*T]
		m := float32(math.Inf(-1))
		for _, v := range sh {
			m = max(m, v)
		}
		var z float32
		e := make([]float32, T)
		for t, v := range sh {
			e[t] = float32(math.Exp(float64(v - m)))
			z += e[t]
		}
		for t := 0; t < T; t++ {
			if e[t] == 0 {
				continue
			}
			p := e[t] / z
			for k := 0; k < c; k++ {
				o[h*c+k] += p * kv[t*(c+r)+k]
			}
		}
		lse[h] = float64(m) + math.Log(float64(z))
	}
	return o, lse
}

// corruptV32FFN is the faulty value of a FFN-side V3.2 fault's stage from
// the stage's inputs in (engine.V32BlockStages: moe_indices from ffn_in,
// moe_weights from ffn_in and moe_indices, ffn_out from ffn_in (and the
// route), logits from ffn_out and h_mid).
func corruptV32FFN(ctx *engine.StepContext, f Fault, in map[string]engine.Tensor) (engine.Tensor, error) {
	cfg := ctx.Cfg
	if ctx.W == nil || ctx.W.V32 == nil || ctx.W.V32.FFN == nil {
		return engine.Tensor{}, fmt.Errorf("fault %s: layer %d has no V3.2 FFN weights (norms, ffn.*): make the whole model (synth --whole) or use a dump with them", f, ctx.Layer)
	}
	w := ctx.W.V32.FFN
	x := in["ffn_in"].F
	switch f.Kind {
	case RouterBias, RouterGroupsIgnored, RouterUnnormalised, SharedGateUp:
		if w.Gate == nil {
			return engine.Tensor{}, fmt.Errorf("fault %s: layer %d has no MoE weights", f, ctx.Layer)
		}
	}
	ids := func(idx []int32) engine.Tensor {
		v := make([]int64, len(idx))
		for i, e := range idx {
			v[i] = int64(e)
		}
		return engine.FromI(engine.KindI64, v, len(v))
	}
	switch f.Kind {
	case RouterBias:
		g := w.Gate
		if g.Bias == nil {
			return engine.Tensor{}, fmt.Errorf("fault %s: layer %d's gate has no bias to leave out (the official Gate has one only at dim 7168; this model's dim is %d and its checkpoint holds no ffn.gate.bias; a small model with one: synth --config v32-tiny-grouped --whole)", f, ctx.Layer, cfg.Dim)
		}
		return ids(moe.V32RouteNoBias(g, scoresOf(g, x), cfg.NExpertGroups, cfg.NLimitedGroups)), nil
	case RouterGroupsIgnored:
		g := w.Gate
		sel := moe.V32Select(g, scoresOf(g, x))
		top, _ := moe.TopK(sel, g.TopK)
		return ids(top), nil
	case RouterUnnormalised:
		g := w.Gate
		idx, err := routed(f, g, in["moe_indices"])
		if err != nil {
			return engine.Tensor{}, err
		}
		wt := moe.RouteWeights(scoresOf(g, x), idx, moe.Softmax, g.RouteScale) // the softmax branch: no division
		return engine.FromF(engine.KindF32, wt, len(wt)), nil
	case SharedGateUp:
		idx, err := routed(f, w.Gate, in["moe_indices"])
		if err != nil {
			return engine.Tensor{}, err
		}
		out := make([]float32, cfg.Dim)
		engine.V32MoE(out, x, moe.Route{Indices: idx, Weights: in["moe_weights"].F}, w.Experts, w.Shared.GateUpSwapped())
		return engine.FromF(engine.KindBF16, out, cfg.Dim), nil
	case DenseGateUp:
		out := make([]float32, cfg.Dim)
		w.Dense.GateUpSwapped().Forward(out, x)
		return engine.FromF(engine.KindBF16, out, cfg.Dim), nil
	case HeadNoNorm:
		if w.Head == nil {
			return engine.Tensor{}, fmt.Errorf("fault %s: the model has no head weights (norm.weight, head.weight)", f)
		}
		return engine.V32HeadNoNorm(w, in["ffn_out"].F, in["h_mid"].F), nil
	}
	return engine.Tensor{}, fmt.Errorf("fault %s: not a V3.2 FFN fault", f)
}

func scoresOf(g *moe.Gate, x []float32) []float32 {
	s := make([]float32, g.Experts)
	g.Scores(s, x)
	return s
}

// StageIn is the stage where the fault first shows in a model of cfg: Stage
// for V4, the V3.2 stage (v32Stage) for V3.2.
func (f Fault) StageIn(cfg *engine.Config) string {
	if cfg != nil && cfg.V32() {
		return f.v32Stage()
	}
	return f.Stage()
}

// DiagnosisIn is Diagnosis in a model of cfg.
func (f Fault) DiagnosisIn(cfg *engine.Config) string {
	if cfg != nil && cfg.V32() {
		return f.v32Diagnosis()
	}
	return f.Diagnosis()
}
