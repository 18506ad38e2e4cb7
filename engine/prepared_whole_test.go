package engine

import (
	"slices"
	"testing"
)

// wholeFixture is a synthetic whole model: per layer the reference weights
// (attention + block), a second copy of the same weights for the prepared
// path, the states before the first step, and the head.
type wholeFixture struct {
	cfg    *Config
	ref    []*LayerWeights
	refHW  *HeadWeights
	fast   *PreparedWhole
	states []*LayerState
	start  int64
}

func newWholeFixture(cfg *Config, start int64, steps int, seed uint64) *wholeFixture {
	n := cfg.NLayers
	f := &wholeFixture{cfg: cfg, start: start,
		refHW: &HeadWeights{Embed: RandomEmbedding(cfg, seed), Head: RandomHead(cfg, seed)}}
	f.fast = &PreparedWhole{Cfg: cfg, Attn: &PreparedModel{Cfg: cfg, Layers: make([]*PreparedLayer, n), Rope: make([]*RopeTable, n)},
		Blocks: make([]*PreparedBlock, n), Embed: RandomEmbedding(cfg, seed), Head: PrepareHead(RandomHead(cfg, seed))}
	for l := 0; l < n; l++ {
		w := RandomLayerWeights(cfg, l, seed)
		w.Block = RandomBlockWeights(cfg, l, seed)
		rope := LayerRope(cfg, l, int(start)+steps+1)
		f.ref = append(f.ref, w)
		f.fast.Attn.Layers[l] = Prepare(cfg, w)
		f.fast.Attn.Rope[l] = rope
		f.fast.Blocks[l] = PrepareBlock(cfg, RandomBlockWeights(cfg, l, seed))
		f.fast.Blocks[l].Compact() // a real load's form: Step reads the panels only
		f.states = append(f.states, SyntheticState(cfg, w, rope, start, seed+1))
	}
	return f
}

// refStep is one whole step on the reference loops: RunLayer layer after
// layer, each from the previous layer's h_out; it returns every layer's
// h_out, the logits and the states after the step.
func (f *wholeFixture) refStep(t *testing.T, states []*LayerState, tok, pos int64) ([][]float32, []float32, [][]int64, []*LayerState) {
	var houts [][]float32
	var idx [][]int64
	var next []*LayerState
	var h Tensor
	var logits []float32
	for l, w := range f.ref {
		ctx := &StepContext{Cfg: f.cfg, Layer: l, Pos: pos, W: w, Rope: f.fast.Attn.Rope[l], Head: f.refHW}
		seeds := map[string]Tensor{GlobalPrefix + "tok": FromI(KindI64, []int64{tok}, 1)}
		if l > 0 {
			seeds["h_in"] = h
		}
		out, st, err := RunLayer(ctx, seeds, states[l])
		if err != nil {
			t.Fatal(err)
		}
		h = out["h_out"]
		houts = append(houts, h.F)
		idx = append(idx, out["moe_indices"].I)
		next = append(next, st)
		if l == len(f.ref)-1 {
			lg, ok := out["logits"]
			if !ok {
				t.Fatal("the last layer computed no logits")
			}
			logits = lg.F
		}
	}
	return houts, logits, idx, next
}

// TestPreparedWholeStepEqualsRunLayer: PreparedWhole.Step — every layer's
// hc_pre/attention/hc_post/router/experts/hc_post on the fast kernels, in
// order, then the head — gives the bits of RunLayer on the reference loops
// chained layer after layer (h_out, moe_indices, every state tensor, logits,
// token), over consecutive steps (CSA rows emitted on the way), with the
// assembly and the pure-Go kernels at GOMAXPROCS 1 and 2; on a small
// V4-Flash-shaped model (hash and top-k layers, SWA/CSA/HCA) and on tiny.
func TestPreparedWholeStepEqualsRunLayer(t *testing.T) {
	small := smallFlash(t)
	small.NLayers, small.CompressRatios, small.NHashLayers = 5, flashRatios(5), 2
	small.VocabSize, small.NRoutedExperts, small.MoEInterDim = 700, 16, 256
	if err := small.Validate(); err != nil {
		t.Fatal(err)
	}
	tiny, _ := Preset("tiny")
	for _, c := range []struct {
		name  string
		cfg   *Config
		start int64
		steps int
	}{{"small-flash", small, 509, 3}, {"tiny", tiny, 30, 3}} {
		t.Run(c.name, func(t *testing.T) {
			f := newWholeFixture(c.cfg, c.start, c.steps, 21)
			type want struct {
				houts  [][]float32
				logits []float32
				idx    [][]int64
				states []map[string]Tensor
			}
			var ws []want
			states := f.states
			for i := 0; i < c.steps; i++ {
				pos := c.start + int64(i)
				h, lg, idx, next := f.refStep(t, states, int64(7+31*i), pos)
				w := want{houts: h, logits: lg, idx: idx}
				for _, st := range next {
					w.states = append(w.states, st.StateTensors())
				}
				ws = append(ws, w)
				states = next
			}
			eachFastPath(t, func(t *testing.T) {
				states := make([]*LayerState, len(f.states))
				for l, st := range f.states {
					states[l] = st.Clone()
				}
				for i, w := range ws {
					pos := c.start + int64(i)
					got, err := f.fast.Step(states, int64(7+31*i), pos)
					if err != nil {
						t.Fatal(err)
					}
					if k := bitsEqual(got.HOut, w.houts[len(w.houts)-1]); k != -1 {
						t.Fatalf("step %d: h_out of the last layer differs at %d", pos, k)
					}
					if k := bitsEqual(got.Logits, w.logits); k != -1 {
						t.Fatalf("step %d: logits differ at %d", pos, k)
					}
					for l := range w.idx {
						gi := make([]int64, len(got.Indices[l]))
						for j, e := range got.Indices[l] {
							gi[j] = int64(e)
						}
						if !slices.Equal(gi, w.idx[l]) {
							t.Fatalf("step %d layer %d: moe_indices %v, reference %v", pos, l, gi, w.idx[l])
						}
						st := states[l].StateTensors()
						for name, wt := range w.states[l] {
							if k := bitsEqual(st[name].F, wt.F); k != -1 {
								t.Fatalf("step %d layer %d: state %s differs at %d", pos, l, name, k)
							}
						}
					}
				}
			})
		})
	}
}

// TestCompactLayerReferenceSameBits: a layer whose compressor projections
// (PreparedLayer.CompactCompressors) and block GEMV weights
// (PreparedBlock.Compact) are held only as panels runs the REFERENCE
// loops (RunLayer with no prepared attention) to the same bits as the
// layer with its fp32 weights — every output, every state tensor — and
// the fp32 copies are gone.
func TestCompactLayerReferenceSameBits(t *testing.T) {
	small := smallFlash(t)
	small.NLayers, small.CompressRatios, small.NHashLayers = 4, flashRatios(4), 1
	small.VocabSize, small.NRoutedExperts, small.MoEInterDim = 700, 16, 256
	if err := small.Validate(); err != nil {
		t.Fatal(err)
	}
	const seed, pos = 23, int64(511) // emits a compressed row on r = 4 and r = 128 layers
	var hIn Tensor                   // the previous layer's h_out (full weights), the next layer's h_in
	for l := 0; l < small.NLayers; l++ {
		full := RandomLayerWeights(small, l, seed)
		full.Block = RandomBlockWeights(small, l, seed)
		cw := RandomLayerWeights(small, l, seed)
		cw.Block = RandomBlockWeights(small, l, seed)
		if p := Prepare(small, cw); p.Compressor != nil {
			p.CompactCompressors()
			if cw.Compressor.Wkv != nil || (cw.Indexer != nil && cw.Indexer.Compressor.Wgate != nil) {
				t.Fatalf("layer %d: CompactCompressors kept an fp32 projection", l)
			}
		}
		PrepareBlock(small, cw.Block).Compact()
		if b := cw.Block; b.AttnSite.Fn != nil || b.FFNSite.Fn != nil || b.MoE.Gate.Weight != nil {
			t.Fatalf("layer %d: Compact kept an fp32 hc_*_fn or gate weight", l)
		}
		rope := LayerRope(small, l, int(pos)+1)
		hw := &HeadWeights{Embed: RandomEmbedding(small, seed), Head: RandomHead(small, seed)}
		run := func(w *LayerWeights) (map[string]Tensor, *LayerState) {
			ctx := &StepContext{Cfg: small, Layer: l, Pos: pos, W: w, Rope: rope, Head: hw}
			seeds := map[string]Tensor{GlobalPrefix + "tok": FromI(KindI64, []int64{99}, 1)}
			if l > 0 {
				seeds["h_in"] = hIn
			}
			out, st, err := RunLayer(ctx, seeds, SyntheticState(small, full, rope, pos, seed+1))
			if err != nil {
				t.Fatal(err)
			}
			return out, st
		}
		o1, s1 := run(full)
		o2, s2 := run(cw)
		if len(o1) != len(o2) {
			t.Fatalf("layer %d: %d outputs, full %d", l, len(o2), len(o1))
		}
		for name, v := range o1 {
			if k := bitsEqual(o2[name].F, v.F); k != -1 || !slices.Equal(o2[name].I, v.I) {
				t.Fatalf("layer %d: %s differs at %d on the compact weights", l, name, k)
			}
		}
		hIn = o1["h_out"]
		t1, t2 := s1.StateTensors(), s2.StateTensors()
		for name, v := range t1 {
			if k := bitsEqual(t2[name].F, v.F); k != -1 {
				t.Fatalf("layer %d: state %s differs at %d on the compact weights", l, name, k)
			}
		}
	}
}
