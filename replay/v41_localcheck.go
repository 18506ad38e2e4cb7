package replay

import "fmt"

// v41ConfirmLocally is confirmLocally for a V4.1 propagated replay: rep
// (over steps, under tol) has its first divergence backed by the local
// replay of the steps up to it. On a whole V4.1 dump the propagated chain
// runs the model from the token through every layer, so an error inside
// the propagated tolerance at the stage that made it can leave it only
// layers later, at an innocent stage. The local replay's first divergence
// at or before the chain's step and layer replaces the chain's (saying
// where the chain left its tolerance, its stage's result marked failed);
// the same stage confirms it; none makes it drift (KindDrift).
func v41ConfirmLocally(d *V41Dump, steps []int64, tol *Tolerance, rep *Report) error {
	chain := rep.First
	if chain == nil {
		return nil
	}
	ltol := V41DefaultTolerance(d, Local).Clone()
	def := V41DefaultTolerance(d, Propagated)
	for name, st := range tol.Stages {
		if def.For(name) != st {
			ltol.Set(name, st)
		}
	}
	if tol.Fallback != def.Fallback {
		ltol.Fallback = tol.Fallback
	}
	var upTo []int64
	for _, p := range steps {
		if p <= chain.Step {
			upTo = append(upTo, p)
		}
	}
	csr, ok := failedResult(unitOf(rep.Results, chain.Step, chain.Layer).results, chain.Stage)
	if !ok {
		csr = StageResult{Step: chain.Step, Layer: chain.Layer, Stage: chain.Stage, Status: StatusFail, Reason: chain.Why, Inputs: chain.Inputs}
	}
	lrep, err := V41Run(d, V41Options{Mode: Local, Tol: ltol, Steps: upTo})
	if err != nil {
		rep.First = driftDivergence(unitOf(rep.Results, chain.Step, chain.Layer), csr, Propagated, nil, err, nil)
		return nil
	}
	before := func(step int64, layer int) bool {
		return step < chain.Step || (step == chain.Step && layer <= chain.Layer)
	}
	lf := lrep.First
	var checked []StageResult
	for _, r := range lrep.Results {
		if before(r.Step, r.Layer) {
			checked = append(checked, r)
		}
	}
	var later *StageResult
	switch {
	case lf != nil && lf.Step == chain.Step && lf.Layer == chain.Layer && lf.Stage == chain.Stage:
		return nil // the same stage fails teacher-forced: confirmed
	case lf != nil && before(lf.Step, lf.Layer):
		// The local divergence takes the chain's place only where it comes
		// first in the report's order (the first divergence is the first
		// failing stage); one further on in the chain's step and layer is
		// named in the drift.
		lr := laterFailure(unitOf(lrep.Results, lf.Step, lf.Layer), lf)
		if at, _ := localSlot(rep.Results, lrep.Results, lf.Step, lf.Layer, lf.Stage); failedBefore(rep.Results, at) {
			later = lr
			break
		}
		where := fmt.Sprintf("decode step %d, layer %d, stage %s", chain.Step, chain.Layer, chain.Stage)
		if lf.Step == chain.Step && lf.Layer == chain.Layer {
			where = fmt.Sprintf("stage %s of this step and layer", chain.Stage)
		}
		var prior StageResult
		rep.Results, prior = placeLocalFailure(rep.Results, lrep.Results, *lr, true)
		lf.Mode = string(Propagated)
		lf.Why += fmt.Sprintf("; (propagated: the reference's own chain %s at %s (%s); teacher-forced from the dump's inputs, the local replay of every step and layer up to there finds this stage the first out of tolerance)", chainStood(prior, Propagated), where, csr.Reason)
		lf.Text = fmt.Sprintf("first divergence: decode step %d, layer %d, stage %s — %s: %s", lf.Step, lf.Layer, lf.Stage, lf.Kind, lf.Why)
		rep.First = lf
		return nil
	}
	rep.First = driftDivergence(unitOf(rep.Results, chain.Step, chain.Layer), csr, Propagated, []unitResult{{results: checked}}, nil, later)
	return nil
}

// unitOf gathers the results of one step and layer.
func unitOf(rs []StageResult, step int64, layer int) unitResult {
	var u unitResult
	for _, r := range rs {
		if r.Step == step && r.Layer == layer {
			u.results = append(u.results, r)
		}
	}
	return u
}
