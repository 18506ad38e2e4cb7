package replay

import (
	"fmt"

	"sparsemla/attention"
	"sparsemla/attribute"
	"sparsemla/engine"
)

// RopeStage is the name of the RoPE-table check in a report: one result per
// layer whose table the dump carries (the GPU's own, not computed), at the
// first replayed step, before the layer's stages.
const RopeStage = "rope_table"

// ropeResults checks, for every layer of layers whose RoPE table is the
// GPU's own, that table against the one the config implies
// (attention.CheckRopeTable: per position and pair, the angle error in ulps
// of θ, within attention.RopeAngleTol — the CUDA libm differences the golden
// GPU runs show) over the positions the replay reads (0 … last step + 1).
// A table outside the tolerance is a divergence of kind "RoPE table"; the
// known wrong tables (bf16 inv_freq, no or another YaRN, another theta) are
// tried and the one that explains it is named. step is the first replayed
// step (where the results are placed). Tables shared by several layers are
// compared once.
func ropeResults(m *engine.Model, steps []int64, layers []int) (map[int]StageResult, map[int]*Divergence) {
	res, divs := map[int]StageResult{}, map[int]*Divergence{}
	if len(steps) == 0 {
		return res, divs
	}
	first, last := steps[0], steps[len(steps)-1]
	type key struct {
		tb *engine.RopeTable
		p  attention.RopeParams
	}
	seen := map[key]attention.RopeCheck{}
	cfg := m.Cfg
	for _, l := range layers {
		tb := m.Rope[l]
		if tb == nil || tb.Source == "computed" {
			continue
		}
		p := cfg.RopeParams(l)
		k := key{tb, p}
		c, ok := seen[k]
		if !ok {
			other := cfg.RopeTheta
			if cfg.Ratio(l) == 0 {
				other = cfg.CompressRopeTheta
			}
			yarn := attention.RopeParams{Base: cfg.CompressRopeTheta, OriginalSeqLen: cfg.OriginalSeqLen, Factor: cfg.RopeFactor, BetaFast: cfg.BetaFast, BetaSlow: cfg.BetaSlow}
			// CheckRopeTable's first comparison, before the hypotheses
			// are built (the table of a clean dump passes it).
			c = attention.RopeCheck{Diff: attention.CompareRopeTable(prefixTable(tb, int(last)+2), p)}
			if !c.Diff.OK() {
				c = attention.CheckRopeTable(prefixTable(tb, int(last)+2), p, attention.RopeHypotheses(p, other, yarn))
			}
			if !c.Diff.OK() {
				// HF's table: the config's with cos/sin rounded to bf16 —
				// the expected table under hf-eager, else a named hypothesis
				if bd := ropeBF16Diff(prefixTable(tb, int(last)+2), p); bd.OK() {
					if cfg.PolicyName() == engine.PolicyHFEager {
						c = attention.RopeCheck{Diff: bd}
					} else {
						c.Best, c.BestDiff, c.Matches = ropeBF16Name, bd, true
					}
				}
			}
			seen[k] = c
		}
		sr := StageResult{Step: first, Layer: l, Stage: RopeStage, Tol: "angle",
			Equation: fmt.Sprintf("the GPU's table %s vs cos/sin of θ = f32(t·ω_i) from the config (base %g, YaRN %v), positions 0..%d", tb.Source, p.Base, p.OriginalSeqLen > 0, min(int(last)+1, tb.T-1)),
			Shape:    []int{min(int(last)+2, tb.T), attention.RopePairs, 2}, Inputs: []InputInfo{}}
		sr.Severity = min(c.Diff.MaxAngleULP/attention.RopeAngleTol, 2)
		if c.Diff.OK() {
			sr.Status = StatusPass
			if sr.Severity >= 1 {
				sr.Severity = 0.99
			}
			res[l] = sr
			continue
		}
		sr.Status, sr.Reason = StatusFail, c.Diff.String()
		sr.Severity = max(sr.Severity, 1)
		res[l] = sr
		div := &Divergence{Step: first, Layer: l, Stage: RopeStage, Kind: KindRopeTable, Mode: "", Inputs: []InputInfo{}, Hint: hints[KindRopeTable]}
		div.Why = "the GPU's RoPE table is not the one the config implies (beyond the CUDA libm differences of the golden runs): " + c.Diff.String()
		v := &attribute.Verdict{Stage: RopeStage, Exact: []string{}, Tried: []attribute.Match{},
			Reference: attribute.Match{Name: "reference", Desc: "the table the config implies", Differ: c.Diff.Over, N: c.Diff.T * c.Diff.Pairs}}
		if c.Best != "" {
			b := attribute.Match{Name: c.Best, Desc: "RoPE table: " + c.Best, Exact: c.Matches, Differ: c.BestDiff.Over, N: c.BestDiff.T * c.BestDiff.Pairs,
				At: []int{c.BestDiff.AnglePos, c.BestDiff.AnglePair}}
			v.Tried = append(v.Tried, b)
			if c.Matches {
				v.Exact = append(v.Exact, c.Best)
				div.Why += fmt.Sprintf("; it is the table of hypothesis %q within the tolerance (worst angle error %.3g ulps at position %d pair %d)", c.Best, c.BestDiff.MaxAngleULP, c.BestDiff.AnglePos, c.BestDiff.AnglePair)
			} else {
				div.Why += fmt.Sprintf("; no known wrong table explains it, the closest is %q (%s)", c.Best, c.BestDiff)
			}
			if c.Matches || c.BestDiff.Over < c.Diff.Over {
				v.Best = &v.Tried[0]
			}
		}
		div.Hypothesis = v
		div.Text = fmt.Sprintf("first divergence: decode step %d, layer %d, stage %s — %s: %s", first, l, RopeStage, KindRopeTable, div.Why)
		divs[l] = div
	}
	return res, divs
}

// prefixTable is tb restricted to positions 0 … T-1 (no copy).
func prefixTable(tb *engine.RopeTable, T int) *engine.RopeTable {
	if T >= tb.T {
		return tb
	}
	return &engine.RopeTable{T: T, Cos: tb.Cos[:T*attention.RopePairs], Sin: tb.Sin[:T*attention.RopePairs], Source: tb.Source}
}
