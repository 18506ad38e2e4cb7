package replay

import (
	"testing"

	"sparsemla/engine"
	"sparsemla/quant"
)

// TestV41WholeLocalChain: a whole synthetic V4.1 dump written by WriteV41Dir
// replays clean; a dump whose layer 4 input h_in is not layer 3's dumped
// h_out (one value moved by one bf16 step) diverges exactly there, as a
// hyper-connections divergence; a dump without the per-expert outputs
// replays with them as missing (computed) and still judges ffn_out.
func TestV41WholeLocalChain(t *testing.T) {
	cfg, err := engine.Preset("v41-tiny")
	if err != nil {
		t.Fatal(err)
	}
	m := engine.NewRandomV41WholeModel(cfg, 9, 13)
	pre := engine.SyntheticV41State(m, 10, 9)
	write := func(edit func(map[int64][]map[string]engine.Tensor)) *V41Dump {
		st := pre
		steps := map[int64][]map[string]engine.Tensor{}
		ik := map[int64]int{}
		for p := int64(10); p <= 11; p++ {
			ik[p] = st.IndexKAt
			res, err := engine.V41WholeStep(m, st, 3*p, p, nil)
			if err != nil {
				t.Fatal(err)
			}
			last := res.Stages[cfg.NLayers-1]
			last[engine.GlobalPrefix+"tok"] = engine.FromI(engine.KindI64, []int64{3 * p}, 1)
			for n, v := range res.Global {
				last[engine.GlobalPrefix+n] = v
			}
			steps[p], st = res.Stages, res.Next
		}
		if edit != nil {
			edit(steps)
		}
		dir := t.TempDir() + "/d"
		if err := WriteV41Dir(dir, m, pre, steps, ik, map[string]string{"producer": "test"}); err != nil {
			t.Fatal(err)
		}
		d, err := LoadV41Dir(dir)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	clean, err := V41Run(write(nil), V41Options{Mode: Local})
	if err != nil {
		t.Fatal(err)
	}
	if clean.Verdict != VerdictAgree || clean.Summary.Missing != 0 || clean.Coverage.Scope == "" {
		t.Fatalf("clean: %s", v41Text(clean))
	}
	broken := write(func(s map[int64][]map[string]engine.Tensor) {
		h := s[11][4]["h_in"].Clone()
		h.F[7] = quant.BF16Round(h.F[7] * (1 + 1.0/64))
		s[11][4]["h_in"] = h
	})
	rep, err := V41Run(broken, V41Options{Mode: Local})
	if err != nil {
		t.Fatal(err)
	}
	if f := rep.First; f == nil || f.Step != 11 || f.Layer != 4 || f.Stage != "h_in" || f.Kind != KindHyperConn {
		t.Errorf("h_in not layer 3's h_out: %s", v41Text(rep))
	}
	noExperts := write(func(s map[int64][]map[string]engine.Tensor) {
		for _, layers := range s {
			for _, st := range layers {
				delete(st, "moe_expert_out")
				delete(st, "moe_shared_out")
			}
		}
	})
	rep, err = V41Run(noExperts, V41Options{Mode: Local})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Verdict != VerdictAgree || rep.Summary.Missing != 2*2*cfg.NLayers {
		t.Errorf("without the expert outputs: %s", v41Text(rep))
	}
	n := 0
	for _, r := range rep.Results {
		if r.Stage == "ffn_out" && r.Status == StatusPass {
			n++
		}
	}
	if n != 2*cfg.NLayers {
		t.Errorf("ffn_out judged %d times, want %d", n, 2*cfg.NLayers)
	}
}
