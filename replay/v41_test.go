package replay

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/quant"
)

// The V4.1 golden (testdata/v41-tiny, README.md there): the official
// DeepSeek-V4.1 model.py attention code on an H200 with the v41-tiny
// structure, prefill 12 tokens, decode steps 12 … 15.
const v41Golden = "../testdata/v41-tiny"

// TestV41GoldenOfficial replays the golden in both modes and enforces the
// agreement measured there (testdata/v41-tiny/README.md): teacher-forced,
// every stage bit-exact except o (≤ 1 bf16 ulp) and the fp32 projections
// cmp_a / cmp_b (≤ 1e-6 of max); propagated also within V41Tolerance's
// tolerances; with OwnerIndexKeys instead of model.py's released index-key
// slot, the first divergence is layer 2's index_sel at step 12 (its r = 2
// group is open there, so model.py scores against layer 5's keys).
func TestV41GoldenOfficial(t *testing.T) {
	d, err := LoadV41Dir(v41Golden)
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range []Mode{Local, Propagated} {
		rep, err := V41Run(d, V41Options{Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s", v41Text(rep))
		if rep.First != nil || rep.Verdict != VerdictAgree {
			t.Errorf("%s: %s", mode, v41Text(rep))
		}
		var compared []string
		for _, r := range rep.Results {
			if r.Status == StatusPass {
				compared = append(compared, r.Stage)
			}
		}
		for _, want := range []string{"q_a", "cq", "q_b", "q", "kv_raw", "kv_normed", "kv", "window", "kv_cache", "o", "y",
			"cmp_a", "cmp_b", "cmp_raw", "cmp_latent", "cmp_kv_state", "ik_raw", "ik_normed", "icache", "iq_b", "iw_raw", "cand_mask", "index_sel", "topk_idxs"} {
			if !strings.Contains(","+strings.Join(compared, ",")+",", ","+want+",") {
				t.Errorf("%s: stage %s never compared", mode, want)
			}
		}
		if mode == Local {
			for _, r := range rep.Results {
				if r.Metrics != nil && r.Metrics.Mismatch != 0 && r.Stage != "o" && r.Stage != "cmp_a" && r.Stage != "cmp_b" {
					t.Errorf("local: step %d layer %d %s: %d of %d differ", r.Step, r.Layer, r.Stage, r.Metrics.Mismatch, r.Metrics.N)
				}
			}
		}
	}
	if len(rep0(t, d).Coverage.NotModelled) != 0 {
		t.Errorf("a tensor of the golden is not modelled: %v", rep0(t, d).Coverage.NotModelled)
	}
	d.Model.Options.OwnerIndexKeys = true
	rep, err := V41Run(d, V41Options{Mode: Local})
	if err != nil {
		t.Fatal(err)
	}
	if f := rep.First; f == nil || f.Step != 12 || f.Layer != 2 || f.Stage != "index_sel" {
		t.Errorf("owner keys: %s", v41Text(rep))
	}
	bad := 0
	for _, r := range rep.Results {
		if r.Status == StatusFail {
			bad++
			if r.Layer != 2 || r.Stage != "index_sel" || (r.Step != 12 && r.Step != 14) {
				t.Errorf("owner keys: unexpected divergence at step %d layer %d %s", r.Step, r.Layer, r.Stage)
			}
		}
	}
	if bad != 2 {
		t.Errorf("owner keys: %d divergences, want 2 (layer 2 at steps 12 and 14)", bad)
	}
}

// TestV41ReplayNamesCorruption: a copy of the golden with one value of layer
// 3's y at step 13 changed, one with layer 6's window list in V4's order at
// step 14, and one with layer 5's top-k rows at step 13 out of position
// order, diverge first exactly there.
func TestV41ReplayNamesCorruption(t *testing.T) {
	for _, c := range []struct {
		step  int64
		key   string
		edit  func(t *engine.Tensor)
		layer int
		stage string
		hyp   string
	}{
		{13, "L3.y", func(x *engine.Tensor) { x.F[7] = -x.F[7] - 1 }, 3, "y", ""},
		{14, "L6.topk_idxs", func(x *engine.Tensor) {
			// V4's order: the valid slots first, the −1 after them.
			var v, pad []int64
			for _, e := range x.I[:128] {
				if e < 0 {
					pad = append(pad, e)
				} else {
					v = append(v, e)
				}
			}
			copy(x.I, append(v, pad...))
		}, 6, "topk_idxs", "v4-window-order"},
		// the right set of rows, not sorted by position (index_sel is
		// compared as a set, and its order too)
		{13, "L5.index_sel", func(x *engine.Tensor) { x.I[0], x.I[1] = x.I[1], x.I[0] }, 5, "index_sel", ""},
	} {
		dir := t.TempDir()
		ents, _ := os.ReadDir(v41Golden)
		for _, e := range ents {
			b, err := os.ReadFile(filepath.Join(v41Golden, e.Name()))
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, e.Name()), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		f := filepath.Join(dir, "step_"+strconv.FormatInt(c.step, 10)+".safetensors")
		m, err := readV41Tensors(f)
		if err != nil {
			t.Fatal(err)
		}
		x := m[c.key]
		c.edit(&x)
		var recs []dump.Record
		for n, tt := range m {
			r := engine.TensorRecord(tt, dump.Key{Step: dump.NoStep, Layer: dump.Global, Stage: n}, dump.KindStage)
			r.Name = n
			recs = append(recs, r)
		}
		w, err := os.Create(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := dump.WriteSafetensors(w, recs, nil); err != nil {
			t.Fatal(err)
		}
		w.Close()
		d, err := LoadV41Dir(dir)
		if err != nil {
			t.Fatal(err)
		}
		rep, err := V41Run(d, V41Options{Mode: Local})
		if err != nil {
			t.Fatal(err)
		}
		if fd := rep.First; fd == nil || fd.Step != c.step || fd.Layer != c.layer || fd.Stage != c.stage || v41Hyp(fd) != c.hyp {
			t.Errorf("%s edited: %s", c.key, v41Text(rep))
		}
	}
}

func v41Text(r *Report) string {
	var b strings.Builder
	r.WriteText(&b)
	return b.String()
}

// v41Hyp is the hypothesis that reproduces the first divergence bit for bit
// ("" when none).
func v41Hyp(d *Divergence) string {
	if d.Hypothesis == nil || d.Hypothesis.Best == nil || !d.Hypothesis.Best.Exact {
		return ""
	}
	return d.Hypothesis.Best.Name
}

// TestV41Diff: the golden against itself agrees with the referee saying
// both are right; a copy whose attention input x differs (another run) is
// refused; a copy with one y value changed diverges exactly there.
func TestV41Diff(t *testing.T) {
	a, err := LoadV41Dir(v41Golden)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := V41Diff(a, a, nil)
	if err != nil || rep.Verdict != VerdictAgree || rep.Referee == nil || rep.Referee.Right != "both" {
		t.Fatalf("golden vs itself: %v %+v", err, rep)
	}
	b, err := LoadV41Dir(v41Golden)
	if err != nil {
		t.Fatal(err)
	}
	y := b.step[14]["L6.y"].Clone()
	y.F[3] = -y.F[3] - 1
	b.step[14]["L6.y"] = y
	rep, err = V41Diff(a, b, nil)
	if err != nil || rep.First == nil || rep.First.Step != 14 || rep.First.Layer != 6 || rep.First.Stage != "y" || rep.Referee.Right != "a" {
		t.Errorf("one y changed: %v %s", err, v41Text(rep))
	}
	x := b.step[13]["L0.x"].Clone()
	for i := range x.F {
		x.F[i] = -x.F[i]
	}
	b.step[13]["L0.x"] = x
	if _, err := V41Diff(a, b, nil); err == nil || !strings.Contains(err.Error(), "not of the same run") {
		t.Errorf("x negated: err = %v", err)
	}
}

func rep0(t *testing.T, d *V41Dump) *Report {
	t.Helper()
	rep, err := V41Run(d, V41Options{Mode: Local})
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// TestV41IKRawCompared: the golden's ik_raw (indexer.wk of the latent,
// before k_norm) is a stage of the reference: one value of it changed by
// one bf16 ulp is the first divergence, where it was changed (it used to be
// a tensor the reference did not model, never compared).
func TestV41IKRawCompared(t *testing.T) {
	d, err := LoadV41Dir(v41Golden)
	if err != nil {
		t.Fatal(err)
	}
	k := "L5.ik_raw"
	v, ok := d.step[13][k]
	if !ok {
		t.Fatalf("the golden has no %s at step 13", k)
	}
	v = v.Clone()
	v.F[7] = quant.BF16Next(v.F[7], 1)
	d.step[13][k] = v
	rep := rep0(t, d)
	if f := rep.First; f == nil || f.Step != 13 || f.Layer != 5 || f.Stage != "ik_raw" {
		t.Fatalf("first divergence %+v, want step 13 layer 5 ik_raw: %s", rep.First, v41Text(rep))
	}
}
