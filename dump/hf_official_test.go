package dump_test

import (
	"fmt"
	"math"
	"sort"
	"testing"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/indexer"
	"sparsemla/quant"
)

// TestHFDumpAgainstOfficialStages runs the official reference's stages on the
// HF eager dump, teacher-forced (each from the dumped inputs), wherever HF's
// dumped inputs are the official stage's inputs, and checks that every stage
// where the official value differs from HF's is reproduced by HF's own code
// (quoted in testdata/hf-v4-tiny/README.md), i.e. is a real difference of the
// two implementations, not a capture or replay error.
//
// The checkpoint is bf16 (ckpt_l01/model.safetensors, as HF ran it), so the
// official linear is model.py's bf16 path, `F.linear(x, weight)`: bf16(Σ w·x),
// fp32 accumulation (1 ulp allowed for the GEMM's sum order). The
// engine's own stages run for everything that does not read an FP8 weight:
// RMSNorm (cq, kv_normed), HeadRMS (q_pe_prerope), RoPE (kv_roped, with the
// dump's RoPE tables), FQ8 (kv) and wo_a (u). Not checked here (HF's dumped
// state is not the official one): the compressors, the indexer and the
// attention itself.
func TestHFDumpAgainstOfficialStages(t *testing.T) {
	d, err := dump.Open("../testdata/hf-v4-tiny/hf_eager")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ws, err := dump.OpenSafetensors("../testdata/hf-v4-tiny/ckpt_l01/model.safetensors")
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	// The header's ModelArgs: dtype bf16, a bf16 checkpoint.
	cfg, err := engine.ParseConfig([]byte(d.Header.ModelArgs))
	if err != nil || !cfg.BF16Checkpoint() {
		t.Fatalf("config: %v", err)
	}
	rope := map[string]*engine.RopeTable{}
	for _, name := range []string{"freqs_cis_r0", "freqs_cis_cmp"} {
		r, err := d.Get(dump.Key{Step: dump.NoStep, Layer: dump.Global, Stage: name}, dump.KindTable)
		if err != nil {
			t.Fatal(err)
		}
		f, err := r.Float32()
		if err != nil {
			t.Fatal(err)
		}
		rope[name] = attention.RopeTableFromCis(f, r.Shape[0], name)
	}
	wt := func(l int, name string) []float32 {
		f, _, err := ws.Float32(fmt.Sprintf("model.layers.%d.attn.%s", l, name))
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	// stats per stage: compared elements, official == dump, HF formula == dump (within tol)
	type st struct{ n, off, hf int }
	stats := map[string]*st{}
	note := func(stage string, dumped, official, hf []float32, ulps int32) {
		s := stats[stage]
		if s == nil {
			s = &st{}
			stats[stage] = s
		}
		if len(dumped) != len(official) || len(dumped) != len(hf) {
			t.Fatalf("%s: lengths dump %d, official %d, HF %d", stage, len(dumped), len(official), len(hf))
		}
		for i := range dumped {
			s.n++
			if dumped[i] == official[i] {
				s.off++
			}
			if quant.BF16ULPDistance(dumped[i], hf[i]) <= ulps {
				s.hf++
			}
		}
	}
	stage := func(l, p int, name string, in map[string]engine.Tensor, lw *engine.LayerWeights, rt *engine.RopeTable) []float32 {
		for _, def := range engine.Stages(cfg, l, int64(p)) {
			if def.Name == name {
				ctx := &engine.StepContext{Cfg: cfg, Layer: l, Pos: int64(p), W: lw, Rope: rt}
				out, err := def.Compute(ctx, in)
				if err != nil {
					t.Fatalf("L%d p%d %s: %v", l, p, name, err)
				}
				return out.F
			}
		}
		t.Fatalf("no stage %s", name)
		return nil
	}
	for l := 0; l <= 1; l++ {
		rt := rope["freqs_cis_r0"]
		if cfg.Ratio(l) > 0 {
			rt = rope["freqs_cis_cmp"]
		}
		lw := &engine.LayerWeights{Layer: l, Ratio: cfg.Ratio(l), QNorm: wt(l, "q_norm.weight"), KVNorm: wt(l, "norm.weight"), WoA: wt(l, "wo_a.weight")}
		lwCmp := lw
		if cfg.Ratio(l) == 4 {
			cmp := func(pre string, d int, rotate bool) *attention.Compressor {
				return &attention.Compressor{Ratio: 4, HeadDim: d, Dim: cfg.Dim, Rotate: rotate, Eps: float32(cfg.NormEps),
					Wkv: wt(l, pre+"wkv.weight"), Wgate: wt(l, pre+"wgate.weight"), Ape: wt(l, pre+"ape"), Norm: wt(l, pre+"norm.weight")}
			}
			c := *lw
			c.Compressor = cmp("compressor.", cfg.HeadDim, false)
			c.Indexer = &indexer.Indexer{NHeads: cfg.IndexNHeads, HeadDim: cfg.IndexHeadDim, TopK: cfg.IndexTopK,
				Compressor: cmp("indexer.compressor.", cfg.IndexHeadDim, true)}
			lwCmp = &c
		}
		for p := 2; p <= 5; p++ {
			g := func(name string) []float32 { return get(t, d, p, l, name) }
			T := func(name string, v []float32, shape ...int) map[string]engine.Tensor {
				if len(shape) == 0 {
					shape = []int{len(v)}
				}
				return map[string]engine.Tensor{name: engine.FromF(engine.KindBF16, v, shape...)}
			}
			x, qa, cq, qb, kvRaw, kvNormed := g("x"), g("q_a"), g("cq"), g("q_b"), g("kv_raw"), g("kv_normed")
			// linear stages: official bf16-checkpoint F.linear = HF's nn.Linear in bf16
			for _, c := range []struct {
				stage, w string
				in, out  []float32
			}{{"q_a", "wq_a.weight", x, qa}, {"q_b", "wq_b.weight", cq, qb}, {"kv_raw", "wkv.weight", x, kvRaw}, {"y", "wo_b.weight", g("u"), g("y")}} {
				ref := linearBF16(wt(l, c.w), c.in)
				note(c.stage, c.out, ref, ref, 1)
			}
			if cfg.Ratio(l) == 4 {
				ref := linearBF16(wt(l, "indexer.wq_b.weight"), cq)
				note("iq_b", g("iq_b"), ref, ref, 1)
				ref = linearBF16(wt(l, "indexer.weights_proj.weight"), x)
				note("iw_raw", g("iw_raw"), ref, ref, 1)
			}
			// RMSNorm: HF's bf16(w * bf16(y)) (TestHFDumpRMSNormRoundsTwice)
			note("cq", cq, stage(l, p, "cq", T("q_a", qa), lw, rt), hfRMSNorm(qa, lw.QNorm), 0)
			note("kv_normed", kvNormed, stage(l, p, "kv_normed", T("kv_raw", kvRaw), lw, rt), hfRMSNorm(kvRaw, lw.KVNorm), 0)
			// q head norm: HF's DeepseekV4UnweightedRMSNorm
			H, D, rd := cfg.NHeads, cfg.HeadDim, cfg.RopeHeadDim
			off := stage(l, p, "q_pe_prerope", T("q_b", qb, H, D), lw, rt)
			note("q_pe_prerope", g("q_pe_prerope"), off, hfHeadNorm(qb, H, D, rd), 0)
			// window K: HF's cache row p mod 128 is RoPE(kv_normed) with no FQ8
			kvc := g("kv_cache")
			row := kvc[(p%cfg.WindowSize)*D : (p%cfg.WindowSize+1)*D]
			roped := stage(l, p, "kv_roped", T("kv_normed", kvNormed), lw, rt)
			note("kv_roped", row, roped, roped, 0)
			kv := stage(l, p, "kv", map[string]engine.Tensor{"kv_roped": engine.FromF(engine.KindBF16, roped, len(roped))}, lw, rt)
			note("kv", row, kv, roped, 0)
			if cfg.Ratio(l) == 4 {
				// compressor projections: model.py's fp32 GEMM (Wkv · f32(x),
				// the engine's cmp_a) against HF's bf16 nn.Linear on bf16 x
				for _, c := range []struct{ stage, w string }{{"cmp_a", "compressor.wkv.weight"}, {"cmp_b", "compressor.wgate.weight"},
					{"icmp_a", "indexer.compressor.wkv.weight"}, {"icmp_b", "indexer.compressor.wgate.weight"}} {
					off := stage(l, p, c.stage, T("x", x), lwCmp, rt)
					note(c.stage, g(c.stage), off, linearBF16(wt(l, c.w), x), 1)
				}
			}
			// the cache after the step: the dumped cache before it with row
			// p mod 128 <- the window K and, at an emitting step of the CSA
			// layer, row 128 + p div 4 <- the compressed row RoPE(cmp_normed)
			// at position 4·(p div 4); model.py FQ8s the nope dims of both,
			// HF stores them as they are
			var prev []float32
			if p > 2 {
				prev = get(t, d, p-1, l, "kv_cache")
			} else {
				r, err := d.Get(dump.Key{Step: 1, Layer: l, Stage: "kv_cache"}, dump.KindState)
				if err != nil {
					t.Fatal(err)
				}
				prev, _ = r.Float32()
			}
			offC := append([]float32(nil), prev...)
			hfC := append([]float32(nil), prev...)
			copy(offC[(p%cfg.WindowSize)*D:], kv)
			copy(hfC[(p%cfg.WindowSize)*D:], roped)
			if cfg.Ratio(l) == 4 && (p+1)%4 == 0 {
				cr := stage(l, p, "cmp_roped", T("cmp_normed", g("cmp_normed")), lwCmp, rt)
				crow := stage(l, p, "cmp_row", map[string]engine.Tensor{"cmp_roped": engine.FromF(engine.KindBF16, cr, len(cr))}, lwCmp, rt)
				offC, hfC = append(offC, crow...), append(hfC, cr...)
			}
			note("kv_cache", kvc, offC, hfC, 0)
			// wo_a grouped projection of the dumped o_inv
			u := stage(l, p, "u", T("o_inv", g("o_inv"), H, D), lw, rt)
			note("u", g("u"), u, u, 1)
		}
	}
	// What the official stages give on HF's dumped inputs. A stage "agrees"
	// when every element is the official value (1 ulp for GEMMs); a
	// divergent stage must be HF's formula on every element.
	want := map[string]string{
		"q_a": "agree", "q_b": "agree", "kv_raw": "agree", "y": "agree", "iq_b": "agree", "iw_raw": "agree", "u": "agree",
		"cq": "agree", "kv_normed": "agree", // HF's double rounding is invisible with unit norm weights
		"kv_roped": "agree",
		"cmp_a":    "diverge", "cmp_b": "diverge", "icmp_a": "diverge", "icmp_b": "diverge", // bf16 nn.Linear vs model.py's fp32 GEMM
		"kv_cache":     "diverge", // no FQ8 of the window K and the compressed rows
		"q_pe_prerope": "diverge", // HF rounds the rsqrt factor once, model.py rounds every op
		"kv":           "diverge", // HF has no FQ8 of the window K
	}
	names := make([]string, 0, len(stats))
	for name := range stats {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		s := stats[name]
		t.Logf("%-13s %5d values: official %5d exact, HF formula %5d", name, s.n, s.off, s.hf)
		if s.hf != s.n {
			t.Errorf("%s: HF's formula reproduces %d of %d dumped values", name, s.hf, s.n)
		}
		got := "agree"
		if s.off != s.n {
			got = "diverge"
		}
		if name == "q_a" || name == "q_b" || name == "kv_raw" || name == "y" || name == "iq_b" || name == "iw_raw" || name == "u" {
			// GEMMs: compared within 1 ulp above (official == HF formula there)
			got = "agree"
		}
		if want[name] != got {
			t.Errorf("%s: the official stage %ss with HF's dump (%d of %d exact), expected to %s", name, got, s.off, s.n, want[name])
		}
	}
	if len(stats) != len(want) {
		t.Errorf("%d stages compared, want %d", len(stats), len(want))
	}
}

// linearBF16 is model.py's linear on a bf16 checkpoint, F.linear(x, w):
// y_i = bf16(Σ_j w_ij x_j) (accumulated here in float64).
func linearBF16(w, x []float32) []float32 {
	y := make([]float32, len(w)/len(x))
	for i := range y {
		var s float64
		for j, v := range x {
			s += float64(w[i*len(x)+j]) * float64(v)
		}
		y[i] = quant.BF16Round(float32(s))
	}
	return y
}

// hfRMSNorm is DeepseekV4RMSNorm.forward on a bf16 input with a bf16 weight:
// `hidden_states * torch.rsqrt(variance + eps)` in fp32, then
// `self.weight * hidden_states.to(input_dtype)` (a bf16 product).
func hfRMSNorm(x, w []float32) []float32 {
	var ss float32
	for _, v := range x {
		ss += v * v
	}
	r := float32(1 / math.Sqrt(float64(ss/float32(len(x))+1e-6)))
	y := make([]float32, len(x))
	for i, v := range x {
		y[i] = quant.BF16Round(w[i] * quant.BF16Round(v*r))
	}
	return y
}

// hfHeadNorm is DeepseekV4UnweightedRMSNorm per head, `x *
// torch.rsqrt(x.float().square().mean(-1, keepdim=True) +
// self.eps).to(x.dtype)`, returning the last rd dims of each head (the
// dumped q_pe_prerope).
func hfHeadNorm(q []float32, H, D, rd int) []float32 {
	out := make([]float32, 0, H*rd)
	for h := 0; h < H; h++ {
		qh := q[h*D : (h+1)*D]
		var ss float32
		for _, v := range qh {
			ss += v * v
		}
		r := quant.BF16Round(float32(1 / math.Sqrt(float64(ss/float32(D)+1e-6))))
		for _, v := range qh[D-rd:] {
			out = append(out, quant.BF16Round(v*r))
		}
	}
	return out
}

// TestHFDumpAttentionIsHFs reproduces the dumped o_inv (the input of HF's
// o_a_proj) from the dump's q_b and kv_cache with HF's eager attention, the
// code the official reference's o / o_inv differ from (the replay's o_inv
// divergence on this dump):
//
//	q = apply_rotary_pos_emb(q_b_norm(q_b))        DeepseekV4UnweightedRMSNorm, bf16 RoPE tables
//	attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling   bf16
//	combined_logits = torch.cat([attn_weights, sinks], dim=-1)                 fp32 (sinks kept fp32)
//	combined_logits = combined_logits - combined_logits.max(dim=-1, keepdim=True).values
//	probs = F.softmax(combined_logits, dim=-1, dtype=combined_logits.dtype)
//	attn_output = torch.matmul(probs[..., :-1].to(bf16), value_states)       bf16
//	o_inv = apply_rotary_pos_emb(attn_output, cos, -sin)
//
// over the window rows 0..p and (CSA layer, p >= 3) the one compressed row
// the indexer selects. Each step's K = V rows are the dumped cache after it.
func TestHFDumpAttentionIsHFs(t *testing.T) {
	d, err := dump.Open("../testdata/hf-v4-tiny/hf_eager")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ws, err := dump.OpenSafetensors("../testdata/hf-v4-tiny/ckpt_l01/model.safetensors")
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	tab := map[string][]float32{}
	for _, name := range []string{"freqs_cis_r0", "freqs_cis_cmp"} {
		r, err := d.Get(dump.Key{Step: dump.NoStep, Layer: dump.Global, Stage: name}, dump.KindTable)
		if err != nil {
			t.Fatal(err)
		}
		tab[name], _ = r.Float32()
	}
	const H, D, rd, W = 4, 512, 64, 128
	scaling := float32(1 / math.Sqrt(D))
	// rot is HF's apply_rotary_pos_emb on one rope slice: ((x.float() * cos) +
	// (rotate_half(x).float() * sin)).to(bf16), sign -1 for the inverse.
	rot := func(x []float32, table []float32, p int, sign float32) {
		for i := 0; i < rd/2; i++ {
			c, s := table[(p*32+i)*2], sign*table[(p*32+i)*2+1]
			x0, x1 := x[2*i], x[2*i+1]
			x[2*i] = quant.BF16Round(float32(x0*c) + float32(-x1*s))
			x[2*i+1] = quant.BF16Round(float32(x1*c) + float32(x0*s))
		}
	}
	var n, exact, within int
	var worst int32
	for l := 0; l <= 1; l++ {
		table := tab["freqs_cis_r0"]
		if l == 1 {
			table = tab["freqs_cis_cmp"]
		}
		sinks, _, err := ws.Float32(fmt.Sprintf("model.layers.%d.attn.attn_sink", l))
		if err != nil {
			t.Fatal(err)
		}
		for p := 2; p <= 5; p++ {
			qb, kvc, oinv := get(t, d, p, l, "q_b"), get(t, d, p, l, "kv_cache"), get(t, d, p, l, "o_inv")
			rows := [][]float32{}
			for j := 0; j <= p; j++ {
				rows = append(rows, kvc[(j%W)*D:(j%W+1)*D])
			}
			if l == 1 && p >= 3 {
				// the indexer's pick: the one compressed entry, valid from p = 3
				top, err := d.Get(dump.Key{Step: p, Layer: l, Stage: "index_topk"}, dump.KindStage)
				if err != nil {
					t.Fatal(err)
				}
				ti, _ := top.Int64()
				if len(ti) != 1 || ti[0] != 0 || len(kvc) != (W+1)*D {
					t.Fatalf("L1 p%d: index_topk %v, %d cache rows", p, ti, len(kvc)/D)
				}
				rows = append(rows, kvc[W*D:])
			}
			for h := 0; h < H; h++ {
				q := hfHeadNormAll(qb[h*D : (h+1)*D])
				rot(q[D-rd:], table, p, 1)
				logits := make([]float32, len(rows)+1)
				for j, k := range rows {
					logits[j] = quant.BF16Round(quant.BF16Round(dot32(q, k)) * scaling)
				}
				logits[len(rows)] = sinks[h]
				mx := logits[0]
				for _, v := range logits {
					mx = max(mx, v)
				}
				var sum float32
				e := make([]float32, len(logits))
				for j, v := range logits {
					e[j] = float32(math.Exp(float64(v - mx)))
					sum += e[j]
				}
				o := make([]float32, D)
				for c := 0; c < D; c++ {
					var acc float32
					for j, k := range rows {
						acc += float32(quant.BF16Round(e[j]/sum) * k[c])
					}
					o[c] = quant.BF16Round(acc)
				}
				rot(o[D-rd:], table, p, -1)
				for c, v := range o {
					g := oinv[h*D+c]
					n++
					dist := quant.BF16ULPDistance(v, g)
					if dist < 0 {
						dist = -dist
					}
					worst = max(worst, dist)
					if dist == 0 {
						exact++
					}
					if dist <= 1 || math.Abs(float64(v-g)) <= 1e-5 {
						within++
					}
				}
			}
		}
	}
	t.Logf("o_inv: %d values, %d bit-identical to HF's formula, %d within 1 ulp (or 1e-5), worst %d ulps", n, exact, within, worst)
	// GPU sum orders may differ from these loops by an ulp on a regenerated
	// fixture; this one matches bit for bit.
	if exact < n-n/1000 || within < n {
		t.Errorf("HF's eager attention reproduces %d of %d dumped o_inv values exactly, %d within 1 ulp", exact, n, within)
	}
}

// hfHeadNormAll is DeepseekV4UnweightedRMSNorm on one head (all dims).
func hfHeadNormAll(qh []float32) []float32 {
	var ss float32
	for _, v := range qh {
		ss += v * v
	}
	r := quant.BF16Round(float32(1 / math.Sqrt(float64(ss/float32(len(qh))+1e-6))))
	out := make([]float32, len(qh))
	for i, v := range qh {
		out[i] = quant.BF16Round(v * r)
	}
	return out
}

func dot32(a, b []float32) float32 {
	var s float32
	for i, x := range a {
		s += float32(x * b[i])
	}
	return s
}

// TestHFDumpCompressorPoolIsHFEager: engine.PolicyHFEager's compressor pool
// and norm reproduce HF's first compressed entries of layer 1 (CSA, r = 4)
// at step 3 from HF's own state — the raw token projections it buffers
// (hf_buffer_kv_* / hf_buffer_gate_* after step 2, tokens 0..2) laid into the
// official state layout (current group rows 4..7, score = gate + ape; the
// previous group empty: kv 0, score -inf, as HF's first window), plus step
// 3's cmp_a / cmp_b: the dumped cmp_normed and icmp_normed, element for
// element. (HF's pooled value itself is not hooked, only kv_norm's output.)
func TestHFDumpCompressorPoolIsHFEager(t *testing.T) {
	d, err := dump.Open("../testdata/hf-v4-tiny/hf_eager")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ws, err := dump.OpenSafetensors("../testdata/hf-v4-tiny/ckpt_l01/model.safetensors")
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	cfg, err := engine.ParseConfig([]byte(d.Header.ModelArgs))
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.SetPolicy(engine.PolicyHFEager); err != nil {
		t.Fatal(err)
	}
	const l, p = 1, 3
	wt := func(name string) []float32 {
		f, _, err := ws.Float32(fmt.Sprintf("model.layers.%d.attn.%s", l, name))
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	cmp := func(pre string, dd int, rotate bool) *attention.Compressor {
		return &attention.Compressor{Ratio: 4, HeadDim: dd, Dim: cfg.Dim, Rotate: rotate, Eps: float32(cfg.NormEps),
			Wkv: wt(pre + "wkv.weight"), Wgate: wt(pre + "wgate.weight"), Ape: wt(pre + "ape"), Norm: wt(pre + "norm.weight")}
	}
	lw := &engine.LayerWeights{Layer: l, Ratio: 4, Compressor: cmp("compressor.", cfg.HeadDim, false),
		Indexer: &indexer.Indexer{NHeads: cfg.IndexNHeads, HeadDim: cfg.IndexHeadDim, TopK: cfg.IndexTopK,
			Compressor: cmp("indexer.compressor.", cfg.IndexHeadDim, true)}}
	ctx := &engine.StepContext{Cfg: cfg, Layer: l, Pos: p, W: lw}
	defs := map[string]engine.StageDef{}
	for _, def := range engine.Stages(cfg, l, p) {
		defs[def.Name] = def
	}
	for _, c := range []struct {
		pre, buf string
		comp     *attention.Compressor
	}{{"cmp_", "compressor", lw.Compressor}, {"icmp_", "indexer", lw.Indexer.Compressor}} {
		w := c.comp.Width()
		bkv := get(t, d, p-1, l, "hf_buffer_kv_"+c.buf)
		bg := get(t, d, p-1, l, "hf_buffer_gate_"+c.buf)
		if len(bkv) != 3*w || len(bg) != 3*w {
			t.Fatalf("%s buffers: %d, %d values, want 3 tokens of %d", c.buf, len(bkv), len(bg), w)
		}
		kv := make([]float32, 8*w)
		score := make([]float32, 8*w)
		for i := range score {
			score[i] = float32(math.Inf(-1))
		}
		for tok := 0; tok < 3; tok++ {
			for j := 0; j < w; j++ {
				kv[(4+tok)*w+j] = bkv[tok*w+j]
				score[(4+tok)*w+j] = bg[tok*w+j] + c.comp.Ape[tok*w+j]
			}
		}
		in := map[string]engine.Tensor{
			engine.PrevPrefix + c.pre + "kv_state":    engine.FromF(engine.KindF32, kv, 8, w),
			engine.PrevPrefix + c.pre + "score_state": engine.FromF(engine.KindF32, score, 8, w),
			c.pre + "a": engine.FromF(engine.KindBF16, get(t, d, p, l, c.pre+"a"), w),
			c.pre + "b": engine.FromF(engine.KindBF16, get(t, d, p, l, c.pre+"b"), w),
		}
		pooled, err := defs[c.pre+"pooled"].Compute(ctx, in)
		if err != nil {
			t.Fatal(err)
		}
		normed, err := defs[c.pre+"normed"].Compute(ctx, map[string]engine.Tensor{c.pre + "pooled": pooled})
		if err != nil {
			t.Fatal(err)
		}
		want := get(t, d, p, l, c.pre+"normed")
		same := 0
		for i, v := range normed.F {
			if v == want[i] {
				same++
			}
		}
		// the official pool (fp32 weights, one rounding) on the same state
		off := *cfg
		off.Policy = ""
		var offDef engine.StageDef
		for _, def := range engine.Stages(&off, l, p) {
			if def.Name == c.pre+"pooled" {
				offDef = def
			}
		}
		op, err := offDef.Compute(&engine.StepContext{Cfg: &off, Layer: l, Pos: p, W: lw}, in)
		if err != nil {
			t.Fatal(err)
		}
		differ := 0
		for i, v := range op.F {
			if v != pooled.F[i] {
				differ++
			}
		}
		t.Logf("%snormed: %d of %d values are hf-eager's; the official pool differs from HF's on %d of %d", c.pre, same, len(want), differ, len(op.F))
		if same != len(want) {
			t.Errorf("%snormed: hf-eager reproduces %d of %d dumped values", c.pre, same, len(want))
		}
	}
}

// TestHFDumpRopeTables: HF's RoPE tables (as its forward uses them,
// DeepseekV4RotaryEmbedding returning `cos.to(dtype=x.dtype)` for the bf16
// inputs_embeds) are the config's tables with cos and sin rounded to bf16,
// every value; replay's rope_table check names that table.
func TestHFDumpRopeTables(t *testing.T) {
	d, err := dump.Open("../testdata/hf-v4-tiny/hf_eager")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	cfg, err := engine.ParseConfig([]byte(d.Header.ModelArgs))
	if err != nil {
		t.Fatal(err)
	}
	for l, name := range map[int]string{0: "freqs_cis_r0", 1: "freqs_cis_cmp"} {
		r, err := d.Get(dump.Key{Step: dump.NoStep, Layer: dump.Global, Stage: name}, dump.KindTable)
		if err != nil {
			t.Fatal(err)
		}
		f, err := r.Float32()
		if err != nil {
			t.Fatal(err)
		}
		tb := attention.RopeTableFromCis(f, r.Shape[0], name)
		ref := engine.LayerRope(cfg, l, tb.T)
		same, fp32 := 0, 0
		for i := range tb.Cos {
			if tb.Cos[i] == quant.BF16Round(ref.Cos[i]) && tb.Sin[i] == quant.BF16Round(ref.Sin[i]) {
				same++
			}
			if tb.Cos[i] == ref.Cos[i] && tb.Sin[i] == ref.Sin[i] {
				fp32++
			}
		}
		if same != len(tb.Cos) || fp32 > len(tb.Cos)/2 {
			t.Errorf("%s: %d of %d (cos, sin) are the config's rounded to bf16, %d the fp32 ones", name, same, len(tb.Cos), fp32)
		}
	}
}
