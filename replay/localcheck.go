package replay

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"strings"

	"golang.org/x/sync/errgroup"

	"sparsemla/engine"
)

// KindDrift is the kind of a propagated or chained divergence that the
// teacher-forced check does not back: the reference's own chain left the
// mode's tolerance at a stage, but recomputed from the dump's own inputs no
// stage up to there is out of the local tolerance, so no stage is shown to
// have made it. The check compared the chain's stage itself: one it could
// not compare, or a check that could not run, is KindUnconfirmed.
const KindDrift = "drift"

// KindUnconfirmed is the kind of a propagated or chained divergence that the
// teacher-forced check can neither back nor call drift: it could not run,
// or it could not compare the chain's stage itself (no dumped value to
// start it from, say). The chain's stage left the mode's tolerance; whether
// the stage made the difference or inherited it from the chain is not
// shown either way. (Until schema v4 such a divergence was reported as
// drift.)
const KindUnconfirmed = "unconfirmed"

func init() {
	hints[KindUnconfirmed] = "replay --mode local judges every stage from the dump's own inputs, but it could not judge this one (the reason above says what it lacked): dump that too, at every step, so that the stage can be judged teacher-forced; the chain's own values and the dump's are in --json"
	hints[KindDrift] = "replay --mode local: it judges every stage from the dump's own inputs and names the stage that made an error; here the reference's own chain drifted away from the dump (FP8/FP4 activation quantisation turns last-bit differences into visible ones from layer to layer) — compare the cos_diff of the stages layer by layer (--json) to see how it grew"
}

// localTolerance is the policy of the teacher-forced check of a replay in
// mode whose policy is tol: the one a local replay of m uses by default
// (DefaultTolerance, adjusted for the model's policy and for V3.2), with
// the stages tol sets otherwise than the mode's default (--tol,
// --tol-stage) set the same way.
func localTolerance(m *engine.Model, tol *Tolerance, mode Mode) *Tolerance {
	out := v32Tolerance(policyTolerance(DefaultTolerance(), Local, m.Cfg.PolicyName()), Local, m.Cfg).Clone()
	def := PropagatedTolerance()
	if mode == Chained {
		def = ChainedTolerance()
	}
	for name, st := range tol.Stages {
		if def.For(name) != st {
			out.Set(name, st)
		}
	}
	if tol.Fallback != def.Fallback {
		out.Fallback = tol.Fallback
	}
	return out
}

// confirmLocally backs the first divergence of a propagated or chained
// replay with the teacher-forced (local) replay before it is reported. The
// reference's own chain is judged by loose tolerances (cos_diff 1e-4
// propagated, 1e-2 chained): an error smaller than that passes the stage
// that made it, the chain carries it on, and a later, innocent stage whose
// chain inputs were "within tolerance" (not the dump's values) crosses the
// tolerance first. Its diagnosis would then say that the stage itself
// differs, which nothing backs.
//
// units are the replay's (step, layer) units in report order; k is the
// first holding a divergence (a RoPE-table divergence is judged the same
// way in every mode and is left as it is). Every unit up to and including
// k is replayed teacher-forced with the local tolerance (localTolerance:
// the stages the user set in modeTol are judged as set there):
//
//   - its first divergence in an earlier unit, or in unit k at another
//     stage than the chain's, is the first divergence: it replaces the
//     chain's, saying where the chain first left its tolerance, and its
//     stage's result is marked failed with the teacher-forced reason;
//   - the same stage failing teacher-forced confirms the chain's diagnosis,
//     which stays; so does a stage the local replay does not judge (a layer
//     link) when the chain computed it from the dump's own values, or, for a
//     V3.2 layer link, when the dumped values disagree with each other;
//   - otherwise the divergence is drift (KindDrift): the chain's stage is
//     kept, its diagnosis replaced by one that says what was and was not
//     found and names no culprit.
func confirmLocally(ctx context.Context, m *engine.Model, src Source, steps []int64, layers []int, units []unitResult, mode Mode, modeTol *Tolerance) error {
	k := -1
	for i := range units {
		if units[i].first != nil {
			k = i
			break
		}
	}
	if k < 0 {
		return checkAgreeLocally(ctx, m, src, steps, layers, units, mode, modeTol)
	}
	if units[k].first.Stage == RopeStage {
		return nil
	}
	chain := units[k].first
	csr, ok := failedResult(units[k].results, chain.Stage)
	if !ok {
		csr = StageResult{Step: chain.Step, Layer: chain.Layer, Stage: chain.Stage, Status: StatusFail, Reason: chain.Why, Inputs: chain.Inputs}
	}
	tol := localTolerance(m, modeTol, mode)
	lus, err := localPrefix(ctx, m, src, steps, layers, k+1, tol)
	if err != nil {
		if ctx.Err() != nil {
			return err
		}
		units[k].first = driftDivergence(units[k], csr, mode, nil, err, nil)
		return nil
	}
	j := -1
	for i := range lus {
		if lus[i].first != nil {
			j = i
			break
		}
	}
	if j >= 0 && j < k {
		adoptLocal(units, lus, j, chain, csr, mode, false)
		return nil
	}
	if j == k && lus[k].first.Stage == chain.Stage {
		return nil // the same stage fails teacher-forced: confirmed
	}
	if !judgedIn(lus[k].results, chain.Stage) {
		confirmed, err := chainOnlyConfirmed(m, src, csr, tol)
		if err != nil {
			return err
		}
		if confirmed {
			return nil
		}
	}
	if j == k {
		// The teacher-forced divergence takes the chain's place only
		// where it comes first in the unit's order: the first divergence
		// is the first failing stage of the report. One further on (o
		// computed from a dumped kv_cache that the local check could not
		// judge, which the chain found wrong) is named in the drift.
		at, _ := localSlot(units[k].results, lus[k].results, chain.Step, chain.Layer, lus[k].first.Stage)
		if !failedBefore(units[k].results, at) {
			adoptLocal(units, lus, k, chain, csr, mode, true)
			return nil
		}
		units[k].first = driftDivergence(units[k], csr, mode, lus, nil, laterFailure(lus[k], lus[k].first))
		return nil
	}
	units[k].first = driftDivergence(units[k], csr, mode, lus, nil, nil)
	return nil
}

// checkAgreeLocally is confirmLocally for a chain that stayed within its
// tolerance everywhere: its loose tolerance lets a small error pass the
// stage that made it, and one that never grows past it leaves nothing for
// the chain to find (hc_post with comb transposed at step 6, layer 1 of
// official-v4-tiny: chained mode agreed, local mode names h_mid). So every
// unit is replayed teacher-forced with the local tolerance, and its first
// divergence, if any, is the replay's, saying that the chain stayed within
// its tolerance. A teacher-forced replay that cannot run leaves the chain's
// verdict as it is.
func checkAgreeLocally(ctx context.Context, m *engine.Model, src Source, steps []int64, layers []int, units []unitResult, mode Mode, modeTol *Tolerance) error {
	if len(units) == 0 {
		return nil
	}
	tol := localTolerance(m, modeTol, mode)
	lus, err := localPrefix(ctx, m, src, steps, layers, len(units), tol)
	if err != nil {
		if ctx.Err() != nil {
			return err
		}
		return nil
	}
	for j := range lus {
		d := lus[j].first
		if d == nil || d.Stage == RopeStage {
			continue
		}
		d.Mode = string(mode)
		d.Why += fmt.Sprintf("; (%[1]s: the reference's own chain stays within the %[1]s tolerance at every stage it compares; teacher-forced from the dump's inputs, the local check of every step and layer finds this stage the first out of tolerance)", mode)
		d.Text = fmt.Sprintf("first divergence: decode step %d, layer %d, stage %s — %s: %s", d.Step, d.Layer, d.Stage, d.Kind, d.Why)
		markLocalFailure(units, lus, j, d)
		return nil
	}
	return nil
}

// markLocalFailure makes the teacher-forced divergence d of local unit j
// the first divergence of unit j, its failing result placed among the
// unit's results (placeLocalFailure); prior is the chain's own comparison of
// d's stage before it was marked (no Status when there was none).
func markLocalFailure(units, lus []unitResult, j int, d *Divergence) (prior StageResult) {
	lr, found := failedResult(lus[j].results, d.Stage)
	if !found {
		lr = StageResult{Step: d.Step, Layer: d.Layer, Stage: d.Stage}
	}
	units[j].results, prior = placeLocalFailure(units[j].results, lus[j].results, lr, found)
	units[j].first = d
	return prior
}

// placeLocalFailure puts lr, the teacher-forced failing result of a local
// divergence, among rs, the chain's results in report order, where
// localSlot says (lrs, the local results, giving the order): the chain's own
// comparison of its stage is marked failed with the teacher-forced reason,
// or else, when insert, lr is inserted. prior is that comparison as the
// chain judged it (no Status when there was none).
func placeLocalFailure(rs, lrs []StageResult, lr StageResult, insert bool) (out []StageResult, prior StageResult) {
	reason := "teacher-forced from the dump's inputs: " + lr.Reason
	at, replace := localSlot(rs, lrs, lr.Step, lr.Layer, lr.Stage)
	switch {
	case replace:
		r := &rs[at]
		prior = *r
		r.Status, r.Severity, r.Reason = StatusFail, max(r.Severity, 1), reason
	case insert:
		lr.Reason = reason
		rs = slices.Insert(rs, at, lr)
	}
	return rs, prior
}

// chainStood says how the chain's own comparison (prior, from
// placeLocalFailure) of the stage a teacher-forced divergence names stood
// in mode: passed, or not judged or failed.
func chainStood(prior StageResult, mode Mode) string {
	if prior.Status != StatusPass {
		return fmt.Sprintf("first leaves the %s tolerance", mode)
	}
	s := fmt.Sprintf("stays within the %s tolerance here", mode)
	if prior.Metrics != nil {
		s += fmt.Sprintf(" (cos_diff %.3g)", prior.Metrics.CosDiff)
	}
	return s + " and first leaves it"
}

// localSlot is where the teacher-forced failing result of stage at (step,
// layer) goes among rs, the chain's results in report order: the index of
// the chain's own comparison of that stage (replace), or else the index it
// is inserted at, the local replay's results lrs giving the order: before
// the first result of that step and layer that lrs orders after it, else
// after that step and layer's last result, else before the first result of
// a later step, or layer of the same step.
func localSlot(rs, lrs []StageResult, step int64, layer int, stage string) (at int, replace bool) {
	lpos := map[string]int{}
	for i, r := range lrs {
		if _, seen := lpos[r.Stage]; !seen && r.Step == step && r.Layer == layer {
			lpos[r.Stage] = i
		}
	}
	own, ordered := lpos[stage]
	last := -1
	for i, r := range rs {
		if r.Step == step && r.Layer == layer && r.Stage == stage && r.Status != StatusMissing && r.Status != StatusSkipped {
			return i, true
		}
	}
	for i, r := range rs {
		if r.Step != step || r.Layer != layer {
			continue
		}
		if p, ok := lpos[r.Stage]; ok && ordered && p > own {
			return i, false
		}
		last = i
	}
	if last >= 0 {
		return last + 1, false
	}
	for i, r := range rs {
		if r.Step > step || (r.Step == step && r.Layer > layer) {
			return i, false
		}
	}
	return len(rs), false
}

// failedBefore reports whether a result of rs before index at failed.
func failedBefore(rs []StageResult, at int) bool {
	for _, r := range rs[:at] {
		if r.Status == StatusFail {
			return true
		}
	}
	return false
}

// laterFailure is the teacher-forced failing result of d's stage in the
// local unit lu (d's own reason when lu holds none).
func laterFailure(lu unitResult, d *Divergence) *StageResult {
	if r, ok := failedResult(lu.results, d.Stage); ok {
		return &r
	}
	return &StageResult{Step: d.Step, Layer: d.Layer, Stage: d.Stage, Status: StatusFail, Reason: d.Why}
}

// localPrefix replays the first n units of steps × layers (report order)
// teacher-forced, in parallel, each as a local replay would (localUnit); the
// error is the first unit's in report order.
func localPrefix(ctx context.Context, m *engine.Model, src Source, steps []int64, layers []int, n int, tol *Tolerance) ([]unitResult, error) {
	replayed := map[int64]bool{}
	for _, p := range steps {
		replayed[p] = true
	}
	out := make([]unitResult, n)
	errs := make([]error, n)
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	for i := range n {
		u := unit{steps[i/len(layers)], layers[i%len(layers)]}
		g.Go(func() error {
			if err := ctx.Err(); err != nil {
				errs[i] = err
				return nil
			}
			errs[i] = guardUnit(fmt.Sprintf("checking step %d layer %d teacher-forced", u.step, u.layer), func() (err error) {
				out[i], err = localUnit(m, src, u, tol, replayed[u.step-1])
				return err
			})
			return nil
		})
	}
	g.Wait()
	return out, firstErr(errs)
}

func firstErr(errs []error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// failedResult is the first failed result of stage in rs.
func failedResult(rs []StageResult, stage string) (StageResult, bool) {
	for _, r := range rs {
		if r.Stage == stage && r.Status == StatusFail {
			return r, true
		}
	}
	return StageResult{}, false
}

// judgedIn reports whether rs holds a comparison of stage (pass, tie or fail).
func judgedIn(rs []StageResult, stage string) bool {
	for _, r := range rs {
		if r.Stage == stage && (r.Status == StatusPass || r.Status == StatusTie || r.Status == StatusFail) {
			return true
		}
	}
	return false
}

// chainOnlyConfirmed says whether the chain's failing stage sr, one the
// local replay does not judge, is backed without it: the chain computed it
// from the dump's own values only (the embedding row of the dumped token),
// or it is a V3.2 layer link whose dumped value differs from the dumped
// value of the layer below it links to (x_in from ffn_out, res_in from
// h_mid) beyond the local tolerance.
func chainOnlyConfirmed(m *engine.Model, src Source, sr StageResult, tol *Tolerance) (bool, error) {
	fromDump := len(sr.Inputs) > 0
	for _, in := range sr.Inputs {
		if in.From != FromDump && in.From != FromPrevDump && in.From != FromStart {
			fromDump = false
		}
	}
	if fromDump {
		return true, nil
	}
	below := map[string]string{"x_in": "ffn_out", "res_in": "h_mid"}[sr.Stage]
	if !m.Cfg.V32() || sr.Layer == 0 || below == "" {
		return false, nil
	}
	gpu, ok, err := src.Stage(sr.Step, sr.Layer, sr.Stage)
	if err != nil || !ok {
		return false, err
	}
	ref, ok, err := src.Stage(sr.Step, sr.Layer-1, below)
	if err != nil || !ok {
		return false, err
	}
	var r StageResult
	r.Stage = sr.Stage
	JudgeStage(&r, ref, gpu, nil, tol.For(sr.Stage), JudgeContext{m.GPURope, m.Cfg.WindowSize})
	return r.Status == StatusFail, nil
}

// adoptLocal makes the teacher-forced first divergence of unit j the first
// divergence, saying where the chain first left its tolerance (csr, the
// chain's failing result in its first diverging unit; sameUnit: that unit
// is j), and marks its stage failed in the chain's results of unit j.
func adoptLocal(units, lus []unitResult, j int, chain *Divergence, csr StageResult, mode Mode, sameUnit bool) {
	d := lus[j].first
	where := fmt.Sprintf("decode step %d, layer %d, stage %s", chain.Step, chain.Layer, chain.Stage)
	if sameUnit {
		where = fmt.Sprintf("stage %s of this step and layer", chain.Stage)
	}
	prior := markLocalFailure(units, lus, j, d)
	d.Mode = string(mode)
	d.Why += fmt.Sprintf("; (%s: the reference's own chain %s at %s (%s); teacher-forced from the dump's inputs, the local check of every step and layer up to there finds this stage the first out of tolerance)",
		mode, chainStood(prior, mode), where, csr.Reason)
	d.Text = fmt.Sprintf("first divergence: decode step %d, layer %d, stage %s — %s: %s", d.Step, d.Layer, d.Stage, d.Kind, d.Why)
}

// driftDivergence is the diagnosis of the chain's first divergence (sr, in
// unit ur) when the teacher-forced check does not back it: lus are the
// local units up to it (none out of tolerance), or err says why they could
// not be replayed; later, when not nil, is a teacher-forced failure further
// on in the same step and layer, which the diagnosis names. It names the
// stage where the chain crossed its tolerance and no culprit. Its kind is
// drift when the check compared that stage (and found it within the local
// tolerance), unconfirmed when the check could not run or could not compare
// it.
func driftDivergence(ur unitResult, sr StageResult, mode Mode, lus []unitResult, err error, later *StageResult) *Divergence {
	d := &Divergence{Step: sr.Step, Layer: sr.Layer, Stage: sr.Stage, Kind: KindDrift, Mode: string(mode), Inputs: sr.Inputs, Hint: hints[KindDrift]}
	var checked string
	if err != nil {
		checked = fmt.Sprintf("the teacher-forced check of the steps and layers up to here could not run (%v)", err)
	} else {
		checked = "teacher-forced from the dump's inputs, the local check of every step and layer up to here finds no stage out of tolerance"
		n := 0
		var first StageResult
		for _, lu := range lus {
			for _, r := range lu.results {
				if r.Status == StatusSkipped {
					if n == 0 {
						first = r
					}
					n++
				}
			}
		}
		if n > 0 {
			checked += fmt.Sprintf(" among the stages it could compare (%d it could not: the first at decode step %d, layer %d, stage %s: %s)", n, first.Step, first.Layer, first.Stage, first.Reason)
		}
	}
	var conclusion string
	switch why, skipped := skippedIn(lus, sr); {
	case err != nil:
		conclusion = fmt.Sprintf("the difference is shown to be neither an error of %s nor drift along the chain", sr.Stage)
		d.Kind, d.Hint = KindUnconfirmed, "the teacher-forced check could not run (the reason above): replay --mode local says what it lacks; the chain's own values and the dump's are in --json"
	case skipped:
		// The local check could not compare the stage itself: neither
		// drift nor an error of the stage is shown.
		conclusion = fmt.Sprintf("teacher-forced, this stage itself could not be compared (%s), and its inputs here came from the chain (%s), not the dump's own values, so the difference is shown to be neither an error of %s nor drift along the chain",
			why, chainInputs(ur, sr), sr.Stage)
		d.Kind, d.Hint = KindUnconfirmed, hints[KindUnconfirmed]
	default:
		conclusion = fmt.Sprintf("the stage's inputs came from the chain (%s), within the %s tolerance but not the dump's own values, so this is drift accumulated along the chain, not shown to be an error of %s",
			chainInputs(ur, sr), mode, sr.Stage)
	}
	d.Why = fmt.Sprintf("the reference's own chain leaves the %s tolerance here (%s), but %s; %s", mode, sr.Reason, checked, conclusion)
	if later != nil {
		d.Why += fmt.Sprintf("; further on in this step and layer, teacher-forced from the dump's inputs, stage %s is out of the local tolerance (%s; replay --mode local names it)",
			later.Stage, later.Reason)
	}
	d.Text = fmt.Sprintf("first divergence: decode step %d, layer %d, stage %s — %s: %s", d.Step, d.Layer, d.Stage, d.Kind, d.Why)
	return d
}

// skippedIn is the reason the local units lus skipped the stage of sr at
// its step and layer (ok false when they compared it or hold none).
func skippedIn(lus []unitResult, sr StageResult) (string, bool) {
	for _, lu := range lus {
		for _, r := range lu.results {
			if r.Step == sr.Step && r.Layer == sr.Layer && r.Stage == sr.Stage && r.Status == StatusSkipped {
				return r.Reason, true
			}
		}
	}
	return "", false
}

// chainInputs lists the inputs of the chain's result sr with their own
// distance to the dump where the unit judged them ("x: cos_diff 0.0031").
func chainInputs(ur unitResult, sr StageResult) string {
	var parts []string
	for _, in := range sr.Inputs {
		s := in.Name
		if strings.HasPrefix(in.Name, engine.PrevPrefix) {
			s += " (the state the chain carried)"
		} else {
			for _, r := range ur.results {
				if r.Stage == in.Name && r.Metrics != nil && (r.Status == StatusPass || r.Status == StatusFail) {
					if r.Metrics.Mismatch == 0 {
						s += ": equal"
					} else {
						s += fmt.Sprintf(": cos_diff %.3g", r.Metrics.CosDiff)
					}
					break
				}
			}
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, "; ")
}
