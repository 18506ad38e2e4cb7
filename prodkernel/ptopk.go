package prodkernel

import (
	"fmt"
	"slices"
	"strings"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/indexer"
)

// PTopKName is the list vLLM's persistent_topk wrote at k = 512 for each
// unit of a kernels-ptopk run (harness.py ptopk).
const PTopKName = "vllm_ptopk512"

// Join adds every tensor of o whose name ends in suffix to r, in memory, so
// that a run made from r's outputs (kernels-ptopk, computed from
// kernels-index's vllm_logits) is read beside them by unit key
// ("iscore.p126.L3." + suffix). A name r already holds is an error; Join
// returns how many tensors it added.
func (r *Run) Join(o *Run, suffix string) (int, error) {
	n := 0
	for _, name := range o.st.Names() {
		if !strings.HasSuffix(name, suffix) {
			continue
		}
		if r.Has(name) {
			return n, fmt.Errorf("prodkernel: %s: joining %s: %s is in both", r.Path, o.Path, name)
		}
		rec, err := o.read(name)
		if err != nil {
			return n, err
		}
		if r.patched == nil {
			r.patched = map[string]dump.Record{}
		}
		r.patched[name] = rec
		n++
	}
	return n, nil
}

// PTopKExtraUnits lists the logits-only units of a kernels-ptopk run
// (harness.PTOPK_EXTRA: "ptopk.<name>.r<row>.", each with its logits and
// the kernel's list), sorted by name.
func PTopKExtraUnits(r *Run) []string {
	var us []string
	for _, name := range r.st.Names() {
		if strings.HasPrefix(name, "ptopk.") && strings.HasSuffix(name, ".logits") {
			us = append(us, strings.TrimSuffix(name, "logits"))
		}
	}
	slices.Sort(us)
	return us
}

// CheckPTopKExtra holds the kernel's list (PTopKName) of every logits-only
// unit against its own logits, as CheckIndexTopK does (shape: min(k, Tc)
// distinct rows, −1 padding; a top-k of the logits), the reference there
// being indexer.TopK of the same logits with a score tolerance of 0: the
// rows in one set only must score exactly the k-th logit (an exact tie).
func CheckPTopKExtra(r *Run, k int) (*TopKCheck, error) {
	us := PTopKExtraUnits(r)
	if len(us) == 0 {
		return nil, fmt.Errorf("prodkernel: %s: no ptopk.* logits-only units", r.Path)
	}
	var cs []indexCase
	for _, base := range us {
		lg, err := r.Floats(base + "logits")
		if err != nil {
			return nil, err
		}
		tc := len(lg.F)
		if tc == 0 {
			return nil, fmt.Errorf("prodkernel: %s: %slogits is empty", r.Path, base)
		}
		ref := &indexRef{score: engine.Tensor{Shape: []int{tc}, F: lg.F}, tol: make([]float64, tc)}
		ref.topk, _ = indexer.TopK(lg.F, min(k, tc))
		cs = append(cs, indexCase{base: base, unit: strings.TrimSuffix(base, "."), tc: tc, ref: ref})
	}
	return checkIndexTopK(r, PTopKName, "logits", "", k, cs)
}
