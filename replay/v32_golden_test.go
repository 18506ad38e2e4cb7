package replay

import (
	"context"
	"testing"

	"sparsemla/engine"
	"sparsemla/indexer"
)

// TestReplayV32GPUDumpAgrees: the GPU run of the official DeepSeek-V3.2-Exp
// model.py (testdata/v32-tiny, 8631a81) replays with zero divergences in
// local and propagated mode, every V3.2 stage of every step compared, and
// the stages measured bit-exact on it stay bit-exact (docs/v32-agreement.md).
func TestReplayV32GPUDumpAgrees(t *testing.T) {
	m, src := openReplayGolden(t, "v32-tiny")
	if !m.Cfg.V32() || !m.GPURope {
		t.Fatalf("v32-tiny: V3.2 %v, GPU RoPE table %v", m.Cfg.V32(), m.GPURope)
	}
	nStages := len(engine.V32Stages(m.Cfg, 0, 10))
	// measured on the dump: every value of these stages equals the GPU's
	exactOn := map[string]bool{"q_a": true, "qr": true, "q_b": true, "q_pe": true, "q_absorbed": true, "kv_a": true,
		"kv_fq8": true, "k_pe": true, "latent_cache": true, "iq_b": true, "iq_roped": true, "iq_had": true, "iq_fp8": true,
		"iq_scale": true, "ik_raw": true, "ik_normed": true, "ik_roped": true, "ik_had": true, "ik_fp8": true, "ik_scale": true,
		"k_cache": true, "k_scale_cache": true, "iw": true, "index_weights": true, "o_latent": true, "y": true}
	for _, mode := range []Mode{Local, Propagated} {
		rep, err := Run(context.Background(), m, src, Options{Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		if rep.Diverged() {
			t.Fatalf("%s: %s", mode, rep.First.Text)
		}
		// + one check of the GPU's RoPE table per layer against the config's
		if want := 12*2*nStages + m.Cfg.NLayers; rep.Summary.Compared != want || rep.Summary.Missing != 0 || rep.Summary.Skipped != 0 {
			t.Fatalf("%s: summary %+v, want %d stages compared", mode, rep.Summary, want)
		}
		for _, r := range rep.Results {
			if mode == Local && exactOn[r.Stage] && r.Metrics != nil && r.Metrics.Mismatch != 0 {
				t.Errorf("local: step %d layer %d %s: %d values differ from the GPU (bit-exact on this dump before)", r.Step, r.Layer, r.Stage, r.Metrics.Mismatch)
			}
			if r.Set != nil && (r.Set.Recall != 1 || r.Set.Jaccard != 1) {
				t.Errorf("%s: step %d layer %d %s: top-k set differs (recall %g)", mode, r.Step, r.Layer, r.Stage, r.Set.Recall)
			}
		}
	}
}

// TestV32IndexerRopeLayout: the official fix 8631a81 ("fix indexer rope")
// rotates the indexer's first 64 dims as non-interleaved pairs (i, i+32).
// On the GPU dump that form reproduces iq_roped and ik_roped bit for bit; the
// interleaved form of the earlier demo code (2305c7e) does not.
func TestV32IndexerRopeLayout(t *testing.T) {
	m, src := openReplayGolden(t, "v32-tiny")
	for _, c := range []struct{ in, out string }{{"iq_b", "iq_roped"}, {"ik_normed", "ik_roped"}} {
		for _, p := range []int64{10, 21} {
			in, ok1, err1 := src.Stage(p, 1, c.in)
			gpu, ok2, err2 := src.Stage(p, 1, c.out)
			if !ok1 || !ok2 || err1 != nil || err2 != nil {
				t.Fatalf("step %d: %s / %s missing (%v %v)", p, c.in, c.out, err1, err2)
			}
			fixed := append([]float32(nil), in.F...)
			indexer.V32RopeFirst(fixed, p, m.Rope[1])
			old := append([]float32(nil), in.F...)
			indexer.V32RopeFirstInterleaved(old, p, m.Rope[1])
			nFixed, nOld := 0, 0
			for i, g := range gpu.F {
				if fixed[i] != g {
					nFixed++
				}
				if old[i] != g {
					nOld++
				}
			}
			if nFixed != 0 || nOld == 0 {
				t.Errorf("step %d %s: non-interleaved form differs in %d values, interleaved in %d (want 0 and > 0)", p, c.out, nFixed, nOld)
			}
		}
	}
}
