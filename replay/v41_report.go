package replay

import (
	"fmt"
	"slices"
	"strings"

	"sparsemla/attribute"
	"sparsemla/engine"
)

// The common report of a V4.1 replay: V41Run judges every stage of a V4.1
// dump (V41Dump, engine.V41Step) with the stage tolerances of a Tolerance
// (V41Tolerance, overridable by --tol) and fills the same Report as Run —
// per-stage results with metrics and severity, the first divergence with its
// kind, hint, inputs and hypothesis verdict, coverage and the
// sparsemla.replay/v4 JSON — so that replay --json, report (text and HTML),
// diff and bisect read V4.1 dumps like any other.

// V41ModelName is Report.Model of a V4.1 replay.
const V41ModelName = "DeepSeek-V4.1"

// V41Options configure V41Run.
type V41Options struct {
	Mode  Mode       // Local or Propagated
	Tol   *Tolerance // nil: V41Tolerance(Mode)
	Steps []int64    // nil: every dumped step; a step the dump lacks is an error
}

// V41Tolerance is the default tolerance of a V4.1 replay: every stage exact
// (the fallback), except those measured on the GPU golden testdata/v41-tiny:
// o ≤ 1 bf16 ulp (P·V order); the fp32 r = 2 compressor projections cmp_a /
// cmp_b (and, propagated, the states holding them) close to 1e-6; propagated
// y within a cosine of 1e-4 (a 1-ulp o moves FP8 codes of u before wo_b).
func V41Tolerance(mode Mode) *Tolerance {
	exact := StageTol{Mode: TolExact, Why: "V4.1: exact (GPU golden testdata/v41-tiny bit-exact)"}
	t := &Tolerance{Stages: map[string]StageTol{}, Fallback: exact}
	for _, n := range V41StageNames() {
		t.Stages[n] = exact
	}
	f32 := StageTol{Mode: TolClose, Abs: 1e-6, Rel: 1e-5, Cos: 1e-9, Why: "V4.1: fp32 GEMM of the r = 2 compressor, summation order (golden: |Δ| ≤ 2.7e-7 of max)"}
	t.Stages["o"] = StageTol{Mode: TolULP, MaxULP: 1, Why: "V4.1: sparse_attn P·V order (golden: max 1 bf16 ulp)"}
	t.Stages["kv_normed"] = StageTol{Mode: TolULP, MaxULP: 1, Why: "V4.1: RMSNorm mean(x²) order (whole-step golden testdata/v41-tiny-whole: 1 value of 512 off by 1 bf16 ulp at 2 of 24 layer-steps)"}
	t.Stages["cmp_a"], t.Stages["cmp_b"] = f32, f32
	t.Stages["index_sel"] = StageTol{Mode: TolSet, Why: "V4.1: top-k rows + window_size, compared as a set (torch.topk order among ties is unspecified), and sorted by position"}
	for name, st := range v41BlockTolerance() {
		t.Stages[name] = st
	}
	if mode == Propagated {
		for name, st := range v41BlockTolerance() {
			if st.Mode == TolClose || st.Mode == TolULP {
				t.Stages[name] = StageTol{Mode: TolClose, Abs: 1e30, Cos: 1e-4, Why: "V4.1 propagated: cos_diff only (" + st.Why + ")"}
			}
		}
		t.Stages["cmp_kv_state"], t.Stages["cmp_score_state"] = f32, f32
		t.Stages["y"] = StageTol{Mode: TolClose, Abs: 1e-2, Rel: 2e-2, Cos: 1e-4, Why: "V4.1 propagated: a 1-ulp o moves FP8 codes of u before wo_b"}
	}
	return t
}

// V41StageNames are the stage names of the V4.1 stage graph (v41-tiny, every
// layer kind, emitting and not), sorted.
func V41StageNames() []string {
	cfg, err := engine.Preset("v41-tiny")
	if err != nil {
		return nil
	}
	set := map[string]bool{}
	for l := 0; l < cfg.NLayers; l++ {
		for _, p := range []int64{4, 5, 255} {
			for _, d := range engine.V41Stages(cfg, l, p) {
				set[d.Name] = true
			}
		}
	}
	return sortedNames(set)
}

// v41Kind is the diagnosis kind of a V4.1 stage.
func v41Kind(stage string) string {
	switch stage {
	case "h_in", "pre_mix_in", "attn_norm_in", "h_mid", "ffn_norm_in", "h_out":
		return KindHyperConn
	case "moe_indices", "moe_weights":
		return KindRouter
	case "ffn_out":
		return KindExperts
	case "head_in", "head_x", "logits", "next_token":
		return KindHead
	}
	if strings.HasPrefix(stage, "hc_") {
		return KindHyperConn
	}
	switch {
	case stage == "o":
		return KindAttention
	case stage == "window" || stage == "kv_cache" || stage == "ckv":
		return KindCache
	case stage == "kv":
		return KindFP8Cache
	case strings.HasPrefix(stage, "cmp_"):
		return KindCompressor
	case stage == "index_sel" || stage == "cand_mask":
		return KindIndexer
	case stage == "topk_idxs":
		return KindIndexList
	case stage == "icache" || strings.HasPrefix(stage, "ik_") || strings.HasPrefix(stage, "iq") ||
		strings.HasPrefix(stage, "iw") || strings.HasPrefix(stage, "index_"):
		return KindIndexScore
	}
	return KindProjection
}

// v41Hints are the V4.1 wordings of the hints (V4's differ: window order,
// FQ8 block size, FP4 cache, no Hadamard).
var v41Hints = map[string]string{
	KindAttention:  "check sparse_attn: the index list's window and compressed rows it gathers, the sink, and the P·V accumulation (the default tolerance allows 1 bf16 ulp)",
	KindCache:      "check the cache write of this step: window slot p mod window_size ← kv, compressed rows appended at the KV source (FP4, E4M3 scales per 16) and shared with its consumers",
	KindFP8Cache:   "check the window K quantiser: act_quant over all 512 dims (RoPE tail included) in blocks of 32 with UE8M0 scales",
	KindCompressor: "check the compressor: r = 1 bf16 wkv + norm, no gate; r = 2 fp32 wkv/wgate, state slot p mod 2, softmax pooling, norm after the bf16 cast; no ape, no overlap; row pre-RoPE, then RoPE at j·r and FP4 (E4M3 per 16)",
	KindIndexer:    "check the two-level top-k: candidate blocks (amax, last block forced), the mask of later index sources, top-k re-sorted by position; and which index keys the shared slot held (meta.json index_k_at)",
	KindIndexScore: "check the V4.1 indexer: no Hadamard, keys k_norm(wk(latent)) FP4 with UE8M0 per 32, q = wq_b(cq) RoPE then FP4, weights · 1/sqrt(H·D), relu·weight products summed in bf16",
	KindIndexList:  "check the index list: the V4.1 window list is oldest … newest with the -1 padding FIRST while filling (V4 puts it last), then the selected compressed rows offset by window_size",
	KindProjection: "check the linear / norm / RoPE kernel of this stage against its equation (FP8 activations and weights in blocks of 32 with UE8M0 scales, fp32 accumulation, bf16 out; rms_norm_eps)",
	KindHyperConn:  "check the pipelined mHC: each site's hc_mixes from its own streams (rsqrt with norm_eps), but the attention collapses with the INCOMING pre_mix (the previous block's hc_ffn_pre, one-hot at layer 0) and the FFN with hc_attn_pre; hc_post out_k = post_k·a + Σ_j comb[j][k]·h_j",
	KindRouter:     "check the V4.1 gate: fp32 W_g·x divided by gate_temp, score_func, the bias added for the choice only, top-k descending, weights = chosen scores / (their sum + 1e-20) · route_scale (for softmax too)",
	KindExperts:    "check the V4.1 experts: FP8 activations per 32 (not 128), FP4 weights with the even column in the LOW nibble and a UE8M0 scale per 32, swiglu_limit on the routed AND the shared expert, routing weight before w2, fp32 sum in expert-id order plus the shared expert",
	KindHead:       "check the V4.1 head: the last layer's hc_pre with its hc_ffn_pre (no hc_head_fn), the final RMSNorm (norm_eps), the fp32 head GEMV",
	KindNonFinite:  "look for the first NaN/inf of this stage (an empty first chunk of sparse_attn gives NaN when unguarded)",
	KindUpstream:   "look at the earlier divergence of the input named; this stage only inherited it",
}

// V41Run replays a V4.1 dump into the common Report. Local (teacher-forced):
// each stage from the dumped values of its inputs (the window and kv from the
// dumped kv_cache when it is held); propagated: each step's stages chain on
// the reference's own values from the dumped x of every layer and the dumped
// state before the step. Stages the reference defines but the dump does not
// hold are results of status missing (computed, checked only through the
// dumped stages that depend on them); every other tensor of a replayed step
// is accounted for (v41AccountHeld): an input (tok, pos; x without the block
// weights) or a skipped result that makes the report incomplete (a block
// stage without the block weights; a tensor the reference does not model,
// also named in Coverage.NotModelled).
func V41Run(d *V41Dump, opt V41Options) (*Report, error) {
	mode := opt.Mode
	if mode != Local && mode != Propagated {
		return nil, fmt.Errorf("V4.1 replay: mode %q: local or propagated (chained is not implemented for V4.1; on a whole dump propagated runs the model from the token)", mode)
	}
	tol := opt.Tol
	if tol == nil {
		tol = V41DefaultTolerance(d, mode)
	}
	steps := d.Steps
	if opt.Steps != nil {
		steps = nil
		for _, p := range opt.Steps {
			if _, ok := d.step[p]; !ok {
				return nil, fmt.Errorf("%s: --steps names step %d; the dump holds steps %s", d.Dir, p, StepList(d.Steps))
			}
			if !slices.Contains(steps, p) {
				steps = append(steps, p)
			}
		}
		slices.Sort(steps)
	}
	cfg := d.Cfg
	layers := make([]int, cfg.NLayers)
	for l := range layers {
		layers[l] = l
	}
	rep := newReport(d.Dir, string(mode), true, steps, layers)
	rep.Kernels = "reference"
	rep.Model = V41ModelName
	rep.StepsReplayed = len(steps)
	rep.TolOverrides = tol.Overrides
	notMod := map[string]bool{}
	W, D := cfg.WindowSize, cfg.HeadDim
	for _, p := range steps {
		dumped := d.step[p]
		st, err := d.StateBefore(p)
		if err != nil {
			return nil, err
		}
		whole := d.Model.Whole()
		var xs []engine.Tensor
		var tok int64
		if whole {
			if tok, err = d.Token(p); err != nil {
				return nil, err
			}
		} else if xs, err = d.Inputs(p); err != nil {
			return nil, err
		}
		status := map[string]string{}      // "L.stage" → pass | fail | missing, this step
		vals := map[string]engine.Tensor{} // "L.stage" → the value later stages read, this step
		hook := func(l int, def engine.V41StageDef, in map[string]engine.Tensor, ref engine.Tensor) (engine.Tensor, error) {
			dn := fmt.Sprintf("L%d.%s", l, def.Name)
			if def.Global {
				dn = def.Name
			}
			gpu, ok := dumped[dn]
			if kv, has := dumped[fmt.Sprintf("L%d.kv_cache", l)]; has && (def.Name == "window" || def.Name == "kv") && len(kv.F) >= W*D {
				if def.Name == "window" {
					gpu, ok = engine.FromF(engine.KindBF16, kv.F[:W*D], W, D), true
				} else {
					s := int(p%int64(W)) * D
					gpu, ok = engine.FromF(engine.KindBF16, kv.F[s:s+D], D), true
				}
			}
			fromPages, err := d.v41PagesBefore(rep, &gpu, &ok, p, l, def.Name, ref, mode)
			if err != nil {
				return ref, err
			}
			sr := StageResult{Step: p, Layer: l, Stage: def.Name, Equation: def.Equation, Shape: ref.Shape, Inputs: v41Inputs(l, def, status, mode, whole)}
			key := fmt.Sprintf("%d.%s", l, def.Name)
			if !ok {
				sr.Status, sr.Reason = StatusMissing, "not in the dump: computed, checked only through the dumped stages that depend on it"
				status[key] = StatusMissing
				vals[key] = ref
				rep.Results = append(rep.Results, sr)
				return ref, nil
			}
			if len(gpu.F) != len(ref.F) || len(gpu.I) != len(ref.I) || gpu.Kind.IsFloat() != ref.Kind.IsFloat() {
				return ref, fmt.Errorf("step_%d.safetensors: %s is %s %v, the reference's %s %v", p, dn, gpu.Kind, gpu.Shape, ref.Kind, ref.Shape)
			}
			gpu.Shape, gpu.Kind = ref.Shape, ref.Kind
			v41JudgeStage(&sr, ref, gpu, in, tol.For(def.Name), W)
			status[key] = sr.Status
			rep.Results = append(rep.Results, sr)
			if sr.Status == StatusFail && rep.First == nil {
				// The hypotheses may read any earlier stage of the layer
				// (logits' head-no-final-norm reads head_in).
				hin := map[string]engine.Tensor{}
				pre := fmt.Sprintf("%d.", l)
				for k, v := range vals {
					if n, ok := strings.CutPrefix(k, pre); ok {
						hin[n] = v
					}
				}
				for k, v := range in {
					hin[k] = v
				}
				rep.First = v41Divergence(d, sr, l, p, def.Name, hin, ref, gpu, mode)
			}
			if !fromPages {
				d.v41PagesAfter(rep, p, l, def.Name, gpu, sr.Status, mode)
			}
			if mode == Local {
				vals[key] = gpu
				return gpu, nil
			}
			vals[key] = ref
			return ref, nil
		}
		if whole {
			_, err = engine.V41WholeStep(d.Model, st, tok, p, hook)
		} else {
			_, err = engine.V41Step(d.Model, st, xs, p, hook)
		}
		if err != nil {
			return nil, err
		}
		inputs, skipped := v41AccountHeld(d, p, dumped, rep.Results, notMod)
		rep.Coverage.Inputs = append(rep.Coverage.Inputs, inputs...)
		rep.Results = append(rep.Results, skipped...)
	}
	if mode == Propagated && rep.First != nil {
		// The chain's first divergence is reported only as far as the
		// teacher-forced replay backs it.
		if err := v41ConfirmLocally(d, steps, tol, rep); err != nil {
			return nil, err
		}
	}
	rep.Coverage.Scope = v41Scope(d.Model)
	rep.Coverage.NotModelled = []string{}
	for n := range notMod {
		rep.Coverage.NotModelled = append(rep.Coverage.NotModelled, n)
	}
	slices.Sort(rep.Coverage.NotModelled)
	rep.finish()
	return rep, nil
}

// v41JudgeStage is JudgeStage for a V4.1 stage: a set-mode index_sel is
// judged against the scores its top-k ran on (index_score_masked at a
// layer using the candidate mask) and must also be sorted by position (V4.1
// re-sorts the top-k; a set in another order is another list for the
// chunked attention kernel).
func v41JudgeStage(sr *StageResult, ref, gpu engine.Tensor, in map[string]engine.Tensor, st StageTol, window int) {
	if st.Mode == TolSet {
		if m, ok := in["index_score_masked"]; ok {
			in = map[string]engine.Tensor{"index_score": m}
		}
	}
	JudgeStage(sr, ref, gpu, in, st, JudgeContext{GPURope: true, Window: window})
	if st.Mode == TolSet && sr.Stage == "index_sel" && sr.Status != StatusFail && !slices.IsSorted(gpu.I) {
		sr.Status, sr.Severity = StatusFail, 1
		sr.Reason = fmt.Sprintf("the selected rows %v are not sorted by position (V4.1 re-sorts the top-k)", gpu.I)
	}
}

// v41Inputs says where each input of a stage came from in this replay.
func v41Inputs(l int, def engine.V41StageDef, status map[string]string, mode Mode, whole bool) []InputInfo {
	out := []InputInfo{}
	for _, name := range def.Inputs {
		ii := InputInfo{Name: name, Status: "unchecked"}
		switch {
		case strings.HasPrefix(name, engine.GlobalPrefix):
			ii.From = "dump"
		case strings.HasPrefix(name, engine.BelowPrefix):
			base := strings.TrimPrefix(name, engine.BelowPrefix)
			ii.Name = fmt.Sprintf("%s (layer %d)", base, l-1)
			s := status[fmt.Sprintf("%d.%s", l-1, base)]
			ii.From, ii.Status = v41From(s, mode), v41InputStatus(s)
		case strings.HasPrefix(name, engine.PrevPrefix):
			ii.From = "dump@prev"
		case strings.HasPrefix(name, engine.SharedPrefix):
			// published by the latest earlier layer of the step holding it
			base := strings.TrimPrefix(name, engine.SharedPrefix)
			ii.From = "reference"
			for k := l - 1; k >= 0; k-- {
				s, ok := status[fmt.Sprintf("%d.%s", k, base)]
				if !ok {
					continue
				}
				ii.Name = fmt.Sprintf("%s (layer %d)", name, k)
				ii.From = v41From(s, mode)
				ii.Status = v41InputStatus(s)
				break
			}
		case name == "x" && !whole:
			ii.From = "dump"
		default:
			s := status[fmt.Sprintf("%d.%s", l, name)]
			ii.From, ii.Status = v41From(s, mode), v41InputStatus(s)
		}
		out = append(out, ii)
	}
	return out
}

// v41From is where an input with this replay status came from.
func v41From(status string, mode Mode) string {
	switch {
	case status == StatusMissing:
		return "reference"
	case mode == Local:
		return "dump"
	}
	return "propagated"
}

func v41InputStatus(status string) string {
	switch status {
	case StatusPass, StatusTie:
		return "matched"
	case StatusFail:
		return "diverged"
	}
	return "unchecked"
}

// v41Divergence is the diagnosis of the first failing V4.1 stage: its kind
// and hint, and which known alternative (engine.V41Hypotheses) reproduces the
// dumped value bit for bit from the same inputs.
func v41Divergence(d *V41Dump, sr StageResult, l int, p int64, stage string, in map[string]engine.Tensor, ref, gpu engine.Tensor, mode Mode) *Divergence {
	kind := v41Kind(stage)
	if m := sr.Metrics; m != nil && (m.RefNaN != m.GPUNaN || m.RefInf != m.GPUInf || len(m.NonFiniteRows) > 0) {
		kind = KindNonFinite
	}
	for _, ii := range sr.Inputs {
		if ii.Status == "diverged" {
			kind = KindUpstream
		}
	}
	dv := &Divergence{Step: p, Layer: l, Stage: stage, Kind: kind, Why: sr.Reason, Mode: string(mode), Inputs: sr.Inputs, Hint: v41Hints[kind]}
	if hyps := engine.V41Hypotheses(stage); len(hyps) > 0 && kind != KindUpstream {
		ctx := &engine.V41Context{Cfg: d.Cfg, Layer: l, Pos: p, W: d.Model.Layers[l], Rope: d.Model.Rope[l], Head: d.Model.Head}
		v := &attribute.Verdict{Stage: stage, Reference: v41Match("reference", "the reference from the same inputs", ref, gpu), Exact: []string{}, Tried: []attribute.Match{}}
		for _, h := range hyps {
			alt, err := h.Compute(ctx, in)
			var m attribute.Match
			if err != nil {
				m = attribute.Match{Name: h.Name, Desc: h.Why, Skip: err.Error()}
			} else {
				m = v41Match(h.Name, h.Why, alt, gpu)
			}
			v.Tried = append(v.Tried, m)
			if m.Exact {
				v.Exact = append(v.Exact, h.Name)
				if v.Best == nil {
					mm := m
					v.Best = &mm
				}
			}
		}
		dv.Hypothesis = v
		if t := v.Text(); t != "" {
			dv.Detail = append(dv.Detail, t)
		}
	}
	dv.Text = fmt.Sprintf("first divergence: decode step %d, layer %d, stage %s — %s: %s", p, l, stage, kind, sr.Reason)
	return dv
}

// v41Match is the distance of a tensor to the GPU's (bits differing).
func v41Match(name, desc string, t, gpu engine.Tensor) attribute.Match {
	m := attribute.Match{Name: name, Desc: desc, N: max(len(gpu.F), len(gpu.I))}
	if len(t.F) != len(gpu.F) || len(t.I) != len(gpu.I) {
		m.Differ = m.N
		return m
	}
	for i := range gpu.I {
		if t.I[i] != gpu.I[i] {
			m.Differ++
		}
	}
	for i := range gpu.F {
		if !v41Same(engine.FromF(gpu.Kind, t.F[i:i+1], 1), engine.FromF(gpu.Kind, gpu.F[i:i+1], 1)) {
			m.Differ++
		}
	}
	m.Exact = m.Differ == 0
	return m
}

// WhyV41NoBlock is why a V4.1 block stage (mHC, MoE, head) was not compared
// in a replay of the attention sub-layers only.
const WhyV41NoBlock = "the dump's weights have no block weights (layers.L.hc_attn_fn, ffn.*, embed/norm/head): the reference ran the attention sub-layers only"

// v41AccountHeld accounts for the tensors of step p's file (dumped) that no
// result of the step covers: the inputs (tok / token and pos; each layer's
// x when the reference runs the attention sub-layers only), returned, and
// the rest as skipped results with why (WhyV41NoBlock, WhyNotModelled;
// notMod collects the names of the latter).
func v41AccountHeld(d *V41Dump, p int64, dumped map[string]engine.Tensor, results []StageResult, notMod map[string]bool) (inputs []NotChecked, skipped []StageResult) {
	cfg := d.Cfg
	whole := d.Model.Whole()
	have := map[string]bool{}
	for _, r := range results {
		if r.Step == p && r.Status != StatusMissing {
			have[fmt.Sprintf("L%d.%s", r.Layer, r.Stage)] = true
			have[r.Stage] = true // the stages of no layer are keyed by name
		}
	}
	blockLayer := map[int]map[string]bool{}
	globalBlock := map[string]bool{}
	for l := 0; l < cfg.NLayers; l++ {
		blockLayer[l] = map[string]bool{}
		for _, def := range engine.V41WholeStages(cfg, l, p) {
			if def.Global {
				globalBlock[def.Name] = true
			} else {
				blockLayer[l][def.Name] = true
			}
		}
	}
	names := make([]string, 0, len(dumped))
	for n := range dumped {
		names = append(names, n)
	}
	slices.Sort(names)
	last := cfg.NLayers - 1
	for _, n := range names {
		var l int
		var stage string
		if k, err := fmt.Sscanf(n, "L%d.%s", &l, &stage); err != nil || k != 2 || l < 0 || l >= cfg.NLayers {
			// a tensor of no layer
			switch {
			case have[n]:
			case n == "tok" || n == "token" || n == "pos":
				inputs = append(inputs, NotChecked{Step: p, Layer: -1, Stage: n, Why: WhyInputToken})
			case globalBlock[n] && !whole:
				skipped = append(skipped, StageResult{Step: p, Layer: last, Stage: n, Status: StatusSkipped, Reason: WhyV41NoBlock, Inputs: []InputInfo{}})
			default:
				notMod[n] = true
				skipped = append(skipped, StageResult{Step: p, Layer: last, Stage: n, Status: StatusSkipped, Reason: WhyNotModelled, Inputs: []InputInfo{}})
			}
			continue
		}
		switch {
		case have[n]:
		case stage == "x" && !whole:
			inputs = append(inputs, NotChecked{Step: p, Layer: l, Stage: stage, Why: WhyInputX})
		case blockLayer[l][stage] && !whole:
			skipped = append(skipped, StageResult{Step: p, Layer: l, Stage: stage, Status: StatusSkipped, Reason: WhyV41NoBlock, Inputs: []InputInfo{}})
		default:
			notMod[stage] = true
			skipped = append(skipped, StageResult{Step: p, Layer: l, Stage: stage, Status: StatusSkipped, Reason: WhyNotModelled, Inputs: []InputInfo{}})
		}
	}
	// In (layer, name) order, as the report's results.
	slices.SortStableFunc(inputs, func(a, b NotChecked) int { return a.Layer - b.Layer })
	slices.SortStableFunc(skipped, func(a, b StageResult) int { return a.Layer - b.Layer })
	return inputs, skipped
}
