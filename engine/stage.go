package engine

import (
	"fmt"
	"strings"

	"sparsemla/attention"
)

// RopeTable is the layer's cos/sin table (attention.RopeTable): computed, or the
// GPU's own when a dump carries one.
type RopeTable = attention.RopeTable

// StepContext is what a stage computation may read besides its inputs.
type StepContext struct {
	Cfg   *Config       // model config (engine/config.go)
	Layer int           // layer index
	Pos   int64         // p, absolute position of the decoded token (p > 0)
	W     *LayerWeights // attention-path weights of this layer
	Rope  *RopeTable    // this layer's cos/sin table (the GPU's own when a dump carries one)
	Head  *HeadWeights  // embedding and head (nil: none; h_in of layer 0 and logits are then not computed)
}

// Check validates the context once before a step: the layer exists, the
// weights are this layer's, the position is a decode position inside the RoPE
// table.
func (c *StepContext) Check() error {
	if c.Cfg == nil || c.W == nil || c.Rope == nil {
		return fmt.Errorf("engine: step context needs Cfg, W and Rope")
	}
	if c.Layer < 0 || c.Layer >= c.Cfg.NLayers {
		return fmt.Errorf("engine: layer %d outside the model (%d layers)", c.Layer, c.Cfg.NLayers)
	}
	if c.W.Layer != c.Layer || c.W.Ratio != c.Cfg.Ratio(c.Layer) {
		return fmt.Errorf("engine: weights are layer %d (r = %d), the step is layer %d (r = %d)", c.W.Layer, c.W.Ratio, c.Layer, c.Cfg.Ratio(c.Layer))
	}
	if c.Pos <= 0 {
		return fmt.Errorf("engine: decode position %d: decode steps start at p = 1 (p = 0 is a prefill)", c.Pos)
	}
	if c.Pos >= int64(c.Rope.T) {
		return fmt.Errorf("engine: position %d outside the RoPE table (%d positions, %s)", c.Pos, c.Rope.T, c.Rope.Source)
	}
	return nil
}

// LayerRope computes layer l's RoPE table for positions 0 … T−1 (spec §3.6).
func LayerRope(cfg *Config, layer int, T int) *RopeTable {
	return attention.NewRopeTable(cfg.RopeParams(layer), T)
}

// StageDef says how the reference computes one stage of one layer at one decode step.
type StageDef struct {
	Name     string   // canonical stage name, e.g. "q_a"
	Inputs   []string // stages it reads: same-step names ("cq"), or "prev:<name>" for the value after the previous step / the start state
	Equation string   // one line, e.g. "q_a = FP8Lin(wq_a, x)", for explain and reports
	Compute  func(ctx *StepContext, in map[string]Tensor) (Tensor, error)
	// Global says the stage's dumped value belongs to no layer (logits, at
	// dump layer Global); it is computed, and reported, with its layer.
	Global bool
}

// PrevPrefix marks an input read from the state before the step ("prev:kv_cache").
const PrevPrefix = "prev:"

// Stages lists the layer's stages at step pos in spec order (§2.3, §4): the
// query path, the window K, (r = 4) the indexer with its compressor, the index
// list, (r > 0) the main compressor, the cache write, attention, the inverse
// RoPE and the two output projections. Emission-only stages (cmp_pooled …
// cmp_row, icmp_pooled … icmp_row) appear only at steps where (pos+1) mod r == 0.
// The input "x" is the bf16 attention input; "prev:<state>" inputs are the
// StateTensors of the state before the step.
func Stages(cfg *Config, layer int, pos int64) []StageDef {
	if cfg.V32() {
		return V32Stages(cfg, layer, pos)
	}
	r := cfg.Ratio(layer)
	var defs []StageDef
	add := func(name, eq string, compute func(*StepContext, map[string]Tensor) (Tensor, error), inputs ...string) {
		defs = append(defs, StageDef{Name: name, Inputs: inputs, Equation: eq, Compute: compute})
	}
	add("q_a", "q_a = FP8Lin(wq_a, x)", stageQA, "x")
	add("cq", "cq = RMSNorm(q_a) ⊙ q_norm", stageCQ, "q_a")
	add("q_b", "q_b = FP8Lin(wq_b, cq) viewed [H][head_dim]", stageQB, "cq")
	add("q_pe_prerope", "q_pe_prerope = HeadRMS(q_b)[:, nope:]  (every op rounds to bf16)", stageQPePrerope, "q_b")
	add("q", "q = [HeadRMS(q_b)[:, :nope] | RoPE(q_pe_prerope, p)]", stageQ, "q_b", "q_pe_prerope")
	add("kv_raw", "kv_raw = FP8Lin(wkv, x)", stageKVRaw, "x")
	add("kv_normed", "kv_normed = RMSNorm(kv_raw) ⊙ kv_norm", stageKVNormed, "kv_raw")
	add("kv_roped", "kv_roped = kv_normed with RoPE(dims nope:, p)", stageKVRoped, "kv_normed")
	add("kv", "kv = kv_roped with FQ8(dims :nope, 64)  (window K = V)", stageKV, "kv_roped")
	emit := attention.EmitsRow(pos, r)
	if r == 4 {
		add("iq_b", "iq_b = FP8Lin(indexer.wq_b, cq) viewed [H_I][128]", stageIqB, "cq")
		add("iq_roped", "iq_roped = iq_b with RoPE(dims 64:, p)", stageIqRoped, "iq_b")
		add("iq_had", "iq_had = Had(iq_roped) per head", stageIqHad, "iq_roped")
		add("iq", "iq = FQ4(iq_had, 32) per head", stageIq, "iq_had")
		addCompressor(add, "icmp_", true, emit)
		add("icache", "icache = prev:icache ++ icmp_row (if emitted)", stageICache, icacheInputs(emit)...)
		add("iw_raw", "iw_raw = bf16(weights_proj · x)", stageIwRaw, "x")
		add("iw", "iw = bf16(iw_raw · f32(128^-0.5 · H_I^-0.5))", stageIw, "iw_raw")
		add("index_qk", "index_qk[h][j] = bf16(iq[h] · icache[j])", stageIndexQK, "iq", "icache")
		add("index_score", "index_score[j] = bf16(Σ_h bf16(ReLU(index_qk[h][j]) · iw[h]))", stageIndexScore, "index_qk", "iw")
		add("index_topk", "index_topk = top-min(index_topk, Tc) rows of index_score (larger score, then lower row)", stageIndexTopK, "index_score")
		add("index_sel", "index_sel = index_topk + 128", stageIndexSel, "index_topk")
		add("topk_idxs", "topk_idxs = WindowIdx(p) ++ index_sel", stageTopkIdxs, "index_sel")
	} else if r == 128 {
		add("topk_idxs", "topk_idxs = WindowIdx(p) ++ [128 + j for j < Tc]", stageTopkIdxs)
	} else {
		add("topk_idxs", "topk_idxs = WindowIdx(p)", stageTopkIdxs)
	}
	if r > 0 {
		addCompressor(add, "cmp_", false, emit)
	}
	kvIn := []string{PrevPrefix + "kv_cache", "kv"}
	if r > 0 && emit {
		kvIn = append(kvIn, "cmp_row")
	}
	add("kv_cache", "kv_cache[p mod 128] = kv; kv_cache[128 + p div r] = cmp_row (if emitted)", stageKVCache, kvIn...)
	add("o", "o = SparseAttn(q, kv_cache[topk_idxs], attn_sink, τ = head_dim^-0.5)", stageO, "q", "kv_cache", "topk_idxs")
	add("o_inv", "o_inv = o with RoPE⁻¹(dims nope:, p)", stageOInv, "o")
	add("u", "u[g] = bf16(wo_a[g] · o_inv[heads of group g])", stageU, "o_inv")
	add("y", "y = FP8Lin(wo_b, u)", stageY, "u")
	applyPolicy(cfg, defs)
	if cfg.BF16Checkpoint() {
		for i := range defs {
			defs[i].Equation = strings.ReplaceAll(defs[i].Equation, "FP8Lin(", "BF16Lin(")
		}
	}
	return defs
}

func icacheInputs(emit bool) []string {
	if emit {
		return []string{PrevPrefix + "icache", "icmp_row"}
	}
	return []string{PrevPrefix + "icache"}
}

// addCompressor adds the stages of the main (p = "cmp_") or indexer
// (p = "icmp_") compressor.
func addCompressor(add func(string, string, func(*StepContext, map[string]Tensor) (Tensor, error), ...string), p string, idx, emit bool) {
	c := func(ctx *StepContext) *attention.Compressor {
		if idx {
			return ctx.W.Indexer.Compressor
		}
		return ctx.W.Compressor
	}
	add(p+"a", p+"a = Wkv · f32(x)  (fp32)", func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		return cmpProject(ctx, c(ctx), in, true)
	}, "x")
	add(p+"b", p+"b = Wgate · f32(x)  (fp32, ape not yet added)", func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		return cmpProject(ctx, c(ctx), in, false)
	}, "x")
	add(p+"kv_state", p+"kv_state = prev with row (r=4: 4 + p mod 4; r=128: p mod 128) ← "+p+"a; r=4 emission shifts rows 4..7 to 0..3",
		func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
			return cmpState(ctx, c(ctx), in, p, true)
		}, PrevPrefix+p+"kv_state", p+"a")
	add(p+"score_state", p+"score_state = prev with the same row ← "+p+"b + ape[p mod r]",
		func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
			return cmpState(ctx, c(ctx), in, p, false)
		}, PrevPrefix+p+"score_state", p+"b")
	if !emit {
		return
	}
	add(p+"pooled", p+"pooled = bf16(Σ_e softmax_e(score) ⊙ kv) over the group's entries (per channel)",
		func(ctx *StepContext, in map[string]Tensor) (Tensor, error) { return cmpPooled(ctx, c(ctx), in, p) },
		PrevPrefix+p+"kv_state", PrevPrefix+p+"score_state", p+"a", p+"b")
	add(p+"normed", p+"normed = RMSNorm("+p+"pooled) ⊙ compressor.norm",
		func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
			return cmpRowStage(ctx, c(ctx), in, p+"pooled", "normed")
		},
		p+"pooled")
	add(p+"roped", p+"roped = "+p+"normed with RoPE(last 64 dims, j·r)",
		func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
			return cmpRowStage(ctx, c(ctx), in, p+"normed", "roped")
		},
		p+"normed")
	last := p + "roped"
	if idx {
		add(p+"had", p+"had = Had("+p+"roped)",
			func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
				return cmpRowStage(ctx, c(ctx), in, p+"roped", "had")
			},
			p+"roped")
		last = p + "had"
		add(p+"row", p+"row = FQ4("+p+"had, 32)  (index key j = p div 4)",
			func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
				return cmpRowStage(ctx, c(ctx), in, last, "row")
			},
			last)
		return
	}
	add(p+"row", p+"row = "+p+"roped with FQ8(dims :nope, 64)  (kv_cache row 128 + p div r)",
		func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
			return cmpRowStage(ctx, c(ctx), in, last, "row")
		},
		last)
}

// RunStep is the propagated path: from x (bf16 [dim]) and the state before the
// step it chains every stage's Compute on the reference's own outputs and
// returns all stage tensors (keyed by name) and the state after the step. st is
// not modified.
func RunStep(ctx *StepContext, x Tensor, st *LayerState) (map[string]Tensor, *LayerState, error) {
	return RunStepHooked(ctx, x, st, nil)
}

// StageHook is called by RunStepHooked after each stage's Compute with the stage
// and the inputs it read; it returns the value later stages read as that
// stage (the computed one, or a substitute) and may stop the step with an
// error.
type StageHook func(def StageDef, in map[string]Tensor, t Tensor) (Tensor, error)

// RunStepHooked is RunStep with an optional hook after each stage (nil: none). The
// propagated replay compares each stage with the dump there, and follows the
// GPU's selection where it is a legal top-k tie choice.
func RunStepHooked(ctx *StepContext, x Tensor, st *LayerState, hook StageHook) (map[string]Tensor, *LayerState, error) {
	return runDefs(ctx, Stages(ctx.Cfg, ctx.Layer, ctx.Pos), map[string]Tensor{"x": x}, st, hook)
}

// RunLayer is RunStep for the whole layer (BlockStages): from seeds — h_in
// (bf16 [hc, dim]) and the token (GlobalPrefix+"tok", i64 [1]); on layer 0
// with head weights the token alone, h_in being its embedding — and the
// state before the step it chains every stage on the reference's own
// outputs up to h_out (and the logits on the last layer when ctx.Head is
// set). st is not modified.
func RunLayer(ctx *StepContext, seeds map[string]Tensor, st *LayerState) (map[string]Tensor, *LayerState, error) {
	return RunLayerHooked(ctx, seeds, st, nil)
}

// RunLayerHooked is RunLayer with a hook after each stage (nil: none).
func RunLayerHooked(ctx *StepContext, seeds map[string]Tensor, st *LayerState, hook StageHook) (map[string]Tensor, *LayerState, error) {
	return runDefs(ctx, BlockStages(ctx.Cfg, ctx.Layer, ctx.Pos, ctx.W, ctx.Head), seeds, st, hook)
}

// runDefs chains the stages defs from the seed values and the state before
// the step (the "prev:<state>" inputs).
func runDefs(ctx *StepContext, defs []StageDef, seeds map[string]Tensor, st *LayerState, hook StageHook) (map[string]Tensor, *LayerState, error) {
	if err := ctx.Check(); err != nil {
		return nil, nil, err
	}
	if st.Next != 0 && st.Next != ctx.Pos {
		return nil, nil, fmt.Errorf("engine: layer %d: the state is at position %d, the step decodes position %d", ctx.Layer, st.Next, ctx.Pos)
	}
	avail := make(map[string]Tensor, len(seeds))
	for name, t := range seeds {
		avail[name] = t
	}
	for name, t := range st.StateTensors() {
		avail[PrevPrefix+name] = t
	}
	out := make(map[string]Tensor)
	for _, def := range defs {
		in := make(map[string]Tensor, len(def.Inputs))
		for _, name := range def.Inputs {
			t, ok := avail[name]
			if !ok {
				return nil, nil, fmt.Errorf("engine: layer %d step %d: stage %s needs %s, which no earlier stage produced", ctx.Layer, ctx.Pos, def.Name, name)
			}
			in[name] = t
		}
		t, err := def.Compute(ctx, in)
		if err != nil {
			return nil, nil, fmt.Errorf("engine: layer %d step %d: stage %s: %w", ctx.Layer, ctx.Pos, def.Name, err)
		}
		if hook != nil {
			if t, err = hook(def, in, t); err != nil {
				return nil, nil, err
			}
		}
		avail[def.Name] = t
		out[def.Name] = t
	}
	next, err := LoadState(ctx.Cfg, ctx.Layer, out)
	if err != nil {
		return nil, nil, err
	}
	next.Next = ctx.Pos + 1
	return out, next, nil
}
