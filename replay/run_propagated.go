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
			var (
				r []unitResult
				p int64
			)
			err := guardUnit(fmt.Sprintf("replaying layer %d", l), func() (err error) {
				r, p, err = propagateLayer(ctx, m, src, steps, l, opt.Tol, nil)
				return err
			})
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
			ns, err := reseedChain(m, src, layer, p, want)
			if err != nil {
				return nil, failStep, err
			}
			st, stFrom = ns, FromPrevDump
		}
		want = p + 1
		seeds, err := chainSeeds(m, src, p, layer, whole, below != nil)
		if err != nil {
			return nil, failStep, err
		}
		v32Whole, err := v32WholeSeeds(m, src, p, layer, below != nil, seeds)
		if err != nil {
			return nil, failStep, err
		}
		seeded := map[string]bool{} // the whole layer's inputs taken from the dump (h_in, tok)
		if whole {
			for n := range seeds {
				seeded[n] = true
			}
		}
		x := seeds["x"]
		sctx := &engine.StepContext{Cfg: m.Cfg, Layer: layer, Pos: p, W: m.Weights[layer], Rope: m.Rope[layer], Head: m.Head}
		cs := &chainStep{
			m: m, src: src, tol: tol, mode: mode, p: p, layer: layer, sctx: sctx, stFrom: stFrom,
			status:   map[string]string{},
			own:      map[string]engine.Tensor{},
			followed: map[string]bool{},
			seeded:   seeded,
		}
		if below != nil {
			// The layer's input is the chain's h_out of the layer below.
			h, ok := below.hOut[p]
			if !ok {
				return nil, failStep, fmt.Errorf("replay %s: step %d: the chain of layer %d has no h_out", src.Name(), p, layer-1)
			}
			in := fmt.Sprintf("L%d.h_out", layer-1)
			def := engine.StageDef{Name: "h_in", Inputs: []string{in}, Equation: fmt.Sprintf("h_in = h_out of layer %d", layer-1)}
			cs.status[in] = below.status[p]
			seeds["h_in"] = h
			if _, err := cs.judge(def, map[string]engine.Tensor{in: h}, h); err != nil {
				return nil, failStep, err
			}
		}
		var outs map[string]engine.Tensor
		var next *engine.LayerState
		if whole || v32Whole {
			outs, next, err = engine.RunLayerHooked(sctx, seeds, st, cs.judge)
		} else {
			outs, next, err = engine.RunStepHooked(sctx, x, st, cs.judge)
		}
		if err != nil {
			return nil, failStep, fmt.Errorf("replay %s: step %d layer %d: %w", src.Name(), p, layer, err)
		}
		for _, l := range link {
			l.hOut[p], l.status[p] = outs["h_out"], cs.status["h_out"]
		}
		st, stFrom = next, FromPropagate
		out = append(out, cs.ur)
	}
	return out, failStep, nil
}

// reseedChain bridges a gap in a layer's chain (steps want..p-1 are not in
// the dump): it re-seeds the chain from the state the dump holds after p-1
// (a state-only step), as a replay would from a start state.
func reseedChain(m *engine.Model, src Source, layer int, p, want int64) (*engine.LayerState, error) {
	seed := map[string]engine.Tensor{}
	for name := range engine.NewLayerState(m.Cfg, layer).StateTensors() {
		t, ok, err := src.Stage(p-1, layer, name)
		if err != nil {
			return nil, err
		}
		if ok {
			seed[name] = t
		}
	}
	ns, err := engine.LoadState(m.Cfg, layer, seed)
	if err != nil {
		return nil, fmt.Errorf("replay %s: propagated mode: steps %d..%d are not in the dump and no state after step %d is: %w", src.Name(), want, p-1, p-1, err)
	}
	return ns, nil
}

// chainSeeds reads the chain's inputs at step p (seeds) from the dump: the
// dumped x, or with the whole layer the dumped h_in (layer 0: the embedding
// of the token, a stage) and the token; chained (chained true), the layer
// below's h_out, which the caller adds.
func chainSeeds(m *engine.Model, src Source, p int64, layer int, whole, chained bool) (map[string]engine.Tensor, error) {
	names := []string{"x"}
	if whole {
		names = []string{"h_in", engine.GlobalPrefix + "tok"}
		if (layer == 0 && m.Head != nil && m.Head.Embed != nil) || chained {
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
			return nil, err
		}
		if !ok {
			return nil, fmt.Errorf("replay %s: step %d layer %d: no %s in the dump", src.Name(), p, layer, base)
		}
		seeds[n] = t
	}
	return seeds, nil
}

// chainStep is one step of one layer's chain, as its stages are judged:
// the statuses and values so far, the selections the chain took from the
// dump and the results.
type chainStep struct {
	m      *engine.Model
	src    Source
	tol    *Tolerance
	mode   Mode
	p      int64
	layer  int
	sctx   *engine.StepContext
	stFrom string // where the state before the step came from

	ur       unitResult
	status   map[string]string        // this step's stage statuses
	own      map[string]engine.Tensor // the chain's values at this step
	followed map[string]bool          // selection stages the chain took from the dump (a tie)
	seeded   map[string]bool          // the whole layer's inputs taken from the dump (h_in, tok)
}

// judge is the chain's hook (engine.RunLayerHooked, RunStepHooked): it judges
// the stage def the chain just computed (ref, from chainIn) against the dump
// and returns the value the chain continues from — ref, or the GPU's
// selection where a top-k set is judged a tie.
func (c *chainStep) judge(def engine.StageDef, chainIn map[string]engine.Tensor, ref engine.Tensor) (engine.Tensor, error) {
	c.own[def.Name] = ref
	sr := StageResult{Step: c.p, Layer: c.layer, Stage: def.Name, Equation: def.Equation}
	for _, n := range def.Inputs {
		// The chain's own value; same-step inputs were compared
		// with the dump just before. The state before the step is
		// the dump's (start state, or a state-only step after a
		// gap, both unchecked) at the first step of the chain.
		info := InputInfo{Name: n, From: FromPropagate, Status: inputStatus(c.status[n])}
		if c.followed[n] || c.seeded[n] {
			info.From = FromDump
		}
		if strings.HasPrefix(n, engine.PrevPrefix) {
			info.From = c.stFrom
		}
		sr.Inputs = append(sr.Inputs, info)
	}
	gpuLayer := c.layer
	if def.Global {
		gpuLayer = dump.Global
	}
	gpu, ok, err := c.src.Stage(c.p, gpuLayer, def.Name)
	if err != nil {
		return ref, err
	}
	if !ok {
		sr.Status, sr.Shape = StatusMissing, ref.Shape
		c.ur.results = append(c.ur.results, sr)
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
		if s, ok, _ := c.src.Stage(c.p, c.layer, "index_score"); ok {
			in["index_score"] = s
		}
	}
	JudgeStage(&sr, ref, gpu, in, c.tol.For(def.Name), JudgeContext{c.m.GPURope, c.m.Cfg.WindowSize})
	routerNearTie(&sr, c.m, c.layer, in, ref, gpu)
	if def.Name == "index_score" {
		// The chain's own scores are the reference's.
		why, err := selectionBothWays(c.m, c.src, c.sctx, nil, ref.F, gpu, c.tol)
		if err != nil {
			return ref, err
		}
		if why != "" {
			markSelection(&sr, why)
		}
	}
	c.status[def.Name] = sr.Status
	next := ref
	if (sel || def.Name == "moe_indices") && sr.Status == StatusTie {
		// The GPU legally picked another member of the boundary
		// tie: the chain follows its selection (teacher-forced for
		// this step and layer), so attention is compared on the
		// keys the GPU really read. A real divergence keeps the
		// reference's own choice.
		next = gpu
		c.own[def.Name] = gpu
		c.followed[def.Name] = true
		sr.Reason += "; the propagated chain follows the GPU's selection at this step"
	}
	c.ur.results = append(c.ur.results, sr)
	if sr.Status == StatusFail && c.ur.first == nil {
		c.ur.first = Diagnose(DiagnoseInput{Model: c.m, Src: c.src, Def: def, Result: sr, Ref: ref, GPU: gpu, In: in, Own: c.own, Mode: c.mode, Tol: c.tol})
	}
	if def.Name == "kv_cache" {
		// The GPU's page bytes, when dumped, must encode the dumped rows,
		// as in a local replay (a check of the dump against itself: the
		// chain's own rows are judged above).
		pr, ok, err := pageResult(c.m, c.src, c.p, c.layer, gpu, sr.Status)
		if err != nil {
			return next, err
		}
		if ok {
			c.ur.results = append(c.ur.results, pr)
			if pr.Status == StatusFail && c.ur.first == nil {
				c.ur.first = &Divergence{Step: c.p, Layer: c.layer, Stage: pr.Stage, Kind: KindFP8Cache, Mode: string(c.mode),
					Inputs: pr.Inputs, Why: "the GPU's page bytes do not encode its dumped kv_cache rows: " + pr.Reason}
				c.ur.first.Text = fmt.Sprintf("first divergence: decode step %d, layer %d, stage %s — %s: %s", c.p, c.layer, pr.Stage, KindFP8Cache, c.ur.first.Why)
			}
		}
	}
	if def.Name == "o" {
		srs, err := splitResults(c.m.Cfg, c.src, c.p, c.layer, chainIn["q"], chainIn["kv_cache"], chainIn["topk_idxs"], c.tol, c.m.GPURope)
		if err != nil {
			return next, err
		}
		for _, r := range srs {
			for i := range r.Inputs {
				r.Inputs[i].From = FromPropagate
			}
			c.ur.results = append(c.ur.results, r)
			if r.Status == StatusFail && c.ur.first == nil {
				c.ur.first = splitDivergence(r, c.mode)
			}
		}
	}
	return next, nil
}

// propagateChained is the chained replay (mode Chained): the layers run in
// order, layer 0 from the embedding of the dumped token and every later
// layer from the h_out the chain computed for the layer below at the same
// step (judged against the dumped h_in first), each carrying its own state
// across the steps, so the first divergence over the whole model and its
// growth up to the logits are seen end to end.
func propagateChained(ctx context.Context, m *engine.Model, src Source, steps []int64, layers []int, opt Options) ([]unitResult, error) {
	if m.Cfg.V32() {
		return v32Chained(ctx, m, src, steps, layers, opt)
	}
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
