package engine

import (
	"fmt"
	"math/rand/v2"
	"slices"

	"sparsemla/attention"
	"sparsemla/quant"
)

// V41Hook is called after each stage of V41Step with the layer, the stage, the
// inputs it read and its value; it returns the value later stages (and later
// layers, for published stages) read — the computed one or a substitute —
// and may stop the step with an error.
type V41Hook func(layer int, def V41StageDef, in map[string]Tensor, t Tensor) (Tensor, error)

// V41StepResult is one V4.1 decode step of every layer.
type V41StepResult struct {
	Stages []map[string]Tensor // per layer, keyed by stage name
	// From[l][name] is the layer whose publication layer l read as
	// shared:<name> (model.py's shared_attn slots).
	From []map[string]int
	Next *V41State
	// Global holds the whole step's stages of no layer (head_in, head_x,
	// logits, next_token); empty for the attention sub-layers only.
	Global map[string]Tensor
}

// V41Step runs decode position pos of every layer in order, layer l from the
// attention input xs[l] (bf16 [dim]) and its state in st, with the
// SharedAttentionRuntime of model.py: KV sources publish ckv (compress_kv)
// and icache (index_k), the candidate source cand_mask (candidates), index
// sources index_sel (topk_idxs); later layers read the latest publication.
// st is not modified. hook may be nil. A layer without weights (m.Layers[l]
// nil) is not run — its inputs and state may be absent, its Stages and Next
// entries are nil — so a subset of layers can be stepped (V41Needs lists the
// layers one layer's step depends on); a later layer reading something only a
// skipped layer publishes is an error.
func V41Step(m *V41Model, st *V41State, xs []Tensor, pos int64, hook V41Hook) (*V41StepResult, error) {
	if len(xs) != m.Cfg.NLayers {
		return nil, fmt.Errorf("engine: V41Step needs the attention inputs of all %d layers", m.Cfg.NLayers)
	}
	return v41Step(m, st, xs, 0, pos, hook)
}

// V41WholeStep runs the whole decode step of token tok at position pos
// (V41WholeStages: embedding, every layer's pipelined mHC, attention with
// the shared runtime and MoE, the head) on a whole model (V41Model.Whole).
// Layer l's h_in and pre_mix_in are layer l−1's h_out and hc_ffn_pre as
// returned by hook (the dumped values in a teacher-forced replay). The head's
// stages are in Global.
func V41WholeStep(m *V41Model, st *V41State, tok, pos int64, hook V41Hook) (*V41StepResult, error) {
	if !m.Whole() {
		return nil, fmt.Errorf("engine: V41WholeStep needs the whole model (embed, norm, head and every layer's block and MoE weights)")
	}
	if err := v41WholeCheck(m.Cfg); err != nil {
		return nil, err
	}
	return v41Step(m, st, nil, tok, pos, hook)
}

// v41Step is V41Step (xs non-nil: the attention sub-layers) or V41WholeStep
// (xs nil).
func v41Step(m *V41Model, st *V41State, xs []Tensor, tok, pos int64, hook V41Hook) (*V41StepResult, error) {
	cfg := m.Cfg
	whole := xs == nil
	if !cfg.IsV41() {
		return nil, fmt.Errorf("engine: V41Step on a %s config", cfg.Variant())
	}
	if len(m.Layers) != cfg.NLayers || len(st.Layers) != cfg.NLayers {
		return nil, fmt.Errorf("engine: V41Step needs weights and state of all %d layers", cfg.NLayers)
	}
	if pos <= 0 {
		return nil, fmt.Errorf("engine: decode position %d: decode steps start at p = 1", pos)
	}
	if st.Next != 0 && st.Next != pos {
		return nil, fmt.Errorf("engine: the V4.1 state is at position %d, the step decodes position %d", st.Next, pos)
	}
	shared := map[string]Tensor{}
	from := map[string]int{}
	res := &V41StepResult{Next: &V41State{IndexKAt: st.IndexKAt, Next: pos + 1}, Global: map[string]Tensor{}}
	var below map[string]Tensor
	if !m.Options.OwnerIndexKeys && st.IndexKAt >= 0 {
		// The slot still points at the cache published last in the previous
		// forward; that layer has not written this step's key yet.
		if ls := st.Layers[st.IndexKAt]; ls != nil {
			shared["icache"] = ls.StateTensors(cfg)["icache"]
			from["icache"] = st.IndexKAt
		}
	}
	for l := 0; l < cfg.NLayers; l++ {
		if m.Layers[l] == nil {
			res.Next.Layers = append(res.Next.Layers, nil)
			res.Stages = append(res.Stages, nil)
			res.From = append(res.From, nil)
			continue
		}
		if pos >= int64(m.Rope[l].T) {
			return nil, fmt.Errorf("engine: position %d outside layer %d's RoPE table (%d positions)", pos, l, m.Rope[l].T)
		}
		ctx := &V41Context{Cfg: cfg, Layer: l, Pos: pos, W: m.Layers[l], Rope: m.Rope[l], Head: m.Head}
		avail := map[string]Tensor{}
		defs := V41Stages(cfg, l, pos)
		if whole {
			defs = V41WholeStages(cfg, l, pos)
			avail[GlobalPrefix+"tok"] = FromI(KindI64, []int64{tok}, 1)
			for n, t := range below {
				avail[BelowPrefix+n] = t
			}
		} else {
			avail["x"] = xs[l]
		}
		for name, t := range st.Layers[l].StateTensors(cfg) {
			avail[PrevPrefix+name] = t
		}
		readFrom := map[string]int{}
		out := map[string]Tensor{}
		emitted := false
		for _, def := range defs {
			in := make(map[string]Tensor, len(def.Inputs))
			for _, name := range def.Inputs {
				if len(name) > len(SharedPrefix) && name[:len(SharedPrefix)] == SharedPrefix {
					key := name[len(SharedPrefix):]
					t, ok := shared[key]
					if !ok {
						return nil, fmt.Errorf("engine: layer %d step %d: stage %s reads %s, which no earlier layer published", l, pos, def.Name, name)
					}
					in[name] = t
					readFrom[key] = from[key]
					continue
				}
				t, ok := avail[name]
				if !ok {
					return nil, fmt.Errorf("engine: layer %d step %d: stage %s needs %s, which no earlier stage produced", l, pos, def.Name, name)
				}
				in[name] = t
			}
			t, err := def.Compute(ctx, in)
			if err != nil {
				return nil, fmt.Errorf("engine: layer %d step %d: stage %s: %w", l, pos, def.Name, err)
			}
			if hook != nil {
				if t, err = hook(l, def, in, t); err != nil {
					return nil, err
				}
			}
			avail[def.Name] = t
			if def.Global {
				res.Global[def.Name] = t
				continue
			}
			out[def.Name] = t
			switch def.Name {
			case "ik_row":
				emitted = true
			case "ckv", "cand_mask", "index_sel":
				shared[def.Name], from[def.Name] = t, l
			case "icache":
				// Owner keys: the KV source's indexer reads its own cache.
				// Released slot: only a layer that just emitted a key republishes.
				if m.Options.OwnerIndexKeys || emitted {
					shared["icache"], from["icache"] = t, l
					res.Next.IndexKAt = l
				}
			}
		}
		if cfg.IsIndexSource(l) && attention.VisibleRows(pos, cfg.Ratio(l)) == 0 {
			shared["index_sel"], from["index_sel"] = FromI(KindI32, nil, 0), l // an empty list
		}
		ns, err := v41NextState(cfg, l, st.Layers[l], out)
		if err != nil {
			return nil, err
		}
		res.Next.Layers = append(res.Next.Layers, ns)
		res.Stages = append(res.Stages, out)
		res.From = append(res.From, readFrom)
		below = out
	}
	return res, nil
}

// v41NextState is layer l's state after the step from its stage outputs.
func v41NextState(cfg *Config, l int, prev *V41LayerState, out map[string]Tensor) (*V41LayerState, error) {
	ns := prev.Clone()
	w, ok := out["window"]
	if !ok {
		return nil, fmt.Errorf("engine: layer %d: no window stage", l)
	}
	ns.Win = append([]float32(nil), w.F...)
	if t, ok := out["ckv"]; ok {
		ns.CKV = append([]float32(nil), t.F...)
	}
	if t, ok := out["icache"]; ok {
		ns.ICache = append([]float32(nil), t.F...)
	}
	if t, ok := out["cmp_kv_state"]; ok {
		ns.Cmp.KV = append([]float32(nil), t.F...)
		ns.Cmp.Score = append([]float32(nil), out["cmp_score_state"].F...)
	}
	return ns, nil
}

// SyntheticV41Input is the seeded random attention input of layer l at
// position p: bf16(N(0, 1)) [dim].
func SyntheticV41Input(cfg *Config, l int, p int64, seed uint64) Tensor {
	rng := rand.New(rand.NewPCG(seed^uint64(l+1)<<40, uint64(p)))
	x := make([]float32, cfg.Dim)
	for i := range x {
		x[i] = quant.BF16Round(float32(rng.NormFloat64()))
	}
	return FromF(KindBF16, x, cfg.Dim)
}

// SyntheticV41State builds a plausible state of every layer before the token
// at position next, from the seeded inputs SyntheticV41Input:
//
//   - window slots: the real K path (wkv → kv_norm → RoPE at t → FQ8/32) of
//     the last min(next, win) tokens;
//   - KV sources: rows j < next div r from a random bf16 latent finished by the
//     real paths (index key: wk → k_norm → RoPE at j·r → FQ4; row: RoPE at j·r
//     → FQ4E4M3) — on the right grids, not pooled from the tokens;
//   - r = 2 compressor state: the real projections of token next−1 when next
//     is odd (the open group), else the start values;
//   - the index-key slot (model.py's shared_attn.index_k, read by the
//     released behaviour) at the last KV source with an indexer that emitted
//     a key at step next−1, as a decode step next−1 would leave it.
func SyntheticV41State(m *V41Model, next int64, seed uint64) *V41State {
	cfg := m.Cfg
	st := NewV41State(cfg)
	st.Next = next
	D, win := cfg.HeadDim, int64(cfg.WindowSize)
	for l := 0; l < cfg.NLayers; l++ {
		if m.Layers[l] == nil {
			st.Layers[l] = nil
			continue
		}
		w, ls, rope := m.Layers[l], st.Layers[l], m.Rope[l]
		for t := max(0, next-win); t < next; t++ {
			x := SyntheticV41Input(cfg, l, t, seed).F
			k := make([]float32, D)
			attention.V41FP8Linear(k, x, w.Wkv)
			attention.RMSNorm(k, k, w.KVNorm, float32(cfg.NormEps))
			rope.ApplyRope(k[D-attention.RopeDims:], t, false)
			attention.V41FQ8Window(k)
			copy(ls.Win[int(t%win)*D:], k)
		}
		if !cfg.IsKVSource(l) {
			continue
		}
		r := cfg.Ratio(l)
		rng := rand.New(rand.NewPCG(seed, uint64(l)<<32|0x41))
		for j := int64(0); j < next/int64(r); j++ {
			lat := make([]float32, D)
			for i := range lat {
				lat[i] = quant.BF16Round(float32(rng.NormFloat64()))
			}
			w.Compressor.Normed(lat, lat)
			if w.Indexer != nil {
				k := make([]float32, cfg.IndexHeadDim)
				w.Indexer.KeyRaw(k, lat)
				w.Indexer.Key(k, k, j, r, rope)
				ls.ICache = append(ls.ICache, k...)
				if j == next/int64(r)-1 && next%int64(r) == 0 {
					st.IndexKAt = l
				}
			}
			row := make([]float32, D)
			attention.V41KVRow(row, lat, j, r, rope)
			ls.CKV = append(ls.CKV, row...)
		}
		if r == 2 && next%2 == 1 {
			x := SyntheticV41Input(cfg, l, next-1, seed).F
			a, b := make([]float32, D), make([]float32, D)
			w.Compressor.Project(a, b, x)
			w.Compressor.Ingest(ls.Cmp, a, b, next-1)
		}
	}
	return st
}

// V41Needs lists, ascending, the layers whose step layer l's step reads:
// l, its KV source, its index source and, for that index source, the KV
// source of its keys and the candidate source — closed under the same rule —
// and, for an r > 1 KV source with an indexer among them, every later KV
// source with an indexer (the released index-key slot can hold their keys).
// Stepping only these layers (V41Step with the other weights nil) gives
// layer l the publications a whole step would.
func V41Needs(cfg *Config, l int) []int {
	need := map[int]bool{}
	var add func(int)
	add = func(k int) {
		if k < 0 || need[k] {
			return
		}
		need[k] = true
		add(cfg.KVSourceOf(k))
		add(cfg.IndexSourceOf(k))
		if cfg.UsesCandidates(k) {
			add(cfg.CandidateSource())
		}
	}
	add(l)
	// The released index-key slot: an r > 1 KV source with an indexer reads,
	// on steps where its group is open, the keys the last emitting KV source
	// published in the previous step — any later KV source with an indexer.
	for k := range need {
		if cfg.IsKVSource(k) && cfg.IsIndexSource(k) && cfg.Ratio(k) > 1 {
			for _, s := range cfg.KVSources() {
				if s > k && cfg.IsIndexSource(s) {
					add(s)
				}
			}
		}
	}
	out := make([]int, 0, len(need))
	for k := range need {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// NewRandomV41ModelLayers is NewRandomV41Model with weights for the listed
// layers only (the others nil, not run by V41Step).
func NewRandomV41ModelLayers(cfg *Config, seed uint64, T int, layers []int) *V41Model {
	m := &V41Model{Cfg: cfg, Layers: make([]*V41LayerWeights, cfg.NLayers), Rope: make([]*RopeTable, cfg.NLayers)}
	for _, l := range layers {
		m.Layers[l] = RandomV41LayerWeights(cfg, l, seed)
		m.Rope[l] = LayerRope(cfg, l, T)
	}
	return m
}
