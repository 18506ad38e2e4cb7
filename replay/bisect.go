package replay

import (
	"context"
	"fmt"

	"sparsemla/engine"
)

// Probe is one step a bisection replayed and what it found there.
type Probe struct {
	Step     int64  `json:"step"`
	Diverged bool   `json:"diverged"`
	Why      string `json:"why,omitempty"` // the first failing stage, or a cache-consistency fault
}

// BisectOptions configure BisectWith.
type BisectOptions struct {
	Tol *Tolerance // nil: DefaultTolerance()
	// AssumePersistent skips the scan of the steps the binary search did not
	// probe: faster, and honest about it — the report then lists those steps
	// as not checked, and without a divergence among the probes its verdict
	// is "incomplete", never "agree".
	AssumePersistent bool
}

// Bisect is BisectWith with the default options (the scan included).
func Bisect(ctx context.Context, m *engine.Model, src Source, tol *Tolerance) (*Report, error) {
	return BisectWith(ctx, m, src, BisectOptions{Tol: tol})
}

// BisectWith finds the first diverging decode step of src. It first looks
// for a persistent divergence with a binary search over the steps, where
// probing step p means
//
//  1. a local (teacher-forced) replay of every layer at step p, and
//  2. a cache-consistency check of the state after p: every window row and
//     compressed row must equal the value dumped at the step that wrote it
//     (kv at step t for window slot t mod W, cmp_row at the emission step for
//     compressed row j), or the start state's row for tokens before the
//     first dumped step.
//
// The cache after step p summarises every earlier step's writes, so a cache
// corruption or stale page is seen at every later probe while its row stays
// in the cache; a kernel bug that appears at some step and persists is seen
// at every later probe by (1). A divergence confined to one step that leaves
// nothing in the cache (a split-K merge or top-k bug at one step, a row the
// window ring later overwrote) is not seen by the probes, so the search
// only bounds the answer: the steps before the first diverging probe (every
// step when no probe diverged) that were not probed are then replayed as
// well, in one local replay. The report therefore names the same first
// divergence (step, layer, stage) and the same verdict as a local replay of
// the whole dump; it saves the steps after the first persistent divergence.
// With AssumePersistent the scan is skipped and the report says which steps
// were not checked.
//
// The report holds the probes, the scanned steps, the number of steps
// replayed and, when a diverging step is found, the full local replay of
// that step (its first divergence names the layer and stage); otherwise the
// results of every step replayed.
func BisectWith(ctx context.Context, m *engine.Model, src Source, opt BisectOptions) (*Report, error) {
	tol := opt.Tol
	if tol == nil {
		tol = DefaultTolerance()
	}
	steps := src.Steps()
	rep := newReport(src.Name(), string(Local), m.GPURope, steps, src.Layers())
	rep.Command = "bisect"
	rep.Kernels = m.Kernels()
	rep.TolOverrides = tol.Overrides
	rep.Coverage.Unread = unreadOf(src, "")
	if p := m.Cfg.PolicyName(); p != engine.PolicyOfficial {
		rep.Policy = p
	}
	cacheBad := map[int64]cacheFault{} // probes whose cache check failed
	search := bisectSearch{
		steps:            steps,
		assumePersistent: opt.AssumePersistent,
		replay: func(ps []int64) (*Report, error) {
			return Run(ctx, m, src, Options{Mode: Local, Tol: tol, Steps: ps})
		},
		check: func(p int64) (string, error) {
			cf, err := cacheConsistency(m, src, p)
			if err != nil || cf.why == "" {
				return "", err
			}
			cacheBad[p] = cf
			return fmt.Sprintf("layer %d: %s", cf.layer, cf.why), nil
		},
	}
	first, byStep, err := search.run(rep)
	if err != nil {
		return nil, err
	}
	if first < 0 {
		return rep, nil
	}
	r := byStep[first]
	rep.Results = r.Results
	rep.First = r.First
	rep.Coverage.NotModelled = r.Coverage.NotModelled
	rep.Coverage.Inputs, rep.Coverage.Scope = r.Coverage.Inputs, r.Coverage.Scope
	if rep.First == nil {
		// The step's own stages agree; the divergence is in the cache it
		// holds (rows that changed after they were written, at a step the
		// dump does not replay).
		cf := cacheBad[first]
		rep.First = &Divergence{Step: first, Layer: cf.layer, Stage: "kv_cache", Kind: KindCache, Mode: string(Local),
			Why: cf.why, Inputs: []InputInfo{}, Hint: hints[KindCache]}
		rep.First.Text = fmt.Sprintf("first divergence: decode step %d, layer %d, stage kv_cache — %s: %s", first, cf.layer, KindCache, cf.why)
	}
	rep.finish()
	return rep, nil
}

// bisectSearch is the search BisectWith describes, shared by the V4 and
// V4.1 bisections: a binary search over steps for a persistent divergence,
// probing one step at a time with replay (a local replay of the steps it is
// given) and, where the step's own stages agree, check (a further test of
// the state after the step; "" when it passes, else why it failed), then,
// unless assumePersistent, one replay of the steps before the first
// diverging probe that no probe replayed.
type bisectSearch struct {
	steps            []int64
	assumePersistent bool
	replay           func(steps []int64) (*Report, error)
	check            func(p int64) (string, error) // nil: no further check
}

// run searches, recording in rep the probes, the scanned steps, the steps
// replayed and the coverage. It returns the first diverging step (-1 when
// none: rep then holds the results of every step replayed and is finished)
// and the local report of each step replayed.
func (b bisectSearch) run(rep *Report) (first int64, byStep map[int64]*Report, err error) {
	steps := b.steps
	rep.Probes, rep.Scanned = []Probe{}, []int64{}
	byStep = map[int64]*Report{}
	if len(steps) == 0 {
		rep.finish()
		return -1, byStep, nil
	}
	probe := func(i int) (bool, error) {
		p := steps[i]
		r, err := b.replay([]int64{p})
		if err != nil {
			return false, err
		}
		byStep[p] = r
		pr := Probe{Step: p, Diverged: r.Diverged()}
		if r.First != nil {
			pr.Why = fmt.Sprintf("layer %d stage %s: %s", r.First.Layer, r.First.Stage, r.First.Kind)
		}
		if !pr.Diverged && b.check != nil {
			why, err := b.check(p)
			if err != nil {
				return false, err
			}
			if why != "" {
				pr.Diverged, pr.Why = true, why
			}
		}
		rep.Probes = append(rep.Probes, pr)
		return pr.Diverged, nil
	}
	cand := -1 // index of the first diverging probe under the persistence assumption
	bad, err := probe(len(steps) - 1)
	if err != nil {
		return -1, nil, err
	}
	if bad {
		lo, hi := 0, len(steps)-1 // steps[hi] diverges; all before lo are unknown
		for lo < hi {
			mid := (lo + hi) / 2
			bd, err := probe(mid)
			if err != nil {
				return -1, nil, err
			}
			if bd {
				hi = mid
			} else {
				lo = mid + 1
			}
		}
		cand = hi
	}
	limit := len(steps)
	if cand >= 0 {
		limit = cand
	}
	var rest []int64 // steps before the candidate that no probe replayed
	for _, p := range steps[:limit] {
		if byStep[p] == nil {
			rest = append(rest, p)
		}
	}
	var scanFirst *Divergence
	if len(rest) > 0 && !b.assumePersistent {
		r, err := b.replay(rest)
		if err != nil {
			return -1, nil, err
		}
		rep.Scanned = rest
		for _, p := range rest {
			byStep[p] = stepReport(r, p)
		}
		scanFirst = r.First
	}
	first = -1
	switch {
	case scanFirst != nil:
		first = scanFirst.Step
	case cand >= 0:
		first = steps[cand]
	}
	var checked, unchecked []int64
	for _, p := range steps {
		switch {
		case byStep[p] != nil:
			checked = append(checked, p)
		case first < 0 || p < first:
			unchecked = append(unchecked, p)
		}
	}
	rep.StepsReplayed = len(checked)
	rep.Coverage.Steps = append([]int64{}, checked...)
	if len(unchecked) > 0 {
		rep.Coverage.StepsNotChecked = unchecked
		rep.Coverage.StepsWhy = "not probed (bisect assumed a divergence persists once it appears)"
	}
	if first < 0 {
		// No divergence: the results of every step replayed, in step order.
		// Each replay judges the RoPE tables once, at its first step: the
		// probes and the scan are several replays, and each table is one
		// tensor of the dump, counted once (at the first step checked).
		rope := map[int]bool{}
		for _, p := range checked {
			for _, sr := range byStep[p].Results {
				if sr.Stage == "rope_table" {
					if rope[sr.Layer] {
						continue
					}
					rope[sr.Layer] = true
				}
				rep.Results = append(rep.Results, sr)
			}
			rep.Coverage.Inputs = append(rep.Coverage.Inputs, byStep[p].Coverage.Inputs...)
			rep.Coverage.NotModelled = mergeNames(rep.Coverage.NotModelled, byStep[p].Coverage.NotModelled)
			rep.Coverage.Scope = byStep[p].Coverage.Scope
		}
		rep.finish()
	}
	return first, byStep, nil
}

// stepReport is the part of r (a local replay of several steps) about
// step p, as a report of its own (results, first divergence, coverage).
func stepReport(r *Report, p int64) *Report {
	s := newReport(r.Dump, r.Mode, r.GPURope, []int64{p}, r.Layers)
	for _, sr := range r.Results {
		if sr.Step == p {
			s.Results = append(s.Results, sr)
		}
	}
	if r.First != nil && r.First.Step == p {
		s.First = r.First
	}
	for _, in := range r.Coverage.Inputs {
		if in.Step == p {
			s.Coverage.Inputs = append(s.Coverage.Inputs, in)
		}
	}
	s.Coverage.NotModelled = r.Coverage.NotModelled
	s.Coverage.Scope = r.Coverage.Scope
	s.finish()
	return s
}

func mergeNames(a, b []string) []string {
	set := map[string]bool{}
	for _, n := range a {
		set[n] = true
	}
	for _, n := range b {
		set[n] = true
	}
	return sortedNames(set)
}

// cacheFault is a cache row that differs from the value dumped when it was
// written: its layer and a sentence.
type cacheFault struct {
	layer int
	why   string
}

// cacheConsistency checks that the cache rows in the state after step p equal
// the values the dump recorded when they were written. It returns a
// description of the first inconsistent row, or "".
func cacheConsistency(m *engine.Model, src Source, p int64) (cacheFault, error) {
	cfg := m.Cfg
	W, D := cfg.WindowSize, cfg.HeadDim
	for _, l := range src.Layers() {
		kc, ok, err := src.Stage(p, l, "kv_cache")
		if err != nil || !ok || len(kc.Shape) != 2 || kc.Shape[1] != D {
			if err != nil {
				return cacheFault{}, err
			}
			continue
		}
		start, after, hasStart, err := src.State(l)
		if err != nil {
			return cacheFault{}, err
		}
		row := func(i int) []float32 { return kc.F[i*D : (i+1)*D] }
		// Window rows: token t sits in slot t mod W.
		for t := max(0, p-int64(W)+1); t <= p; t++ {
			slot := int(t % int64(W))
			var want []float32
			if v, ok, err := src.Stage(t, l, "kv"); err != nil {
				return cacheFault{}, err
			} else if ok && len(v.F) == D {
				want = v.F
			} else if hasStart && t <= after {
				if sk, ok := start["kv_cache"]; ok && len(sk.F) >= (slot+1)*D {
					want = sk.F[slot*D : (slot+1)*D]
				}
			}
			if want != nil && !rowsEqual(want, row(slot)) {
				return cacheFault{l, fmt.Sprintf("cache row %d (window slot of token %d) after step %d differs from the kv written at step %d", slot, t, p, t)}, nil
			}
		}
		r := cfg.Ratio(l)
		if r == 0 {
			continue
		}
		for j := 0; W+j < kc.Shape[0]; j++ {
			e := int64(j*r + r - 1)
			var want []float32
			if v, ok, err := src.Stage(e, l, "cmp_row"); err != nil {
				return cacheFault{}, err
			} else if ok && len(v.F) == D {
				want = v.F
			} else if hasStart && e <= after {
				if sk, ok := start["kv_cache"]; ok && len(sk.F) >= (W+j+1)*D {
					want = sk.F[(W+j)*D : (W+j+1)*D]
				}
			}
			if want != nil && !rowsEqual(want, row(W+j)) {
				return cacheFault{l, fmt.Sprintf("compressed row %d after step %d differs from the cmp_row emitted at step %d", j, p, e)}, nil
			}
		}
	}
	return cacheFault{}, nil
}
