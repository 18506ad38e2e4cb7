package prodkernel

import (
	"path/filepath"
	"strings"
	"testing"

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
