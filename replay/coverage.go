package replay

import (
	"fmt"
	"slices"
	"strings"

	"sparsemla/dump"
	"sparsemla/engine"
)

// The reasons a held stage tensor was not compared, or was read as an input,
// besides the per-stage reasons of a skipped stage (an input unavailable, the
// reference failing on the dumped inputs). They are the same words in the
// text report, the HTML page and the JSON (coverage.not_checked[].why,
// coverage.inputs[].why), so that a report groups tensors by them.
const (
	// WhyNotModelled: the name is no stage of the reference's model (an
	// engine's own buffer, an intermediate the reference computes inside
	// another stage).
	WhyNotModelled = "not a stage the reference models"
	// WhyNoBlockWeights: a stage of the whole layer (mHC, norms, MoE) of a
	// layer whose weights the weights given do not hold.
	WhyNoBlockWeights = "the weights given have no whole-layer tensors for this layer (hc_attn_*, hc_ffn_*, attn_norm, ffn_norm, ffn.*): the reference ran its attention sub-layer only"
	// WhyNoV32BlockWeights is WhyNoBlockWeights of a V3.2 layer.
	WhyNoV32BlockWeights = "the weights given have no whole-layer tensors for this layer (attn_norm, ffn_norm, ffn.*): the reference ran its attention sub-layer only"
	// WhyNoHead: the logits, with weights that hold no head.
	WhyNoHead = "the weights given have no head (hc_head_*, norm, head)"
	// WhyNoV32BlockInput: a V3.2 step whose Block input x_in is not dumped
	// runs the attention sub-layer from the dumped x alone.
	WhyNoV32BlockInput = "the dump holds no x_in (the layer's Block input) at this step: the reference ran the attention sub-layer from the dumped x"
	// WhyPagesNoKVCache: KV page records beside no compared kv_cache.
	WhyPagesNoKVCache = "KV page bytes are judged against the dumped kv_cache rows, and the kv_cache of this step and layer was not compared (not dumped, or skipped)"
	// WhySplitRecord: a split-K record that was not judged.
	WhySplitRecord = "a split-K record judged only beside a computed o, over the splits split_bounds names"

	// WhyInputToken: tok and pos, the model's input at each step.
	WhyInputToken = "the token fed and its position: the model's input at each step"
	// WhyInputX: each layer's attention input x when the reference runs
	// the attention sub-layer only.
	WhyInputX = "the attention sub-layer's input: the reference starts each layer from the dumped x"
	// WhyInputHInPropagated: propagated mode starts each layer's chain
	// from its dumped h_in.
	WhyInputHInPropagated = "propagated mode starts each layer's chain from its dumped h_in (local and chained mode compare it with the h_out of the layer below)"
	// WhyInputHInNoBelow: a local replay compares h_in with the dumped
	// h_out of the layer below, when the dump holds it.
	WhyInputHInNoBelow = "the layer's input: the dump holds no h_out of the layer below to compare it with (chained mode compares it with the chain's own)"
	// WhyInputNoEmbed: layer 0's input (V4 h_in, V3.2 x_in) when the
	// weights hold no embedding to compute it from the token.
	WhyInputNoEmbed = "layer 0's input: the weights given have no embedding (embed.weight) to compute it from the token, so the replay starts layer 0 from it"
	// WhyInputV32Block: a V3.2 layer's Block inputs in a local or
	// propagated replay.
	WhyInputV32Block = "the layer's Block input, read from the dump (chained mode compares it with the ffn_out / h_mid of the layer below, and layer 0's with the embedding row of the token when the weights hold the embedding)"
	// WhyInputOther: another tensor a replayed stage reads from the dump
	// and that no replayed stage computes.
	WhyInputOther = "an input the replayed stages read from the dump, computed by no stage of this replay"
)

// accountHeld accounts for every stage tensor src holds at the replayed
// steps and layers that no result of units (in (step, layer) order) covers:
// an input the replay starts from (returned, not compared, not making the
// report incomplete: the token and position of each step, each layer's x
// when the reference runs the attention sub-layer only, the h_in each
// layer's chain starts from in propagated mode, a layer's h_in that no h_out
// below can be compared with, layer 0's input when the weights hold no
// embedding) or a tensor not compared, added to its unit's
// results as skipped with the reason (the weights given lack the part that
// computes it, the reference does not model it). notModelled names the
// latter of no reference stage, sorted. Without a StageLister src nothing is
// accounted for.
func accountHeld(m *engine.Model, src Source, mode Mode, steps []int64, layers []int, units []unitResult) (inputs []NotChecked, notModelled []string, _ error) {
	sl, ok := src.(StageLister)
	if !ok || len(layers) == 0 || len(units) != len(steps)*len(layers) {
		return nil, nil, nil
	}
	nm := map[string]bool{}
	for si, p := range steps {
		for li, l := range layers {
			ur := &units[si*len(layers)+li]
			have := map[string]bool{}
			for _, r := range ur.results {
				if r.Status != StatusMissing {
					have[r.Stage] = true
				}
			}
			ran := ranStages(m, src, mode, p, l)
			full := fullStageNames(m.Cfg, l, p)
			for _, n := range sl.StageNames(p, l) {
				if have[n] {
					continue
				}
				input, why, err := classifyHeld(m, src, mode, p, l, n, ran, full)
				if err != nil {
					return nil, nil, err
				}
				if input {
					inputs = append(inputs, NotChecked{Step: p, Layer: l, Stage: n, Why: why})
					continue
				}
				if why == WhyNotModelled {
					nm[n] = true
				}
				ur.results = append(ur.results, StageResult{Step: p, Layer: l, Stage: n, Status: StatusSkipped, Reason: why, Inputs: []InputInfo{}})
			}
			// The KV page records (kind page) the dump holds there: judged
			// against the dumped kv_cache beside a compared kv_cache.
			if ps, ok := src.(PageSource); ok && !have["kv_pages"] {
				pages, err := ps.Pages(p, l)
				if err != nil {
					return nil, nil, err
				}
				if len(pages) > 0 {
					ur.results = append(ur.results, StageResult{Step: p, Layer: l, Stage: "kv_pages", Status: StatusSkipped, Reason: WhyPagesNoKVCache, Inputs: []InputInfo{}})
				}
			}
		}
		// The tensors of no layer (tok, pos, logits), with the step's
		// last layer (where the logits are judged).
		ur := &units[si*len(layers)+len(layers)-1]
		last := layers[len(layers)-1]
		have := map[string]bool{}
		for li := range layers {
			for _, r := range units[si*len(layers)+li].results {
				if r.Stage == "logits" && r.Status != StatusMissing {
					have[r.Stage] = true
				}
			}
		}
		for _, n := range sl.StageNames(p, dump.Global) {
			switch {
			case have[n]:
			case n == "tok" || n == "pos":
				inputs = append(inputs, NotChecked{Step: p, Layer: dump.Global, Stage: n, Why: WhyInputToken})
			default:
				why := WhyNotModelled
				if n == "logits" {
					why = "logits: not computed by this replay"
					if !hasHead(m) {
						why = WhyNoHead
					} else if last != m.Cfg.NLayers-1 {
						why = fmt.Sprintf("the replay does not run the last layer (%d), whose output the head reads", m.Cfg.NLayers-1)
					} else if w := m.Weights[last]; w != nil && !hasWholeLayer(m.Cfg, w) {
						why = blockWhy(m.Cfg)
					}
				} else {
					nm[n] = true
				}
				ur.results = append(ur.results, StageResult{Step: p, Layer: last, Stage: n, Status: StatusSkipped, Reason: why, Inputs: []InputInfo{}})
			}
		}
	}
	for n := range nm {
		notModelled = append(notModelled, n)
	}
	slices.Sort(notModelled)
	return inputs, notModelled, nil
}

// hasHead reports whether m holds the head the logits need.
func hasHead(m *engine.Model) bool {
	if m.Cfg.V32() {
		w := m.Weights[m.Cfg.NLayers-1]
		return w != nil && w.V32 != nil && w.V32.FFN != nil && w.V32.FFN.Head != nil
	}
	return m.Head != nil && m.Head.Head != nil
}

// hasWholeLayer reports whether w holds the whole layer (not the attention
// sub-layer only).
func hasWholeLayer(cfg *engine.Config, w *engine.LayerWeights) bool {
	if cfg.V32() {
		return w.V32 != nil && w.V32.FFN != nil
	}
	return w.Block != nil
}

func blockWhy(cfg *engine.Config) string {
	if cfg.V32() {
		return WhyNoV32BlockWeights
	}
	return WhyNoBlockWeights
}

// ranSet is what a replay runs at one step and layer: the names of its
// stages (defs) and the inputs they read from the dump (the names they read
// that none of them computes).
type ranSet struct {
	defs   map[string]bool
	inputs map[string]bool
}

// ranStages is the ranSet of a replay in mode at (p, l) with m's weights.
func ranStages(m *engine.Model, src Source, mode Mode, p int64, l int) ranSet {
	r := ranSet{defs: map[string]bool{}, inputs: map[string]bool{}}
	w := m.Weights[l]
	defs := engine.BlockStages(m.Cfg, l, p, w, m.Head)
	if m.Cfg.V32() && mode != Chained {
		if d, err := v32LocalDefs(m, src, unit{p, l}, defs); err == nil {
			defs = d
		}
	}
	for _, d := range defs {
		r.defs[d.Name] = true
	}
	for _, d := range defs {
		for _, in := range d.Inputs {
			if strings.HasPrefix(in, engine.PrevPrefix) || strings.HasPrefix(in, engine.GlobalPrefix) || r.defs[in] {
				continue
			}
			r.inputs[in] = true
		}
	}
	return r
}

// fullStageNames are the stages of the whole model at (p, l): what a replay
// with every weight (the whole layer, the embedding, the head) defines.
func fullStageNames(cfg *engine.Config, l int, p int64) map[string]bool {
	out := map[string]bool{}
	if cfg.V32() {
		w := &engine.LayerWeights{V32: &engine.V32Weights{FFN: &engine.V32FFNWeights{Head: []float32{0}}}}
		for _, d := range engine.V32BlockStages(cfg, l, p, w) {
			out[d.Name] = true
		}
		out["x_in"], out["res_in"] = true, true
		return out
	}
	out["h_in"] = true // layer 0: from the embedding; above: the h_out below
	for _, n := range engine.WholeStageNames(cfg, l, p) {
		out[n] = true
	}
	return out
}

// classifyHeld says why held tensor n at (p, l), which no result covers,
// was not compared: input true when it is an input the replay starts from.
func classifyHeld(m *engine.Model, src Source, mode Mode, p int64, l int, n string, ran ranSet, full map[string]bool) (input bool, why string, _ error) {
	w := m.Weights[l]
	whole := w != nil && hasWholeLayer(m.Cfg, w)
	switch {
	case isSplitStage(n):
		return false, WhySplitRecord, nil
	case !m.Cfg.V32() && n == "h_in":
		switch {
		case !whole:
			return false, blockWhy(m.Cfg), nil
		case l == 0:
			return true, WhyInputNoEmbed, nil
		case mode == Propagated:
			return true, WhyInputHInPropagated, nil
		}
		below, err := heldBy(src, p, l-1, "h_out")
		if err != nil {
			return false, "", err
		}
		if !below {
			return true, WhyInputHInNoBelow, nil
		}
		return false, "h_in: not compared with the h_out of the layer below", nil
	case n == "x" && ran.inputs["x"]:
		return true, WhyInputX, nil
	case m.Cfg.V32() && mode == Chained && l == 0 && n == "x_in":
		return true, WhyInputNoEmbed, nil
	case ran.inputs[n] && m.Cfg.V32() && (n == "x_in" || n == "res_in"):
		return true, WhyInputV32Block, nil
	case ran.inputs[n]:
		return true, WhyInputOther, nil
	case full[n] && !whole:
		return false, blockWhy(m.Cfg), nil
	case full[n] && m.Cfg.V32():
		return false, WhyNoV32BlockInput, nil
	case full[n]:
		return false, n + ": not computed by this replay", nil
	}
	return false, WhyNotModelled, nil
}

// unreadOf is Coverage.Unread of a replay of src (nil unless src is a
// DumpSource): the first step of a window without a prefill state
// (dump.Dump.Window), and the other tensors no name-map rule placed
// (dump.Dump.Unmapped). prefix ("A: ", "B: " in a diff) starts each why.
func unreadOf(src Source, prefix string) []Unread {
	ds, ok := src.(*DumpSource)
	if !ok || ds.D == nil {
		return nil
	}
	var out []Unread
	n := len(ds.D.Unmapped)
	if w := ds.D.Window; w != nil {
		out = append(out, Unread{Tensors: w.LeftOut, Why: fmt.Sprintf("%sstep %d, the first of this window (no prefill state): nothing says the state before it, so it is not replayed; its %d cache states are the start state of step %d, its other tensors are not compared", prefix, w.Step, w.States, w.Step+1)})
		n -= w.LeftOut
	}
	if n > 0 {
		out = append(out, Unread{Tensors: n, Why: prefix + "no name-map rule places them at a decode step of a request (prefill steps, metadata, unknown names: 'inspect' lists each); not compared"})
	}
	return out
}
