package attribute

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"sparsemla/engine"
	"sparsemla/quant"
)

// Call is what a hypothesis reads: the step context (config, layer,
// position, weights, RoPE table), the stage, its inputs (the dumped values
// in a teacher-forced replay), the reference's value from those inputs, and
// Get for other values of the same step and the state before it
// ("split_bounds", "prev:kv_cache", …; nil or false when not available).
type Call struct {
	Ctx *engine.StepContext
	Def engine.StageDef
	In  map[string]engine.Tensor
	Ref engine.Tensor
	Get func(name string) (engine.Tensor, bool)
}

func (c *Call) get(name string) (engine.Tensor, bool) {
	if t, ok := c.In[name]; ok {
		return t, true
	}
	if c.Get == nil {
		return engine.Tensor{}, false
	}
	return c.Get(name)
}

// Hypothesis is one alternative computation of a stage.
type Hypothesis struct {
	Name string // short and stable, e.g. "bf16-softmax"
	Desc string // what it computes differently, and who ships it
	run  func(c *Call) (engine.Tensor, error)
}

// Match is how close one hypothesis comes to the GPU's tensor. The worst
// element's ulp distance and coordinate come from the same element.
type Match struct {
	Name   string `json:"name"`
	Desc   string `json:"description"`
	Exact  bool   `json:"exact"`             // bit-identical with the GPU
	Differ int    `json:"differ"`            // elements whose bits differ from the GPU's
	N      int    `json:"n"`                 // elements compared
	MaxULP int32  `json:"max_ulp"`           // largest bf16 ulp distance among them (float tensors)
	At     []int  `json:"at,omitempty"`      // coordinate of that element
	Skip   string `json:"skipped,omitempty"` // why it could not run (then nothing above is meaningful)
}

// Verdict is the outcome of Attribute for one diverging stage.
type Verdict struct {
	Stage string `json:"stage"`
	// Reference is the reference's own distance to the GPU (Name "reference").
	Reference Match `json:"reference"`
	// Best is the hypothesis that reproduces the GPU bit for bit (the first
	// of Exact), else the closest one that is strictly closer to the GPU
	// than the reference; nil when no hypothesis is closer.
	Best  *Match   `json:"best"`
	Exact []string `json:"exact"` // every hypothesis that reproduces the GPU bit for bit, in list order
	Tried []Match  `json:"tried"` // every hypothesis, in list order
}

// Text is the hypothesis sentence of a diagnosis, "" when none fits.
func (v *Verdict) Text() string {
	if v == nil || v.Best == nil {
		return ""
	}
	b := v.Best
	if b.Exact {
		s := fmt.Sprintf("the GPU's %s is reproduced bit for bit by hypothesis %q (%s)", v.Stage, b.Name, b.Desc)
		if len(v.Exact) > 1 {
			s += fmt.Sprintf("; equally by %s", strings.Join(quoteAll(v.Exact[1:]), ", "))
		}
		return s
	}
	return fmt.Sprintf("no hypothesis reproduces the GPU's %s bit for bit; the closest is %q (%s): %d of %d elements differ, max %d bf16 ulps at %v (the reference: %d differ)",
		v.Stage, b.Name, b.Desc, b.Differ, b.N, b.MaxULP, b.At, v.Reference.Differ)
}

func quoteAll(s []string) []string {
	out := make([]string, len(s))
	for i, x := range s {
		out[i] = fmt.Sprintf("%q", x)
	}
	return out
}

// Attribute runs every hypothesis of c.Def.Name on c and compares each
// result with gpu. It returns nil when the stage has no hypotheses.
func Attribute(c *Call, gpu engine.Tensor) *Verdict {
	hyps := Hypotheses(c.Def.Name)
	if len(hyps) == 0 {
		return nil
	}
	v := &Verdict{Stage: c.Def.Name, Reference: distance("reference", "the reference from the same inputs", c.Ref, gpu), Exact: []string{}, Tried: []Match{}}
	for _, h := range hyps {
		t, err := safeRun(h, c)
		var m Match
		if err != nil {
			m = Match{Name: h.Name, Desc: h.Desc, Skip: err.Error()}
		} else {
			m = distance(h.Name, h.Desc, t, gpu)
		}
		v.Tried = append(v.Tried, m)
		if m.Skip == "" && m.Exact {
			v.Exact = append(v.Exact, h.Name)
		}
	}
	for i := range v.Tried {
		m := &v.Tried[i]
		if m.Skip != "" {
			continue
		}
		if m.Exact {
			v.Best = m
			break
		}
		if closer(*m, v.Reference) && (v.Best == nil || closer(*m, *v.Best)) {
			v.Best = m
		}
	}
	return v
}

// closer reports whether a is strictly closer to the GPU than b: fewer
// differing elements, then a smaller worst ulp distance.
func closer(a, b Match) bool {
	if a.Differ != b.Differ {
		return a.Differ < b.Differ
	}
	return a.MaxULP < b.MaxULP
}

func safeRun(h Hypothesis, c *Call) (t engine.Tensor, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%v", r)
		}
	}()
	return h.run(c)
}

// distance compares a hypothesis's tensor with the GPU's element by element.
func distance(name, desc string, t, gpu engine.Tensor) Match {
	m := Match{Name: name, Desc: desc}
	if t.Kind.IsFloat() != gpu.Kind.IsFloat() || !engine.SameShape(t.Shape, gpu.Shape) || len(t.F) != len(gpu.F) || len(t.I) != len(gpu.I) {
		m.Skip = fmt.Sprintf("gives %s %v, the GPU's tensor is %s %v", t.Kind, t.Shape, gpu.Kind, gpu.Shape)
		return m
	}
	worst := -1
	if t.Kind.IsFloat() {
		m.N = len(t.F)
		for i := range t.F {
			if math.Float32bits(t.F[i]) == math.Float32bits(gpu.F[i]) {
				continue
			}
			m.Differ++
			u := quant.BF16ULPDistance(t.F[i], gpu.F[i])
			if t.F[i] != t.F[i] || gpu.F[i] != gpu.F[i] {
				u = math.MaxInt32
			}
			if worst < 0 || u > m.MaxULP {
				m.MaxULP, worst = u, i
			}
		}
	} else {
		m.N = len(t.I)
		for i := range t.I {
			if t.I[i] != gpu.I[i] {
				m.Differ++
				if worst < 0 {
					worst = i
				}
			}
		}
	}
	if worst >= 0 {
		m.At = engine.Coord(gpu.Shape, worst)
	}
	m.Exact = m.Differ == 0
	return m
}

// Names lists the stages that have hypotheses, sorted.
func Names() []string {
	out := make([]string, 0, len(registry))
	for s := range registry {
		out = append(out, s)
	}
	slices.Sort(out)
	return out
}

// Hypotheses returns the hypotheses tried for stage (nil: none), in the
// order Attribute tries them.
func Hypotheses(stage string) []Hypothesis { return registry[stage] }
