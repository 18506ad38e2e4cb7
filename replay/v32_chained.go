package replay

import (
	"context"
	"fmt"

	"sparsemla/dump"
	"sparsemla/engine"
)

// v32Chained is the chained replay of a V3.2 model (mode Chained): at each
// decode step the layers run in order as one model, every layer the whole
// V3.2 layer (engine.V32BlockStages) on its own state carried from the
// dump's start state:
//
//	layer 0:   x_in = embed.weight[tok] when the weights hold the embedding
//	           (judged against the dumped x_in), else the dumped x_in (the
//	           embedding then is not checked: the report's layer-0 x_in
//	           result is absent and this is said in its inputs: from dump)
//	layer l>0: x_in = the chain's ffn_out of layer l−1, res_in = its h_mid
//	           (each judged against the dumped x_in / res_in first: the
//	           layer link)
//	last:      logits = head · norm(ffn_out, h_mid), judged, and the greedy
//	           token argmax(logits) of the chain against the GPU's
//
// so the first divergence over the whole model is found, and the stages of
// every later layer (compared where dumped) show how it grows up to the
// logits. Every dumped step needs layer 0's input (x_in, or the token with
// the embedding): a step without it is refused with the steps that have it.
func v32Chained(ctx context.Context, m *engine.Model, src Source, steps []int64, layers []int, opt Options) ([]unitResult, error) {
	cfg := m.Cfg
	for i, l := range layers {
		if l != i {
			return nil, fmt.Errorf("replay %s: a chained replay needs the layers 0 … n-1 in the dump (have %v)", src.Name(), layers)
		}
		if w := m.Weights[l]; w == nil || w.V32 == nil || w.V32.FFN == nil {
			return nil, fmt.Errorf("replay %s: a chained V3.2 replay needs the whole layer's weights (attn_norm, ffn_norm, ffn.*); layer %d has the attention path only", src.Name(), l)
		}
	}
	if len(layers) != cfg.NLayers {
		return nil, fmt.Errorf("replay %s: a chained replay needs every layer (0 … %d) in the dump (have %v)", src.Name(), cfg.NLayers-1, layers)
	}
	last := m.Weights[cfg.NLayers-1].V32.FFN
	if last.Head == nil {
		return nil, fmt.Errorf("replay %s: a chained V3.2 replay needs the final norm and head (norm.weight, head.weight)", src.Name())
	}
	embed := m.Weights[0].V32.FFN.Embed
	// Every step needs layer 0's input.
	var without, with []int64
	for _, p := range steps {
		ok, err := v32HasChainInput(src, p, embed != nil)
		if err != nil {
			return nil, err
		}
		if ok {
			with = append(with, p)
		} else {
			without = append(without, p)
		}
	}
	if len(without) > 0 {
		need := "x_in of layer 0 (the Block input: the embedding row)"
		if embed != nil {
			need = "the token (tok) or x_in of layer 0"
		}
		have := "none"
		if len(with) > 0 {
			have = StepList(with) + " (replay those with --steps)"
		}
		return nil, fmt.Errorf("replay %s: a chained V3.2 replay starts every step from %s; the dump lacks it at steps %s; it holds it at %s", src.Name(), need, StepList(without), have)
	}
	states := make([]*engine.LayerState, len(layers))
	stFrom := make([]string, len(layers))
	want := make([]int64, len(layers))
	for _, l := range layers {
		stT, after, ok, err := src.State(l)
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, fmt.Errorf("replay %s: chained mode needs the start state of layer %d", src.Name(), l)
		}
		if states[l], err = engine.LoadState(cfg, l, stT); err != nil {
			return nil, fmt.Errorf("replay %s: start state of layer %d: %w", src.Name(), l, err)
		}
		stFrom[l], want[l] = FromStart, after+1
	}
	var out []unitResult
	for si, p := range steps {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		var below map[string]engine.Tensor // the layer below's chain values at p
		for _, l := range layers {
			if p != want[l] {
				ns, err := reseedChain(m, src, l, p, want[l])
				if err != nil {
					return nil, err
				}
				states[l], stFrom[l] = ns, FromPrevDump
			}
			want[l] = p + 1
			sctx := &engine.StepContext{Cfg: cfg, Layer: l, Pos: p, W: m.Weights[l], Rope: m.Rope[l], Head: m.Head}
			cs := &chainStep{
				m: m, src: src, tol: opt.Tol, mode: Chained, p: p, layer: l, sctx: sctx, stFrom: stFrom[l],
				status: map[string]string{}, own: map[string]engine.Tensor{}, followed: map[string]bool{}, seeded: map[string]bool{},
			}
			seeds, err := v32ChainSeeds(cs, embed, below)
			if err != nil {
				return nil, err
			}
			outs, next, err := engine.RunLayerHooked(sctx, seeds, states[l], cs.judge)
			if err != nil {
				return nil, fmt.Errorf("replay %s: step %d layer %d: %w", src.Name(), p, l, err)
			}
			if l == cfg.NLayers-1 {
				if err := v32GreedyToken(cs, outs); err != nil {
					return nil, err
				}
			}
			states[l], stFrom[l] = next, FromPropagate
			below = outs
			out = append(out, cs.ur)
		}
		if opt.Progress != nil {
			opt.Progress(si+1, len(steps))
		}
	}
	return out, nil
}

// v32HasChainInput reports whether step p holds layer 0's chain input: its
// x_in, or (with the embedding) the token.
func v32HasChainInput(src Source, p int64, embed bool) (bool, error) {
	if embed {
		if ok, err := heldBy(src, p, dump.Global, "tok"); err != nil || ok {
			return ok, err
		}
	}
	return heldBy(src, p, 0, "x_in")
}

// v32ChainSeeds are the seeds of one layer's step in the chain (v32Chained),
// the layer links judged as stages: x_in (and res_in above layer 0).
func v32ChainSeeds(cs *chainStep, embed []float32, below map[string]engine.Tensor) (map[string]engine.Tensor, error) {
	cfg, src, p, l := cs.m.Cfg, cs.src, cs.p, cs.layer
	seeds := map[string]engine.Tensor{}
	if l == 0 {
		if embed != nil {
			tok, ok, err := src.Stage(p, dump.Global, "tok")
			if err != nil {
				return nil, err
			}
			if ok {
				if len(tok.I) != 1 || tok.I[0] < 0 || tok.I[0] >= int64(cfg.VocabSize) {
					return nil, fmt.Errorf("replay %s: step %d: tok %v is not one token id of the vocabulary (0 … %d)", src.Name(), p, tok.I, cfg.VocabSize-1)
				}
				row := engine.FromF(engine.KindBF16, append([]float32(nil), embed[tok.I[0]*int64(cfg.Dim):(tok.I[0]+1)*int64(cfg.Dim)]...), cfg.Dim)
				cs.seeded[engine.GlobalPrefix+"tok"] = true
				cs.status[engine.GlobalPrefix+"tok"] = StatusPass
				def := engine.StageDef{Name: "x_in", Inputs: []string{engine.GlobalPrefix + "tok"}, Equation: "x_in = embed.weight[tok]  (layer 0's Block input)"}
				if _, err := cs.judge(def, map[string]engine.Tensor{engine.GlobalPrefix + "tok": tok}, row); err != nil {
					return nil, err
				}
				v32LinkDiagnosis(cs, KindEmbedding, "the dumped x_in of layer 0 is not the embedding row embed.weight[tok] of the dumped token")
				seeds["x_in"] = row
				return seeds, nil
			}
		}
		x, ok, err := src.Stage(p, 0, "x_in")
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, fmt.Errorf("replay %s: step %d: no x_in of layer 0 in the dump", src.Name(), p)
		}
		seeds["x_in"] = x
		cs.seeded["x_in"] = true
		return seeds, nil
	}
	for _, link := range []struct{ name, from string }{{"x_in", "ffn_out"}, {"res_in", "h_mid"}} {
		t, ok := below[link.from]
		if !ok {
			return nil, fmt.Errorf("replay %s: step %d: the chain of layer %d has no %s", src.Name(), p, l-1, link.from)
		}
		in := fmt.Sprintf("L%d.%s", l-1, link.from)
		cs.status[in] = StatusPass
		def := engine.StageDef{Name: link.name, Inputs: []string{in}, Equation: fmt.Sprintf("%s = %s of layer %d (the Block.forward arguments)", link.name, link.from, l-1)}
		if _, err := cs.judge(def, map[string]engine.Tensor{in: t}, t); err != nil {
			return nil, err
		}
		seeds[link.name] = t
	}
	v32LinkDiagnosis(cs, KindLayerLink, fmt.Sprintf("the dumped Block inputs of layer %d (x_in, res_in) are not the ffn_out / h_mid the chain computed for layer %d", l, l-1))
	return seeds, nil
}

// v32LinkDiagnosis names a layer link (or the embedding) when it is the
// unit's first divergence.
func v32LinkDiagnosis(cs *chainStep, kind, why string) {
	d := cs.ur.first
	if d == nil || (d.Stage != "x_in" && d.Stage != "res_in") {
		return
	}
	var reason string
	for _, r := range cs.ur.results {
		if r.Stage == d.Stage {
			reason = r.Reason
		}
	}
	d.Kind = kind
	d.Why = fmt.Sprintf("%s (%s): what runs between the layers changed the residual stream, or the dump's %s is not the chain's input", why, reason, d.Stage)
	d.Text = fmt.Sprintf("first divergence: decode step %d, layer %d, stage %s — %s: %s", d.Step, d.Layer, d.Stage, d.Kind, d.Why)
}

// v32GreedyToken adds the greedy token to the logits result of the last
// layer: argmax of the chain's logits against argmax of the GPU's (the
// lowest id among equal maxima, as torch.argmax).
func v32GreedyToken(cs *chainStep, outs map[string]engine.Tensor) error {
	own, ok := outs["logits"]
	if !ok {
		return nil
	}
	gpu, ok, err := cs.src.Stage(cs.p, dump.Global, "logits")
	if err != nil || !ok || len(gpu.F) != len(own.F) {
		return err
	}
	a, b := argmax(own.F), argmax(gpu.F)
	for i := range cs.ur.results {
		r := &cs.ur.results[i]
		if r.Stage != "logits" {
			continue
		}
		note := fmt.Sprintf("greedy token %d, the GPU's", a)
		if a != b {
			note = fmt.Sprintf("greedy token %d, the GPU's is %d", a, b)
		}
		if r.Reason != "" {
			note = r.Reason + "; " + note
		}
		r.Reason = note
	}
	return nil
}

func argmax(v []float32) int {
	best := 0
	for i, x := range v {
		if x > v[best] {
			best = i
		}
	}
	return best
}
