package replay

import (
	"fmt"
	"slices"

	"sparsemla/engine"
)

// V41Diff compares two V4.1 dumps of the same run (the same config, prefill
// and decode steps in common) stage by stage in model order and names the
// first stage where B leaves A's tolerance (tol, nil: V41Tolerance(Local)).
// Both directories carry their weights, so the reference referees: each dump
// is replayed (local) and, at the diverging stage, the verdict of each
// replay there is given (each fed its own dump's inputs). Dumps whose
// configs differ, that share no decode step, or whose attention input x
// already differs (cos_diff > 0.1: other tokens) are refused.
func V41Diff(a, b *V41Dump, tol *Tolerance) (*Report, error) {
	if tol == nil {
		tol = V41Tolerance(Local)
	}
	if f := firstConfigDifference(a.Cfg, b.Cfg); f != "" {
		return nil, fmt.Errorf("diff %s %s: these dumps are of different models (config %s)", a.Dir, b.Dir, f)
	}
	if a.Pre.Next != b.Pre.Next {
		return nil, fmt.Errorf("diff %s %s: these dumps start after different prefills (A %d tokens, B %d)", a.Dir, b.Dir, a.Pre.Next, b.Pre.Next)
	}
	steps := intersectSteps(a.Steps, b.Steps)
	if len(steps) == 0 {
		return nil, fmt.Errorf("diff %s %s: these dumps decode different steps, none in common (A: %s, B: %s)", a.Dir, b.Dir, StepList(a.Steps), StepList(b.Steps))
	}
	cfg := a.Cfg
	layers := make([]int, cfg.NLayers)
	for l := range layers {
		layers[l] = l
	}
	rep := newReport(a.Dir, string(Local), true, steps, layers)
	rep.Command, rep.Against, rep.Model = "diff", b.Dir, V41ModelName
	rep.TolOverrides = tol.Overrides
	for _, p := range append(slices.Clone(a.Steps), b.Steps...) {
		if !slices.Contains(steps, p) && !slices.Contains(rep.Coverage.StepsNotChecked, p) {
			rep.Coverage.StepsNotChecked = append(rep.Coverage.StepsNotChecked, p)
		}
	}
	if len(rep.Coverage.StepsNotChecked) > 0 {
		slices.Sort(rep.Coverage.StepsNotChecked)
		rep.Coverage.StepsWhy = "only one of the two dumps holds them"
	}
	var first *StageResult
	for _, p := range steps {
		for l := 0; l < cfg.NLayers; l++ {
			defs := engine.V41Stages(cfg, l, p)
			if a.Model.Whole() && b.Model.Whole() {
				defs = engine.V41WholeStages(cfg, l, p) // the block stages and the head too
			}
			var names []string
			eq := map[string]string{}
			global := map[string]bool{}
			for _, d := range defs {
				names = append(names, d.Name)
				eq[d.Name] = d.Equation
				global[d.Name] = d.Global
			}
			if !slices.Contains(names, "x") {
				names = append([]string{"x"}, names...)
			}
			if !slices.Contains(names, "kv_cache") {
				names = append(names, "kv_cache")
			}
			// Every other tensor either dump holds at the step and layer
			// (and, with the last layer, of no layer) is compared too,
			// after the reference's stages, by its name's tolerance.
			listed := map[string]bool{}
			for _, n := range names {
				listed[n] = true
			}
			for _, n := range v41HeldUnion(a, b, p, l) {
				if !listed[n] {
					names, listed[n] = append(names, n), true
				}
			}
			if l == cfg.NLayers-1 {
				for _, n := range v41HeldUnion(a, b, p, -1) {
					if !listed[n] && !global[n] {
						names, listed[n], global[n] = append(names, n), true, true
					}
				}
			}
			for _, name := range names {
				key := fmt.Sprintf("L%d.%s", l, name)
				if global[name] {
					key = name
				}
				ta, okA := a.step[p][key]
				tb, okB := b.step[p][key]
				if !okA && !okB {
					continue
				}
				sr := StageResult{Step: p, Layer: l, Stage: name, Equation: eq[name], Inputs: []InputInfo{}}
				if !okA || !okB {
					// Held by one dump only: not compared.
					sr.Status, sr.Reason = StatusSkipped, "only B holds it"
					if okA {
						sr.Reason = "only A holds it"
					}
					rep.Results = append(rep.Results, sr)
					continue
				}
				in := map[string]engine.Tensor{}
				for _, n := range []string{"index_score", "index_score_masked"} {
					if s, ok := a.step[p][fmt.Sprintf("L%d.%s", l, n)]; ok {
						in[n] = s
					}
				}
				v41JudgeStage(&sr, ta, tb, in, tol.For(name), cfg.WindowSize)
				sr.Reason = diffWords(sr.Reason)
				rep.Results = append(rep.Results, sr)
				if sr.Status == StatusFail && first == nil {
					if (name == "x" || name == "embed") && sr.Metrics != nil && sr.Metrics.CosDiff > differentRunCos {
						return nil, fmt.Errorf("diff %s %s: these dumps are not of the same run: the attention input x of layer %d at step %d already differs (cos_diff %.3g; %s) — other tokens or prompt, or a difference upstream of attention", a.Dir, b.Dir, l, p, sr.Metrics.CosDiff, sr.Reason)
					}
					first = &rep.Results[len(rep.Results)-1]
					kind := v41Kind(name)
					rep.First = &Divergence{Step: p, Layer: l, Stage: name, Kind: kind, Mode: "diff", Why: "A and B differ: " + sr.Reason,
						Inputs: []InputInfo{}, Hint: v41Hints[kind]}
					rep.First.Text = fmt.Sprintf("first divergence: decode step %d, layer %d, stage %s — %s: %s", p, l, name, kind, rep.First.Why)
				}
			}
		}
	}
	rep.StepsReplayed = len(steps)
	rep.finish()
	ra, errA := V41Run(a, V41Options{Mode: Local, Tol: tol, Steps: steps})
	rb, errB := V41Run(b, V41Options{Mode: Local, Tol: tol, Steps: steps})
	rep.Referee = referee(ra, rb, errA, errB)
	if rep.First != nil && errA == nil && errB == nil {
		f := rep.First
		sa, sb := v41ResultAt(ra, f.Step, f.Layer, f.Stage), v41ResultAt(rb, f.Step, f.Layer, f.Stage)
		okA, okB := sa != nil && sa.Status == StatusPass, sb != nil && sb.Status == StatusPass
		line := "referee (each dump's own inputs): "
		switch {
		case sa == nil || sb == nil:
			line += "the reference does not compute this stage; no verdict"
		case okA && !okB:
			line += "the reference agrees with A: B is wrong here (" + sb.Reason + ")"
		case okB && !okA:
			line += "the reference agrees with B: A is wrong here (" + sa.Reason + ")"
		case okA && okB:
			line += "the reference is within tolerance of both"
		default:
			line += "the reference agrees with neither (A: " + sa.Reason + "; B: " + sb.Reason + ")"
		}
		f.Detail = append(f.Detail, line)
	}
	return rep, nil
}

func v41ResultAt(r *Report, p int64, l int, stage string) *StageResult {
	for i := range r.Results {
		if s := &r.Results[i]; s.Step == p && s.Layer == l && s.Stage == stage && s.Status != StatusMissing {
			return s
		}
	}
	return nil
}

// v41HeldUnion are the stage names A or B holds at step p and layer l
// (l -1: the tensors of no layer), sorted.
func v41HeldUnion(a, b *V41Dump, p int64, l int) []string {
	set := map[string]bool{}
	for _, d := range []*V41Dump{a, b} {
		for n := range d.step[p] {
			var ln int
			var stage string
			k, err := fmt.Sscanf(n, "L%d.%s", &ln, &stage)
			switch {
			case err == nil && k == 2 && ln == l:
				set[stage] = true
			case (err != nil || k != 2) && l < 0:
				set[n] = true
			}
		}
	}
	return sortedNames(set)
}
