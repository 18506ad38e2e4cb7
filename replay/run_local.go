package replay

import (
	"context"
	"fmt"
	"runtime"
	"strings"

	"golang.org/x/sync/errgroup"

	"sparsemla/dump"
	"sparsemla/engine"
)

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
			var r unitResult
			err := guardUnit(fmt.Sprintf("replaying step %d layer %d", u.step, u.layer), func() (err error) {
				r, err = localUnit(m, src, u, opt.Tol, replayed[u.step-1])
				return err
			})
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
	var res unitResult
	ctx := &engine.StepContext{Cfg: m.Cfg, Layer: u.layer, Pos: u.step, W: m.Weights[u.layer], Rope: m.Rope[u.layer], Head: m.Head}
	defs := engine.BlockStages(m.Cfg, u.layer, u.step, m.Weights[u.layer], m.Head)
	if m.Cfg.V32() {
		var err error
		if defs, err = v32LocalDefs(m, src, u, defs); err != nil {
			return res, err
		}
	}
	if u.layer > 0 && m.Weights[u.layer].Block != nil {
		if err := localBelow(m, src, u, tol, &res); err != nil {
			return res, err
		}
	}
	own := map[string]engine.Tensor{}    // the reference's values at this step
	status := map[string]string{}        // this step's stage statuses
	start := &startState{}               // loaded on first use
	judged := map[string]engine.Tensor{} // this step's dumped values read to be judged (copies)
	for _, def := range defs {
		sr := StageResult{Step: u.step, Layer: u.layer, Stage: def.Name, Equation: def.Equation}
		in, infos, missing, err := localInputs(src, u, def, prevChecked, start, status, own, judged)
		if err != nil {
			return res, err
		}
		sr.Inputs = infos
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
		if ok && !def.Global {
			judged[def.Name] = gpu.Clone()
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

// localBelow judges, in a local replay, the dumped h_in of layer u.layer
// (> 0) against the dumped h_out of the layer below (belowInput) and adds
// the result to res (diagnosed when it fails); nothing when the dump holds
// no such pair.
func localBelow(m *engine.Model, src Source, u unit, tol *Tolerance, res *unitResult) error {
	sr, def, ok, err := belowInput(src, u)
	if err != nil {
		return err
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
	return nil
}

// startState is a layer's start state in the dump, read on first use.
type startState struct {
	t      map[string]engine.Tensor
	after  int64 // the step the state is valid after
	ok     bool  // the dump holds a start state
	loaded bool
}

// localInputs gathers the inputs of stage def at unit u in a local replay,
// each with where it came from: "prev:X" the dumped X of step p-1, else the
// start state (when it is valid after p-1); a global input (the token) this
// step's dumped value; any other this step's dumped value, else the
// reference's own (own). status holds this step's stage statuses so far.
// missing, when not empty, says why an input has no value; infos then lists
// the inputs before it. judged holds copies of this step's dumped values
// already read (to be judged): an input among them is a copy of it, not read
// and decoded again.
func localInputs(src Source, u unit, def engine.StageDef, prevChecked bool, start *startState, status map[string]string, own, judged map[string]engine.Tensor) (in map[string]engine.Tensor, infos []InputInfo, missing string, err error) {
	prevStep := u.step - 1
	in = make(map[string]engine.Tensor, len(def.Inputs))
	for _, name := range def.Inputs {
		info := InputInfo{Name: name}
		if base, ok := strings.CutPrefix(name, "prev:"); ok {
			var t engine.Tensor
			found := false
			if prevStep >= 0 {
				v, ok, err := src.Stage(prevStep, u.layer, base)
				if err != nil {
					return in, infos, missing, err
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
				if !start.loaded {
					var err error
					start.t, start.after, start.ok, err = src.State(u.layer)
					if err != nil {
						return in, infos, missing, err
					}
					start.loaded = true
				}
				if v, ok := start.t[base]; ok && start.ok && start.after == u.step-1 {
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
				return in, infos, missing, err
			}
			if !ok {
				missing = fmt.Sprintf("no %s at step %d in the dump", base, u.step)
				break
			}
			in[name] = v
			info.From, info.Status = FromDump, "unchecked"
		} else {
			v, ok := judged[name]
			if ok {
				v = v.Clone()
			} else if v, ok, err = src.Stage(u.step, u.layer, name); err != nil {
				return in, infos, missing, err
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
		infos = append(infos, info)
	}
	return in, infos, missing, nil
}

// isSelectionStage reports whether a stage is a top-k selection judged as a
// set (a boundary tie is legal there).
func isSelectionStage(name string) bool {
	return name == "index_topk" || name == "index_sel" || name == "topk_idxs"
}

func hasTensor(m map[string]engine.Tensor, name string) bool { _, ok := m[name]; return ok }

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
