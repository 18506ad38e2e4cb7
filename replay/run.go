package replay

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"sparsemla/engine"
)

// Mode selects how stage inputs are obtained.
type Mode string

const (
	// Local (teacher-forced, the default): every stage is recomputed from the
	// dump's own values of its inputs, so an error is attributed to the stage
	// that made it.
	Local Mode = "local"
	// Propagated: RunStep from each layer's dumped x, carrying the reference's
	// own state across steps, to show how an error grows. With the whole
	// layer's weights each layer's chain starts from its dumped h_in instead
	// (engine.RunLayer) and runs to h_out.
	Propagated Mode = "propagated"
	// Chained: propagated across layers as well — layer 0 from the embedding
	// of the dumped token, every later layer from the h_out the chain computed
	// below it, up to the logits — to find the first divergence over the whole
	// model and show its growth layer by layer. It needs the whole model's
	// weights (every layer's block weights and the head).
	Chained Mode = "chained"
)

// Options configure one replay.
type Options struct {
	Mode Mode
	Tol  *Tolerance // nil: DefaultTolerance()
	// Steps restricts the replay to these decode steps (nil: all).
	Steps []int64
	// Progress, when set, is called after each (step, layer) unit completes.
	Progress func(done, total int)
}

// Status of one stage comparison.
const (
	StatusPass    = "pass"    // within tolerance
	StatusFail    = "fail"    // out of tolerance: a divergence
	StatusTie     = "tie"     // top-k differs only inside a boundary tie
	StatusMissing = "missing" // the dump does not hold this stage
	StatusSkipped = "skipped" // an input was unavailable, nothing compared
)

// Input sources of a stage input.
const (
	FromDump      = "dump"        // this step's dumped value
	FromPrevDump  = "dump@prev"   // the previous step's dumped value
	FromStart     = "start-state" // the dump's start state
	FromReference = "reference"   // not dumped: the reference's own value
	FromPropagate = "propagated"  // the reference's own chain (propagated mode)
)

// unit is one (step, layer) of a replay.
type unit struct {
	step  int64
	layer int
}

// unitResult is what replaying one unit yields.
type unitResult struct {
	results []StageResult
	first   *Divergence // diagnosis of the unit's first failing stage
}

// Run replays src against the reference and returns the report (Verdict
// "agree" or "diverged"). err is for unusable input (unreadable dump, missing
// weights, a gap in the steps a propagated replay cannot bridge).
//
// Order: decode steps ascending, then layers, then the stages of Stages (spec
// order). In Local mode (teacher-forced, the default) each stage is computed
// by its StageDef.Compute from the DUMPED values of its inputs — "prev:X"
// inputs from the dump of step p-1 or the start state — and compared with the
// dumped value of the stage, so an error is charged to the stage that made
// it; (step, layer) units run in parallel and are assembled in order, so the
// report is identical at any GOMAXPROCS. In Propagated mode RunStep chains the
// reference's own values from each layer's dumped x, carrying its own state
// from the start state (re-seeded from a dumped state across gaps), to show
// how an error grows; where the GPU's top-k selection is judged a boundary
// tie (a legal choice) the chain follows the GPU's selection for that step
// and layer, and the tie's reason says so.
//
// Each comparison is judged by the stage's tolerance (DefaultTolerance,
// PropagatedTolerance, overridable; docs/replay-json.md): exact, bf16 ulps,
// FlashMLA's abs-or-rel plus cos_diff, or top-k sets with boundary ties. The
// first failing stage is diagnosed (Diagnose) with what its inputs looked
// like; KV pages (a PageSource: the dump's records of kind "page") are
// checked byte by byte with the kvcache codecs and a prefix-cache hit (a
// PrefixSource) row by row with kvcache.VerifyPrefixHit.
//
// In Propagated and Chained mode the chain's first divergence is reported
// only as far as a teacher-forced replay of every step and layer up to it
// backs it (confirmLocally): the chain's loose tolerances let an error pass
// the stage that made it, and a later stage whose chain inputs were merely
// within tolerance would be blamed. An earlier teacher-forced divergence is
// reported instead (saying where the chain left its tolerance); none makes
// it drift (KindDrift), blaming no stage.
func Run(ctx context.Context, m *engine.Model, src Source, opt Options) (*Report, error) {
	if opt.Mode == "" {
		opt.Mode = Local
	}
	if opt.Tol == nil {
		opt.Tol = DefaultTolerance()
		switch opt.Mode {
		case Propagated:
			opt.Tol = PropagatedTolerance()
		case Chained:
			opt.Tol = ChainedTolerance()
		}
	}
	opt.Tol = policyTolerance(opt.Tol, opt.Mode, m.Cfg.PolicyName())
	opt.Tol = v32Tolerance(opt.Tol, opt.Mode, m.Cfg)
	steps := src.Steps()
	if opt.Steps != nil {
		if err := checkStepSelection(src, opt.Steps); err != nil {
			return nil, err
		}
		steps = intersectSteps(steps, opt.Steps)
	}
	layers := src.Layers()
	for _, l := range layers {
		if m.Weights[l] == nil {
			return nil, fmt.Errorf("replay %s: no weights for layer %d", src.Name(), l)
		}
	}
	rep := newReport(src.Name(), string(opt.Mode), m.GPURope, steps, layers)
	rep.Kernels = m.Kernels()
	if p := m.Cfg.PolicyName(); p != engine.PolicyOfficial {
		rep.Policy = p
	}
	rep.TolOverrides = opt.Tol.Overrides
	var units []unitResult
	var err error
	switch opt.Mode {
	case Local:
		units, err = replayLocal(ctx, m, src, steps, layers, opt)
	case Propagated:
		units, err = replayPropagated(ctx, m, src, steps, layers, opt)
	case Chained:
		units, err = propagateChained(ctx, m, src, steps, layers, opt)
	default:
		return nil, fmt.Errorf("replay: unknown mode %q (local, propagated, chained)", opt.Mode)
	}
	if err != nil {
		return nil, err
	}
	rep.StepsReplayed = len(steps)
	// The GPU's own RoPE tables are judged first, at the first step, before
	// each layer's stages (units are in (step, layer) order).
	rres, rdiv := ropeResults(m, steps, layers)
	for i := range units {
		if i >= len(layers) {
			break
		}
		l := layers[i]
		if sr, ok := rres[l]; ok {
			units[i].results = append([]StageResult{sr}, units[i].results...)
			if d, ok := rdiv[l]; ok {
				d.Mode = string(opt.Mode)
				units[i].first = d
			}
		}
	}
	if opt.Mode != Local {
		// The chain's first divergence is reported only as far as the
		// teacher-forced replay backs it.
		if err := confirmLocally(ctx, m, src, steps, layers, units, opt.Mode, opt.Tol); err != nil {
			return nil, err
		}
	}
	inputs, nm, err := accountHeld(m, src, opt.Mode, steps, layers, units)
	if err != nil {
		return nil, err
	}
	for _, u := range units {
		rep.Results = append(rep.Results, u.results...)
		if rep.First == nil && u.first != nil {
			rep.First = u.first
		}
	}
	rep.Coverage.Inputs, rep.Coverage.NotModelled = inputs, nm
	rep.Coverage.Scope = scopeOf(m, layers)
	rep.Coverage.Unread = unreadOf(src, "")
	if err := checkWeightsMatch(src, rep.Results); err != nil {
		return nil, err
	}
	rep.finish()
	return rep, nil
}

// xProjections are the stages computed from the dumped x by a weight alone.
var xProjections = map[string]bool{"q_a": true, "kv_raw": true, "cmp_a": true, "cmp_b": true, "icmp_a": true, "icmp_b": true, "iw_raw": true}

// wrongWeightsCos is the cos_diff above which a projection is unrelated to
// the reference's (a kernel's summation order or a one-ulp rounding gives
// cos_diff ~1e-6; other weights give ~1).
const wrongWeightsCos = 0.1

// checkWeightsMatch refuses a replay whose weights evidently belong to
// another model or checkpoint: every projection of the attention input x
// (q_a, kv_raw, the compressor and indexer-weight projections) of every
// layer, at every step, is out of tolerance and unrelated to the GPU's
// value (cos_diff above wrongWeightsCos). A kernel bug does not do that to
// every projection of every layer; blaming the linear kernels hundreds of
// times would hide the cause.
func checkWeightsMatch(src Source, results []StageResult) error {
	n := 0
	layers := map[int]bool{}
	var first *StageResult
	for i := range results {
		sr := &results[i]
		if !xProjections[sr.Stage] || (sr.Status != StatusPass && sr.Status != StatusFail) {
			continue
		}
		if sr.Status != StatusFail || sr.Metrics == nil || !(sr.Metrics.CosDiff > wrongWeightsCos) {
			return nil
		}
		if first == nil {
			first = sr
		}
		n++
		layers[sr.Layer] = true
	}
	if n < 2 || first == nil {
		return nil
	}
	return fmt.Errorf("replay %s: these weights do not match this dump: all %d projections of x (q_a, kv_raw, …) of its %d layers differ from the reference at every step, unrelated to it (first: step %d layer %d %s, cos_diff %.3g) — weights of another model or checkpoint? (--weights)",
		src.Name(), n, len(layers), first.Step, first.Layer, first.Stage, first.Metrics.CosDiff)
}

// checkStepSelection refuses a selection of decode steps that selects
// nothing or names a step the dump does not hold as a decode step: a
// replay of fewer steps than asked for would be reported as if it had
// checked them.
func checkStepSelection(src Source, want []int64) error {
	if len(want) == 0 {
		return fmt.Errorf("replay %s: the step selection is empty", src.Name())
	}
	have := map[int64]bool{}
	for _, p := range src.Steps() {
		have[p] = true
	}
	var absent []int64
	seen := map[int64]bool{}
	for _, p := range want {
		if !have[p] && !seen[p] {
			absent = append(absent, p)
		}
		seen[p] = true
	}
	if len(absent) == 0 {
		return nil
	}
	slices.Sort(absent)
	what := "is not a dumped decode step"
	if len(absent) > 1 {
		what = "are not dumped decode steps"
	}
	return fmt.Errorf("replay %s: step %s %s (dumped: %s)", src.Name(), StepList(absent), what, StepList(src.Steps()))
}

// scopeOf is Coverage.Scope of a replay of layers with m: "" when the
// reference runs the whole step, else which part it runs and why.
func scopeOf(m *engine.Model, layers []int) string {
	var attn []int
	for _, l := range layers {
		if w := m.Weights[l]; w != nil && !hasWholeLayer(m.Cfg, w) {
			attn = append(attn, l)
		}
	}
	var parts []string
	switch {
	case len(attn) == len(layers):
		parts = append(parts, "attention sub-layers only: the weights given have no whole-layer tensors, so the mHC, norms and MoE are not compared")
		if m.Cfg.V32() {
			parts[0] = "attention sub-layers only: the weights given have no whole-layer tensors, so the norms, FFN and head are not compared"
		}
	case len(attn) > 0:
		parts = append(parts, fmt.Sprintf("attention sub-layer only at layers %s: the weights given have no whole-layer tensors for them", intList(attn)))
	}
	last := layers[len(layers)-1] == m.Cfg.NLayers-1
	if last && len(attn) < len(layers) && !hasHead(m) {
		parts = append(parts, "no head: the weights given have none, so the logits are not compared")
	}
	if !m.Cfg.V32() && layers[0] == 0 && len(attn) < len(layers) && (m.Head == nil || m.Head.Embed == nil) {
		parts = append(parts, "no embedding: layer 0's h_in is not computed from the token")
	}
	return strings.Join(parts, "; ")
}

func intList(v []int) string {
	s := make([]int64, len(v))
	for i, x := range v {
		s[i] = int64(x)
	}
	return StepList(s)
}

// heldBy reports whether src holds stage (step, layer, stage), reading the
// record only when src cannot say without it.
func heldBy(src Source, step int64, layer int, stage string) (bool, error) {
	if sl, ok := src.(StageLister); ok {
		return sl.Has(step, layer, stage), nil
	}
	_, ok, err := src.Stage(step, layer, stage)
	return ok, err
}

func intersectSteps(have, want []int64) []int64 {
	w := map[int64]bool{}
	for _, s := range want {
		w[s] = true
	}
	var out []int64
	for _, s := range have {
		if w[s] {
			out = append(out, s)
		}
	}
	return out
}

// errInternal marks an error made from a panic that escaped a replay unit:
// a bug in sparsemla, never a property of the dump. The fuzzers fail on it.
const errInternal = "internal error (a sparsemla bug; please report it with the dump)"

// guardUnit runs one replay unit (a local step-layer, a propagated layer's
// chain) and turns a panic that escapes it into an error naming the unit,
// so that a bug on a goroutine of the replay ends the command with one line
// and exit 2 instead of a crash of the whole process. The message holds no
// address or stack: it is the same on every run.
func guardUnit(what string, f func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%s: %s: %v", errInternal, what, r)
		}
	}()
	return f()
}

// ComputeStage runs a stage's Compute on dumped inputs. Compute validates its
// inputs and returns errors; a panic that slips through on malformed dump data
// is turned into an error naming the stage, so outside input never crashes a
// replay.
func ComputeStage(def engine.StageDef, ctx *engine.StepContext, in map[string]engine.Tensor) (t engine.Tensor, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("stage %s failed on the dumped inputs: %v", def.Name, r)
		}
	}()
	return def.Compute(ctx, in)
}

// JudgeContext is what judging a stage needs besides the tolerance.
type JudgeContext struct {
	GPURope bool // RoPE ran on the GPU's own table
	Window  int  // window size W: topk_idxs = W window entries, then the compressed part
}

// JudgeStage compares ref with gpu under st and fills sr's status, reason,
// metrics and severity. in holds the stage's inputs (index_score for sets).
func JudgeStage(sr *StageResult, ref, gpu engine.Tensor, in map[string]engine.Tensor, st StageTol, jc JudgeContext) {
	gpuRope := jc.GPURope
	sr.Tol = string(st.Mode)
	sr.Shape = ref.Shape
	sr.GPUShape = gpu.Shape
	if st.Mode == TolSet {
		judgeSet(sr, ref, gpu, in, jc.Window)
		return
	}
	if ref.Kind.IsFloat() != gpu.Kind.IsFloat() {
		sr.Status, sr.Severity = StatusFail, 2
		sr.Reason = fmt.Sprintf("dtype %s, reference %s", gpu.Kind, ref.Kind)
		return
	}
	if !engine.SameShape(ref.Shape, gpu.Shape) {
		sr.Status, sr.Severity = StatusFail, 2
		sr.Reason = fmt.Sprintf("shape %v, reference %v", gpu.Shape, ref.Shape)
		return
	}
	var mt Metrics
	if ref.Kind.IsFloat() {
		mt = CompareFloat(ref, gpu, st, gpuRope)
	} else {
		mt = CompareInt(ref, gpu)
	}
	sr.Metrics = &mt
	ok, why := st.Judge(mt, gpuRope)
	sr.Severity = severity(mt, st, gpuRope)
	if ok {
		sr.Status = StatusPass
		if sr.Severity >= 1 {
			sr.Severity = 0.99
		}
		return
	}
	sr.Status, sr.Reason = StatusFail, why
	if sr.Severity < 1 {
		sr.Severity = 1
	}
}

// severity maps metrics to one number for heatmaps: 0 = identical, < 1 within
// tolerance, >= 1 out of tolerance (capped at 2).
func severity(m Metrics, st StageTol, gpuRope bool) float64 {
	var s float64
	if m.RefNaN != m.GPUNaN || m.RefInf != m.GPUInf || len(m.NonFiniteRows) > 0 {
		return 2
	}
	switch st.Mode {
	case TolExact:
		if m.Mismatch > 0 {
			s = 1 + float64(m.Mismatch)/float64(max(m.N, 1))
		}
	case TolULP:
		s = float64(m.MaxULP) / float64(st.allowedULP(gpuRope)+1)
	case TolClose:
		if m.CloseFail > 0 {
			s = 1 + float64(m.CloseFail)/float64(max(m.N, 1))
		} else if st.Cos > 0 {
			s = m.CosDiff / st.Cos
		}
	default:
		if m.Mismatch > 0 {
			s = 0.5
		}
	}
	return min(s, 2)
}

// splitDivergence is the first divergence of a failing split-K record: the
// split kernel (or the bounds it was given), not the combine.
func splitDivergence(r StageResult, mode Mode) *Divergence {
	d := &Divergence{Step: r.Step, Layer: r.Layer, Stage: r.Stage, Kind: KindAttention, Mode: string(mode), Inputs: r.Inputs, Hint: hints[KindAttention]}
	if r.Stage == "split_bounds" {
		d.Why = "the split-K bounds the GPU dumped are not a split of its index list: " + r.Reason
	} else {
		d.Why = "the GPU's split-K partial differs from the reference's over the same split of the index list (q, kv_cache and topk_idxs from the dump): the split kernel, not the combine: " + r.Reason
	}
	d.Text = fmt.Sprintf("first divergence: decode step %d, layer %d, stage %s — %s: %s", d.Step, d.Layer, d.Stage, d.Kind, d.Why)
	return d
}
