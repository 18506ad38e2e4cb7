package replay

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
	rep.TolOverrides = tol.Overrides
	search := bisectSearch{
		steps:            steps,
		assumePersistent: assumePersistent,
		replay: func(ps []int64) (*Report, error) {
			return V41Run(d, V41Options{Mode: Local, Tol: tol, Steps: ps})
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
	rep.Results, rep.First, rep.Coverage.NotModelled = r.Results, r.First, r.Coverage.NotModelled
	rep.Coverage.Inputs, rep.Coverage.Scope = r.Coverage.Inputs, r.Coverage.Scope
	rep.finish()
	return rep, nil
}
