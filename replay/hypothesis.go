package replay

import (
	"strings"

	"sparsemla/attribute"
	"sparsemla/engine"
)

// attributeStage runs the hypotheses of the diverging stage (package
// attribute: the stage computed the way a known engine or a known bug
// computes it) on the stage's inputs — the dumped ones in a local replay,
// the chain's own in a propagated one — and returns which of them
// reproduces the GPU's value (nil when the stage has none). Values a
// hypothesis reads besides the stage's inputs (split_bounds, the state
// before the step) come from the dump, else from the reference's own
// values of the step.
func attributeStage(d DiagnoseInput) *attribute.Verdict {
	sr := d.Result
	if d.Model == nil || d.Model.Weights[sr.Layer] == nil || d.Model.Rope[sr.Layer] == nil {
		return nil
	}
	ctx := &engine.StepContext{Cfg: d.Model.Cfg, Layer: sr.Layer, Pos: sr.Step, W: d.Model.Weights[sr.Layer], Rope: d.Model.Rope[sr.Layer], Head: d.Model.Head}
	get := func(name string) (engine.Tensor, bool) {
		if t, ok := d.In[name]; ok {
			return t, true
		}
		if d.Src == nil {
			return engine.Tensor{}, false
		}
		if base, ok := strings.CutPrefix(name, engine.PrevPrefix); ok {
			if t, ok, err := d.Src.Stage(sr.Step-1, sr.Layer, base); err == nil && ok {
				return t, true
			}
			if st, after, ok, err := d.Src.State(sr.Layer); err == nil && ok && after == sr.Step-1 {
				t, ok := st[base]
				return t, ok
			}
			return engine.Tensor{}, false
		}
		if t, ok, err := d.Src.Stage(sr.Step, sr.Layer, name); err == nil && ok {
			return t, true
		}
		t, ok := d.Own[name]
		return t, ok
	}
	return attribute.Attribute(&attribute.Call{Ctx: ctx, Def: d.Def, In: d.In, Ref: d.Ref, Get: get}, d.GPU)
}

// exactHypothesis is the name of the hypothesis reproducing the GPU bit for
// bit, "" when none does.
func exactHypothesis(v *attribute.Verdict) string {
	if v == nil || v.Best == nil || !v.Best.Exact {
		return ""
	}
	return v.Best.Name
}
