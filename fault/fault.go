package fault

import (
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/quant"
	"sparsemla/replay"
)

// Options configure WriteFaulted.
type Options struct {
	Fault Fault
	// Seed picks what a fault leaves to chance: the 64-block whose scale
	// byte flips (scale-byte) and the donor request's tokens (stale-prefix).
	Seed uint64
	// Weights is where the replay found the weights (a safetensors file or a
	// directory holding weights.safetensors; empty: beside the dump). The
	// file is copied into the output directory, so the copy replays without
	// flags.
	Weights string
}

// Copy says what WriteFaulted wrote.
type Copy struct {
	Dir       string
	Fault     Fault
	Request   string            // the replayed request the fault went into
	Changed   []replay.StageKey // its stage records whose values changed, in replay order
	Dropped   []replay.StageKey // its stage records left out (stages the faulty GPU did not compute)
	Pages     int               // KV page records re-encoded
	Donor     string            // stale-prefix: the request whose rows were served
	Records   int               // tensor records written
	Unmapped  int               // tensors of the input no name-map rule matched (not in the input's index, not copied)
	CarriedTo int64             // last step whose records carry the fault (its cache rows or outputs)
}

// The files of a faulted copy: the layout of a synthetic dump directory
// (SynthConfigFile, SynthWeightsFile, SynthDumpFile), so replay, report,
// diff and bisect find the native dump and the weights beside it.

// WriteFaulted writes into dir (created; new, empty, or an earlier copy) a
// copy of the dump d (replayed request src, reference m) in which the fault
// opt.Fault is applied the way a buggy GPU would have produced it:
//
//   - the fault's stage (Fault.Stage) at its step and layer is corrupted
//     (faultInjector, the code Synthesize injects with), starting from the
//     GPU's own dumped value; it must be out of tolerance against the
//     reference computed from the dumped inputs (ErrFaultInvisible);
//   - every stage of that step and layer that reads a changed value,
//     directly or through other stages, is recomputed with the reference
//     from the changed values (a local replay recomputes each stage from the
//     dump's own inputs, so the first divergence is exactly the injected
//     stage and every later stage agrees); stages upstream of the fault and
//     stages that read no changed value keep their dumped bytes;
//   - when the fault lives in the cache (kv, kv_cache), later steps of the
//     layer carry it: their kv_cache is recomputed from the faulty one, and
//     across steps the dump does not hold (a state-only step, a gap) the
//     faulty rows are carried into the dumped cache unless a later token
//     overwrote their window slot; the outputs those steps compute from the
//     cache are recomputed too;
//   - KV pages of a changed kv_cache are re-encoded (replay.RewritePage); split-K
//     partials dumped beside a recomputed o are recomputed over the dumped
//     split_bounds; a stale-prefix fault adds the donor request's cache and
//     the prefix-cache hit record.
//
// Other layers and the residual stream between layers (mHC, FFN: not part of
// the reference) keep their dumped values. dir receives config.json (the
// ModelArgs), weights.safetensors (a copy of the weights the replay used)
// and dump.smd: a native dump holding every record of the input (start
// state, tables, all steps, other requests, pages, prefix hits; weight
// records live in weights.safetensors), with the header's user metadata
// naming the fault and the input.
func WriteFaulted(d *dump.Dump, src *replay.DumpSource, m *engine.Model, dir string, opt Options) (*Copy, error) {
	wpath, err := replay.FindWeights(d.Path, opt.Weights)
	if err != nil {
		return nil, err
	}
	if err := checkOutDir(dir, d, wpath); err != nil {
		return nil, err
	}
	pl, err := planFault(d, src, m, opt)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("fault: %w", err)
	}
	res := &Copy{Dir: dir, Fault: opt.Fault, Request: src.Request, Donor: pl.donor, Unmapped: len(d.Unmapped), CarriedTo: pl.carriedTo}
	for k := range pl.patch {
		res.Changed = append(res.Changed, k)
	}
	for k := range pl.drop {
		res.Dropped = append(res.Dropped, k)
	}
	sortStageKeys(res.Changed)
	sortStageKeys(res.Dropped)
	if err := os.WriteFile(filepath.Join(dir, SynthConfigFile), []byte(d.Header.ModelArgs), 0o644); err != nil {
		return nil, fmt.Errorf("fault: %w", err)
	}
	if err := copyFile(filepath.Join(dir, SynthWeightsFile), wpath); err != nil {
		return nil, err
	}
	n, pages, err := pl.write(filepath.Join(dir, SynthDumpFile), wpath)
	if err != nil {
		return nil, err
	}
	res.Records, res.Pages = n, pages
	return res, nil
}

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
	if !containsStep(steps, f.Step) {
		return nil, fmt.Errorf("fault %s: step %d is not a dumped decode step (dumped: %s)", f, f.Step, stepList(steps))
	}
	if !containsInt(layers, f.Layer) {
		return nil, fmt.Errorf("fault %s: layer %d is not in the dump", f, f.Layer)
	}
	if _, ok, err := src.Stage(f.Step, f.Layer, f.Stage()); err != nil {
		return nil, err
	} else if !ok {
		return nil, fmt.Errorf("fault %s: the dump does not hold stage %s at step %d, layer %d, so a replay could not see the fault", f, f.Stage(), f.Step, f.Layer)
	}
	switch f.Kind {
	case TopKOffByOne:
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
	pl.inj = newFaultInjector(f, opt.Seed, other)
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
	ctx := &engine.StepContext{Cfg: cfg, Layer: l, Pos: p, W: pl.m.Weights[l], Rope: pl.m.Rope[l]}
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
	for _, def := range engine.Stages(cfg, l, p) {
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
			t, ok, err := pl.src.Stage(p, l, name)
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
		gpu, dumped, err := pl.src.Stage(p, l, def.Name)
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
			return fmt.Errorf("fault %s: step %d layer %d: recomputing %s from the faulty values: %w", pl.f, p, l, def.Name, err)
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
	for name, t := range changed {
		if _, ok, _ := pl.src.Stage(p, l, name); ok {
			pl.patch[replay.StageKey{Step: p, Layer: l, Stage: name}] = t
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
		if replay.StateStages[name] {
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

// makeDonor builds the stale-prefix donor: another request that shares the
// replayed request's tokens before p-4 and has its own tokens at p-4 .. p-1
// (seeded random attention inputs, as synth's request A), so its window rows
// of those tokens differ. Its kv_cache at the fault step p is the replayed
// request's with those rows replaced, each computed by the reference's own
// window-K stages (kv_raw, kv_normed, kv_roped, kv) at its position.
func (pl *faultPlan) makeDonor(seed uint64) error {
	f, cfg := pl.f, pl.cfg
	base, ok, err := pl.src.Stage(f.Step, f.Layer, "kv_cache")
	if err != nil {
		return err
	}
	if !ok || len(base.Shape) != 2 || base.Shape[1] != cfg.HeadDim || base.Shape[0] < cfg.WindowSize {
		return fmt.Errorf("fault %s: the dump has no usable kv_cache at step %d, layer %d", f, f.Step, f.Layer)
	}
	reqs := map[string]bool{}
	for _, e := range pl.d.Entries {
		reqs[e.Request] = true
	}
	pl.donor = SynthOtherRequest
	for i := 2; reqs[pl.donor]; i++ {
		pl.donor = fmt.Sprintf("%s%d", SynthOtherRequest, i)
	}
	D, W := cfg.HeadDim, cfg.WindowSize
	pl.donorCache = base.Clone()
	for t := max(0, f.Step-4); t < f.Step; t++ {
		row, err := pl.windowRow(t, donorInput(cfg, seed, t, f.Layer))
		if err != nil {
			return fmt.Errorf("fault %s: donor row of token %d: %w", f, t, err)
		}
		slot := int(t % int64(W))
		copy(pl.donorCache.F[slot*D:(slot+1)*D], row)
	}
	return nil
}

// donorInput is the donor request's attention input at token t: a seeded
// random bf16 residual vector through synthNorm (synth's request glue).
func donorInput(cfg *engine.Config, seed uint64, t int64, layer int) engine.Tensor {
	rng := rand.New(rand.NewPCG(seed^0xa5a5a5a5, uint64(t)<<8|uint64(layer)))
	h := make([]float32, cfg.Dim)
	for i := range h {
		h[i] = quant.BF16Round(float32(rng.NormFloat64()))
	}
	return synthNorm(h)
}

// windowRow computes the window K row (stage kv) of token t from the
// attention input x with the fault layer's reference stages.
func (pl *faultPlan) windowRow(t int64, x engine.Tensor) ([]float32, error) {
	l := pl.layer
	ctx := &engine.StepContext{Cfg: pl.cfg, Layer: l, Pos: t, W: pl.m.Weights[l], Rope: pl.m.Rope[l]}
	if t >= int64(ctx.Rope.T) {
		return nil, fmt.Errorf("position %d outside the RoPE table", t)
	}
	vals := map[string]engine.Tensor{"x": x}
	for _, def := range engine.Stages(pl.cfg, l, t) {
		switch def.Name {
		case "kv_raw", "kv_normed", "kv_roped", "kv":
		default:
			continue
		}
		out, err := def.Compute(ctx, vals)
		if err != nil {
			return nil, err
		}
		vals[def.Name] = out
	}
	return vals["kv"].F, nil
}

// planPages re-encodes, for every changed kv_cache of the replayed request,
// the entries of its changed rows in the dumped KV pages.
func (pl *faultPlan) planPages() error {
	for k, kv := range pl.patch {
		if k.Stage != "kv_cache" {
			continue
		}
		gpu, _, err := pl.src.Stage(k.Step, k.Layer, "kv_cache")
		if err != nil {
			return err
		}
		D := kv.Shape[1]
		for i := range pl.d.Entries {
			e := &pl.d.Entries[i]
			if e.Kind != dump.KindPage || e.Request != pl.src.Request || int64(e.Step) != k.Step || e.Layer != k.Layer || !replay.IsPageStage(e.Stage) {
				continue
			}
			if e.Page == nil || e.Page.BlockSize <= 0 {
				return fmt.Errorf("dump %s: record %d (%s): page record without page info", e.File, e.Record, e.Key)
			}
			B := e.Page.BlockSize
			rows := map[int][]float32{}
			for b, id := range e.Page.BlockTable {
				if id != e.Page.PageID {
					continue
				}
				for r := b * B; r < (b+1)*B && (r+1)*D <= len(kv.F); r++ {
					nr := kv.F[r*D : (r+1)*D]
					if (r+1)*D <= len(gpu.F) && bitIdentical(engine.FromF(engine.KindF32, nr, D), engine.FromF(engine.KindF32, gpu.F[r*D:(r+1)*D], D)) {
						continue
					}
					rows[r-b*B] = nr
				}
			}
			if len(rows) == 0 {
				continue
			}
			rec, err := pl.d.Read(e)
			if err != nil {
				return err
			}
			data, err := replay.RewritePage(e.Page.Layout, D, B, rec.Data, rows)
			if err != nil {
				return fmt.Errorf("dump %s: record %d (%s): re-encoding the faulty rows: %w", e.File, e.Record, e.Key, err)
			}
			pl.pages[i] = data
		}
	}
	return nil
}

// write writes the native dump of the faulted copy to path; the weight
// records of the input's weights file wpath are left out (the file is copied
// beside it). It returns the tensor records and page records rewritten.
func (pl *faultPlan) write(path, wpath string) (records, pages int, err error) {
	h := pl.d.Header
	h.User = map[string]string{}
	for k, v := range pl.d.Header.User {
		h.User[k] = v
	}
	h.User["injected_fault"] = pl.f.String()
	h.User["faulted_from"] = pl.d.Path
	if h.ModelArgs != "" && len(h.CompressRatios) == 0 {
		h.CompressRatios = append([]int(nil), pl.cfg.CompressRatios...)
	}
	w, err := dump.Create(path, h)
	if err != nil {
		return 0, 0, err
	}
	fail := func(err error) (int, int, error) {
		w.Close()
		return 0, 0, fmt.Errorf("fault: %s: %w", path, err)
	}
	wfi, _ := os.Stat(wpath)
	var buf []byte
	for i := range pl.d.Entries {
		e := &pl.d.Entries[i]
		if e.Kind == dump.KindWeight && wfi != nil {
			if fi, err := os.Stat(e.File); err == nil && os.SameFile(fi, wfi) {
				continue
			}
		}
		rec, err := pl.d.ReadBuf(e, buf)
		if err != nil {
			return fail(err)
		}
		buf = rec.Data[:0]
		if e.Kind == dump.KindStage && e.Request == pl.src.Request && e.Layer == pl.layer {
			k := replay.StageKey{Step: int64(e.Step), Layer: e.Layer, Stage: e.Stage}
			if pl.drop[k] {
				continue
			}
			if t, ok := pl.patch[k]; ok {
				rec = engine.RecordLike(rec, t)
			}
		}
		if data, ok := pl.pages[i]; ok {
			rec.Data = data
			pages++
		}
		if err := w.Write(&rec); err != nil {
			return fail(err)
		}
		records++
	}
	if pl.donor != "" {
		rec := engine.TensorRecord(pl.donorCache, dump.Key{Request: pl.donor, Step: int(pl.f.Step), Layer: pl.layer, Stage: "kv_cache"}, dump.KindStage)
		if err := w.Write(&rec); err != nil {
			return fail(err)
		}
		records++
	}
	for _, hit := range pl.d.Prefix {
		if err := w.WritePrefix(hit); err != nil {
			return fail(err)
		}
	}
	if pl.donor != "" {
		if err := w.WritePrefix(dump.PrefixHit{Request: pl.src.Request, Source: pl.donor, Tokens: int(pl.f.Step)}); err != nil {
			return fail(err)
		}
	}
	if err := w.Close(); err != nil {
		return 0, 0, fmt.Errorf("fault: %s: %w", path, err)
	}
	return records, pages, nil
}

// bitIdentical reports whether two tensors hold the same shape and bit-identical
// values.
func bitIdentical(a, b engine.Tensor) bool {
	if a.Kind.IsFloat() != b.Kind.IsFloat() || !engine.SameShape(a.Shape, b.Shape) || len(a.F) != len(b.F) || len(a.I) != len(b.I) {
		return false
	}
	for i := range a.F {
		if math.Float32bits(a.F[i]) != math.Float32bits(b.F[i]) {
			return false
		}
	}
	for i := range a.I {
		if a.I[i] != b.I[i] {
			return false
		}
	}
	return true
}

// checkOutDir checks that dir can receive a faulted copy: new, empty, or
// holding only the files of a faulted copy or synthetic dump (an earlier copy
// is replaced); not the directory of the input dump or its weights, nor one
// inside the input.
func checkOutDir(dir string, d *dump.Dump, wpath string) error {
	inputs := map[string]bool{filepath.Dir(wpath): true, d.Path: true}
	for _, e := range d.Entries {
		inputs[filepath.Dir(e.File)] = true
	}
	absOut, err := filepath.Abs(dir)
	if err != nil {
		return fmt.Errorf("fault: %w", err)
	}
	for in := range inputs {
		// A copy inside the input's directory would become part of the
		// input dump (dump.Open reads sub-directories).
		if absIn, err := filepath.Abs(in); err == nil {
			if rel, err := filepath.Rel(absIn, absOut); err == nil && rel != "." && !strings.HasPrefix(rel, "..") {
				return fmt.Errorf("fault: output directory %s lies inside the input %s; write the copy elsewhere", dir, in)
			}
		}
	}
	if fi, err := os.Stat(dir); err == nil {
		if !fi.IsDir() {
			return fmt.Errorf("fault: output %s is not a directory", dir)
		}
		for in := range inputs {
			if ifi, err := os.Stat(in); err == nil && os.SameFile(fi, ifi) {
				return fmt.Errorf("fault: output directory %s holds the input dump or its weights; write the copy elsewhere", dir)
			}
		}
		ents, err := os.ReadDir(dir)
		if err != nil {
			return fmt.Errorf("fault: %w", err)
		}
		for _, e := range ents {
			switch e.Name() {
			case SynthConfigFile, SynthWeightsFile, SynthDumpFile:
			default:
				return fmt.Errorf("fault: output directory %s holds %s: want a new or empty directory (or an earlier copy to replace)", dir, e.Name())
			}
		}
	}
	return nil
}

// copyFile copies src to dst.
func copyFile(dst, src string) error {
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("fault: %w", err)
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return fmt.Errorf("fault: %w", err)
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return fmt.Errorf("fault: copying %s: %w", src, err)
	}
	if err := out.Close(); err != nil {
		return fmt.Errorf("fault: %w", err)
	}
	return nil
}

func containsStep(s []int64, p int64) bool {
	for _, v := range s {
		if v == p {
			return true
		}
	}
	return false
}

func containsInt(s []int, x int) bool {
	for _, v := range s {
		if v == x {
			return true
		}
	}
	return false
}

// stepList prints steps as ranges, e.g. "2..7" or "126..128, 254..256".
func stepList(s []int64) string {
	var parts []string
	for i := 0; i < len(s); {
		j := i
		for j+1 < len(s) && s[j+1] == s[j]+1 {
			j++
		}
		if i == j {
			parts = append(parts, fmt.Sprint(s[i]))
		} else {
			parts = append(parts, fmt.Sprintf("%d..%d", s[i], s[j]))
		}
		i = j + 1
	}
	return strings.Join(parts, ", ")
}
