package fault

import (
	"fmt"

	"sort"
	"strings"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/replay"
)

// faultPlan is what a faulted copy changes in the input: stage records of
// the replayed request (patch, drop), page records (by entry index), and
// records and a prefix hit it adds.
type faultPlan struct {
	d     *dump.Dump
	src   *replay.DumpSource
	m     *engine.Model
	cfg   *engine.Config
	f     Fault
	layer int
	inj   *faultInjector

	patch map[replay.StageKey]engine.Tensor
	drop  map[replay.StageKey]bool
	pages map[int][]byte // entry index -> re-encoded page bytes

	donor      string        // stale-prefix donor request
	donorCache engine.Tensor // its kv_cache at the fault step
	carriedTo  int64

	// Walking the steps: the last step processed, the state tensors that
	// changed there (full values), and the kv_cache rows that differ from
	// the dump after it.
	prevStep int64
	prevNew  map[string]engine.Tensor
	carry    map[int][]float32
}

// planFault checks that the fault applies to the dump and computes every
// record it changes.
func planFault(d *dump.Dump, src *replay.DumpSource, m *engine.Model, opt Options) (*faultPlan, error) {
	f := opt.Fault
	steps, layers := src.Steps(), src.Layers()
	if err := f.Check(m.Cfg, steps[0], steps[len(steps)-1]); err != nil {
		return nil, err
	}
	if f.NeedsBlock() && m.Cfg.V32() && !v32HasFFN(m, f.Layer) && f.checkV32(m.Cfg) == nil {
		return nil, fmt.Errorf("fault %s: needs the whole V3.2 layer's weights (norms, FFN; the head for logits); the weights of layer %d hold the attention path only", f, f.Layer)
	}
	if f.NeedsBlock() && !m.Cfg.V32() && (m.Weights[f.Layer] == nil || m.Weights[f.Layer].Block == nil) {
		return nil, fmt.Errorf("fault %s: needs the whole layer's weights (hyper-connections, MoE); the weights of layer %d hold the attention path only", f, f.Layer)
	}
	if !containsStep(steps, f.Step) {
		return nil, fmt.Errorf("fault %s: step %d is not a dumped decode step (dumped: %s)", f, f.Step, replay.StepList(steps))
	}
	if !containsInt(layers, f.Layer) {
		return nil, fmt.Errorf("fault %s: layer %d is not in the dump", f, f.Layer)
	}
	stageLayer := f.Layer
	if f.Kind == HeadNoNorm {
		stageLayer = dump.Global // logits: a global stage, computed after the last layer
	}
	if _, ok, err := src.Stage(f.Step, stageLayer, f.StageIn(m.Cfg)); err != nil {
		return nil, err
	} else if !ok {
		return nil, fmt.Errorf("fault %s: the dump does not hold stage %s at step %d, layer %d, so a replay could not see the fault", f, f.StageIn(m.Cfg), f.Step, f.Layer)
	}
	switch f.Kind {
	case TopKOffByOne:
		if m.Cfg.V32() {
			break // checkV32: the V3.2 indexer ranks every token
		}
		// Top-k selects min(index_topk, Tc) of the Tc compressed rows; with
		// Tc <= k every row is selected and there is no unselected
		// neighbour for the last entry to slip to.
		if tc := (f.Step + 1) / 4; tc <= int64(m.Cfg.IndexTopK) {
			return nil, fmt.Errorf("fault %s: at step %d the indexer selects every one of its Tc = %d compressed rows (top-%d): no unselected neighbour to be off by one to (needs Tc > %d, step >= %d)",
				f, f.Step, tc, m.Cfg.IndexTopK, m.Cfg.IndexTopK, 4*(m.Cfg.IndexTopK+1)-1)
		}
	case StalePrefix:
		if hit, ok := src.PrefixHit(); ok {
			return nil, fmt.Errorf("fault %s: the dump already records a prefix-cache hit of request %q from %q", f, src.Request, hit.From)
		}
	}
	pl := &faultPlan{d: d, src: src, m: m, cfg: m.Cfg, f: f, layer: f.Layer,
		patch: map[replay.StageKey]engine.Tensor{}, drop: map[replay.StageKey]bool{}, pages: map[int][]byte{},
		prevStep: f.Step - 1, carriedTo: f.Step}
	var other map[int]engine.Tensor
	if f.Kind == StalePrefix {
		if err := pl.makeDonor(opt.Seed); err != nil {
			return nil, err
		}
		other = map[int]engine.Tensor{f.Layer: pl.donorCache}
	}
	pl.inj = newFaultInjector(f, opt.Seed, other, m.Cfg)
	for _, p := range pl.layerSteps() {
		if p > f.Step && len(pl.prevNew) == 0 && len(pl.carry) == 0 {
			break // nothing left to carry
		}
		var err error
		if containsStep(steps, p) {
			err = pl.fullStep(p)
		} else {
			err = pl.stateStep(p)
		}
		if err != nil {
			return nil, err
		}
	}
	for name := range pl.inj.hidden {
		k := replay.StageKey{Step: f.Step, Layer: f.Layer, Stage: name}
		if _, ok, _ := src.Stage(k.Step, k.Layer, k.Stage); ok {
			pl.drop[k] = true
			delete(pl.patch, k)
		}
	}
	if err := pl.planPages(); err != nil {
		return nil, err
	}
	return pl, nil
}

// layerSteps lists every step from the fault's on at which the dump holds
// stage records of the fault's layer (full and state-only steps), ascending.
func (pl *faultPlan) layerSteps() []int64 {
	seen := map[int64]bool{}
	for _, e := range pl.d.Entries {
		if e.Kind == dump.KindStage && e.Request == pl.src.Request && e.Layer == pl.layer && int64(e.Step) >= pl.f.Step {
			seen[int64(e.Step)] = true
		}
	}
	out := make([]int64, 0, len(seen))
	for p := range seen {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// prevInput is the value of state name after step p-1: the changed value
// when step p-1 changed it, else the dump's (step p-1, or the start state).
func (pl *faultPlan) prevInput(p int64, name string) (t engine.Tensor, ok, changed bool, err error) {
	if pl.prevStep == p-1 {
		if t, ok := pl.prevNew[name]; ok {
			return t, true, true, nil
		}
	}
	if p-1 >= 0 {
		t, ok, err := pl.src.Stage(p-1, pl.layer, name)
		if err != nil || ok {
			return t, ok, false, err
		}
	}
	st, after, ok, err := pl.src.State(pl.layer)
	if err != nil || !ok || after != p-1 {
		return engine.Tensor{}, false, false, err
	}
	t, ok = st[name]
	return t, ok, false, nil
}

// fullStep walks the stages of a dumped step of the fault's layer: the fault
// at its stage, the reference for every stage reading a changed value.
func (pl *faultPlan) fullStep(p int64) error {
	cfg, l := pl.cfg, pl.layer
	ctx := &engine.StepContext{Cfg: cfg, Layer: l, Pos: p, W: pl.m.Weights[l], Rope: pl.m.Rope[l], Head: pl.m.Head}
	if err := ctx.Check(); err != nil {
		return fmt.Errorf("fault %s: step %d: %w", pl.f, p, err)
	}
	changed := map[string]engine.Tensor{} // values of this step that differ from the dump
	own := map[string]engine.Tensor{}     // reference values of stages the dump lacks
	contiguous := pl.prevStep == p-1
	if !contiguous {
		if err := pl.checkCarry(p); err != nil {
			return err
		}
	}
	// The whole layer when its weights hold it: the block stages after a
	// fault are recomputed from the faulty values as well (h_mid … h_out,
	// and the logits on the last layer).
	defs := engine.BlockStages(cfg, l, p, pl.m.Weights[l], pl.m.Head)
	for _, def := range defs {
		in := make(map[string]engine.Tensor, len(def.Inputs))
		fromChanged, missing := false, false
		for _, name := range def.Inputs {
			if base, ok := strings.CutPrefix(name, engine.PrevPrefix); ok {
				t, ok, ch, err := pl.prevInput(p, base)
				if err != nil {
					return err
				}
				if !ok {
					missing = true
					break
				}
				in[name], fromChanged = t, fromChanged || ch
				continue
			}
			if t, ok := changed[name]; ok {
				in[name], fromChanged = t, true
				continue
			}
			inLayer, inName := l, name
			if base, ok := strings.CutPrefix(name, engine.GlobalPrefix); ok {
				inLayer, inName = dump.Global, base // the token
			}
			t, ok, err := pl.src.Stage(p, inLayer, inName)
			if err != nil {
				return err
			}
			if !ok {
				if t, ok = own[name]; !ok {
					missing = true
					break
				}
			}
			in[name] = t
		}
		defLayer := l
		if def.Global {
			defLayer = dump.Global
		}
		gpu, dumped, err := pl.src.Stage(p, defLayer, def.Name)
		if err != nil {
			return err
		}
		atFault := pl.inj.at(p, l, def.Name)
		if missing {
			if atFault {
				return fmt.Errorf("fault %s: stage %s cannot be computed from the dump (an input is neither dumped nor computable)", pl.f, def.Name)
			}
			if def.Name == "kv_cache" && dumped && !contiguous {
				// Across a gap: the dump's cache with the faulty rows no
				// later token overwrote.
				if t := pl.carried(p, gpu); !bitIdentical(t, gpu) {
					changed[def.Name] = t
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
			return fmt.Errorf("fault %s: step %d layer %d: "+from+": %w", pl.f, p, l, def.Name, err)
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
				return err
			}
		case !fromChanged:
			v = gpu
		}
		v = pl.inj.lateWrite(ctx, def.Name, v)
		if !bitIdentical(v, gpu) {
			changed[def.Name] = v
		}
	}
	if err := pl.splitPartials(p, changed); err != nil {
		return err
	}
	global := map[string]bool{}
	for _, def := range defs {
		global[def.Name] = def.Global
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
	pl.endStep(p, changed)
	return nil
}

// stateStep carries the faulty cache rows into the state records of a step
// the dump holds only the state of (its stages were not dumped).
func (pl *faultPlan) stateStep(p int64) error {
	if err := pl.checkCarry(p); err != nil {
		return err
	}
	changed := map[string]engine.Tensor{}
	gpu, ok, err := pl.src.Stage(p, pl.layer, "kv_cache")
	if err != nil {
		return err
	}
	if ok {
		if t := pl.carried(p, gpu); !bitIdentical(t, gpu) {
			changed["kv_cache"] = t
			pl.patch[replay.StageKey{Step: p, Layer: pl.layer, Stage: "kv_cache"}] = t
		}
	}
	pl.endStep(p, changed)
	return nil
}

// checkCarry refuses to carry a changed state other than the cache across
// steps that are not recomputed (no fault changes one).
func (pl *faultPlan) checkCarry(p int64) error {
	for name := range pl.prevNew {
		if name != "kv_cache" {
			return fmt.Errorf("fault %s: %s changed at step %d, and steps %d..%d are not in the dump to carry it", pl.f, name, pl.prevStep, pl.prevStep+1, p)
		}
	}
	return nil
}

// carried is the dump's kv_cache after step p with the faulty rows of the
// last processed step q that no token in (q, p] overwrote: window slot
// t mod W is rewritten by token t, and a late compressed row lands at the
// step after its emission step.
func (pl *faultPlan) carried(p int64, gpu engine.Tensor) engine.Tensor {
	if len(pl.carry) == 0 || len(gpu.Shape) != 2 {
		return gpu
	}
	W, D := pl.cfg.WindowSize, gpu.Shape[1]
	gone := map[int]bool{}
	for t := pl.prevStep + 1; t <= p && len(gone) < W; t++ {
		gone[int(t%int64(W))] = true
	}
	if pl.f.Kind == CompressorLate && pl.f.Step+1 > pl.prevStep && pl.f.Step+1 <= p {
		gone[W+attention.EmittedRow(pl.f.Step, pl.cfg.Ratio(pl.layer))] = true
	}
	out := gpu.Clone()
	for i, row := range pl.carry {
		if gone[i] || (i+1)*D > len(out.F) || len(row) != D {
			continue
		}
		copy(out.F[i*D:(i+1)*D], row)
	}
	return out
}

// endStep records what step p leaves for the next: its changed state
// tensors and the kv_cache rows that differ from the dump.
func (pl *faultPlan) endStep(p int64, changed map[string]engine.Tensor) {
	pl.prevStep, pl.prevNew, pl.carry = p, map[string]engine.Tensor{}, nil
	for name, t := range changed {
		if replay.IsStateStage(name) {
			pl.prevNew[name] = t
		}
	}
	if len(changed) > 0 {
		pl.carriedTo = p
	}
	kv, ok := changed["kv_cache"]
	if !ok || len(kv.Shape) != 2 {
		return
	}
	gpu, ok, err := pl.src.Stage(p, pl.layer, "kv_cache")
	if err != nil || !ok || !engine.SameShape(gpu.Shape, kv.Shape) {
		return
	}
	D := kv.Shape[1]
	pl.carry = map[int][]float32{}
	for i := 0; i < kv.Shape[0]; i++ {
		a, b := kv.F[i*D:(i+1)*D], gpu.F[i*D:(i+1)*D]
		if !bitIdentical(engine.FromF(engine.KindF32, a, D), engine.FromF(engine.KindF32, b, D)) {
			pl.carry[i] = append([]float32(nil), a...)
		}
	}
}

// splitPartials recomputes the split-K partials (split_bounds, o_split/<s>,
// lse_split/<s>) dumped beside o when an input of the attention (q,
// kv_cache, topk_idxs) changed at step p: the GPU's split kernel would have
// read the changed values. The dumped split_bounds are kept.
func (pl *faultPlan) splitPartials(p int64, changed map[string]engine.Tensor) error {
	l := pl.layer
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
