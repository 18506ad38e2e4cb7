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

// Bisect finds the first diverging decode step of src with few replays: a
// binary search over the steps, where probing step p means
//
//  1. a local (teacher-forced) replay of every layer at step p, and
//  2. a cache-consistency check of the state after p: every window row and
//     compressed row must equal the value dumped at the step that wrote it
//     (kv at step t for window slot t mod W, cmp_row at the emission step for
//     compressed row j, icmp_row for index key j), or the start state's row for
//     tokens before the first dumped step.
//
// The cache after step p summarises every earlier step's writes, so a cache
// corruption or stale page is seen at every later probe while its row stays
// in the cache; a kernel bug that appears at some step and persists (the usual
// case: a context-length condition, a scale rule) is seen at every later
// probe by (1). A divergence confined to one step that leaves nothing in the
// cache can be missed between probes: a full `replay` scans every step.
//
// The returned report holds the probes, the number of steps replayed and, when
// a diverging step is found, the full local replay of that step (its first
// divergence names the layer and stage).
func Bisect(ctx context.Context, m *engine.Model, src Source, tol *Tolerance) (*Report, error) {
	if tol == nil {
		tol = DefaultTolerance()
	}
	steps := src.Steps()
	rep := newReport(src.Name(), string(Local), m.GPURope, steps, src.Layers())
	rep.Command = "bisect"
	rep.Kernels = m.Kernels()
	rep.Probes = []Probe{}
	cache := map[int64]*Report{}
	probe := func(i int) (bool, error) {
		p := steps[i]
		r, err := Run(ctx, m, src, Options{Mode: Local, Tol: tol, Steps: []int64{p}})
		if err != nil {
			return false, err
		}
		cache[p] = r
		pr := Probe{Step: p, Diverged: r.Diverged()}
		if r.First != nil {
			pr.Why = fmt.Sprintf("layer %d stage %s: %s", r.First.Layer, r.First.Stage, r.First.Kind)
		}
		if !pr.Diverged {
			bad, err := cacheConsistency(m, src, p)
			if err != nil {
				return false, err
			}
			if bad != "" {
				pr.Diverged, pr.Why = true, bad
			}
		}
		rep.Probes = append(rep.Probes, pr)
		return pr.Diverged, nil
	}
	if len(steps) == 0 {
		rep.finish()
		return rep, nil
	}
	bad, err := probe(len(steps) - 1)
	if err != nil {
		return nil, err
	}
	if !bad {
		rep.StepsReplayed = len(rep.Probes)
		rep.finish()
		return rep, nil
	}
	lo, hi := 0, len(steps)-1 // steps[hi] diverges; all before lo are unknown
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
	first := steps[hi]
	rep.StepsReplayed = len(rep.Probes)
	r := cache[first]
	rep.Results = r.Results
	rep.First = r.First
	rep.finish()
	if rep.First == nil {
		// The step's own stages agree; the divergence is in the cache it holds.
		for _, pr := range rep.Probes {
			if pr.Step == first {
				rep.First = &Divergence{Step: first, Layer: -1, Stage: "kv_cache", Kind: KindPrefix, Mode: string(Local),
					Why: pr.Why, Inputs: []InputInfo{}}
				rep.First.Text = fmt.Sprintf("first divergence: decode step %d, stage kv_cache — %s: %s", first, rep.First.Kind, pr.Why)
			}
		}
		rep.Verdict = "diverged"
	}
	return rep, nil
}

// cacheConsistency checks that the cache rows in the state after step p equal
// the values the dump recorded when they were written. It returns a
// description of the first inconsistent row, or "".
func cacheConsistency(m *engine.Model, src Source, p int64) (string, error) {
	cfg := m.Cfg
	W, D := cfg.WindowSize, cfg.HeadDim
	for _, l := range src.Layers() {
		kc, ok, err := src.Stage(p, l, "kv_cache")
		if err != nil || !ok || len(kc.Shape) != 2 || kc.Shape[1] != D {
			if err != nil {
				return "", err
			}
			continue
		}
		start, after, hasStart, err := src.State(l)
		if err != nil {
			return "", err
		}
		row := func(i int) []float32 { return kc.F[i*D : (i+1)*D] }
		// Window rows: token t sits in slot t mod W.
		for t := max(0, p-int64(W)+1); t <= p; t++ {
			slot := int(t % int64(W))
			var want []float32
			if v, ok, err := src.Stage(t, l, "kv"); err != nil {
				return "", err
			} else if ok && len(v.F) == D {
				want = v.F
			} else if hasStart && t <= after {
				if sk, ok := start["kv_cache"]; ok && len(sk.F) >= (slot+1)*D {
					want = sk.F[slot*D : (slot+1)*D]
				}
			}
			if want != nil && !rowsEqual(want, row(slot)) {
				return fmt.Sprintf("layer %d: cache row %d (window slot of token %d) after step %d differs from the kv written at step %d", l, slot, t, p, t), nil
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
				return "", err
			} else if ok && len(v.F) == D {
				want = v.F
			} else if hasStart && e <= after {
				if sk, ok := start["kv_cache"]; ok && len(sk.F) >= (W+j+1)*D {
					want = sk.F[(W+j)*D : (W+j+1)*D]
				}
			}
			if want != nil && !rowsEqual(want, row(W+j)) {
				return fmt.Sprintf("layer %d: compressed row %d after step %d differs from the cmp_row emitted at step %d", l, j, p, e), nil
			}
		}
	}
	return "", nil
}
