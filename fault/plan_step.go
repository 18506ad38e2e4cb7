package fault

// The recomputation of one layer at one step of the walk (faultPlan.walk):
// every stage reading a value the fault changed, the state the layer leaves
// for its next step, and the faulty cache rows carried across steps the dump
// holds only the state of.

import (
	"fmt"
	"sort"
	"strings"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/replay"
)

// links names, for the layer above l, each input that is an output of
// layer l (input name -> output name): the hyper-connection streams h_in =
// h_out of a V4 layer with block weights, x_in = ffn_out and res_in = h_mid
// of a V3.2 layer with its FFN weights; nil where the reference does not
// model what runs between the layers (the weights hold the attention path
// only).
func (pl *faultPlan) links(l int) map[string]string {
	w := pl.m.Weights[l]
	switch {
	case w == nil:
		return nil
	case pl.cfg.V32():
		if v32HasFFN(pl.m, l) {
			return map[string]string{"x_in": "ffn_out", "res_in": "h_mid"}
		}
	case w.Block != nil:
		return map[string]string{"h_in": "h_out"}
	}
	return nil
}

// prevInput is the value of layer l's state name after step p-1: the changed
// value when step p-1 changed it, else the dump's (step p-1, or the start
// state).
func (pl *faultPlan) prevInput(p int64, l int, tr *layerTrack, name string) (t engine.Tensor, ok, changed bool, err error) {
	if tr.prevStep == p-1 {
		if t, ok := tr.prevNew[name]; ok {
			return t, true, true, nil
		}
	}
	if p-1 >= 0 {
		t, ok, err := pl.src.Stage(p-1, l, name)
		if err != nil || ok {
			return t, ok, false, err
		}
	}
	st, after, ok, err := pl.src.State(l)
	if err != nil || !ok || after != p-1 {
		return engine.Tensor{}, false, false, err
	}
	t, ok = st[name]
	return t, ok, false, nil
}

// fullStep walks the stages of layer l at a dumped step p: the fault at its
// stage, the reference for every stage reading a changed value. seeds are
// the layer's inputs the layer below changed (its output streams). It
// returns the changed values the layer above reads (links).
func (pl *faultPlan) fullStep(p int64, l int, tr *layerTrack, seeds map[string]engine.Tensor) (map[string]engine.Tensor, error) {
	cfg := pl.cfg
	if pl.m.Weights[l] == nil {
		pl.notes.add(p, fmt.Sprintf("layer %d has no weights: its stages are not recomputed from the faulty values", l))
		tr.prevStep, tr.prevNew, tr.carry = p, nil, nil
		return nil, nil
	}
	ctx := &engine.StepContext{Cfg: cfg, Layer: l, Pos: p, W: pl.m.Weights[l], Rope: pl.m.Rope[l], Head: pl.m.Head}
	if err := ctx.Check(); err != nil {
		return nil, fmt.Errorf("fault %s: step %d layer %d: %w", pl.f, p, l, err)
	}
	changed := map[string]engine.Tensor{} // values of this step that differ from the dump
	for name, t := range seeds {
		changed[name] = t
	}
	own := map[string]engine.Tensor{} // reference values of stages the dump lacks
	contiguous := tr.prevStep == p-1
	if !contiguous {
		if err := pl.checkCarry(p, tr); err != nil {
			return nil, err
		}
	}
	// The whole layer when its weights hold it: hyper-connections, MoE
	// and, on the last layer, the logits.
	defs := engine.BlockStages(cfg, l, p, pl.m.Weights[l], pl.m.Head)
	var last string              // the layer's last stage (its output without links)
	stuck := map[string]string{} // stages that read a changed value but cannot be recomputed -> the input missing
	for _, def := range defs {
		in := make(map[string]engine.Tensor, len(def.Inputs))
		fromChanged, missing := false, ""
		for _, name := range def.Inputs {
			t, ok, ch, err := pl.input(p, l, tr, name, changed, own)
			if err != nil {
				return nil, err
			}
			if !ok {
				if missing == "" {
					missing = name
				}
				if m, bad := stuck[name]; bad {
					// Computed from a changed value, had it been computable.
					fromChanged, missing = true, m
				}
				continue
			}
			in[name], fromChanged = t, fromChanged || ch
		}
		defLayer := l
		if def.Global {
			defLayer = dump.Global
		} else {
			last = def.Name
		}
		gpu, dumped, err := pl.src.Stage(p, defLayer, def.Name)
		if err != nil {
			return nil, err
		}
		atFault := pl.inj.at(p, l, def.Name)
		if missing != "" {
			switch {
			case atFault:
				return nil, fmt.Errorf("fault %s: stage %s cannot be computed from the dump (an input is neither dumped nor computable)", pl.f, def.Name)
			case def.Name == "kv_cache" && dumped && !contiguous:
				// Across a gap: the dump's cache with the faulty rows no
				// later token overwrote.
				if t := pl.carried(p, l, tr, gpu); !bitIdentical(t, gpu) {
					changed[def.Name] = t
				}
			case fromChanged:
				stuck[def.Name] = missing
				if dumped {
					pl.notes.add(p, fmt.Sprintf("layer %d, stage %s reads a value the fault changed but cannot be recomputed (%s is neither dumped nor computable): kept as dumped", l, def.Name, missing))
				}
			}
			continue
		}
		late := pl.inj.lateWrite(ctx, def.Name, gpu)
		if !fromChanged && !atFault && dumped && bitIdentical(late, gpu) {
			continue // the dump's value stands
		}
		ref, err := replay.ComputeStage(def, ctx, in)
		if err != nil {
			from := "recomputing %s from the faulty values"
			if !fromChanged {
				from = "computing %s from the dumped inputs"
			}
			return nil, fmt.Errorf("fault %s: step %d layer %d: "+from+": %w", pl.f, p, l, def.Name, err)
		}
		if !dumped {
			own[def.Name] = ref
			if fromChanged {
				changed[def.Name] = ref
			}
			continue
		}
		v := ref
		switch {
		case atFault:
			if v, err = pl.inj.apply(ctx, gpu, ref, in, pl.m.GPURope); err != nil {
				return nil, err
			}
		case !fromChanged:
			v = gpu
		}
		v = pl.inj.lateWrite(ctx, def.Name, v)
		if !bitIdentical(v, gpu) {
			changed[def.Name] = v
		}
	}
	if err := pl.splitPartials(p, l, changed); err != nil {
		return nil, err
	}
	global := map[string]bool{}
	for _, def := range defs {
		global[def.Name] = def.Global
	}
	if len(changed) > 0 {
		pl.noteUnmodeled(p, l, defs)
	}
	for name, t := range changed {
		layer := l
		if global[name] {
			layer = dump.Global // logits
		}
		if _, ok, _ := pl.src.Stage(p, layer, name); ok {
			pl.patch[replay.StageKey{Step: p, Layer: layer, Stage: name}] = t
		}
	}
	pl.endStep(p, l, tr, changed)
	_, lastChanged := changed[last]
	_, lastStuck := stuck[last]
	if l == cfg.NLayers-1 {
		if _, ok := global["logits"]; !ok && (lastChanged || lastStuck) {
			if _, dumped, _ := pl.src.Stage(p, dump.Global, "logits"); dumped {
				pl.notes.add(p, "the weights hold no head: the logits are not recomputed from the last layer's faulty output")
			}
		}
		return nil, nil
	}
	links := pl.links(l)
	if links == nil {
		if lastChanged || lastStuck {
			pl.notes.add(p, fmt.Sprintf("layer %d's output %s changed, but its weights hold the attention path only (the residual stream between layers is not part of the reference): the layers above and the logits keep their dumped values", l, last))
		}
		return nil, nil
	}
	out := map[string]engine.Tensor{}
	var lost []string
	for in, from := range links {
		if t, ok := changed[from]; ok {
			out[in] = t
		} else if m, ok := stuck[from]; ok {
			lost = append(lost, fmt.Sprintf("%s (%s is neither dumped nor computable)", from, m))
		}
	}
	if len(lost) > 0 {
		sort.Strings(lost)
		pl.notes.add(p, fmt.Sprintf("layer %d's output %s reads a value the fault changed but cannot be recomputed: the layers above and the logits keep their dumped inputs", l, strings.Join(lost, ", ")))
	}
	return out, nil
}

// noteUnmodeled notes the stage records the dump holds for layer l at step
// p that the reference neither computes nor reads (defs), where the fault
// reaches the layer: the GPU computed them from the changed values, the
// copy keeps them as dumped. Split-K partials are recomputed
// (splitPartials).
func (pl *faultPlan) noteUnmodeled(p int64, l int, defs []engine.StageDef) {
	known := map[string]bool{}
	for _, def := range defs {
		known[def.Name] = true
		for _, in := range def.Inputs {
			known[strings.TrimPrefix(in, engine.PrevPrefix)] = true
		}
	}
	var odd []string
	for _, n := range pl.src.StageNames(p, l) {
		if known[n] || n == "split_bounds" || strings.HasPrefix(n, "o_split/") || strings.HasPrefix(n, "lse_split/") {
			continue
		}
		odd = append(odd, n)
	}
	if len(odd) > 0 {
		pl.notes.add(p, fmt.Sprintf("layer %d: stage(s) %s are not part of the reference: kept as dumped, though the fault reaches the layer", l, strings.Join(odd, ", ")))
	}
}

// input is the value of input name of a stage of layer l at step p, and
// whether it differs from the dump's: a "prev:" state (prevInput), a value
// this step changed, the step's global value (the token), the dumped value,
// else the reference's own value of a stage the dump lacks.
func (pl *faultPlan) input(p int64, l int, tr *layerTrack, name string, changed, own map[string]engine.Tensor) (engine.Tensor, bool, bool, error) {
	if base, ok := strings.CutPrefix(name, engine.PrevPrefix); ok {
		return pl.prevInput(p, l, tr, base)
	}
	if t, ok := changed[name]; ok {
		return t, true, true, nil
	}
	inLayer, inName := l, name
	if base, ok := strings.CutPrefix(name, engine.GlobalPrefix); ok {
		inLayer, inName = dump.Global, base // the token
	}
	t, ok, err := pl.src.Stage(p, inLayer, inName)
	if err != nil || ok {
		return t, ok, false, err
	}
	t, ok = own[name]
	return t, ok, false, nil
}

// stateStep carries the faulty cache rows of the fault's layer into the
// state records of a step the dump holds only the state of (its stages were
// not dumped). Any other layer's changed state cannot be followed through a
// step whose inputs were not dumped: the layer starts again from the
// dumped state (walk notes it).
func (pl *faultPlan) stateStep(p int64, l int, tr *layerTrack) error {
	if l != pl.layer {
		tr.prevStep, tr.prevNew, tr.carry = p, nil, nil // walk noted what is lost
		return nil
	}
	if err := pl.checkCarry(p, tr); err != nil {
		return err
	}
	changed := map[string]engine.Tensor{}
	gpu, ok, err := pl.src.Stage(p, l, "kv_cache")
	if err != nil {
		return err
	}
	if ok {
		if t := pl.carried(p, l, tr, gpu); !bitIdentical(t, gpu) {
			changed["kv_cache"] = t
			pl.patch[replay.StageKey{Step: p, Layer: l, Stage: "kv_cache"}] = t
		}
	}
	pl.endStep(p, l, tr, changed)
	return nil
}

// checkCarry refuses to carry a changed state of the fault's layer other
// than the cache across steps that are not recomputed.
func (pl *faultPlan) checkCarry(p int64, tr *layerTrack) error {
	for name := range tr.prevNew {
		if name != "kv_cache" {
			return fmt.Errorf("fault %s: %s changed at step %d, and steps %d..%d are not in the dump to carry it", pl.f, name, tr.prevStep, tr.prevStep+1, p)
		}
	}
	return nil
}

// carried is the dump's kv_cache of layer l after step p with the faulty
// rows of the last processed step q that no token in (q, p] overwrote:
// window slot t mod W is rewritten by token t, and a late compressed row
// lands at the step after its emission step. Only the fault's layer
// carries rows across steps that are not recomputed: the layers below it
// are unchanged, so the rows it wrote meanwhile are the dump's.
func (pl *faultPlan) carried(p int64, l int, tr *layerTrack, gpu engine.Tensor) engine.Tensor {
	if l != pl.layer || len(tr.carry) == 0 || len(gpu.Shape) != 2 {
		return gpu
	}
	W, D := pl.cfg.WindowSize, gpu.Shape[1]
	gone := map[int]bool{}
	for t := tr.prevStep + 1; t <= p && len(gone) < W; t++ {
		gone[int(t%int64(W))] = true
	}
	if pl.f.Kind == CompressorLate && pl.f.Step+1 > tr.prevStep && pl.f.Step+1 <= p {
		gone[W+attention.EmittedRow(pl.f.Step, pl.cfg.Ratio(l))] = true
	}
	out := gpu.Clone()
	for i, row := range tr.carry {
		if gone[i] || (i+1)*D > len(out.F) || len(row) != D {
			continue
		}
		copy(out.F[i*D:(i+1)*D], row)
	}
	return out
}

// endStep records what step p of layer l leaves for the layer's next step:
// its changed state tensors and the kv_cache rows that differ from the dump.
func (pl *faultPlan) endStep(p int64, l int, tr *layerTrack, changed map[string]engine.Tensor) {
	tr.prevStep, tr.prevNew, tr.carry = p, map[string]engine.Tensor{}, nil
	for name, t := range changed {
		if replay.IsStateStage(name) {
			tr.prevNew[name] = t
		}
	}
	if len(changed) > 0 {
		pl.carriedTo = max(pl.carriedTo, p)
	}
	kv, ok := changed["kv_cache"]
	if !ok || len(kv.Shape) != 2 {
		return
	}
	gpu, ok, err := pl.src.Stage(p, l, "kv_cache")
	if err != nil || !ok || !engine.SameShape(gpu.Shape, kv.Shape) {
		return
	}
	D := kv.Shape[1]
	tr.carry = map[int][]float32{}
	for i := 0; i < kv.Shape[0]; i++ {
		a, b := kv.F[i*D:(i+1)*D], gpu.F[i*D:(i+1)*D]
		if !bitIdentical(engine.FromF(engine.KindF32, a, D), engine.FromF(engine.KindF32, b, D)) {
			tr.carry[i] = append([]float32(nil), a...)
		}
	}
}

// splitPartials recomputes the split-K partials (split_bounds, o_split/<s>,
// lse_split/<s>) dumped beside o when an input of the attention (q,
// kv_cache, topk_idxs) of layer l changed at step p: the GPU's split kernel
// would have read the changed values. The dumped split_bounds are kept.
func (pl *faultPlan) splitPartials(p int64, l int, changed map[string]engine.Tensor) error {
	bt, ok, err := pl.src.Stage(p, l, "split_bounds")
	if err != nil || !ok {
		return err
	}
	get := func(name string) (engine.Tensor, bool) {
		if t, ok := changed[name]; ok {
			return t, true
		}
		t, ok, _ := pl.src.Stage(p, l, name)
		return t, ok
	}
	_, c1 := changed["q"]
	_, c2 := changed["kv_cache"]
	_, c3 := changed["topk_idxs"]
	if !c1 && !c2 && !c3 {
		return nil
	}
	q, ok1 := get("q")
	kv, ok2 := get("kv_cache")
	idx, ok3 := get("topk_idxs")
	if !ok1 || !ok2 || !ok3 || bt.Kind.IsFloat() || len(bt.I) < 2 || bt.I[len(bt.I)-1] != int64(len(idx.I)) {
		return fmt.Errorf("fault %s: step %d layer %d: split-K partials dumped beside o cannot be recomputed (split_bounds %v, index list of %d entries)", pl.f, p, l, bt.I, len(idx.I))
	}
	cfg := pl.cfg
	for s, pt := range replay.SplitPartials(cfg, q, kv, idx, bt.I) {
		changed[fmt.Sprintf("o_split/%d", s)] = engine.FromF(engine.KindF32, pt.O, cfg.NHeads, cfg.HeadDim)
		changed[fmt.Sprintf("lse_split/%d", s)] = engine.FromF(engine.KindF32, pt.LSE2, cfg.NHeads)
	}
	return nil
}
