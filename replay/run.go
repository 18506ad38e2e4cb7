package replay

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"strings"

	"golang.org/x/sync/errgroup"

	"sparsemla/dump"
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
	for _, u := range units {
		rep.Results = append(rep.Results, u.results...)
		if rep.First == nil && u.first != nil {
			rep.First = u.first
		}
	}
	rep.Coverage.NotModelled = notModelled(m, src, steps, layers)
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

// notModelled names the stage tensors src holds at the replayed steps and
// layers that the reference's stage graph does not define (nil when src
// cannot list them), sorted.
func notModelled(m *engine.Model, src Source, steps []int64, layers []int) []string {
	sl, ok := src.(StageLister)
	if !ok {
		return nil
	}
	set := map[string]bool{}
	for _, p := range steps {
		for _, l := range layers {
			names := sl.StageNames(p, l)
			if len(names) == 0 {
				continue
			}
			defined := map[string]bool{}
			if l > 0 && m.Weights[l].Block != nil {
				defined["h_in"] = true // checked against h_out of the layer below
			}
			for _, d := range engine.BlockStages(m.Cfg, l, p, m.Weights[l], m.Head) {
				defined[d.Name] = true
				for _, in := range d.Inputs {
					defined[in] = true // an input (x): read, not judged here
				}
			}
			for _, n := range names {
				if !defined[n] && !isSplitStage(n) {
					set[n] = true
				}
			}
		}
	}
	out := make([]string, 0, len(set))
	for n := range set {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
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

// replayLocal runs every (step, layer) unit independently (they read only the
// dump), in parallel across units; each unit's stages run in order. Results
// are assembled in (step, layer) order, so the output does not depend on
// GOMAXPROCS.
func replayLocal(ctx context.Context, m *engine.Model, src Source, steps []int64, layers []int, opt Options) ([]unitResult, error) {
	var work []unit
	for _, p := range steps {
		for _, l := range layers {
			work = append(work, unit{p, l})
		}
	}
	out := make([]unitResult, len(work))
	replayed := map[int64]bool{}
	for _, p := range steps {
		replayed[p] = true
	}
	// Every unit runs to its end and keeps its own error, so the error
	// returned is the one of the first unit in (step, layer) order that has
	// one, the same on every run (not whichever goroutine failed first).
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	done := make(chan struct{}, len(work))
	errs := make([]error, len(work))
	for i, u := range work {
		g.Go(func() error {
			if err := ctx.Err(); err != nil {
				errs[i] = err
				return nil
			}
			r, err := localUnit(m, src, u, opt.Tol, replayed[u.step-1])
			if err != nil {
				errs[i] = err
				return nil
			}
			out[i] = r
			done <- struct{}{}
			return nil
		})
	}
	if opt.Progress != nil {
		go func() {
			for n := 1; n <= len(work); n++ {
				if _, ok := <-done; !ok {
					return
				}
				opt.Progress(n, len(work))
			}
		}()
	}
	g.Wait()
	close(done)
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	return out, nil
}

// localUnit replays the stages of one layer at one step from dumped inputs.
//
// "prev:X" inputs are the dumped X of step p-1 (a full or a state-only dumped
// step), else the start state when it is valid after p-1. prevChecked says
// whether step p-1 is replayed too (its values are then checked there).
func localUnit(m *engine.Model, src Source, u unit, tol *Tolerance, prevChecked bool) (unitResult, error) {
	prevStep := u.step - 1
	var res unitResult
	ctx := &engine.StepContext{Cfg: m.Cfg, Layer: u.layer, Pos: u.step, W: m.Weights[u.layer], Rope: m.Rope[u.layer], Head: m.Head}
	defs := engine.BlockStages(m.Cfg, u.layer, u.step, m.Weights[u.layer], m.Head)
	if u.layer > 0 && m.Weights[u.layer].Block != nil {
		sr, def, ok, err := belowInput(src, u)
		if err != nil {
			return res, err
		}
		if ok {
			if sr.Status == "" {
				ref, _, _ := src.Stage(u.step, u.layer-1, "h_out")
				gpu, _, _ := src.Stage(u.step, u.layer, "h_in")
				JudgeStage(&sr, ref, gpu, nil, tol.For("h_in"), JudgeContext{m.GPURope, m.Cfg.WindowSize})
				if sr.Status == StatusFail {
					res.first = Diagnose(DiagnoseInput{Model: m, Src: src, Def: def, Result: sr, Ref: ref, GPU: gpu,
						In: map[string]engine.Tensor{def.Inputs[0]: ref}, Own: map[string]engine.Tensor{}, Mode: Local, Tol: tol})
				}
			}
			res.results = append(res.results, sr)
		}
	}
	own := map[string]engine.Tensor{}  // the reference's values at this step
	status := map[string]string{}      // this step's stage statuses
	var start map[string]engine.Tensor // loaded on first use
	var startAfter int64
	startOK, startLoaded := false, false
	for _, def := range defs {
		sr := StageResult{Step: u.step, Layer: u.layer, Stage: def.Name, Equation: def.Equation}
		in := make(map[string]engine.Tensor, len(def.Inputs))
		missing := ""
		for _, name := range def.Inputs {
			info := InputInfo{Name: name}
			if base, ok := strings.CutPrefix(name, "prev:"); ok {
				var t engine.Tensor
				found := false
				if prevStep >= 0 {
					v, ok, err := src.Stage(prevStep, u.layer, base)
					if err != nil {
						return res, err
					}
					if ok {
						t, found = v, true
						info.From, info.Status = FromPrevDump, "unchecked"
						if prevChecked {
							info.Status = "matched" // compared there; an earlier divergence would be reported first
						}
					}
				}
				if !found {
					if !startLoaded {
						var err error
						start, startAfter, startOK, err = src.State(u.layer)
						if err != nil {
							return res, err
						}
						startLoaded = true
					}
					if v, ok := start[base]; ok && startOK && startAfter == u.step-1 {
						t, found = v, true
						info.From, info.Status = FromStart, "unchecked"
					}
				}
				if !found {
					missing = fmt.Sprintf("no value of %s after step %d in the dump", base, u.step-1)
					break
				}
				in[name] = t
			} else if base, ok := strings.CutPrefix(name, engine.GlobalPrefix); ok {
				// A value of the step that belongs to no layer (the token).
				v, ok, err := src.Stage(u.step, dump.Global, base)
				if err != nil {
					return res, err
				}
				if !ok {
					missing = fmt.Sprintf("no %s at step %d in the dump", base, u.step)
					break
				}
				in[name] = v
				info.From, info.Status = FromDump, "unchecked"
			} else {
				v, ok, err := src.Stage(u.step, u.layer, name)
				if err != nil {
					return res, err
				}
				switch {
				case ok:
					in[name] = v
					info.From = FromDump
					switch status[name] {
					case StatusPass, StatusTie:
						info.Status = "matched"
					case StatusFail:
						info.Status = "diverged"
					default:
						info.Status = "unchecked"
					}
				case hasTensor(own, name):
					in[name] = own[name]
					info.From, info.Status = FromReference, "unchecked"
				default:
					missing = fmt.Sprintf("input %s is neither dumped nor computed", name)
				}
				if missing != "" {
					break
				}
			}
			sr.Inputs = append(sr.Inputs, info)
		}
		var ref engine.Tensor
		if missing == "" {
			var err error
			if ref, err = ComputeStage(def, ctx, in); err != nil {
				missing = "reference: " + err.Error()
			}
		}
		if missing != "" {
			// Not computed: not checked when the dump holds the stage
			// (coverage), merely absent when it does not.
			held, err := heldBy(src, u.step, u.layer, def.Name)
			if err != nil {
				return res, err
			}
			sr.Status, sr.Reason = StatusSkipped, missing
			if !held {
				sr.Status, sr.Reason = StatusMissing, "not dumped, and not computed: "+missing
			}
			res.results = append(res.results, sr)
			status[def.Name] = sr.Status
			continue
		}
		own[def.Name] = ref
		gpuLayer := u.layer
		if def.Global {
			gpuLayer = dump.Global
		}
		gpu, ok, err := src.Stage(u.step, gpuLayer, def.Name)
		if err != nil {
			return res, err
		}
		sr.Shape = ref.Shape
		if !ok {
			sr.Status = StatusMissing
			res.results = append(res.results, sr)
			status[def.Name] = StatusMissing
			continue
		}
		JudgeStage(&sr, ref, gpu, in, tol.For(def.Name), JudgeContext{m.GPURope, m.Cfg.WindowSize})
		routerNearTie(&sr, m, u.layer, in, ref, gpu)
		if def.Name == "index_score" && sr.Status != StatusSkipped {
			why, err := selectionBothWays(m, src, ctx, defs, nil, gpu, tol)
			if err != nil {
				return res, err
			}
			if why != "" {
				markSelection(&sr, why)
			}
		}
		status[def.Name] = sr.Status
		res.results = append(res.results, sr)
		if sr.Status == StatusFail && res.first == nil {
			res.first = Diagnose(DiagnoseInput{
				Model: m, Src: src, Def: def, Result: sr, Ref: ref, GPU: gpu, In: in, Own: own, Mode: Local, Tol: tol,
			})
		}
		if def.Name == "o" {
			// The split-K partials the dump holds beside o, from the same
			// dumped inputs (judged after o: the attention diagnosis of o
			// already uses them).
			srs, err := splitResults(m.Cfg, src, u.step, u.layer, in["q"], in["kv_cache"], in["topk_idxs"], tol, m.GPURope)
			if err != nil {
				return res, err
			}
			for _, r := range srs {
				res.results = append(res.results, r)
				if r.Status == StatusFail && res.first == nil {
					res.first = splitDivergence(r, Local)
				}
			}
		}
		if def.Name == "kv_cache" {
			// The GPU's page bytes, when dumped, must encode the dumped rows
			// (teacher-forced like every stage: kv_pages is computed from
			// the dumped kv_cache).
			pr, ok, err := pageResult(m, src, u.step, u.layer, gpu, sr.Status)
			if err != nil {
				return res, err
			}
			if ok {
				res.results = append(res.results, pr)
				if pr.Status == StatusFail && res.first == nil {
					res.first = &Divergence{Step: u.step, Layer: u.layer, Stage: pr.Stage, Kind: KindFP8Cache, Mode: string(Local),
						Inputs: pr.Inputs, Why: "the kv_cache rows matched, but the GPU's page bytes do not encode them: " + pr.Reason}
					res.first.Text = fmt.Sprintf("first divergence: decode step %d, layer %d, stage %s — %s: %s", u.step, u.layer, pr.Stage, KindFP8Cache, res.first.Why)
				}
			}
		}
	}
	return res, nil
}

// isSelectionStage reports whether a stage is a top-k selection judged as a
// set (a boundary tie is legal there).
func isSelectionStage(name string) bool {
	return name == "index_topk" || name == "index_sel" || name == "topk_idxs"
}

func hasTensor(m map[string]engine.Tensor, name string) bool { _, ok := m[name]; return ok }

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

// replayPropagated runs each layer's chain with RunStep from the dumped x,
// carrying the reference's own state from the dump's start state. The steps
// must be consecutive from the start state on.
//
// Each stage is judged as soon as the chain computes it. Where a top-k
// selection (index_topk, index_sel, topk_idxs) is judged a tie — the GPU
// picked another member of a boundary tie, which is legal — the chain
// continues from the GPU's selection for the rest of that step and layer
// (the selection does not enter the state carried to the next step), so the
// attention stages are not false alarms; a real divergence of the selection
// keeps the reference's own choice.
func replayPropagated(ctx context.Context, m *engine.Model, src Source, steps []int64, layers []int, opt Options) ([]unitResult, error) {
	perLayer := make([][]unitResult, len(layers))
	// Each layer's chain runs to its end and keeps its error; the error
	// returned is the first in (step, layer) order — the one a sequential
	// replay would meet first — on every run.
	errs := make([]error, len(layers))
	errStep := make([]int64, len(layers))
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	for li, l := range layers {
		g.Go(func() error {
			r, p, err := propagateLayer(ctx, m, src, steps, l, opt.Tol, nil)
			perLayer[li], errs[li], errStep[li] = r, err, p
			return nil
		})
	}
	g.Wait()
	pick := -1
	for li, err := range errs {
		if err != nil && (pick < 0 || errStep[li] < errStep[pick]) {
			pick = li
		}
	}
	if pick >= 0 {
		return nil, errs[pick]
	}
	// Reorder to (step, layer).
	var out []unitResult
	for si := range steps {
		for li := range layers {
			out = append(out, perLayer[li][si])
		}
		if opt.Progress != nil {
			opt.Progress(si+1, len(steps))
		}
	}
	return out, nil
}

// chainLink is what a chained replay hands the next layer's chain: the
// h_out this layer's chain computed at each step, and its status there.
type chainLink struct {
	hOut   map[int64]engine.Tensor
	status map[int64]string
}

// propagateLayer runs one layer's chain; on an error it also returns the
// step it stopped at (-1: before the first step). below, in a chained
// replay, holds the layer below's chain outputs: the layer then starts each
// step from that h_out (judged against the dumped h_in first) and from the
// token, and records its own h_out in link (else nil: the dumped x, or h_in
// and the token with the whole layer's weights).
func propagateLayer(ctx context.Context, m *engine.Model, src Source, steps []int64, layer int, tol *Tolerance, below *chainLink, link ...*chainLink) (_ []unitResult, failStep int64, _ error) {
	failStep = -1
	mode := Propagated
	if below != nil || len(link) > 0 {
		mode = Chained
	}
	whole := m.Weights[layer].Block != nil
	stT, after, ok, err := src.State(layer)
	if err != nil {
		return nil, failStep, err
	}
	if !ok {
		return nil, failStep, fmt.Errorf("replay %s: propagated mode needs the start state of layer %d", src.Name(), layer)
	}
	st, err := engine.LoadState(m.Cfg, layer, stT)
	if err != nil {
		return nil, failStep, fmt.Errorf("replay %s: start state of layer %d: %w", src.Name(), layer, err)
	}
	out := make([]unitResult, 0, len(steps))
	want := after + 1
	stFrom := FromStart // where the state before the step came from
	for _, p := range steps {
		failStep = p
		if err := ctx.Err(); err != nil {
			return nil, failStep, err
		}
		if p != want {
			// A gap: re-seed the chain from the state the dump holds after
			// p-1 (a state-only step), as a replay would from a start state.
			seed := map[string]engine.Tensor{}
			for name := range engine.NewLayerState(m.Cfg, layer).StateTensors() {
				t, ok, err := src.Stage(p-1, layer, name)
				if err != nil {
					return nil, failStep, err
				}
				if ok {
					seed[name] = t
				}
			}
			ns, err := engine.LoadState(m.Cfg, layer, seed)
			if err != nil {
				return nil, failStep, fmt.Errorf("replay %s: propagated mode: steps %d..%d are not in the dump and no state after step %d is: %w", src.Name(), want, p-1, p-1, err)
			}
			st, stFrom = ns, FromPrevDump
		}
		want = p + 1
		// The chain's inputs at this step (seeds): the dumped x, or with
		// the whole layer the dumped h_in (layer 0: the embedding of the
		// token, a stage) and the token; chained, the layer below's h_out.
		names := []string{"x"}
		if whole {
			names = []string{"h_in", engine.GlobalPrefix + "tok"}
			if (layer == 0 && m.Head != nil && m.Head.Embed != nil) || below != nil {
				names = names[1:]
			}
		}
		seeds := map[string]engine.Tensor{}
		for _, n := range names {
			sl, base := layer, n
			if b, ok := strings.CutPrefix(n, engine.GlobalPrefix); ok {
				sl, base = dump.Global, b
			}
			t, ok, err := src.Stage(p, sl, base)
			if err != nil {
				return nil, failStep, err
			}
			if !ok {
				return nil, failStep, fmt.Errorf("replay %s: step %d layer %d: no %s in the dump", src.Name(), p, layer, base)
			}
			seeds[n] = t
		}
		seeded := map[string]bool{} // the whole layer's inputs taken from the dump (h_in, tok)
		if whole {
			for n := range seeds {
				seeded[n] = true
			}
		}
		x := seeds["x"]
		sctx := &engine.StepContext{Cfg: m.Cfg, Layer: layer, Pos: p, W: m.Weights[layer], Rope: m.Rope[layer], Head: m.Head}
		var ur unitResult
		status := map[string]string{}     // this step's stage statuses
		own := map[string]engine.Tensor{} // the chain's values at this step
		followed := map[string]bool{}     // selection stages the chain took from the dump (a tie)
		judge := func(def engine.StageDef, chainIn map[string]engine.Tensor, ref engine.Tensor) (engine.Tensor, error) {
			own[def.Name] = ref
			sr := StageResult{Step: p, Layer: layer, Stage: def.Name, Equation: def.Equation}
			for _, n := range def.Inputs {
				// The chain's own value; same-step inputs were compared
				// with the dump just before. The state before the step is
				// the dump's (start state, or a state-only step after a
				// gap, both unchecked) at the first step of the chain.
				info := InputInfo{Name: n, From: FromPropagate, Status: inputStatus(status[n])}
				if followed[n] || seeded[n] {
					info.From = FromDump
				}
				if strings.HasPrefix(n, engine.PrevPrefix) {
					info.From = stFrom
				}
				sr.Inputs = append(sr.Inputs, info)
			}
			gpuLayer := layer
			if def.Global {
				gpuLayer = dump.Global
			}
			gpu, ok, err := src.Stage(p, gpuLayer, def.Name)
			if err != nil {
				return ref, err
			}
			if !ok {
				sr.Status, sr.Shape = StatusMissing, ref.Shape
				ur.results = append(ur.results, sr)
				return ref, nil
			}
			// The chain's own inputs (for the diagnosis); a top-k set is
			// judged against the dumped scores, as in a local replay.
			in := map[string]engine.Tensor{}
			for _, n := range def.Inputs {
				in[n] = chainIn[n]
			}
			sel := isSelectionStage(def.Name)
			if sel {
				if s, ok, _ := src.Stage(p, layer, "index_score"); ok {
					in["index_score"] = s
				}
			}
			JudgeStage(&sr, ref, gpu, in, tol.For(def.Name), JudgeContext{m.GPURope, m.Cfg.WindowSize})
			routerNearTie(&sr, m, layer, in, ref, gpu)
			if def.Name == "index_score" {
				// The chain's own scores are the reference's.
				why, err := selectionBothWays(m, src, sctx, nil, ref.F, gpu, tol)
				if err != nil {
					return ref, err
				}
				if why != "" {
					markSelection(&sr, why)
				}
			}
			status[def.Name] = sr.Status
			next := ref
			if (sel || def.Name == "moe_indices") && sr.Status == StatusTie {
				// The GPU legally picked another member of the boundary
				// tie: the chain follows its selection (teacher-forced for
				// this step and layer), so attention is compared on the
				// keys the GPU really read. A real divergence keeps the
				// reference's own choice.
				next = gpu
				own[def.Name] = gpu
				followed[def.Name] = true
				sr.Reason += "; the propagated chain follows the GPU's selection at this step"
			}
			ur.results = append(ur.results, sr)
			if sr.Status == StatusFail && ur.first == nil {
				ur.first = Diagnose(DiagnoseInput{Model: m, Src: src, Def: def, Result: sr, Ref: ref, GPU: gpu, In: in, Own: own, Mode: mode, Tol: tol})
			}
			if def.Name == "o" {
				srs, err := splitResults(m.Cfg, src, p, layer, chainIn["q"], chainIn["kv_cache"], chainIn["topk_idxs"], tol, m.GPURope)
				if err != nil {
					return next, err
				}
				for _, r := range srs {
					for i := range r.Inputs {
						r.Inputs[i].From = FromPropagate
					}
					ur.results = append(ur.results, r)
					if r.Status == StatusFail && ur.first == nil {
						ur.first = splitDivergence(r, Propagated)
					}
				}
			}
			return next, nil
		}
		if below != nil {
			// The layer's input is the chain's h_out of the layer below.
			h, ok := below.hOut[p]
			if !ok {
				return nil, failStep, fmt.Errorf("replay %s: step %d: the chain of layer %d has no h_out", src.Name(), p, layer-1)
			}
			in := fmt.Sprintf("L%d.h_out", layer-1)
			def := engine.StageDef{Name: "h_in", Inputs: []string{in}, Equation: fmt.Sprintf("h_in = h_out of layer %d", layer-1)}
			status[in] = below.status[p]
			seeds["h_in"] = h
			if _, err := judge(def, map[string]engine.Tensor{in: h}, h); err != nil {
				return nil, failStep, err
			}
		}
		var outs map[string]engine.Tensor
		var next *engine.LayerState
		if whole {
			outs, next, err = engine.RunLayerHooked(sctx, seeds, st, judge)
		} else {
			outs, next, err = engine.RunStepHooked(sctx, x, st, judge)
		}
		if err != nil {
			return nil, failStep, fmt.Errorf("replay %s: step %d layer %d: %w", src.Name(), p, layer, err)
		}
		for _, l := range link {
			l.hOut[p], l.status[p] = outs["h_out"], status["h_out"]
		}
		if ur.first != nil {
			if err := attributeLocally(m, src, &ur, p, layer, prevInSteps(steps, p)); err != nil {
				return nil, failStep, err
			}
		}
		st, stFrom = next, FromPropagate
		out = append(out, ur)
	}
	return out, failStep, nil
}

// propagateChained is the chained replay (mode Chained): the layers run in
// order, layer 0 from the embedding of the dumped token and every later
// layer from the h_out the chain computed for the layer below at the same
// step (judged against the dumped h_in first), each carrying its own state
// across the steps, so the first divergence over the whole model and its
// growth up to the logits are seen end to end.
func propagateChained(ctx context.Context, m *engine.Model, src Source, steps []int64, layers []int, opt Options) ([]unitResult, error) {
	for i, l := range layers {
		if l != i {
			return nil, fmt.Errorf("replay %s: a chained replay needs the layers 0 … n-1 in the dump (have %v)", src.Name(), layers)
		}
		if m.Weights[l].Block == nil {
			return nil, fmt.Errorf("replay %s: a chained replay needs the whole layer's weights (hc_*, norms, MoE); layer %d has the attention path only", src.Name(), l)
		}
	}
	if m.Head == nil || m.Head.Embed == nil {
		return nil, fmt.Errorf("replay %s: a chained replay needs the embedding and head weights", src.Name())
	}
	perLayer := make([][]unitResult, len(layers))
	var below *chainLink
	for li, l := range layers {
		link := &chainLink{hOut: map[int64]engine.Tensor{}, status: map[int64]string{}}
		r, _, err := propagateLayer(ctx, m, src, steps, l, opt.Tol, below, link)
		if err != nil {
			return nil, err
		}
		perLayer[li], below = r, link
	}
	var out []unitResult
	for si := range steps {
		for li := range layers {
			out = append(out, perLayer[li][si])
		}
		if opt.Progress != nil {
			opt.Progress(si+1, len(steps))
		}
	}
	return out, nil
}

// belowInput is the check of a layer's dumped input against the layer below
// in a local replay: h_in of layer l (l > 0) is layer l-1's h_out, both from
// the dump. ok is false when the dump holds no h_in there or no h_out below
// it (h_in is then an input, read and not judged); else sr comes back with no
// status yet, to be judged.
func belowInput(src Source, u unit) (sr StageResult, def engine.StageDef, ok bool, err error) {
	_, has, err := src.Stage(u.step, u.layer, "h_in")
	if err != nil || !has {
		return sr, def, false, err
	}
	below := fmt.Sprintf("L%d.h_out", u.layer-1)
	def = engine.StageDef{Name: "h_in", Inputs: []string{below}, Equation: fmt.Sprintf("h_in = h_out of layer %d", u.layer-1)}
	sr = StageResult{Step: u.step, Layer: u.layer, Stage: "h_in", Equation: def.Equation}
	_, has, err = src.Stage(u.step, u.layer-1, "h_out")
	if err != nil {
		return sr, def, false, err
	}
	if !has {
		// Without the layer below's h_out, h_in is the layer's input only
		// (read, not judged; the chained mode checks it).
		return sr, def, false, nil
	}
	sr.Inputs = []InputInfo{{Name: below, From: FromDump, Status: "unchecked"}}
	return sr, def, true, nil
}

// prevInSteps reports whether step p-1 is among steps.
func prevInSteps(steps []int64, p int64) bool {
	return slices.Contains(steps, p-1)
}

// attributeLocally checks the first divergence of a propagated unit with a
// teacher-forced replay of the same step and layer (each stage from the
// dump's own inputs, the default local tolerances). The reference's own
// chain can stay within the propagated tolerances at the stage that made an
// error (a small rescaling of o, say) and leave them only a few stages
// later (y), where the diagnosis would blame an innocent projection. When
// the teacher-forced replay names an earlier stage, that stage is the first
// divergence: its result is marked failed with the teacher-forced reason
// and its diagnosis replaces the later one, saying where the chain left
// tolerance.
func attributeLocally(m *engine.Model, src Source, ur *unitResult, p int64, layer int, prevChecked bool) error {
	lu, err := localUnit(m, src, unit{p, layer}, DefaultTolerance(), prevChecked)
	if err != nil || lu.first == nil || lu.first.Stage == ur.first.Stage {
		return err
	}
	order := map[string]int{}
	for i, sr := range ur.results {
		if _, ok := order[sr.Stage]; !ok {
			order[sr.Stage] = i
		}
	}
	li, ok1 := order[lu.first.Stage]
	pi, ok2 := order[ur.first.Stage]
	if !ok1 || !ok2 || li >= pi {
		return nil
	}
	var reason string
	for _, sr := range lu.results {
		if sr.Stage == lu.first.Stage {
			reason = sr.Reason
		}
	}
	r := &ur.results[li]
	r.Status = StatusFail
	r.Severity = max(r.Severity, 1)
	r.Reason = "teacher-forced from the dump's inputs: " + reason
	later := ur.first
	d := lu.first
	d.Mode = string(Propagated)
	d.Why += fmt.Sprintf("; (propagated: the reference's own chain stays within the propagated tolerances here and first leaves them at stage %s; teacher-forced from the dump's inputs this stage is the first out of tolerance)", later.Stage)
	d.Text = fmt.Sprintf("first divergence: decode step %d, layer %d, stage %s — %s: %s", d.Step, d.Layer, d.Stage, d.Kind, d.Why)
	ur.first = d
	return nil
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
