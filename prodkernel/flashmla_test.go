package prodkernel

import (
	"math"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"sparsemla/attention"
	"sparsemla/quant"
	"sparsemla/replay"
)

// openFlashSynth opens the committed synthetic FlashMLA run and regenerates its input.
func openFlashSynth(t *testing.T) (*Run, *FlashInput, *FlashCache) {
	t.Helper()
	r, err := Open(filepath.Join("..", "testdata", "kernels", "flashmla-synth"), "flashmla")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	in, err := NewFlashInput()
	if err != nil {
		t.Fatal(err)
	}
	c, err := NewFlashCache(in.Pages, in.Table)
	if err != nil {
		t.Fatal(err)
	}
	return r, in, c
}

// TestFlashSynthReplay: FlashMLA's sparse FP8 decode (sm90, MODEL1, 64
// heads) over the synthetic V4-Flash inputs agrees with the reference in
// every query row of every clean case, under the default o and lse
// tolerances, at every split count the cases reach.
func TestFlashSynthReplay(t *testing.T) {
	r, in, c := openFlashSynth(t)
	tol := FlashMLATolerance()
	var all []FlashQuery
	for _, fc := range FlashCases {
		if fc.Fault != "" {
			continue
		}
		cr, ok := r.Info.Cases[fc.Name]
		if !ok || !cr.OK {
			t.Errorf("%s did not run: %s", fc.Name, cr.Error)
			continue
		}
		qs, err := FlashSynthQueries(r, in, fc)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: b %d s_q %d topk %d, %d SM parts, num_splits %v, repeat bit-equal %v", fc.Name, cr.B, cr.SQ, cr.TopK, cr.NumSMParts, cr.NumSplits, cr.Repeat)
		all = append(all, qs...)
	}
	rep := ReplayFlash(all, c, FlashWindow+FlashCmp, in.Sink, tol)
	for _, v := range rep.Verdicts {
		if !v.OK {
			t.Errorf("%s: diverged: %s (hypotheses reproducing: %v)", v.Unit, v.Why, v.Hypothes)
		}
	}
	nd := 0
	for _, v := range rep.Verdicts {
		okL, _ := tol.For("lse").Judge(v.LSE, false)
		if v.FailsUnder(replay.DefaultTolerance().For("o"), okL) {
			nd++
		}
	}
	t.Logf("under the default tolerance (FlashMLA's own test thresholds) %d of %d rows would fail", nd, len(all))
	t.Logf("%d query rows × %d heads: o |err| %v; o |err| where rel ≥ %.3g: %v; o bf16 ulps %v; cos_diff %v; lse |err| %v; lse rel %v",
		len(all), FlashHeads, rep.OAbs, tol.For("o").Rel, rep.OAbsBeyondRel, rep.OULP, rep.Cos, rep.LSEAbs, rep.LSERel)
}

// TestFlashGoldenReplay: FlashMLA over the goldens' MODEL1 pages (kvcache's
// encoding of the dumped kv_cache), dumped q, topk_idxs and attn_sink agrees
// with the reference at every step and layer.
func TestFlashGoldenReplay(t *testing.T) {
	tol := FlashMLATolerance()
	for _, name := range goldenDumps {
		d, src := openGolden(t, name)
		m, err := replay.LoadModel(d, src, "")
		if err != nil {
			t.Fatal(err)
		}
		r, err := Open(kernelDir(name), "flashmla")
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		if kr := r.Info.Runs["flashmla_sparse_decode_fwd"]; !kr.OK {
			t.Fatalf("%s: FlashMLA did not run: %s", name, kr.Error)
		}
		n := 0
		var reps []*FlashReport
		for _, p := range src.Steps() {
			for _, l := range src.Layers() {
				if !r.Has(fmtKey(p, l) + "o") {
					continue
				}
				q, err := FlashGoldenQuery(r, src, p, l)
				if err != nil {
					t.Fatal(err)
				}
				kv, _, err := src.Stage(p, l, "kv_cache")
				if err != nil {
					t.Fatal(err)
				}
				pages, table, err := EncodePages(kv)
				if err != nil {
					t.Fatal(err)
				}
				c, err := NewFlashCache(pages, table)
				if err != nil {
					t.Fatal(err)
				}
				rep := ReplayFlash([]FlashQuery{q}, c, kv.Shape[0], m.Weights[l].AttnSink, tol)
				for _, v := range rep.Verdicts {
					if !v.OK {
						t.Errorf("%s %s: diverged: %s", name, v.Unit, v.Why)
					}
					okL, _ := tol.For("lse").Judge(v.LSE, false)
					if v.FailsUnder(replay.DefaultTolerance().For("o"), okL) {
						t.Logf("%s %s: would fail the default o tolerance (abs %.3g where rel ≥ 2.01/128, cos_diff %.3g)", name, v.Unit, v.BeyondRel, v.CosMax)
					}
				}
				reps = append(reps, rep)
				n++
			}
		}
		if n == 0 {
			t.Fatalf("%s: no FlashMLA unit", name)
		}
		t.Logf("%s: %d units replayed", name, n)
	}
}

// TestFlashFaults: the two faulted FlashMLA calls replay to exactly their
// fault. f_dropped_split: the combine was given num_splits [0, 9] for a
// request FlashMLA split 10 ways (one 64-entry block each), so the last
// split partial, over entries [576, 640), is left out; f_wrong_page: the
// index list was mapped through a block table naming page 9 for logical
// block 5 (its page is 13).
func TestFlashFaults(t *testing.T) {
	r, in, c := openFlashSynth(t)
	tol := FlashMLATolerance()
	want := map[string]string{
		"f_dropped_split": "dropped split: the softmax misses index-list entries [576, 640) (blocks 9..9 of 64)",
		"f_wrong_page":    "in logical block 5 were read from physical page 9, not page 13",
	}
	for _, fc := range FlashCases {
		if fc.Fault == "" {
			continue
		}
		t.Run(fc.Name, func(t *testing.T) {
			cr := r.Info.Cases[fc.Name]
			if !cr.OK || cr.Fault != fc.Fault {
				t.Fatalf("run %+v", cr)
			}
			qs, err := FlashSynthQueries(r, in, fc)
			if err != nil {
				t.Fatal(err)
			}
			rep := ReplayFlash(qs, c, FlashWindow+FlashCmp, in.Sink, tol)
			if rep.Diverged() != len(qs) {
				t.Fatalf("%d of %d rows diverged", rep.Diverged(), len(qs))
			}
			for _, v := range rep.Verdicts {
				t.Logf("%s: %s\n  diagnosis: %s", v.Unit, v.Why, v.Fault)
				if !strings.Contains(v.Fault, want[fc.Name]) || len(v.Hypothes) != 1 {
					t.Errorf("diagnosis %q (all reproducing: %v), want %q", v.Fault, v.Hypothes, want[fc.Name])
				}
			}
			if fc.Fault == "dropped-split" {
				// The clean call of the same inputs agrees: the fault is the combine's.
				o, err := r.Floats(fc.Name + ".o_clean")
				if err != nil {
					t.Fatal(err)
				}
				clean := qs[0]
				clean.O = o.F
				lse := ReplayFlash([]FlashQuery{clean}, c, FlashWindow+FlashCmp, in.Sink, tol)
				if lse.Verdicts[0].O.CloseFail != 0 {
					t.Errorf("clean call of %s: %s", fc.Name, lse.Verdicts[0].Why)
				}
			}
		})
	}
}

// TestFlashModel: FlashModel — FlashMLA's own evaluation order, its
// scheduler's split ranges (FlashSchedule, checked against the run's
// num_splits) — is much closer to the kernel's o than the reference is: the
// evidence that the measured FlashMLA distance is its split-K bf16(P)
// rounding and not a defect.
func TestFlashModel(t *testing.T) {
	r, in, c := openFlashSynth(t)
	type tally struct{ n, refDiff, modDiff, refOver, modOver int }
	var all tally
	var refAbs, modAbs float64
	for _, fc := range FlashCases {
		if fc.Fault != "" {
			continue
		}
		cr := r.Info.Cases[fc.Name]
		blocks := make([]int, fc.B)
		for i := range blocks {
			blocks[i] = fc.TopK() / 64
		}
		sched := FlashSchedule(blocks, cr.NumSMParts)
		ns := []int{0}
		for _, s := range sched {
			ns = append(ns, ns[len(ns)-1]+len(s))
		}
		if !slices.Equal(ns, cr.NumSplits) {
			t.Fatalf("%s: FlashSchedule gives num_splits %v, the kernel %v", fc.Name, ns, cr.NumSplits)
		}
		qs, err := FlashSynthQueries(r, in, fc)
		if err != nil {
			t.Fatal(err)
		}
		kv := c.rows(FlashWindow + FlashCmp)
		for qi, q := range qs {
			row := func(i int) []float32 { j := int(q.Idx[i]); return kv[j*FlashDim : (j+1)*FlashDim] }
			mo, _ := FlashModel(q.Q, row, q.Idx, in.Sink, sched[qi/fc.SQ])
			ref := make([]float32, len(q.Q))
			attention.SparseAttnFast(ref, q.Q, kv, FlashDim, q.Idx, in.Sink, flashScale)
			for i, g := range q.O {
				all.n++
				dr, dm := math.Abs(float64(g-ref[i])), math.Abs(float64(g-mo[i]))
				refAbs, modAbs = max(refAbs, dr), max(modAbs, dm)
				if g != ref[i] {
					all.refDiff++
				}
				if g != mo[i] {
					all.modDiff++
				}
				if quant.BF16ULPDistance(g, ref[i]) > 1 && dr > 1e-4 {
					all.refOver++
				}
				if quant.BF16ULPDistance(g, mo[i]) > 1 && dm > 1e-4 {
					all.modOver++
				}
			}
		}
	}
	// The goldens: one request, 132 SM parts (the H200), lists padded to 64.
	for _, name := range goldenDumps {
		d, src := openGolden(t, name)
		m, err := replay.LoadModel(d, src, "")
		if err != nil {
			t.Fatal(err)
		}
		gr, err := Open(kernelDir(name), "flashmla")
		if err != nil {
			t.Fatal(err)
		}
		defer gr.Close()
		for _, p := range src.Steps() {
			for _, l := range src.Layers() {
				if !gr.Has(fmtKey(p, l) + "o") {
					continue
				}
				q, err := FlashGoldenQuery(gr, src, p, l)
				if err != nil {
					t.Fatal(err)
				}
				kvt, _, _ := src.Stage(p, l, "kv_cache")
				kv := kvt.F
				for len(q.Idx)%64 != 0 {
					q.Idx = append(q.Idx, -1)
				}
				sched := FlashSchedule([]int{len(q.Idx) / 64}, 132)
				ns, _ := gr.Ints(fmtKey(p, l) + "num_splits")
				if len(ns) != 2 || int(ns[1]) != len(sched[0]) {
					t.Fatalf("%s p%d L%d: FlashSchedule gives %d splits, the kernel %v", name, p, l, len(sched[0]), ns)
				}
				sink := m.Weights[l].AttnSink
				row := func(i int) []float32 { j := int(q.Idx[i]); return kv[j*FlashDim : (j+1)*FlashDim] }
				mo, _ := FlashModel(q.Q, row, q.Idx, sink, sched[0])
				ref := make([]float32, len(q.Q))
				attention.SparseAttn(ref, q.Q, kv, FlashDim, q.Idx, sink, flashScale)
				for i, g := range q.O {
					all.n++
					dr, dm := math.Abs(float64(g-ref[i])), math.Abs(float64(g-mo[i]))
					refAbs, modAbs = max(refAbs, dr), max(modAbs, dm)
					if g != ref[i] {
						all.refDiff++
					}
					if g != mo[i] {
						all.modDiff++
					}
					if quant.BF16ULPDistance(g, ref[i]) > 1 && dr > 1e-4 {
						all.refOver++
					}
					if quant.BF16ULPDistance(g, mo[i]) > 1 && dm > 1e-4 {
						all.modOver++
					}
				}
			}
		}
	}
	t.Logf("%d elements (synthetic and goldens): not bit-equal to the kernel: reference %d, FlashModel %d; beyond 1 ulp and 1e-4: reference %d, FlashModel %d; max |err| reference %.3g, FlashModel %.3g",
		all.n, all.refDiff, all.modDiff, all.refOver, all.modOver, refAbs, modAbs)
	if all.modOver*4 > all.refOver || modAbs >= refAbs {
		t.Errorf("FlashModel is not markedly closer to FlashMLA than the reference")
	}
}
