package fault

import (
	"fmt"

	"sort"
	"strings"

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
