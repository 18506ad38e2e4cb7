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
	layer int // the fault's layer
	inj   *faultInjector

	patch map[replay.StageKey]engine.Tensor
	drop  map[replay.StageKey]bool
	pages map[int][]byte // entry index -> re-encoded page bytes

	donor      string        // stale-prefix donor request
	donorCache engine.Tensor // its kv_cache at the fault step
	carriedTo  int64

	// tracks holds, per layer, what the walk over the steps left for the
	// layer's next step.
	tracks map[int]*layerTrack
	// notes says what the copy could not recompute (Copy.NotRecomputed).
	notes noteSet
}

// layerTrack is one layer's walk: the last step processed, the state
// tensors that changed there (full values), and the kv_cache rows that
// differ from the dump after it.
type layerTrack struct {
	prevStep int64
	prevNew  map[string]engine.Tensor
	carry    map[int][]float32
}

// live reports whether the layer's state after its last step differs from
// the dump's.
func (t *layerTrack) live() bool { return len(t.prevNew) > 0 || len(t.carry) > 0 }

// noteSet collects what a faulted copy leaves as dumped although the fault
// would have changed it, each reason with the steps it holds for.
type noteSet struct {
	order []string
	steps map[string][]int64
}

func (n *noteSet) add(p int64, reason string) {
	if n.steps == nil {
		n.steps = map[string][]int64{}
	}
	if _, ok := n.steps[reason]; !ok {
		n.order = append(n.order, reason)
	}
	if s := n.steps[reason]; len(s) == 0 || s[len(s)-1] != p {
		n.steps[reason] = append(s, p)
	}
}

// list is one line per reason: "step(s) …: reason".
func (n *noteSet) list() []string {
	var out []string
	for _, r := range n.order {
		s := n.steps[r]
		w := "step"
		if len(s) > 1 {
			w = "steps"
		}
		out = append(out, fmt.Sprintf("%s %s: %s", w, replay.StepList(s), r))
	}
	return out
}

// planFault checks that the fault applies to the dump and computes every
// record it changes: the fault's stage, then every stage the GPU would have
// computed from a changed value — the rest of the fault's layer, the layers
// above it at the fault's step (each one's input streams are the output of
// the layer below), the logits, and at the later steps every layer whose
// state (caches, compressor states) changed and every stage computed from
// it, up the layers again. The tokens fed are kept as dumped (sampled, not
// derived from the logits); what the dump does not let it recompute is
// recorded in notes.
func planFault(d *dump.Dump, src *replay.DumpSource, m *engine.Model, opt Options) (*faultPlan, error) {
	f := opt.Fault
	steps, layers := src.Steps(), src.Layers()
	if err := checkTopKDump(f, m.Cfg, steps); err != nil {
		return nil, err
	}
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
	if f.Kind == StalePrefix {
		if hit, ok := src.PrefixHit(); ok {
			return nil, fmt.Errorf("fault %s: the dump already records a prefix-cache hit of request %q from %q", f, src.Request, hit.From)
		}
	}
	pl := &faultPlan{d: d, src: src, m: m, cfg: m.Cfg, f: f, layer: f.Layer,
		patch: map[replay.StageKey]engine.Tensor{}, drop: map[replay.StageKey]bool{}, pages: map[int][]byte{},
		carriedTo: f.Step, tracks: map[int]*layerTrack{}}
	var other map[int]engine.Tensor
	if f.Kind == StalePrefix {
		if err := pl.makeDonor(opt.Seed); err != nil {
			return nil, err
		}
		other = map[int]engine.Tensor{f.Layer: pl.donorCache}
	}
	pl.inj = newFaultInjector(f, opt.Seed, other, m.Cfg)
	if err := pl.walk(); err != nil {
		return nil, err
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
	pl.checkTokens()
	return pl, nil
}

// walkSteps lists, ascending, every step from the fault's on at which the
// dump holds stage records of the replayed request (full and state-only
// steps), each with its layers, ascending.
func (pl *faultPlan) walkSteps() ([]int64, map[int64][]int) {
	seen := map[int64]map[int]bool{}
	for _, e := range pl.d.Entries {
		if e.Kind == dump.KindStage && e.Request == pl.src.Request && e.Layer >= 0 && int64(e.Step) >= pl.f.Step {
			if seen[int64(e.Step)] == nil {
				seen[int64(e.Step)] = map[int]bool{}
			}
			seen[int64(e.Step)][e.Layer] = true
		}
	}
	steps := make([]int64, 0, len(seen))
	layers := map[int64][]int{}
	for p, ls := range seen {
		steps = append(steps, p)
		for l := range ls {
			layers[p] = append(layers[p], l)
		}
		sort.Ints(layers[p])
	}
	sort.Slice(steps, func(i, j int) bool { return steps[i] < steps[j] })
	return steps, layers
}

// walk processes the steps from the fault's on, each layer from the bottom
// up, until no layer's state differs from the dump's.
func (pl *faultPlan) walk() error {
	f := pl.f
	steps, layersAt := pl.walkSteps()
	full := map[int64]bool{}
	for _, p := range pl.src.Steps() {
		full[p] = true
	}
	for _, p := range steps {
		if p > f.Step && !pl.anyLive() {
			break // nothing left to carry
		}
		var link map[string]engine.Tensor // the layer below's changed outputs, as this layer's inputs
		below := -1                       // the layer link came from
		top := -1                         // the last layer processed at p
		lost := map[int64]*lostState{}    // by the step after which the state is lost
		var lostOrder []int64
		for _, l := range layersAt[p] {
			if p == f.Step && l < f.Layer {
				continue
			}
			tr := pl.tracks[l]
			if tr == nil {
				tr = &layerTrack{prevStep: p - 1}
				pl.tracks[l] = tr
			}
			seeds := link
			if len(link) > 0 && below != l-1 {
				pl.notes.add(p, fmt.Sprintf("%s not in the dump: the layers above it and the logits keep their dumped values, not recomputed from layer %d's faulty output", layerSpan(below+1, l-1), below))
				seeds = nil
			}
			link, below, top = nil, l, l
			site := p == f.Step && l == f.Layer
			if l != f.Layer && tr.live() && (tr.prevStep != p-1 || !full[p]) {
				// A layer above the fault's reads the faulty stream: its
				// state cannot be followed through a step whose inputs
				// were not dumped.
				ls := lost[tr.prevStep]
				if ls == nil {
					ls = &lostState{names: map[string]bool{}}
					lost[tr.prevStep] = ls
					lostOrder = append(lostOrder, tr.prevStep)
				}
				ls.layers = append(ls.layers, fmt.Sprint(l))
				for _, n := range tr.changedNames() {
					ls.names[n] = true
				}
				tr.prevNew, tr.carry = nil, nil
			}
			if !site && !tr.live() && len(seeds) == 0 {
				tr.prevStep = p
				continue // nothing reaches this layer at p
			}
			if !full[p] {
				if err := pl.stateStep(p, l, tr); err != nil {
					return err
				}
				continue
			}
			out, err := pl.fullStep(p, l, tr, seeds)
			if err != nil {
				return err
			}
			link = out
		}
		for _, q := range lostOrder {
			ls := lost[q]
			through := p - 1
			if !full[p] {
				through = p
			}
			var names []string
			for n := range ls.names {
				names = append(names, n)
			}
			sort.Strings(names)
			w := "layer"
			if len(ls.layers) > 1 {
				w = "layers"
			}
			pl.notes.add(p, fmt.Sprintf("%s %s: the state the fault changed up to step %d (%s) is not followed through step(s) %s, whose inputs the dump does not hold: after them these layers go on from their dumped state",
				w, strings.Join(ls.layers, ", "), q, strings.Join(names, ", "), stepSpan(q+1, through)))
		}
		if len(link) > 0 && top != pl.cfg.NLayers-1 {
			if _, ok, _ := pl.src.Stage(p, dump.Global, "logits"); ok {
				pl.notes.add(p, fmt.Sprintf("%s not in the dump: the logits are not recomputed from layer %d's faulty output", layerSpan(top+1, pl.cfg.NLayers-1), top))
			}
		}
	}
	return nil
}

// stepSpan writes the steps a..b ("7", "129..254").
func stepSpan(a, b int64) string {
	if a == b {
		return fmt.Sprint(a)
	}
	return fmt.Sprintf("%d..%d", a, b)
}

// layerSpan writes the layers a..b as the subject of a sentence ("layer 2
// is", "layers 2..3 are").
func layerSpan(a, b int) string {
	if a == b {
		return fmt.Sprintf("layer %d is", a)
	}
	return fmt.Sprintf("layers %d..%d are", a, b)
}

// lostState is what the walk could not follow at one step: the layers
// whose changed state it dropped, and the state tensors.
type lostState struct {
	layers []string
	names  map[string]bool
}

// changedNames lists the state tensors t carries, sorted.
func (t *layerTrack) changedNames() []string {
	var n []string
	for name := range t.prevNew {
		n = append(n, name)
	}
	if len(n) == 0 && len(t.carry) > 0 {
		n = append(n, "kv_cache")
	}
	sort.Strings(n)
	return n
}

// anyLive reports whether some layer's state after its last processed step
// differs from the dump's.
func (pl *faultPlan) anyLive() bool {
	for _, t := range pl.tracks {
		if t.live() {
			return true
		}
	}
	return false
}

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

// checkTokens notes where the copy's tokens no longer follow from its
// logits: the tokens fed are kept as dumped, which is what a sampled run
// does; but when every dumped token is the greedy pick of the logits
// before it and the faulty logits pick another, a greedy GPU would have
// fed that one (and every later step would differ).
func (pl *faultPlan) checkTokens() {
	argmax := func(v []float32) int64 {
		b := 0
		for i, x := range v {
			if x > v[b] {
				b = i
			}
		}
		return int64(b)
	}
	greedy, pairs := true, 0
	for _, p := range pl.src.Steps() {
		lg, ok1, err1 := pl.src.Stage(p, dump.Global, "logits")
		tk, ok2, err2 := pl.src.Stage(p+1, dump.Global, "tok")
		if err1 != nil || err2 != nil || !ok1 || !ok2 || len(tk.I) != 1 || len(lg.F) == 0 {
			continue
		}
		pairs++
		if argmax(lg.F) != tk.I[0] {
			greedy = false
		}
	}
	if !greedy || pairs == 0 {
		return
	}
	for _, p := range pl.src.Steps() {
		lg, ok := pl.patch[replay.StageKey{Step: p, Layer: dump.Global, Stage: "logits"}]
		tk, ok2, err := pl.src.Stage(p+1, dump.Global, "tok")
		if !ok || err != nil || !ok2 || len(tk.I) != 1 || len(lg.F) == 0 {
			continue
		}
		if a := argmax(lg.F); a != tk.I[0] {
			pl.notes.add(p+1, fmt.Sprintf("the token fed is kept as dumped (%d), though the dump's run is greedy and the faulty logits of the step before pick %d: a greedy GPU would have fed %d, and every later step would differ", tk.I[0], a, a))
		}
	}
}
