package replay

import "fmt"

// V41Bisect is bisect for a V4.1 dump: a binary search over the steps for a
// divergence that persists once it appears, probing one step at a time with
// a local V41Run, then (unless assumePersistent) one local replay of the
// steps before the first diverging probe that no probe replayed, so that the
// verdict, step, layer and stage are those of a local replay of the whole
// dump (BisectWith's contract). Unlike BisectWith there is no separate
// cache-consistency check: a V4.1 step's window and kv_cache stages are
// compared against the previous step's dumped cache plus this step's row,
// so a cache corruption is named at the step whose dump first holds it.
func V41Bisect(d *V41Dump, tol *Tolerance, assumePersistent bool) (*Report, error) {
	if tol == nil {
		tol = V41Tolerance(Local)
	}
	steps := d.Steps
	layers := make([]int, d.Cfg.NLayers)
	for l := range layers {
		layers[l] = l
	}
	rep := newReport(d.Dir, string(Local), true, steps, layers)
	rep.Command, rep.Kernels, rep.Model = "bisect", "reference", V41ModelName
	rep.Probes, rep.Scanned = []Probe{}, []int64{}
	byStep := map[int64]*Report{}
	probe := func(i int) (bool, error) {
		p := steps[i]
		r, err := V41Run(d, V41Options{Mode: Local, Tol: tol, Steps: []int64{p}})
		if err != nil {
			return false, err
		}
		byStep[p] = r
		pr := Probe{Step: p, Diverged: r.Diverged()}
		if r.First != nil {
			pr.Why = fmt.Sprintf("layer %d stage %s: %s", r.First.Layer, r.First.Stage, r.First.Kind)
		}
		rep.Probes = append(rep.Probes, pr)
		return pr.Diverged, nil
	}
	cand := -1
	bad, err := probe(len(steps) - 1)
	if err != nil {
		return nil, err
	}
	if bad {
		lo, hi := 0, len(steps)-1
		for lo < hi {
			mid := (lo + hi) / 2
			b, err := probe(mid)
			if err != nil {
				return nil, err
			}
			if b {
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
	var rest []int64
	for _, p := range steps[:limit] {
		if byStep[p] == nil {
			rest = append(rest, p)
		}
	}
	var scanFirst *Divergence
	if len(rest) > 0 && !assumePersistent {
		r, err := V41Run(d, V41Options{Mode: Local, Tol: tol, Steps: rest})
		if err != nil {
			return nil, err
		}
		rep.Scanned = rest
		for _, p := range rest {
			byStep[p] = stepReport(r, p)
		}
		scanFirst = r.First
	}
	var first int64 = -1
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
		for _, p := range checked {
			rep.Results = append(rep.Results, byStep[p].Results...)
			rep.Coverage.NotModelled = mergeNames(rep.Coverage.NotModelled, byStep[p].Coverage.NotModelled)
		}
		rep.finish()
		return rep, nil
	}
	r := byStep[first]
	rep.Results, rep.First, rep.Coverage.NotModelled = r.Results, r.First, r.Coverage.NotModelled
	rep.finish()
	return rep, nil
}
