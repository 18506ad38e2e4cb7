package replay

import (
	"context"
	"math"
	"strings"
	"testing"

	"sparsemla/engine"
	"sparsemla/indexer"
	"sparsemla/kvcache"
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
		"k_cache": true, "k_scale_cache": true, "iw": true, "index_weights": true, "o_latent": true, "y": true,
		"h_in": true, "x": true, "h_mid": true, "ffn_in": true, "ffn_out": true, "moe_indices": true}
	for _, mode := range []Mode{Local, Propagated} {
		rep, err := Run(context.Background(), m, src, Options{Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		if rep.Diverged() {
			t.Fatalf("%s: %s", mode, rep.First.Text)
		}
		// + one check of the GPU's RoPE table per layer against the config's;
		// steps 10..13 hold the whole layer (Block inputs x_in / res_in, the
		// norms, the FFN, the logits): x, h_mid, ffn_in, ffn_out on the dense
		// layer 0, h_in, x, h_mid, ffn_in, moe_indices, moe_weights, ffn_out on
		// the MoE layer 1, and the logits: 12 more stages per step
		const wholeSteps, wholeStages = 4, 4 + 7 + 1
		want := 12*2*nStages + m.Cfg.NLayers + wholeSteps*wholeStages
		// steps 10..13 run the whole layer, steps 14..21 (no x_in dumped) the
		// attention from the dumped x, in both modes
		missing, skipped := 0, 0
		if rep.Summary.Compared != want || rep.Summary.Missing != missing || rep.Summary.Skipped != skipped {
			t.Fatalf("%s: summary %+v, want %d stages compared, %d missing, %d skipped", mode, rep.Summary, want, missing, skipped)
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

// TestV32LatentCachePages: the official model.py rounds each latent row
// through act_quant (4 blocks of 128, power-of-two scales) before caching it,
// so the 656-byte V3.2 FP8 page entry (kvcache.LayoutV32: 512 E4M3, 4 fp32
// scales, 64 bf16 rope) holds the GPU's latent_cache rows losslessly: every
// row of the dump encodes and decodes back to the same bits.
func TestV32LatentCachePages(t *testing.T) {
	_, src := openReplayGolden(t, "v32-tiny")
	for l := 0; l < 2; l++ {
		lc, ok, err := src.Stage(21, l, "latent_cache")
		if !ok || err != nil {
			t.Fatalf("layer %d: latent_cache at step 21: %v", l, err)
		}
		T, D := lc.Shape[0], lc.Shape[1]
		f := kvcache.MustFormat(kvcache.LayoutV32, D, T)
		page := make([]byte, f.PageBytes())
		f.EncodePage(page, lc.F, kvcache.RefFP8)
		back := make([]float32, len(lc.F))
		if faults := f.DecodePage(back, page); len(faults) != 0 {
			t.Fatalf("layer %d: decode faults %v", l, faults)
		}
		for i := range back {
			if math.Float32bits(back[i]) != math.Float32bits(lc.F[i]) {
				t.Fatalf("layer %d: row %d dim %d: page gives %g, the GPU cached %g", l, i/D, i%D, back[i], lc.F[i])
			}
		}
		if got := len(page) / T; got != 656 {
			t.Errorf("%d bytes per entry, want 656", got)
		}
		// the bf16 latent before the FP8 round trip (the demo code before
		// 8631a81 cached that) does not survive the page
		kvn, _, _ := src.Stage(21, l, "kv_normed")
		pe, _, _ := src.Stage(21, l, "k_pe")
		row := append(append([]float32(nil), kvn.F...), pe.F...)
		one := kvcache.MustFormat(kvcache.LayoutV32, D, 1)
		pg := make([]byte, one.PageBytes())
		one.EncodePage(pg, row, kvcache.RefFP8)
		rb := make([]float32, D)
		one.DecodePage(rb, pg)
		same := true
		for i := range rb {
			same = same && rb[i] == row[i]
		}
		if same {
			t.Errorf("layer %d: the un-rounded latent survived the FP8 page: the test cannot tell the two apart", l)
		}
	}
}

// TestReplayV32PreFixCode: the V3.2-Exp demo code as first published
// (2305c7e), run on the same H200 with the same weights and tokens
// (testdata/v32-tiny-2305c7e), diverges from the reference exactly at the
// five stages its 2025-11-17 fix changed, and each is named by the
// hypothesis of the old form, bit for bit.
func TestReplayV32PreFixCode(t *testing.T) {
	m, src := openReplayGolden(t, "v32-tiny-2305c7e")
	rep, err := Run(context.Background(), m, src, Options{})
	if err != nil {
		t.Fatal(err)
	}
	d := rep.First
	if d == nil || d.Step != 16 || d.Layer != 0 || d.Stage != "kv_fq8" || d.Hypothesis == nil || d.Hypothesis.Best == nil ||
		!d.Hypothesis.Best.Exact || d.Hypothesis.Best.Name != "v32-latent-bf16" {
		t.Fatalf("first divergence %+v, want step 16 layer 0 kv_fq8 reproduced by v32-latent-bf16", d)
	}
	want := map[string]string{"kv_fq8": "v32-latent-bf16", "iq_roped": "v32-indexer-rope-interleaved",
		"ik_roped": "v32-indexer-rope-interleaved", "iw_raw": "v32-weights-proj-bf16", "o_latent": "v32-fp32-scores"}
	failed := map[string]bool{}
	for _, r := range rep.Results {
		if r.Status == StatusFail {
			failed[r.Stage] = true
		}
	}
	for s := range failed {
		if want[s] == "" {
			t.Errorf("stage %s diverged; only the five stages the fix changed should", s)
		}
	}
	const p, l = int64(18), 1
	ctx := &engine.StepContext{Cfg: m.Cfg, Layer: l, Pos: p, W: m.Weights[l], Rope: m.Rope[l]}
	for _, def := range engine.V32Stages(m.Cfg, l, p) {
		name, ok := want[def.Name]
		if !ok {
			continue
		}
		if !failed[def.Name] {
			t.Errorf("stage %s did not diverge", def.Name)
		}
		in := map[string]engine.Tensor{}
		for _, n := range def.Inputs {
			step, base := p, n
			if b, ok := strings.CutPrefix(n, engine.PrevPrefix); ok {
				step, base = p-1, b
			}
			v, ok, err := src.Stage(step, l, base)
			if !ok || err != nil {
				t.Fatalf("%s: input %s: %v", def.Name, n, err)
			}
			in[n] = v
		}
		ref, err := ComputeStage(def, ctx, in)
		if err != nil {
			t.Fatal(err)
		}
		gpu, _, _ := src.Stage(p, l, def.Name)
		v := attributeStage(DiagnoseInput{Model: m, Src: src, Def: def, Result: StageResult{Step: p, Layer: l, Stage: def.Name},
			Ref: ref, GPU: gpu, In: in})
		if v == nil || v.Best == nil || !v.Best.Exact || v.Best.Name != name {
			t.Errorf("step %d layer %d %s: verdict %+v, want %q bit for bit", p, l, def.Name, v, name)
		}
	}
}
