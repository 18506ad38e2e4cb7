// The synthetic GPU run's whole-model, V3.2 and per-layer steps (gpuRun).

package fault

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"

	"sparsemla/engine"
	"sparsemla/quant"
	"sparsemla/replay"
)

// runWhole is run for a whole model: at each position a seeded random token
// (global tok), layer 0 from its embedding, each later layer from the h_out
// of the layer below (faulty ones included), the last layer's stages ending
// in the logits.
func (g *gpuRun) runWhole(rng *rand.Rand, states []map[string]engine.Tensor) error {
	cfg := g.s.Cfg
	for p := int64(0); p <= g.last; p++ {
		tok := engine.FromI(engine.KindI64, []int64{rng.Int64N(int64(cfg.VocabSize))}, 1)
		var hOut engine.Tensor
		for l := 0; l < cfg.NLayers; l++ {
			seeds := map[string]engine.Tensor{engine.GlobalPrefix + "tok": tok}
			if l > 0 {
				seeds["h_in"] = hOut
			}
			vals, err := g.layerStep(p, l, seeds, states[l])
			if err != nil {
				return fmt.Errorf("synth: step %d layer %d: %w", p, l, err)
			}
			for name := range states[l] {
				if t, ok := vals[name]; ok {
					states[l][name] = t
				}
			}
			g.report(p, l, vals, states[l])
			hOut = vals["h_out"]
		}
	}
	return nil
}

// runV32Whole is run for a whole V3.2 model (synth --whole): at each
// position a seeded random token (global tok) and layer 0 from its
// embedding row x_in = embed.weight[tok] (a seeded random bf16 x_in when
// the weights hold no embedding), each later layer from the Block outputs
// of the layer below (x_in = its ffn_out, res_in = its h_mid, faulty ones
// included), the last layer ending in the logits.
func (g *gpuRun) runV32Whole(rng *rand.Rand, states []map[string]engine.Tensor) error {
	cfg := g.s.Cfg
	embed := g.s.Weights[0].V32.FFN.Embed
	for p := int64(0); p <= g.last; p++ {
		var seeds map[string]engine.Tensor
		if embed != nil {
			t := rng.Int64N(int64(cfg.VocabSize))
			row := append([]float32(nil), embed[t*int64(cfg.Dim):(t+1)*int64(cfg.Dim)]...)
			seeds = map[string]engine.Tensor{"x_in": engine.FromF(engine.KindBF16, row, cfg.Dim),
				engine.GlobalPrefix + "tok": engine.FromI(engine.KindI64, []int64{t}, 1)}
		} else {
			x := make([]float32, cfg.Dim)
			for i := range x {
				x[i] = quant.BF16Round(float32(rng.NormFloat64()))
			}
			seeds = map[string]engine.Tensor{"x_in": engine.FromF(engine.KindBF16, x, cfg.Dim)}
		}
		for l := 0; l < cfg.NLayers; l++ {
			vals, err := g.layerStep(p, l, seeds, states[l])
			if err != nil {
				return fmt.Errorf("synth: step %d layer %d: %w", p, l, err)
			}
			for name := range states[l] {
				if t, ok := vals[name]; ok {
					states[l][name] = t
				}
			}
			g.report(p, l, vals, states[l])
			seeds = map[string]engine.Tensor{"x_in": vals["ffn_out"], "res_in": vals["h_mid"]}
		}
	}
	return nil
}

// synthNorm is x = bf16(h · rsqrt(mean(h²) + 1e-6)), a weightless RMS norm.
func synthNorm(h []float32) engine.Tensor {
	var ss float64
	for _, v := range h {
		ss += float64(v) * float64(v)
	}
	r := 1 / math.Sqrt(ss/float64(len(h))+1e-6)
	x := make([]float32, len(h))
	for i, v := range h {
		x[i] = quant.BF16Round(float32(float64(v) * r))
	}
	return engine.FromF(engine.KindBF16, x, len(x))
}

// layerStep runs one layer's stages at position p from seeds (the
// attention path: x; a whole model: global:tok, and h_in above layer 0) and
// the state before the step. The values it returns hold the seeds and every
// stage; a global stage (logits) under engine.GlobalPrefix.
func (g *gpuRun) layerStep(p int64, l int, seeds, prev map[string]engine.Tensor) (map[string]engine.Tensor, error) {
	cfg := g.s.Cfg
	ctx := &engine.StepContext{Cfg: cfg, Layer: l, Pos: p, W: g.s.Weights[l], Rope: g.s.Rope[l], Head: g.s.Head}
	vals := make(map[string]engine.Tensor, len(seeds))
	for k, t := range seeds {
		vals[k] = t
	}
	defs := engine.Stages(cfg, l, p)
	if g.s.Head != nil || cfg.V32() { // V3.2: the whole layer when its FFN weights are set
		defs = engine.BlockStages(cfg, l, p, g.s.Weights[l], g.s.Head)
	}
	for _, def := range defs {
		if p == 0 && prefillSkips[def.Name] {
			if def.Name == "y" {
				vals["y"] = engine.NewF(engine.KindBF16, cfg.Dim)
			}
			continue
		}
		in := make(map[string]engine.Tensor, len(def.Inputs))
		for _, name := range def.Inputs {
			if base, ok := strings.CutPrefix(name, engine.PrevPrefix); ok {
				in[name] = prev[base]
			} else {
				in[name] = vals[name]
			}
		}
		out, err := def.Compute(ctx, in)
		if err != nil {
			return nil, fmt.Errorf("stage %s: %w", def.Name, err)
		}
		if g.inj != nil && g.inj.at(p, l, def.Name) {
			// The "GPU" is the reference here, so the value to corrupt
			// and the reference value are the same.
			if out, err = g.inj.apply(ctx, out, out, in, true); err != nil {
				return nil, err
			}
		}
		if g.inj != nil {
			out = g.inj.lateWrite(ctx, def.Name, out)
		}
		if def.Global {
			vals[engine.GlobalPrefix+def.Name] = out
			continue
		}
		vals[def.Name] = out
		if def.Name == "o" {
			// The GPU's split-K partials (FlashMLA form), dumped beside o.
			if bounds := replay.SplitBounds(in["topk_idxs"].I); bounds != nil {
				parts := replay.SplitPartials(cfg, in["q"], in["kv_cache"], in["topk_idxs"], bounds)
				vals["split_bounds"] = engine.FromI(engine.KindI64, bounds, len(bounds))
				for i, pt := range parts {
					vals[fmt.Sprintf("o_split/%d", i)] = engine.FromF(engine.KindF32, pt.O, cfg.NHeads, cfg.HeadDim)
					vals[fmt.Sprintf("lse_split/%d", i)] = engine.FromF(engine.KindF32, pt.LSE2, cfg.NHeads)
				}
			}
		}
	}
	return vals, nil
}

// prefillSkips are the stages position 0 does not run: in the official code
// p = 0 is a prefill, and the decode-step index list (WindowIdx) starts at
// p = 1. Position 0 only writes its cache and compressor state; its attention
// output is taken as zero (the synthetic residual stream is unchanged).
var prefillSkips = map[string]bool{"topk_idxs": true, "o": true, "o_inv": true, "u": true, "y": true}
