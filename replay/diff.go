package replay

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strings"

	"sparsemla/dump"
	"sparsemla/engine"
)

// Diff compares two dumps of the same run stage by stage, in replay order
// (step, layer, the order of Stages), treating A as the baseline and B as the
// candidate under tol, and names the first stage where they differ. When m is
// non-nil the reference referees: at that stage it is computed from A's dumped
// inputs (which agree with B's, or an earlier stage would have differed) and
// compared with both values, and both dumps are replayed in local mode — so the
// report says which side is right. cfg gives the stage order (m.Cfg when m is
// set).
func Diff(ctx context.Context, cfg *engine.Config, m *engine.Model, a, b Source, tol *Tolerance) (*Report, error) {
	if tol == nil {
		tol = DefaultTolerance()
	}
	steps := intersectSteps(a.Steps(), b.Steps())
	layers := intersectInts(a.Layers(), b.Layers())
	if len(steps) == 0 || len(layers) == 0 {
		return nil, fmt.Errorf("diff %s %s: no decode step and layer in common (A steps %v, B steps %v)", a.Name(), b.Name(), a.Steps(), b.Steps())
	}
	rep := newReport(a.Name(), string(Local), m != nil && m.GPURope, steps, layers)
	rep.Command, rep.Against = "diff", b.Name()
	rep.TolOverrides = tol.Overrides
	rep.Coverage.Unread = append(unreadOf(a, "A: "), unreadOf(b, "B: ")...)
	for _, p := range append(slices.Clone(a.Steps()), b.Steps()...) {
		if !slices.Contains(steps, p) && !slices.Contains(rep.Coverage.StepsNotChecked, p) {
			rep.Coverage.StepsNotChecked = append(rep.Coverage.StepsNotChecked, p)
		}
	}
	if len(rep.Coverage.StepsNotChecked) > 0 {
		slices.Sort(rep.Coverage.StepsNotChecked)
		rep.Coverage.StepsWhy = "only one of the two dumps holds them"
	}
	if m != nil {
		rep.Kernels = m.Kernels()
		if p := m.Cfg.PolicyName(); p != engine.PolicyOfficial {
			rep.Policy = p
		}
	}
	for _, p := range steps {
		for _, l := range layers {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			// Every stage of the whole layer (the block stages are compared
			// where either dump holds them); the referee computes a stage
			// when the model has its weights.
			attn := map[string]bool{"x": true}
			for _, d := range engine.Stages(cfg, l, p) {
				attn[d.Name] = true
			}
			names := engine.WholeStageNames(cfg, l, p)
			if l > 0 {
				names = append([]string{"h_in"}, names...)
			}
			defs := map[string]engine.StageDef{}
			if m != nil && m.Weights[l] != nil {
				for _, d := range engine.BlockStages(cfg, l, p, m.Weights[l], m.Head) {
					defs[d.Name] = d
				}
			} else {
				for _, d := range engine.Stages(cfg, l, p) {
					defs[d.Name] = d
				}
			}
			global := map[string]bool{"logits": true}
			last := l == layers[len(layers)-1]
			// Every other tensor either dump holds at the step and layer
			// (and, with the last layer, of no layer: tok, pos, …) is
			// compared too, after the reference's stages, by its name's
			// tolerance.
			listed := map[string]bool{}
			for _, n := range names {
				listed[n] = true
			}
			for _, n := range heldUnion(a, b, p, l) {
				if !listed[n] {
					names, listed[n] = append(names, n), true
				}
			}
			if last {
				for _, n := range heldUnion(a, b, p, dump.Global) {
					if !listed[n] {
						names, listed[n], global[n] = append(names, n), true, true
					}
				}
			}
			for _, name := range names {
				layer := l
				if global[name] {
					layer = dump.Global
				}
				ta, okA, err := a.Stage(p, layer, name)
				if err != nil {
					return nil, err
				}
				tb, okB, err := b.Stage(p, layer, name)
				if err != nil {
					return nil, err
				}
				if !okA && !okB && !attn[name] {
					continue // a block stage neither dump holds
				}
				sr := StageResult{Step: p, Layer: l, Stage: name, Equation: defs[name].Equation, Inputs: []InputInfo{}}
				if !okA || !okB {
					sr.Status = StatusMissing
					sr.Reason = fmt.Sprintf("in A: %t, in B: %t", okA, okB)
					if okA || okB {
						// Held by one dump only: not compared.
						sr.Status, sr.Reason = StatusSkipped, "only B holds it"
						if okA {
							sr.Reason = "only A holds it"
						}
					}
					rep.Results = append(rep.Results, sr)
					continue
				}
				in := map[string]engine.Tensor{}
				if s, ok, _ := a.Stage(p, l, "index_score"); ok {
					in["index_score"] = s
				}
				JudgeStage(&sr, ta, tb, in, tol.For(name), JudgeContext{GPURope: true, Window: cfg.WindowSize})
				sr.Reason = diffWords(sr.Reason)
				rep.Results = append(rep.Results, sr)
				if sr.Status == StatusFail && rep.First == nil && name == "x" && sr.Metrics != nil && sr.Metrics.CosDiff > differentRunCos {
					// The attention input itself is unrelated: not two engines
					// of one run but two runs (other tokens or prompt), or a
					// difference upstream of the attention sub-layer.
					return nil, fmt.Errorf("diff %s %s: these dumps are not of the same run: the attention input x of layer %d at step %d already differs (cos_diff %.3g; %s) — other tokens or prompt, or a difference upstream of attention", a.Name(), b.Name(), l, p, sr.Metrics.CosDiff, sr.Reason)
				}
				if sr.Status == StatusFail && rep.First == nil {
					div := &Divergence{Step: p, Layer: l, Stage: name, Kind: stageKind(name), Mode: "diff",
						Why: "A and B differ: " + sr.Reason, Inputs: []InputInfo{}}
					if m != nil {
						if def, ok := defs[name]; ok {
							div.Detail = append(div.Detail, refereeStage(m, a, def, p, l, ta, tb, tol))
						} else if w := m.Weights[l]; w != nil && !hasWholeLayer(m.Cfg, w) && fullStageNames(m.Cfg, l, p)[name] {
							div.Detail = append(div.Detail, "referee: no verdict at this stage: "+blockWhy(m.Cfg))
						} else {
							div.Detail = append(div.Detail, "referee: no verdict at this stage: the reference does not compute it with the weights given")
						}
					}
					div.Text = fmt.Sprintf("first divergence: decode step %d, layer %d, stage %s — %s: %s", p, l, name, div.Kind, div.Why)
					rep.First = div
				}
			}
		}
	}
	rep.StepsReplayed = len(steps)
	rep.finish()
	if m != nil {
		ra, errA := Run(ctx, m, a, Options{Tol: tol})
		rb, errB := Run(ctx, m, b, Options{Tol: tol})
		rep.Referee = referee(ra, rb, errA, errB)
	}
	return rep, nil
}

// referee is the verdict of the reference on each side of a diff, from a
// replay of each (ra, rb; "not-run" where it failed) and which side is
// right (Referee): a side is right only when its replay agrees (every
// tensor its dump holds compared, none out of tolerance) and the other's
// diverged or agrees too; an incomplete replay tells nothing about what it
// did not compare.
func referee(ra, rb *Report, errA, errB error) *Referee {
	r := &Referee{A: RefereeNotRun, B: RefereeNotRun, Right: "unknown"}
	if errA == nil {
		r.A = ra.Verdict
	}
	if errB == nil {
		r.B = rb.Verdict
	}
	var tail string
	switch {
	case errA != nil || errB != nil:
		tail = "unknown which is right: a replay failed"
	case ra.Diverged() && rb.Diverged():
		r.Right, tail = "neither", "neither is right"
		if ra.First != nil && rb.First != nil {
			a, b := ra.First, rb.First
			tail += fmt.Sprintf(": the reference's first divergence from A is at decode step %d, layer %d, stage %s", a.Step, a.Layer, a.Stage)
			if a.Step == b.Step && a.Layer == b.Layer && a.Stage == b.Stage {
				tail += ", from B at the same stage"
			} else {
				tail += fmt.Sprintf(", from B at decode step %d, layer %d, stage %s", b.Step, b.Layer, b.Stage)
			}
		}
	case ra.Diverged() && !rb.Diverged():
		if rb.Verdict == VerdictAgree {
			r.Right, tail = "b", "B is right"
		} else {
			tail = "A is wrong; B's replay is incomplete (not everything B holds was compared), so B is not known to be right"
		}
	case rb.Diverged():
		if ra.Verdict == VerdictAgree {
			r.Right, tail = "a", "A is right"
		} else {
			tail = "B is wrong; A's replay is incomplete (not everything A holds was compared), so A is not known to be right"
		}
	case ra.Verdict == VerdictAgree && rb.Verdict == VerdictAgree:
		r.Right, tail = "both", "both are right"
	default:
		tail = "unknown which is right: neither replay found a divergence, but an incomplete replay says nothing of what it did not compare"
	}
	r.Text = fmt.Sprintf("reference vs A %s, vs B %s: %s", r.A, r.B, tail)
	return r
}

// refereeStage computes stage def from A's dumped inputs and says which of the
// two dumped values the reference agrees with.
func refereeStage(m *engine.Model, a Source, def engine.StageDef, p int64, l int, ta, tb engine.Tensor, tol *Tolerance) string {
	in := map[string]engine.Tensor{}
	for _, name := range def.Inputs {
		var t engine.Tensor
		var ok bool
		var err error
		if base, prev := cutPrev(name); prev {
			t, ok, err = a.Stage(p-1, l, base)
			if !ok && err == nil {
				if st, after, has, e := a.State(l); e == nil && has && after == p-1 {
					t, ok = st[base]
				}
			}
		} else {
			t, ok, err = a.Stage(p, l, name)
		}
		if err != nil || !ok {
			return fmt.Sprintf("referee: input %s of %s is not in dump A; no verdict", name, def.Name)
		}
		in[name] = t
	}
	ctx := &engine.StepContext{Cfg: m.Cfg, Layer: l, Pos: p, W: m.Weights[l], Rope: m.Rope[l]}
	ref, err := def.Compute(ctx, in)
	if err != nil {
		return "referee: " + err.Error()
	}
	var sa, sb StageResult
	sa.Stage, sb.Stage = def.Name, def.Name
	JudgeStage(&sa, ref, ta, in, tol.For(def.Name), JudgeContext{m.GPURope, m.Cfg.WindowSize})
	JudgeStage(&sb, ref, tb, in, tol.For(def.Name), JudgeContext{m.GPURope, m.Cfg.WindowSize})
	okA := sa.Status != StatusFail
	okB := sb.Status != StatusFail
	switch {
	case okA && !okB:
		return "referee: the reference, fed A's inputs, agrees with A: B is wrong here (" + sb.Reason + ")"
	case okB && !okA:
		return "referee: the reference, fed A's inputs, agrees with B: A is wrong here (" + sa.Reason + ")"
	case okA && okB:
		return "referee: the reference is within tolerance of both"
	}
	return "referee: the reference agrees with neither (A: " + sa.Reason + "; B: " + sb.Reason + ")"
}

func cutPrev(name string) (string, bool) {
	if len(name) > len(engine.PrevPrefix) && name[:len(engine.PrevPrefix)] == engine.PrevPrefix {
		return name[len(engine.PrevPrefix):], true
	}
	return name, false
}

func intersectInts(a, b []int) []int {
	in := map[int]bool{}
	for _, v := range b {
		in[v] = true
	}
	var out []int
	for _, v := range a {
		if in[v] {
			out = append(out, v)
		}
	}
	sort.Ints(out)
	return out
}

// differentRunCos is the cos_diff of the attention input x above which two
// dumps are taken to be of different runs: two engines running the same
// tokens agree in x to bf16 rounding (cos_diff ~1e-5 at most), unrelated
// inputs give cos_diff ~1.
const differentRunCos = 0.1

// SameRun refuses to diff two dumps that are not of the same run: their
// model configs differ (the ModelArgs of their headers, when both carry
// one), they have no decode step in common or hold different layers, or
// they feed different tokens or positions at a common step (the global
// "tok" / "pos" records, when both hold them). Steps only one of them holds
// are not refused: Diff compares the common ones and reports the others as
// not checked. A stage-by-stage diff of two different runs would name the first
// stage where the runs differ — a projection, typically — as a kernel
// difference.
func SameRun(a, b *DumpSource) error {
	na, nb := a.Name(), b.Name()
	if ma, mb := a.D.Header.ModelArgs, b.D.Header.ModelArgs; ma != "" && mb != "" {
		ca, errA := engine.ParseConfig([]byte(ma))
		cb, errB := engine.ParseConfig([]byte(mb))
		if errA == nil && errB == nil {
			if f := firstConfigDifference(ca, cb); f != "" {
				return fmt.Errorf("diff %s %s: these dumps are of different models (config %s)", na, nb, f)
			}
		}
	}
	if len(intersectSteps(a.Steps(), b.Steps())) == 0 {
		return fmt.Errorf("diff %s %s: these dumps decode different steps, none in common (A: %s, B: %s)", na, nb, StepList(a.Steps()), StepList(b.Steps()))
	}
	if la, lb := a.Layers(), b.Layers(); !slices.Equal(la, lb) {
		return fmt.Errorf("diff %s %s: these dumps hold different layers (A: %v, B: %v)", na, nb, la, lb)
	}
	for _, p := range intersectSteps(a.Steps(), b.Steps()) {
		for _, name := range []string{"pos", "tok"} {
			ta, okA, err := a.read(dump.Key{Request: a.Request, Step: int(p), Layer: dump.Global, Stage: name}, dump.KindStage)
			if err != nil {
				return err
			}
			tb, okB, err := b.read(dump.Key{Request: b.Request, Step: int(p), Layer: dump.Global, Stage: name}, dump.KindStage)
			if err != nil {
				return err
			}
			if okA && okB && !slices.Equal(ta.I, tb.I) {
				return fmt.Errorf("diff %s %s: these dumps are of different runs: %s at step %d is %v in A, %v in B", na, nb, name, p, ta.I, tb.I)
			}
		}
	}
	return nil
}

// firstConfigDifference names the first ModelArgs field (in JSON key order)
// whose value differs between two configs, with both values; "" when none.
func firstConfigDifference(a, b *engine.Config) string {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	var ma, mb map[string]any
	if json.Unmarshal(ja, &ma) != nil || json.Unmarshal(jb, &mb) != nil {
		return ""
	}
	keys := make([]string, 0, len(ma))
	for k := range ma {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		va, _ := json.Marshal(ma[k])
		vb, _ := json.Marshal(mb[k])
		if string(va) != string(vb) {
			return fmt.Sprintf("%s: A %s, B %s", k, va, vb)
		}
	}
	return ""
}

// heldUnion are the stage tensors a or b holds at (p, layer), sorted (none
// when a source cannot list them).
func heldUnion(a, b Source, p int64, layer int) []string {
	set := map[string]bool{}
	for _, src := range []Source{a, b} {
		if sl, ok := src.(StageLister); ok {
			for _, n := range sl.StageNames(p, layer) {
				set[n] = true
			}
		}
	}
	return sortedNames(set)
}

// diffWordsReplacer turns a reason written for a replay (the reference
// against the GPU) into one of a diff, which judges B against A.
var diffWordsReplacer = strings.NewReplacer(
	"the reference set", "A's set", "the reference's", "A's", "the reference", "A", "reference", "A",
	"the GPU's", "B's", "GPU", "B")

// diffWords is a judging reason in a diff's words: A where a replay says
// the reference, B where it says the GPU.
func diffWords(reason string) string { return diffWordsReplacer.Replace(reason) }
