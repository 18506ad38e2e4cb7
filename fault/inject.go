// The fault injector Synthesize and WriteFaulted share.

package fault

import (
	"fmt"
	"math/rand/v2"

	"sparsemla/attention"
	"sparsemla/engine"
	"sparsemla/indexer"
	"sparsemla/quant"
	"sparsemla/replay"
)

// faultInjector applies one Fault the way a buggy GPU makes it. Synthesize
// (a synthetic GPU run) and WriteFaulted (a faulted copy of a dump) share it.
type faultInjector struct {
	fault Fault
	seed  uint64 // scale-byte: which 64-block's scale byte flips
	// other is, per layer, the kv_cache another request (the donor of a
	// stale prefix-cache page) held at the fault step (stale-prefix only).
	other map[int]engine.Tensor
	// hidden names the stages a faulty GPU did not produce at the fault's
	// step and layer (compressor-late: the row is not computed there); they
	// are left out of the dump.
	hidden  map[string]bool
	lateRow []float32 // compressor-late: the row the GPU writes one step late
	stage   string    // the fault's stage in this model (Fault.StageIn)
}

func newFaultInjector(f Fault, seed uint64, other map[int]engine.Tensor, cfg *engine.Config) *faultInjector {
	j := &faultInjector{fault: f, seed: seed, other: other, hidden: map[string]bool{}, stage: f.StageIn(cfg)}
	if f.Kind == CompressorLate {
		for _, n := range []string{"cmp_pooled", "cmp_normed", "cmp_roped", "cmp_row"} {
			j.hidden[n] = true
		}
	}
	return j
}

// at reports whether stage name of (step p, layer l) is where the fault lives.
func (j *faultInjector) at(p int64, l int, name string) bool {
	return p == j.fault.Step && l == j.fault.Layer && name == j.stage
}

// hides reports whether stage name of (p, l) is one the faulty GPU did not
// produce.
func (j *faultInjector) hides(p int64, l int, name string) bool {
	return p == j.fault.Step && l == j.fault.Layer && j.hidden[name]
}

// apply returns the faulty value of the fault's stage: base is the GPU's
// correct value (corrupted in a copy), ref the reference value computed from
// the stage's inputs in (base itself for a synthetic run). The faulty value
// must be out of tolerance against ref, else ErrInvisible.
func (j *faultInjector) apply(ctx *engine.StepContext, base, ref engine.Tensor, in map[string]engine.Tensor, gpuRope bool) (engine.Tensor, error) {
	name := j.stage
	bad, err := j.corrupt(ctx, base, in)
	if err != nil {
		return engine.Tensor{}, err
	}
	var sr replay.StageResult
	sr.Stage = name
	replay.JudgeStage(&sr, ref, bad, in, replay.DefaultTolerance().For(name), replay.JudgeContext{GPURope: gpuRope, Window: ctx.Cfg.WindowSize})
	// A choice among near-equal experts is a tie a replay does not blame
	// (tie-aware router faults).
	replay.RouterNearTie(&sr, ctx.Cfg, ctx.Layer, ctx.W, in, ref, bad)
	if sr.Status == replay.StatusTie {
		return engine.Tensor{}, fmt.Errorf("fault %s: the faulty experts differ from the reference's only among near-equal candidates (%s): a tie at the top-k boundary, not a router bug: %w", j.fault, sr.Reason, ErrInvisible)
	}
	if sr.Status != replay.StatusFail {
		return engine.Tensor{}, fmt.Errorf("fault %s: %w", j.fault, ErrInvisible)
	}
	return bad, nil
}

// lateWrite is the compressor-late fault's second half: at step Step+1 the
// kv_cache finally receives the row due at the emission step. Any other
// stage or step is returned unchanged.
func (j *faultInjector) lateWrite(ctx *engine.StepContext, name string, out engine.Tensor) engine.Tensor {
	f := j.fault
	if f.Kind != CompressorLate || ctx.Layer != f.Layer || ctx.Pos != f.Step+1 || name != "kv_cache" || j.lateRow == nil {
		return out
	}
	cfg := ctx.Cfg
	out = out.Clone()
	r := attention.EmittedRow(f.Step, cfg.Ratio(ctx.Layer))
	copy(out.F[(cfg.WindowSize+r)*cfg.HeadDim:], j.lateRow)
	return out
}

// corrupt returns base with the fault applied.
func (j *faultInjector) corrupt(ctx *engine.StepContext, out engine.Tensor, in map[string]engine.Tensor) (engine.Tensor, error) {
	cfg := ctx.Cfg
	if cfg.V32() && j.fault.Kind != TopKOffByOne { // top-k off by one: the same corruption below
		return j.corruptV32(ctx, out, in)
	}
	D, W := cfg.HeadDim, cfg.WindowSize
	bad := out.Clone()
	switch j.fault.Kind {
	case SplitKMerge, WrongLSE:
		q, kv, idx := in["q"], in["kv_cache"], in["topk_idxs"]
		bounds := replay.SplitBounds(idx.I)
		if bounds == nil {
			return engine.Tensor{}, fmt.Errorf("fault %s: fewer than 2 keys", j.fault)
		}
		parts := replay.SplitPartials(cfg, q, kv, idx, bounds)
		if j.fault.Kind == WrongLSE {
			// The combine's total LSE without the sink term.
			attention.MergePartialsNoSink(bad.F, parts, D)
			return bad, nil
		}
		// Correct total L (with the sink), then the buggy sum: split 1 is
		// added with weight 1 instead of 2^(LSE2_1 − L).
		attention.MergePartialsUnscaled(bad.F, parts, ctx.W.AttnSink, D, 1)
		return bad, nil
	case FP8Scale:
		// FQ8 of the window K with every block scale rounded down to a
		// power of two instead of up (quant.FQ8Floor2).
		copy(bad.F, in["kv_roped"].F)
		quant.FQ8Floor2(bad.F[:D-64], 64)
		return bad, nil
	case ScaleByte:
		slot := int((j.fault.Step - 1) % int64(W))
		row := bad.F[slot*D : (slot+1)*D]
		rng := rand.New(rand.NewPCG(j.seed, uint64(j.fault.Step)<<8|uint64(j.fault.Layer)))
		for try := 0; try < 16; try++ {
			b := rng.IntN((D - 64) / 64)
			blk := row[b*64 : (b+1)*64]
			if allZero(blk) {
				continue
			}
			e := replay.ScaleExp2(replay.FQ8Scale(blk))
			f := float32(2) // scale byte 127+e with bit 0 flipped
			if (127+e)%2 == 1 {
				f = 0.5
			}
			for i := range blk {
				blk[i] *= f
			}
			return bad, nil
		}
		return engine.Tensor{}, fmt.Errorf("fault %s: no non-zero block in window slot %d", j.fault, slot)
	case TopKOffByOne:
		scores := in["index_score"].F
		k := len(out.I)
		tc := len(scores)
		_, tr := indexer.TopK(scores, k)
		ties := tr.KthScore
		last := out.I[k-1]
		sel := map[int64]bool{}
		for _, v := range out.I {
			sel[v] = true
		}
		for _, c := range []int64{last + 1, last - 1} {
			if c < 0 || c >= int64(tc) {
				continue
			}
			if sel[c] || scores[c] != ties {
				bad.I[k-1] = c
				return bad, nil
			}
		}
		return engine.Tensor{}, fmt.Errorf("fault %s: %w", j.fault, ErrInvisible)
	case StalePrefix:
		o := j.other[j.fault.Layer]
		for t := max(0, j.fault.Step-4); t < j.fault.Step; t++ {
			slot := int(t % int64(W))
			copy(bad.F[slot*D:(slot+1)*D], o.F[slot*D:(slot+1)*D])
		}
		return bad, nil
	case WindowOrder:
		var valid, pad []int64
		for _, v := range out.I[:W] {
			if v >= 0 {
				valid = append(valid, v)
			} else {
				pad = append(pad, v)
			}
		}
		copy(bad.I, append(pad, valid...))
		return bad, nil
	case ExpertNibble, RouterBias, HCPostTransposed, RouterHashOff, RouterUnnormalised, ExpertScaleBlock, ExpertNoClamp,
		SharedGateUp, HCSplitNoSigmoid, HeadNoNorm:
		return corruptBlock(ctx, j.fault, out, in)
	case CompressorLate:
		e := attention.EmittedRow(j.fault.Step, cfg.Ratio(j.fault.Layer))
		row := bad.F[(W+e)*D : (W+e+1)*D]
		j.lateRow = append([]float32(nil), row...)
		clear(row)
		return bad, nil
	}
	return engine.Tensor{}, fmt.Errorf("fault %s: unknown kind", j.fault)
}

// allZero reports whether every value of v is zero.
func allZero(v []float32) bool {
	for _, x := range v {
		if x != 0 {
			return false
		}
	}
	return true
}
