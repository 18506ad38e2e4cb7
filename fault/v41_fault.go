package fault

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/replay"
	"sparsemla/userfile"
)

// Faulting an existing V4.1 dump (fault --in on a directory in the official
// V4.1 layout, e.g. testdata/v41-tiny): WriteFaultedV41 copies the
// directory, replacing in step_P.safetensors the faulty stage of layer L
// with the faulty computation from the dumped inputs and every stage of the
// step that reads it (within the layer, and at later layers through the
// shared runtime: a faulty index_sel of an index source reaches the layers
// that consume it) recomputed with the reference from it — as the GPU with
// that bug would have dumped them. In a dump of the attention sub-layers
// neither attention kind reaches the cache, so the other steps are copied
// unchanged, and the later layers' inputs x stay as dumped. In a whole dump
// (block weights, V41WholeStep) the block kinds apply too (the hypothesis of
// each at its stage, as synth writes it) and every stage the faulty value
// reaches — through h_out into every later layer, the caches they write and
// the head — is recomputed; the steps after P are left out of the copy
// (their state would follow from the faulty step).

// V41FaultResult says what WriteFaultedV41 wrote.
type V41FaultResult struct {
	Dir     string
	Changed []replay.StageKey // stages whose dumped value the fault changed, model order
	// NotRecomputed says, one line each, what the faulty GPU would have
	// changed but the copy does not hold recomputed: in a dump of the
	// attention sub-layers the later layers' inputs x (the residual stream
	// between layers is not part of it), in a whole dump the steps after
	// the fault's, left out of the copy.
	NotRecomputed []string
}

// v41Inject is the faulty value of the fault's stage given its inputs and
// the correct value t.
func v41Inject(cfg *engine.Config, f Fault, p int64, in map[string]engine.Tensor, t engine.Tensor) engine.Tensor {
	t = t.Clone()
	switch f.Kind {
	case WindowOrder:
		for i, v := range attention.WindowIdx(p, cfg.WindowSize) {
			t.I[i] = int64(v)
		}
	case TopKOffByOne:
		sc, ok := in["index_score_masked"]
		if !ok {
			sc = in["index_score"]
		}
		t.I = V41OffByOne(sc.F, len(t.I), cfg.WindowSize)
	}
	return t
}

// WriteFaultedV41 writes into out a copy of the V4.1 dump directory in
// (loaded as d) with fault f injected (see above). out must be new, empty or
// an earlier copy, and must not be or hold an input. A fault kind that does
// not exist in V4.1, a step the dump lacks, or a place where the kind does
// not apply (or would leave the dumped value unchanged) is refused.
func WriteFaultedV41(in string, d *replay.V41Dump, out string, f Fault) (*V41FaultResult, error) {
	cfg := d.Cfg
	whole := d.Model.Whole()
	_, block := v41BlockFaults[f.Kind]
	if err := checkV41FaultWhole(cfg, f, d.Steps[0], d.Steps[len(d.Steps)-1], whole); err != nil {
		return nil, err
	}
	if block && !d.Official() {
		// A block fault reaches the later layers' caches and the stages of
		// no layer (head, logits): the native copy would need its KV pages
		// re-encoded and its later steps recomputed or dropped.
		return nil, fmt.Errorf("fault %s: the block fault kinds are written into whole V4.1 dumps in the official layout only (a native copy would carry KV pages the fault changed unchanged); use synth --fault, or a dump in the official layout (synth --format official)", f)
	}
	p := f.Step
	stepFile := filepath.Join(in, fmt.Sprintf("step_%d.safetensors", p))
	st, err := d.StateBefore(p)
	if err != nil {
		return nil, err
	}
	var xs []engine.Tensor
	var tok int64
	if whole {
		tok, err = d.Token(p)
	} else {
		xs, err = d.Inputs(p)
	}
	if err != nil {
		return nil, err
	}
	faultStage := v41FaultStage[f.Kind]
	if block {
		faultStage = v41BlockFaults[f.Kind].stage
	}
	tainted := map[string]bool{}       // "L.stage" (a global stage: its name) computed from the faulty value
	globals := map[string]bool{}       // the global stages seen so far
	seen := map[string]engine.Tensor{} // the fault layer's stage values so far (head-no-norm reads head_in)
	changed := map[string]engine.Tensor{}
	res := &V41FaultResult{}
	published := map[string]int{} // stage → latest layer that produced it this step
	hook := func(l int, def engine.V41StageDef, inp map[string]engine.Tensor, ref engine.Tensor) (engine.Tensor, error) {
		key := fmt.Sprintf("L%d.%s", l, def.Name)
		if def.Global {
			key = def.Name
			globals[def.Name] = true
		}
		bad := false
		for _, name := range def.Inputs {
			if base, ok := strings.CutPrefix(name, engine.SharedPrefix); ok {
				if k, has := published[base]; has && tainted[fmt.Sprintf("L%d.%s", k, base)] {
					bad = true
				}
			} else if base, ok := strings.CutPrefix(name, engine.BelowPrefix); ok {
				bad = bad || tainted[fmt.Sprintf("L%d.%s", l-1, base)]
			} else if globals[name] {
				bad = bad || tainted[name]
			} else if !strings.HasPrefix(name, engine.PrevPrefix) && !strings.HasPrefix(name, engine.GlobalPrefix) && tainted[fmt.Sprintf("L%d.%s", l, name)] {
				bad = true
			}
		}
		published[def.Name] = l
		var out engine.Tensor
		t, isDumped := d.StageTensor(p, key)
		switch {
		case l == f.Layer && def.Name == faultStage && block:
			all := map[string]engine.Tensor{}
			for n, v := range seen {
				all[n] = v
			}
			for n, v := range inp {
				all[n] = v
			}
			c := &engine.V41Context{Cfg: cfg, Layer: l, Pos: p, W: d.Model.Layers[l], Rope: d.Model.Rope[l], Head: d.Model.Head}
			var err error
			if out, err = v41BlockInject(c, f, all, ref); err != nil {
				return ref, err
			}
			bad = true
		case l == f.Layer && def.Name == faultStage:
			out, bad = v41Inject(cfg, f, p, inp, ref), true
		case bad:
			out = ref
		case isDumped:
			if len(t.F) != len(ref.F) || len(t.I) != len(ref.I) {
				return ref, fmt.Errorf("%s: %s is %s %v, the reference's %s %v", stepFile, key, t.Kind, t.Shape, ref.Kind, ref.Shape)
			}
			t.Shape, t.Kind = ref.Shape, ref.Kind
			if l == f.Layer {
				seen[def.Name] = t
			}
			return t, nil // teacher-forced: the dumped value
		default:
			if l == f.Layer {
				seen[def.Name] = ref
			}
			return ref, nil
		}
		tainted[key] = bad
		if isDumped {
			changed[key] = out
			res.Changed = append(res.Changed, replay.StageKey{Step: p, Layer: l, Stage: def.Name})
		}
		return out, nil
	}
	if whole {
		_, err = engine.V41WholeStep(d.Model, st, tok, p, hook)
	} else {
		_, err = engine.V41Step(d.Model, st, xs, p, hook)
	}
	if err != nil {
		return nil, err
	}
	fk := fmt.Sprintf("L%d.%s", f.Layer, faultStage)
	if globals[faultStage] {
		fk = faultStage
	}
	if _, ok := changed[fk]; !ok {
		return nil, fmt.Errorf("fault %s: the dump holds no %s of layer %d at step %d to corrupt", f, faultStage, f.Layer, p)
	}
	orig, _ := d.StageTensor(p, fk)
	if slices.Equal(orig.I, changed[fk].I) && slices.Equal(orig.F, changed[fk].F) {
		return nil, fmt.Errorf("fault %s: the faulty %s equals the dumped one at step %d, layer %d: nothing to inject", f, faultStage, p, f.Layer)
	}
	if !whole {
		var ys []string
		for _, k := range res.Changed {
			if k.Stage == "y" && k.Layer < cfg.NLayers-1 {
				ys = append(ys, fmt.Sprint(k.Layer))
			}
		}
		if len(ys) > 0 {
			res.NotRecomputed = append(res.NotRecomputed, fmt.Sprintf("step %d: the attention output y of layer(s) %s changed, but the dump holds the attention sub-layers only (the residual stream between layers is not part of it): the inputs x of the layers above keep their dumped values", p, strings.Join(ys, ", ")))
		}
	} else if d.Official() {
		var later []int64
		for _, q := range d.Steps {
			if q > p {
				later = append(later, q)
			}
		}
		if len(later) > 0 {
			res.NotRecomputed = append(res.NotRecomputed, fmt.Sprintf("steps %s: left out of the copy (their state would follow from the faulty step, which the copy does not recompute)", replay.StepList(later)))
		}
	}
	if !d.Official() {
		if res.Dir, err = writeFaultedV41Native(in, out, d.WeightsFile, p, changed, f); err != nil {
			return nil, err
		}
		return res, nil
	}
	dumped, err := readStepRecords(stepFile)
	if err != nil {
		return nil, err
	}
	g, err := userfile.NewGuard(in)
	if err != nil {
		return nil, err
	}
	od, err := g.CreateDir(out)
	if err != nil {
		return nil, err
	}
	defer od.Abort()
	entries, err := os.ReadDir(in)
	if err != nil {
		return nil, fmt.Errorf("fault: %w", err)
	}
	for _, e := range entries {
		name := e.Name()
		if !e.Type().IsRegular() || name == filepath.Base(stepFile) || name == dump.WeightsFile || !(strings.HasSuffix(name, ".safetensors") || strings.HasSuffix(name, ".json")) {
			continue
		}
		var q int64
		if _, err := fmt.Sscanf(name, "step_%d.safetensors", &q); err == nil && whole && q > p {
			continue // in a whole dump every fault reaches the later layers' caches: the later steps would follow from it
		}
		src := filepath.Join(in, name)
		if err := od.WriteFile(name, 0o644, func(w io.Writer) error { return copyFile(w, src) }); err != nil {
			return nil, err
		}
	}
	// the weights the dump was read with (beside it, or --weights), so that
	// the copy replays with no flags
	if err := copyWeightsInto(od, d.WeightsFile); err != nil {
		return nil, err
	}
	recs := make([]dump.Record, 0, len(dumped.order))
	for _, n := range dumped.order {
		r := dumped.byName[n]
		if t, ok := changed[n]; ok {
			r = engine.TensorRecord(t, r.Key, r.Kind)
			r.Name = n
		}
		recs = append(recs, r)
	}
	meta := map[string]string{"producer": "sparsemla fault", "injected_fault": f.String()}
	if err := od.WriteFile(filepath.Base(stepFile), 0o644, func(w io.Writer) error { return dump.WriteSafetensors(w, recs, meta) }); err != nil {
		return nil, err
	}
	if err := od.Commit(); err != nil {
		return nil, err
	}
	res.Dir = od.Final()
	return res, nil
}

type stepRecords struct {
	order  []string
	byName map[string]dump.Record
}

func readStepRecords(path string) (*stepRecords, error) {
	st, err := dump.OpenSafetensors(path)
	if err != nil {
		return nil, err
	}
	defer st.Close()
	out := &stepRecords{byName: map[string]dump.Record{}}
	for _, n := range st.Names() {
		r, err := st.Read(n)
		if err != nil {
			return nil, err
		}
		r.Name = n
		out.order = append(out.order, n)
		out.byName[n] = r
	}
	sort.Strings(out.order)
	return out, nil
}

func ptr[T any](v T) *T { return &v }
